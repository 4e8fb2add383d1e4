"""vLLM integration: receive each sync straight into vLLM's fused parameters.

Inference side, two ways into vLLM's worker processes:

* **Native weight-transfer backend** (vLLM's ``WeightTransferEngine`` API with the four-phase
  lifecycle: ``init_transfer_engine``, ``start_weight_update``, ``receive_weights``,
  ``finish_weight_update``, ``shutdown``; documented from vLLM v0.25). Installing weightbus
  adds the entry point ``vllm.general_plugins: weightbus`` so that every vLLM process runs
  :func:`register`, which registers the backend ``"weightbus"`` with
  ``WeightTransferEngineFactory``. Start vLLM with it::

      vllm serve MODEL --weight-transfer-config '{"backend": "weightbus"}'

  (the RLHF routes are under vLLM's dev mode: ``VLLM_SERVER_DEV_MODE=1``).
* **Worker extension** for vLLM versions without the native API:
  ``LLM(..., worker_extension_cls="weightbus.engines.vllm.WorkerExtension")`` and drive it
  with :class:`CollectiveRPC` (``llm.collective_rpc("weightbus_init", ...)``).

Either way each vLLM worker (one GPU: one tensor-parallel rank of one data-parallel replica)
is one weightbus reader. Its layout is :func:`vllm_layout` of the served model's
:class:`~weightbus.layouts.families.ModelSpec` (built from vLLM's Hugging Face config) at the
worker's parallel ranks, and :func:`bind` ties it to the worker's live parameters by name,
after checking every shape and dtype, the parallel layers' own attributes (tp size and rank,
KV head replicas, vocab padding, expert map) and that no parameter is left out. A sync then
writes in place into those parameters: no ``load_weights``, no copy of the model.

What in-place receiving requires: the engine's parameters must hold the checkpoint's values
as loaded (vLLM's ``reload_mode="direct"`` has the same condition). That holds for unquantized
models on CUDA and for block-FP8 models on the kernels named below ("FP8"). :func:`bind`
refuses every other quantized layer.
DeepSeek's multi-latent attention derives ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` after
loading; :meth:`Receiver.finish` recomputes them in place after every sync
(:func:`refresh_derived`).

FP8 (block-quantized checkpoints, ``weight_block_size = [128, 128]``, DeepSeek-V3 style).
Start the job with ``SyncConfig(fp8=Fp8Config(block=128))`` on every participant: writers
quantize, readers receive ``float8_e4m3fn`` weights and float32 ``weight_scale_inv`` block
scales straight into vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` parameters
(:func:`vllm_fp8_layout`: the engine layout through
:func:`~weightbus.codecs.fp8.quantized_layout`, with vLLM's block-shape rules). vLLM's
post-load processing and why :class:`Receiver` does not call it again after a sync:

* ``Fp8LinearMethod.process_weights_after_loading`` with a block size: on ROCm FNUZ platforms
  it reinterprets the e4m3fn bits as e4m3fnuz and doubles the scales (not idempotent: a
  second call doubles them again); with ``VLLM_ROCM_FP8_PADDING`` it pads the weight's rows;
  with DeepGEMM it requantizes to power-of-two scales (in place) and swaps ``weight_scale_inv``
  for DeepGEMM's own scale layout (TMA-aligned, packed int32 for UE8M0): applying that twice
  transforms already transformed scales; with the Marlin weight-only path it repacks the
  weight. Otherwise (CUDA, e4m3fn, Triton or CUTLASS block kernels) weight and scales stay as
  loaded: ``process_fp8_weight_block_strategy`` returns them unchanged, so nothing needs
  redoing after a sync that wrote the checkpoint's own bytes.
* ``Fp8MoEMethod.process_weights_after_loading`` converts ``w13`` / ``w2`` and their scales
  to the selected MoE backend's format (``convert_to_fp8_moe_kernel_format``: shuffles for
  FlashInfer and AITER, DeepGEMM scale layouts, FNUZ as above), re-registers them and builds
  the kernel. The conversion is not idempotent except for the Triton backend, where it is
  the identity.

So the safe thing, done here: :func:`bind` accepts block-FP8 layers only where vLLM's
post-processing left the checkpoint layout in place (Triton MoE backend, no Marlin, and every
weight and scale parameter of the checkpoint's shape, dtype ``float8_e4m3fn`` / ``float32``,
contiguous), and refuses the others naming the layer and what to change; after each
committed sync :meth:`Receiver.finish` checks that the bound tensors are still the layers'
parameters (:func:`check_fp8_bound`) instead of re-running the processing. This FP8 path never
ran inside a real vLLM: it was checked against a reference of vLLM's loaders (block shapes,
scale sharding) and against stand-in modules.

Trainer side, :class:`VLLMWeightSync` drives vLLM's HTTP routes (``/get_world_size``,
``/init_weight_transfer_engine``, ``/pause``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update`` with ``weight_version``, ``/resume``) together with weightbus'
:class:`~weightbus.Writer`; the data itself moves through weightbus' transports (NCCL on
GPUs), never through HTTP.

Pipeline parallel vLLM engines, LoRA-extended vocabularies, expert-parallel load balancing
(redundant experts) and SGLang-style data-parallel attention are not supported.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from weightbus._session import SyncConfig, SyncResult
from weightbus.codecs.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8Config,
    dequantize,
    quantized_layout,
)
from weightbus.control.store import ControlConfig
from weightbus.engines._concurrent import beside
from weightbus.errors import WeightbusError
from weightbus.layouts.families import ModelSpec, model_spec
from weightbus.layouts.fused import EXPERT_PLACEMENTS, engine_layout, expert_ids, kv_head_range
from weightbus.reader import Reader
from weightbus.spec import BoundLayout, Layout, LayoutError, Participant, dtype_name
from weightbus.writer import Writer

__all__ = [
    "BACKEND",
    "CollectiveRPC",
    "InitInfo",
    "Receiver",
    "UpdateInfo",
    "VLLMParallel",
    "VLLMServer",
    "VLLMWeightSync",
    "WorkerExtension",
    "bind",
    "check_fp8_bound",
    "refresh_derived",
    "register",
    "vllm_fp8_layout",
    "vllm_layout",
]

logger = logging.getLogger(__name__)

BACKEND = "weightbus"
"""The name of the weight-transfer backend in ``WeightTransferConfig(backend=...)``."""

_UNQUANTIZED = (
    "UnquantizedLinearMethod",
    "UnquantizedEmbeddingMethod",
    "UnquantizedFusedMoEMethod",
)
_FP8_LINEAR, _FP8_MOE = "Fp8LinearMethod", "Fp8MoEMethod"


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMParallel:
    """Where one vLLM worker sits, in vLLM's own terms."""

    tp: int = 1
    """``--tensor-parallel-size``."""
    tp_rank: int = 0
    """This worker's tensor-parallel rank."""
    dp: int = 1
    """``--data-parallel-size``: replicas; MoE layers flatten tp across them."""
    dp_rank: int = 0
    """This worker's data-parallel rank."""
    enable_expert_parallel: bool = False
    """``--enable-expert-parallel``: experts spread whole over all ``tp * dp`` workers."""
    expert_placement: str = "linear"
    """``expert_placement_strategy``: ``"linear"`` or ``"round_robin"``."""
    vocab_pad: int = 64
    """Vocabulary padding of ``VocabParallelEmbedding`` / ``ParallelLMHead`` (vLLM's 64)."""

    def __post_init__(self) -> None:
        for size, rank in (("tp", "tp_rank"), ("dp", "dp_rank")):
            n, r = getattr(self, size), getattr(self, rank)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{size}={n!r} must be an int >= 1")
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
                raise ValueError(f"{rank}={r!r} must be in [0, {size}={n})")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ValueError(
                f"expert_placement={self.expert_placement!r} is not one of {EXPERT_PLACEMENTS}"
            )
        if not isinstance(self.vocab_pad, int) or self.vocab_pad < 1:
            raise ValueError(f"vocab_pad={self.vocab_pad!r} must be a positive int (vLLM: 64)")

    @property
    def worker_index(self) -> int:
        """This worker's index among the ``tp * dp`` workers of one vLLM server."""
        return self.dp_rank * self.tp + self.tp_rank

    def moe(self) -> dict[str, int]:
        """``engine_layout`` arguments for the experts (vLLM's ``FusedMoEParallelConfig``)."""
        flat, flat_rank = self.tp * self.dp, self.worker_index
        if self.enable_expert_parallel and flat > 1:
            return {"ep": flat, "ep_rank": flat_rank, "moe_tp": 1, "moe_tp_rank": 0}
        return {"ep": 1, "ep_rank": 0, "moe_tp": flat, "moe_tp_rank": flat_rank}

    def layout(
        self, model: ModelSpec, participant: Participant, *, dtype: str | None = None
    ) -> Layout:
        return vllm_layout(model, participant, self, dtype=dtype)

    def checks(self) -> dict[str, Any]:
        """What :func:`bind` compares with the engine layers' attributes."""
        return {
            "tp": self.tp,
            "tp_rank": self.tp_rank,
            "placement": self.expert_placement,
            "vocab_pad": self.vocab_pad,
            **self.moe(),
        }


def vllm_layout(
    model: ModelSpec, participant: Participant, parallel: VLLMParallel, *, dtype: str | None = None
) -> Layout:
    """The layout of one vLLM worker: fused parameters named as vLLM names them."""
    moe = parallel.moe() if model.num_experts else {}
    return engine_layout(
        model,
        participant,
        tp=parallel.tp,
        tp_rank=parallel.tp_rank,
        vocab_pad=parallel.vocab_pad,
        dtype=dtype,
        expert_placement=parallel.expert_placement,
        **moe,
    )


def vllm_fp8_layout(
    model: ModelSpec,
    participant: Participant,
    parallel: VLLMParallel,
    fp8: Fp8Config,
    *,
    dtype: str | None = None,
) -> Layout:
    """The wire layout of one vLLM worker serving a block-FP8 checkpoint.

    :func:`vllm_layout` through :func:`~weightbus.codecs.fp8.quantized_layout`. vLLM refuses,
    when it builds the model, a tensor-parallel shard or a fused component (q / k / v,
    gate / up) whose rows (or, for row-parallel layers, columns) are not a multiple of the
    block, except the last component of a merged layer that is not split over ranks
    (``validate_fp8_block_shape``; FusedMoE: the per-rank intermediate size); this layout
    refuses the same shards, naming them, rather than planning a layout vLLM cannot hold.
    """
    layout = vllm_layout(model, participant, parallel, dtype=dtype)
    _check_fp8_blocks(layout, fp8)
    return quantized_layout(layout, fp8)


def _check_fp8_blocks(layout: Layout, fp8: Fp8Config) -> None:
    """Every piece of a tensor ``fp8`` quantizes starts on a block boundary (canonical and
    local) and ends on one or at the end of both its tensor and its local tensor."""
    block = fp8.block
    locals_ = {lt.key: lt for lt in layout.locals}
    specs = {t.name: t for t in layout.tensors}
    shapes = {t.name: t.shape for t in layout.tensors}
    for p in layout.iter_pieces():
        if not fp8.quantizes(specs[p.tensor]):
            continue
        local_shape = locals_[p.key].shape
        for d in (-2, -1):
            a, b = p.box.start[d], p.box.stop[d]
            la, lb = p.local_box.start[d], p.local_box.stop[d]
            ends = b == shapes[p.tensor][d] and lb == local_shape[d]
            if a % block or la % block or (not ends and (b % block or lb % block)):
                what = "rows" if d == -2 else "columns"
                raise LayoutError(
                    f"{layout.role} {layout.name!r}: {p.tensor} {what} [{a}, {b}) land at "
                    f"{what} [{la}, {lb}) of {p.key!r}, which cuts a {block}-wide FP8 block; "
                    "vLLM refuses such block-FP8 shards too (validate_fp8_block_shape: every "
                    f"tensor-parallel shard and fused component must be a multiple of {block}):"
                    " use a tensor-parallel size that divides these sizes into whole blocks"
                )


# ---------------------------------------------------------------------------------------------
# binding a live engine model
# ---------------------------------------------------------------------------------------------


def _fp8_layers(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """Block-FP8 layers by module name, with their block size; raises for other quantization
    and for FP8 layers whose post-load processing leaves no checkpoint layout to write into."""
    out: dict[str, tuple[nn.Module, int]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__ if method is not None else None
        if kind is None or kind in _UNQUANTIZED:
            continue
        config = getattr(method, "quant_config", None)
        size = getattr(method, "weight_block_size", None) or getattr(
            config, "weight_block_size", None
        )
        if kind not in (_FP8_LINEAR, _FP8_MOE) or not size:
            raise NotImplementedError(
                f"module {name!r} is quantized ({kind}, weight_block_size={size}): weightbus "
                "receives unquantized models and block-FP8 ones (weight_block_size [128, 128], "
                "what its FP8 codec sends) only; serve the unquantized or a block-FP8 "
                "checkpoint"
            )
        if len(size) != 2 or size[0] != size[1]:
            raise NotImplementedError(
                f"module {name!r}: FP8 blocks {list(size)} are not square; weightbus' FP8 codec "
                "uses square blocks (Fp8Config.block)"
            )
        if getattr(method, "use_marlin", False):
            raise NotImplementedError(
                f"module {name!r}: vLLM runs this FP8 layer through Marlin (weight-only FP8 on "
                "GPUs without FP8 tensor cores), which repacks the weights after loading; "
                "weightbus can write FP8 only into checkpoint-layout parameters: use a GPU with "
                "FP8 support (compute capability 8.9+)"
            )
        backend = getattr(method, "fp8_backend", None)
        if kind == _FP8_MOE and "TRITON" not in str(getattr(backend, "name", backend)).upper():
            raise NotImplementedError(
                f"module {name!r}: vLLM's FP8 MoE backend here is {backend!r}, which converts "
                "w13 / w2 and their scales to its own format after loading (shuffles, scale "
                "layouts), so they no longer hold the checkpoint layout weightbus writes; "
                "select vLLM's Triton FP8 MoE backend (for example VLLM_USE_DEEP_GEMM=0 and "
                "VLLM_USE_FLASHINFER_MOE_FP8=0)"
            )
        out[name] = (module, int(size[0]))
    return out


def _fp8_param_hint(name: str) -> str:
    if name.endswith(SCALE_SUFFIX):
        return (
            "; this is an FP8 scale tensor: vLLM re-lays scales out after loading for DeepGEMM "
            "(TMA-aligned or packed UE8M0) and on ROCm FNUZ platforms, where weightbus cannot "
            "write them in place: run vLLM with VLLM_USE_DEEP_GEMM=0 on CUDA"
        )
    return ""


def _attr(module: nn.Module, name: str) -> Any:
    value = getattr(module, name, None)
    if value is None:
        config = getattr(module, "moe_parallel_config", None)
        value = getattr(config, name, None) if config is not None else None
    return value


def _check_module(who: str, key: str, module: nn.Module, expected: Mapping[str, Any]) -> None:
    """Compare the engine layer's own attributes with what the layout assumed."""
    for attr, want in expected.items():
        got = _attr(module, attr)
        if got is None:
            continue  # this vLLM version does not keep the attribute
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if got != want:
            raise LayoutError(
                f"{who}: the engine layer holding {key!r} ({type(module).__name__}) has "
                f"{attr}={got!r}, the weightbus layout assumed {want!r}: the parallel settings "
                "passed to weightbus do not match the engine's; build them from the engine's "
                "own config (weightbus.engines.vllm.parallel_from_vllm)"
            )


def _expected_attrs(
    spec: ModelSpec, key: str, local_shape: tuple[int, ...], parallel: Mapping[str, int]
) -> dict[str, Any]:
    """What the engine layer holding local tensor ``key`` must say about its sharding."""
    tp, tp_rank = parallel["tp"], parallel["tp_rank"]
    leaf = key.split(".")[-2] if "." in key else key
    if key.endswith(".w13_weight") or key.endswith(".w2_weight"):
        out: dict[str, Any] = {"local_num_experts": local_shape[0]}
        if parallel.get("ep", 1) > 1:
            ids = expert_ids(
                spec.num_experts, parallel["ep"], parallel["ep_rank"], parallel["placement"]
            )
            mapping = [-1] * spec.num_experts
            for slot, expert in enumerate(ids.tolist()):
                mapping[expert] = slot
            out["expert_map"] = mapping
            out["ep_size"], out["ep_rank"] = parallel["ep"], parallel["ep_rank"]
        out["tp_size"], out["tp_rank"] = parallel["moe_tp"], parallel["moe_tp_rank"]
        return out
    if leaf == "qkv_proj":
        heads = kv_head_range(spec.num_kv_heads, tp, tp_rank)
        replicas = max(1, tp // spec.num_kv_heads)
        return {
            "tp_size": tp,
            "tp_rank": tp_rank,
            "num_kv_heads": len(heads),
            "num_kv_head_replicas": replicas,
        }
    if leaf in ("embed_tokens", "lm_head"):
        return {"tp_size": tp, "padding_size": parallel["vocab_pad"]}
    # replicated layers (routers, DeepSeek's fused_qkv_a_proj) keep the group's tp_size in some
    # vLLM versions and 1 in others: nothing to check there
    if leaf in ("gate_up_proj", "down_proj", "o_proj", "q_proj", "q_b_proj", "kv_b_proj"):
        return {"tp_size": tp, "tp_rank": tp_rank}
    return {}


def bind(
    model: nn.Module,
    layout: Layout,
    *,
    spec: ModelSpec | None = None,
    parallel: Mapping[str, int] | None = None,
    prefix: str = "",
    ignore: Iterable[str] = (),
    fp8: Fp8Config | None = None,
) -> BoundLayout:
    """Tie ``layout`` to the live parameters of an engine model, by name.

    Every local tensor of the layout must be a parameter of ``model`` (under ``prefix``) with
    the same shape and dtype; every parameter of ``model`` must be in the layout (a parameter
    no sync writes would keep its old values), except those matching a name in ``ignore``.
    With ``spec`` and ``parallel`` (keys ``tp``, ``tp_rank``, ``ep``, ``ep_rank``, ``moe_tp``,
    ``moe_tp_rank``, ``placement``, ``vocab_pad``) the engine layers' own attributes are checked
    against the layout's assumptions too. A block-FP8 model needs ``fp8`` (the job's
    :class:`~weightbus.codecs.Fp8Config`, its block equal to the model's) and ``layout`` its
    wire layout (:func:`vllm_fp8_layout`). Raises :class:`LayoutError` naming the tensor and
    both sides' values, ``NotImplementedError`` for quantization weightbus cannot write into
    (see "FP8" in the module docstring).
    """
    layers = _fp8_layers(model)
    who = layout.name
    if layers:
        name, (_, size) = next(iter(layers.items()))
        if fp8 is None:
            raise LayoutError(
                f"{who}: the engine model is block-FP8 (e.g. {name!r}, blocks of {size}) but "
                f"FP8 is off: pass SyncConfig(fp8=Fp8Config(block={size})) on every "
                "participant, and bind the wire layout (weightbus.engines.vllm.vllm_fp8_layout)"
            )
        if any(b != fp8.block for _, b in layers.values()):
            raise LayoutError(
                f"{who}: the engine's FP8 blocks are {size} wide ({name!r}), Fp8Config.block "
                f"is {fp8.block}: use Fp8Config(block={size}) on every participant"
            )
    params = {name: p for name, p in model.named_parameters()}
    skip = set(ignore)
    tensors: dict[str, torch.Tensor] = {}
    for local in layout.locals:
        name = prefix + local.key
        param = params.get(name)
        if param is None:
            close = sorted(n for n in params if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:3]
            raise LayoutError(
                f"{who}: the engine model has no parameter {name!r} for local tensor "
                f"{local.key!r}; parameters with that leaf name: {close}; pass prefix= if the "
                "engine nests the language model"
            )
        data = param.data
        if tuple(data.shape) != local.shape or dtype_name(data.dtype) != local.dtype:
            raise LayoutError(
                f"{who}: engine parameter {name!r} is {tuple(data.shape)} "
                f"{dtype_name(data.dtype)}, the layout says {local.shape} {local.dtype}: the "
                "parallel settings, the model config or the FP8 setting (SyncConfig.fp8) given "
                "to weightbus differ from the engine's" + _fp8_param_hint(name)
            )
        if not data.is_contiguous():
            raise LayoutError(
                f"{who}: engine parameter {name!r} is not contiguous (strides {data.stride()}); "
                "weightbus writes fused parameters as laid out by their loaders"
                + _fp8_param_hint(name)
            )
        if spec is not None and parallel is not None:
            module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            _check_module(
                who, name, module, _expected_attrs(spec, local.key, local.shape, parallel)
            )
        tensors[local.key] = data
    held = {prefix + local.key for local in layout.locals}
    left = sorted(n for n in params if n not in held and n not in skip)
    if left:
        raise LayoutError(
            f"{who}: {len(left)} engine parameters are in no weightbus piece and would keep "
            f"stale values after a sync, e.g. {left[:5]}; pass ignore=[...] for parameters "
            "that are not weights of the checkpoint"
        )
    return BoundLayout(layout=layout, tensors=tensors)


def check_fp8_bound(model: nn.Module, bound: BoundLayout, prefix: str = "") -> int:
    """After a committed sync: every FP8 weight and scale tensor weightbus wrote is still the
    storage of its engine parameter. vLLM's FP8 post-load processing is not re-run (see "FP8"
    in the module docstring); this catches a vLLM that replaced the parameters since
    :func:`bind`, which would otherwise keep serving stale weights silently. Returns how many
    tensors were checked."""
    params = dict(model.named_parameters())
    count = 0
    for local in bound.layout.locals:
        if local.dtype != FP8_DTYPE and not local.key.endswith(SCALE_SUFFIX):
            continue
        mine, theirs = bound.tensors[local.key], params.get(prefix + local.key)
        if theirs is None or theirs.data.data_ptr() != mine.data_ptr():
            raise WeightbusError(
                f"{bound.layout.name}: engine parameter {prefix + local.key!r} is no longer the "
                "tensor weightbus bound and wrote (vLLM replaced it, e.g. by running its FP8 "
                "post-load processing again): the engine serves stale weights; reconnect "
                "weightbus after any reload (shutdown, then init_weight_transfer_engine)"
            )
        count += 1
    return count


def refresh_derived(model: nn.Module) -> int:
    """Recompute, in place, tensors the engine derived from weights after loading them.

    DeepSeek's multi-latent attention keeps ``W_UK_T`` ``(heads, nope, kv_lora)`` and ``W_UV``
    ``(heads, kv_lora, v)`` computed from ``kv_b_proj.weight`` ``(heads * (nope + v),
    kv_lora)``. They are copied into the existing tensors (CUDA graphs captured them), not
    replaced. Returns how many attention layers were refreshed.
    """
    count = 0
    seen: set[int] = set()
    for module in model.modules():
        for holder in (module, getattr(module, "impl", None)):
            if holder is None or id(holder) in seen:
                continue
            if not all(hasattr(holder, a) for a in ("W_UV", "W_UK_T", "kv_b_proj")):
                continue
            seen.add(id(holder))
            _refresh_mla(holder)
            count += 1
    return count


def _refresh_mla(holder: Any) -> None:
    weight = holder.kv_b_proj.weight
    uv, uk_t = holder.W_UV, holder.W_UK_T
    heads, kv_lora, v = uv.shape
    nope = uk_t.shape[1]
    if tuple(weight.shape) != (heads * (nope + v), kv_lora):
        raise LayoutError(
            f"MLA attention: kv_b_proj.weight is {tuple(weight.shape)}, W_UV {tuple(uv.shape)} "
            f"and W_UK_T {tuple(uk_t.shape)} do not derive from it as (heads * (nope + v), "
            "kv_lora); this vLLM version lays MLA out differently"
        )
    if weight.dtype == torch.float8_e4m3fn:
        # block-FP8 kv_b_proj: derive from the dequantized weight (q * s per block), as vLLM
        # dequantizes it for MLA
        layer = holder.kv_b_proj
        method = getattr(layer, "quant_method", None)
        size = getattr(layer, "weight_block_size", None) or getattr(
            method, "weight_block_size", None
        )
        if not size:
            raise LayoutError(
                "MLA attention: kv_b_proj.weight is FP8 but its layer names no "
                "weight_block_size; weightbus refreshes W_UK_T / W_UV for block-FP8 only"
            )
        weight = dequantize(weight, layer.weight_scale_inv, block=int(size[0]))
    # kv_b_proj maps kv_lora -> heads * (nope + v); its transpose, split per head
    per_head = weight.t().reshape(kv_lora, heads, nope + v).to(uv.dtype)
    uk, uvv = per_head.split([nope, v], dim=-1)
    uv.copy_(uvv.transpose(0, 1))
    uk_t.copy_(uk.permute(1, 2, 0))


# ---------------------------------------------------------------------------------------------
# the inference side, independent of how vLLM calls it
# ---------------------------------------------------------------------------------------------


def _fp8_fields(fp8: Fp8Config) -> dict[str, Any]:
    """Every field of ``fp8`` as JSON values (the ignore list as a list): what a reader needs
    to build an equal Fp8Config (the codecs' key covers all of them)."""
    return {**asdict(fp8), "ignore": list(fp8.ignore)}


@dataclass
class InitInfo:
    """What each vLLM worker needs to join a weightbus job (JSON in ``/init_weight_transfer_engine``)."""

    store_address: str
    """``host:port`` of the weightbus control store (reachable from every worker)."""
    num_writers: int
    """Writers in the job."""
    num_readers: int
    """Readers in the job: every worker of every vLLM server (plus any other readers)."""
    reader_rank_offset: int = 0
    """Reader rank of this server's first worker; workers add their index (dp_rank * tp + tp_rank)."""
    job: str = "default"
    """Control-store key namespace, as the writers use it."""
    bucket_bytes: int = 64 << 20
    """SyncConfig.bucket_bytes; must equal the writers'."""
    staging_buffers: int = 4
    """SyncConfig.staging_buffers."""
    direct_bytes: int = 4 << 20
    """SyncConfig.direct_bytes; must equal the writers'."""
    cast: dict[str, str] = field(default_factory=dict)
    """SyncConfig.cast; must equal the writers'."""
    ignore_unread: list[str] = field(default_factory=list)
    """SyncConfig.ignore_unread; must equal the writers'."""
    transport: str = "auto"
    """SyncConfig.transport."""
    fp8: dict[str, Any] | None = None
    """SyncConfig.fp8 as the fields of an Fp8Config (block, scale_format, eps, ignore, ahead,
    bucket_bytes; those left out take Fp8Config's defaults), or None for no FP8; must equal
    the writers'."""
    sync_timeout_s: float = 300.0
    """SyncConfig.sync_timeout in seconds."""
    connect_timeout_s: float = 300.0
    """SyncConfig.connect_timeout in seconds."""
    step_timeout_s: float = 1800.0
    """SyncConfig.step_timeout in seconds."""

    def __post_init__(self) -> None:
        if self.reader_rank_offset < 0 or self.reader_rank_offset >= self.num_readers:
            raise ValueError(
                f"reader_rank_offset={self.reader_rank_offset} must be in "
                f"[0, num_readers={self.num_readers})"
            )
        if self.fp8 is not None:
            self.fp8_config()  # raises for unknown fields or bad values

    def fp8_config(self) -> Fp8Config | None:
        if self.fp8 is None:
            return None
        try:
            return Fp8Config(**self.fp8)
        except TypeError as e:
            raise ValueError(
                f"fp8={self.fp8!r} must hold Fp8Config fields "
                f"({', '.join(f.name for f in fields(Fp8Config))}): {e}"
            ) from e

    @classmethod
    def from_configs(
        cls, control: ControlConfig, sync: SyncConfig, *, reader_rank_offset: int = 0
    ) -> InitInfo:
        """The init info matching a writer's configuration."""
        return cls(
            store_address=control.address,
            num_writers=control.num_writers,
            num_readers=control.num_readers,
            reader_rank_offset=reader_rank_offset,
            job=control.job,
            bucket_bytes=sync.bucket_bytes,
            staging_buffers=sync.staging_buffers,
            direct_bytes=sync.direct_bytes,
            cast=dict(sync.cast),
            ignore_unread=list(sync.ignore_unread),
            transport=sync.transport,
            fp8=None if sync.fp8 is None else _fp8_fields(sync.fp8),
            sync_timeout_s=sync.sync_timeout.total_seconds(),
            connect_timeout_s=sync.connect_timeout.total_seconds(),
            step_timeout_s=sync.step_timeout.total_seconds(),
        )

    def configs(self) -> tuple[ControlConfig, SyncConfig]:
        control = ControlConfig(
            num_writers=self.num_writers,
            num_readers=self.num_readers,
            address=self.store_address,
            host_store=False,
            job=self.job,
            timeout=timedelta(seconds=self.connect_timeout_s),
        )
        sync = SyncConfig(
            bucket_bytes=self.bucket_bytes,
            staging_buffers=self.staging_buffers,
            cast=dict(self.cast),
            ignore_unread=tuple(self.ignore_unread),
            direct_bytes=self.direct_bytes,
            transport=self.transport,
            fp8=self.fp8_config(),
            sync_timeout=timedelta(seconds=self.sync_timeout_s),
            connect_timeout=timedelta(seconds=self.connect_timeout_s),
            step_timeout=timedelta(seconds=self.step_timeout_s),
        )
        return control, sync


@dataclass
class UpdateInfo:
    """One update (JSON in ``/update_weights``): the version the writers are sending."""

    version: int


class Receiver:
    """One engine worker as a weightbus reader: bind, connect, receive, refresh, close.

    ``model`` is the worker's live model, ``spec`` its canonical tensors, ``parallel`` where
    the worker sits (a :class:`VLLMParallel`, or SGLang's equivalent: anything with
    ``worker_index``, ``layout(spec, participant, dtype=)`` and ``checks()``). ``engine``
    prefixes the reader's name. Used by the native backend, :class:`WorkerExtension` and
    SGLang's custom loader.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        parallel: Any,
        device: torch.device | str,
        *,
        engine: str = "vllm",
        prefix: str = "",
        ignore: Iterable[str] = (),
    ) -> None:
        self.model, self.spec, self.parallel, self.engine = model, spec, parallel, engine
        self.device = torch.device(device)
        self.prefix, self.ignore = prefix, tuple(ignore)
        self.reader: Reader | None = None
        self.bound: BoundLayout | None = None
        self.last: SyncResult | None = None

    def connect(self, info: InitInfo) -> None:
        """Join the job; returns once every participant connected and agreed on the plan."""
        if self.reader is not None:
            raise WeightbusError(f"{self.reader.name}: already connected; shutdown first")
        rank = info.reader_rank_offset + self.parallel.worker_index
        if rank >= info.num_readers:
            raise ValueError(
                f"reader rank {rank} (offset {info.reader_rank_offset} + worker "
                f"{self.parallel.worker_index}) is not below num_readers={info.num_readers}: "
                "count every worker of every server in num_readers"
            )
        participant = Participant(
            role="reader",
            rank=rank,
            name=f"{self.engine}-{rank}",
            host=socket.gethostname(),
            device=str(self.device),
        )
        embed = dict(self.model.named_parameters()).get(self.prefix + "model.embed_tokens.weight")
        dtype = None if embed is None else dtype_name(embed.dtype)
        control, sync = info.configs()
        layout = self.parallel.layout(self.spec, participant, dtype=dtype)
        if sync.fp8 is not None:
            _check_fp8_blocks(layout, sync.fp8)
            layout = quantized_layout(layout, sync.fp8)
        bound = bind(
            self.model,
            layout,
            spec=self.spec,
            parallel=self.parallel.checks(),
            prefix=self.prefix,
            ignore=self.ignore,
            fp8=sync.fp8,
        )
        reader = Reader(bound, control, sync)
        reader.connect()
        self.reader, self.bound = reader, bound
        self.step_timeout = sync.step_timeout

    def receive(self, version: int) -> SyncResult:
        """Receive version ``version`` in place; returns once it is committed."""
        if self.reader is None:
            raise WeightbusError(
                "weightbus receiver is not connected: call init_weight_transfer_engine first"
            )
        result = self.reader.wait(self.step_timeout)
        if result.version != int(version):
            raise WeightbusError(
                f"{self.reader.name}: the trainer announced version {version} to the engine "
                f"but its writers sent {result.version}; drive every sync through "
                "VLLMWeightSync.sync so both agree"
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last = result
        return result

    def finish(self) -> None:
        """Refresh tensors the engine derived from the weights (DeepSeek's MLA); check the FP8
        parameters are still the ones written (vLLM's FP8 post-load processing is not re-run:
        see "FP8" in the module docstring)."""
        with torch.no_grad():
            refresh_derived(self.model)
        if self.bound is not None:
            check_fp8_bound(self.model, self.bound, self.prefix)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        self.bound = None


def parallel_from_vllm(vllm_config: Any) -> VLLMParallel:
    """This worker's :class:`VLLMParallel`, read from vLLM's config and process groups."""
    from vllm.distributed import get_tensor_model_parallel_rank

    pc = vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) != 1:
        raise NotImplementedError(
            f"pipeline_parallel_size={pc.pipeline_parallel_size}: weightbus' vLLM backend "
            "supports tensor, data and expert parallel engines only"
        )
    dp = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp_rank = getattr(pc, "data_parallel_rank", None)
    if dp_rank is None:
        dp_rank = getattr(pc, "data_parallel_index", 0)
    return VLLMParallel(
        tp=int(pc.tensor_parallel_size),
        tp_rank=int(get_tensor_model_parallel_rank()),
        dp=dp,
        dp_rank=int(dp_rank or 0) if dp > 1 else 0,
        enable_expert_parallel=bool(getattr(pc, "enable_expert_parallel", False)),
        expert_placement=str(getattr(pc, "expert_placement_strategy", "linear") or "linear"),
    )


def spec_from_vllm(vllm_config: Any) -> ModelSpec:
    """The served model's canonical tensors, from vLLM's Hugging Face config."""
    hf = vllm_config.model_config.hf_config
    return model_spec(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))


# ---------------------------------------------------------------------------------------------
# vLLM's native weight-transfer API
# ---------------------------------------------------------------------------------------------


class _Backend:
    """The weightbus weight-transfer backend; :func:`register` mixes it into vLLM's
    ``WeightTransferEngine`` (see the module docstring for the lifecycle)."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any = None, model: Any = None):
        if model is None:
            raise NotImplementedError(
                "this vLLM gives weight-transfer backends no model (the API before v0.25): "
                "use worker_extension_cls='weightbus.engines.vllm.WorkerExtension' instead"
            )
        self.config, self.vllm_config = config, vllm_config
        self.device, self.model = device, model
        self.receiver: Receiver | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        try:
            return InitInfo(**init_dict)
        except TypeError as e:
            raise ValueError(f"invalid weightbus init_info {sorted(init_dict)}: {e}") from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        try:
            return UpdateInfo(**update_dict)
        except TypeError as e:
            raise ValueError(f"invalid weightbus update_info {sorted(update_dict)}: {e}") from e

    def _make_receiver(self) -> Receiver:
        return Receiver(
            self.model,
            spec_from_vllm(self.vllm_config),
            parallel_from_vllm(self.vllm_config),
            self.device if self.device is not None else "cuda",
        )

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        receiver = self._make_receiver()
        receiver.connect(init_info)
        self.receiver = receiver

    def start_weight_update(self) -> None:
        # writes are in place: nothing to prepare
        if self.receiver is None:
            raise WeightbusError(
                "weightbus: start_weight_update before init_weight_transfer_engine"
            )

    def receive_weights(self, update_info: UpdateInfo, *_: Any) -> None:
        if self.receiver is None:
            raise WeightbusError("weightbus: update_weights before init_weight_transfer_engine")
        self.receiver.receive(update_info.version)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        if self.receiver is not None:
            self.receiver.finish()

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        raise NotImplementedError("weightbus does not update speculative draft models")

    def reset_weight_update_target(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise NotImplementedError(
            "weightbus sends from every trainer rank through weightbus.Writer: use "
            "weightbus.engines.vllm.VLLMWeightSync on the trainer"
        )


_ENGINE_CLASS: type | None = None


def engine_class() -> type:
    """The backend as a subclass of vLLM's ``WeightTransferEngine`` (needs vLLM)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine

        _ENGINE_CLASS = type(
            "WeightbusTransferEngine",
            (_Backend, WeightTransferEngine),
            {"__module__": __name__, "__doc__": _Backend.__doc__},
        )
    return _ENGINE_CLASS


def register() -> None:
    """vLLM plugin entry point: register the ``"weightbus"`` backend (safe to call repeatedly).

    Does nothing, with a debug log, on vLLM versions without ``WeightTransferEngineFactory``.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        logger.debug("vLLM has no WeightTransferEngineFactory; weightbus backend not registered")
        return
    if BACKEND in getattr(WeightTransferEngineFactory, "_registry", {}):
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_class())
    except ValueError:
        pass  # registered by another import of this plugin meanwhile


# ---------------------------------------------------------------------------------------------
# older vLLM: worker extension + collective_rpc
# ---------------------------------------------------------------------------------------------


class WorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; called through ``collective_rpc``.

    ``llm.collective_rpc("weightbus_init", args=(init_info_dict,))``, then per sync
    ``weightbus_receive(version)`` and ``weightbus_finish()``; ``weightbus_close()`` at the end.
    """

    def weightbus_init(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank  # noqa: F401  (vLLM check)

        info = InitInfo(**init_info)
        model = self.model_runner.model  # type: ignore[attr-defined]
        receiver = Receiver(
            model,
            spec_from_vllm(self.vllm_config),  # type: ignore[attr-defined]
            parallel_from_vllm(self.vllm_config),  # type: ignore[attr-defined]
            getattr(self, "device", "cuda"),
        )
        receiver.connect(info)
        self._weightbus = receiver

    def weightbus_receive(self, version: int) -> int:
        return self._weightbus_receiver().receive(version).version

    def weightbus_finish(self) -> None:
        self._weightbus_receiver().finish()

    def weightbus_close(self) -> None:
        receiver = getattr(self, "_weightbus", None)
        if receiver is not None:
            receiver.close()
            self._weightbus = None

    def _weightbus_receiver(self) -> Receiver:
        receiver = getattr(self, "_weightbus", None)
        if receiver is None:
            raise WeightbusError("weightbus: call collective_rpc('weightbus_init', ...) first")
        return receiver


# ---------------------------------------------------------------------------------------------
# the trainer side
# ---------------------------------------------------------------------------------------------


class VLLMServer:
    """vLLM's RLHF HTTP routes (JSON only), for one server (all its data-parallel replicas).

    ``timeout`` bounds every request; ``update`` and ``init`` block until the workers have
    received, so they get ``long_timeout``.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: timedelta = timedelta(seconds=60),
        long_timeout: timedelta = timedelta(minutes=35),
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout, self.long_timeout = timeout, long_timeout

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        long: bool = False,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        limit = (self.long_timeout if long else self.timeout).total_seconds()
        try:
            with urllib.request.urlopen(request, timeout=limit) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise WeightbusError(
                f"vLLM server {self.url}: {method} {path} answered {e.code}: {detail}"
                + (
                    " (the RLHF routes need VLLM_SERVER_DEV_MODE=1 on the server)"
                    if e.code == 404
                    else ""
                )
            ) from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise WeightbusError(
                f"vLLM server {self.url}: {method} {path} failed after at most {limit:.0f} s: {e}"
            ) from e
        return json.loads(text)

    def world_size(self, include_dp: bool = True) -> int:
        query = "true" if include_dp else "false"
        return int(self._call("GET", f"/get_world_size?include_dp={query}")["world_size"])

    def init(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info}, long=True)

    def pause(self, mode: str = "wait") -> None:
        self._call("POST", f"/pause?mode={mode}")

    def resume(self) -> None:
        self._call("POST", "/resume")

    def start(self) -> None:
        self._call("POST", "/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        self._call("POST", "/update_weights", {"update_info": update_info}, long=True)

    def finish(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._call("POST", "/finish_weight_update", body)


class CollectiveRPC:
    """The same calls as :class:`VLLMServer` for an in-process ``vllm.LLM`` built with
    ``worker_extension_cls="weightbus.engines.vllm.WorkerExtension"`` (older vLLM)."""

    def __init__(self, llm: Any, *, world_size: int) -> None:
        self.llm, self._world_size = llm, world_size

    def world_size(self, include_dp: bool = True) -> int:
        return self._world_size

    def init(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("weightbus_init", args=(init_info,))

    def pause(self, mode: str = "wait") -> None:
        pass  # an in-process LLM generates only when called

    def resume(self) -> None:
        pass

    def start(self) -> None:
        pass

    def update(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("weightbus_receive", args=(int(update_info["version"]),))

    def finish(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("weightbus_finish")


class VLLMWeightSync:
    """A trainer rank's side of syncing into vLLM servers: weightbus' Writer plus, on writer
    rank 0, the vLLM routes that make every worker receive.

    >>> sync = VLLMWeightSync(bound, control, SyncConfig(cast={"float32": "bfloat16"}),
    ...                       servers=["http://infer0:8000"])   # servers on writer 0 only
    >>> sync.connect()
    >>> for step in range(steps):
    ...     train_step()
    ...     sync.sync(step)

    Every writer rank constructs one (with ``servers`` only on rank 0) and calls
    :meth:`connect` and :meth:`sync` together. ``control.num_readers`` must count every worker
    of every server; ``pause_mode`` (``"wait"``, ``"abort"``, ``"keep"`` or None for no pause)
    is how the servers treat in-flight requests while weights change.
    """

    def __init__(
        self,
        bound: BoundLayout,
        control: ControlConfig,
        sync: SyncConfig | None = None,
        *,
        servers: Sequence[str | VLLMServer | CollectiveRPC] = (),
        pause_mode: str | None = "wait",
    ) -> None:
        self.sync_config = sync or SyncConfig()
        self.control = control
        self.writer = Writer(bound, control, self.sync_config)
        self.servers = [VLLMServer(s) if isinstance(s, str) else s for s in servers]
        if self.servers and bound.layout.rank != 0:
            raise ValueError(
                f"writer rank {bound.layout.rank} was given servers: only writer rank 0 drives "
                "the vLLM routes; pass servers=() on the other ranks"
            )
        if pause_mode not in (None, "wait", "abort", "keep"):
            raise ValueError(f"pause_mode={pause_mode!r}: use 'wait', 'abort', 'keep' or None")
        self.pause_mode = pause_mode

    def _both(self, call: Callable[[Any], None], local: Callable[[], Any]) -> Any:
        """Run ``call(server)`` for every server on threads while ``local()`` runs here."""
        return beside([functools.partial(call, s) for s in self.servers], local)

    def connect(self) -> None:
        """Connect the writer and, from rank 0, every server's workers (they connect together)."""
        offsets, total = [], 0
        for server in self.servers:
            offsets.append(total)
            total += server.world_size(include_dp=True)
        if self.servers and total > self.control.num_readers:
            raise ValueError(
                f"the servers have {total} workers but control.num_readers="
                f"{self.control.num_readers}: count every worker (tp * dp of each server)"
            )
        infos = {
            id(s): asdict(
                InitInfo.from_configs(self.control, self.sync_config, reader_rank_offset=o)
            )
            for s, o in zip(self.servers, offsets, strict=True)
        }
        self._both(lambda s: s.init(infos[id(s)]), self.writer.connect)

    def sync(self, version: int) -> SyncResult:
        """Send ``version``; returns once every reader has it and the servers finished the update."""
        version = int(version)
        if self.pause_mode is not None:
            for s in self.servers:
                s.pause(self.pause_mode)
        try:
            for s in self.servers:
                s.start()
            result = self._both(
                lambda s: s.update(asdict(UpdateInfo(version=version))),
                lambda: self.writer.sync(version),
            )
            for s in self.servers:
                s.finish(str(version))
        finally:
            if self.pause_mode is not None:
                for s in self.servers:
                    s.resume()
        return result

    def close(self) -> None:
        self.writer.close()
