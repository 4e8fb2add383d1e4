"""FP8 and delta codecs on a GPU: the Triton kernels equal the formula's reference bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_codec_fp8 import (
    assert_matches_reference,
    assert_reader_holds,
    canonical,
    expected_wire,
    fsdp_writers,
    in_process,
    reference_quantize,
    sample_input,
    tp_readers,
)
from weightbus.codecs.delta import DeltaConfig
from weightbus.codecs.fp8 import (
    Fp8Config,
    QuantizePlan,
    block_amax,
    quantize,
    quantize_blocks,
    scales_from_amax,
)
from weightbus.plan import PlanOptions, allocate, fill_from_canonical, make_plan
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, WriterCodec, run_sync, wire_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    ((300, 260), torch.bfloat16, False),
    ((300, 260), torch.bfloat16, True),
    ((1024, 2048), torch.bfloat16, False),
    ((129, 1), torch.float16, False),
    ((640, 384), torch.float32, True),
    ((2048, 7168), torch.bfloat16, False),
]


@pytest.mark.parametrize("shape,dtype,ue8m0", CASES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fused_kernel_matches_reference(shape, dtype, ue8m0, impl):
    cfg = Fp8Config(scale_format="ue8m0" if ue8m0 else "float32")
    x = sample_input(*shape, dtype=dtype, seed=shape[0])
    q, s = quantize_blocks(x.cuda(), cfg, impl=impl)
    assert q.is_cuda and s.is_cuda
    assert_matches_reference(q, s, *reference_quantize(x, ue8m0=ue8m0))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_region_kernels_match_the_cpu(ue8m0):
    cfg = Fp8Config(scale_format="ue8m0" if ue8m0 else "float32")
    x = sample_input(700, 530, seed=9)
    q, s = quantize_blocks(x, cfg, impl="torch")
    xg = x.cuda().t().contiguous().t()  # strided source
    for r0, r1, c0, c1 in [(0, 700, 0, 530), (100, 650, 37, 300), (255, 257, 127, 129)]:
        blocks = (slice(r0 // 128, -(-r1 // 128)), slice(c0 // 128, -(-c1 // 128)))
        a = block_amax(xg[r0:r1, c0:c1], origin=(r0, c0), impl="triton")
        assert torch.equal(a.cpu(), block_amax(x[r0:r1, c0:c1], origin=(r0, c0), impl="torch"))
        out = torch.empty(c1 - c0, r1 - r0, dtype=torch.float8_e4m3fn, device="cuda").t()
        quantize(xg[r0:r1, c0:c1], s[blocks].cuda(), origin=(r0, c0), out=out, impl="triton")
        assert torch.equal(out.cpu().view(torch.uint8), q[r0:r1, c0:c1].view(torch.uint8))


def test_amax_kernel_propagates_nan():
    x = torch.zeros(200, 300, device="cuda")
    x[150, 3] = float("nan")
    x[10, 10] = -5.0
    a = block_amax(x, impl="triton").cpu()
    assert a[0, 0].item() == 5.0 and math.isnan(a[1, 0].item()) and a[1, 2].item() == 0.0


def _regions(device, block):
    """Sources of every dtype and stride the writer meets, at canonical origins that cut
    blocks, each with its own grid of scales (from the torch amax), and output offsets."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(300, 270, generator=g).to(torch.bfloat16)
    b = torch.randn(260, 150, generator=g).t()  # fp32, strided
    c = torch.randn(200, 300, generator=g).to(torch.float16)[:, 7:290]
    d = torch.randn(256, 384, generator=g).to(torch.bfloat16)  # whole weights, row shards:
    e = torch.randn(96, 160, generator=g)  # the aligned kernels' 16-byte loads and stores
    cpu = [(a[20:290, 5:260], (40, 9)), (b, (0, 0)), (c, (130, 3)), (a[:50, :70], (128, 0))]
    cpu += [(d, (0, 0)), (d[64:200], (64, 0)), (d[:, 128:], (0, 128)), (e, (32, 0))]
    out, off = [], 0
    for x, origin in cpu:
        s = scales_from_amax(block_amax(x, origin=origin, block=block, impl="torch"), Fp8Config())
        out.append((x.to(device), origin, s.to(device), off, x.shape[1]))
        off += -(-(x.numel() + 64) // 16) * 16
    return out, off


@pytest.mark.parametrize("block", [128, 32])
def test_one_launch_quantize_matches_the_torch_plan(block):
    gpu, size = _regions("cuda", block)
    cpu, _ = _regions("cpu", block)
    plan = QuantizePlan(gpu, block, torch.device("cuda"))
    assert plan._table is not None  # the Triton table, not torch
    assert {aligned for (_, aligned), *_ in plan._table.groups} == {False, True}
    got = torch.full((size,), 7, dtype=torch.uint8, device="cuda")
    plan.run(got)
    want = torch.full((size,), 7, dtype=torch.uint8)
    QuantizePlan(cpu, block, torch.device("cpu")).run(want)
    assert torch.equal(got.cpu(), want)


def test_one_launch_amax_merges_regions_and_propagates_nan():
    from weightbus.codecs import _fp8_triton

    block = 32
    gpu, _ = _regions("cuda", block)
    x0, o0, _, _, _ = gpu[0]
    x0[100, 7] = float("nan")
    # a second region over part of the first one's blocks: cells are raised, not overwritten
    extra = x0[:60, :40] * 3
    grids = [torch.zeros_like(s) for _, _, s, _, _ in gpu]
    sub = grids[0][: -(-(o0[0] % block + 60) // block), : -(-(o0[1] % block + 40) // block)]
    regions = [(x, o, gr, 0, 0) for (x, o, _, _, _), gr in zip(gpu, grids, strict=True)]
    _fp8_triton.RegionTable([*regions, (extra, o0, sub, 0, 0)], block, torch.device("cuda")).amax()
    for i, (x, o, _, _, _) in enumerate(gpu):
        want = block_amax(x.cpu(), origin=o, block=block, impl="torch")
        if i == 0:
            part = block_amax(extra.cpu(), origin=o, block=block, impl="torch")
            want[: part.shape[0], : part.shape[1]] = torch.maximum(
                want[: part.shape[0], : part.shape[1]], part
            )
        assert torch.equal(grids[i].cpu().nan_to_num(-1.0), want.nan_to_num(-1.0))
    assert math.isnan(grids[0][(o0[0] % block + 100) // block, (o0[1] % block + 7) // block])


@pytest.mark.parametrize("shadow,window", [("device", 1 << 30), ("host", 40 << 10)])
def test_codecs_end_to_end_on_gpu(shadow, window):
    cfg = Fp8Config()
    codecs = CodecConfig(
        fp8=cfg, delta=DeltaConfig(checksum_every=2, shadow=shadow, window_bytes=window)
    )
    canon = canonical(6)
    ws, rs = fsdp_writers(3), tp_readers()
    wires_r = [wire_layout(r, codecs) for r in rs]
    plan = make_plan(
        [wire_layout(w, codecs) for w in ws], wires_r, PlanOptions(bucket_bytes=32 << 10)
    )
    live = [allocate(w, device="cuda") for w in ws]
    got = [allocate(r, device="cuda") for r in wires_r]
    wcs = [WriterCodec(plan, i, live[i], codecs, amax_reduce=in_process) for i in range(3)]
    rcs = [ReaderCodec(plan, i, got[i], codecs) for i in range(2)]
    g = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        if step > 1:
            flat = canon[next(iter(canon))].view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[:50]
            flat[idx] = (flat[idx].float() * 1.5).to(flat.dtype)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, {k: v.cuda() for k, v in canon.items()}, t)
        run_sync(plan, wcs, rcs, step)
        want = expected_wire(canon, cfg)
        for lay, gt in zip(wires_r, got, strict=True):
            assert_reader_holds(lay, {k: v.cpu() for k, v in gt.items()}, want)
