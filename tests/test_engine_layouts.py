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

import pytest
import torch

from tests.engine_reference import DATA, PADDING, EngineRank, engine_rank_params
from weightbus.engines.sglang import SGLangParallel, sglang_layout
from weightbus.engines.vllm import VLLMParallel, vllm_layout
from weightbus.layouts.families import model_spec
from weightbus.layouts.fsdp import fsdp_layout
from weightbus.plan import PlanOptions, allocate, execute, fill_from_canonical, make_plan
from weightbus.spec import Participant

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
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
    },
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
