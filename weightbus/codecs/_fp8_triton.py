"""Triton kernels of the FP8 block codec (imported only for CUDA tensors, where Triton exists).

One program per block. Each computes exactly what :mod:`weightbus.codecs.fp8` specifies:
correctly rounded fp32 divisions (``tl.div_rn``, not Triton's approximate ``/``), round to
nearest-even into e4m3 after clamping, amax NaN-propagating (``tl.max`` alone would drop NaN).

The *table* kernels serve the writer's hot path: a :class:`RegionTable` built once at connect
lists fixed regions (addresses of live tensors, strides, block phases, where scales and
results go) and every block of every region, so one launch quantizes a whole bucket, or
computes every block amax of a writer, whatever the number of tensors. The tables hold raw
addresses: the tensors they were built from must stay alive and in place (the writer's live
parameters and scale grids do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from weightbus.codecs.fp8 import FP8_MAX, Fp8Config, scale_shape

# every launch and warm-up passes enable_fp_fusion=False: no multiply and add is contracted
# into one rounding, whatever Triton's default (it changes in Triton 3.10), so float results
# round as the torch paths do


@triton.jit
def _load_block(x_ptr, sx0, sx1, h, w, pr, pc, bi, bj, BLOCK: tl.constexpr):
    rows = bi * BLOCK - pr + tl.arange(0, BLOCK)
    cols = bj * BLOCK - pc + tl.arange(0, BLOCK)
    mask = ((rows >= 0) & (rows < h))[:, None] & ((cols >= 0) & (cols < w))[None, :]
    offs = rows[:, None].to(tl.int64) * sx0 + cols[None, :].to(tl.int64) * sx1
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x, rows, cols, mask


@triton.jit
def _amax_of(x):
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
    return tl.where(nan > 0, float("nan"), amax)


@triton.jit
def _store_q(q_ptr, sq0, sq1, x, s, rows, cols, mask, fmax, BLOCK: tl.constexpr):
    sv = tl.zeros([BLOCK, BLOCK], tl.float32) + s
    v = tl.div_rn(x, sv)
    v = tl.minimum(tl.maximum(v, -fmax), fmax)
    offs = rows[:, None].to(tl.int64) * sq0 + cols[None, :].to(tl.int64) * sq1
    tl.store(q_ptr + offs, v.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _amax_kernel(x_ptr, sx0, sx1, h, w, pr, pc, out_ptr, nbc, BLOCK: tl.constexpr):
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    x, rows, cols, mask = _load_block(x_ptr, sx0, sx1, h, w, pr, pc, bi, bj, BLOCK)
    tl.store(out_ptr + bi * nbc + bj, _amax_of(x))


@triton.jit
def _quant_kernel(
    x_ptr, sx0, sx1, h, w, pr, pc, s_ptr, ss0, ss1, q_ptr, sq0, sq1, fmax, BLOCK: tl.constexpr
):
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    x, rows, cols, mask = _load_block(x_ptr, sx0, sx1, h, w, pr, pc, bi, bj, BLOCK)
    s = tl.load(s_ptr + bi * ss0 + bj * ss1)
    _store_q(q_ptr, sq0, sq1, x, s, rows, cols, mask, fmax, BLOCK)


@triton.jit
def _fused_kernel(
    x_ptr,
    sx0,
    sx1,
    h,
    w,
    q_ptr,
    sq0,
    sq1,
    s_ptr,
    nbc,
    eps,
    fmax,
    UE8M0: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    x, rows, cols, mask = _load_block(x_ptr, sx0, sx1, h, w, 0, 0, bi, bj, BLOCK)
    amax = _amax_of(x)
    s = tl.div_rn(tl.maximum(amax, eps), fmax)
    if UE8M0:
        bits = s.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + 0x800000
        bits = tl.where((bits & 0x7FFFFF) != 0, up, bits)
        s = bits.to(tl.float32, bitcast=True)
    s = tl.where(amax != amax, float("nan"), s)
    tl.store(s_ptr + bi * nbc + bj, s)
    _store_q(q_ptr, sq0, sq1, x, s, rows, cols, mask, fmax, BLOCK)


# a region table row, int64: source address, its 2 strides, rows, cols, row and col phase in
# the block grid; grid address, its 2 strides; output offset (elements), output row stride
_FIELDS = 12
_XKIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@triton.jit
def _table_block(
    blocks_ptr, routes_ptr, XKIND: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    """This program's block: its region's row of the table, and the block's values.

    The table's values are unknown to the compiler, so without hints every element is loaded
    alone (about 300 GB/s on an H200). An ``ALIGNED`` group's regions (see :func:`_aligned`)
    promise 16-element multiples and unit column strides, which lets it load 16 bytes at once.
    """
    pid = tl.program_id(0).to(tl.int64)
    r = tl.load(blocks_ptr + pid * 3).to(tl.int64)
    bi = tl.load(blocks_ptr + pid * 3 + 1).to(tl.int64)
    bj = tl.load(blocks_ptr + pid * 3 + 2).to(tl.int64)
    row = routes_ptr + r * 12
    addr = tl.load(row + 0)
    if XKIND == 0:
        x_ptr = addr.to(tl.pointer_type(tl.bfloat16))
    elif XKIND == 1:
        x_ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        x_ptr = addr.to(tl.pointer_type(tl.float32))
    sx0 = tl.load(row + 1)
    h = tl.load(row + 3)
    w = tl.load(row + 4)
    pr = tl.load(row + 5)
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        sx0 = tl.multiple_of(sx0, 16)
        w = tl.multiple_of(w, 16)
        x, rows, cols, mask = _load_block(x_ptr, sx0, 1, h, w, pr, 0, bi, bj, BLOCK)
    else:
        sx1 = tl.load(row + 2)
        pc = tl.load(row + 6)
        x, rows, cols, mask = _load_block(x_ptr, sx0, sx1, h, w, pr, pc, bi, bj, BLOCK)
    return row, bi, bj, x, rows, cols, mask


@triton.jit
def _quant_table_kernel(
    blocks_ptr,
    routes_ptr,
    q_ptr,
    fmax,
    XKIND: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, bi, bj, x, rows, cols, mask = _table_block(blocks_ptr, routes_ptr, XKIND, ALIGNED, BLOCK)
    s_ptr = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    s = tl.load(s_ptr + bi * tl.load(row + 8) + bj * tl.load(row + 9))
    at = tl.load(row + 10)
    sq0 = tl.load(row + 11)
    if ALIGNED:
        at = tl.multiple_of(at, 16)
        sq0 = tl.multiple_of(sq0, 16)
    _store_q(q_ptr + at, sq0, 1, x, s, rows, cols, mask, fmax, BLOCK)


@triton.jit
def _amax_table_kernel(
    blocks_ptr, routes_ptr, XKIND: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    row, bi, bj, x, rows, cols, mask = _table_block(blocks_ptr, routes_ptr, XKIND, ALIGNED, BLOCK)
    # amaxes are >= 0 or a positive NaN, so their bits order like the values (NaN above inf):
    # an integer atomic max merges blocks that several regions touch, NaN-propagating
    g_ptr = tl.load(row + 7).to(tl.pointer_type(tl.int32))
    cell = g_ptr + bi * tl.load(row + 8) + bj * tl.load(row + 9)
    tl.atomic_max(cell, _amax_of(x).to(tl.int32, bitcast=True), sem="relaxed")


# warps per 128 x 128 block, measured on an H200 (bf16 in, 1 GiB): quantizing ran at 1.98 TB/s
# of input with 16 warps, 1.70 with 8, 1.27 with 4 and 32; the amax pass at 4.46 TB/s with 8
_QUANT_WARPS = 16


def _aligned(x: torch.Tensor, pc: int, out_offset: int, out_stride: int) -> bool:
    """Whether a region may take the table kernels' 16-byte loads and stores: unit column
    stride, no column phase, and address, row stride, width and output place all multiples of
    16 elements (bytes for the FP8 output). Whole weights and row shards of them qualify."""
    sixteen = (x.data_ptr() % 16, x.stride(0) % 16, x.shape[1] % 16, out_offset % 16)
    return x.stride(1) == 1 and pc == 0 and out_stride % 16 == 0 and not any(sixteen)


def _grid(origin: Sequence[int], shape: Sequence[int], block: int) -> tuple[int, int, int, int]:
    pr, pc = int(origin[0]) % block, int(origin[1]) % block
    return pr, pc, -(-(pr + shape[0]) // block), -(-(pc + shape[1]) // block)


def block_amax(x: torch.Tensor, origin: Sequence[int], block: int) -> torch.Tensor:
    h, w = x.shape
    pr, pc, nbr, nbc = _grid(origin, x.shape, block)
    out = torch.empty((nbr, nbc), dtype=torch.float32, device=x.device)
    if x.numel():
        _amax_kernel[(nbr, nbc)](
            x,
            x.stride(0),
            x.stride(1),
            h,
            w,
            pr,
            pc,
            out,
            nbc,
            BLOCK=block,
            num_warps=8,
            enable_fp_fusion=False,
        )
    return out


def quantize(
    x: torch.Tensor, scales: torch.Tensor, origin: Sequence[int], block: int, q: torch.Tensor
) -> None:
    h, w = x.shape
    pr, pc, nbr, nbc = _grid(origin, x.shape, block)
    if x.numel() == 0:
        return
    s = scales if scales.dtype == torch.float32 else scales.float()
    _quant_kernel[(nbr, nbc)](
        x,
        x.stride(0),
        x.stride(1),
        h,
        w,
        pr,
        pc,
        s,
        s.stride(0),
        s.stride(1),
        q,
        q.stride(0),
        q.stride(1),
        FP8_MAX,
        BLOCK=block,
        num_warps=_QUANT_WARPS,
        enable_fp_fusion=False,
    )


def quantize_blocks(x: torch.Tensor, config: Fp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    h, w = x.shape
    nbr, nbc = scale_shape(x.shape, config.block)
    q = torch.empty((h, w), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((nbr, nbc), dtype=torch.float32, device=x.device)
    if x.numel():
        _fused_kernel[(nbr, nbc)](
            x,
            x.stride(0),
            x.stride(1),
            h,
            w,
            q,
            q.stride(0),
            q.stride(1),
            s,
            nbc,
            config.eps,
            FP8_MAX,
            UE8M0=config.scale_format == "ue8m0",
            BLOCK=config.block,
            num_warps=_QUANT_WARPS,
            enable_fp_fusion=False,
        )
    return q, s


class RegionTable:
    """Fixed 2-D regions and all their blocks, on the device, for one-launch kernels.

    ``regions``: per region ``(x, origin, dst, out_offset, out_row_stride)``: ``x`` a 2-D view
    of a live tensor (any strides), ``origin`` its first element's canonical (row, col), ``dst``
    the 2-D float32 grid of the blocks it touches (its scales to read, or the amaxes to raise),
    and for quantizing, where its first result goes in the output buffer (elements) and that
    output's row stride. Regions are grouped by source dtype, one launch per group.
    """

    def __init__(self, regions, block: int, device: torch.device) -> None:
        self.block = block
        self.groups: list[tuple[tuple[int, bool], torch.Tensor, torch.Tensor, int]] = []
        by_kind: dict[tuple[int, bool], list] = {}
        for reg in regions:
            x, origin = reg[0], reg[1]
            if x.dtype not in _XKIND:
                raise TypeError(f"FP8 kernels take bfloat16, float16 or float32, not {x.dtype}")
            if x.numel():
                aligned = _aligned(x, int(origin[1]) % block, int(reg[3]), int(reg[4]))
                by_kind.setdefault((_XKIND[x.dtype], aligned), []).append(reg)
        for kind, regs in sorted(by_kind.items()):
            rows = np.zeros((len(regs), _FIELDS), np.int64)
            blocks = []
            for i, (x, origin, dst, out_offset, out_stride) in enumerate(regs):
                h, w = x.shape
                pr, pc, nbr, nbc = _grid(origin, x.shape, block)
                if tuple(dst.shape) != (nbr, nbc) or dst.dtype != torch.float32:
                    raise ValueError(
                        f"a region {tuple(x.shape)} at {tuple(origin)} touches {nbr} x {nbc} "
                        f"blocks, its grid is {tuple(dst.shape)} {dst.dtype}"
                    )
                rows[i] = (
                    x.data_ptr(), x.stride(0), x.stride(1), h, w, pr, pc,
                    dst.data_ptr(), dst.stride(0), dst.stride(1), out_offset, out_stride,
                )  # fmt: skip
                bi, bj = np.meshgrid(np.arange(nbr), np.arange(nbc), indexing="ij")
                blocks.append(np.stack([np.full(bi.size, i), bi.ravel(), bj.ravel()], 1))
            table = torch.from_numpy(np.concatenate(blocks).astype(np.int32)).to(device)
            self.groups.append((kind, table, torch.from_numpy(rows).to(device), len(table)))
        self.device = torch.device(device)

    def _on_device(self):
        """Launch on the tables' device (Triton launches on the current one)."""
        if self.device.index is not None and self.device.index != torch.cuda.current_device():
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def quantize(self, out: torch.Tensor) -> None:
        """Quantize every region into ``out`` (uint8 or float8_e4m3fn, contiguous) with the
        scales in the regions' grids."""
        q = out.view(torch.float8_e4m3fn)
        with self._on_device():
            for (kind, aligned), blocks, routes, n in self.groups:
                _quant_table_kernel[(n,)](
                    blocks,
                    routes,
                    q,
                    FP8_MAX,
                    XKIND=kind,
                    ALIGNED=aligned,
                    BLOCK=self.block,
                    num_warps=_QUANT_WARPS,
                    enable_fp_fusion=False,
                )

    def amax(self) -> None:
        """Raise each region's grid cells to the amax of the region's part of the block
        (grids zeroed, or holding amaxes, beforehand)."""
        with self._on_device():
            for (kind, aligned), blocks, routes, n in self.groups:
                _amax_table_kernel[(n,)](
                    blocks,
                    routes,
                    XKIND=kind,
                    ALIGNED=aligned,
                    BLOCK=self.block,
                    num_warps=8,
                    enable_fp_fusion=False,
                )
