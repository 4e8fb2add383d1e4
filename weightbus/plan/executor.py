"""The reference executor: applies a plan with plain tensor copies between in-memory layouts.

It is the oracle every transport is tested against: same plan, same pack/unpack, no transport.
Also helpers to allocate and fill a layout's local tensors from full canonical tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightbus.plan.planner import TransferPlan
from weightbus.plan.program import build_program, pack, unpack
from weightbus.spec import Layout, torch_dtype

__all__ = ["allocate", "fill_from_canonical", "execute", "poison"]


def poison(t: torch.Tensor) -> None:
    """Overwrite a tensor with values a correct sync can never leave behind (NaN, or random)."""
    if t.is_floating_point() and t.element_size() >= 2:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.copy_(torch.randint(0, 2, t.shape, dtype=torch.bool))
    else:
        # fp8 and integers: random values, made where the tensor lives (an 8 GB FP8 engine
        # on a GPU took minutes through a CPU tensor of int64)
        raw = t.view(torch.int8) if t.element_size() == 1 else t
        low = -100 if raw.dtype.is_signed else 0
        raw.copy_(torch.randint(low, 100, raw.shape, dtype=raw.dtype, device=raw.device))


def allocate(
    layout: Layout, *, device: str | torch.device = "cpu", poisoned: bool = True
) -> dict[str, torch.Tensor]:
    """Fresh local tensors for a layout, poisoned (NaN) unless ``poisoned=False`` (zeros)."""
    out = {}
    for lt in layout.locals:
        t = torch.zeros(lt.shape, dtype=torch_dtype(lt.dtype), device=device)
        if poisoned:
            poison(t)
        out[lt.key] = t
    return out


def fill_from_canonical(
    layout: Layout, canonical: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Write each piece's region of the full canonical tensors into ``tensors`` (by local key)."""
    for p in layout.iter_pieces():
        dst = tensors[p.key][p.local_box.slices()]
        dst.copy_(canonical[p.tensor][p.box.slices()].reshape(dst.shape))


def execute(
    plan: TransferPlan,
    writer_tensors: Sequence[Mapping[str, torch.Tensor]],
    reader_tensors: Sequence[Mapping[str, torch.Tensor]],
) -> int:
    """Run the whole plan in this process; returns the bytes moved."""
    if len(writer_tensors) != len(plan.writers) or len(reader_tensors) != len(plan.readers):
        raise ValueError(
            f"plan has {len(plan.writers)} writers and {len(plan.readers)} readers, got tensors for "
            f"{len(writer_tensors)} and {len(reader_tensors)}"
        )
    w_ops = {
        op.bucket: (i, op)
        for i in range(len(plan.writers))
        for op in build_program(plan, "writer", i)
    }
    r_ops = {
        op.bucket: (i, op)
        for i in range(len(plan.readers))
        for op in build_program(plan, "reader", i)
    }
    moved = 0
    for b in range(len(plan.buckets)):
        wi, wop = w_ops[b]
        ri, rop = r_ops[b]
        buf = torch.empty(wop.nbytes, dtype=torch.uint8)
        pack(wop, writer_tensors[wi], buf)
        unpack(rop, reader_tensors[ri], buf)
        moved += wop.nbytes
    return moved
