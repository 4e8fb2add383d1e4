"""Engine layouts checked bit for bit against a reference of the engines' own weight loaders.

For each model family and engine parallel setting, every engine rank is computed two ways:

* the reference (:mod:`tests.engine_reference`): the engine's parallel layers re-stated from
  vLLM's / SGLang's loader code, loading a Hugging Face checkpoint written by transformers'
  ``save_pretrained`` (names and shapes from transformers, values random);
* weightbus: writers holding the checkpoint FSDP-sharded over two ranks (float32), the
  engine ranks' layouts from :func:`weightbus.engines.vllm.vllm_layout` /
  :func:`weightbus.engines.sglang.sglang_layout`, one plan, run by the reference executor
  into poisoned (NaN) bfloat16 parameters.

They must agree bit for bit on every element the engine loads from the checkpoint; the vocab
padding rows (which the engine zero-fills at load) must be left untouched by weightbus. The
parameter names, shapes and dtypes must be the engine's.
"""

from __future__ import annotations

import functools
import glob
import json
import tempfile

import numpy as np
import pytest
import torch

from tests.engine_reference import (
    DATA,
    PADDING,
    BlockShapeError,
    EngineRank,
    EngineRankModel,
    QKVParallel,
    engine_rank_fp8_params,
    engine_rank_params,
)
from tests.layout_fixtures import QWEN3_MOE
from tests.test_codec_fp8 import reference_quantize
from weightbus.codecs.fp8 import Fp8Config, quantized_layout, scale_name
from weightbus.engines import vllm as wv
from weightbus.engines.sglang import SGLangParallel, sglang_layout
from weightbus.engines.vllm import VLLMParallel, vllm_fp8_layout, vllm_layout
from weightbus.errors import WeightbusError
from weightbus.layouts.families import model_spec
from weightbus.layouts.fsdp import fsdp_layout
from weightbus.plan import PlanOptions, allocate, execute, fill_from_canonical, make_plan
from weightbus.spec import LayoutError, Participant

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.engine_layouts, pytest.mark.timeout(120)]

# -- model configs (small; every head/expert count chosen to exercise a rule) -----------------

LLAMA = {  # 8 q heads, 2 kv heads: tp 4 and 8 replicate each kv head
    "model_type": "llama",
    "vocab_size": 100,  # padded to 128: tp 8 leaves the last shard all padding
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 4,
}
CONFIGS = {
    "llama": LLAMA,
    "llama_mha": {**LLAMA, "num_key_value_heads": 8},
    "llama_bias": {**LLAMA, "attention_bias": True, "mlp_bias": True},
    "qwen2": {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 2},
    "qwen3_tied": {**LLAMA, "model_type": "qwen3", "tie_word_embeddings": True},
    "qwen3_moe": {**QWEN3_MOE, "num_experts_per_tok": 2},
    "mixtral": {
        "model_type": "mixtral",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "deepseek": {
        "model_type": "deepseek_v3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 2,
        "v_head_dim": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
}
CONFIGS["deepseek_no_q_lora"] = {**CONFIGS["deepseek"], "q_lora_rank": None}

# block-FP8 models: every tensor-parallel shard vLLM accepts must be whole 128-blocks, so these
# are wider (head_dim 128); tp 4 still replicates the 2 kv heads.
LLAMA_FP8 = {
    **LLAMA,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "head_dim": 128,
}
CONFIGS["llama_fp8"] = LLAMA_FP8
CONFIGS["llama_fp8_h64"] = {**LLAMA_FP8, "head_dim": 64}  # tp 2: 64 rows of k per rank
CONFIGS["qwen3_moe_fp8"] = {
    **CONFIGS["qwen3_moe"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 1,
    "head_dim": 128,
    "num_experts": 4,
    "mlp_only_layers": [],
}
CONFIGS["deepseek_fp8"] = {  # fused_qkv_a_proj's last component (128 + 64 rows) ends mid-block
    **CONFIGS["deepseek"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 1,
    "first_k_dense_replace": 0,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
}


@functools.cache
def _checkpoint(name: str) -> tuple[object, dict[str, torch.Tensor]]:
    """The transformers config and a checkpoint of it: names and shapes as ``save_pretrained``
    writes them, values random float32."""
    config = dict(CONFIGS[name])
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved: dict[str, torch.Tensor] = {}
        for path in sorted(glob.glob(f"{tmp}/*.safetensors")):
            saved.update(safetensors_torch.load_file(path))
    g = torch.Generator().manual_seed(hash(name) % 1000)
    checkpoint = {k: torch.randn(v.shape, generator=g) for k, v in sorted(saved.items())}
    return hf_config, checkpoint


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _check(name: str, engine: str, ranks: list[tuple[EngineRank, object]]) -> None:
    """Plan FSDP(2) float32 writers -> these engine ranks (bf16), execute, compare."""
    hf_config, checkpoint = _checkpoint(name)
    spec = model_spec(CONFIGS[name])
    canonical = {t.name: tuple(t.shape) for t in spec.tensors}
    assert canonical == {k: tuple(v.shape) for k, v in checkpoint.items()}, (
        "weightbus' canonical tensors differ from what transformers saves"
    )
    writers = [
        fsdp_layout(
            spec, Participant(role="writer", rank=r), shard=2, shard_rank=r, dtype="float32"
        )
        for r in range(2)
    ]
    readers = []
    for i, (_, parallel) in enumerate(ranks):
        who = Participant(role="reader", rank=i)
        if engine == "vllm":
            readers.append(vllm_layout(spec, who, parallel))
        else:
            readers.append(sglang_layout(spec, who, parallel))
    plan = make_plan(
        writers, readers, PlanOptions(cast={"float32": "bfloat16"}, bucket_bytes=64 << 10)
    )
    source = [allocate(w) for w in writers]
    for lay, tensors in zip(writers, source, strict=True):
        fill_from_canonical(lay, checkpoint, tensors)
    got = [allocate(r) for r in readers]  # poisoned: NaN
    execute(plan, source, got)

    for (rank, _), tensors in zip(ranks, got, strict=True):
        params, masks = engine_rank_params(hf_config, checkpoint, rank, torch.bfloat16)
        where = f"{name} {rank}"
        assert {k: (tuple(v.shape), v.dtype) for k, v in params.items()} == {
            k: (tuple(v.shape), v.dtype) for k, v in tensors.items()
        }, f"{where}: parameter names, shapes or dtypes differ from the engine's"
        for key, want in params.items():
            have, mask = tensors[key], masks[key]
            data = mask == DATA
            same = _int_view(have)[data] == _int_view(want)[data]
            assert bool(same.all()), (
                f"{where}: {key} differs from the engine's loader at "
                f"{int((~same).sum())} of {int(data.sum())} elements"
            )
            padding = mask == PADDING
            assert bool(torch.isnan(have[padding].float()).all()), (
                f"{where}: weightbus wrote into {key}'s vocab padding"
            )


def _vllm_ranks(**kw) -> list[tuple[EngineRank, VLLMParallel]]:
    tp, dp = kw.get("tp", 1), kw.get("dp", 1)
    out = []
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            common = {**kw, "tp_rank": tp_rank, "dp_rank": dp_rank}
            placement = common.pop("placement", "linear")
            pad = common.pop("pad", 64)
            rank = EngineRank(
                engine="vllm", expert_placement=placement, vocab_padding=pad, **common
            )
            parallel = VLLMParallel(expert_placement=placement, vocab_pad=pad, **common)
            out.append((rank, parallel))
    return out


def _sglang_ranks(tp: int, ep: int = 1) -> list[tuple[EngineRank, SGLangParallel]]:
    return [
        (
            EngineRank(engine="sglang", tp=tp, tp_rank=r, ep=ep),
            SGLangParallel(tp=tp, tp_rank=r, ep=ep),
        )
        for r in range(tp)
    ]


# -- dense layers: QKV (GQA with and without KV replication), merged, row, vocab -------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_gqa(tp: int) -> None:
    # kv heads 2: tp 1, 2 split them; tp 4, 8 replicate each on tp / 2 ranks
    _check("llama", "vllm", _vllm_ranks(tp=tp))


@pytest.mark.parametrize("tp", [4, 8])
def test_llama_without_kv_replication(tp: int) -> None:
    _check("llama_mha", "vllm", _vllm_ranks(tp=tp))


@pytest.mark.parametrize("tp", [2, 8])
def test_biases(tp: int) -> None:
    # column biases split, replicated kv biases at tp 8, row biases whole
    _check("llama_bias", "vllm", _vllm_ranks(tp=tp))
    _check("qwen2", "vllm", _vllm_ranks(tp=tp))


@pytest.mark.parametrize("tp", [1, 4])
def test_qwen3_norms_and_tied_embeddings(tp: int) -> None:
    _check("qwen3_tied", "vllm", _vllm_ranks(tp=tp))


def test_vocab_padding_other_than_64() -> None:
    _check("llama", "vllm", _vllm_ranks(tp=4, pad=16))


def test_data_parallel_replicas_of_a_dense_model() -> None:
    _check("llama", "vllm", _vllm_ranks(tp=2, dp=2))


# -- FusedMoE: w13 / w2, expert parallel -----------------------------------------------------


@pytest.mark.parametrize(
    "tp, dp, ep",
    [
        (1, 1, False),
        (2, 1, False),  # experts split over tp
        (4, 1, False),
        (2, 1, True),  # ep 2, whole experts
        (4, 1, True),  # ep 4
        (1, 4, True),  # ep 4 across data-parallel replicas
        (2, 2, False),  # no ep, dp 2: experts split over tp * dp = 4 ranks
        (2, 2, True),  # ep 4 = tp * dp
        (1, 3, True),  # ep 3 does not divide 8 experts: 3, 3, 2
    ],
)
def test_qwen3_moe_vllm(tp: int, dp: int, ep: bool) -> None:
    _check("qwen3_moe", "vllm", _vllm_ranks(tp=tp, dp=dp, enable_expert_parallel=ep))


def test_round_robin_expert_placement() -> None:
    _check(
        "qwen3_moe",
        "vllm",
        _vllm_ranks(tp=4, enable_expert_parallel=True, placement="round_robin"),
    )


@pytest.mark.parametrize("tp, ep", [(2, False), (2, True), (1, False)])
def test_mixtral_vllm(tp: int, ep: bool) -> None:
    _check("mixtral", "vllm", _vllm_ranks(tp=tp, enable_expert_parallel=ep))


@pytest.mark.parametrize(
    "tp, dp, ep", [(1, 1, False), (2, 1, False), (4, 1, False), (4, 1, True), (2, 2, True)]
)
def test_deepseek_mla_vllm(tp: int, dp: int, ep: bool) -> None:
    _check("deepseek", "vllm", _vllm_ranks(tp=tp, dp=dp, enable_expert_parallel=ep))


def test_deepseek_without_q_lora() -> None:
    _check("deepseek_no_q_lora", "vllm", _vllm_ranks(tp=2, enable_expert_parallel=True))


# -- SGLang: the same layers, expert parallel as a divisor of tp ------------------------------


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_qwen3_moe_sglang(ep: int) -> None:
    _check("qwen3_moe", "sglang", _sglang_ranks(tp=4, ep=ep))


def test_sglang_dense_and_mla() -> None:
    _check("llama", "sglang", _sglang_ranks(tp=8))
    _check("deepseek", "sglang", _sglang_ranks(tp=2, ep=2))


# -- block FP8: FP8 weights and weight_scale_inv, as vLLM's Fp8LinearMethod / Fp8MoEMethod -----

FP8 = Fp8Config(block=128)


@functools.cache
def _fp8_checkpoint(name: str) -> dict[str, torch.Tensor]:
    """The block-FP8 checkpoint of model ``name`` (DeepSeek-V3 format): each quantized weight
    as float8_e4m3fn and its float32 ``weight_scale_inv``, from the codec's formula restated
    in numpy (tests/test_codec_fp8.py); the other tensors in bfloat16."""
    _, checkpoint = _checkpoint(name)
    out: dict[str, torch.Tensor] = {}
    for t in model_spec(CONFIGS[name]).tensors:
        x = checkpoint[t.name]
        if FP8.quantizes(t):
            q, s = reference_quantize(x, block=FP8.block)
            out[t.name] = torch.from_numpy(q).to(torch.float8_e4m3fn)
            out[scale_name(t.name)] = torch.from_numpy(s)
        else:
            out[t.name] = x.to(torch.bfloat16)
    return out


def _poison_nan(tensors: dict[str, torch.Tensor]) -> None:
    """NaN everywhere (0x7f is e4m3fn's NaN): no correct value can be left behind by chance."""
    for t in tensors.values():
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))


def _check_fp8(name: str, ranks: list[tuple[EngineRank, object]]) -> int:
    """FSDP(2) writers holding the FP8 checkpoint -> these vLLM ranks' FP8 wire layouts, one
    plan, executed into NaN-poisoned tensors, compared bit for bit with the reference loader.
    Returns how many FP8 and scale elements were compared."""
    hf_config, _ = _checkpoint(name)
    checkpoint = _fp8_checkpoint(name)
    spec = model_spec(CONFIGS[name])
    writers = [
        quantized_layout(
            fsdp_layout(
                spec, Participant(role="writer", rank=r), shard=2, shard_rank=r, dtype="bfloat16"
            ),
            FP8,
        )
        for r in range(2)
    ]
    readers = [
        vllm_fp8_layout(spec, Participant(role="reader", rank=i), parallel, FP8, dtype="bfloat16")
        for i, (_, parallel) in enumerate(ranks)
    ]
    plan = make_plan(writers, readers, PlanOptions(bucket_bytes=64 << 10))
    source = [allocate(w) for w in writers]
    for lay, tensors in zip(writers, source, strict=True):
        fill_from_canonical(lay, checkpoint, tensors)
    got = [allocate(r) for r in readers]
    for tensors in got:
        _poison_nan(tensors)
    execute(plan, source, got)

    compared = 0
    for (rank, _), tensors in zip(ranks, got, strict=True):
        params, masks = engine_rank_fp8_params(hf_config, checkpoint, rank, torch.bfloat16)
        where = f"{name} FP8 {rank}"
        assert {k: (tuple(v.shape), v.dtype) for k, v in params.items()} == {
            k: (tuple(v.shape), v.dtype) for k, v in tensors.items()
        }, f"{where}: parameter names, shapes or dtypes differ from the engine's"
        for key, want in params.items():
            have, data = tensors[key], masks[key] == DATA
            same = _int_view(have)[data] == _int_view(want)[data]
            assert bool(same.all()), (
                f"{where}: {key} differs from the engine's loader at "
                f"{int((~same).sum())} of {int(data.sum())} elements"
            )
            if want.dtype == torch.float8_e4m3fn or key.endswith("_scale_inv"):
                compared += int(data.sum())
            padding = masks[key] == PADDING
            assert bool(torch.isnan(have[padding].float()).all()), (
                f"{where}: weightbus wrote into {key}'s vocab padding"
            )
    return compared


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fp8_qkv_merged_row_with_kv_replication(tp: int) -> None:
    # tp 4 replicates each of the 2 kv heads (and its 128-row scale block) on 2 ranks
    assert _check_fp8("llama_fp8", _vllm_ranks(tp=tp)) > 0


@pytest.mark.parametrize("tp, ep", [(2, False), (2, True), (4, True)])
def test_fp8_fused_moe_w13_w2_scales_with_expert_parallel(tp: int, ep: bool) -> None:
    _check_fp8("qwen3_moe_fp8", _vllm_ranks(tp=tp, enable_expert_parallel=ep))


@pytest.mark.parametrize("tp, ep", [(2, False), (4, True)])
def test_fp8_deepseek_column_layers_and_a_merged_tail_ending_mid_block(tp: int, ep: bool) -> None:
    # q_b_proj / kv_b_proj are column parallel; fused_qkv_a_proj ([256, 192] rows, not split)
    # ends inside its second scale row, which vLLM allows for the last merged component
    _check_fp8("deepseek_fp8", _vllm_ranks(tp=tp, enable_expert_parallel=ep))


@pytest.mark.parametrize(
    "name, tp, ep, vllm_says",
    [
        # QKV: 64 rows of k per rank (head_dim 64, one kv head per rank)
        ("llama_fp8_h64", 2, False, "output_partition_size = 64 is not divisible by .* 128"),
        # merged column: gate_up_proj's 512 + 512 rows over tp 8 (down_proj's 64 input
        # columns per rank would be refused next, as row parallel)
        ("llama_fp8", 8, False, "gate_up_proj: .*output_partition_size = 64 is not divisible"),
        # FusedMoE: 256 intermediate rows over moe tp 4
        ("qwen3_moe_fp8", 4, False, "gate's and up's weight = 64 is not divisible by .* 128"),
    ],
)
def test_fp8_shard_cutting_a_block_is_refused_by_vllm_and_by_weightbus(
    name: str, tp: int, ep: bool, vllm_says: str
) -> None:
    hf_config, _ = _checkpoint(name)
    spec = model_spec(CONFIGS[name])
    refused = 0
    for rank, parallel in _vllm_ranks(tp=tp, enable_expert_parallel=ep):
        with pytest.raises(BlockShapeError, match=vllm_says):
            EngineRankModel(hf_config, rank, torch.bfloat16).to_block_fp8(128)
        with pytest.raises(LayoutError, match="cuts a 128-wide FP8 block.*vLLM refuses"):
            vllm_fp8_layout(spec, Participant(role="reader", rank=0), parallel, FP8)
        refused += 1
    assert refused == tp


def test_fp8_check_sees_scales_from_the_wrong_kv_head(monkeypatch) -> None:
    """A loader that gives each rank the other kv head's k scales (k_proj's two block rows
    swapped) must fail the comparison: the scale check is not vacuous."""
    original = QKVParallel.load

    def swapped_k_scales(self, attr, loaded, shard_id=None):
        if attr.endswith("_scale_inv") and shard_id == "k":
            loaded = loaded.flip(0)
        return original(self, attr, loaded, shard_id)

    monkeypatch.setattr(QKVParallel, "load", swapped_k_scales)
    with pytest.raises(AssertionError, match="qkv_proj.weight_scale_inv differs from the engine"):
        _check_fp8("llama_fp8", _vllm_ranks(tp=2))


# -- binding stand-ins of vLLM's block-FP8 layers ----------------------------------------------


class Fp8LinearMethod:  # named as vLLM names it; bind looks at the class name and attributes
    def __init__(self, block: int = 128, use_marlin: bool = False) -> None:
        self.weight_block_size = [block, block]
        self.use_marlin = use_marlin


class Fp8MoEMethod:
    def __init__(self, backend: str = "TRITON") -> None:
        self.weight_block_size = [128, 128]
        self.fp8_backend = backend


def _fp8_engine(name: str, parallel: VLLMParallel, moe_backend: str = "TRITON"):
    """A module tree whose parameters are the FP8 wire layout's local tensors, with FP8 quant
    methods on the layers vLLM quantizes."""
    spec = model_spec(CONFIGS[name])
    wire = vllm_fp8_layout(spec, Participant(role="reader", rank=0), parallel, FP8)
    root = torch.nn.Module()
    for local in wire.locals:
        *path, leaf = local.key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        data = torch.zeros(local.shape, dtype=getattr(torch, local.dtype))
        module.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
        if local.dtype == "float8_e4m3fn":
            experts = path[-1] == "experts"
            module.quant_method = Fp8MoEMethod(moe_backend) if experts else Fp8LinearMethod()
    return spec, wire, root


def test_bind_accepts_block_fp8_layers_and_checks_them_after_a_sync() -> None:
    spec, wire, model = _fp8_engine("qwen3_moe_fp8", VLLMParallel(tp=2))
    bound = wv.bind(model, wire, fp8=FP8)
    params = dict(model.named_parameters())
    assert all(bound.tensors[k].data_ptr() == params[k].data_ptr() for k in bound.tensors)
    assert "model.layers.0.mlp.experts.w13_weight_scale_inv" in bound.tensors
    checked = wv.check_fp8_bound(model, bound)
    assert checked == sum(
        1 for lt in wire.locals if lt.dtype == "float8_e4m3fn" or lt.key.endswith("_scale_inv")
    )
    # vLLM re-registering a scale (its post-load processing run again) is caught
    attn = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    attn.weight_scale_inv = torch.nn.Parameter(attn.weight_scale_inv.data.clone())
    with pytest.raises(WeightbusError, match="qkv_proj.weight_scale_inv.*no longer the tensor"):
        wv.check_fp8_bound(model, bound)


def test_bind_refuses_fp8_it_cannot_write_in_place() -> None:
    spec, wire, model = _fp8_engine("qwen3_moe_fp8", VLLMParallel(tp=2))
    with pytest.raises(LayoutError, match="block-FP8.*FP8 is off.*Fp8Config\\(block=128\\)"):
        wv.bind(model, wire)
    with pytest.raises(LayoutError, match="blocks are 128 wide.*Fp8Config.block is 64"):
        wv.bind(model, wire, fp8=Fp8Config(block=64))
    _, _, flashinfer = _fp8_engine("qwen3_moe_fp8", VLLMParallel(tp=2), moe_backend="FLASHINFER")
    with pytest.raises(NotImplementedError, match="experts.*FLASHINFER.*Triton FP8 MoE backend"):
        wv.bind(flashinfer, wire, fp8=FP8)
    model.get_submodule("model.layers.0.self_attn.o_proj").quant_method = Fp8LinearMethod(
        use_marlin=True
    )
    with pytest.raises(NotImplementedError, match="o_proj.*Marlin"):
        wv.bind(model, wire, fp8=FP8)
    # scales re-laid out after loading (DeepGEMM's MN-major layout): not contiguous
    _, _, relaid = _fp8_engine("qwen3_moe_fp8", VLLMParallel(tp=2))
    o_proj = relaid.get_submodule("model.layers.0.self_attn.o_proj")
    scale = o_proj.weight_scale_inv.data
    o_proj.weight_scale_inv = torch.nn.Parameter(scale.t().contiguous().t(), requires_grad=False)
    with pytest.raises(LayoutError, match="o_proj.weight_scale_inv.*not contiguous.*DeepGEMM"):
        wv.bind(relaid, wire, fp8=FP8)


def test_mla_refresh_dequantizes_a_block_fp8_kv_b_proj() -> None:
    """W_UK_T / W_UV come from q * s per block (the numpy reference), not the raw FP8 values."""
    heads, nope, v, kv_lora = 2, 64, 128, 192  # 384 x 192: a partial 128-block in each dim
    x = torch.randn(heads * (nope + v), kv_lora, generator=torch.Generator().manual_seed(3))
    q, s = reference_quantize(x, block=128)
    holder = torch.nn.Module()
    holder.kv_b_proj = torch.nn.Module()
    holder.kv_b_proj.weight = torch.nn.Parameter(
        torch.from_numpy(q).to(torch.float8_e4m3fn), requires_grad=False
    )
    holder.kv_b_proj.weight_scale_inv = torch.nn.Parameter(torch.from_numpy(s), requires_grad=False)
    holder.kv_b_proj.quant_method = Fp8LinearMethod()
    holder.W_UV = torch.full((heads, kv_lora, v), float("nan"), dtype=torch.bfloat16)
    holder.W_UK_T = torch.full((heads, nope, kv_lora), float("nan"), dtype=torch.bfloat16)
    assert wv.refresh_derived(holder) == 1
    rows = np.arange(q.shape[0]) // 128
    cols = np.arange(q.shape[1]) // 128
    w = torch.from_numpy(q * s.astype(np.float64)[np.ix_(rows, cols)]).float()
    per_head = w.t().reshape(kv_lora, heads, nope + v)
    want_uv = per_head[..., nope:].transpose(0, 1).to(torch.bfloat16)
    want_uk_t = per_head[..., :nope].permute(1, 2, 0).to(torch.bfloat16)
    assert torch.equal(holder.W_UV.view(torch.int16), want_uv.view(torch.int16))
    assert torch.equal(holder.W_UK_T.view(torch.int16), want_uk_t.view(torch.int16))


def test_init_info_carries_the_fp8_config() -> None:
    from weightbus._session import SyncConfig
    from weightbus.control.store import ControlConfig

    control = ControlConfig(num_writers=1, num_readers=1, address="h:1", host_store=False)
    fp8 = Fp8Config(scale_format="ue8m0", ahead=2, bucket_bytes=0, ignore=("*norm*",))
    info = wv.InitInfo.from_configs(control, SyncConfig(fp8=fp8))
    again = wv.InitInfo(**json.loads(json.dumps(info.__dict__)))
    assert again.configs()[1].fp8 == fp8  # every field, not only the defaults'
    assert again.configs()[1].codecs().key() == SyncConfig(fp8=fp8).codecs().key()
    with pytest.raises(ValueError, match="Fp8Config fields"):
        wv.InitInfo(store_address="h:1", num_writers=1, num_readers=1, fp8={"blok": 128})


# -- the reference itself ----------------------------------------------------------------------


def test_reference_sees_a_wrong_layout() -> None:
    """A layout that swaps the replicated KV heads of two ranks must fail the comparison:
    the check is not vacuous."""
    ranks = _vllm_ranks(tp=4)
    swapped = [ranks[0], (ranks[1][0], ranks[3][1]), ranks[2], (ranks[3][0], ranks[1][1])]
    with pytest.raises(AssertionError, match="differs from the engine's loader"):
        _check("llama", "vllm", swapped)


def test_configs_are_what_the_tests_claim() -> None:
    assert json.dumps(CONFIGS["llama"], sort_keys=True)  # plain data, no objects
    hf, _ = _checkpoint("qwen3_moe")
    assert hf.num_experts == 8 and hf.mlp_only_layers == [1]
