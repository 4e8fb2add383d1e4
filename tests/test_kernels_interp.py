"""The GPU kernels' logic on CPU, in Triton's interpreter: verification sums, bucket copies, FP8.

CI has no GPU; these run the same Triton kernels over CPU tensors with ``TRITON_INTERPRET=1``
(set before triton is first imported, so :func:`test_kernels_in_the_interpreter` runs this
module's ``test_interp_*`` tests in a child pytest). The interpreter runs programs one after
another: races and compile-time problems show only on a GPU (``tests/test_verify.py``,
``tests/test_pack_gpu.py``, ``tests/test_codec_gpu.py``, marker ``gpu``).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.interp import INTERPRETER, run_interpreted

interp = pytest.mark.skipif(
    not INTERPRETER, reason="runs under TRITON_INTERPRET=1 (test_kernels_in_the_interpreter)"
)


@pytest.mark.skipif(INTERPRETER, reason="already in the interpreter")
def test_kernels_in_the_interpreter():
    """This module's ``test_interp_*`` tests in a child pytest under TRITON_INTERPRET=1."""
    run_interpreted(__file__)


def _views(seed: int) -> list[torch.Tensor]:
    """Routes of every word width and layout a bucket meets: strided rows, leading dims that
    do not collapse, long and short vectors, a 0-d tensor, aligned and unaligned rows."""
    rng = random.Random(seed)
    views = []
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float64, torch.int8):
        shape = (rng.randint(1, 70), rng.randint(1, 700))
        t = (torch.randn(shape) * 3000).to(dtype)
        views.append(t[:, rng.randrange(shape[1]) :])
    return views + [
        torch.randn(4, 5, 6)[:, 1:4, :].bfloat16(),
        torch.randn(4, 5, 6).bfloat16()[:, 1:4, :],
        (torch.randn(1200, 300) * 3000).bfloat16()[:, 7:],  # several row groups per program
        torch.randn(64, 512).bfloat16(),
        torch.randn(9000).bfloat16(),
        torch.tensor(3.0).bfloat16(),
        torch.full((40, 300), -32768, dtype=torch.int16),
    ]


@interp
def test_interp_verify_sums_equal_the_definition():
    from weightbus.verify import Verifier, route_sums

    views = _views(2)
    op = SimpleNamespace(bucket=0, copies=[None] * len(views))
    v = Verifier("checksum")
    v.begin()
    v.add(op, views)
    assert v._gpu is not False and next(iter(v._gpu._tables.values())) is not None
    assert np.array_equal(v.collect()[0], route_sums(views).numpy())


@interp
def test_interp_verify_sums_of_many_buckets_in_one_launch_equal_each_buckets():
    """Verifier.add_all: one launch over several buckets gives each bucket its own routes'
    sums; a bucket the kernel cannot read (a transposed route) sends every bucket the
    per-bucket way, with the same numbers."""
    from weightbus._verify_triton import _sums_kernel
    from weightbus.verify import Verifier, route_sums

    buckets = [_views(3), _views(4)[:5], [torch.randn(30, 20).bfloat16()]]
    ops = [SimpleNamespace(bucket=b, copies=[None] * len(v)) for b, v in enumerate(buckets)]
    launches = []
    run = _sums_kernel.run

    def counted(*args, **kwargs):
        launches.append(kwargs["grid"])
        return run(*args, **kwargs)

    _sums_kernel.run = counted
    try:
        v = Verifier("checksum")
        v.begin()
        v.add_all(ops, buckets)
        (table,) = v._gpu._tables.values()
        together = len(launches)
        got = v.collect()
        transposed = [*buckets[:2], [torch.randn(30, 20).bfloat16().t()]]
        v.begin()
        v.add_all(ops, transposed)
        apart = v.collect()
    finally:
        _sums_kernel.run = run
    # one table over every bucket's routes, a launch per group of pieces (word width and
    # alignment) for all buckets together
    assert table.routes == sum(len(b) for b in buckets)
    assert together == len(table.groups) < sum(len(b) for b in buckets)
    for b, views in enumerate(buckets):
        assert np.array_equal(got[b], route_sums(views).numpy()), b
    for b, views in enumerate(transposed):
        assert np.array_equal(apart[b], route_sums(views).numpy()), b


@interp
def test_interp_copy_tables_pack_and_unpack_every_layout():
    from weightbus.plan._copy_triton import CopyTable

    regions = _views(3)
    sizes = [-(-(r.numel() * r.element_size() + 48) // 16) * 16 for r in regions]
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    wires, at = [], 0
    for r, n in zip(regions, sizes, strict=True):
        wires.append(buf[at : at + r.numel() * r.element_size()].view(r.dtype).view(r.shape))
        at += n
    CopyTable(list(zip(regions, wires, strict=True)), pack=True).run()
    for r, w in zip(regions, wires, strict=True):
        assert torch.equal(w.view(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8))
    back = [torch.full_like(r, 0) for r in regions]
    CopyTable(list(zip(back, wires, strict=True)), pack=False).run()
    for got, r in zip(back, regions, strict=True):
        assert torch.equal(got.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8))


@interp
def test_interp_fp8_aligned_tables_equal_the_unaligned_ones(monkeypatch):
    """The 16-byte (aligned) variant of the FP8 table kernels writes what the element-wise
    one writes (the interpreter rounds to e4m3 its own way, so the two are compared, and the
    GPU tests compare both with torch)."""
    from weightbus.codecs import _fp8_triton as k
    from weightbus.codecs.fp8 import Fp8Config, block_amax, scales_from_amax

    block = 32
    a = torch.randn(96, 128).bfloat16()
    regions = [(a, (0, 0)), (a[32:96, 16:112], (32, 16)), (torch.randn(64, 80), (0, 0))]
    regions += [(a[:, :64], (0, 64)), (torch.randn(70, 50).half(), (3, 5))]
    parts, off = [], 0
    for x, o in regions:
        s = scales_from_amax(block_amax(x, origin=o, block=block, impl="torch"), Fp8Config())
        parts.append((x, o, s, off, x.shape[1]))
        off += -(-(x.numel() + 16) // 16) * 16

    def run(aligned: bool):
        if not aligned:
            monkeypatch.setattr(k, "_aligned", lambda *a: False)
        table = k.RegionTable(parts, block, torch.device("cpu"))
        out = torch.full((off,), 7, dtype=torch.uint8)
        table.quantize(out)
        grids = [torch.zeros_like(s) for _, _, s, _, _ in parts]
        k.RegionTable(
            [(x, o, g, 0, 0) for (x, o, _, _, _), g in zip(parts, grids, strict=True)],
            block,
            torch.device("cpu"),
        ).amax()
        return table, out, grids

    table, fast, fast_grids = run(True)
    assert {aligned for (_, aligned), *_ in table.groups} == {False, True}
    _, plain, plain_grids = run(False)
    assert torch.equal(fast, plain)
    for g, h, (x, o, _, _, _) in zip(fast_grids, plain_grids, parts, strict=True):
        assert torch.equal(g, h) and torch.equal(g, block_amax(x, origin=o, block=block))
