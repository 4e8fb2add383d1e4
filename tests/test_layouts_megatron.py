"""Megatron-style trainer layouts, checked bit for bit against shards cut directly from the
tensor / pipeline / expert parallel rules (by checkpoint name, not through the layout code)."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

from tests.layout_fixtures import NAN, QWEN3_MOE, canonical_tensors, deepseek_config, small_config
from weightbus.layouts.families import ModelSpec, model_spec
from weightbus.layouts.megatron import expert_range, megatron_layout, pipeline_stages
from weightbus.spec import Layout, LayoutBuilder, Participant

DEEPSEEK = deepseek_config(4)

_COLUMN = re.compile(
    r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3|q_b_proj|kv_b_proj)\.(weight|bias)$"
)
_ROW = re.compile(r"\.(o_proj|down_proj|w2)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def megatron_rank(
    model: ModelSpec,
    w: dict[str, torch.Tensor],
    *,
    tp: int = 1,
    r: int = 0,
    layers: range,
    first: bool,
    last: bool,
    ep: int = 1,
    er: int = 0,
    multiple: int = 128,
    fuse_qkv: bool = False,
) -> dict[str, torch.Tensor]:
    """What the rank holds: canonical names -> shards, NaN in vocab padding."""
    n_experts = model.num_experts
    mine = range(er * n_experts // ep, (er + 1) * n_experts // ep) if n_experts else range(0)
    out = {}
    for name, x in w.items():
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) not in layers:
            continue
        expert = _EXPERT.search(name)
        if expert and int(expert.group(1)) not in mine:
            continue
        if name == "model.embed_tokens.weight" and not (
            first or (last and "lm_head.weight" not in w)
        ):
            continue
        if name in ("model.norm.weight", "lm_head.weight") and not last:
            continue
        if fuse_qkv and re.search(r"\.(q|k|v)_proj\.", name):
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = math.ceil(x.shape[0] / (multiple * tp)) * multiple * tp
            padded = torch.full((rows, x.shape[1]), NAN)
            padded[: x.shape[0]] = x
            out[name] = padded.chunk(tp, 0)[r].clone()
        elif expert and ep > 1:
            out[name] = x
        elif _COLUMN.search(name):
            out[name] = x.chunk(tp, 0)[r]
        elif _ROW.search(name):
            out[name] = x.chunk(tp, 1)[r]
        else:
            out[name] = x
    if fuse_qkv:
        n_kv, d = model.num_kv_heads, model.head_dim
        for layer in layers:
            a = f"model.layers.{layer}.self_attn"
            for param in ("weight", "bias"):
                if f"{a}.q_proj.{param}" not in w:
                    continue
                q, k, v = (w[f"{a}.{x}_proj.{param}"] for x in "qkv")
                trailing = q.shape[1:]
                full = torch.cat(
                    [
                        q.reshape(n_kv, -1, *trailing),
                        k.reshape(n_kv, d, *trailing),
                        v.reshape(n_kv, d, *trailing),
                    ],
                    dim=1,
                ).reshape(-1, *trailing)
                out[f"{a}.linear_qkv.{param}"] = full.chunk(tp, 0)[r]
    return out


def check_against(layout: Layout, expected: dict, w: dict) -> None:
    assert {x.key: x.shape for x in layout.locals} == {
        k: tuple(v.shape) for k, v in expected.items()
    }
    counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in expected.items()}
    for p in layout.iter_pieces():
        region = expected[p.key][p.local_box.slices()]
        assert torch.equal(region.reshape(p.box.shape), w[p.tensor][p.box.slices()]), p
        counts[p.key][p.local_box.slices()] += 1
    for k, v in expected.items():
        assert torch.equal(counts[k], (~torch.isnan(v)).int()), f"{k}: pieces do not tile it"


def check_grid(
    model: ModelSpec, *, tp=1, pp=1, ep=1, stages=None, multiple=128, fuse_qkv=False
) -> None:
    """Every rank of a tp x pp x ep grid against the reference; together they hold everything."""
    w = canonical_tensors(model)
    covered = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in w.items()}
    ranges = pipeline_stages(model.num_layers, pp, stages)
    for s in range(pp):
        for er in range(ep):
            for r in range(tp):
                layout = megatron_layout(
                    model,
                    Participant(role="writer", rank=0),
                    tp=tp,
                    tp_rank=r,
                    pp=pp,
                    pp_rank=s,
                    ep=ep,
                    ep_rank=er,
                    layers_per_stage=stages,
                    vocab_multiple=multiple,
                    fuse_qkv=fuse_qkv,
                )
                expected = megatron_rank(
                    model,
                    w,
                    tp=tp,
                    r=r,
                    layers=ranges[s],
                    first=s == 0,
                    last=s == pp - 1,
                    ep=ep,
                    er=er,
                    multiple=multiple,
                    fuse_qkv=fuse_qkv,
                )
                check_against(layout, expected, w)
                for p in layout.iter_pieces():
                    covered[p.tensor][p.box.slices()] = True
    missing = [k for k, v in covered.items() if not v.all()]
    assert not missing, f"no rank holds all of {missing}"


# -- tensor parallel ----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_tensor_parallel(tp: int) -> None:
    check_grid(model_spec(small_config("llama", kv_heads=4)), tp=tp)


@pytest.mark.parametrize("tp, multiple", [(2, 128), (4, 8), (4, 1)])
def test_vocab_parallel_padding(tp: int, multiple: int) -> None:
    model = model_spec(small_config("qwen2", kv_heads=4))
    check_grid(model, tp=tp, multiple=multiple)
    layout = megatron_layout(
        model, Participant(role="writer", rank=0), tp=tp, tp_rank=0, vocab_multiple=multiple
    )
    embed = next(x for x in layout.locals if x.key == "model.embed_tokens.weight")
    assert embed.shape[0] * tp == math.ceil(100 / (multiple * tp)) * multiple * tp


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fuse_qkv_interleaves_per_kv_group(tp: int) -> None:
    check_grid(
        model_spec(small_config("llama", kv_heads=4)), tp=tp, fuse_qkv=True
    )  # 8 heads, 4 kv groups


def test_fuse_qkv_with_biases_and_pipeline() -> None:
    check_grid(
        model_spec(small_config("qwen2", num_hidden_layers=3, kv_heads=4)),
        tp=2,
        pp=2,
        fuse_qkv=True,
    )


def test_fuse_qkv_local_rows_by_hand() -> None:
    """One KV group of 2 q heads (d=4) per rank: rows [q0 q1 k v] of group tp_rank."""
    model = model_spec(
        small_config("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=16)
    )
    layout = megatron_layout(
        model, Participant(role="writer", rank=1), tp=2, tp_rank=1, fuse_qkv=True
    )
    key = "model.layers.0.self_attn.linear_qkv.weight"
    assert next(x.shape for x in layout.locals if x.key == key) == (16, 16)
    rows = sorted(
        (p.local_box.start[0], p.tensor.split(".")[-2], p.box.start[0], p.box.stop[0])
        for p in layout.iter_pieces()
        if p.key == key
    )
    assert rows == [(0, "q_proj", 8, 16), (8, "k_proj", 4, 8), (12, "v_proj", 4, 8)]


# -- pipeline parallel --------------------------------------------------------------------------


def test_pipeline_stages_rule() -> None:
    assert pipeline_stages(5, 2) == (range(0, 3), range(3, 5))
    assert pipeline_stages(7, 3) == (range(0, 3), range(3, 5), range(5, 7))
    assert [len(s) for s in pipeline_stages(61, 4)] == [16, 15, 15, 15]
    assert pipeline_stages(5, 3, [1, 3, 1]) == (range(0, 1), range(1, 4), range(4, 5))
    with pytest.raises(
        ValueError,
        match=r"layers_per_stage \[1, 1\] must be 2 non-negative counts summing to num_layers=5",
    ):
        pipeline_stages(5, 2, [1, 1])
    with pytest.raises(ValueError, match="pp=6 is larger than the 5 layers"):
        pipeline_stages(5, 6)


@pytest.mark.parametrize("pp, stages", [(2, None), (3, None), (3, [1, 3, 1]), (5, None)])
def test_pipeline_parallel(pp: int, stages) -> None:
    check_grid(
        model_spec(small_config("llama", num_hidden_layers=5, kv_heads=4)),
        tp=2,
        pp=pp,
        stages=stages,
    )


def test_pipeline_owners() -> None:
    model = model_spec(small_config("llama", num_hidden_layers=5, kv_heads=4))
    who = Participant(role="writer", rank=0)
    held = [
        {t.name for t in megatron_layout(model, who, pp=3, pp_rank=s).tensors} for s in range(3)
    ]
    assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" in held[2]
    assert "model.norm.weight" in held[2] and "model.norm.weight" not in held[1]
    assert "model.embed_tokens.weight" not in held[1] | held[2]
    layers = [
        sorted({int(n.split(".")[2]) for n in h if n.startswith("model.layers.")}) for h in held
    ]
    assert layers == [[0, 1], [2, 3], [4]]


def test_tied_embeddings_on_first_and_last_stage() -> None:
    model = model_spec(
        small_config("qwen3", num_hidden_layers=4, head_dim=4, tie_word_embeddings=True, kv_heads=4)
    )
    check_grid(model, tp=2, pp=2)
    who = Participant(role="writer", rank=0)
    for s in range(2):
        names = {t.name for t in megatron_layout(model, who, pp=2, pp_rank=s).tensors}
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


# -- expert parallel ----------------------------------------------------------------------------


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2), (1, 4), (2, 8)])
def test_qwen3_moe_expert_parallel(tp: int, ep: int) -> None:
    check_grid(model_spec(QWEN3_MOE), tp=tp, ep=ep)


def test_experts_whole_under_ep_sharded_without() -> None:
    model = model_spec(QWEN3_MOE)
    who = Participant(role="writer", rank=0)
    gate = "model.layers.2.mlp.experts.5.gate_proj.weight"
    down = "model.layers.2.mlp.experts.5.down_proj.weight"
    ep = megatron_layout(model, who, tp=2, tp_rank=1, ep=4, ep_rank=2)
    shapes = {x.key: x.shape for x in ep.locals}
    assert shapes[gate] == (16, 32) and shapes[down] == (32, 16)
    assert "model.layers.2.mlp.experts.3.gate_proj.weight" not in shapes
    tp_only = {x.key: x.shape for x in megatron_layout(model, who, tp=2, tp_rank=1).locals}
    assert tp_only[gate] == (8, 32) and tp_only[down] == (32, 8)
    assert expert_range(8, 4, 2) == range(4, 6)
    assert expert_range(8, 3, 2, even=False) == range(6, 8)
    with pytest.raises(ValueError, match="8 experts do not split evenly over ep=3"):
        expert_range(8, 3, 0)


@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_deepseek_mla(tp: int, pp: int, ep: int) -> None:
    check_grid(model_spec(DEEPSEEK), tp=tp, pp=pp, ep=ep)


def test_mixtral() -> None:
    check_grid(
        model_spec({**small_config("mixtral", kv_heads=4), "num_local_experts": 4}),
        tp=2,
        pp=2,
        ep=2,
    )


# -- the rest -----------------------------------------------------------------------------------


def test_dtype_override_and_builder_round_trip() -> None:
    model = model_spec(DEEPSEEK)
    layout = megatron_layout(
        model,
        Participant(role="writer", rank=5),
        tp=2,
        tp_rank=1,
        pp=2,
        pp_rank=1,
        ep=2,
        ep_rank=1,
        dtype="float32",
    )
    assert {t.dtype for t in layout.tensors} == {x.dtype for x in layout.locals} == {"float32"}
    b = LayoutBuilder(layout.participant)
    for t in layout.tensors:
        b.add_tensor(t.name, t.shape, t.dtype)
    for x in layout.locals:
        b.add_local(x.key, x.shape, x.dtype)
    for p in layout.iter_pieces():
        b.add_piece(p.tensor, p.box, p.key, p.local_box)
    assert b.build().digest == layout.digest
    assert Layout.from_json(layout.to_json()).digest == layout.digest
    default = megatron_layout(model, Participant(role="writer", rank=0))
    assert {t.dtype for t in default.tensors} == {"bfloat16", "float32"}  # the router bias


def test_errors() -> None:
    who = Participant(role="writer", rank=0)
    llama = model_spec(small_config("llama", num_key_value_heads=2))
    with pytest.raises(
        ValueError,
        match=r"k_proj.weight \(8, 32\): dim 0 \(2 heads of 4\) does not split into 4 equal parts for tp=4",
    ):
        megatron_layout(llama, who, tp=4, tp_rank=0)
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by tp=4"):
        megatron_layout(llama, who, tp=4, tp_rank=0, fuse_qkv=True)
    with pytest.raises(ValueError, match="multi-latent attention"):
        megatron_layout(model_spec(DEEPSEEK), who, fuse_qkv=True)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, pp=2\), got 2"):
        megatron_layout(llama, who, pp=2, pp_rank=2)
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        megatron_layout(llama, who, tp=0)
    with pytest.raises(ValueError, match="has no experts: pass ep=1"):
        megatron_layout(llama, who, ep=2)
    with pytest.raises(ValueError, match="8 experts do not split evenly over ep=3"):
        megatron_layout(model_spec(QWEN3_MOE), who, ep=3)
    with pytest.raises(TypeError, match="participant must be a Participant"):
        megatron_layout(llama, "writer-0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_multiple must be a positive integer"):
        megatron_layout(llama, who, vocab_multiple=0)
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight \(50, 32\): dim 0 \(50\)"):
        megatron_layout(
            model_spec(small_config("llama", intermediate_size=50, kv_heads=4)),
            who,
            tp=4,
            tp_rank=0,
        )


def test_deepseek_v3_megatron_layouts_at_scale() -> None:
    """256 ranks: tp 8 x pp 8 x dp 4, experts over ep 32 = dp x tp (CPU time)."""
    model = model_spec("deepseek-v3")
    t0 = time.process_time()
    layouts = []
    for rank in range(256):
        tp_rank, pp_rank, dp_rank = rank % 8, rank // 8 % 8, rank // 64
        layouts.append(
            megatron_layout(
                model,
                Participant(role="writer", rank=rank),
                tp=8,
                tp_rank=tp_rank,
                pp=8,
                pp_rank=pp_rank,
                ep=32,
                ep_rank=dp_rank * 8 + tp_rank,
            )
        )
    elapsed = time.process_time() - t0
    assert elapsed < 2.0, f"{elapsed:.2f} s for 256 ranks"
    # the 32 ranks of a stage are 32 distinct ep ranks: each expert is held once, whole
    expert_numel = sum(t.numel for t in model.tensors if t.expert is not None)
    held = 0
    for layout in layouts:
        p = layout.pieces
        is_expert = torch.tensor([t.name.count(".experts.") == 1 for t in layout.tensors])
        extent = torch.from_numpy(p.stop - p.start).prod(dim=1)
        held += int(extent[is_expert[torch.from_numpy(p.tensor).long()]].sum())
    assert held == expert_numel
