"""The verification sums on a GPU: one Triton launch per bucket, or per run of buckets, reads
each word once.

Imported only for CUDA tensors, where Triton exists. Computes exactly the ``s1`` and ``s2`` of
:mod:`weightbus.verify` (so CPU and GPU sums compare), without any floating point:

A bucket's routes are cut into 2-D *pieces* (rows of words with unit column stride) and each
piece into tiles of ``_GROUP * _BR x _BC`` words. A program sums its tile three ways, exactly in
integers: ``A = sum w``, ``R = sum r * w`` and ``C = sum c * w`` over the tile's local row
``r`` and column ``c``. A word's position in its route is ``p0 + r * width + c`` (``p0`` the
tile's first word's), so the tile adds ``A`` to ``s1`` and
``(p0 + 1) * A + width * R + C`` (mod ``PRIME``) to ``s2``, both with integer atomics (whose
order does not matter). Bounds: narrow words (1 and 2 bytes) are summed along a row in int32
(``|c * w| <= 255 * 2**15``, a row of 256 words stays below ``2**31``), everything else in
int64, far from overflow at ``2**17`` words per tile (``r < 2**9``).

The tables (pieces: address, row stride, rows, width, first position, route; tiles: piece,
tile row, tile column) are built on the host once per bucket geometry and buffer, and kept.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from weightbus.plan._copy_triton import blocks, tiles

# every launch and warm-up passes enable_fp_fusion=False: no multiply and add is contracted
# into one rounding, whatever Triton's default (it changes in Triton 3.10), so float results
# round as the torch paths do

_BR, _BC = 32, 256  # words per tile: rows, columns (_BC <= 256 keeps narrow row sums in int32)
# row tiles per program: a route's programs all add into its two sums, and atomics on one
# address serialize (one tile per program ran at 0.84 TB/s on an H200)
_GROUP = 16
_PIECE = 6  # int64 per piece: address, row stride, rows, width, first position, route
_KIND = {torch.uint8: 0, torch.int16: 1, torch.int32: 2}
_CACHED = 1024  # tables kept per verifier (buckets x staging buffers)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's interpreter (tests): CPU tensors run the kernels too."""


@triton.jit
def _sums_kernel(
    tiles_ptr,
    pieces_ptr,
    out_ptr,
    prime,
    KIND: tl.constexpr,
    ALIGNED: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    k = tl.load(tiles_ptr + pid * 3).to(tl.int64)
    tr = tl.load(tiles_ptr + pid * 3 + 1).to(tl.int64)
    tc = tl.load(tiles_ptr + pid * 3 + 2).to(tl.int64)
    row = pieces_ptr + k * 6
    addr = tl.load(row)
    s0 = tl.load(row + 1)
    h = tl.load(row + 2)
    w = tl.load(row + 3)
    first = tl.load(row + 4)
    route = tl.load(row + 5)
    if KIND == 0:
        ptr = addr.to(tl.pointer_type(tl.uint8))
    elif KIND == 1:
        ptr = addr.to(tl.pointer_type(tl.int16))
    else:
        ptr = addr.to(tl.pointer_type(tl.int32))
    if ALIGNED:  # see _aligned: lets the loads take 16 bytes at once
        ptr = tl.multiple_of(ptr, 16)
        s0 = tl.multiple_of(s0, 16)
        w = tl.multiple_of(w, 16)
    c = tc * BC + tl.arange(0, BC).to(tl.int64)
    cl = tl.arange(0, BC)
    a = tl.zeros([BR], tl.int64)
    rr = tl.zeros([BR], tl.int64)
    cc = tl.zeros([BR], tl.int64)
    for g in range(GROUP):  # GROUP row blocks per program: fewer atomics on a route's sums
        rl = g * BR + tl.arange(0, BR).to(tl.int64)
        r = tr * (GROUP * BR) + rl
        mask = (r < h)[:, None] & (c < w)[None, :]
        x = tl.load(ptr + r[:, None] * s0 + c[None, :], mask=mask, other=0)
        if KIND == 2:
            x64 = x.to(tl.int64)
            row_a = tl.sum(x64, axis=1)
            row_c = tl.sum(x64 * cl.to(tl.int64)[None, :], axis=1)
        else:
            x32 = x.to(tl.int32)  # uint8 widens unsigned, int16 signed
            row_a = tl.sum(x32, axis=1).to(tl.int64)
            row_c = tl.sum(x32 * cl[None, :], axis=1).to(tl.int64)
        a += row_a
        rr += row_a * rl
        cc += row_c
    a = tl.sum(a, axis=0)
    rr = tl.sum(rr, axis=0)
    cc = tl.sum(cc, axis=0)
    p0 = first + tr * (GROUP * BR) * w + tc * BC
    # residues in [0, prime): products of two stay below 2**62
    am = (a % prime + prime) % prime
    rm = (rr % prime + prime) % prime
    cm = (cc % prime + prime) % prime
    t = ((p0 + 1) % prime) * am % prime + (w % prime) * rm % prime + cm
    tl.atomic_add(out_ptr + route * 2, a, sem="relaxed")
    tl.atomic_add(out_ptr + route * 2 + 1, t % prime, sem="relaxed")


def _aligned(addr: int, s0: int, w: int) -> bool:
    """16-byte aligned rows of a multiple of 16 words: what the ``ALIGNED`` hints promise."""
    return addr % 16 == 0 and s0 % 16 == 0 and w % 16 == 0


class _Table:
    """One bucket's pieces and tiles on the device, grouped by word kind and alignment."""

    __slots__ = ("groups", "routes")

    def __init__(self, pieces: Sequence[tuple], routes: int, device: torch.device) -> None:
        self.routes = routes
        by: dict[tuple[int, bool], list] = {}
        for kind, addr, s0, h, w, first, route in pieces:
            aligned = _aligned(addr, s0, w)
            by.setdefault((kind, aligned), []).append((addr, s0, h, w, first, route))
        self.groups = []
        for (kind, aligned), rows in sorted(by.items()):
            table = np.array(rows, dtype=np.int64).reshape(-1, _PIECE)
            t = tiles([(h, w) for _, _, h, w, _, _ in rows], _BR * _GROUP, _BC)
            self.groups.append(
                (
                    kind,
                    aligned,
                    torch.from_numpy(t).to(device),
                    torch.from_numpy(table).to(device),
                    len(t),
                )
            )


class GpuSums:
    """A verifier's sums of CUDA buckets (see the module docstring).

    :meth:`add` launches a bucket's sums and returns its ``(routes, 2)`` int64 device tensor
    with ``s2`` not yet reduced modulo the prime (the caller reduces, once for all buckets), or
    None when the bucket's views do not fit the kernels (a column stride other than 1).
    """

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple, _Table | None] = OrderedDict()

    def add(self, words: Sequence[list[tuple[torch.Tensor, int]]]) -> torch.Tensor | None:
        """``words``: per route its pieces ``(word view, first position)`` (as
        :func:`weightbus.verify._pieces` gives them)."""
        key = tuple(
            (p.data_ptr(), tuple(p.shape), tuple(p.stride()), p.dtype, start)
            for route in words
            for p, start in route
        ) + (len(words),)
        table = self._tables.get(key, False)
        if table is False:
            table = self._build(words)
            self._tables[key] = table
            if len(self._tables) > _CACHED:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        if table is None:
            return None
        device = next(p.device for route in words for p, _ in route)
        out = torch.zeros((table.routes, 2), dtype=torch.int64, device=device)
        on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on:
            for kind, aligned, tiles, pieces, n in table.groups:
                _sums_kernel[(n,)](
                    tiles,
                    pieces,
                    out,
                    2**31 - 1,
                    KIND=kind,
                    ALIGNED=aligned,
                    BR=_BR,
                    BC=_BC,
                    GROUP=_GROUP,
                    num_warps=8,
                    enable_fp_fusion=False,
                )
        return out

    @staticmethod
    def _build(words: Sequence[list[tuple[torch.Tensor, int]]]) -> _Table | None:
        pieces = []
        device = None
        for route, parts in enumerate(words):
            for piece, start in parts:
                if piece.dtype not in _KIND or (piece.device.type != "cuda" and not INTERPRETED):
                    return None
                device = piece.device
                parts = blocks(piece)
                if parts is None:
                    return None
                for b, at in parts:
                    h, w = b.shape
                    kind = _KIND[b.dtype]
                    pieces.append((kind, b.data_ptr(), b.stride(0), h, w, start + at, route))
        if device is None:
            return None
        return _Table(pieces, len(words), device)
