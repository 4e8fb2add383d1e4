"""Packing and unpacking on a GPU: one Triton copy launch per bucket equals ``copy_`` per route."""

from __future__ import annotations

import pytest
import torch

from weightbus.plan.program import BucketCopier, BucketOp, Copy, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bucket(device: str):
    """Live tensors of several dtypes and a bucket of routes over them: strided rows, 3-D
    slices that do not collapse, long and strided vectors, a cast, a 0-d tensor."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(300, 700, generator=g).bfloat16(),
        "b": torch.randn(40, 50, 60, generator=g),
        "c": torch.randn(5000, generator=g).half(),
        "d": torch.randint(0, 255, (77, 33), generator=g, dtype=torch.uint8),
        "e": torch.randn(30, 20, generator=g).double(),
        "f": torch.randn(1200, 512, generator=g).bfloat16(),
        "m": torch.randn(16, 64, generator=g),
        "s": torch.randn((), generator=g),
    }
    tensors = {k: v.to(device) for k, v in tensors.items()}
    regions = [
        ("a", (slice(10, 290), slice(37, 600)), None),
        ("b", (slice(0, 40), slice(3, 40), slice(0, 60)), None),
        ("c", (slice(5, 4990),), None),
        ("d", (slice(1, 77), slice(2, 33)), None),
        ("e", (slice(3, 30), slice(0, 20)), None),
        ("f", (slice(100, 1100), slice(0, 512)), None),
        ("m", (slice(0, 16), slice(8, 64)), torch.bfloat16),  # cast on the wire
        ("s", (), None),
    ]
    copies, at = [], 0
    for key, index, wire in regions:
        region = tensors[key][index]
        dtype = wire or region.dtype
        nbytes = region.numel() * dtype.itemsize
        copies.append(
            Copy(
                key=key,
                index=index,
                shape=tuple(region.shape),
                offset=at,
                nbytes=nbytes,
                dtype=dtype,
                tensor=key,
            )  # fmt: skip
        )
        at += -(-(nbytes + 48) // 16) * 16
    op = BucketOp(bucket=0, peer=0, peer_global=1, wave=0, nbytes=at, copies=tuple(copies))
    return tensors, op


def test_compiled_pack_and_unpack_equal_copy_per_route():
    tensors, op = _bucket("cuda")
    cpu_tensors, _ = _bucket("cpu")
    want = torch.full((op.nbytes,), 0xFF, dtype=torch.uint8)  # the padding between routes
    pack(op, cpu_tensors, want)
    copier = BucketCopier()
    buf = torch.zeros(op.nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):  # compiled on the first call, replayed on the second
        buf.fill_(0xFF)
        copier.pack(op, tensors, buf)
        got = buf.cpu()
        for c in op.copies:  # route by route first, for a readable failure
            part = slice(c.offset, c.offset + c.nbytes)
            assert torch.equal(got[part], want[part]), (c.key, c.index)
        assert torch.equal(got, want)
    (entry,) = copier._compiled.values()
    assert entry[2] is not None and len(entry[3]) == 1  # all routes in one table but the cast
    poisoned = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v.clone().zero_()
                for k, v in tensors.items()}  # fmt: skip
    for _ in range(2):
        for v in poisoned.values():
            v.fill_(float("nan") if v.is_floating_point() else 0)
        copier.unpack(op, poisoned, buf)
        for c in op.copies:
            got, exp = poisoned[c.key][c.index], tensors[c.key][c.index]
            assert torch.equal(got, exp.to(c.dtype).to(got.dtype)), c.key
