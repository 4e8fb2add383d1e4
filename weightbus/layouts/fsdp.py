"""FSDP2-style trainer layouts from a model description, optionally with expert parallelism.

For planning and simulation without running the trainer (``weightbus plan``, the planner's scale
bench). A running FSDP2 trainer gives its real layout through :mod:`weightbus.layouts.dtensor`.

The rank at ``(ep_rank, shard_rank)`` of an ``ep x shard`` mesh holds:

* every dense tensor (everything but routed experts) cut along dim 0 into ``shard`` chunks the
  way ``torch.chunk`` and FSDP2's ``Shard(0)`` cut it (chunks of ``ceil(n / shard)`` rows, the
  last ones shorter or empty), chunk ``shard_rank``; the ``ep`` groups hold identical copies
  (hybrid sharding: replicated across expert-parallel groups);
* the routed experts of expert-parallel rank ``ep_rank`` (contiguous ranges, as
  :func:`weightbus.layouts.megatron.expert_range` places them), stacked per layer and
  projection into 3-D tensors ``(E_local, out, in)`` named ``<layer>.mlp.experts.gate_proj``
  (``up_proj``, ``down_proj``; the family's own leaf names), each cut along dim 1 into
  ``shard`` chunks like the dense tensors. Stacked, dim-1-sharded experts are how FSDP2 trainers
  with expert parallelism keep them when experts outnumber nothing per rank (torchtitan's
  grouped experts).
"""

from __future__ import annotations

import numpy as np

from weightbus.layouts.families import ModelSpec
from weightbus.layouts.megatron import check_rank, expert_range
from weightbus.spec import Layout, LocalTensor, Participant, PieceTable

__all__ = ["chunk_range", "fsdp_layout"]

_COLS = 3


def chunk_range(n: int | np.ndarray, parts: int, index: int):
    """``torch.chunk`` rows ``[lo, hi)`` of chunk ``index`` of ``n`` rows in ``parts``."""
    size = -(-n // parts)
    lo = np.minimum(index * size, n)
    hi = np.minimum(lo + size, n)
    return lo, hi


def _dense(model: ModelSpec, shard: int, shard_rank: int, dtype: str | None):
    """Dense pieces of one shard rank: the same for every expert-parallel group, so cached."""
    cache_key = ("fsdp-dense", shard, shard_rank, dtype)
    hit = model._cache.get(cache_key)
    if hit is not None:
        return hit
    idx = np.array([i for i, t in enumerate(model.tensors) if t.expert is None], np.int64)
    shapes = np.ones((len(idx), _COLS), np.int64)
    for row, i in enumerate(idx.tolist()):
        s = model.tensors[i].shape
        shapes[row, _COLS - len(s) :] = s
    ndims = np.array([len(model.tensors[i].shape) for i in idx.tolist()], np.int64)
    dim0 = _COLS - ndims
    n0 = shapes[np.arange(len(idx)), dim0]
    lo, hi = chunk_range(n0, shard, shard_rank)
    keep = hi > lo
    idx, shapes, dim0, lo, hi = idx[keep], shapes[keep], dim0[keep], lo[keep], hi[keep]
    start = np.zeros_like(shapes)
    stop = shapes.copy()
    rows = np.arange(len(idx))
    start[rows, dim0] = lo
    stop[rows, dim0] = hi
    locals_ = []
    for row, i in enumerate(idx.tolist()):
        t = model.tensors[i]
        shape = list(t.shape)
        shape[0] = int(hi[row] - lo[row])
        locals_.append(
            LocalTensor(key=t.name, shape=tuple(shape), dtype=model.local_dtype(t, dtype))
        )
    hit = model._cache[cache_key] = (idx, start, stop, locals_)
    return hit


def _experts(model: ModelSpec, shard: int, shard_rank: int, n: int, dtype: str | None):
    """Expert pieces for ``n`` experts per layer starting at expert 0, all MoE layers at once.

    The same for every expert-parallel rank that owns ``n`` experts: the caller shifts the
    tensor indices by its first expert. Cached.
    """
    cache_key = ("fsdp-experts", shard, shard_rank, n, dtype)
    hit = model._cache.get(cache_key)
    if hit is not None:
        return hit
    layers = [layer for layer in model.layers if layer.moe]
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    locals_: list[LocalTensor] = []
    j = np.arange(n, dtype=np.int64)
    for layer in layers:
        gate = model.tensors[layer.experts_start]
        inter, hidden = gate.shape
        prefix = gate.name[: gate.name.rindex(".experts.")]
        for k, leaf in enumerate(model.names.expert_leaves):
            rows_out, cols_in = (inter, hidden) if k < 2 else (hidden, inter)
            lo, hi = chunk_range(rows_out, shard, shard_rank)
            if hi <= lo:
                continue
            a = np.zeros((n, _COLS), np.int64)
            b = np.ones((n, _COLS), np.int64)
            a[:, 1], b[:, 1], b[:, 2] = lo, hi, cols_in
            la = np.zeros((n, _COLS), np.int64)
            la[:, 0] = j
            for col, v in zip(
                cols,
                (layer.experts_start + 3 * j + k, np.full(n, len(locals_), np.int64), a, b, la),
                strict=True,
            ):
                col.append(v)
            locals_.append(
                LocalTensor(
                    key=f"{prefix}.experts.{leaf}",
                    shape=(n, int(hi - lo), cols_in),
                    dtype=model.local_dtype(gate, dtype),
                )
            )
    empty = (np.zeros(0, np.int64),) * 2 + (np.zeros((0, _COLS), np.int64),) * 3
    arrays = tuple(np.concatenate(c) if c else e for c, e in zip(cols, empty, strict=True))
    hit = model._cache[cache_key] = (*arrays, locals_)
    return hit


def fsdp_layout(
    model: ModelSpec,
    participant: Participant,
    *,
    shard: int,
    shard_rank: int,
    ep: int = 1,
    ep_rank: int = 0,
    dtype: str | None = None,
) -> Layout:
    """The layout of trainer rank ``(ep_rank, shard_rank)``; see the module docstring."""
    check_rank("shard", shard, shard_rank)
    check_rank("ep", ep, ep_rank)
    idx, start, stop, dense_locals = _dense(model, shard, shard_rank, dtype)
    t_cols, k_cols = [idx], [np.arange(len(idx))]
    a_cols, b_cols, l_cols = [start], [stop], [np.zeros_like(start)]
    locals_ = list(dense_locals)
    if any(layer.moe for layer in model.layers):
        experts = expert_range(model.num_experts, ep, ep_rank)
        if len(experts):
            t, k, a, b, la, expert_locals = _experts(model, shard, shard_rank, len(experts), dtype)
            t_cols.append(t + 3 * experts.start)
            k_cols.append(k + len(locals_))
            a_cols.append(a)
            b_cols.append(b)
            l_cols.append(la)
            locals_.extend(expert_locals)
    t = np.concatenate(t_cols)
    used = np.unique(t)
    return Layout(
        participant=participant,
        tensors=tuple(model.specs(used, dtype)),
        locals=tuple(locals_),
        pieces=PieceTable(
            tensor=np.searchsorted(used, t),
            key=np.concatenate(k_cols),
            start=np.concatenate(a_cols),
            stop=np.concatenate(b_cols),
            local_start=np.concatenate(l_cols),
        ),
    )
