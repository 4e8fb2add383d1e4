"""Per-participant programs: the copies one writer packs, or one reader unpacks, per bucket.

Built once from a plan (at connect); a sync only replays them. The reference executor and the
transports' Writer/Reader run the same :func:`pack` and :func:`unpack`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightbus.plan.planner import TransferPlan
from weightbus.spec import torch_dtype

__all__ = ["BucketCopier", "BucketOp", "Copy", "build_program", "direct_view", "pack", "unpack"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Copy:
    """One route as seen from one side: a region of a local tensor <-> bytes of a bucket."""

    key: str
    """Local tensor key."""
    index: tuple[slice, ...]
    """The region of the local tensor."""
    shape: tuple[int, ...]
    """Shape of that region (the bytes in the bucket have this shape in ``dtype``)."""
    offset: int
    nbytes: int
    dtype: torch.dtype
    """Wire dtype."""
    tensor: str
    """Canonical tensor name, for messages."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketOp:
    """Everything one participant does for one bucket."""

    bucket: int
    peer: int
    """Reader index (for a writer's op) or writer index (for a reader's op)."""
    peer_global: int
    """The peer's index among all participants: writers first, then readers."""
    wave: int
    nbytes: int
    copies: tuple[Copy, ...]


def build_program(plan: TransferPlan, role: str, index: int) -> tuple[BucketOp, ...]:
    """The bucket ops of writer or reader ``index``, in execution order."""
    if role not in ("writer", "reader"):
        raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
    layout = (plan.writers if role == "writer" else plan.readers)[index]
    routes, buckets = plan.routes, plan.buckets
    key_col, local_col = (
        (routes.src_key, routes.src_local)
        if role == "writer"
        else (routes.dst_key, routes.dst_local)
    )
    peer_col = buckets.dst if role == "writer" else buckets.src
    wire = [torch_dtype(t.dtype) for t in plan.tensors]
    ops = []
    for b in plan.buckets_of(role, index).tolist():
        lo, hi = int(buckets.first[b]), int(buckets.first[b] + buckets.count[b])
        copies = []
        extent = routes.stop[lo:hi] - routes.start[lo:hi]
        for i, r in enumerate(range(lo, hi)):
            local = layout.locals[int(key_col[r])]
            nd = len(local.shape)
            start = local_col[r][local_col.shape[1] - nd :]
            ext = extent[i][extent.shape[1] - nd :]
            copies.append(
                Copy(
                    key=local.key,
                    index=tuple(slice(int(a), int(a + e)) for a, e in zip(start, ext, strict=True)),
                    shape=tuple(int(e) for e in ext),
                    offset=int(routes.offset[r]),
                    nbytes=int(routes.nbytes[r]),
                    dtype=wire[int(routes.tensor[r])],
                    tensor=plan.tensors[int(routes.tensor[r])].name,
                )
            )
        ops.append(
            BucketOp(
                bucket=b,
                peer=int(peer_col[b]),
                peer_global=int(peer_col[b]) + (len(plan.writers) if role == "writer" else 0),
                wave=int(buckets.wave[b]),
                nbytes=int(buckets.nbytes[b]),
                copies=tuple(copies),
            )
        )
    return tuple(ops)


def direct_view(op: BucketOp, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The live bytes of a bucket that can travel in place (no staging), else None: its routes
    are contiguous regions of one local tensor, already in the wire dtype, that lie in memory
    as they lie in the bucket (one route; or a tensor cut into several routes of one bucket,
    as the planner cuts them with ``route_bytes``)."""
    if not op.copies or len({c.key for c in op.copies}) != 1:
        return None
    end = 0
    for c in sorted(op.copies, key=lambda c: c.offset):
        if c.offset != end:
            return None  # a gap (routes padded to 128 bytes) or an overlap in the bucket
        end += c.nbytes
    if end != op.nbytes:
        return None
    base = tensors[op.copies[0].key]
    start = None
    for c in op.copies:
        view = base[c.index]
        if view.dtype != c.dtype or not view.is_contiguous():
            return None
        at = view.data_ptr() - c.offset  # where the bucket's first byte would lie
        if start is not None and at != start:
            return None
        start = at
    if len(op.copies) == 1:
        return base[op.copies[0].index].reshape(-1).view(torch.uint8)
    # the routes fill the bucket end to end, each where the bucket's bytes would lie, so
    # they fill [start, start + nbytes) of the tensor's memory: that range, as bytes
    assert start is not None  # (op.copies is not empty)
    storage = base.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=base.device).set_(storage)
    begin = start - storage.data_ptr()
    return raw[begin : begin + op.nbytes]


class BucketCopier:
    """:func:`pack` and :func:`unpack`, compiled per bucket on CUDA: the first time a bucket
    is packed from (or unpacked into) a buffer, its routes become one Triton copy table (see
    :mod:`weightbus.plan._copy_triton`), and every later time one launch copies them all;
    casts and odd strides keep ``copy_``. The live tensors must stay in place (sessions check
    it every sync); one copier serves one set of buffers (a session's epoch).
    ``$WEIGHTBUS_COPY_KERNELS=0`` turns the kernels off (``copy_`` per route everywhere)."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, tuple] = {}
        self._triton: Any = None  # the kernels' module once imported; False without Triton

    def pack(self, op: BucketOp, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor) -> None:
        """As :func:`pack`."""
        self._run(op, tensors, buf, True)

    def unpack(self, op: BucketOp, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor) -> None:
        """As :func:`unpack`."""
        self._run(op, tensors, buf, False)

    @torch.no_grad()
    def _run(self, op, tensors, buf, packing: bool) -> None:
        if buf.device.type != "cuda" or os.environ.get("WEIGHTBUS_COPY_KERNELS") == "0":
            (pack if packing else unpack)(op, tensors, buf)
            return
        key = (id(op), id(tensors), buf.data_ptr(), packing)
        entry = self._compiled.get(key)
        if entry is None or entry[0] is not op or entry[1] is not tensors:
            entry = self._compiled[key] = (op, tensors, *self._compile(op, tensors, buf, packing))
        _, _, table, rest = entry
        if table is not None:
            table.run()
        for region, wire in rest:
            if packing:
                wire.copy_(region)
            else:
                region.copy_(wire)

    def _compile(self, op, tensors, buf, packing: bool):
        if self._triton is None:
            try:
                from weightbus.plan import _copy_triton
            except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
                self._triton = False
            else:
                self._triton = _copy_triton
        kernel, rest = [], []
        for c in op.copies:
            region, wire = tensors[c.key][c.index], _wire_view(buf, c)
            words = self._triton.words(region) if self._triton else None
            fits = words is not None and region.dtype == c.dtype and region.is_cuda
            if fits and self._triton.blocks(words) is not None:
                kernel.append((region, wire))
            else:
                rest.append((region, wire))
        table = self._triton.CopyTable(kernel, pack=packing) if kernel else None
        return table, tuple(rest)


def _wire_view(buf: torch.Tensor, c: Copy) -> torch.Tensor:
    return buf[c.offset : c.offset + c.nbytes].view(c.dtype).view(c.shape)


@torch.no_grad()
def pack(op: BucketOp, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor) -> None:
    """Copy (and cast) a writer's regions into the bucket's bytes ``buf`` (uint8, contiguous)."""
    for c in op.copies:
        _wire_view(buf, c).copy_(tensors[c.key][c.index])


@torch.no_grad()
def unpack(op: BucketOp, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor) -> None:
    """Copy (and cast) the bucket's bytes into a reader's live tensors, in place (parameters
    that require grad included: the engine's autograd state is not touched)."""
    for c in op.copies:
        tensors[c.key][c.index].copy_(_wire_view(buf, c))
