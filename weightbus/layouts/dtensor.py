"""Layouts for DTensors: which region of the global tensor a mesh coordinate holds.

DTensor places a tensor on a device mesh by one placement per mesh dim, applied left to right:
``Replicate()`` keeps the dim whole, ``Shard(d)`` takes the ``r``-th ``torch.chunk`` of tensor
dim ``d`` (chunk size ``ceil(n / mesh size)``, so trailing ranks may get short or empty chunks),
and ``_StridedShard(d, split_factor=k)`` first chunks dim ``d`` into ``k`` groups, chunks each
group across the mesh dim and concatenates the ``r``-th chunk of every group. FSDP2 on top of
tensor parallelism produces ``[_StridedShard(d, k), Shard(d)]``; transformers' packed
``gate_up_proj`` produces ``[_StridedShard(d, 2)]`` on a 1-D mesh. ``Partial`` holds unreduced
partial sums, which no sync can read; it is rejected.

Most placements give one box per rank (:func:`shard_box`). ``_StridedShard`` can give several:
on 2 ranks with ``split_factor=2`` rank 0 holds rows ``[0:2]`` and ``[4:6]`` of 8. The local
tensor is still dense, so each run of consecutive global indices is one piece
(:func:`shard_regions`); nothing is ever mapped to a region it does not hold.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from weightbus.spec import BoundLayout, Box, LayoutBuilder, LayoutError, Participant, dtype_name

__all__ = [
    "add_tensor_pieces",
    "bind_dtensors",
    "local_regions",
    "shard_box",
    "shard_regions",
]

logger = logging.getLogger(__name__)

# A run of consecutive global indices along one tensor dim: (first global index, length).
_Run = tuple[int, int]


def _take(runs: list[_Run], start: int, stop: int) -> list[_Run]:
    """Positions ``[start, stop)`` of the index sequence that ``runs`` spell out, as runs."""
    out: list[_Run] = []
    pos = 0
    for first, length in runs:
        lo, hi = max(start, pos), min(stop, pos + length)
        if lo < hi:
            out.append((first + lo - pos, hi - lo))
        pos += length
        if pos >= stop:
            break
    return out


def _chunk(runs: list[_Run], n: int, r: int) -> list[_Run]:
    """The ``r``-th of ``n`` chunks, with ``torch.chunk`` sizes (ceil division, trailing may be empty)."""
    size = sum(length for _, length in runs)
    step = -(-size // n)
    return _take(runs, min(r * step, size), min((r + 1) * step, size))


def _merge(runs: list[_Run]) -> list[_Run]:
    out: list[_Run] = []
    for first, length in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((first, length))
    return out


def _describe(placements: Sequence[object]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _dim_runs(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
    name: str,
) -> list[list[_Run]]:
    """Per tensor dim, the global indices this coordinate holds, in local order, as runs."""
    shape = tuple(int(s) for s in global_shape)
    mesh = tuple(int(s) for s in mesh_shape)
    coord = tuple(int(c) for c in coordinate)
    where = f"{name} (shape {shape}, placements {_describe(placements)}, mesh {mesh})"
    if not len(mesh) == len(coord) == len(placements):
        raise ValueError(
            f"{where}: mesh shape {mesh}, coordinate {coord} and placements must have one entry "
            "per mesh dim"
        )
    for i, (c, m) in enumerate(zip(coord, mesh, strict=True)):
        if m < 1 or not 0 <= c < m:
            raise ValueError(f"{where}: coordinate {coord} is outside the mesh on mesh dim {i}")
    runs: list[list[_Run]] = [[(0, s)] if s else [] for s in shape]
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= d < len(shape):
                raise ValueError(f"{where}: {p!r} on mesh dim {i} names tensor dim {p.dim}")
            # _StridedShard subclasses Shard on older torch, so it is tested first.
            if isinstance(p, _StridedShard):
                k = int(p.split_factor)
                if k < 1:
                    raise ValueError(f"{where}: {p!r} has split_factor {k}; it must be >= 1")
                picked: list[_Run] = []
                for g in range(k):
                    picked += _chunk(_chunk(runs[d], k, g), mesh[i], coord[i])
                runs[d] = _merge(picked)
            else:
                runs[d] = _chunk(runs[d], mesh[i], coord[i])
        elif isinstance(p, Replicate):
            continue
        elif isinstance(p, Partial):
            raise LayoutError(
                f"{where}: mesh dim {i} is {p!r}, partial sums that no sync can read; "
                "redistribute first, e.g. tensor.redistribute(placements=[Replicate() or "
                "Shard(d) per mesh dim])"
            )
        else:
            raise TypeError(
                f"{where}: placement {p!r} on mesh dim {i} is not Shard, _StridedShard, "
                "Replicate or Partial"
            )
    return runs


def shard_regions(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
    *,
    name: str = "tensor",
) -> list[tuple[Box, Box]]:
    """The regions mesh coordinate ``coordinate`` holds, as ``(global box, local box)`` pairs.

    The local boxes tile the local tensor (shape: the per-dim sums of the box extents) in
    order; an empty shard gives ``[]``. One pair unless a ``_StridedShard`` splits a dim into
    several runs. Raises :class:`LayoutError` for ``Partial``.
    """
    return _regions(_dim_runs(global_shape, mesh_shape, coordinate, placements, name))


def _regions(runs: list[list[_Run]]) -> list[tuple[Box, Box]]:
    if any(not r for r in runs):
        return []
    per_dim = []
    for dim_runs in runs:
        local = itertools.accumulate((length for _, length in dim_runs), initial=0)
        per_dim.append(
            [(first, length, lo) for (first, length), lo in zip(dim_runs, local, strict=False)]
        )
    out = []
    for combo in itertools.product(*per_dim):
        shape = [length for _, length, _ in combo]
        start = [first for first, _, _ in combo]
        local_start = [lo for _, _, lo in combo]
        out.append((Box.at(start, shape), Box.at(local_start, shape)))
    return out


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
    *,
    name: str = "tensor",
) -> Box:
    """The box of the global tensor that mesh coordinate ``coordinate`` holds.

    An empty shard gives an empty box that starts, on each emptied dim, at the dim's global size
    (torch's convention). Raises :class:`LayoutError` when the region is not one box (a
    ``_StridedShard`` that leaves several runs; :func:`shard_regions` handles those) and for
    ``Partial``.
    """
    shape = tuple(int(s) for s in global_shape)
    runs = _dim_runs(shape, mesh_shape, coordinate, placements, name)
    empty = any(not dim_runs for dim_runs in runs)
    start, stop = [], []
    for d, dim_runs in enumerate(runs):
        if len(dim_runs) > 1 and not empty:
            raise LayoutError(
                f"{name} (shape {shape}, placements {_describe(placements)}, mesh "
                f"{tuple(mesh_shape)}): coordinate {tuple(coordinate)} holds {len(dim_runs)} "
                f"separate runs of dim {d} ({', '.join(f'{a}:{a + n}' for a, n in dim_runs)}), "
                "not one box; use shard_regions, which maps each run to its own piece"
            )
        first = dim_runs[0][0] if dim_runs else shape[d]
        start.append(first)
        stop.append(first + sum(length for _, length in dim_runs))
    return Box(tuple(start), tuple(stop))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _check_shard_order(name: str, t: DTensor) -> None:
    spec = t._spec
    order = getattr(spec, "shard_order", None)
    if order is None or getattr(spec, "use_strided_shard_as_shard_order", False):
        return
    compute = getattr(type(spec), "compute_default_shard_order", None)
    if compute is None:
        return
    default = compute(spec.placements)
    if tuple(order) != tuple(default):
        raise LayoutError(
            f"{name}: DTensor shards in the non-default order {order} (placements "
            f"{_describe(t.placements)}); weightbus reads placements left to right: redistribute "
            "it to the default order first"
        )


def local_regions(
    name: str, tensor: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...], list[tuple[Box, Box]]]:
    """``(live local tensor, global shape, [(global box, local box), ...])`` for one tensor.

    A plain tensor is whole: itself, its shape, one region covering it. A DTensor's local tensor
    is ``to_local()``, checked to share storage with the DTensor, so a reader writing into it
    writes the DTensor; its regions come from :func:`shard_regions` at this rank's coordinate
    (none when the rank is outside the mesh).
    """
    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape)
        return tensor, shape, [(Box.whole(shape), Box.whole(shape))]
    shape = tuple(tensor.shape)
    with torch.no_grad():
        local = tensor.to_local()
    if not _same_view(local, tensor._local_tensor):
        raise LayoutError(
            f"{name}: DTensor.to_local() returned a copy, not a view of the DTensor's storage, so "
            "writes would not reach it; pass the DTensor's local tensor yourself"
        )
    _check_shard_order(name, tensor)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return local, shape, []
    runs = _dim_runs(shape, tuple(mesh.shape), coordinate, tensor.placements, name)
    expected = tuple(sum(length for _, length in dim_runs) for dim_runs in runs)
    if expected != tuple(local.shape):
        hint = ""
        if any(isinstance(p, _StridedShard) for p in tensor.placements):
            # FSDP2 shards the TP-local tensor itself; on a dim that does not divide evenly its
            # data no longer matches what its _StridedShard placements describe.
            hint = (
                " (FSDP2 over tensor parallelism on a dim that does not divide evenly makes such "
                "DTensors: pad that dim to a multiple of dp * tp, or bind the trainer's full "
                "tensors instead)"
            )
        raise LayoutError(
            f"{name}: DTensor (shape {shape}, placements {_describe(tensor.placements)}, mesh "
            f"{tuple(mesh.shape)}) at coordinate {tuple(coordinate)} has a local tensor of shape "
            f"{tuple(local.shape)}, torch.chunk semantics give {expected}: the local shards were "
            f"not made the way distribute_tensor makes them{hint}; redistribute it"
        )
    return local, shape, _regions(runs)


def add_tensor_pieces(
    builder: LayoutBuilder,
    key: str,
    tensor: torch.Tensor,
    targets: Sequence[tuple[str, Box, Box]],
) -> torch.Tensor | None:
    """Declare local tensor ``key`` (plain or DTensor) and its pieces; return the live tensor.

    ``targets`` says what the *global* tensor is made of: ``(canonical name, canonical box,
    box of the global tensor)`` triples, already declared with ``builder.add_tensor``. The box
    of the global tensor may have extra leading dims of extent 1 (one expert inside a stacked
    expert tensor). Each target is cut by the regions this rank holds. Returns ``None``, adding
    nothing, when the rank holds no part of any target.
    """
    local, _, regions = local_regions(key, tensor)
    pieces = []
    for gbox, lbox in regions:
        for name, cbox, sbox in targets:
            inter = gbox.intersect(sbox)
            if inter is None:
                continue
            lead = sbox.ndim - cbox.ndim
            assert lead >= 0, (name, cbox, sbox)
            off = [a - b for a, b in zip(inter.start, sbox.start, strict=True)][lead:]
            start = [a + o for a, o in zip(cbox.start, off, strict=True)]
            local_start = [
                a + b - c for a, b, c in zip(lbox.start, inter.start, gbox.start, strict=True)
            ]
            pieces.append(
                (name, Box.at(start, inter.shape[lead:]), Box.at(local_start, inter.shape))
            )
    if not pieces:
        return None
    builder.add_local(key, tuple(local.shape), local.dtype)
    for name, box, local_box in pieces:
        builder.add_piece(name, box, key, local_box)
    return local


def bind_dtensors(named: Mapping[str, torch.Tensor], participant: Participant) -> BoundLayout:
    """A layout where each name is one canonical tensor, held as a DTensor shard or whole.

    DTensor values contribute the pieces this rank's coordinate holds, with ``to_local()`` as the
    live local tensor; plain tensors are whole. Local keys are the names.
    """
    builder = LayoutBuilder(participant)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{participant.name}: {name!r} is a {type(value).__name__}, not a tensor; pass "
                "only tensors (DTensor or plain)"
            )
        shape = tuple(value.shape)
        builder.add_tensor(name, shape, dtype_name(value.dtype))
        live = add_tensor_pieces(builder, name, value, [(name, Box.whole(shape), Box.whole(shape))])
        if live is not None:
            tensors[name] = live
    layout = builder.build()
    logger.debug(
        "%s: %d tensors, %d pieces", participant.name, len(layout.tensors), len(layout.pieces)
    )
    return BoundLayout(layout=layout, tensors=tensors)
