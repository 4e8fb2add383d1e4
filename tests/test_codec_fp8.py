"""FP8 block codec: the formula, its error bound, ue8m0 scales, layouts across resharding."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from weightbus.codecs.fp8 import (
    DEFAULT_IGNORE,
    FP8_DTYPE,
    Fp8Config,
    block_amax,
    dequantize,
    quantize,
    quantize_blocks,
    quantized_layout,
    quantized_specs,
    scale_name,
    scales_from_amax,
)
from weightbus.plan import PlanOptions, allocate, fill_from_canonical, make_plan
from weightbus.plan.codec_plan import (
    CodecConfig,
    ReaderCodec,
    WriterCodec,
    check_codec_layouts,
    run_sync,
    wire_layout,
)
from weightbus.spec import Box, LayoutBuilder, LayoutError, Participant, TensorSpec

B = 128

# ---------------------------------------------------------------------------------------------
# the reference: the module docstring's formula, block by block, in float64 and numpy
# ---------------------------------------------------------------------------------------------


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round float64 values with |v| <= 448 to the nearest e4m3fn value, ties to even."""
    a = np.abs(v)
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    exp = np.maximum(e - 1, -6)  # binade of a; below 2**-6 the subnormal spacing 2**-9 holds
    quantum = np.ldexp(1.0, exp - 3)  # 3 mantissa bits
    return np.copysign(np.round(a / quantum) * quantum, v)  # np.round: half to even


def reference_quantize(
    x: torch.Tensor, *, block: int = B, eps: float = 1e-4, ue8m0: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(q as float64 values, s as float32) of a whole 2-D tensor, one block at a time."""
    xd = x.double().cpu().numpy()
    rows, cols = xd.shape
    nbr, nbc = -(-rows // block), -(-cols // block)
    q = np.zeros_like(xd)
    s = np.zeros((nbr, nbc), np.float32)
    eps32 = float(np.float32(eps))
    for i in range(nbr):
        for j in range(nbc):
            blk = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            amax = float(np.abs(xd[blk]).max())
            # a float64 quotient of two fp32 values rounded to fp32 is the correctly rounded
            # fp32 quotient (53 >= 2 * 24 + 2: this double rounding is innocuous)
            sc = float(np.float32(max(amax, eps32) / 448.0))
            if ue8m0:
                m, e = math.frexp(sc)
                sc = sc if m == 0.5 else math.ldexp(1.0, e)
            s[i, j] = sc
            v = (xd[blk] / sc).astype(np.float32).astype(np.float64)
            q[blk] = e4m3_round(np.clip(v, -448.0, 448.0))
    return q, s


def assert_matches_reference(q: torch.Tensor, s: torch.Tensor, ref_q, ref_s) -> None:
    got = q.float().double().cpu().numpy()
    assert np.array_equal(got, ref_q), np.argwhere(got != ref_q)[:5]
    assert np.array_equal(np.signbit(got), np.signbit(ref_q))
    assert np.array_equal(s.cpu().numpy(), ref_s)


def sample_input(rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Values over many magnitudes per block, zeros, -0.0, subnormal-range values, and ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.pow(10.0, torch.randint(-6, 4, (rows, 1), generator=g).float())
    x[: min(rows, 5), : min(cols, 7)] = 0.0 if rows > 1 else x[:1, :1]
    x[-1, -3:] = -0.0
    x[:, -1] *= 1e-5  # lands in e4m3's subnormal range within its block
    return x.to(dtype)


@pytest.mark.parametrize(
    "shape,dtype,ue8m0",
    [
        ((300, 260), torch.bfloat16, False),
        ((300, 260), torch.bfloat16, True),
        ((128, 384), torch.float32, False),
        ((77, 129), torch.float16, True),
        ((1, 1), torch.bfloat16, False),
    ],
)
def test_matches_reference(shape, dtype, ue8m0):
    cfg = Fp8Config(scale_format="ue8m0" if ue8m0 else "float32")
    x = sample_input(*shape, dtype=dtype)
    q, s = quantize_blocks(x, cfg, impl="torch")
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // B), -(-shape[1] // B))
    assert_matches_reference(q, s, *reference_quantize(x, ue8m0=ue8m0))


def test_rounding_ties_and_eps():
    # a block whose amax is 448 has s = 1 exactly, so x / s = x: ties of e4m3 are visible
    x = torch.zeros(B, B)
    vals = [448.0, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 0.3, -0.0]
    x[0, : len(vals)] = torch.tensor(vals)
    q, s = quantize_blocks(x, impl="torch")
    assert s.item() == 1.0
    got = q[0, : len(vals)].float().tolist()
    assert got == [448.0, 16.0, 20.0, 0.0, 2.0**-8, -0.0, 0.3125, -0.0]
    assert torch.signbit(q[0, 5].float()) and torch.signbit(q[0, 7].float())
    # an all-zero block gets s = eps / 448 and zeros
    q, s = quantize_blocks(torch.zeros(3, 5), Fp8Config(eps=1e-3), impl="torch")
    assert s.item() == float(np.float32(np.float32(1e-3) / np.float32(448.0)))
    assert not q.float().any()
    assert_matches_reference(q, s, *reference_quantize(torch.zeros(3, 5), eps=1e-3))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_dequantization_error_within_bound(ue8m0):
    cfg = Fp8Config(scale_format="ue8m0" if ue8m0 else "float32")
    x = sample_input(400, 300, seed=3).float()
    q, s = quantize_blocks(x, cfg, impl="torch")
    deq = dequantize(q, s)
    s_full = s.repeat_interleave(B, 0)[: x.shape[0]].repeat_interleave(B, 1)[:, : x.shape[1]]
    # e4m3 keeps 3 mantissa bits: half a unit in the last place is 2**-4 relative for normal
    # values, and 2**-10 * s in the subnormal range; the fp32 division and product add 2**-23
    bound = x.abs() * (2.0**-4 + 2.0**-20) + s_full * 2.0**-10
    err = (x - deq).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # the bound is nearly reached: it is the real one, not a loose one
    assert float((err / bound).max()) > 0.5


def test_ue8m0_scales_are_powers_of_two():
    x = sample_input(256, 512, seed=5)
    amax = block_amax(x)
    plain = scales_from_amax(amax, Fp8Config())
    pow2 = scales_from_amax(amax, Fp8Config(scale_format="ue8m0"))
    bits = pow2.view(torch.int32)
    assert bool(((bits & 0x7FFFFF) == 0).all()), "mantissa bits set"
    assert bool((pow2 >= plain).all()) and bool((pow2 < 2 * plain).all())
    q, s = quantize_blocks(x, Fp8Config(scale_format="ue8m0"), impl="torch")
    assert torch.equal(s, pow2)
    assert float(q.float().abs().max()) <= 448.0


def test_regions_use_the_whole_tensors_blocks():
    x = sample_input(300, 260, seed=7)
    q, s = quantize_blocks(x, impl="torch")
    for r0, r1, c0, c1 in [(100, 300, 37, 200), (0, 1, 255, 256), (128, 256, 0, 260)]:
        region = x[r0:r1, c0:c1]
        amax = block_amax(region, origin=(r0, c0))
        blocks = (slice(r0 // B, -(-r1 // B)), slice(c0 // B, -(-c1 // B)))
        assert amax.shape == s[blocks].shape
        got = quantize(region, s[blocks], origin=(r0, c0))
        assert torch.equal(got.view(torch.uint8), q[r0:r1, c0:c1].view(torch.uint8))
        # a strided (transposed) source and destination give the same bytes
        out = torch.empty(c1 - c0, r1 - r0, dtype=torch.float8_e4m3fn).t()
        quantize(region.t().contiguous().t(), s[blocks], origin=(r0, c0), out=out)
        assert torch.equal(out.view(torch.uint8), q[r0:r1, c0:c1].view(torch.uint8))
    with pytest.raises(ValueError, match="touches 2 x 1 blocks"):
        quantize(x[100:200, :10], s[:1, :1], origin=(100, 0))


def test_block_amax_propagates_nan():
    x = torch.zeros(200, 200)
    x[150, 3] = float("nan")
    x[10, 10] = -5.0
    a = block_amax(x)
    assert a[0, 0].item() == 5.0 and math.isnan(a[1, 0].item())
    assert a[0, 1].item() == 0.0 and a[1, 1].item() == 0.0


# ---------------------------------------------------------------------------------------------
# which tensors, and the specs on the wire
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ignore",
    [(), DEFAULT_IGNORE, ("*.mlp.*", "model.layers.[0-3].*", "*[!t]_proj.weight", "?m_head*")],
)
def test_ignore_patterns_match_as_fnmatchcase(ignore):
    """The ignore list, tested as one expression, keeps fnmatchcase's meaning: wildcards,
    character classes and their negation, case sensitivity."""
    import fnmatch

    from weightbus.layouts.families import model_spec

    names = [t.name for t in model_spec("qwen3-30b-a3b").tensors] + [
        "LM_HEAD.weight",
        "model.layers.10.self_attn.o_proj.weight",
        "model.Norm.weight",
    ]
    cfg = Fp8Config(ignore=ignore)
    for name in names:
        spec = TensorSpec(name=name, shape=(256, 256), dtype="bfloat16")
        expect = not any(fnmatch.fnmatchcase(name, p) for p in ignore)
        assert cfg.quantizes(spec) == expect, (name, ignore)


def test_quantized_specs_and_default_ignore_list():
    h = 256
    names = {
        "model.embed_tokens.weight": (1000, h),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (h, h),
        "model.layers.0.self_attn.q_proj.bias": (h,),
        "model.layers.0.self_attn.kv_a_layernorm.weight": (64,),
        "model.layers.0.mlp.gate.weight": (8, h),  # router
        "model.layers.0.mlp.gate.e_score_correction_bias": (8,),
        "model.layers.0.mlp.experts.0.gate_proj.weight": (300, h),
        "model.layers.0.mlp.router.weight": (8, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (1000, h),
    }
    specs = [TensorSpec(name=n, shape=s, dtype="bfloat16") for n, s in names.items()]
    out = {s.name: s for s in quantized_specs(specs, Fp8Config())}
    quantized = {n for n, s in out.items() if s.dtype == FP8_DTYPE}
    assert quantized == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
    }
    sc = out["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"]
    assert sc.shape == (3, 2) and sc.dtype == "float32"
    assert len(out) == len(names) + 2
    # an ignore list of its own; integer tensors never
    cfg = Fp8Config(ignore=("*q_proj*",))
    out = {s.name: s for s in quantized_specs(specs, cfg)}
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == "bfloat16"
    assert out["lm_head.weight"].dtype == FP8_DTYPE
    assert not cfg.quantizes(TensorSpec(name="w", shape=(4, 4), dtype="int32"))
    with pytest.raises(ValueError, match="looks quantized"):
        quantized_specs(
            [
                TensorSpec(name="w.weight", shape=(4, 4), dtype="bfloat16"),
                TensorSpec(name="w.weight_scale_inv", shape=(1, 1), dtype="float32"),
            ],
            Fp8Config(),
        )


def test_config_checks():
    with pytest.raises(ValueError, match="power of two"):
        Fp8Config(block=100)
    with pytest.raises(ValueError, match="scale_format"):
        Fp8Config(scale_format="e8m0")
    with pytest.raises(ValueError, match="eps"):
        Fp8Config(eps=0.0)
    assert Fp8Config().key() != Fp8Config(scale_format="ue8m0").key()


# ---------------------------------------------------------------------------------------------
# layouts: readers' engine-style scale tensors, writers' grids, straddled blocks
# ---------------------------------------------------------------------------------------------


def build(role, rank, tensors, pieces, locals_=None):
    """A layout: ``tensors`` name -> shape (bf16); ``pieces`` (tensor, start, stop, key,
    local_start); a piece's local tensor defaults to its own box shape."""
    b = LayoutBuilder(Participant(role=role, rank=rank))
    locals_ = dict(locals_ or {})
    for _, start, stop, key, _ in pieces:
        locals_.setdefault(key, tuple(e - s for s, e in zip(start, stop, strict=True)))
    for name in dict.fromkeys(p[0] for p in pieces):
        b.add_tensor(name, tensors[name], "bfloat16")
    for key, shape in locals_.items():
        b.add_local(key, shape, "bfloat16")
    for t, start, stop, key, lstart in pieces:
        lstart = lstart or (0,) * len(locals_[key])
        ext = tuple(e - s for s, e in zip(start, stop, strict=True))
        lead = len(locals_[key]) - len(ext)
        b.add_piece(t, Box(start, stop), key, Box.at(lstart, (1,) * lead + ext))
    return b.build()


def scale_pieces(layout):
    return sorted(
        (p.tensor, p.box.start, p.box.stop, p.key, p.local_box.start)
        for p in layout.iter_pieces()
        if p.tensor.endswith("_scale_inv")
    )


W = "layers.0.mlp.down_proj.weight"


def test_reader_scales_follow_the_engine_grid():
    tensors = {W: (500, 260)}
    aligned = build("reader", 0, tensors, [(W, (256, 0), (500, 260), W, None)])
    lay = quantized_layout(aligned, Fp8Config())
    local = {lt.key: lt for lt in lay.locals}
    assert local[W].dtype == FP8_DTYPE
    assert local[W + "_scale_inv"].shape == (2, 3)
    assert scale_pieces(lay) == [(scale_name(W), (2, 0), (4, 3), W + "_scale_inv", (0, 0))]
    # rows 100..300 cut blocks 0 and 2: the reader gets blocks 0, 1 and 2, whole
    cut = build("reader", 0, tensors, [(W, (100, 0), (300, 260), W, None)])
    lay = quantized_layout(cut, Fp8Config())
    assert {lt.key: lt.shape for lt in lay.locals}[W + "_scale_inv"] == (3, 3)
    assert scale_pieces(lay) == [(scale_name(W), (0, 0), (3, 3), W + "_scale_inv", (0, 0))]


def test_fused_and_stacked_reader_locals():
    q, k, v = "a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight"
    tensors = {q: (256, 200), k: (128, 200), v: (128, 200)}
    qkv = [
        (q, (0, 0), (256, 200), "qkv", (0, 0)),
        (k, (0, 0), (128, 200), "qkv", (256, 0)),
        (v, (0, 0), (128, 200), "qkv", (384, 0)),
    ]
    lay = quantized_layout(build("reader", 0, tensors, qkv, {"qkv": (512, 200)}), Fp8Config())
    assert {lt.key: lt.shape for lt in lay.locals}["qkv_scale_inv"] == (4, 2)
    assert scale_pieces(lay) == [
        (scale_name(k), (0, 0), (1, 2), "qkv_scale_inv", (2, 0)),
        (scale_name(q), (0, 0), (2, 2), "qkv_scale_inv", (0, 0)),
        (scale_name(v), (0, 0), (1, 2), "qkv_scale_inv", (3, 0)),
    ]
    # a 64-row k_proj puts v_proj 64 rows into a block: one grid cannot serve both
    tensors[k] = (64, 200)
    bad = [
        qkv[0],
        (k, (0, 0), (64, 200), "qkv", (256, 0)),
        (v, (0, 0), (128, 200), "qkv", (320, 0)),
    ]
    with pytest.raises(LayoutError, match=r"different offsets .* \(0, 0\) vs \(64, 0\)"):
        quantized_layout(build("reader", 0, tensors, bad, {"qkv": (448, 200)}), Fp8Config())
    # q rows 0..64 and k rows 64..128 (a shard) on the same grid share block 0
    bad = [(q, (0, 0), (64, 200), "qk", (0, 0)), (k, (0, 0), (64, 200), "qk", (64, 0))]
    tensors[k] = (128, 200)
    bad[1] = (k, (64, 0), (128, 200), "qk", (64, 0))
    with pytest.raises(
        LayoutError, match=r"holds a.q_proj.weight and a.k_proj.weight in one 128 x 128"
    ):
        quantized_layout(build("reader", 0, tensors, bad, {"qk": (128, 200)}), Fp8Config())
    # two shards of one tensor at different offsets within a block
    w = "b.weight"
    odd = [(w, (0, 0), (100, 64), "w", (0, 0)), (w, (100, 0), (200, 64), "w", (110, 0))]
    with pytest.raises(LayoutError, match="different offsets"):
        quantized_layout(build("reader", 0, {w: (200, 64)}, odd, {"w": (210, 64)}), Fp8Config())
    # a norm and a weight in one local tensor cannot have one dtype
    n = "c.norm.weight"
    mixed = [(w, (0, 0), (200, 64), "m", (0, 0)), (n, (0, 0), (1, 64), "m", (200, 0))]
    with pytest.raises(LayoutError, match="one local tensor has one dtype"):
        quantized_layout(
            build("reader", 0, {w: (200, 64), n: (1, 64)}, mixed, {"m": (201, 64)}), Fp8Config()
        )
    # stacked experts (E, 2 * I, H): gate and up of each expert, scales (E, blocks, blocks)
    g0, u0, g1, u1 = (f"e.{i}.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up"))
    t = {name: (128, 256) for name in (g0, u0, g1, u1)}
    w13 = [
        (g0, (0, 0), (128, 256), "w13", (0, 0, 0)),
        (u0, (0, 0), (128, 256), "w13", (0, 128, 0)),
        (g1, (0, 0), (128, 256), "w13", (1, 0, 0)),
        (u1, (0, 0), (128, 256), "w13", (1, 128, 0)),
    ]
    lay = quantized_layout(build("reader", 0, t, w13, {"w13": (2, 256, 256)}), Fp8Config())
    assert {lt.key: lt.shape for lt in lay.locals}["w13_scale_inv"] == (2, 2, 2)
    assert (scale_name(u1), (0, 0), (1, 2), "w13_scale_inv", (1, 1, 0)) in scale_pieces(lay)


# ---------------------------------------------------------------------------------------------
# end to end: FSDP-style writers that cut blocks -> readers that cut other blocks
# ---------------------------------------------------------------------------------------------

Q = "layers.0.self_attn.q_proj.weight"
NORM = "layers.0.input_layernorm.weight"
EMB = "model.embed_tokens.weight"
SHAPES = {W: (300, 260), Q: (256, 200), NORM: (200,), EMB: (50, 200)}


def fsdp_writers(n, rows_per=None):
    """``torch.chunk`` along dim 0 into ``n`` shards (or ``rows_per`` rows each)."""
    out = []
    for rank in range(n):
        pieces = []
        for name, shape in SHAPES.items():
            size = rows_per or -(-shape[0] // n)
            lo, hi = min(rank * size, shape[0]), min((rank + 1) * size, shape[0])
            if hi > lo:
                start, stop = (lo,) + (0,) * (len(shape) - 1), (hi,) + tuple(shape[1:])
                pieces.append((name, start, stop, name, None))
        out.append(build("writer", rank, SHAPES, pieces))
    return out


def tp_readers():
    """Reader 0: W columns 0..130 (cuts column block 1), Q rows 0..150 (cuts row block 1),
    the norm and embedding; reader 1 the rest of W and Q."""
    r0 = [
        (W, (0, 0), (300, 130), W, None),
        (Q, (0, 0), (150, 200), Q, None),
        (NORM, (0,), (200,), NORM, None),
        (EMB, (0, 0), (50, 200), EMB, None),
    ]
    r1 = [(W, (0, 130), (300, 260), W, None), (Q, (150, 0), (256, 200), Q, None)]
    return [build("reader", 0, SHAPES, r0), build("reader", 1, SHAPES, r1)]


def canonical(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}


def expected_wire(canon, cfg):
    out = dict(canon)
    for name, x in canon.items():
        if cfg.quantizes(TensorSpec(name=name, shape=tuple(x.shape), dtype="bfloat16")):
            out[name], out[scale_name(name)] = quantize_blocks(x, cfg, impl="torch")
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_reader_holds(lay, got, want):
    for p in lay.iter_pieces():
        have = got[p.key][p.local_box.slices()]
        exp = want[p.tensor][p.box.slices()].reshape(have.shape)
        assert have.dtype == exp.dtype, (p.tensor, have.dtype, exp.dtype)
        same = torch.equal(bits(have), bits(exp))
        assert same, (lay.name, p.tensor)


def connect(writers, readers, codecs, canon, **kwargs):
    """Wire layouts, plan, codecs; writers' live bf16 tensors filled, readers poisoned."""
    wires_w = [wire_layout(w, codecs) for w in writers]
    wires_r = [wire_layout(r, codecs) for r in readers]
    check_codec_layouts(wires_w, wires_r)
    plan = make_plan(wires_w, wires_r, PlanOptions(bucket_bytes=64 << 10, direct_bytes=0))
    live = [allocate(w) for w in writers]
    for lay, t in zip(writers, live, strict=True):
        fill_from_canonical(lay, canon, t)
    wcs = [WriterCodec(plan, i, live[i], codecs, **kwargs) for i in range(len(writers))]
    got = [allocate(r) for r in wires_r]
    rcs = [ReaderCodec(plan, i, got[i], codecs) for i in range(len(readers))]
    return plan, wires_r, live, got, wcs, rcs


@pytest.mark.parametrize("ue8m0", [False, True])
def test_writers_that_cut_blocks_agree_on_scales(ue8m0):
    cfg = Fp8Config(scale_format="ue8m0" if ue8m0 else "float32")
    codecs = CodecConfig(fp8=cfg)
    canon = canonical()
    writers = fsdp_writers(3)  # W rows 0..100, 100..200, 200..300: blocks 0 and 1 are cut
    plan, wires_r, _, got, wcs, rcs = connect(
        writers, tp_readers(), codecs, canon, amax_reduce=in_process
    )
    assert wcs[0].scales.exchange_size > 0
    run_sync(plan, wcs, rcs, version=1)
    want = expected_wire(canon, cfg)
    assert want[W].dtype == torch.float8_e4m3fn and want[EMB].dtype == torch.bfloat16
    for lay, g in zip(wires_r, got, strict=True):
        assert_reader_holds(lay, g, want)
    # reader 0 holds Q rows 0..150 with a phase-0 grid of 2 scale rows; its dequantized shard
    # is the same rows of the whole tensor's dequantization
    whole = dequantize(want[Q], want[scale_name(Q)])
    mine = dequantize(got[0][Q], got[0][Q + "_scale_inv"])
    assert torch.equal(mine, whole[:150])
    # reader 1 holds Q rows 150..256: its grid starts inside block 1 (phase 22)
    mine = dequantize(got[1][Q], got[1][Q + "_scale_inv"], origin=(150 % B, 0))
    assert torch.equal(mine, whole[150:])
    wm = dequantize(want[W], want[scale_name(W)])
    assert torch.equal(
        dequantize(got[1][W], got[1][W + "_scale_inv"], origin=(0, 130)), wm[:, 130:]
    )


def test_straddling_reader_gets_whole_blocks():
    cfg = Fp8Config()
    canon = canonical(1)
    readers = [
        build("reader", 0, SHAPES, [(W, (100, 0), (300, 260), W, None)]),
        build("reader", 1, SHAPES, [(W, (0, 0), (100, 260), W, None)]),
    ]
    writers = [build("writer", 0, SHAPES, [(W, (0, 0), (300, 260), W, None)])]
    plan, wires_r, _, got, wcs, rcs = connect(writers, readers, CodecConfig(fp8=cfg), canon)
    assert wcs[0].scales.exchange_size == 0  # one writer holds every block whole
    run_sync(plan, wcs, rcs, version=1)
    want = expected_wire(canon, cfg)
    # the scale row of block 0 goes to both readers
    assert got[0][W + "_scale_inv"].shape == (3, 3) and got[1][W + "_scale_inv"].shape == (1, 3)
    assert torch.equal(got[0][W + "_scale_inv"], want[scale_name(W)])
    assert torch.equal(got[1][W + "_scale_inv"], want[scale_name(W)][:1])
    whole = dequantize(want[W], want[scale_name(W)])
    assert torch.equal(
        dequantize(got[0][W], got[0][W + "_scale_inv"], origin=(100, 0)), whole[100:]
    )
    assert torch.equal(dequantize(got[1][W], got[1][W + "_scale_inv"]), whole[:100])


def test_cut_blocks_need_an_amax_reduce():
    canon = canonical()
    with pytest.raises(ValueError, match=r"cut FP8 blocks .*layers.0.mlp.down_proj.weight"):
        connect(fsdp_writers(3), tp_readers(), CodecConfig(fp8=Fp8Config()), canon)
    # block-aligned shards (128 rows each) need none
    *_, wcs, _ = connect(
        fsdp_writers(3, rows_per=128), tp_readers(), CodecConfig(fp8=Fp8Config()), canon
    )
    assert all(w.scales.exchange_size == 0 for w in wcs)


def in_process(t: torch.Tensor) -> None:
    """The amax reduce of writers under run_sync, which exchanges amaxes itself."""
    raise AssertionError("run_sync does the writers' amax exchange in process")


class ThreadMax:
    """An all-reduce (MAX) between threads of this process, standing in for the trainer's."""

    def __init__(self, n: int) -> None:
        self.n, self.bufs, self.lock = n, [], threading.Lock()
        self.barrier = threading.Barrier(n)

    def __call__(self, t: torch.Tensor) -> None:
        with self.lock:
            self.bufs.append(t)
        self.barrier.wait(timeout=30)
        m = torch.stack(self.bufs).amax(0)
        self.barrier.wait(timeout=30)
        t.copy_(m)
        self.barrier.wait(timeout=30)
        with self.lock:
            self.bufs.clear()


def test_writer_begin_runs_the_amax_reduce():
    canon = canonical(2)
    codecs = CodecConfig(fp8=Fp8Config())
    reduce = ThreadMax(3)
    plan, wires_r, _, got, wcs, rcs = connect(
        fsdp_writers(3), tp_readers(), codecs, canon, amax_reduce=reduce
    )
    errors = []

    def begin(w):
        try:
            w.begin(1)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=begin, args=(w,)) for w in wcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    want = expected_wire(canon, codecs.fp8)
    for w in wcs:
        for t, (o0, o1) in w.scales.origin.items():
            grid = w.scales.tensors[scale_name(t)]
            full = want[scale_name(t)][o0 : o0 + grid.shape[0], o1 : o1 + grid.shape[1]]
            assert torch.equal(grid, full), (w.name, t)


def test_amax_pass_of_bound_tensors_equals_the_general_one():
    canon = canonical(3)
    codecs = CodecConfig(fp8=Fp8Config())
    plan, wires_r, _, got, wcs, rcs = connect(
        fsdp_writers(3), tp_readers(), codecs, canon, amax_reduce=in_process
    )
    for w in wcs:
        bound = w.scales.partial(w.live)  # regions found at connect
        flat = w.scales.flat.clone()
        other = w.scales.partial(dict(w.live))  # another mapping: found again
        assert torch.equal(w.scales.flat, flat) and torch.equal(bound, other)


def test_non_finite_weights_are_refused():
    canon = canonical()
    canon[W][250, 7] = float("inf")
    plan, _, _, _, wcs, rcs = connect(
        fsdp_writers(3), tp_readers(), CodecConfig(fp8=Fp8Config()), canon, amax_reduce=in_process
    )
    with pytest.raises(ValueError, match=r"writer-2.*down_proj.*NaN or infinite.*block \(1, 0\)"):
        run_sync(plan, wcs, rcs, version=1)


def test_fp8_on_one_side_only_fails_at_connect():
    writers = [wire_layout(w, CodecConfig(fp8=Fp8Config())) for w in fsdp_writers(2)]
    readers = tp_readers()
    with pytest.raises(LayoutError, match="writers quantize to FP8 and the reader"):
        check_codec_layouts(writers, readers)
    with pytest.raises(LayoutError):
        make_plan(writers, readers)
    plain_w = fsdp_writers(2)
    fp8_r = [wire_layout(r, CodecConfig(fp8=Fp8Config())) for r in readers]
    with pytest.raises(LayoutError, match="reader quantize to FP8 and the writers"):
        check_codec_layouts(plain_w, fp8_r)
    with pytest.raises(LayoutError):
        make_plan(plain_w, fp8_r)
    assert CodecConfig(fp8=Fp8Config()).digest() != CodecConfig().digest()
    assert CodecConfig(fp8=Fp8Config()).digest().startswith("fp8:")


def test_two_pieces_of_one_tensor_share_a_scale_block_once():
    # one local tensor holds W's rows 0..64 and 64..300 as two pieces: both touch block row 0,
    # whose scales the reader receives once
    cfg = Fp8Config()
    canon = canonical(3)
    two = [(W, (0, 0), (64, 260), "w", (0, 0)), (W, (64, 0), (300, 260), "w", (64, 0))]
    readers = [build("reader", 0, SHAPES, two, {"w": (300, 260)})]
    lay = quantized_layout(readers[0], cfg)
    assert scale_pieces(lay) == [
        (scale_name(W), (0, 0), (1, 3), "w_scale_inv", (0, 0)),
        (scale_name(W), (1, 0), (3, 3), "w_scale_inv", (1, 0)),
    ]
    writers = [build("writer", 0, SHAPES, [(W, (0, 0), (300, 260), W, None)])]
    plan, wires_r, _, got, wcs, rcs = connect(writers, readers, CodecConfig(fp8=cfg), canon)
    run_sync(plan, wcs, rcs, version=1)
    want = expected_wire(canon, cfg)
    assert torch.equal(bits(got[0]["w"]), bits(want[W]))
    assert torch.equal(got[0]["w_scale_inv"], want[scale_name(W)])
