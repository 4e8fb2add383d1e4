"""The transformers adapter: canonical names are what save_pretrained writes.

Tiny models are built from config objects (no downloads). The reference for every check is the
safetensors file ``save_pretrained`` writes: its key set and shapes are the canonical tensors,
and every piece must read exactly its box of the saved tensor.
"""

from __future__ import annotations

import contextlib
import copy
import resource

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from weightbus.engines.hf import bind, checkpoint_targets  # noqa: E402
from weightbus.spec import LayoutError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _llama(tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


def _mixtral() -> MixtralForCausalLM:
    torch.manual_seed(1)
    cfg = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(cfg).to(torch.bfloat16)


def _qwen3_moe(tie: bool = False) -> Qwen3MoeForCausalLM:
    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=18,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        tie_word_embeddings=tie,
    )
    return Qwen3MoeForCausalLM(cfg)


def _saved(model, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def _check(bound, ref, counts=None, *, whole=True):
    """Pieces read exactly their box of the saved tensors; with ``whole``, each saved element
    is read exactly once."""
    assert {t.name: t.shape for t in bound.layout.tensors} == {
        k: tuple(v.shape) for k, v in ref.items()
    }
    for t in bound.layout.tensors:
        assert t.dtype == str(ref[t.name].dtype).removeprefix("torch.")
    counts = (
        counts
        if counts is not None
        else {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in ref.items()}
    )
    for piece in bound.layout.iter_pieces():
        local = bound.tensors[piece.key][piece.local_box.slices()]
        assert torch.equal(local.reshape(piece.box.shape), ref[piece.tensor][piece.box.slices()]), (
            piece
        )
        counts[piece.tensor][piece.box.slices()] += 1
    if whole:
        for name, c in counts.items():
            assert bool((c == 1).all()), name
    return counts


def test_llama_tied_embeddings(tmp_path):
    model = _llama(tie=True)
    ref = _saved(model, tmp_path)
    bound = bind(model, "writer", 0)
    assert "lm_head.weight" not in ref
    assert bound.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    _check(bound, ref)
    # one piece per tensor, each the whole live parameter
    assert len(bound.layout.pieces) == len(ref)
    assert (
        bound.tensors["model.layers.1.mlp.up_proj.weight"]
        is model.model.layers[1].mlp.up_proj.weight
    )


def test_llama_untied_head(tmp_path):
    model = _llama(tie=False)
    ref = _saved(model, tmp_path)
    bound = bind(model, "reader", 1)
    assert "lm_head.weight" in ref and bound.aliases == {}
    _check(bound, ref)


def test_mixtral_fused_experts_map_to_per_expert_tensors(tmp_path):
    model = _mixtral()
    ref = _saved(model, tmp_path)
    bound = bind(model, "reader", 0)
    _check(bound, ref)
    # the checkpoint keeps Mixtral's names and one 2-D tensor per expert ...
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in ref
    # ... which land in the fused 3-D parameter behind a leading extent-1 local dim
    (piece,) = [
        p
        for p in bound.layout.iter_pieces()
        if p.tensor == "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    ]
    assert piece.key == "model.layers.0.mlp.experts.gate_up_proj"
    assert piece.box.start == (0, 0) and piece.box.stop == (24, 32)
    assert piece.local_box.start == (2, 24, 0) and piece.local_box.stop == (3, 48, 32)
    assert bound.tensors[piece.key] is model.model.layers[0].mlp.experts.gate_up_proj
    assert bound.layout.tensor_spec(piece.tensor).dtype == "bfloat16"


def test_qwen3_moe_fused_experts(tmp_path):
    model = _qwen3_moe()
    ref = _saved(model, tmp_path)
    bound = bind(model, "writer", 0)
    _check(bound, ref)
    experts = [
        p for p in bound.layout.iter_pieces() if p.key == "model.layers.1.mlp.experts.down_proj"
    ]
    assert sorted(p.local_box.start[0] for p in experts) == [0, 1, 2, 3]
    assert {p.tensor for p in experts} == {
        f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)
    }


@contextlib.contextmanager
def _fake_rank(rank, world_size):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        from torch.distributed.tensor import debug

        for clear in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):
            getattr(debug, clear, lambda: None)()  # not every torch has both caches


def test_tensor_parallel_dtensors(tmp_path):
    """transformers' own TP sharding (as tp_plan="auto" applies it) on 3 simulated ranks.

    The fused gate_up_proj is a _StridedShard(1, split_factor=2): each rank holds a slice of
    every expert's gate and a slice of its up, both within one local tensor. Dims do not divide
    by 3, so shards are uneven. (from_pretrained(tp_plan=...) itself needs accelerate and real
    collectives; this applies the same parallel styles to a built model.)
    """
    from torch.distributed.device_mesh import init_device_mesh

    tp = pytest.importorskip("transformers.distributed.tensor_parallel")
    base = _qwen3_moe(tie=True)
    if not hasattr(tp, "apply_tensor_parallelism") or not hasattr(base, "_expand_parallel_plan"):
        pytest.skip("this transformers has no apply_tensor_parallelism")
    ref = _saved(base, tmp_path)
    counts = None
    placements = set()
    for rank in range(3):
        with _fake_rank(rank, 3):
            model = copy.deepcopy(base)
            plan = model._expand_parallel_plan(dict(model.tp_plan))
            names = set(dict(model.named_modules())) | set(dict(model.named_parameters()))
            tp.apply_tensor_parallelism(
                model, init_device_mesh("cpu", (3,)), {k: v for k, v in plan.items() if k in names}
            )
            model.tie_weights()
            placements.update(
                str(v.placements)
                for v in model.state_dict(keep_vars=True).values()
                if hasattr(v, "placements")
            )
            bound = bind(model, "reader", rank)
            assert bound.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
            counts = _check(bound, ref, counts, whole=False)
    assert any("_StridedShard" in p for p in placements), placements
    for name, c in counts.items():
        sharded = any(s in name for s in ("proj", "embed_tokens"))
        assert bool((c == (1 if sharded else 3)).all()), (name, c.unique())


_ROWS = torch.arange(32)[:, None]


def _patched_revert(monkeypatch, edit):
    import transformers.core_model_loading as cml

    real = cml.revert_weight_conversion

    def revert(model, state_dict):
        return edit(real(model, state_dict))

    monkeypatch.setattr(cml, "revert_weight_conversion", revert)


def test_checkpoint_tensor_concatenated_from_several_model_tensors(monkeypatch):
    """A checkpoint that keeps q/k/v fused while the model holds them apart."""
    model = _llama()
    attn = "model.layers.0.self_attn."

    def fuse(sd):
        sd[attn + "qkv_proj.weight"] = torch.cat(
            [sd.pop(attn + f"{x}_proj.weight") for x in "qkv"], dim=0
        )
        return sd

    _patched_revert(monkeypatch, fuse)
    bound = bind(model, "reader", 0)
    sd = model.state_dict()
    ref = {
        k: v
        for k, v in sd.items()
        if k != "lm_head.weight" and not k.startswith(attn) or k.endswith("o_proj.weight")
    }
    ref = {k: v for k, v in ref.items() if not any(k == attn + f"{x}_proj.weight" for x in "qkv")}
    ref[attn + "qkv_proj.weight"] = torch.cat([sd[attn + f"{x}_proj.weight"] for x in "qkv"], dim=0)
    _check(bound, ref)
    pieces = sorted(
        (p.box.start[0], p.key)
        for p in bound.layout.iter_pieces()
        if p.tensor == attn + "qkv_proj.weight"
    )
    assert pieces == [
        (0, attn + "q_proj.weight"),
        (64, attn + "k_proj.weight"),
        (96, attn + "v_proj.weight"),
    ]


def test_concatenation_where_indices_run_on(monkeypatch):
    """Rows 0-15 of q then rows 16-31 of k: the row index runs on, the source changes."""
    model = _llama()
    attn = "model.layers.0.self_attn."
    fused = attn + "qk_mix.weight"

    def mix(sd):
        q, k = sd.pop(attn + "q_proj.weight"), sd.pop(attn + "k_proj.weight")
        sd[fused] = torch.cat([q[:16], k[16:]])
        return sd

    _patched_revert(monkeypatch, mix)
    bound = bind(model, "reader", 0)
    sd = model.state_dict()
    pieces = sorted(
        (p.box.start[0], p.key, p.local_box.start[0])
        for p in bound.layout.iter_pieces()
        if p.tensor == fused
    )
    assert pieces == [(0, attn + "q_proj.weight", 0), (16, attn + "k_proj.weight", 16)]
    want = torch.cat([sd[attn + "q_proj.weight"][:16], sd[attn + "k_proj.weight"][16:]])
    got = torch.empty_like(want)
    for p in bound.layout.iter_pieces():
        if p.tensor == fused:
            got[p.box.slices()] = bound.tensors[p.key][p.local_box.slices()]
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("edit", "n_pieces"),
    [
        (lambda t: t.flip(0), 32),  # a row permutation: one piece per row
        (lambda t: t.reshape(-1), 32),  # flattened: one piece per row
        (lambda t: t.reshape(-1).view(64, 32)[::2], 1),  # every other half row: t[:, :32]
        (lambda t: t[:, [3, 4, 5, 0, 1, 2] + list(range(6, 64))], 3),  # columns swapped in blocks
    ],
    ids=["flip", "flatten", "half_rows", "column_blocks"],
)
def test_reordered_checkpoint_tensors_become_exact_pieces(monkeypatch, edit, n_pieces):
    model = _llama()
    name = "model.layers.1.self_attn.k_proj.weight"
    _patched_revert(monkeypatch, lambda sd: {**sd, name: edit(sd[name])})
    bound = bind(model, "reader", 0)
    sd = model.state_dict()
    ref = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    ref[name] = edit(sd[name])
    _check(bound, ref)
    assert sum(p.tensor == name for p in bound.layout.iter_pieces()) == n_pieces


def test_too_many_pieces_are_refused(monkeypatch):
    import weightbus.engines.hf as hf

    monkeypatch.setattr(hf, "_MAX_BLOCKS", 16)
    name = "model.layers.1.self_attn.k_proj.weight"
    _patched_revert(monkeypatch, lambda sd: {**sd, name: sd[name].flip(0)})
    with pytest.raises(LayoutError, match=r"k_proj.*32 separate boxes.*bind_module"):
        bind(_llama(), "reader", 0)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.t(), r"o_proj.*maps checkpoint dim -> dim .*\[\(0, 1\), \(1, 0\)\]"),
        (lambda t: t.unsqueeze(0).expand(2, -1, -1), r"o_proj.*repeats elements"),
        (
            lambda t: torch.cat([torch.cat([t, t], 1), torch.cat([t, t], 1)], 0),
            r"o_proj.*several dims",
        ),
        (lambda t: t.flip(0).flip(1), r"o_proj.*several dims"),
        (lambda t: t[:, :, None], r"o_proj.*trailing dims"),
        # element (i, j) is t[i, i + j]: the column index advances along both dims
        (lambda t: t[_ROWS, _ROWS + _ROWS.t()], r"o_proj.*one-for-one"),
    ],
    ids=["transpose", "repeat", "grid", "scramble", "unsqueeze", "skew"],
)
def test_conversions_pieces_cannot_express_are_refused(monkeypatch, edit, match):
    name = "model.layers.0.self_attn.o_proj.weight"
    _patched_revert(monkeypatch, lambda sd: {**sd, name: edit(sd[name])})
    with pytest.raises(LayoutError, match=match):
        bind(_llama(), "reader", 0)


def test_probes_stay_zero_copy_on_a_realistic_moe():
    """Qwen3-30B-A3B-sized MoE layer on the meta device: the probes must not materialize the
    (128, 1536, 2048) fused experts (3 GB as int64 indices per probe)."""
    cfg = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        head_dim=128,
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cmap = checkpoint_targets(model)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 1024, grown_mb
    gate_up = cmap.targets["model.layers.0.mlp.experts.gate_up_proj"]
    assert len(gate_up) == 256
    assert ("model.layers.0.mlp.experts.127.up_proj.weight", (127, 768, 0)) in {
        (n, kb.start) for n, _, kb in gate_up
    }
    assert len(cmap.shapes) == 128 * 3 + 12


def test_bind_takes_a_pretrained_model_and_names_the_participant():
    model = _llama()
    p = bind(model, "writer", 2, host="trainer-host").layout.participant
    assert (p.name, p.host, p.device) == ("writer-2", "trainer-host", "cpu")
    with pytest.raises(TypeError, match="PreTrainedModel.*engines.module.bind"):
        bind(torch.nn.Linear(2, 2), "writer", 0)


def test_conversions_that_change_values_are_refused(monkeypatch):
    name = "model.layers.0.self_attn.o_proj.weight"
    _patched_revert(monkeypatch, lambda sd: {**sd, name: sd[name].float()})
    with pytest.raises(LayoutError, match=r"o_proj.*changes values or dtypes"):
        bind(_llama(), "reader", 0)

    def boom(sd):
        raise RuntimeError("dequantize wants floats")

    _patched_revert(monkeypatch, boom)
    with pytest.raises(LayoutError, match="LlamaForCausalLM.*dequantize wants floats.*bind_module"):
        bind(_llama(), "reader", 0)
