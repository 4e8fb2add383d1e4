"""Model knowledge: the canonical tensors of a model family, how parallel engines split them,
and how vLLM names the parameters that hold them.

:func:`model_spec` turns a Hugging Face config (a dict, a ``config.json`` path, a checkpoint
directory, or a name from :data:`PRESETS`) into a :class:`ModelSpec`: every canonical tensor
exactly as the checkpoint names and shapes it, each with its *kind*:

``split``
    how tensor-parallel engines cut it. ``column``: dim 0 in ``tp`` equal parts (q/k/v, gate,
    up, MLA ``q_b_proj``/``kv_b_proj``, expert gate/up, and their biases). ``row``: dim 1
    (o_proj, down_proj, expert down). ``vocab``: dim 0 after padding the vocabulary
    (``embed_tokens``, ``lm_head``). ``replicated``: whole on every rank (norms, routers,
    row-parallel biases, MLA ``q_a_proj``/``kv_a_proj_with_mqa``, which both Megatron-core and
    vLLM keep unsplit).
``unit``
    the granule of the split dim that no cut may go through: ``head_dim`` for q/k/v and o_proj,
    ``qk_nope + qk_rope`` for ``q_b_proj``, ``qk_nope + v_head_dim`` for ``kv_b_proj``,
    ``v_head_dim`` for the MLA o_proj, 1 otherwise. ``size // unit`` must divide by ``tp``.
``role``
    the family-independent part it plays (one of :data:`ROLES`); ``layer`` and ``expert``
    index it (None outside a layer or an expert).
``group`` / ``member``
    the fused engine parameter it joins and its place there: ``qkv`` (q 0, k 1, v 2),
    ``gate_up`` (gate 0, up 1; dense and shared-expert MLPs), ``qkv_a`` (DeepSeek
    ``q_a_proj`` 0, ``kv_a_proj_with_mqa`` 1, only with ``q_lora_rank``), ``w13`` (expert gate 0,
    up 1), ``w2`` (expert down 0).

Within a layer, routed experts are stored expert-major, ``(gate, up, down)`` per expert, from
:attr:`LayerSpec.experts_start`; layout providers rely on that to handle a layer's experts as
arrays instead of one Python object at a time (DeepSeek-V3 has about 45,000 canonical tensors).

Family notes. qwen2 always has q/k/v biases; llama, qwen3 and qwen3_moe have q/k/v/o biases
with ``attention_bias`` and llama gate/up/down biases with ``mlp_bias``; qwen3* add per-head
``q_norm``/``k_norm`` (``head_dim`` defaults to 128 for qwen3, as transformers does). A
qwen3_moe layer is sparse unless listed in ``mlp_only_layers`` or ``(layer + 1) %
decoder_sparse_step != 0``. A deepseek_v3 layer is sparse from ``first_k_dense_replace`` on
when ``layer % moe_layer_freq == 0`` (vLLM's rule; 1 in every released config); its router
bias ``mlp.gate.e_score_correction_bias`` is float32 whatever the model dtype, as in the
checkpoint and in vLLM. DeepSeek's multi-token-prediction layer (``num_nextn_predict_layers``)
is not a canonical tensor: transformers and vLLM's main model skip it. FP8 checkpoints'
``weight_scale_inv`` tensors are out of scope: the canonical dtype is the model's (bf16) one.
``tie_word_embeddings`` drops ``lm_head.weight``.

vLLM names (:class:`NameTable`, one per family in :data:`NAME_TABLES`). A fused parameter
takes the name of its first member with the module replaced: ``...self_attn.q_proj.weight``
-> ``...self_attn.qkv_proj.weight`` (QKVParallelLinear), ``...mlp.gate_proj.weight`` and
``...mlp.shared_experts.up_proj.weight`` -> ``...gate_up_proj.weight``
(MergedColumnParallelLinear), DeepSeek ``q_a_proj``/``kv_a_proj_with_mqa`` ->
``fused_qkv_a_proj`` (replicated). Routed experts of a layer live in two stacked FusedMoE
parameters, ``<moe>.experts.w13_weight`` and ``<moe>.experts.w2_weight``, where ``<moe>`` is
``model.layers.N.mlp`` (``block_sparse_moe`` for mixtral, whose checkpoint experts are
``w1``=gate, ``w3``=up, ``w2``=down). Everything else keeps its checkpoint name (norms,
``mlp.gate.weight`` routers, ``embed_tokens``, ``lm_head``, ``o_proj``, ``down_proj``, MLA
``q_b_proj``/``kv_b_proj``, and ``q_proj``/``kv_a_proj_with_mqa`` when ``q_lora_rank`` is
None).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightbus.spec import TensorSpec, dtype_name

__all__ = [
    "FAMILIES",
    "GROUPS",
    "NAME_TABLES",
    "PRESETS",
    "ROLES",
    "SPLITS",
    "CanonicalTensor",
    "LayerSpec",
    "ModelSpec",
    "NameTable",
    "load_config",
    "model_spec",
]

SPLITS = ("column", "row", "replicated", "vocab")
"""How tensor-parallel engines cut a tensor (module docstring, ``split``)."""
GROUPS = ("qkv", "gate_up", "qkv_a", "w13", "w2")
"""Fused engine parameters a tensor can join (module docstring, ``group``)."""
ROLES = (
    "embed",
    "final_norm",
    "lm_head",
    "input_norm",
    "post_attn_norm",
    "q",
    "k",
    "v",
    "o",
    "q_norm",
    "k_norm",
    "q_a",
    "q_a_norm",
    "q_b",
    "kv_a",
    "kv_a_norm",
    "kv_b",
    "gate",
    "up",
    "down",
    "router",
    "router_bias",
    "shared_gate",
    "shared_up",
    "shared_down",
    "expert_gate",
    "expert_up",
    "expert_down",
)
"""Family-independent parts a canonical tensor can play (module docstring, ``role``)."""
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
"""Model families (``model_type`` values) weightbus knows."""

_SPLIT_DIM = {"column": 0, "vocab": 0, "row": 1, "replicated": None}


@dataclass(frozen=True, slots=True, kw_only=True)
class CanonicalTensor:
    """One canonical tensor and its kind (see the module docstring for each field)."""

    name: str
    """Checkpoint name."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """dtype name in the checkpoint."""
    split: str
    """How tensor-parallel engines cut it: one of :data:`SPLITS`."""
    role: str
    """The family-independent part it plays: one of :data:`ROLES`."""
    layer: int | None = None
    """Decoder layer index, None outside a layer."""
    expert: int | None = None
    """Routed expert index, None outside an expert."""
    group: str | None = None
    """Fused engine parameter it joins (one of :data:`GROUPS`), or None."""
    member: int = 0
    """Its place in that fused parameter (q 0, k 1, v 2; gate 0, up 1)."""
    unit: int = 1
    """Granule of the split dim no cut may go through (a head), 1 otherwise."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(v) for v in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.split not in SPLITS:
            raise ValueError(f"tensor {self.name!r}: split {self.split!r} is not one of {SPLITS}")
        if self.role not in ROLES:
            raise ValueError(f"tensor {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if self.group is not None and self.group not in GROUPS:
            raise ValueError(f"tensor {self.name!r}: group {self.group!r} is not one of {GROUPS}")
        dim = _SPLIT_DIM[self.split]
        if dim is not None and (dim >= len(self.shape) or self.shape[dim] % self.unit):
            raise ValueError(
                f"tensor {self.name!r} of shape {self.shape} cannot be split {self.split} "
                f"in units of {self.unit}"
            )

    @property
    def dim(self) -> int | None:
        """The dim tensor parallelism cuts, or None when replicated."""
        return _SPLIT_DIM[self.split]

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for v in self.shape:
            n *= v
        return n


_FIELDS = tuple(CanonicalTensor.__dataclass_fields__)
(
    _s_name,
    _s_shape,
    _s_dtype,
    _s_split,
    _s_role,
    _s_layer,
    _s_expert,
    _s_group,
    _s_member,
    _s_unit,
) = (CanonicalTensor.__dict__[f].__set__ for f in _FIELDS)


def _new_tensor(name, shape, dtype, split, role, layer, expert, group, member, unit):  # noqa: ANN001
    # A frozen dataclass's __init__ costs ~3 us (one object.__setattr__ per field); DeepSeek-V3
    # has ~45,000 tensors, so the builder fills the slots directly with values it has already
    # checked. Tests compare the result with the checked constructor.
    obj = object.__new__(CanonicalTensor)
    _s_name(obj, name)
    _s_shape(obj, shape)
    _s_dtype(obj, dtype)
    _s_split(obj, split)
    _s_role(obj, role)
    _s_layer(obj, layer)
    _s_expert(obj, expert)
    _s_group(obj, group)
    _s_member(obj, member)
    _s_unit(obj, unit)
    return obj


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSpec:
    """Where one decoder layer's tensors sit in :attr:`ModelSpec.tensors`.

    ``start:stop`` are all of its tensors. For a sparse layer, routed expert ``e``'s gate, up
    and down projections are tensors ``experts_start + 3 * e + (0, 1, 2)``; ``experts_start``
    is -1 in a dense layer.
    """

    index: int
    """Layer index."""
    start: int
    """First of the layer's tensors in :attr:`ModelSpec.tensors`."""
    stop: int
    """End (exclusive) of the layer's tensors."""
    experts_start: int = -1
    """First routed-expert tensor, -1 in a dense layer."""
    num_experts: int = 0
    """Routed experts in the layer."""

    @property
    def moe(self) -> bool:
        """Whether the layer has routed experts."""
        return self.experts_start >= 0

    @property
    def experts_stop(self) -> int:
        """End (exclusive) of the routed-expert tensors, -1 in a dense layer."""
        return self.experts_start + 3 * self.num_experts if self.moe else -1


@dataclass(frozen=True, slots=True, kw_only=True)
class NameTable:
    """How vLLM names the parameters of one family (see the module docstring).

    ``fused`` maps a fused group to the vLLM module that holds it, ``experts`` maps ``w13`` and
    ``w2`` to the stacked FusedMoE parameters, ``expert_leaves`` are the checkpoint's names for
    one expert's gate, up and down projections and ``moe_module`` the layer's MoE block.
    """

    family: str
    """The family (``model_type``)."""
    fused: tuple[tuple[str, str], ...] = (("qkv", "qkv_proj"), ("gate_up", "gate_up_proj"))
    """Fused group -> the vLLM module holding it."""
    experts: tuple[tuple[str, str], ...] = (("w13", "w13_weight"), ("w2", "w2_weight"))
    """Expert group -> the stacked FusedMoE parameter."""
    expert_leaves: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of one expert's gate, up and down projections."""
    moe_module: str = "mlp"
    """The layer's MoE block (``block_sparse_moe`` for mixtral)."""

    def engine_name(self, tensor: CanonicalTensor) -> str:
        """The vLLM parameter that holds ``tensor``."""
        group = tensor.group
        if group is None:
            return tensor.name
        for g, param in self.experts:
            if g == group:
                prefix = tensor.name[: tensor.name.rindex(".experts.")]
                return f"{prefix}.experts.{param}"
        for g, module in self.fused:
            if g == group:
                parent, _, param = tensor.name.rsplit(".", 2)
                return f"{parent}.{module}.{param}"
        raise KeyError(f"{self.family} name table has no vLLM parameter for group {group!r}")


NAME_TABLES: dict[str, NameTable] = {
    "llama": NameTable(family="llama"),
    "qwen2": NameTable(family="qwen2"),
    "qwen3": NameTable(family="qwen3"),
    "qwen3_moe": NameTable(family="qwen3_moe"),
    "mixtral": NameTable(
        family="mixtral",
        fused=(("qkv", "qkv_proj"),),
        expert_leaves=("w1", "w3", "w2"),
        moe_module="block_sparse_moe",
    ),
    "deepseek_v3": NameTable(
        family="deepseek_v3",
        fused=(("qkv_a", "fused_qkv_a_proj"), ("gate_up", "gate_up_proj")),
    ),
}
"""vLLM's parameter names, one :class:`NameTable` per family."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ModelSpec:
    """Every canonical tensor of one model, with its kind, and the dims it was built from.

    Build one with :func:`model_spec`. ``tensors`` is in a fixed order: ``embed_tokens``,
    each layer's tensors (see :class:`LayerSpec`), final norm, ``lm_head``.
    """

    family: str
    """Model family (one of :data:`FAMILIES`)."""
    dtype: str
    """Model dtype (canonical tensors use it unless the family pins another)."""
    vocab_size: int
    """Vocabulary size (unpadded)."""
    hidden_size: int
    """Hidden size."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Attention (query) heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Dimension of one attention head."""
    intermediate_size: int
    """Dense MLP intermediate size."""
    tie_word_embeddings: bool
    """Whether ``lm_head`` shares ``embed_tokens`` (no canonical ``lm_head.weight``)."""
    num_experts: int = 0
    """Routed experts per sparse layer (0: dense model)."""
    moe_intermediate_size: int = 0
    """Intermediate size of one routed expert."""
    shared_intermediate_size: int = 0
    """Intermediate size of the shared experts (0: none)."""
    q_lora_rank: int | None = None
    """MLA query low-rank dimension; None: no ``q_a_proj``."""
    kv_lora_rank: int = 0
    """MLA key/value low-rank dimension; 0: no multi-latent attention."""
    qk_nope_head_dim: int = 0
    """MLA per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA per-head query/key dims with rotary embedding."""
    v_head_dim: int = 0
    """MLA per-head value dims."""
    tensors: tuple[CanonicalTensor, ...] = ()
    """Every canonical tensor, in the order of the class docstring."""
    layers: tuple[LayerSpec, ...] = ()
    """Where each layer's tensors sit in :attr:`tensors`."""
    config: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """The config it was built from."""
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, dtype: str | None = None) -> ModelSpec:
        """Build from a Hugging Face config dict; ``dtype`` overrides the config's dtype."""
        return _build(config, dtype)

    @property
    def names(self) -> NameTable:
        """The vLLM name table of this model's family."""
        return NAME_TABLES[self.family]

    @property
    def mla(self) -> bool:
        """Multi-latent attention (DeepSeek) instead of q/k/v projections."""
        return self.kv_lora_rank > 0

    @property
    def num_params(self) -> int:
        """Elements over all canonical tensors."""
        return sum(t.numel for t in self.tensors)

    @property
    def embed(self) -> int:
        """Index of ``model.embed_tokens.weight``."""
        return 0

    @property
    def final_norm(self) -> int:
        """Index of ``model.norm.weight``."""
        return self.layers[-1].stop if self.layers else 1

    @property
    def lm_head(self) -> int | None:
        """Index of ``lm_head.weight``, None with tied embeddings."""
        return None if self.tie_word_embeddings else self.final_norm + 1

    def index(self, name: str) -> int:
        """Position of canonical tensor ``name`` in :attr:`tensors`."""
        by_name = self._cache.get("index")
        if by_name is None:
            by_name = self._cache["index"] = {t.name: i for i, t in enumerate(self.tensors)}
        try:
            return by_name[name]
        except KeyError:
            raise KeyError(
                f"{self.family} model has no canonical tensor {name!r} "
                f"({len(self.tensors)} tensors, e.g. {self.tensors[min(2, len(self.tensors) - 1)].name!r})"
            ) from None

    def tensor(self, name: str) -> CanonicalTensor:
        """The canonical tensor ``name`` (KeyError if the model has none)."""
        return self.tensors[self.index(name)]

    def specs(self, indices: Iterable[int], dtype: str | None = None) -> list[TensorSpec]:
        """The :class:`TensorSpec` of each tensor in ``indices``, cached on the model.

        ``dtype`` replaces the model dtype; tensors the family pins to another dtype (DeepSeek's
        float32 router bias) keep theirs.
        """
        key = ("specs", None if dtype is None else dtype_name(dtype))
        cache = self._cache.get(key)
        if cache is None:
            cache = self._cache[key] = [None] * len(self.tensors)
        ids: list[int] = np.asarray(indices, dtype=np.int64).tolist()
        out = [cache[i] for i in ids]
        for j, spec in enumerate(out):
            if spec is None:
                i = ids[j]
                t = self.tensors[i]
                out[j] = cache[i] = TensorSpec(
                    name=t.name, shape=t.shape, dtype=self.local_dtype(t, dtype)
                )
        return out

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``key`` for this model (layout providers' memo)."""
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = make()
            return value

    def local_dtype(self, tensor: CanonicalTensor, dtype: str | None) -> str:
        """``dtype`` for tensors in the model dtype, their own dtype for pinned ones."""
        if dtype is None or tensor.dtype != self.dtype:
            return tensor.dtype
        return dtype

    def engine_name(self, name: str) -> str:
        """The vLLM parameter that holds canonical tensor ``name``."""
        return self.names.engine_name(self.tensor(name))

    def canonical_names(self, engine_name: str) -> tuple[str, ...]:
        """The canonical tensors held by vLLM parameter ``engine_name``, in fused order."""
        table = self._cache.get("engine")
        if table is None:
            grouped: dict[str, list[tuple[int, int, str]]] = {}
            names = self.names
            for t in self.tensors:
                grouped.setdefault(names.engine_name(t), []).append(
                    (t.expert if t.expert is not None else -1, t.member, t.name)
                )
            table = self._cache["engine"] = {
                k: tuple(n for *_, n in sorted(v)) for k, v in grouped.items()
            }
        try:
            return table[engine_name]
        except KeyError:
            raise KeyError(
                f"{self.family} model has no vLLM parameter {engine_name!r}; "
                f"see weightbus.layouts.families.NAME_TABLES[{self.family!r}]"
            ) from None


# ---------------------------------------------------------------------------------------------
# building the tensor list
# ---------------------------------------------------------------------------------------------


def _get(config: Mapping[str, Any], key: str, default: Any = ...) -> Any:
    value = config.get(key, default)
    if value is ...:
        raise KeyError(
            f"{config.get('model_type')!r} config has no {key!r}: pass the model's full "
            "config.json (or use a preset from weightbus.layouts.families.PRESETS)"
        )
    return value


def _positive(name: str, value: Any, family: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{family} config: {name} must be a positive integer, got {value!r}")
    return value


class _Tensors:
    """Appends canonical tensors in order."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.items: list[CanonicalTensor] = []

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        split: str,
        role: str,
        layer: int | None = None,
        *,
        group: str | None = None,
        member: int = 0,
        unit: int = 1,
        dtype: str | None = None,
    ) -> None:
        self.items.append(
            CanonicalTensor(
                name=name,
                shape=shape,
                dtype=dtype or self.dtype,
                split=split,
                role=role,
                layer=layer,
                group=group,
                member=member,
                unit=unit,
            )
        )

    def experts(
        self, prefix: str, layer: int, n: int, leaves: tuple[str, str, str], h: int, i: int
    ) -> int:
        start = len(self.items)
        dtype, new, append = self.dtype, _new_tensor, self.items.append
        gate_shape, down_shape = (i, h), (h, i)
        g, u, d = (f".{leaf}.weight" for leaf in leaves)
        for e in range(n):
            p = f"{prefix}{e}"
            append(new(p + g, gate_shape, dtype, "column", "expert_gate", layer, e, "w13", 0, 1))
            append(new(p + u, gate_shape, dtype, "column", "expert_up", layer, e, "w13", 1, 1))
            append(new(p + d, down_shape, dtype, "row", "expert_down", layer, e, "w2", 0, 1))
        return start


def _mlp(b: _Tensors, p: str, layer: int, h: int, i: int, bias: bool, shared: bool = False) -> None:
    roles = ("shared_gate", "shared_up", "shared_down") if shared else ("gate", "up", "down")
    b.add(f"{p}.gate_proj.weight", (i, h), "column", roles[0], layer, group="gate_up", member=0)
    b.add(f"{p}.up_proj.weight", (i, h), "column", roles[1], layer, group="gate_up", member=1)
    b.add(f"{p}.down_proj.weight", (h, i), "row", roles[2], layer)
    if bias:
        b.add(f"{p}.gate_proj.bias", (i,), "column", roles[0], layer, group="gate_up", member=0)
        b.add(f"{p}.up_proj.bias", (i,), "column", roles[1], layer, group="gate_up", member=1)
        b.add(f"{p}.down_proj.bias", (h,), "replicated", roles[2], layer)


def _build(config: Mapping[str, Any], dtype: str | None) -> ModelSpec:
    # Tens of thousands of acyclic objects: with the cyclic collector running, its full passes
    # over everything already alive can double or triple the build time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_spec(config, dtype)
    finally:
        if enabled:
            gc.enable()


def _build_spec(config: Mapping[str, Any], dtype: str | None) -> ModelSpec:
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a mapping (a parsed config.json), got {type(config).__name__}"
        )
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)} "
            f"(presets: {', '.join(PRESETS)})"
        )
    c = config
    dtype = dtype_name(dtype or c.get("dtype") or c.get("torch_dtype") or "bfloat16")
    h = _positive("hidden_size", _get(c, "hidden_size"), family)
    vocab = _positive("vocab_size", _get(c, "vocab_size"), family)
    n_layers = _positive("num_hidden_layers", _get(c, "num_hidden_layers"), family)
    n_heads = _positive("num_attention_heads", _get(c, "num_attention_heads"), family)
    n_kv = c.get("num_key_value_heads") or n_heads
    n_kv = _positive("num_key_value_heads", n_kv, family)
    if n_heads % n_kv:
        raise ValueError(
            f"{family} config: num_attention_heads {n_heads} is not a multiple of "
            f"num_key_value_heads {n_kv}"
        )
    default_head_dim = 128 if family == "qwen3" else h // n_heads
    head_dim = _positive("head_dim", c.get("head_dim") or default_head_dim, family)
    inter = _positive("intermediate_size", _get(c, "intermediate_size"), family)
    tied = bool(c.get("tie_word_embeddings", False))
    names = NAME_TABLES[family]
    mla = family == "deepseek_v3"

    dims: dict[str, Any] = {}
    if mla:
        if c.get("attention_bias"):
            raise ValueError(
                "deepseek_v3 config: attention_bias=True is not supported (no released "
                "DeepSeek-V3 has it, and vLLM's fused_qkv_a_proj has no bias)"
            )
        q_lora = c.get("q_lora_rank")
        dims = {
            "q_lora_rank": None if q_lora is None else _positive("q_lora_rank", q_lora, family),
            "kv_lora_rank": _positive("kv_lora_rank", _get(c, "kv_lora_rank"), family),
            "qk_nope_head_dim": _positive("qk_nope_head_dim", _get(c, "qk_nope_head_dim"), family),
            "qk_rope_head_dim": _positive("qk_rope_head_dim", _get(c, "qk_rope_head_dim"), family),
            "v_head_dim": _positive("v_head_dim", _get(c, "v_head_dim"), family),
        }
    moe_layers: set[int] = set()
    n_experts = moe_i = shared_i = 0
    if family == "qwen3_moe":
        n_experts = int(c.get("num_experts") or 0)
        step = _positive("decoder_sparse_step", c.get("decoder_sparse_step", 1), family)
        dense_only = set(c.get("mlp_only_layers") or ())
        if n_experts > 0:
            moe_layers = {i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0}
    elif family == "mixtral":
        n_experts = _positive("num_local_experts", _get(c, "num_local_experts"), family)
        moe_layers = set(range(n_layers))
    elif family == "deepseek_v3":
        n_experts = int(c.get("n_routed_experts") or 0)
        first_dense = int(c.get("first_k_dense_replace") or 0)
        freq = _positive("moe_layer_freq", c.get("moe_layer_freq", 1), family)
        if n_experts > 0:
            moe_layers = {i for i in range(first_dense, n_layers) if i % freq == 0}
        shared_i = int(c.get("n_shared_experts") or 0) * int(c.get("moe_intermediate_size") or 0)
    if moe_layers:
        moe_i = inter if family == "mixtral" else _get(c, "moe_intermediate_size")
        moe_i = _positive("moe_intermediate_size", moe_i, family)

    qkv_bias = family == "qwen2" or (family != "mixtral" and bool(c.get("attention_bias")))
    o_bias = family in ("llama", "qwen3", "qwen3_moe") and bool(c.get("attention_bias"))
    mlp_bias = family == "llama" and bool(c.get("mlp_bias"))
    qk_norm = family in ("qwen3", "qwen3_moe")

    b = _Tensors(dtype)
    b.add("model.embed_tokens.weight", (vocab, h), "vocab", "embed")
    layers = []
    q_rows, kv_rows = n_heads * head_dim, n_kv * head_dim
    for i in range(n_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        start = len(b.items)
        b.add(f"{p}.input_layernorm.weight", (h,), "replicated", "input_norm", i)
        if mla:
            qk_head = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
            kv_lora, rope = dims["kv_lora_rank"], dims["qk_rope_head_dim"]
            q_lora = dims["q_lora_rank"]
            if q_lora is None:
                b.add(f"{a}.q_proj.weight", (n_heads * qk_head, h), "column", "q", i, unit=qk_head)
            else:
                b.add(f"{a}.q_a_proj.weight", (q_lora, h), "replicated", "q_a", i, group="qkv_a")
                b.add(f"{a}.q_a_layernorm.weight", (q_lora,), "replicated", "q_a_norm", i)
                b.add(
                    f"{a}.q_b_proj.weight",
                    (n_heads * qk_head, q_lora),
                    "column",
                    "q_b",
                    i,
                    unit=qk_head,
                )
            kv_group = None if q_lora is None else "qkv_a"
            b.add(
                f"{a}.kv_a_proj_with_mqa.weight",
                (kv_lora + rope, h),
                "replicated",
                "kv_a",
                i,
                group=kv_group,
                member=1 if kv_group else 0,
            )
            b.add(f"{a}.kv_a_layernorm.weight", (kv_lora,), "replicated", "kv_a_norm", i)
            kv_head = dims["qk_nope_head_dim"] + dims["v_head_dim"]
            b.add(
                f"{a}.kv_b_proj.weight",
                (n_heads * kv_head, kv_lora),
                "column",
                "kv_b",
                i,
                unit=kv_head,
            )
            v = dims["v_head_dim"]
            b.add(f"{a}.o_proj.weight", (h, n_heads * v), "row", "o", i, unit=v)
        else:
            for role, rows, m in (("q", q_rows, 0), ("k", kv_rows, 1), ("v", kv_rows, 2)):
                b.add(
                    f"{a}.{role}_proj.weight",
                    (rows, h),
                    "column",
                    role,
                    i,
                    group="qkv",
                    member=m,
                    unit=head_dim,
                )
            if qkv_bias:
                for role, rows, m in (("q", q_rows, 0), ("k", kv_rows, 1), ("v", kv_rows, 2)):
                    b.add(
                        f"{a}.{role}_proj.bias",
                        (rows,),
                        "column",
                        role,
                        i,
                        group="qkv",
                        member=m,
                        unit=head_dim,
                    )
            b.add(f"{a}.o_proj.weight", (h, q_rows), "row", "o", i, unit=head_dim)
            if o_bias:
                b.add(f"{a}.o_proj.bias", (h,), "replicated", "o", i)
            if qk_norm:
                b.add(f"{a}.q_norm.weight", (head_dim,), "replicated", "q_norm", i)
                b.add(f"{a}.k_norm.weight", (head_dim,), "replicated", "k_norm", i)
        b.add(f"{p}.post_attention_layernorm.weight", (h,), "replicated", "post_attn_norm", i)
        experts_start = -1
        if i in moe_layers:
            moe = f"{p}.{names.moe_module}"
            b.add(f"{moe}.gate.weight", (n_experts, h), "replicated", "router", i)
            if family == "deepseek_v3":
                b.add(
                    f"{moe}.gate.e_score_correction_bias",
                    (n_experts,),
                    "replicated",
                    "router_bias",
                    i,
                    dtype="float32",
                )
                if shared_i:
                    _mlp(b, f"{moe}.shared_experts", i, h, shared_i, bias=False, shared=True)
            experts_start = b.experts(
                f"{moe}.experts.", i, n_experts, names.expert_leaves, h, moe_i
            )
        else:
            _mlp(b, f"{p}.mlp", i, h, inter, mlp_bias)
        layers.append(
            LayerSpec(
                index=i,
                start=start,
                stop=len(b.items),
                experts_start=experts_start,
                num_experts=n_experts if experts_start >= 0 else 0,
            )
        )
    b.add("model.norm.weight", (h,), "replicated", "final_norm")
    if not tied:
        b.add("lm_head.weight", (vocab, h), "vocab", "lm_head")

    return ModelSpec(
        family=family,
        dtype=dtype,
        vocab_size=vocab,
        hidden_size=h,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=inter,
        tie_word_embeddings=tied,
        num_experts=n_experts if moe_layers else 0,
        moe_intermediate_size=moe_i,
        shared_intermediate_size=shared_i if moe_layers else 0,
        tensors=tuple(b.items),
        layers=tuple(layers),
        config=dict(config),
        **dims,
    )


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Kimi-K2 (about 1.03T parameters): the DeepSeek-V3 architecture with 384 routed experts,
    # 64 attention heads, one dense layer first; values from its published config.json
    # (model_type "kimi_k2" there, built here as deepseek_v3)
    "kimi-k2": {
        "model_type": "deepseek_v3",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
"""Configs by name (``model_spec("llama-3-8b")``): published shapes, no weights."""


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Hugging Face ``config.json`` (the file, or the checkpoint directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"no config.json at {str(p)!r}: pass the file or its checkpoint directory"
        )
    with p.open() as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{str(p)!r} holds a JSON {type(config).__name__}, not a config object")
    return config


def model_spec(
    source: str | os.PathLike[str] | Mapping[str, Any], *, dtype: str | None = None
) -> ModelSpec:
    """A :class:`ModelSpec` from a preset name, a config dict, or a ``config.json`` path.

    ``dtype`` overrides the config's ``torch_dtype`` (bfloat16 when the config has none).
    """
    if isinstance(source, Mapping):
        return ModelSpec.from_config(source, dtype=dtype)
    if isinstance(source, str) and source in PRESETS:
        return ModelSpec.from_config(PRESETS[source], dtype=dtype)
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).exists():
            raise KeyError(
                f"{str(source)!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                "config.json path"
            )
        return ModelSpec.from_config(load_config(source), dtype=dtype)
    raise TypeError(
        f"model_spec takes a preset name, a config dict or a config.json path, got {type(source).__name__}"
    )
