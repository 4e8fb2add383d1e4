"""Model families: canonical tensor lists, kinds, presets, vLLM name tables, configs."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from weightbus.layouts.families import (
    NAME_TABLES,
    PRESETS,
    CanonicalTensor,
    ModelSpec,
    load_config,
    model_spec,
)

TINY = {
    "llama": {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "llama-bias": {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": True,
        "mlp_bias": True,
    },
    "qwen2-tied": {
        "model_type": "qwen2",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "qwen3_moe-step2": {
        "model_type": "qwen3_moe",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
    },
    "mixtral": {
        "model_type": "mixtral",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
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
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
    },
    "deepseek_v3-no-q-lora": {
        "model_type": "deepseek_v3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 24,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 2,
        "v_head_dim": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
    },
}


# -- against the real thing ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY))
def test_tensor_list_matches_transformers_checkpoint(name: str) -> None:
    """Names and shapes equal what transformers would save (its fused experts reverted)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.core_model_loading import revert_weight_conversion

    config = dict(TINY[name])
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    saved = revert_weight_conversion(hf_model, dict(hf_model.state_dict()))
    expected = {k: tuple(v.shape) for k, v in saved.items()}
    if TINY[name].get("tie_word_embeddings"):
        del expected["lm_head.weight"]  # tied: save_pretrained drops it
    ours = model_spec(TINY[name])
    assert {t.name: t.shape for t in ours.tensors} == expected
    assert len(ours.tensors) == len(expected)


@pytest.mark.parametrize(
    "preset, params",
    [
        ("tiny-llama", 106_816),
        ("llama-3-8b", 8_030_261_248),
        ("qwen2-7b", 7_615_616_512),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("mixtral-8x7b", 46_702_792_704),
    ],
)
def test_preset_parameter_counts(preset: str, params: int) -> None:
    assert model_spec(preset).num_params == params


def test_deepseek_v3_size_and_build_time() -> None:
    times = []  # CPU time: other processes on a shared machine do not count
    for _ in range(3):
        t0 = time.process_time()
        model = model_spec("deepseek-v3")
        times.append(time.process_time() - t0)
    assert abs(model.num_params - 671e9) / 671e9 < 0.01, model.num_params
    # 61 layers x 9 attention/norm tensors, 3 dense MLPs, 58 MoE layers x (256 x 3 experts +
    # router + router bias + 3 shared), embed, norm, lm_head
    assert len(model.tensors) == 61 * 9 + 3 * 3 + 58 * (256 * 3 + 5) + 3 == 45395
    assert min(times) < 0.2, times
    bias = model.tensor("model.layers.3.mlp.gate.e_score_correction_bias")
    assert bias.dtype == "float32" and bias.shape == (256,)
    assert model.tensor("model.layers.2.mlp.gate_proj.weight").shape == (18432, 7168)
    assert model.tensor("model.layers.60.mlp.experts.255.down_proj.weight").shape == (7168, 2048)
    assert model.tensor("model.layers.3.mlp.shared_experts.up_proj.weight").shape == (2048, 7168)


# -- kinds --------------------------------------------------------------------------------------


def _kind(model: ModelSpec, name: str) -> tuple:
    t = model.tensor(name)
    return t.split, t.role, t.layer, t.expert, t.group, t.member, t.unit


def test_dense_kinds() -> None:
    m = model_spec(TINY["llama-bias"])  # head_dim 8
    a, p = "model.layers.1.self_attn", "model.layers.1.mlp"
    assert _kind(m, "model.embed_tokens.weight") == ("vocab", "embed", None, None, None, 0, 1)
    assert _kind(m, "lm_head.weight") == ("vocab", "lm_head", None, None, None, 0, 1)
    assert _kind(m, "model.norm.weight")[:2] == ("replicated", "final_norm")
    assert _kind(m, f"{a}.q_proj.weight") == ("column", "q", 1, None, "qkv", 0, 8)
    assert _kind(m, f"{a}.k_proj.bias") == ("column", "k", 1, None, "qkv", 1, 8)
    assert _kind(m, f"{a}.v_proj.weight") == ("column", "v", 1, None, "qkv", 2, 8)
    assert _kind(m, f"{a}.o_proj.weight") == ("row", "o", 1, None, None, 0, 8)
    assert _kind(m, f"{a}.o_proj.bias")[:2] == ("replicated", "o")
    assert _kind(m, f"{p}.gate_proj.weight") == ("column", "gate", 1, None, "gate_up", 0, 1)
    assert _kind(m, f"{p}.up_proj.bias") == ("column", "up", 1, None, "gate_up", 1, 1)
    assert _kind(m, f"{p}.down_proj.weight")[:2] == ("row", "down")
    assert _kind(m, f"{p}.down_proj.bias")[:2] == ("replicated", "down")
    assert _kind(m, "model.layers.0.input_layernorm.weight")[:3] == ("replicated", "input_norm", 0)
    assert m.tensor("model.embed_tokens.weight").dim == 0
    assert m.tensor(f"{a}.o_proj.weight").dim == 1
    assert m.tensor("model.norm.weight").dim is None


def test_family_specific_tensors() -> None:
    qwen2 = model_spec(TINY["qwen2-tied"])
    assert qwen2.tensor("model.layers.0.self_attn.q_proj.bias").shape == (32,)
    assert qwen2.tensor("model.layers.0.self_attn.k_proj.bias").shape == (16,)
    with pytest.raises(KeyError, match="o_proj.bias"):
        qwen2.tensor("model.layers.0.self_attn.o_proj.bias")
    assert qwen2.lm_head is None and "lm_head.weight" not in {t.name for t in qwen2.tensors}

    qwen3 = model_spec(TINY["qwen3"])
    assert qwen3.head_dim == 16
    assert qwen3.tensor("model.layers.1.self_attn.q_proj.weight").shape == (64, 32)
    assert _kind(qwen3, "model.layers.1.self_attn.q_norm.weight")[:2] == ("replicated", "q_norm")
    assert qwen3.tensor("model.layers.1.self_attn.k_norm.weight").shape == (16,)
    assert not any(".bias" in t.name for t in qwen3.tensors)
    default = dict(TINY["qwen3"])
    del default["head_dim"]
    assert model_spec(default).head_dim == 128  # transformers' Qwen3Config default

    moe = model_spec(TINY["qwen3_moe"])  # mlp_only_layers=[1]
    assert [layer.moe for layer in moe.layers] == [True, False, True, True]
    assert moe.tensor("model.layers.1.mlp.gate_proj.weight").shape == (24, 32)
    assert _kind(moe, "model.layers.2.mlp.gate.weight")[:2] == ("replicated", "router")
    assert _kind(moe, "model.layers.2.mlp.experts.3.up_proj.weight") == (
        "column",
        "expert_up",
        2,
        3,
        "w13",
        1,
        1,
    )
    assert _kind(moe, "model.layers.2.mlp.experts.0.down_proj.weight")[:6] == (
        "row",
        "expert_down",
        2,
        0,
        "w2",
        0,
    )
    step2 = model_spec(TINY["qwen3_moe-step2"])
    assert [layer.moe for layer in step2.layers] == [False, True, False, True]

    mixtral = model_spec(TINY["mixtral"])
    e = "model.layers.0.block_sparse_moe.experts.2"
    assert _kind(mixtral, f"{e}.w1.weight")[1:6] == ("expert_gate", 0, 2, "w13", 0)
    assert _kind(mixtral, f"{e}.w3.weight")[1:6] == ("expert_up", 0, 2, "w13", 1)
    assert _kind(mixtral, f"{e}.w2.weight")[1:6] == ("expert_down", 0, 2, "w2", 0)
    assert mixtral.moe_intermediate_size == 24

    ds = model_spec(TINY["deepseek_v3"])
    a = "model.layers.1.self_attn"
    assert [layer.moe for layer in ds.layers] == [False, True, True]
    assert _kind(ds, f"{a}.q_a_proj.weight") == ("replicated", "q_a", 1, None, "qkv_a", 0, 1)
    assert _kind(ds, f"{a}.kv_a_proj_with_mqa.weight") == (
        "replicated",
        "kv_a",
        1,
        None,
        "qkv_a",
        1,
        1,
    )
    assert _kind(ds, f"{a}.q_b_proj.weight") == ("column", "q_b", 1, None, None, 0, 6)
    assert _kind(ds, f"{a}.kv_b_proj.weight") == ("column", "kv_b", 1, None, None, 0, 8)
    assert _kind(ds, f"{a}.o_proj.weight") == ("row", "o", 1, None, None, 0, 4)
    assert _kind(ds, "model.layers.1.mlp.gate.e_score_correction_bias")[:2] == (
        "replicated",
        "router_bias",
    )
    assert _kind(ds, "model.layers.1.mlp.shared_experts.gate_proj.weight")[:5] == (
        "column",
        "shared_gate",
        1,
        None,
        "gate_up",
    )
    assert ds.tensor("model.layers.1.mlp.shared_experts.down_proj.weight").shape == (32, 16)
    no_lora = model_spec(TINY["deepseek_v3-no-q-lora"])
    assert _kind(no_lora, "model.layers.0.self_attn.q_proj.weight")[:5] == (
        "column",
        "q",
        0,
        None,
        None,
    )
    assert no_lora.tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").group is None


def test_router_bias_keeps_float32_under_dtype_override() -> None:
    ds = model_spec(TINY["deepseek_v3"], dtype="float16")
    assert ds.dtype == "float16"
    assert ds.tensor("model.layers.1.mlp.gate.weight").dtype == "float16"
    assert ds.tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "float32"
    i = ds.index("model.layers.1.mlp.gate.e_score_correction_bias")
    j = ds.index("model.layers.1.mlp.gate.weight")
    assert [s.dtype for s in ds.specs([i, j], "float32")] == ["float32", "float32"]
    assert [s.dtype for s in ds.specs([i, j], "bfloat16")] == ["float32", "bfloat16"]
    assert model_spec(TINY["llama"]).dtype == "bfloat16"  # no torch_dtype in the config
    assert model_spec({**TINY["llama"], "torch_dtype": "float32"}).dtype == "float32"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_layer_index_arithmetic(name: str) -> None:
    m = model_spec(TINY[name])
    assert m.tensors[m.embed].name == "model.embed_tokens.weight"
    assert m.tensors[m.final_norm].name == "model.norm.weight"
    assert m.tensors[m.lm_head].name == "lm_head.weight"
    position = 1
    for layer in m.layers:
        assert layer.start == position
        position = layer.stop
        assert {m.tensors[i].layer for i in range(layer.start, layer.stop)} == {layer.index}
        if not layer.moe:
            assert not any(m.tensors[i].expert is not None for i in range(layer.start, layer.stop))
            continue
        roles = ("expert_gate", "expert_up", "expert_down")
        for e in range(layer.num_experts):
            for j, role in enumerate(roles):
                t = m.tensors[layer.experts_start + 3 * e + j]
                assert (t.expert, t.role) == (e, role)
        outside = [*range(layer.start, layer.experts_start), *range(layer.experts_stop, layer.stop)]
        assert all(m.tensors[i].expert is None for i in outside)
    assert position == m.final_norm


def test_fast_constructed_tensors_equal_checked_ones() -> None:
    for config in (TINY["qwen3_moe"], TINY["deepseek_v3"], TINY["mixtral"]):
        for t in model_spec(config).tensors:
            fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
            assert CanonicalTensor(**fields) == t


def test_canonical_tensor_checks() -> None:
    kw = {"name": "w", "shape": (8, 4), "dtype": "bfloat16", "role": "q"}
    with pytest.raises(ValueError, match="split 'diagonal'"):
        CanonicalTensor(split="diagonal", **kw)
    with pytest.raises(ValueError, match="cannot be split row in units of 3"):
        CanonicalTensor(split="row", unit=3, **kw)
    with pytest.raises(ValueError, match="role 'x'"):
        CanonicalTensor(**{**kw, "role": "x"}, split="column")
    with pytest.raises(TypeError, match="not supported"):
        CanonicalTensor(**{**kw, "dtype": "complex64"}, split="column")


# -- vLLM names ---------------------------------------------------------------------------------


def test_engine_names() -> None:
    llama = model_spec(TINY["llama-bias"])
    a = "model.layers.0.self_attn"
    assert llama.engine_name(f"{a}.k_proj.weight") == f"{a}.qkv_proj.weight"
    assert llama.engine_name(f"{a}.v_proj.bias") == f"{a}.qkv_proj.bias"
    assert llama.engine_name(f"{a}.o_proj.weight") == f"{a}.o_proj.weight"
    assert (
        llama.engine_name("model.layers.0.mlp.up_proj.bias")
        == "model.layers.0.mlp.gate_up_proj.bias"
    )
    assert llama.engine_name("lm_head.weight") == "lm_head.weight"
    assert llama.canonical_names(f"{a}.qkv_proj.weight") == tuple(
        f"{a}.{x}_proj.weight" for x in "qkv"
    )

    mixtral = model_spec(TINY["mixtral"])
    m = "model.layers.1.block_sparse_moe"
    assert mixtral.engine_name(f"{m}.experts.3.w3.weight") == f"{m}.experts.w13_weight"
    assert mixtral.engine_name(f"{m}.experts.3.w2.weight") == f"{m}.experts.w2_weight"
    assert mixtral.engine_name(f"{m}.gate.weight") == f"{m}.gate.weight"
    assert mixtral.canonical_names(f"{m}.experts.w13_weight") == tuple(
        f"{m}.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3")
    )
    assert mixtral.canonical_names(f"{m}.experts.w2_weight") == tuple(
        f"{m}.experts.{e}.w2.weight" for e in range(4)
    )

    ds = model_spec(TINY["deepseek_v3"])
    a = "model.layers.1.self_attn"
    assert ds.canonical_names(f"{a}.fused_qkv_a_proj.weight") == (
        f"{a}.q_a_proj.weight",
        f"{a}.kv_a_proj_with_mqa.weight",
    )
    assert ds.engine_name("model.layers.1.mlp.shared_experts.gate_proj.weight") == (
        "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    )
    assert (
        ds.engine_name("model.layers.0.mlp.down_proj.weight")
        == "model.layers.0.mlp.down_proj.weight"
    )
    no_lora = model_spec(TINY["deepseek_v3-no-q-lora"])
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert no_lora.engine_name(kv_a) == kv_a
    with pytest.raises(KeyError, match="no vLLM parameter"):
        ds.canonical_names("model.layers.1.self_attn.qkv_proj.weight")


@pytest.mark.parametrize("name", sorted(TINY))
def test_name_table_round_trip(name: str) -> None:
    m = model_spec(TINY[name])
    assert m.names is NAME_TABLES[m.family]
    engine = {t.name: m.engine_name(t.name) for t in m.tensors}
    back = {c: e for e in set(engine.values()) for c in m.canonical_names(e)}
    assert back == engine
    for e in set(engine.values()):
        members = [m.tensor(c) for c in m.canonical_names(e)]
        assert len({(t.group, t.layer) for t in members}) == 1
        if members[0].group is None:
            assert len(members) == 1 and members[0].name == e


# -- configs ------------------------------------------------------------------------------------


def test_presets_all_build() -> None:
    assert {"tiny-llama", "llama-3-8b", "qwen2-7b", "qwen3-8b", "qwen3-30b-a3b"} <= set(PRESETS)
    assert {"mixtral-8x7b", "deepseek-v3"} <= set(PRESETS)
    tiny = model_spec("tiny-llama")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads) == (2, 64, 4, 2)
    assert (tiny.vocab_size, tiny.intermediate_size) == (256, 128)


def test_load_config_file_and_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY["qwen3_moe"]))
    assert load_config(tmp_path) == TINY["qwen3_moe"]
    from_dir = model_spec(tmp_path)
    from_file = model_spec(str(tmp_path / "config.json"))
    assert [t.name for t in from_dir.tensors] == [t.name for t in from_file.tensors]
    assert from_dir.num_params == model_spec(TINY["qwen3_moe"]).num_params
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(tmp_path / "missing")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON list"):
        load_config(tmp_path / "list.json")


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        model_spec({"model_type": "gpt2"})
    with pytest.raises(KeyError, match="'intermediate_size'"):
        model_spec({k: v for k, v in TINY["llama"].items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 3"):
        model_spec({**TINY["llama"], "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        model_spec({**TINY["llama"], "hidden_size": 0})
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        model_spec({**TINY["deepseek_v3"], "attention_bias": True})
    with pytest.raises(KeyError, match="neither a preset"):
        model_spec("llama-9000")
    with pytest.raises(TypeError, match="preset name, a config dict"):
        model_spec(42)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no canonical tensor"):
        model_spec("tiny-llama").index("model.layers.7.mlp.up_proj.weight")
