"""Explicit Megatron-style parallelism for one trainer rank: tensor, pipeline and expert parallel.

:func:`megatron_layout` lists the pieces a rank at ``(tp_rank, pp_rank, ep_rank)`` holds, with
local tensors keyed by canonical name and shaped as that rank's shard:

* tensor parallel (``tp``): ``column`` tensors split dim 0 in ``tp`` equal parts, ``row``
  tensors dim 1, ``replicated`` ones stay whole (see :mod:`weightbus.layouts.families` for
  which is which). A cut may not go through an attention head: q/k/v need the head counts,
  MLA ``q_b_proj``/``kv_b_proj``/``o_proj`` the head count, to divide by ``tp``.
* vocab parallel: ``embed_tokens`` and ``lm_head`` are padded to a multiple of
  ``vocab_multiple * tp`` rows (Megatron's ``make_vocab_size_divisible_by`` rule, 128 by
  default) and split dim 0 evenly; the padding rows of the last shards belong to no piece.
* pipeline parallel (``pp``): stage ``s`` owns a contiguous range of layers (see
  :func:`pipeline_stages`: with ``L`` layers the first ``L % pp`` stages own one layer more,
  or pass ``layers_per_stage``). The first stage also owns ``embed_tokens``, the last the
  final norm and ``lm_head``. With tied embeddings and ``pp > 1`` the last stage also holds
  ``embed_tokens`` as its output layer, as Megatron keeps a copy there.
* expert parallel (``ep``): rank ``ep_rank`` owns experts ``[ep_rank * E / ep, (ep_rank + 1) *
  E / ep)`` of every MoE layer. With ``ep > 1`` experts are whole (expert tensor parallel 1);
  with ``ep == 1`` each expert is tensor parallel like a dense MLP (gate/up dim 0, down dim 1).
  Routers, DeepSeek's router bias and shared experts follow the dense rules.

``fuse_qkv=True`` holds each layer's q/k/v as Megatron-core's ``linear_qkv`` instead, keyed
``model.layers.N.self_attn.linear_qkv.weight`` (and ``.bias``): the rows are interleaved per
KV group, ``[q heads of group g, k head g, v head g]`` for ``g`` in the rank's groups, and tensor
parallel splits whole groups, so ``num_key_value_heads`` must divide by ``tp``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weightbus.layouts.families import CanonicalTensor, ModelSpec
from weightbus.spec import Layout, LocalTensor, Participant, PieceTable, dtype_name

__all__ = ["expert_range", "megatron_layout", "pipeline_stages"]

_COLS = 3  # stacked experts make local tensors at most 3-D; canonical tensors are at most 2-D


def check_rank(what: str, size: int, rank: int) -> None:
    """Raise ValueError unless ``size >= 1`` and ``0 <= rank < size``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{what} must be a positive integer, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{what}_rank must be in [0, {what}={size}), got {rank!r}")


def shard(t: CanonicalTensor, dim: int, parts: int, rank: int, why: str) -> tuple[int, int]:
    """The range of ``t``'s dim ``dim`` that part ``rank`` of ``parts`` equal parts holds.

    Parts are whole multiples of ``t.unit`` (a head); raises ValueError when they cannot be.
    """
    size = t.shape[dim]
    units = size // t.unit
    if units % parts:
        what = f"{units} heads of {t.unit}" if t.unit > 1 else f"{size}"
        raise ValueError(
            f"{t.name} {t.shape}: dim {dim} ({what}) does not split into {parts} equal parts "
            f"for {why}={parts}: pick a {why} that divides {units}"
        )
    step = size // parts
    return rank * step, (rank + 1) * step


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def expert_range(num_experts: int, ep: int, ep_rank: int, *, even: bool = True) -> range:
    """The contiguous experts expert-parallel rank ``ep_rank`` of ``ep`` owns.

    ``even`` requires ``ep`` to divide ``num_experts`` (Megatron); otherwise the first
    ``num_experts % ep`` ranks own one expert more (vLLM's linear placement).
    """
    check_rank("ep", ep, ep_rank)
    if ep > num_experts:
        raise ValueError(
            f"ep={ep} is larger than the {num_experts} experts: use ep <= {num_experts}"
        )
    base, extra = divmod(num_experts, ep)
    if even and extra:
        raise ValueError(
            f"{num_experts} experts do not split evenly over ep={ep}: pick an ep that divides "
            f"{num_experts}"
        )
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def pipeline_stages(
    num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None
) -> tuple[range, ...]:
    """The contiguous layer range of each of ``pp`` pipeline stages.

    By default the first ``num_layers % pp`` stages own ``num_layers // pp + 1`` layers and the
    rest ``num_layers // pp`` (61 layers over 4 stages: 16, 15, 15, 15). ``layers_per_stage``
    gives the counts explicitly; they must sum to ``num_layers``.
    """
    check_rank("pp", pp, 0)
    if layers_per_stage is None:
        if pp > num_layers:
            raise ValueError(
                f"pp={pp} is larger than the {num_layers} layers: use pp <= {num_layers}"
            )
        base, extra = divmod(num_layers, pp)
        counts = [base + (s < extra) for s in range(pp)]
    else:
        counts = [int(n) for n in layers_per_stage]
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(
                f"layers_per_stage {list(layers_per_stage)} must be {pp} non-negative counts "
                f"summing to num_layers={num_layers}"
            )
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return tuple(out)


class Rows:
    """Pieces of one layout, collected one row or one array block at a time.

    Rows are right-aligned to three columns (see :mod:`weightbus.spec`) and the table is cut
    down to the layout's ndim in :meth:`build`. Tensors are model indices until then; the
    layout lists only the canonical tensors it holds pieces of, in model order. A
    :meth:`snapshot` of rows shared by many ranks can seed another ``Rows``.
    """

    def __init__(
        self,
        model: ModelSpec,
        participant: Participant | None,
        dtype: str | None,
        base: tuple[tuple[LocalTensor, ...], tuple[np.ndarray, ...]] | None = None,
    ) -> None:
        self.model = model
        self.participant = participant
        self.dtype = None if dtype is None else dtype_name(dtype)
        self.locals: list[LocalTensor] = []
        self._keys: dict[str, int] = {}
        self._rows: list[tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
        self._blocks: list[tuple[np.ndarray, ...]] = []
        # LocalTensor objects are immutable and many ranks declare the same ones
        self._made: dict[tuple, LocalTensor] = model.cached("local_tensors", dict)
        if base is not None:
            self.locals.extend(base[0])
            self._keys = {x.key: k for k, x in enumerate(self.locals)}
            self._blocks.append(base[1])

    def local_dtype(self, t: CanonicalTensor) -> str:
        return self.model.local_dtype(t, self.dtype)

    def local(self, key: str, shape: tuple[int, ...], dtype: str) -> int:
        """Index of local tensor ``key``, declared on first use."""
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = len(self.locals)
            local = self._made.get((key, shape, dtype))
            if local is None:
                local = self._made[key, shape, dtype] = LocalTensor(
                    key=key, shape=shape, dtype=dtype
                )
            self.locals.append(local)
        else:
            old = self.locals[k]
            assert old.shape == tuple(shape) and old.dtype == dtype, (key, old, shape, dtype)
        return k

    def piece(
        self,
        t: int,
        start: tuple[int, ...],
        stop: tuple[int, ...],
        key: int,
        lstart: tuple[int, ...],
    ) -> None:
        """Box ``[start, stop)`` of model tensor ``t`` is at ``lstart`` in local ``key``."""
        pad = _COLS - len(start)
        self._rows.append(
            (t, key, (0,) * pad + start, (1,) * pad + stop, (0,) * (_COLS - len(lstart)) + lstart)
        )

    def block(
        self,
        t: np.ndarray,
        key: np.ndarray,
        start: np.ndarray,
        stop: np.ndarray,
        lstart: np.ndarray,
    ) -> None:
        """Many rows at once: ``t`` and ``key`` of shape (n,), the boxes (n, 3), right-aligned."""
        self._flush()
        self._blocks.append((t, key, start, stop, lstart))

    def _flush(self) -> None:
        if self._rows:
            t, k, a, b, la = zip(*self._rows, strict=True)
            self._blocks.append((np.array(t), np.array(k), np.array(a), np.array(b), np.array(la)))
            self._rows = []

    def columns(self) -> tuple[np.ndarray, ...]:
        """``(tensor, key, start, stop, local_start)`` of every row so far."""
        self._flush()
        if not self._blocks:
            z = np.zeros((0, _COLS), np.int64)
            return np.zeros(0, np.int64), np.zeros(0, np.int64), z, z, z
        if len(self._blocks) > 1:
            self._blocks = [tuple(np.concatenate(c) for c in zip(*self._blocks, strict=True))]
        return self._blocks[0]

    def snapshot(self) -> tuple[tuple[LocalTensor, ...], tuple[np.ndarray, ...]]:
        """The locals and rows so far, read-only, to seed other ``Rows`` with."""
        cols = tuple(c.copy() for c in self.columns())
        for c in cols:
            c.flags.writeable = False
        return tuple(self.locals), cols

    def build(self) -> Layout:
        assert self.participant is not None
        t, k, a, b, la = self.columns()
        used = np.unique(t)
        tensors = tuple(self.model.specs(used, self.dtype))
        # a local tensor has at least the dims of the boxes it holds, so this is also the
        # canonical tensors' maximum
        ndim = max([len(x.shape) for x in self.locals] + [1])
        cut = _COLS - ndim
        assert not cut or (
            (a[:, :cut] == 0).all() and (b[:, :cut] == 1).all() and (la[:, :cut] == 0).all()
        )
        return Layout(
            participant=self.participant,
            tensors=tensors,
            locals=tuple(self.locals),
            pieces=PieceTable(
                tensor=np.searchsorted(used, t),
                key=k,
                start=a[:, cut:],
                stop=b[:, cut:],
                local_start=la[:, cut:],
            ),
        )


def _whole(rows: Rows, i: int, t: CanonicalTensor) -> None:
    key = rows.local(t.name, t.shape, rows.local_dtype(t))
    rows.piece(i, (0,) * len(t.shape), t.shape, key, (0,) * len(t.shape))


def _split(rows: Rows, i: int, t: CanonicalTensor, dim: int, tp: int, tp_rank: int) -> None:
    lo, hi = shard(t, dim, tp, tp_rank, "tp")
    start = [0] * len(t.shape)
    stop = list(t.shape)
    start[dim], stop[dim] = lo, hi
    shape = tuple(b - a for a, b in zip(start, stop, strict=True))
    key = rows.local(t.name, shape, rows.local_dtype(t))
    rows.piece(i, tuple(start), tuple(stop), key, (0,) * len(shape))


def _vocab(rows: Rows, i: int, t: CanonicalTensor, tp: int, tp_rank: int, multiple: int) -> None:
    vocab, hidden = t.shape
    per = round_up(vocab, multiple * tp) // tp
    key = rows.local(t.name, (per, hidden), rows.local_dtype(t))
    lo, hi = tp_rank * per, min((tp_rank + 1) * per, vocab)
    if hi > lo:
        rows.piece(i, (lo, 0), (hi, hidden), key, (0, 0))


def _linear_qkv(rows: Rows, model: ModelSpec, q: int, tp: int, tp_rank: int) -> None:
    """q, k, v (weights or biases) as a shard of Megatron-core's interleaved ``linear_qkv``."""
    parent, _, param = model.tensors[q].name.rsplit(".", 2)
    qkv = (q, model.index(f"{parent}.k_proj.{param}"), model.index(f"{parent}.v_proj.{param}"))
    d, n_kv = model.head_dim, model.num_kv_heads
    if n_kv % tp:
        raise ValueError(
            f"{parent}: fuse_qkv splits whole KV groups, and num_key_value_heads={n_kv} does "
            f"not divide by tp={tp}: pick a tp that divides {n_kv}, or fuse_qkv=False"
        )
    q_per_group = model.num_heads // n_kv
    groups = n_kv // tp
    group_rows = (q_per_group + 2) * d
    trailing = model.tensors[q].shape[1:]
    key = rows.local(
        f"{parent}.linear_qkv.{param}",
        (groups * group_rows, *trailing),
        rows.local_dtype(model.tensors[q]),
    )
    zeros = (0,) * len(trailing)
    for j in range(groups):
        g = tp_rank * groups + j
        at = j * group_rows
        # (tensor, first row, rows): q heads of group g, then its k head, then its v head
        for i, lo, n in (
            (qkv[0], g * q_per_group * d, q_per_group * d),
            (qkv[1], g * d, d),
            (qkv[2], g * d, d),
        ):
            rows.piece(i, (lo, *zeros), (lo + n, *trailing), key, (at, *zeros))
            at += n


def megatron_layout(
    model: ModelSpec,
    participant: Participant,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
    layers_per_stage: Sequence[int] | None = None,
    vocab_multiple: int = 128,
    fuse_qkv: bool = False,
    dtype: str | None = None,
) -> Layout:
    """The layout of the Megatron-style trainer rank at ``(tp_rank, pp_rank, ep_rank)``.

    ``dtype`` is the dtype the trainer holds (its canonical tensors and local shards), for
    example float32 master weights; None keeps the model's. See the module docstring for the
    split rules, ``layers_per_stage`` and ``vocab_multiple``.
    """
    if not isinstance(model, ModelSpec):
        raise TypeError(
            f"model must be a ModelSpec (weightbus.layouts.families.model_spec), got {type(model).__name__}"
        )
    if not isinstance(participant, Participant):
        raise TypeError(f"participant must be a Participant, got {type(participant).__name__}")
    check_rank("tp", tp, tp_rank)
    check_rank("pp", pp, pp_rank)
    check_rank("ep", ep, ep_rank)
    if (
        isinstance(vocab_multiple, bool)
        or not isinstance(vocab_multiple, int)
        or vocab_multiple < 1
    ):
        raise ValueError(f"vocab_multiple must be a positive integer, got {vocab_multiple!r}")
    if fuse_qkv and model.mla:
        raise ValueError(
            f"fuse_qkv=True needs q/k/v projections; {model.family} has none (multi-latent "
            "attention): pass fuse_qkv=False"
        )
    if ep > 1 and not model.num_experts:
        raise ValueError(f"ep={ep} but {model.family} model has no experts: pass ep=1")
    experts = expert_range(model.num_experts, ep, ep_rank) if model.num_experts else range(0)
    stage = pipeline_stages(model.num_layers, pp, layers_per_stage)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1

    rows = Rows(model, participant, dtype)
    tensors = model.tensors

    def add(i: int) -> None:
        t = tensors[i]
        split = t.split
        if split == "replicated" or (t.expert is not None and ep > 1):
            _whole(rows, i, t)
        elif split == "vocab":
            _vocab(rows, i, t, tp, tp_rank, vocab_multiple)
        else:
            assert t.dim is not None  # (only replicated tensors have none)
            _split(rows, i, t, t.dim, tp, tp_rank)

    if first or (last and model.tie_word_embeddings):
        add(model.embed)
    for layer in model.layers[stage.start : stage.stop]:
        indices: Sequence[int] = range(layer.start, layer.stop)
        if layer.moe:
            own = range(
                layer.experts_start + 3 * experts.start, layer.experts_start + 3 * experts.stop
            )
            indices = [
                *range(layer.start, layer.experts_start),
                *own,
                *range(layer.experts_stop, layer.stop),
            ]
        for i in indices:
            t = tensors[i]
            if fuse_qkv and t.group == "qkv":
                if t.member == 0:
                    _linear_qkv(rows, model, i, tp, tp_rank)
            else:
                add(i)
    if last:
        add(model.final_norm)
        if model.lm_head is not None:
            add(model.lm_head)
    return rows.build()
