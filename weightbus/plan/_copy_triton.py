"""Packing and unpacking a bucket on a GPU in one Triton launch, whatever its route count.

Imported only for CUDA tensors, where Triton exists. A :class:`CopyTable` is built once per
bucket and buffer (at the first sync that uses them): every route whose region and wire dtype
agree is cut into 2-D blocks of rows with unit column stride, and each block is a row of the
table (source and destination addresses and row strides, rows, width). One program copies a
``_GROUP * _BR x _BC`` tile of words of one block, so a bucket of thousands of small routes
costs one launch per word size instead of a ``copy_`` (a launch and several microseconds of
Python) per route. Routes that cast (an fp32 master weight sent as bf16) or have other strides
stay with ``copy_``.

The table holds raw addresses: the live tensors must stay in place (sessions check it every
sync) and the buffer alive (a session's staging buffers live as long as its epoch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

_BR, _BC, _GROUP = 16, 256, 8  # a program copies _GROUP tiles of _BR x _BC words
_FIELDS = 6  # per block: source address, its row stride, destination address, its row stride,
# rows, width (strides and width in words)
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_KIND = {1: 0, 2: 1, 4: 2, 8: 3}
_ROW = 4096  # words per row when a long vector is cut into rows

# every launch and warm-up passes enable_fp_fusion=False: no multiply and add is contracted
# into one rounding, whatever Triton's default (it changes in Triton 3.10), so float results
# round as the torch paths do


@triton.jit
def _copy_kernel(
    tiles_ptr,
    blocks_ptr,
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
    row = blocks_ptr + k * 6
    src_addr = tl.load(row)
    s0 = tl.load(row + 1)
    dst_addr = tl.load(row + 2)
    d0 = tl.load(row + 3)
    h = tl.load(row + 4)
    w = tl.load(row + 5)
    if KIND == 0:
        src = src_addr.to(tl.pointer_type(tl.uint8))
        dst = dst_addr.to(tl.pointer_type(tl.uint8))
    elif KIND == 1:
        src = src_addr.to(tl.pointer_type(tl.int16))
        dst = dst_addr.to(tl.pointer_type(tl.int16))
    elif KIND == 2:
        src = src_addr.to(tl.pointer_type(tl.int32))
        dst = dst_addr.to(tl.pointer_type(tl.int32))
    else:
        src = src_addr.to(tl.pointer_type(tl.int64))
        dst = dst_addr.to(tl.pointer_type(tl.int64))
    if ALIGNED:  # see _aligned: 16-byte loads and stores
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        s0 = tl.multiple_of(s0, 16)
        d0 = tl.multiple_of(d0, 16)
        w = tl.multiple_of(w, 16)
    c = tc * BC + tl.arange(0, BC).to(tl.int64)
    for g in range(GROUP):
        r = tr * (GROUP * BR) + g * BR + tl.arange(0, BR).to(tl.int64)
        mask = (r < h)[:, None] & (c < w)[None, :]
        x = tl.load(src + r[:, None] * s0 + c[None, :], mask=mask)
        tl.store(dst + r[:, None] * d0 + c[None, :], x, mask=mask)


def _aligned(src: int, s0: int, dst: int, d0: int, w: int) -> bool:
    """16-byte aligned addresses, and row strides and width multiples of 16 words."""
    return src % 16 == 0 and dst % 16 == 0 and s0 % 16 == 0 and d0 % 16 == 0 and w % 16 == 0


def blocks(x: torch.Tensor) -> list[tuple[torch.Tensor, int]] | None:
    """2-D views ``(rows, width)`` of ``x`` with unit column stride, in row-major order, with
    each one's first element's row-major position in ``x``; None when ``x`` has none such."""
    if x.dim() == 0:
        x = x.reshape(1, 1)
    if x.dim() == 1:
        n = x.shape[0]
        if x.stride(0) != 1 and n > 1:
            return [(x.unsqueeze(1), 0)]  # one word per row: correct, if slow (rare)
        m = n // _ROW if n > _ROW else 0  # a long vector as rows, so programs fill up
        out = [(x[: m * _ROW].view(m, _ROW), 0)] if m else []
        return out + ([(x[m * _ROW :].view(1, -1), m * _ROW)] if n > m * _ROW else [])
    if x.dim() == 2:
        parts = [x]
    else:
        try:
            parts = [x.view(-1, x.shape[-1])]
        except RuntimeError:  # leading dims that do not collapse
            parts = []
            for i in range(x.shape[0]):
                sub = blocks(x[i])
                if sub is None:
                    return None
                parts += [b for b, _ in sub]
    out, at = [], 0
    for b in parts:
        if b.numel() == 0:
            continue
        if b.stride(1) != 1 and b.shape[1] != 1:
            return None
        out.append((b, at))
        at += b.numel()
    return out


def tiles(shapes: Sequence[tuple[int, int]], rows: int, cols: int) -> np.ndarray:
    """``(block, tile row, tile column)`` int32 of every ``rows x cols`` tile of blocks of
    ``shapes`` (their ``(rows, width)``): one program each in a table kernel."""
    out = [np.zeros((0, 3), np.int64)]
    for k, (h, w) in enumerate(shapes):
        tr, tc = np.meshgrid(np.arange(-(-h // rows)), np.arange(-(-w // cols)), indexing="ij")
        out.append(np.stack([np.full(tr.size, k), tr.ravel(), tc.ravel()], 1))
    return np.concatenate(out).astype(np.int32)


def words(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as integers of its element size (None for sizes the kernel does not copy)."""
    size = x.element_size()
    if size not in _WORD:
        return None
    return (x if x.dim() else x.reshape(1)).view(_WORD[size])


class CopyTable:
    """One bucket's copies between regions of live tensors and the bucket's bytes.

    ``routes``: per route ``(region, wire)``: ``region`` a view of a live tensor (any strides,
    :func:`blocks` must find its blocks), ``wire`` the bucket's bytes for it in the region's
    dtype and shape (contiguous). ``pack`` copies regions into the bucket, else the bucket
    into the regions.
    """

    def __init__(self, routes: Sequence[tuple[torch.Tensor, torch.Tensor]], pack: bool) -> None:
        by: dict[tuple[int, bool], list] = {}
        device = None
        for region, wire in routes:
            size = region.element_size()
            ints = words(region)
            parts = blocks(ints) if ints is not None else None
            if parts is None or not wire.is_contiguous():
                raise ValueError("CopyTable routes need blocks with unit column stride")
            base = wire.data_ptr()
            for b, at in parts:
                h, w = b.shape
                rp, r0 = b.data_ptr(), (b.stride(0) if h > 1 else w)
                wp, w0 = base + at * size, w
                src, s0, dst, d0 = (rp, r0, wp, w0) if pack else (wp, w0, rp, r0)
                key = (_KIND[size], _aligned(src, s0, dst, d0, w))
                by.setdefault(key, []).append((src, s0, dst, d0, h, w))
                device = region.device
        self.groups = []
        for (kind, aligned), rows in sorted(by.items()):
            grid = tiles([(h, w) for *_, h, w in rows], _BR * _GROUP, _BC)
            t = torch.from_numpy(grid).to(device)
            b = torch.from_numpy(np.array(rows, dtype=np.int64).reshape(-1, _FIELDS)).to(device)
            self.groups.append((kind, aligned, t, b, len(t)))
        self.device = device

    def run(self) -> None:
        """Copy every block (on the current stream of the tables' device)."""
        if self.device is None:
            return
        on = (
            torch.cuda.device(self.device)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        with on:
            for kind, aligned, tiles, table, n in self.groups:
                _copy_kernel[(n,)](
                    tiles,
                    table,
                    KIND=kind,
                    ALIGNED=aligned,
                    BR=_BR,
                    BC=_BC,
                    GROUP=_GROUP,
                    enable_fp_fusion=False,
                )
