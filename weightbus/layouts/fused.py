"""Inference-engine layouts: one vLLM-style rank, with fused parameters named and shaped as vLLM
holds them (names: see :mod:`weightbus.layouts.families`).

:func:`engine_layout` follows vLLM's parallel layers for the rank at ``(tp_rank, ep_rank)``:

* ``QKVParallelLinear`` ``qkv_proj`` = ``[q shard; k shard; v shard]`` along dim 0 (weights and
  biases alike). q heads split evenly over ``tp``. KV heads split evenly when
  ``tp <= num_key_value_heads``; when ``tp > num_key_value_heads`` each rank holds one KV head,
  ``tp_rank // (tp // num_key_value_heads)``, so every KV head is replicated on
  ``tp // num_key_value_heads`` ranks. Anything else (neither divides) is an error, as in vLLM.
* ``MergedColumnParallelLinear`` ``gate_up_proj`` = ``[gate shard; up shard]`` (dense MLPs and
  DeepSeek's shared experts); ``RowParallelLinear`` ``o_proj``/``down_proj`` split dim 1, their
  biases whole; norms, routers (``ReplicatedLinear``) and DeepSeek's float32
  ``e_score_correction_bias`` whole on every rank.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary is padded to a multiple of
  ``vocab_pad`` (vLLM's 64) and the padded rows split evenly over ``tp``; the padding rows at
  the end of the last shards belong to no piece. With tied embeddings there is no canonical
  ``lm_head`` and the one ``embed_tokens`` parameter serves both, as in vLLM.
* ``FusedMoE``: ``w13_weight`` is ``(E_local, 2 * I_shard, H)`` with expert ``j``'s
  ``[gate shard; up shard]`` at ``[j]``, ``w2_weight`` is ``(E_local, H, I_shard)``. With
  ``expert_placement="linear"`` experts are placed contiguously over ``ep`` ranks; when ``ep``
  does not divide the expert count the first ``E % ep`` ranks own one more (vLLM's linear
  placement). With ``"round_robin"`` rank ``r`` owns experts ``r, r + ep, r + 2 ep, ...`` in
  that order (vLLM's ``expert_placement_strategy="round_robin"``). The intermediate dim ``I``
  splits over ``moe_tp`` ranks (``I_shard = I / moe_tp``, part ``moe_tp_rank``). By default
  ``moe_tp`` is 1 with ``ep > 1`` (vLLM's FusedMoE runs with tp 1 under expert parallel) and
  ``tp`` with ``ep == 1``. Pass it for the other cases: vLLM with data parallel and no expert
  parallel shards experts over all ``tp * dp`` ranks (``moe_tp = tp * dp``, ``moe_tp_rank =
  dp_rank * tp + tp_rank``), and SGLang with ``ep`` dividing ``tp`` splits each expert over
  ``moe_tp = tp / ep`` ranks (``ep_rank = tp_rank // moe_tp``, ``moe_tp_rank = tp_rank %
  moe_tp``).
* DeepSeek multi-latent attention, as vLLM's ``DeepseekV2MLAAttention``: with ``q_lora_rank``
  the replicated ``fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``, without it a
  column-parallel ``q_proj`` and a replicated ``kv_a_proj_with_mqa``; ``q_a_layernorm`` and
  ``kv_a_layernorm`` replicated; ``q_b_proj`` and ``kv_b_proj`` column parallel by heads;
  ``o_proj`` row parallel by heads.

Local tensors have the model dtype, or ``dtype`` when given (tensors the family pins to another
dtype keep theirs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weightbus.layouts.families import CanonicalTensor, ModelSpec
from weightbus.layouts.megatron import Rows, check_rank, expert_range, round_up, shard
from weightbus.spec import Layout, Participant, dtype_name

__all__ = ["EXPERT_PLACEMENTS", "engine_layout", "expert_ids", "kv_head_range"]


def kv_head_range(num_kv_heads: int, tp: int, tp_rank: int) -> range:
    """The KV heads a vLLM tensor-parallel rank holds (replicated when ``tp > num_kv_heads``)."""
    check_rank("tp", tp, tp_rank)
    if tp >= num_kv_heads:
        if tp % num_kv_heads:
            raise ValueError(
                f"tp={tp} and num_key_value_heads={num_kv_heads}: vLLM needs one to divide the "
                f"other; pick a tp that divides {num_kv_heads} or is a multiple of it"
            )
        head = tp_rank // (tp // num_kv_heads)
        return range(head, head + 1)
    if num_kv_heads % tp:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} does not split evenly over tp={tp}: pick a tp "
            f"that divides {num_kv_heads} or is a multiple of it"
        )
    per = num_kv_heads // tp
    return range(tp_rank * per, (tp_rank + 1) * per)


def _box(
    model: ModelSpec, t: CanonicalTensor, tp: int, tp_rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The canonical box of ``t`` this tensor-parallel rank holds (not for vocab tensors)."""
    start, stop = [0] * len(t.shape), list(t.shape)
    if t.split == "replicated":
        pass
    elif t.group == "qkv" and t.role in ("k", "v"):
        heads = kv_head_range(model.num_kv_heads, tp, tp_rank)
        start[0], stop[0] = heads.start * t.unit, heads.stop * t.unit
    else:
        dim = t.dim
        assert dim is not None  # (only replicated tensors have none)
        start[dim], stop[dim] = shard(t, dim, tp, tp_rank, "tp")
    return tuple(start), tuple(stop)


def _vocab(rows: Rows, i: int, t: CanonicalTensor, tp: int, tp_rank: int, pad: int) -> None:
    vocab, hidden = t.shape
    padded = round_up(vocab, pad)
    if padded % tp:
        raise ValueError(
            f"{t.name}: vocab {vocab} padded to a multiple of vocab_pad={pad} is {padded} rows, "
            f"which do not split evenly over tp={tp}: pick a vocab_pad that is a multiple of {tp}"
        )
    per = padded // tp
    key = rows.local(rows.model.names.engine_name(t), (per, hidden), rows.local_dtype(t))
    lo, hi = tp_rank * per, min((tp_rank + 1) * per, vocab)
    if hi > lo:
        rows.piece(i, (lo, 0), (hi, hidden), key, (0, 0))


def _experts(rows: Rows, experts: np.ndarray, moe_tp: int, moe_tp_rank: int) -> None:
    """Every MoE layer's FusedMoE ``w13_weight`` and ``w2_weight``, as one array block.

    ``experts`` are the global expert ids this rank holds, in local order.
    """
    model = rows.model
    tensors, names = model.tensors, model.names
    moe = [layer for layer in model.layers if layer.moe]
    gate = tensors[moe[0].experts_start]
    inter, hidden = gate.shape
    lo, hi = shard(gate, 0, moe_tp, moe_tp_rank, "moe_tp")
    width = hi - lo
    n = len(experts)
    dtype = rows.local_dtype(gate)
    keys = np.array(
        [
            (
                rows.local(
                    names.engine_name(tensors[layer.experts_start]), (n, 2 * width, hidden), dtype
                ),
                rows.local(
                    names.engine_name(tensors[layer.experts_start + 2]), (n, hidden, width), dtype
                ),
            )
            for layer in moe
        ],
        np.int64,
    )
    # One expert's three rows (gate, up, down) as (3, 3) boxes, right-aligned: gate and up are
    # rows [lo, hi) of (I, H) at w13[j, 0 or width], down is columns [lo, hi) of (H, I) at w2[j].
    start = np.array([(0, lo, 0), (0, lo, 0), (0, 0, lo)], np.int64)
    stop = np.array([(1, hi, hidden), (1, hi, hidden), (1, hidden, hi)], np.int64)
    lstart = np.zeros((n, 3, 3), np.int64)
    lstart[:, :, 0] = np.arange(n)[:, None]
    lstart[:, 1, 1] = width
    bases = np.array([layer.experts_start for layer in moe], np.int64)
    t = bases[:, None, None] + 3 * experts[None, :, None] + np.arange(3)[None, None, :]
    count = len(moe) * n * 3
    rows.block(
        t.reshape(-1),
        np.broadcast_to(keys[:, None, [0, 0, 1]], (len(moe), n, 3)).reshape(-1),
        np.broadcast_to(start, (len(moe), n, 3, 3)).reshape(count, 3),
        np.broadcast_to(stop, (len(moe), n, 3, 3)).reshape(count, 3),
        np.broadcast_to(lstart, (len(moe), n, 3, 3)).reshape(count, 3),
    )


def _dense(model: ModelSpec, tp: int, tp_rank: int, vocab_pad: int, dtype: str | None) -> tuple:
    """Every piece but the routed experts' (the same on all ranks with this ``tp_rank``)."""
    rows = Rows(model, None, dtype)
    tensors, names = model.tensors, model.names
    _vocab(rows, model.embed, tensors[model.embed], tp, tp_rank, vocab_pad)
    for layer in model.layers:
        indices: Sequence[int] = range(layer.start, layer.stop)
        if layer.moe:
            indices = [
                *range(layer.start, layer.experts_start),
                *range(layer.experts_stop, layer.stop),
            ]
        # local key -> its pieces (member, tensor, box); fused members share one key
        held: dict[str, list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]] = {}
        for i in indices:
            t = tensors[i]
            start, stop = _box(model, t, tp, tp_rank)
            held.setdefault(names.engine_name(t), []).append((t.member, i, start, stop))
        for name, members in held.items():
            if len(members) > 1:
                members.sort()
            first = tensors[members[0][1]]
            _, _, start, stop = members[0]
            trailing = tuple(b - a for a, b in zip(start[1:], stop[1:], strict=True))
            total = sum(b[0] - a[0] for _, _, a, b in members)
            key = rows.local(name, (total, *trailing), rows.local_dtype(first))
            at = 0
            for _, i, start, stop in members:
                rows.piece(i, start, stop, key, (at,) + (0,) * len(trailing))
                at += stop[0] - start[0]
    norm = tensors[model.final_norm]
    key = rows.local(norm.name, norm.shape, rows.local_dtype(norm))
    rows.piece(model.final_norm, (0,), norm.shape, key, (0,))
    if model.lm_head is not None:
        _vocab(rows, model.lm_head, tensors[model.lm_head], tp, tp_rank, vocab_pad)
    return rows.snapshot()


def engine_layout(
    model: ModelSpec,
    participant: Participant,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
    vocab_pad: int = 64,
    dtype: str | None = None,
    moe_tp: int | None = None,
    moe_tp_rank: int | None = None,
    expert_placement: str = "linear",
) -> Layout:
    """The layout of the vLLM-style inference rank at ``(tp_rank, ep_rank)``.

    See the module docstring for every rule (``moe_tp``, ``moe_tp_rank`` and
    ``expert_placement`` under ``FusedMoE``). Raises ValueError, naming the tensor and the
    sizes, when ``tp`` or ``ep`` does not fit the model. Local tensors list the non-expert
    parameters in model order, then each MoE layer's ``w13_weight`` and ``w2_weight``.
    """
    if not isinstance(model, ModelSpec):
        raise TypeError(
            f"model must be a ModelSpec (weightbus.layouts.families.model_spec), got {type(model).__name__}"
        )
    if not isinstance(participant, Participant):
        raise TypeError(f"participant must be a Participant, got {type(participant).__name__}")
    check_rank("tp", tp, tp_rank)
    check_rank("ep", ep, ep_rank)
    if isinstance(vocab_pad, bool) or not isinstance(vocab_pad, int) or vocab_pad < 1:
        raise ValueError(f"vocab_pad must be a positive integer, got {vocab_pad!r}")
    if ep > 1 and not model.num_experts:
        raise ValueError(f"ep={ep} but {model.family} model has no experts: pass ep=1")
    dtype = None if dtype is None else dtype_name(dtype)
    # Ranks that share tp_rank share everything but their experts: 128 DeepSeek-V3 ranks at
    # tp 8 build the rest 8 times, not 128.
    dense = model.cached(
        ("engine_layout", tp, tp_rank, vocab_pad, dtype),
        lambda: _dense(model, tp, tp_rank, vocab_pad, dtype),
    )
    if (moe_tp is None) != (moe_tp_rank is None):
        raise ValueError(
            f"pass moe_tp and moe_tp_rank together (got moe_tp={moe_tp!r}, "
            f"moe_tp_rank={moe_tp_rank!r}), or neither for the default"
        )
    if moe_tp is None or moe_tp_rank is None:
        moe_tp, moe_tp_rank = (1, 0) if ep > 1 else (tp, tp_rank)
    check_rank("moe_tp", moe_tp, moe_tp_rank)
    rows = Rows(model, participant, dtype, base=dense)
    if model.num_experts:
        experts = expert_ids(model.num_experts, ep, ep_rank, expert_placement)
        _experts(rows, experts, moe_tp, moe_tp_rank)
    return rows.build()


EXPERT_PLACEMENTS = ("linear", "round_robin")
"""How experts are spread over expert-parallel ranks: contiguous blocks (``linear``), or
expert ``e`` on rank ``e % ep`` (``round_robin``)."""


def expert_ids(num_experts: int, ep: int, ep_rank: int, placement: str = "linear") -> np.ndarray:
    """The global ids of the experts expert-parallel rank ``ep_rank`` holds, in local order.

    ``"linear"``: a contiguous range, the first ``num_experts % ep`` ranks one expert more.
    ``"round_robin"``: ``ep_rank, ep_rank + ep, ...``.
    """
    if placement not in EXPERT_PLACEMENTS:
        raise ValueError(f"expert_placement={placement!r} is not one of {EXPERT_PLACEMENTS}")
    if placement == "round_robin":
        expert_range(num_experts, ep, ep_rank, even=False)  # the same checks
        return np.arange(ep_rank, num_experts, ep, dtype=np.int64)
    held = expert_range(num_experts, ep, ep_rank, even=False)
    return np.arange(held.start, held.stop, dtype=np.int64)
