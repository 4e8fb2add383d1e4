"""A reference of how vLLM and SGLang load a Hugging Face checkpoint into one rank's parameters.

This is the oracle for the engine-layout tests. It is written from the engines' own loading
code, not from weightbus' layout builders: it builds, for one engine rank, the parameters the
engine's parallel layers allocate (names, shapes) and runs each checkpoint tensor through a
re-statement of that layer's ``weight_loader``, the way the model's ``load_weights`` routes it.
What each piece restates (vLLM's main branch of 2026; SGLang's layer classes are the same
design, ported from vLLM):

* ``ColumnParallelLinear.weight_loader``: ``shard = param.shape[output_dim]``, copy
  ``loaded.narrow(output_dim, tp_rank * shard, shard)``; biases alike (``output_dim`` 0).
* ``MergedColumnParallelLinear.weight_loader(param, loaded, shard_id)``: the destination is
  ``param.narrow(0, sum(output_sizes[:shard_id]) // tp, output_sizes[shard_id] // tp)``, the
  source ``loaded.narrow(0, tp_rank * size, size)``. With ``disable_tp`` (DeepSeek's
  ``fused_qkv_a_proj``) tp is 1.
* ``QKVParallelLinear``: ``num_heads = total_heads / tp``; when ``tp >= total_kv_heads`` one
  KV head per rank and ``num_kv_head_replicas = tp / total_kv_heads``, else ``total_kv_heads /
  tp`` heads and one replica. Shard offsets in the fused parameter: q at 0, k at ``num_heads
  * head_size``, v after k. ``load_qkv_weight`` picks source shard ``tp_rank`` for q and
  ``tp_rank // num_kv_head_replicas`` for k and v.
* ``RowParallelLinear``: the weight narrows ``input_dim`` 1 at ``tp_rank * shard``; the bias
  has no ``input_dim`` and is copied whole on every rank.
* ``ReplicatedLinear``, norms, ``e_score_correction_bias``: whole copy.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: ``pad_vocab_size(vocab, 64)`` rows, split
  evenly over tp (``divide`` asserts); rank r holds checkpoint rows ``[min(r*per, vocab),
  min((r+1)*per, vocab))`` at the top of its shard and the loader zero-fills the rest.
* ``FusedMoE``: ``w13_weight`` ``(local_experts, 2 * I / moe_tp, H)``, ``w2_weight``
  ``(local_experts, H, I / moe_tp)``. The expert map sends a global expert id to its local
  slot (or -1: skipped). ``_load_w13``: ``shard = w13.shape[1] // 2``, source
  ``loaded.narrow(0, shard * moe_tp_rank, shard)`` into ``[0, shard)`` for ``w1`` (gate) and
  ``[shard, 2 shard)`` for ``w3`` (up). ``_load_w2``: ``shard = w2.shape[2]``, source
  ``loaded.narrow(1, shard * moe_tp_rank, shard)``.
* MoE parallel settings. vLLM (``FusedMoEParallelConfig.make``): tp is flattened across dp,
  ``flat_tp = tp * dp``, ``flat_rank = dp_rank * tp + tp_rank``; without expert parallel the
  experts are all local and split over ``flat_tp``; with ``enable_expert_parallel`` the expert
  parallel group is ``flat_tp`` ranks at ``flat_rank`` and each expert is whole. Placement
  (``determine_expert_map``): ``linear`` gives rank r a contiguous block, the first ``E % ep``
  ranks one more; ``round_robin`` gives ``r, r + ep, ...``. SGLang (``--ep-size``, no DP
  attention): ``moe_tp = tp / ep``, ``ep_rank = tp_rank // moe_tp``, ``moe_tp_rank = tp_rank %
  moe_tp``, experts ``E / ep`` per rank, contiguous.
* Routing (each model's ``load_weights``): ``stacked_params_mapping`` sends ``.q_proj`` /
  ``.k_proj`` / ``.v_proj`` to ``.qkv_proj`` with shard ``q`` / ``k`` / ``v`` and
  ``.gate_proj`` / ``.up_proj`` to ``.gate_up_proj`` shard 0 / 1 (dense and shared-expert
  MLPs); DeepSeek with ``q_lora_rank`` sends ``.q_a_proj`` / ``.kv_a_proj_with_mqa`` to
  ``.fused_qkv_a_proj`` shard 0 / 1. Routed experts go through the expert mapping
  (``experts.{e}.gate_proj`` -> ``experts.w13_weight`` shard ``w1``, ``up_proj`` -> ``w3``,
  ``down_proj`` -> ``experts.w2_weight`` shard ``w2``; Mixtral's ``w1`` / ``w3`` / ``w2``).
  With tied embeddings there is no ``lm_head`` parameter (it is ``embed_tokens``).
* Which layers have biases follows the engines' model files: Qwen2 q/k/v biases always, no
  o_proj bias; Llama q/k/v and o_proj biases with ``attention_bias``, MLP biases with
  ``mlp_bias``; Qwen3 / Qwen3-MoE q/k/v biases with ``attention_bias`` and never an o_proj
  bias; Mixtral and DeepSeek none.

Block-FP8 checkpoints (``quantization_config.weight_block_size = [128, 128]``, DeepSeek-V3
style: ``float8_e4m3fn`` weights and a float32 ``weight_scale_inv`` per 128 x 128 block), as
vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` load them (:meth:`EngineRankModel.to_block_fp8`):

* Which layers: every linear layer built with the quant config (QKV, merged column, column,
  row, FusedMoE); ``ReplicatedLinear`` routers built without it, norms and the vocab layers
  stay unquantized.
* Parameters: ``weight`` ``float8_e4m3fn`` of the unquantized shape; ``weight_scale_inv``
  float32 ``(ceil(out_per_partition / bn), ceil(in_per_partition / bk))``
  (``create_fp8_scale_parameter``); FusedMoE ``w13_weight_scale_inv`` ``(local_experts, 2 *
  ceil(I_part / bn), ceil(H / bk))`` and ``w2_weight_scale_inv`` ``(local_experts, ceil(H /
  bn), ceil(I_part / bk))``.
* Shape checks (``validate_fp8_block_shape``): with tp > 1 and ``input_size //
  input_per_partition == tp``, ``input_per_partition % bk`` must be 0 (row parallel); when
  ``tp > 1 and output_size // sum(output_partition_sizes) == tp`` (a tp split) every partition
  size must be a multiple of ``bn``, else for a merged layer (several partitions) every one but
  the last. FusedMoE: ``I_part % bn`` must be 0, and ``I_part % bk`` too when tp > 1. A
  violation is a ``ValueError`` at model construction (:class:`BlockShapeError` here).
* Loading the scales (``BlockQuantScaleParameter``): column and row layers narrow by the scale
  parameter's own extent at ``tp_rank`` (the weights' rule); ``MergedColumnParallelLinear``
  uses offset ``ceil(sum(output_sizes[:i]) / bn) // tp`` and size ``ceil(output_sizes[i] / bn)
  // tp``; ``QKVParallelLinear`` takes the weights' per-rank offset and size and rounds both up
  to blocks, source shard as for the weights (``tp_rank // num_kv_head_replicas`` for k and v);
  FusedMoE scales go through the weights' ``_load_w13`` / ``_load_w2`` with the scale
  parameter's extents.

Every parameter also gets a mask of what its loader wrote: 1 for checkpoint data, 2 for the
vocab padding it zero-fills. A parameter element no loader wrote is a bug in this reference
(:func:`EngineRankModel.check_complete`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

DATA, PADDING = 1, 2


class BlockShapeError(ValueError):
    """vLLM refuses this block-FP8 layer at construction (``validate_fp8_block_shape``)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


SCALE = "_scale_inv"


def validate_block_shape(
    layer: str,
    *,
    tp: int,
    input_size: int,
    input_per_partition: int,
    output_size: int,
    output_partition_sizes: list[int],
    block: int,
) -> None:
    """vLLM's ``validate_fp8_block_shape``, restated (block_n == block_k == block)."""
    if tp > 1 and input_size // input_per_partition == tp and input_per_partition % block:
        raise BlockShapeError(
            f"{layer}: weight input_size_per_partition = {input_per_partition} is not "
            f"divisible by weight quantization block_k = {block}"
        )
    tp_split = tp > 1 and output_size // sum(output_partition_sizes) == tp
    merged = len(output_partition_sizes) > 1
    if tp_split or merged:
        sizes = output_partition_sizes if tp_split else output_partition_sizes[:-1]
        for size in sizes:
            if size % block:
                raise BlockShapeError(
                    f"{layer}: weight output_partition_size = {size} is not divisible by "
                    f"weight quantization block_n = {block}"
                )


def divide(numerator: int, denominator: int) -> int:
    """The engines' ``divide``: exact division or an assertion."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


@dataclass(frozen=True)
class EngineRank:
    """One engine rank's parallel settings, in the engine's own terms."""

    engine: str = "vllm"
    """``"vllm"`` or ``"sglang"``."""
    tp: int = 1
    tp_rank: int = 0
    dp: int = 1
    """vLLM data parallel size (a separate engine per replica; flattened into the MoE group)."""
    dp_rank: int = 0
    enable_expert_parallel: bool = False
    """vLLM ``--enable-expert-parallel``."""
    ep: int = 1
    """SGLang ``--ep-size`` (a divisor of tp)."""
    expert_placement: str = "linear"
    vocab_padding: int = 64

    def moe(self) -> tuple[int, int, int, int]:
        """``(moe_tp, moe_tp_rank, ep, ep_rank)`` as the engine's FusedMoE computes them."""
        if self.engine == "vllm":
            flat_tp = self.tp * self.dp
            flat_rank = self.dp_rank * self.tp + self.tp_rank
            if self.enable_expert_parallel and flat_tp > 1:
                return 1, 0, flat_tp, flat_rank
            return flat_tp, flat_rank, 1, 0
        assert self.engine == "sglang", self.engine
        moe_tp = divide(self.tp, self.ep)
        return moe_tp, self.tp_rank % moe_tp, self.ep, self.tp_rank // moe_tp


def expert_map(num_experts: int, ep: int, ep_rank: int, placement: str, engine: str) -> list[int]:
    """Global expert id -> local slot, or -1 for experts another rank holds."""
    if engine == "sglang":
        per = divide(num_experts, ep)
        local = list(range(ep_rank * per, (ep_rank + 1) * per))
    elif placement == "round_robin":
        local = list(range(ep_rank, num_experts, ep))
    else:
        base, remainder = divmod(num_experts, ep)
        count = base + 1 if ep_rank < remainder else base
        start = ep_rank * base + min(ep_rank, remainder)
        local = list(range(start, start + count))
    out = [-1] * num_experts
    for slot, expert in enumerate(local):
        out[expert] = slot
    return out


class _Param:
    """A parameter and the mask of what its loader wrote."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.data = torch.full(shape, float("nan"), dtype=dtype)
        self.mask = torch.zeros(shape, dtype=torch.int8)

    def write(self, region: tuple[slice, ...] | None, value: torch.Tensor, kind: int = DATA):
        dst = self.data if region is None else self.data[region]
        mask = self.mask if region is None else self.mask[region]
        assert dst.shape == value.shape, (dst.shape, value.shape)
        assert not mask.any(), "a loader wrote the same element twice"
        dst.copy_(value)
        mask.fill_(kind)


def _rows(start: int, size: int) -> tuple[slice, ...]:
    return (slice(start, start + size),)


class _Module:
    """A parallel layer: its parameters (by attribute) and its weight loader."""

    params: dict[str, _Param]
    block: int | None = None
    """Block-FP8 block side once :meth:`EngineRankModel.to_block_fp8` converted the layer."""

    def _fp8_linear(self, block: int) -> None:
        """FP8 ``weight`` and its ``weight_scale_inv`` grid, as ``Fp8LinearMethod`` makes them."""
        rows, cols = self.params["weight"].data.shape
        self.params["weight"] = _Param((rows, cols), torch.float8_e4m3fn)
        self.params["weight" + SCALE] = _Param(
            (cdiv(rows, block), cdiv(cols, block)), torch.float32
        )
        self.block = block

    def load(self, attr: str, loaded: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError


class Replicated(_Module):
    """ReplicatedLinear, RMSNorm, plain parameters: the whole tensor on every rank."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        self.params = {a: _Param(s, dtype) for a, s in shapes.items()}

    def load(self, attr, loaded, shard_id=None):
        assert shard_id is None
        self.params[attr].write(None, loaded)


class ColumnParallel(_Module):
    def __init__(self, inp, out, bias, tp, tp_rank, dtype):
        self.tp_rank, self.tp, self.inp, self.out = tp_rank, tp, inp, out
        rows = divide(out, tp)
        self.params = {"weight": _Param((rows, inp), dtype)}
        if bias:
            self.params["bias"] = _Param((rows,), dtype)

    def load(self, attr, loaded, shard_id=None):
        assert shard_id is None
        param = self.params[attr]
        shard = param.data.shape[0]
        param.write(None, loaded.narrow(0, self.tp_rank * shard, shard))

    def to_block_fp8(self, name: str, block: int) -> None:
        validate_block_shape(
            name,
            tp=self.tp,
            input_size=self.inp,
            input_per_partition=self.inp,
            output_size=self.out,
            output_partition_sizes=[self.out // self.tp],
            block=block,
        )
        self._fp8_linear(block)


class MergedColumnParallel(_Module):
    def __init__(self, inp, output_sizes, bias, tp, tp_rank, dtype, *, disable_tp=False):
        if disable_tp:
            tp, tp_rank = 1, 0
        self.tp, self.tp_rank, self.output_sizes = tp, tp_rank, list(output_sizes)
        self.inp = inp
        rows = sum(divide(s, tp) for s in output_sizes)
        self.params = {"weight": _Param((rows, inp), dtype)}
        if bias:
            self.params["bias"] = _Param((rows,), dtype)

    def load(self, attr, loaded, shard_id=None):
        param = self.params[attr]
        if attr.endswith(SCALE):  # BlockQuantScaleParameter: offsets in blocks, then / tp
            b = self.block
            offset = cdiv(sum(self.output_sizes[:shard_id]), b) // self.tp
            size = cdiv(self.output_sizes[shard_id], b) // self.tp
        else:
            offset = sum(self.output_sizes[:shard_id]) // self.tp
            size = self.output_sizes[shard_id] // self.tp
        param.write(_rows(offset, size), loaded.narrow(0, self.tp_rank * size, size))

    def to_block_fp8(self, name: str, block: int) -> None:
        validate_block_shape(
            name,
            tp=self.tp,
            input_size=self.inp,
            input_per_partition=self.inp,
            output_size=sum(self.output_sizes),
            output_partition_sizes=[s // self.tp for s in self.output_sizes],
            block=block,
        )
        self._fp8_linear(block)


class QKVParallel(_Module):
    def __init__(self, hidden, head_size, total_heads, total_kv_heads, bias, tp, tp_rank, dtype):
        self.tp_rank, self.tp, self.inp = tp_rank, tp, hidden
        self.head_size = head_size
        self.total = (total_heads + 2 * total_kv_heads) * head_size
        self.num_heads = divide(total_heads, tp)
        if tp >= total_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp, total_kv_heads)
        else:
            self.num_kv_heads = divide(total_kv_heads, tp)
            self.num_kv_head_replicas = 1
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.params = {"weight": _Param((rows, hidden), dtype)}
        if bias:
            self.params["bias"] = _Param((rows,), dtype)

    def load(self, attr, loaded, shard_id=None):
        h, q, kv = self.head_size, self.num_heads, self.num_kv_heads
        offset = {"q": 0, "k": q * h, "v": (q + kv) * h}[shard_id]
        size = {"q": q * h, "k": kv * h, "v": kv * h}[shard_id]
        if attr.endswith(SCALE):  # BlockQuantScaleParameter: the same, rounded up to blocks
            offset, size = cdiv(offset, self.block), cdiv(size, self.block)
        source = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        self.params[attr].write(_rows(offset, size), loaded.narrow(0, source * size, size))

    def to_block_fp8(self, name: str, block: int) -> None:
        h = self.head_size
        validate_block_shape(
            name,
            tp=self.tp,
            input_size=self.inp,
            input_per_partition=self.inp,
            output_size=self.total,
            output_partition_sizes=[
                self.num_heads * h,
                self.num_kv_heads * h,
                self.num_kv_heads * h,
            ],
            block=block,
        )
        self._fp8_linear(block)


class RowParallel(_Module):
    def __init__(self, inp, out, bias, tp, tp_rank, dtype):
        self.tp_rank, self.tp, self.inp, self.out = tp_rank, tp, inp, out
        self.params = {"weight": _Param((out, divide(inp, tp)), dtype)}
        if bias:
            self.params["bias"] = _Param((out,), dtype)

    def load(self, attr, loaded, shard_id=None):
        assert shard_id is None
        param = self.params[attr]
        if attr == "bias":  # no input_dim: the whole bias on every rank
            param.write(None, loaded)
            return
        shard = param.data.shape[1]
        param.write(None, loaded.narrow(1, self.tp_rank * shard, shard))

    def to_block_fp8(self, name: str, block: int) -> None:
        validate_block_shape(
            name,
            tp=self.tp,
            input_size=self.inp,
            input_per_partition=self.inp // self.tp,
            output_size=self.out,
            output_partition_sizes=[self.out],
            block=block,
        )
        self._fp8_linear(block)


class VocabParallel(_Module):
    def __init__(self, vocab, hidden, padding, tp, tp_rank, dtype):
        self.vocab = vocab
        padded = pad_vocab_size(vocab, padding)
        per = divide(padded, tp)
        start = min(tp_rank * per, vocab)
        self.start, self.end = start, min((tp_rank + 1) * per, vocab)
        self.params = {"weight": _Param((per, hidden), dtype)}

    def load(self, attr, loaded, shard_id=None):
        assert shard_id is None and loaded.shape[0] == self.vocab
        param = self.params[attr]
        n = self.end - self.start
        param.write(_rows(0, n), loaded.narrow(0, self.start, n))
        rest = param.data.shape[0] - n
        param.write(_rows(n, rest), torch.zeros((rest, *param.data.shape[1:])), PADDING)


class FusedMoE(_Module):
    def __init__(self, num_experts, hidden, inter, rank: EngineRank, dtype):
        self.moe_tp, self.moe_tp_rank, ep, ep_rank = rank.moe()
        self.map = expert_map(num_experts, ep, ep_rank, rank.expert_placement, rank.engine)
        local = sum(slot >= 0 for slot in self.map)
        shard = divide(inter, self.moe_tp)
        self.local, self.shard, self.hidden = local, shard, hidden
        self.params = {
            "w13_weight": _Param((local, 2 * shard, hidden), dtype),
            "w2_weight": _Param((local, hidden, shard), dtype),
        }

    def load_expert(self, attr, loaded, expert_id: int, shard_id: str) -> None:
        slot = self.map[expert_id]
        if slot < 0:
            return  # another expert-parallel rank holds it
        param = self.params[attr]
        if shard_id == "w2":
            shard = param.data.shape[2]
            src = loaded.narrow(1, shard * self.moe_tp_rank, shard)
            param.write((slot,), src)
            return
        shard = param.data.shape[1] // 2
        src = loaded.narrow(0, shard * self.moe_tp_rank, shard)
        at = 0 if shard_id == "w1" else shard
        param.write((slot, slice(at, at + shard)), src)

    def to_block_fp8(self, name: str, block: int) -> None:
        """``Fp8MoEMethod.create_weights`` with a block size: its checks and parameters."""
        if self.shard % block:
            raise BlockShapeError(
                f"{name}: the output_size of gate's and up's weight = {self.shard} is not "
                f"divisible by weight quantization block_n = {block}"
            )
        # (vLLM's second check, I_part % block_k with tp > 1, adds nothing when bn == bk)
        e, i, hid = self.local, self.shard, self.hidden
        self.params = {
            "w13_weight": _Param((e, 2 * i, hid), torch.float8_e4m3fn),
            "w2_weight": _Param((e, hid, i), torch.float8_e4m3fn),
            "w13_weight" + SCALE: _Param((e, 2 * cdiv(i, block), cdiv(hid, block)), torch.float32),
            "w2_weight" + SCALE: _Param((e, cdiv(hid, block), cdiv(i, block)), torch.float32),
        }
        self.block = block


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


class EngineRankModel:
    """One engine rank's parameters for a Hugging Face config, and its ``load_weights``.

    ``config`` is the transformers config object (what the engines read) or its dict.
    ``params`` maps each engine parameter name to its tensor after :meth:`load_weights`;
    ``masks`` maps it to what was written (1 data, 2 padding).
    """

    def __init__(self, config: Any, rank: EngineRank, dtype: torch.dtype) -> None:
        self.config, self.rank, self.dtype = config, rank, dtype
        self.family = _cfg(config, "model_type")
        self.modules: dict[str, _Module] = {}
        self.tied = bool(_cfg(config, "tie_word_embeddings", False))
        self._build()

    # -- structure ------------------------------------------------------------------------

    def _add(self, prefix: str, module: _Module) -> None:
        self.modules[prefix] = module

    def _build(self) -> None:
        c, r, dt = self.config, self.rank, self.dtype
        tp, tpr = r.tp, r.tp_rank
        family = self.family
        hidden = _cfg(c, "hidden_size")
        vocab = _cfg(c, "vocab_size")
        self._add("model.embed_tokens", VocabParallel(vocab, hidden, r.vocab_padding, tp, tpr, dt))
        for i in range(_cfg(c, "num_hidden_layers")):
            p = f"model.layers.{i}"
            self._add(
                p,
                Replicated(
                    {
                        "input_layernorm.weight": (hidden,),
                        "post_attention_layernorm.weight": (hidden,),
                    },
                    dt,
                ),
            )
            if family == "deepseek_v3":
                self._mla(f"{p}.self_attn")
            else:
                self._attention(f"{p}.self_attn")
            self._mlp_block(i, p)
        self._add("model.norm", Replicated({"weight": (hidden,)}, dt))
        if not self.tied:
            self._add("lm_head", VocabParallel(vocab, hidden, r.vocab_padding, tp, tpr, dt))

    def _attention(self, a: str) -> None:
        c, r, dt, family = self.config, self.rank, self.dtype, self.family
        hidden = _cfg(c, "hidden_size")
        heads = _cfg(c, "num_attention_heads")
        kv = _cfg(c, "num_key_value_heads") or heads
        head_dim = _cfg(c, "head_dim") or hidden // heads
        attention_bias = bool(_cfg(c, "attention_bias", False))
        qkv_bias = True if family == "qwen2" else attention_bias and family != "mixtral"
        o_bias = attention_bias and family == "llama"
        self._add(
            f"{a}.qkv_proj",
            QKVParallel(hidden, head_dim, heads, kv, qkv_bias, r.tp, r.tp_rank, dt),
        )
        self._add(f"{a}.o_proj", RowParallel(heads * head_dim, hidden, o_bias, r.tp, r.tp_rank, dt))
        if family in ("qwen3", "qwen3_moe"):
            self._add(
                a, Replicated({"q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,)}, dt)
            )

    def _mla(self, a: str) -> None:
        c, r, dt = self.config, self.rank, self.dtype
        hidden = _cfg(c, "hidden_size")
        heads = _cfg(c, "num_attention_heads")
        q_lora = _cfg(c, "q_lora_rank")
        kv_lora = _cfg(c, "kv_lora_rank")
        nope, rope = _cfg(c, "qk_nope_head_dim"), _cfg(c, "qk_rope_head_dim")
        v = _cfg(c, "v_head_dim")
        tp, tpr = r.tp, r.tp_rank
        if q_lora:
            self._add(
                f"{a}.fused_qkv_a_proj",
                MergedColumnParallel(
                    hidden, [q_lora, kv_lora + rope], False, tp, tpr, dt, disable_tp=True
                ),
            )
            self._add(f"{a}.q_a_layernorm", Replicated({"weight": (q_lora,)}, dt))
            self._add(
                f"{a}.q_b_proj", ColumnParallel(q_lora, heads * (nope + rope), False, tp, tpr, dt)
            )
        else:
            self._add(
                f"{a}.q_proj", ColumnParallel(hidden, heads * (nope + rope), False, tp, tpr, dt)
            )
            self._add(
                f"{a}.kv_a_proj_with_mqa", Replicated({"weight": (kv_lora + rope, hidden)}, dt)
            )
        self._add(f"{a}.kv_a_layernorm", Replicated({"weight": (kv_lora,)}, dt))
        self._add(f"{a}.kv_b_proj", ColumnParallel(kv_lora, heads * (nope + v), False, tp, tpr, dt))
        self._add(f"{a}.o_proj", RowParallel(heads * v, hidden, False, tp, tpr, dt))

    def _is_moe(self, i: int) -> bool:
        c, family = self.config, self.family
        if family == "mixtral":
            return True
        if family == "qwen3_moe":
            experts = _cfg(c, "num_experts") or 0
            step = _cfg(c, "decoder_sparse_step", 1) or 1
            return (
                i not in (_cfg(c, "mlp_only_layers") or []) and experts > 0 and (i + 1) % step == 0
            )
        if family == "deepseek_v3":
            return (
                _cfg(c, "n_routed_experts") is not None
                and i >= (_cfg(c, "first_k_dense_replace") or 0)
                and i % (_cfg(c, "moe_layer_freq", 1) or 1) == 0
            )
        return False

    def _dense_mlp(self, m: str, inter: int, bias: bool) -> None:
        c, r, dt = self.config, self.rank, self.dtype
        hidden = _cfg(c, "hidden_size")
        self._add(
            f"{m}.gate_up_proj",
            MergedColumnParallel(hidden, [inter, inter], bias, r.tp, r.tp_rank, dt),
        )
        self._add(f"{m}.down_proj", RowParallel(inter, hidden, bias, r.tp, r.tp_rank, dt))

    def _mlp_block(self, i: int, p: str) -> None:
        c, r, dt, family = self.config, self.rank, self.dtype, self.family
        hidden = _cfg(c, "hidden_size")
        if not self._is_moe(i):
            mlp_bias = family == "llama" and bool(_cfg(c, "mlp_bias", False))
            self._dense_mlp(f"{p}.mlp", _cfg(c, "intermediate_size"), mlp_bias)
            return
        if family == "mixtral":
            m, experts, inter = (
                f"{p}.block_sparse_moe",
                _cfg(c, "num_local_experts"),
                _cfg(c, "intermediate_size"),
            )
        elif family == "qwen3_moe":
            m, experts, inter = f"{p}.mlp", _cfg(c, "num_experts"), _cfg(c, "moe_intermediate_size")
        else:
            m, experts, inter = (
                f"{p}.mlp",
                _cfg(c, "n_routed_experts"),
                _cfg(c, "moe_intermediate_size"),
            )
        gate = {"weight": (experts, hidden)}
        self._add(f"{m}.gate", Replicated(gate, dt))
        if family == "deepseek_v3":
            bias = Replicated({"e_score_correction_bias": (experts,)}, torch.float32)
            self._add(f"{m}.gate", _Merged(self.modules[f"{m}.gate"], bias))
            shared = _cfg(c, "n_shared_experts")
            if shared:
                self._dense_mlp(f"{m}.shared_experts", inter * shared, False)
        self._add(f"{m}.experts", FusedMoE(experts, hidden, inter, r, dt))

    # -- loading --------------------------------------------------------------------------

    def _stacked(self) -> list[tuple[str, str, Any]]:
        mapping: list[tuple[str, str, Any]] = []
        if self.family != "deepseek_v3":
            mapping += [
                (".qkv_proj", ".q_proj", "q"),
                (".qkv_proj", ".k_proj", "k"),
                (".qkv_proj", ".v_proj", "v"),
            ]
        elif _cfg(self.config, "q_lora_rank"):
            mapping += [
                (".fused_qkv_a_proj", ".q_a_proj", 0),
                (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1),
            ]
        mapping += [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
        return mapping

    def _expert_leaves(self) -> dict[str, tuple[str, str]]:
        if self.family == "mixtral":
            return {
                "w1": ("w13_weight", "w1"),
                "w3": ("w13_weight", "w3"),
                "w2": ("w2_weight", "w2"),
            }
        return {
            "gate_proj": ("w13_weight", "w1"),
            "up_proj": ("w13_weight", "w3"),
            "down_proj": ("w2_weight", "w2"),
        }

    def _find(self, name: str) -> tuple[_Module, str]:
        for cut in range(name.count("."), 0, -1):
            prefix, attr = name.rsplit(".", cut)[0], ".".join(name.rsplit(".", cut)[1:])
            module = self.modules.get(prefix)
            if module is not None and attr in module.params:
                return module, attr
        raise KeyError(f"the engine has no parameter for checkpoint tensor {name!r}")

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        expert_re = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight(_scale_inv)?$")
        leaves = self._expert_leaves()
        stacked = self._stacked()
        for name, loaded in weights.items():
            if self.tied and name.startswith("lm_head."):
                continue
            routed = expert_re.match(name)
            if routed is not None:
                prefix, expert, leaf = routed.group(1), int(routed.group(2)), routed.group(3)
                attr, shard_id = leaves[leaf]
                attr += routed.group(4) or ""
                module = self.modules[f"{prefix}.experts"]
                assert isinstance(module, FusedMoE)
                module.load_expert(attr, loaded, expert, shard_id)
                continue
            for param_part, weight_part, shard_id in stacked:
                if weight_part in name:
                    module, attr = self._find(name.replace(weight_part, param_part))
                    module.load(attr, loaded, shard_id)
                    break
            else:
                module, attr = self._find(name)
                module.load(attr, loaded)

    def to_block_fp8(self, block: int = 128) -> None:
        """Make the layers vLLM's block-FP8 quant config quantizes FP8 (see the module
        docstring); raises :class:`BlockShapeError` where vLLM refuses the shapes."""
        quantized = (ColumnParallel, MergedColumnParallel, QKVParallel, RowParallel, FusedMoE)
        for prefix, module in self.modules.items():
            if isinstance(module, quantized):
                module.to_block_fp8(prefix, block)

    # -- results --------------------------------------------------------------------------

    def _named(self) -> dict[str, _Param]:
        out: dict[str, _Param] = {}
        for prefix, module in self.modules.items():
            for attr, param in module.params.items():
                out[f"{prefix}.{attr}"] = param
        return out

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.data for k, v in self._named().items()}

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        return {k: v.mask for k, v in self._named().items()}

    def check_complete(self) -> None:
        """Every element of every parameter was written exactly once (data or padding)."""
        for name, param in self._named().items():
            assert bool((param.mask > 0).all()), f"reference left {name} partly unwritten"


class _Merged(_Module):
    """Two modules under one prefix (DeepSeek's gate: a router weight and its bias)."""

    def __init__(self, *parts: _Module) -> None:
        self.parts = parts
        self.params = {k: v for part in parts for k, v in part.params.items()}

    def load(self, attr, loaded, shard_id=None):
        for part in self.parts:
            if attr in part.params:
                part.load(attr, loaded, shard_id)
                return
        raise KeyError(attr)


def engine_rank_params(
    config: Any, checkpoint: Mapping[str, torch.Tensor], rank: EngineRank, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(params, masks)`` of one engine rank after loading ``checkpoint``."""
    model = EngineRankModel(config, rank, dtype)
    model.load_weights(checkpoint)
    model.check_complete()
    return model.params, model.masks


def engine_rank_fp8_params(
    config: Any,
    checkpoint: Mapping[str, torch.Tensor],
    rank: EngineRank,
    dtype: torch.dtype,
    block: int = 128,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(params, masks)`` of one engine rank of a block-FP8 model after loading a block-FP8
    ``checkpoint`` (FP8 weights and their ``weight_scale_inv``; the rest in ``dtype``)."""
    model = EngineRankModel(config, rank, dtype)
    model.to_block_fp8(block)
    model.load_weights(checkpoint)
    model.check_complete()
    return model.params, model.masks
