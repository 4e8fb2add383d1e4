"""vLLM-style engine layouts, checked bit for bit against tensors built the way vLLM's weight
loaders build them (torch.cat / chunk / narrow written from the parallel rules, not from the
layout code)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.layout_fixtures import NAN, QWEN3_MOE, canonical_tensors, deepseek_config, small_config
from weightbus.layouts.families import ModelSpec, model_spec
from weightbus.layouts.fused import engine_layout, kv_head_range
from weightbus.spec import Layout, LayoutBuilder, Participant

MIXTRAL = {**small_config("mixtral"), "num_local_experts": 4}
DEEPSEEK = deepseek_config(3)


# -- the reference: what a vLLM rank holds after load_weights -----------------------------------


def vllm_rank(
    model: ModelSpec,
    w: dict[str, torch.Tensor],
    *,
    tp: int,
    r: int,
    ep: int = 1,
    er: int = 0,
    pad: int = 64,
) -> dict[str, torch.Tensor]:
    """Rank ``(r, er)``'s parameters, NaN where vLLM holds padding."""

    def col(x: torch.Tensor) -> torch.Tensor:  # ColumnParallelLinear weight_loader: narrow dim 0
        n = x.shape[0] // tp
        return x.narrow(0, r * n, n)

    def row(x: torch.Tensor) -> torch.Tensor:  # RowParallelLinear: narrow dim 1
        return x.chunk(tp, 1)[r]

    def kv(x: torch.Tensor) -> torch.Tensor:  # QKVParallelLinear k/v shard
        heads, d = model.num_kv_heads, model.head_dim
        if tp >= heads:
            return x.view(heads, d, *x.shape[1:])[r // (tp // heads)]
        return x.chunk(tp, 0)[r]

    def vocab(x: torch.Tensor) -> torch.Tensor:  # VocabParallelEmbedding / ParallelLMHead
        padded = torch.full((math.ceil(x.shape[0] / pad) * pad, x.shape[1]), NAN)
        padded[: x.shape[0]] = x
        return padded.chunk(tp, 0)[r].clone()

    out = {"model.embed_tokens.weight": vocab(w["model.embed_tokens.weight"])}
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        out[f"{p}.input_layernorm.weight"] = w[f"{p}.input_layernorm.weight"]
        out[f"{p}.post_attention_layernorm.weight"] = w[f"{p}.post_attention_layernorm.weight"]
        if model.family == "deepseek_v3":
            if f"{a}.q_a_proj.weight" in w:
                out[f"{a}.fused_qkv_a_proj.weight"] = torch.cat(
                    [w[f"{a}.q_a_proj.weight"], w[f"{a}.kv_a_proj_with_mqa.weight"]]
                )
                out[f"{a}.q_a_layernorm.weight"] = w[f"{a}.q_a_layernorm.weight"]
                out[f"{a}.q_b_proj.weight"] = col(w[f"{a}.q_b_proj.weight"])
            else:
                out[f"{a}.q_proj.weight"] = col(w[f"{a}.q_proj.weight"])
                out[f"{a}.kv_a_proj_with_mqa.weight"] = w[f"{a}.kv_a_proj_with_mqa.weight"]
            out[f"{a}.kv_a_layernorm.weight"] = w[f"{a}.kv_a_layernorm.weight"]
            out[f"{a}.kv_b_proj.weight"] = col(w[f"{a}.kv_b_proj.weight"])
        else:
            for param in ("weight", "bias"):
                if f"{a}.q_proj.{param}" in w:
                    out[f"{a}.qkv_proj.{param}"] = torch.cat(
                        [
                            col(w[f"{a}.q_proj.{param}"]),
                            kv(w[f"{a}.k_proj.{param}"]),
                            kv(w[f"{a}.v_proj.{param}"]),
                        ]
                    )
            for norm in ("q_norm", "k_norm"):
                if f"{a}.{norm}.weight" in w:
                    out[f"{a}.{norm}.weight"] = w[f"{a}.{norm}.weight"]
            if f"{a}.o_proj.bias" in w:
                out[f"{a}.o_proj.bias"] = w[f"{a}.o_proj.bias"]
        out[f"{a}.o_proj.weight"] = row(w[f"{a}.o_proj.weight"])

        moe = f"{p}.block_sparse_moe" if model.family == "mixtral" else f"{p}.mlp"
        gate, up, down = (
            ("w1", "w3", "w2")
            if model.family == "mixtral"
            else ("gate_proj", "up_proj", "down_proj")
        )
        if f"{moe}.gate.weight" not in w:
            m = f"{p}.mlp"
            for param in ("weight", "bias"):
                if f"{m}.gate_proj.{param}" in w:
                    out[f"{m}.gate_up_proj.{param}"] = torch.cat(
                        [col(w[f"{m}.gate_proj.{param}"]), col(w[f"{m}.up_proj.{param}"])]
                    )
            out[f"{m}.down_proj.weight"] = row(w[f"{m}.down_proj.weight"])
            if f"{m}.down_proj.bias" in w:
                out[f"{m}.down_proj.bias"] = w[f"{m}.down_proj.bias"]
            continue
        out[f"{moe}.gate.weight"] = w[f"{moe}.gate.weight"]
        if f"{moe}.gate.e_score_correction_bias" in w:
            out[f"{moe}.gate.e_score_correction_bias"] = w[f"{moe}.gate.e_score_correction_bias"]
        s = f"{moe}.shared_experts"
        if f"{s}.gate_proj.weight" in w:
            out[f"{s}.gate_up_proj.weight"] = torch.cat(
                [col(w[f"{s}.gate_proj.weight"]), col(w[f"{s}.up_proj.weight"])]
            )
            out[f"{s}.down_proj.weight"] = row(w[f"{s}.down_proj.weight"])
        # FusedMoE with linear expert placement: the first E % ep ranks hold one more expert
        n = model.num_experts
        base, extra = divmod(n, ep)
        first = er * base + min(er, extra)
        mine = range(first, first + base + (er < extra))
        e = f"{moe}.experts"
        if ep > 1:
            w13 = [
                torch.cat([w[f"{e}.{i}.{gate}.weight"], w[f"{e}.{i}.{up}.weight"]]) for i in mine
            ]
            w2 = [w[f"{e}.{i}.{down}.weight"] for i in mine]
        else:
            w13 = [
                torch.cat([col(w[f"{e}.{i}.{gate}.weight"]), col(w[f"{e}.{i}.{up}.weight"])])
                for i in mine
            ]
            w2 = [row(w[f"{e}.{i}.{down}.weight"]) for i in mine]
        out[f"{e}.w13_weight"] = torch.stack(w13)
        out[f"{e}.w2_weight"] = torch.stack(w2)
    out["model.norm.weight"] = w["model.norm.weight"]
    if "lm_head.weight" in w:
        out["lm_head.weight"] = vocab(w["lm_head.weight"])
    return out


def check_against(layout: Layout, model: ModelSpec, expected: dict, w: dict) -> None:
    """Every piece reads exactly the canonical box it names; pieces tile every non-NaN element
    of every local tensor exactly once; the declared shapes and dtypes are right."""
    assert {x.key: x.shape for x in layout.locals} == {
        k: tuple(v.shape) for k, v in expected.items()
    }
    for spec in layout.tensors:
        t = model.tensor(spec.name)
        assert (spec.shape, spec.dtype) == (t.shape, t.dtype)
    for x in layout.locals:
        want = "float32" if x.key.endswith("e_score_correction_bias") else model.dtype
        assert x.dtype == want, x
    counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in expected.items()}
    for p in layout.iter_pieces():
        region = expected[p.key][p.local_box.slices()]
        assert torch.equal(region.reshape(p.box.shape), w[p.tensor][p.box.slices()]), p
        counts[p.key][p.local_box.slices()] += 1
    for k, v in expected.items():
        assert torch.equal(counts[k], (~torch.isnan(v)).int()), f"{k}: pieces do not tile it"


def check_all_ranks(model: ModelSpec, *, tp: int, ep: int = 1, pad: int = 64) -> None:
    w = canonical_tensors(model)
    covered = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in w.items()}
    for er in range(ep):
        for r in range(tp):
            layout = engine_layout(
                model,
                Participant(role="reader", rank=er * tp + r),
                tp=tp,
                tp_rank=r,
                ep=ep,
                ep_rank=er,
                vocab_pad=pad,
            )
            check_against(layout, model, vllm_rank(model, w, tp=tp, r=r, ep=ep, er=er, pad=pad), w)
            for p in layout.iter_pieces():
                covered[p.tensor][p.box.slices()] = True
    missing = [k for k, v in covered.items() if not v.all()]
    assert not missing, f"no rank holds all of {missing}"


# -- dense models -------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_gqa_with_and_without_kv_replication(tp: int) -> None:
    # 8 q heads, 2 kv heads: tp 1, 2 split the kv heads, tp 4, 8 replicate them
    check_all_ranks(model_spec(small_config("llama")), tp=tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_biases(tp: int) -> None:
    model = model_spec(small_config("qwen2", num_attention_heads=4))
    assert any(t.name.endswith("k_proj.bias") for t in model.tensors)
    check_all_ranks(model, tp=tp)


def test_llama_attention_and_mlp_biases() -> None:
    check_all_ranks(model_spec(small_config("llama", attention_bias=True, mlp_bias=True)), tp=2)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_norms_and_tied_embeddings(tied: bool) -> None:
    model = model_spec(small_config("qwen3", head_dim=8, tie_word_embeddings=tied))
    check_all_ranks(model, tp=4)
    layout = engine_layout(model, Participant(role="reader", rank=0), tp=4, tp_rank=0)
    keys = {x.key for x in layout.locals}
    assert ("lm_head.weight" in keys) is not tied
    assert "model.embed_tokens.weight" in keys


@pytest.mark.parametrize("tp, pad", [(1, 64), (4, 64), (8, 64), (4, 16), (2, 1)])
def test_vocab_padding(tp: int, pad: int) -> None:
    model = model_spec(small_config("llama", vocab_size=100, num_attention_heads=8))
    check_all_ranks(model, tp=tp, pad=pad)
    per = math.ceil(100 / pad) * pad // tp
    last = engine_layout(
        model, Participant(role="reader", rank=0), tp=tp, tp_rank=tp - 1, vocab_pad=pad
    )
    embed = next(x for x in last.locals if x.key == "model.embed_tokens.weight")
    assert embed.shape == (per, 32)
    real_rows = max(0, min(per, 100 - (tp - 1) * per))
    held = sum(p.box.shape[0] for p in last.iter_pieces() if p.key == "model.embed_tokens.weight")
    assert held == real_rows  # tp 8, pad 64: the last shard is rows 112:128, all padding


# -- MoE ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2), (1, 4), (2, 4), (1, 3)])
def test_qwen3_moe_experts(tp: int, ep: int) -> None:
    # ep 3 does not divide 8 experts: 3, 3, 2
    check_all_ranks(model_spec(QWEN3_MOE), tp=tp, ep=ep)


def test_expert_placement_and_shapes() -> None:
    model = model_spec(QWEN3_MOE)
    who = Participant(role="reader", rank=0)
    w13 = "model.layers.2.mlp.experts.w13_weight"
    shapes = {}
    for ep, er, tp in ((3, 0, 1), (3, 2, 1), (1, 0, 2), (4, 1, 2)):
        layout = engine_layout(model, who, tp=tp, tp_rank=0, ep=ep, ep_rank=er)
        shapes[ep, er, tp] = next(x.shape for x in layout.locals if x.key == w13)
        experts = sorted(
            {int(p.tensor.split(".")[5]) for p in layout.iter_pieces() if p.key == w13}
        )
        shapes[ep, er, tp, "experts"] = experts
    assert shapes[3, 0, 1] == (3, 32, 32) and shapes[3, 0, 1, "experts"] == [0, 1, 2]
    assert shapes[3, 2, 1] == (2, 32, 32) and shapes[3, 2, 1, "experts"] == [6, 7]
    assert shapes[1, 0, 2] == (8, 16, 32)  # ep 1: I = 16 split over tp 2, [gate; up]
    assert shapes[4, 1, 2] == (2, 32, 32) and shapes[4, 1, 2, "experts"] == [2, 3]  # ep > 1: whole


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 4)])
def test_mixtral(tp: int, ep: int) -> None:
    check_all_ranks(model_spec(MIXTRAL), tp=tp, ep=ep)


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (4, 2), (2, 4)])
def test_deepseek_mla(tp: int, ep: int) -> None:
    check_all_ranks(model_spec(DEEPSEEK), tp=tp, ep=ep)


def test_deepseek_without_q_lora() -> None:
    check_all_ranks(model_spec({**DEEPSEEK, "q_lora_rank": None}), tp=2, ep=2)


# -- the rules, as properties -------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 3, 4, 6]),
    group=st.sampled_from([1, 2, 3]),
    tp=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    data=st.data(),
)
def test_gqa_rule_or_error(kv: int, group: int, tp: int, data) -> None:
    heads = kv * group
    model = model_spec(
        small_config(
            "qwen2",
            num_attention_heads=heads,
            num_key_value_heads=kv,
            hidden_size=4 * heads,
            intermediate_size=24,
        )
    )
    # vocab 100 padded to 120 and intermediate 24 split over every tp drawn
    valid = heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    r = data.draw(st.integers(0, tp - 1))
    who = Participant(role="reader", rank=r)
    if not valid:
        with pytest.raises(ValueError, match=f"tp={tp}"):
            engine_layout(model, who, tp=tp, tp_rank=r, vocab_pad=24)
        return
    w = canonical_tensors(model, seed=r)
    layout = engine_layout(model, who, tp=tp, tp_rank=r, vocab_pad=24)
    check_against(layout, model, vllm_rank(model, w, tp=tp, r=r, pad=24), w)


def test_kv_head_range() -> None:
    assert [kv_head_range(2, 8, r) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert [kv_head_range(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    with pytest.raises(ValueError, match="tp=4 and num_key_value_heads=3"):
        kv_head_range(3, 4, 0)
    with pytest.raises(ValueError, match="num_key_value_heads=6 does not split evenly over tp=4"):
        kv_head_range(6, 4, 0)


def test_layout_is_valid_for_layout_builder_and_serialises() -> None:
    """Rebuilt piece by piece through LayoutBuilder's checks, the layout is the same."""
    for config, kw in (
        (QWEN3_MOE, {"tp": 2, "tp_rank": 1, "ep": 2, "ep_rank": 1}),
        (DEEPSEEK, {"tp": 2, "tp_rank": 0}),
    ):
        layout = engine_layout(model_spec(config), Participant(role="reader", rank=3), **kw)
        b = LayoutBuilder(layout.participant)
        for t in layout.tensors:
            b.add_tensor(t.name, t.shape, t.dtype)
        for x in layout.locals:
            b.add_local(x.key, x.shape, x.dtype)
        for p in layout.iter_pieces():
            b.add_piece(p.tensor, p.box, p.key, p.local_box)
        assert b.build().digest == layout.digest
        assert Layout.from_msgpack(layout.to_msgpack()).digest == layout.digest


def test_dtype_override() -> None:
    model = model_spec(DEEPSEEK)
    layout = engine_layout(
        model, Participant(role="reader", rank=0), tp=2, tp_rank=0, dtype="float16"
    )
    dtypes = {x.key: x.dtype for x in layout.locals}
    assert dtypes["model.layers.1.mlp.experts.w13_weight"] == "float16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert {t.dtype for t in layout.tensors} == {"float16", "float32"}


def test_errors() -> None:
    who = Participant(role="reader", rank=0)
    llama = model_spec(small_config("llama", num_attention_heads=8))
    with pytest.raises(
        ValueError, match=r"q_proj.weight \(32, 32\): dim 0 \(8 heads of 4\) .* tp=3"
    ):
        engine_layout(llama, who, tp=3, tp_rank=0, vocab_pad=3)
    with pytest.raises(ValueError, match="128 rows, which do not split evenly over tp=3"):
        engine_layout(
            model_spec(
                small_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
            ),
            who,
            tp=3,
            tp_rank=0,
        )
    with pytest.raises(
        ValueError, match=r"mlp.gate_proj.weight \(50, 32\): dim 0 \(50\) does not split into 4"
    ):
        engine_layout(model_spec(small_config("llama", intermediate_size=50)), who, tp=4, tp_rank=0)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, tp=2\), got 2"):
        engine_layout(llama, who, tp=2, tp_rank=2)
    with pytest.raises(ValueError, match="has no experts: pass ep=1"):
        engine_layout(llama, who, ep=2, ep_rank=0)
    with pytest.raises(ValueError, match="ep=16 is larger than the 8 experts"):
        engine_layout(model_spec(QWEN3_MOE), who, ep=16, ep_rank=0)
    with pytest.raises(ValueError, match="vocab_pad must be a positive integer"):
        engine_layout(llama, who, vocab_pad=0)
    with pytest.raises(TypeError, match="model must be a ModelSpec"):
        engine_layout({"model_type": "llama"}, who)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="participant must be a Participant"):
        engine_layout(llama, "reader-0")  # type: ignore[arg-type]


# -- scale --------------------------------------------------------------------------------------


def test_deepseek_v3_engine_layouts_at_scale() -> None:
    """128 ranks, tp 8 x ep 16, well inside the 2 s budget they share with planning (CPU time,
    so that other processes on a shared machine do not count)."""
    model = model_spec("deepseek-v3")
    t0 = time.process_time()
    layouts = [
        engine_layout(
            model, Participant(role="reader", rank=r), tp=8, tp_rank=r % 8, ep=16, ep_rank=r // 8
        )
        for r in range(128)
    ]
    elapsed = time.process_time() - t0
    assert elapsed < 2.0, f"{elapsed:.2f} s for 128 ranks"
    # each routed expert lives whole on the 8 tp ranks of its ep rank
    expert_numel = sum(t.numel for t in model.tensors if t.expert is not None)
    held = 0
    for layout in layouts:
        p = layout.pieces
        is_expert = torch.tensor([".experts." in t.name for t in layout.tensors])[
            torch.from_numpy(p.tensor).long()
        ]
        extent = torch.from_numpy(p.stop - p.start).prod(dim=1)
        held += int(extent[is_expert].sum())
    assert held == 8 * expert_numel
    assert len(layouts[0].pieces) == 3635


def test_describe_vllm_data_parallel_splits_experts_over_all_ranks():
    """``vllm:tp=2,dp=2`` without ep: each expert's intermediate dim over all 4 ranks (vLLM's
    MoE tensor parallel spans data parallel); with ``ep=on`` whole experts, a quarter each."""
    from weightbus.layouts.describe import build_layouts
    from weightbus.layouts.families import model_spec

    model = model_spec("qwen3-30b-a3b")
    w13 = "model.layers.0.mlp.experts.w13_weight"
    inter, experts = 768, 128
    for desc, want in (
        ("vllm:tp=2,dp=2", (experts, 2 * inter // 4)),
        ("vllm:tp=2,dp=2,ep=on", (experts // 4, 2 * inter)),
    ):
        for layout in build_layouts(model, desc, "reader"):
            local = next(x for x in layout.locals if x.key == w13)
            assert tuple(local.shape[:2]) == want, (desc, layout.name, local.shape)
