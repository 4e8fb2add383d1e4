"""Triton kernels of the sparse-delta codec (imported only where Triton is, for CUDA tensors).

They do what :mod:`weightbus.codecs.delta` specifies with a fixed number of launches whatever
the number of routes: tables built once at connect hold every route's addresses, strides and
tiles (``BLOCK`` elements of one route each), and a launch covers every route of one element
size and addressing mode. The tables hold raw addresses: the regions they were built from must
stay in place (their owners keep them alive). The encoder builds its tables again when the live
views change (a trainer tensor whose storage was replaced); a reader's live tensors are
updated in place and never move.

Writer, per window (:class:`WindowTable`):

1. compare: per tile, the raw bits of the new values against the shadow's (integers of the
   element's width, so NaN payloads and ``-0.0`` compare exactly), the count of changed
   elements and a bitmask of them (16 bytes a load for routes known to be aligned:
   :data:`ALIGNED`); and the changed elements into the shadow, which then equals the new
   values (:data:`WHOLE_ABOVE`);
2. a cumsum over the tiles' counts and one small device-to-host copy, on the compare pass's
   stream: each route's count (the host waits for that stream alone);
3. emit, after the host chose each route's frame (a plan row per route): the changed elements'
   indices and values into the route's sparse frame, their bits and values into its masked
   frame (:func:`_mask_bits`), or all its values into a dense frame, in the window's store,
   whose bytes that no frame fills one launch zeroed first (:meth:`WindowTable.zero`).
   Outside dense frames it visits the changed elements only, by the bitmask's words: one step
   per set bit of the word that has the most, each step taking every word's lowest one. A
   program then takes several tiles at once: each tile's work is a chain of dependent reads
   (its route's row, its plan row, its words, its elements), whose latency, not bandwidth,
   bounds a pass that touches 1% of the elements.

The shadow is written by the compare pass, where the changed elements' bytes were just read,
rather than by the emit pass, whose scattered 2-byte stores each made the memory read and
write back a whole sector: on an H200, 2 GiB of bf16 in 64 contiguous routes at 1% changed,
compare and emit take 1.39 and 0.73 ms (2.13 together) against 1.23 and 1.25 before; as the
column halves of a [rows, 8192] tensor 2.93 against 4.85 ms, at 3% changed 2.38 and 3.27
against 3.09 and 5.77 (the emit changes below included).

A window whose readers all get dense bytes needs no counts: one pass writes the changed
elements into the shadow.

Reader, per group of buckets (:class:`TargetTable`): one launch per element size copies the
dense frames that go to contiguous regions (16 bytes a load where aligned), and one per
element size and addressing mode writes the other dense frames and scatters every sparse frame
of the buckets into the live regions; masked frames take a popcount pass per tile of
:data:`APPLY_MASKED`, a cumsum and one launch per element size and addressing mode
(:meth:`TargetTable.apply_masked`). An element whose index falls outside its region (a
damaged frame) is not written: it is counted, with its route, in the table's faults, which
the reader reads once per sync (:meth:`TargetTable.faults`, after its stream ran) and refuses
the sync for; so are a masked frame's bits past its route's elements or past its values, and
a route whose bits do not number its values.

Masked frames cost per element whatever the fraction changed: on an H200, per 2 GiB of bf16
in 64 contiguous routes, the emit pass by lanes takes 2.0 ms at 50% changed and 1.9 at 10%,
a reader's masked apply 2.1-2.2 ms (2.0 at 10%), against 1.0 for a device copy of the same
bytes (see :data:`LANES`: both took 3.1 ms before they looped over their tiles). Other
layouts were slower: the lanes laid out by the bitmask's words ([words, 32], every element
loaded) 5.2 ms at 50%; the same over ALIGNED routes with 16-byte loads 2.6-3.7 ms at 50% and
2.1-2.6 at 10% (the stores, an element each, stay scattered); each element's place by a
scan of its bit (its word loaded per lane) 3.4, and the apply so 4.0-7.0 ms. Each word's
place in its tile handed to the kernels (no scan in them) saved 0.1 ms of 1.8 in a
pared-down copy of the emit pass, and nothing of the apply's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 2048
"""Elements per tile (the unit of the counts and bitmasks; a program takes one or more)."""
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether these kernels run in Triton's CPU interpreter (tests), taking CPU tensors."""
STEPS_BELOW = 0.07
"""A window whose changed elements are fewer than this fraction of its elements is emitted
step by step (:func:`_emit_kernel` with ``STEPS``), else a lane per element.
Measured on an H200, 1 GiB of bf16 in 32 routes (steps, 4 tiles a program, against lanes):
0.62 against 1.33 ms at 1% changed, 1.22 against 1.38 at 5%, but 1.89 against 1.43 at 10%."""
COMPARE = (1, 8)
"""Tiles per program and warps of the compare pass (on an H200, 2 tiles a program or 4 or
16 warps were slower)."""
SAMPLE = 16
"""A window sent dense on a guess (every route of it went dense last time) is copied into the
shadow; :meth:`WindowTable.sample` first compares every this-many-th tile of each of its
routes (the first included), to tell when a route would go sparse again."""
WHOLE_ABOVE = 1 / 16
"""The compare pass writes a tile's changed elements into the shadow one at a time or, where
more than this fraction of its elements changed, the whole tile (16 bytes a store where
aligned; the same bytes where nothing changed). On an H200, 2 GiB of bf16 in 64 aligned
routes: 1.39 ms a pass at 1% changed (1.74 writing every tile whole), 1.67 at 50% (3.70
writing the changed elements one at a time); 1/32 and 1/8 within 0.05 ms of it."""
EMIT_STEPS = (8, 4)
"""Tiles per program and warps of the emit pass, step by step (on an H200, 2 GiB of bf16 in
64 routes: 0.81 ms at 1% changed and 0.90 at 3% in contiguous routes, against 0.78 and 0.98
for 4 tiles; as column halves of a [rows, 8192] tensor 1.26 and 1.53 against 1.66 and 2.10;
8 warps, or 2 tiles, slower in all)."""
EMIT_LANES = (4, 4)
"""Tiles per program and warps of the emit pass, a lane per element."""
APPLY_MASKED = (8, 4)
"""Tiles of ``BLOCK`` elements per program of the reader's masked apply (one tile of its
counts and its apply kernel), and warps (:data:`LANES`)."""
LANES = 1024
"""Elements that a kernel with a lane per element takes at a time, in a loop over its
tiles (the emit pass by lanes, a dense frame's tiles, a masked frame's bits, a reader's
masked apply): fewer registers a thread, so more programs resident to hide the chain of
dependent reads each tile starts with (its route's row, its plan row, its place). On an
H200, 2 GiB of bf16 in 64 contiguous routes: the emit pass takes 2.00 ms at 50% changed
(1.93 at 10%) with 4 tiles a program and 4 warps, against 3.08 (3.00) with one whole tile
of 2048 a program (80 registers a thread); 2 or 8 tiles a program, or a cap of 40 to 56
registers, within 0.1 ms; 8 warps 2.6-2.7 ms. A reader's masked apply takes 2.14 ms
(2.02) with 8 tiles a program and 4 warps (:data:`APPLY_MASKED`), 2.25 (2.13) with 4,
against 3.14 (3.08) with 4 tiles of 8192 elements at once and 8 warps (142 registers: one
program an SM); its entry read from the count pass rather than found by bisection saved
about 0.3 ms of it."""
COPY_IN = (1, 4)
"""Tiles per program and warps of a reader's copies of dense frames into contiguous regions
(on an H200, 1 GiB of bf16 in 32 routes: 0.54 ms, against 0.51 for a device copy of it; 4 to
32 tiles a program or 8 warps 0.55-0.57 ms)."""
ZERO_CHUNK = 4096
"""Bytes a program of the kernel zeroing a window's store takes at most
(:meth:`WindowTable.zero`)."""

# every launch and warm-up passes enable_fp_fusion=False: no multiply and add is contracted
# into one rounding, whatever Triton's default (it changes in Triton 3.10), so float results
# round as the torch paths do

# addressing modes of a region: contiguous; tiles inside one row of its last dim (rows of at
# least half a tile); tiles over its flat element order (narrow rows, any strides)
CONTIG, ROWS, FLAT = 0, 1, 2
ALIGNED, ALIGNED_ROWS = 3, 4
_ALIGNED: tl.constexpr = tl.constexpr(ALIGNED)
_ALIGNED_ROWS: tl.constexpr = tl.constexpr(ALIGNED_ROWS)
"""The addressing modes of a writer's CONTIG routes, and of its ROWS routes whose rows are
contiguous, when their new values and shadow bytes start at 16-byte boundaries and their
element counts (per row) and row strides are multiples of 16 (in a window whose shadow bytes
and scratch start at such boundaries too: :meth:`WindowTable.compare`). The compare pass then
tells the compiler so, which lets it move 16 bytes a load or store instead of one element:
on an H200, 2 GiB of bf16 in 64 contiguous routes at 1% changed, 1.24 ms a pass against 1.71
(and 1.59 against 1.82 when it brings the shadow up to date), the same bytes out; as the
column halves of a [rows, 8192] tensor, 1.64-1.69 ms against 4.0 (1.76-1.79 against 3.9).
The emit pass, which reads changed elements a few at a time, takes them as CONTIG and ROWS."""
_UNALIGNED = {ALIGNED: CONTIG, ALIGNED_ROWS: ROWS}
EMIT_TOGETHER = {CONTIG: 2, ROWS: 3, FLAT: 2}
"""Per addressing mode, how many of the emit pass's first steps load their elements together,
so that their latencies overlap (at 1% changed, most words hold at most 2 or 3). On an
H200, 2 GiB of bf16 in 64 routes at 1% changed, 8 tiles a program: contiguous routes 0.81
ms (0.84 with 3 together); as column halves of a [rows, 8192] tensor 1.26 (1.32 with 2);
of a [rows, 1024] tensor 3.47 (3.77 with 3), before FLAT routes divided once per tile (1.92
since). With 4 tiles a program and one step at a time (as before): 1.01, 1.96 and 3.71 ms.
All of them with the shadow written by the compare pass."""

# writer route row (int64): new values' address (or offset in the window's scratch), 1 if
# in scratch, shadow offset (bytes, in the window's shadow bytes), first tile, elements, tiles
# per row, slot (the route's index in the window), 1 if its tiles' bitmasks are whole words of
# a masked frame's (else their bits are ORed in one by one); then its dims from the last:
# n3, s3, n2, s2, n1, s1, s0, 0 (elements; leading dims padded with extent 1)
_WF = 16
_RF: tl.constexpr = tl.constexpr(_WF)
# reader target row (int64): address, then dims as above (n3 .. s0), then elements
_TFH = 9
_TF: tl.constexpr = tl.constexpr(_TFH)
# reader entry (int64): first tile, target row, values offset (bytes in the bucket), indices
# offset (sparse), elements to write, index size (sparse), log2 elements per unit, sparse
_EFH = 8
_EF: tl.constexpr = tl.constexpr(_EFH)
# a writer plan row (int64), made by the encoder: kind (0: only bring the shadow up to date,
# 1: sparse frame, 2: dense frame, 3: masked frame), frame offset (bytes in the store: its
# indices, or its bitmask), values offset, index size (sparse frames; else 0)
# reader masked entry (int64): first tile, target row, values offset, bitmask offset (bytes in
# the buffer), elements of the route, values (the frame's count), 0, 0
# elements compared and copied as integers of their width: raw bits
_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _lead(dims, rr):
    """Element offset of row ``rr`` of a region (its leading dims n0 x n1 x n2, flattened)."""
    n2 = tl.load(dims + 2)
    n1 = tl.load(dims + 4)
    c2 = rr % n2
    rr = rr // n2
    c1 = rr % n1
    c0 = rr // n1
    return c2 * tl.load(dims + 3) + c1 * tl.load(dims + 5) + c0 * tl.load(dims + 6)


@triton.jit
def _flat(dims, t):
    """Element offsets of the flat (row-major) element indices ``t`` of a strided region."""
    n3 = tl.load(dims)
    rr = t // n3
    return (t - rr * n3) * tl.load(dims + 1) + _lead(dims, rr)


@triton.jit
def _flat_at(dims, base, j):
    """Element offsets of the flat indices ``base + j`` of a FLAT region (rows shorter than
    half a tile, any strides, its inner three extents below 2^30): ``base`` a tile's first
    index, ``j`` (int32) an element of the tile. Only ``base`` is divided in 64 bits, once
    per tile. Per element, the row of ``base % n3 + j`` within the tile comes from a float
    reciprocal, which is exact: that index is below n3 + BLOCK, so the quotient is at least
    0.5 / n3 away from the next integer, far more than the rounding error (a test checks
    every row length); the carries into the leading dims come from 32-bit divisions. On an
    H200, 2 GiB of bf16 as the column halves of a [rows, 1024] tensor at 1% changed:
    compare 6.0 ms and emit 1.9 a pass, against 18.5 and 4.3 with 64-bit divisions per
    element (rows of 4096 take 1.7 and 1.2)."""
    n3 = tl.load(dims)
    n2 = tl.load(dims + 2)
    n1 = tl.load(dims + 4)
    r3 = base // n3
    x = (base - r3 * n3).to(tl.int32) + j
    q = ((x.to(tl.float32) + 0.5) * (1.0 / n3.to(tl.float32))).to(tl.int32)
    r2 = r3 // n2
    y = (r3 - r2 * n2).to(tl.int32) + q
    k2 = y // n2.to(tl.int32)
    r1 = r2 // n1
    z = (r2 - r1 * n1).to(tl.int32) + k2
    k1 = z // n1.to(tl.int32)
    return (
        (x - q * n3.to(tl.int32)) * tl.load(dims + 1)
        + (y - k2 * n2.to(tl.int32)) * tl.load(dims + 3)
        + (z - k1 * n1.to(tl.int32)) * tl.load(dims + 5)
        + (r1 + k1) * tl.load(dims + 6)
    )


@triton.jit
def _at(row, t, j, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Elements ``j`` (within the tile) of tile ``t`` of the route at ``row``: their flat
    indices in the route (which are also their places in the shadow), which are in the route,
    and their offsets in the new values' region (elements)."""
    dims = row + 8
    if MODE == 0:
        u = t * BLOCK + j
        valid = u < tl.load(row + 4)
        off = u
    elif MODE == 1:
        tpr = tl.load(row + 5)
        ncols = tl.load(dims)
        rr = t // tpr
        c = (t - rr * tpr) * BLOCK + j
        valid = c < ncols
        u = rr * ncols + c
        off = c * tl.load(dims + 1) + _lead(dims, rr)
    else:
        u = t * BLOCK + j
        valid = u < tl.load(row + 4)
        off = _flat_at(dims, t * BLOCK, j)
    return u, valid, off


@triton.jit
def _tiles(tiles_ptr, picks_ptr, routes_ptr, first, n, R: tl.constexpr, PICK: tl.constexpr):
    """This program's ``R`` tiles of a launch of ``n`` from tile ``first`` (``PICK``: from
    entry ``first`` of the tile indices at ``picks_ptr``): their indices in the window,
    whether they are in the launch (the last program's may not be), and their routes' rows
    (a tile past the launch reads route row 0 and writes nothing)."""
    k = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    live = k < n
    if PICK:
        g = tl.load(picks_ptr + first + k, mask=live, other=0).to(tl.int64)
    else:
        g = first + k
    row = routes_ptr + tl.load(tiles_ptr + g, mask=live, other=0).to(tl.int64) * _RF
    return g, live, row


@triton.jit
def _regions(row, work_ptr, scratch_ptr, T: tl.constexpr):
    """Where the new values of the routes at ``row`` are (a live region, or their place in
    the window's scratch), and their previous values (in the shadow), as pointers to ``T``."""
    new_at = tl.load(row) + tl.load(row + 1) * scratch_ptr.to(tl.int64)
    return new_at.to(tl.pointer_type(T)), (work_ptr + tl.load(row + 2)).to(tl.pointer_type(T))


@triton.jit
def _compare_aligned(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, counts_ptr, bits_ptr, g,
                     T: tl.constexpr, ROWS_: tl.constexpr, UPDATE: tl.constexpr,
                     COUNT: tl.constexpr, BLOCK: tl.constexpr, WHOLE: tl.constexpr):  # fmt: skip
    """Compare tile ``g`` of an ALIGNED (or, ``ROWS_``, ALIGNED_ROWS) route, telling the
    compiler that the tile's new and previous values start at 16-byte boundaries and that
    the elements it may take (of the route, or of its row) are a multiple of 16, so that it
    loads 16 bytes at a time, and stores as many where it writes a whole tile into the
    shadow (more than ``WHOLE`` of its elements changed)."""
    row = routes_ptr + tl.load(tiles_ptr + g).to(tl.int64) * _RF
    t = g - tl.load(row + 3)
    new_ptr, old_ptr = _regions(row, work_ptr, scratch_ptr, T)
    # the tile's first element on both sides, and how many elements from there it may take
    if ROWS_:  # rows of unit stride: a tile lies in one row
        tpr = tl.load(row + 5)
        ncols = tl.load(row + 8)
        rr = t // tpr
        c0 = (t - rr * tpr) * BLOCK
        new_ptr = new_ptr + _lead(row + 8, rr) + c0
        old_ptr = old_ptr + rr * ncols + c0
        left = ncols - c0
    else:
        new_ptr = new_ptr + t * BLOCK
        old_ptr = old_ptr + t * BLOCK
        left = tl.load(row + 4) - t * BLOCK
    new_ptr = tl.multiple_of(new_ptr, 16)
    old_ptr = tl.multiple_of(old_ptr, 16)
    j = tl.arange(0, BLOCK)
    valid = j < tl.multiple_of(left, 16)
    new = tl.load(new_ptr + j, mask=valid, other=0)
    old = tl.load(old_ptr + j, mask=valid, other=0)
    c = (valid & (new != old)).to(tl.int32)
    n = tl.sum(c, axis=0)
    if COUNT:
        tl.store(counts_ptr + g + 1, n)
        tl.store(counts_ptr + g * 0, g * 0, mask=g == 0)
    if n > WHOLE:
        tl.store(old_ptr + j, new, mask=valid)
    else:
        tl.store(old_ptr + j, new, mask=c != 0)
    if not UPDATE:
        # bit k of word w: element 32 w + k; distinct bits, so their sum is their OR
        words = tl.sum(tl.reshape(c, [BLOCK // 32, 32]) << tl.arange(0, 32)[None, :], axis=1)
        tl.store(bits_ptr + g * (BLOCK // 32) + tl.arange(0, BLOCK // 32), words)


# tile and entry offsets vary per launch: one compiled kernel for all of them
@triton.jit(do_not_specialize=["first", "n"])
def _compare_kernel(
    tiles_ptr,
    picks_ptr,
    routes_ptr,
    work_ptr,
    scratch_ptr,
    counts_ptr,
    bits_ptr,
    first,
    n,
    T: tl.constexpr,
    MODE: tl.constexpr,
    UPDATE: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK: tl.constexpr,
    R: tl.constexpr,
    WHOLE: tl.constexpr,
    PICK: tl.constexpr,
):
    """Compare ``R`` tiles (elements as integers of their width ``T``: raw bits), and bring
    the shadow up to date; ``UPDATE``: no bitmask (every reader of the window gets dense
    bytes); ``COUNT``: with counts; ``WHOLE``: see :func:`_compare_aligned`; ``PICK``: the
    launch's tiles are the ``n`` listed at ``picks_ptr`` from entry ``first`` (a sample),
    else tiles ``first`` to ``first + n``."""
    if MODE == _ALIGNED or MODE == _ALIGNED_ROWS:
        tl.static_assert(R == 1, "ALIGNED routes: one tile a program")
        at = first + tl.program_id(0).to(tl.int64)
        if PICK:
            at = tl.load(picks_ptr + at).to(tl.int64)
        _compare_aligned(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, counts_ptr, bits_ptr,
                         at, T, MODE == _ALIGNED_ROWS, UPDATE, COUNT, BLOCK, WHOLE)  # fmt: skip
        return
    g, live, row = _tiles(tiles_ptr, picks_ptr, routes_ptr, first, n, R, PICK)
    rr = row[:, None]
    u, valid, off = _at(rr, g[:, None] - tl.load(rr + 3), tl.arange(0, BLOCK)[None, :], MODE, BLOCK)
    valid = valid & live[:, None]
    new_ptr, old_ptr = _regions(rr, work_ptr, scratch_ptr, T)
    new = tl.load(new_ptr + off, mask=valid, other=0)
    old = tl.load(old_ptr + u, mask=valid, other=0)
    changed = valid & (new != old)
    c = changed.to(tl.int32)
    if COUNT:
        tl.store(counts_ptr + g + 1, tl.sum(c, axis=1), mask=live)
        tl.store(counts_ptr + g * 0, g * 0, mask=live & (g == 0))
    tl.store(old_ptr + u, new, mask=changed)
    if not UPDATE:
        # bit k of word w: element 32 w + k; distinct bits, so their sum is their OR
        shifted = tl.reshape(c, [R, BLOCK // 32, 32]) << tl.arange(0, 32)[None, None, :]
        words = tl.sum(shifted, axis=2)
        at = g[:, None] * (BLOCK // 32) + tl.arange(0, BLOCK // 32)[None, :]
        tl.store(bits_ptr + at, words, mask=live[:, None])


@triton.jit
def _popcount(x, ASM: tl.constexpr):
    """Set bits of each uint32 ``x`` (the PTX instruction, or the same by shifts and masks
    where the kernels run in Triton's interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1
        )
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _take(new_ptr, u, off, hit, values_at, index_at, ix, place, T: tl.constexpr):
    """Changed elements ``hit`` (flat indices ``u`` in their route, ``off`` in the new values'
    region) of a sparse frame (its ``values_at``, ``index_at`` and index size ``ix``; a null
    ``values_at`` otherwise) at ``place`` of the frame."""
    _put(tl.load(new_ptr + off, mask=hit, other=0), u, hit, values_at, index_at, ix, place)


@triton.jit
def _put(new, u, hit, values_at, index_at, ix, place):
    """Changed elements ``new`` (``hit``, flat indices ``u``) at ``place`` of a sparse frame."""
    # (tl.where: Triton's interpreter mistypes a block mask & a scalar condition)
    tl.store(values_at + place, new, mask=tl.where(values_at.to(tl.int64) != 0, hit, False))
    i4 = tl.where(ix == 4, hit, False)
    tl.store(index_at.to(tl.pointer_type(tl.int32)) + place, u.to(tl.int32), mask=i4)
    i8 = tl.where(ix == 8, hit, False)
    tl.store(index_at.to(tl.pointer_type(tl.int64)) + place, u, mask=i8)


@triton.jit
def _lowest(words, row, t, word_at, MODE: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """Each word's lowest set bit: its element (flat index in the route, offset in the new
    values' region), whether the word had one, and the words without it."""
    lowest = words & ~(words - 1)
    u, valid, off = _at(row, t, word_at + _popcount(lowest - 1, ASM), MODE, BLOCK)
    return u, off, words != 0, words & (words - 1)


@triton.jit
def _emit_dense(row, t, p, new_ptr, store_ptr, T: tl.constexpr, MODE: tl.constexpr,
                BLOCK: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """A tile of a dense frame: all its values, ``SUB`` at a time."""
    at = (store_ptr + tl.load(p + 1)).to(tl.pointer_type(T))
    for s in range(BLOCK // SUB):
        u, valid, off = _at(row, t, s * SUB + tl.arange(0, SUB), MODE, BLOCK)
        tl.store(at + u, tl.load(new_ptr + off, mask=valid), mask=valid)


@triton.jit
def _emit_one_dense(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, plan_ptr, store_ptr, g,
                    T: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                    SUB: tl.constexpr):  # fmt: skip
    """Tile ``g`` whole if its frame is dense."""
    row = routes_ptr + tl.load(tiles_ptr + g).to(tl.int64) * _RF
    p = plan_ptr + tl.load(row + 6) * 4
    if tl.load(p) == 2:
        new_ptr = _regions(row, work_ptr, scratch_ptr, T)[0]
        _emit_dense(row, g - tl.load(row + 3), p, new_ptr, store_ptr, T, MODE, BLOCK, SUB)


@triton.jit
def _tile_span(row, t, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``t`` of the route at ``row``: its first element's flat index in the route, and
    how many elements it holds (a tile of ROWS lies in one row)."""
    if MODE == 1:
        tpr = tl.load(row + 5)
        ncols = tl.load(row + 8)
        rr = t // tpr
        c0 = (t - rr * tpr) * BLOCK
        return rr * ncols + c0, tl.minimum(ncols - c0, BLOCK)
    return t * BLOCK, tl.minimum(tl.load(row + 4) - t * BLOCK, BLOCK)


@triton.jit
def _emit_one_mask(tiles_ptr, routes_ptr, bits_ptr, plan_ptr, store_ptr, g, MODE: tl.constexpr,
                   BLOCK: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """Tile ``g``'s bits into its route's masked frame, if the route has one
    (:func:`_mask_bits`)."""
    row = routes_ptr + tl.load(tiles_ptr + g).to(tl.int64) * _RF
    p = plan_ptr + tl.load(row + 6) * 4
    if tl.load(p) == 3:
        _mask_bits(row, p, g, bits_ptr, store_ptr, MODE, BLOCK, SUB)


@triton.jit
def _mask_bits(row, p, g, bits_ptr, store_ptr, MODE: tl.constexpr, BLOCK: tl.constexpr,
               SUB: tl.constexpr):  # fmt: skip
    """Tile ``g``'s bits (of the route at ``row``, plan row ``p``, a masked frame) into the
    frame, ``SUB`` elements' at a time: the frame's bitmask is over the route's elements in
    flat (row-major) order, bit ``k`` of word ``w`` element ``32 w + k``. A tile covers
    consecutive flat elements (of one row, in ROWS mode); where they start at a multiple of
    32 (the route row's flag) its words are stored whole, else its bits are ORed into the
    frame's words one by one (the frame starts at zero, and two tiles may share a word)."""
    W: tl.constexpr = BLOCK // 32
    V: tl.constexpr = SUB // 32
    u0, n = _tile_span(row, g - tl.load(row + 3), MODE, BLOCK)
    frame = (store_ptr + tl.load(p + 1)).to(tl.pointer_type(tl.int32))
    whole = tl.load(row + 7) != 0
    for s in range(BLOCK // SUB):
        w = s * V + tl.arange(0, V)
        words = tl.load(bits_ptr + g * W + w)
        if whole:
            tl.store(frame + u0 // 32 + w, words, mask=w * 32 < n)
        else:
            lane = tl.arange(0, 32)[None, :]
            hit = tl.reshape((words[:, None] >> lane) & 1, [SUB]) != 0
            j = s * SUB + tl.arange(0, SUB)
            u = u0 + j
            one = tl.full([SUB], 1, tl.int32) << (u % 32).to(tl.int32)
            tl.atomic_or(frame + u // 32, one, mask=hit & (j < n))


@triton.jit
def _emit_start(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, cum_ptr, bits_ptr, plan_ptr,
                store_ptr, g, live, T: tl.constexpr, BLOCK: tl.constexpr,
                ASM: tl.constexpr):  # fmt: skip
    """What the emit kernel's steps read first of tiles ``g`` (a column of them) that are
    ``live``: their routes' rows, their tile indices in their routes, their plan rows and
    frame kinds, where their new values are, where a sparse or masked frame's values and a
    sparse frame's indices go and the index size (null and 0 for other kinds; 0 for a
    masked frame), their bitmasks' words (none but for those two), the words' popcounts,
    and where each word's first changed element goes: the k-th changed element of a route
    goes to place k of its frame's values (a tile's changed elements come in word order,
    and in bit order within a word)."""
    W: tl.constexpr = BLOCK // 32
    row = routes_ptr + tl.load(tiles_ptr + g, mask=live, other=0).to(tl.int64) * _RF
    p = plan_ptr + tl.load(row + 6) * 4
    kind = tl.load(p, mask=live, other=0)
    new_ptr = _regions(row, work_ptr, scratch_ptr, T)[0]
    sparse = (kind == 1) | (kind == 3)  # (a masked frame's values: as a sparse frame's)
    values_at = tl.where(sparse, store_ptr.to(tl.int64) + tl.load(p + 2), 0)
    index_at = store_ptr + tl.load(p + 1)
    ix = tl.where(sparse, tl.load(p + 3), 0)
    words = tl.load(bits_ptr + g * W + tl.arange(0, W), mask=live & sparse, other=0)
    words = words.to(tl.uint32, bitcast=True)
    per_word = _popcount(words, ASM)
    place = tl.load(cum_ptr + g) - tl.load(cum_ptr + tl.load(row + 3))
    place = place + tl.cumsum(per_word, axis=1) - per_word
    return (row, g - tl.load(row + 3), p, kind, new_ptr, values_at.to(tl.pointer_type(T)),
            index_at, ix, words, per_word, place)  # fmt: skip


@triton.jit
def _emit_lanes(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, cum_ptr, bits_ptr, plan_ptr,
                store_ptr, g, T: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                ASM: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """Emit tile ``g`` a lane per element, ``SUB`` elements at a time: a dense frame's tile
    whole, else its changed elements, each placed by the popcounts of its tile's words
    before it and of its word's bits below it (and its masked frame's bits)."""
    W: tl.constexpr = BLOCK // 32
    V: tl.constexpr = SUB // 32
    row = routes_ptr + tl.load(tiles_ptr + g).to(tl.int64) * _RF
    p = plan_ptr + tl.load(row + 6) * 4
    kind = tl.load(p)
    t = g - tl.load(row + 3)
    new_ptr = _regions(row, work_ptr, scratch_ptr, T)[0]
    if kind == 2:
        _emit_dense(row, t, p, new_ptr, store_ptr, T, MODE, BLOCK, SUB)
    elif kind != 0:
        # a masked frame's bits: its words, stored below, or ORed in bit by bit here
        whole = tl.load(row + 7) != 0
        if kind == 3 and not whole:
            _mask_bits(row, p, g, bits_ptr, store_ptr, MODE, BLOCK, SUB)
        u0, n = _tile_span(row, t, MODE, BLOCK)
        words_to = tl.where((kind == 3) & whole, u0 // 32, -1)
        # (a masked frame's values: as a sparse frame's, with no indices)
        values_at = (store_ptr + tl.load(p + 2)).to(tl.pointer_type(T))
        index_at = store_ptr + tl.load(p + 1)
        frame = index_at.to(tl.pointer_type(tl.int32)) + words_to
        ix = tl.load(p + 3)
        # the tile's first place (64 bits), then each element's from there (32 bits)
        place = tl.load(cum_ptr + g) - tl.load(cum_ptr + tl.load(row + 3))
        lane = tl.arange(0, 32)[None, :].to(tl.uint32)
        for s in range(BLOCK // SUB):
            w = s * V + tl.arange(0, V)
            words = tl.load(bits_ptr + g * W + w)
            # (tl.where: Triton's interpreter mistypes a block mask & a scalar condition)
            tl.store(frame + w, words, mask=tl.where(words_to >= 0, w * 32 < n, False))
            words = words.to(tl.uint32, bitcast=True)
            per_word = _popcount(words, ASM)
            below = _popcount(words[:, None] & ((tl.full([1, 32], 1, tl.uint32) << lane) - 1), ASM)
            at_k = tl.reshape((tl.cumsum(per_word, axis=0) - per_word)[:, None] + below, [SUB])
            hit = tl.reshape(((words[:, None] >> lane) & 1) != 0, [SUB])
            u, valid, off = _at(row, t, s * SUB + tl.arange(0, SUB), MODE, BLOCK)
            _take(new_ptr, u, off, hit, values_at + place, index_at + place * ix, ix, at_k, T)
            place = place + tl.sum(per_word, axis=0)


# tile and entry offsets vary per launch: one compiled kernel for all of them
@triton.jit(do_not_specialize=["first", "n"])
def _emit_kernel(
    tiles_ptr,
    routes_ptr,
    work_ptr,
    scratch_ptr,
    cum_ptr,
    bits_ptr,
    plan_ptr,
    store_ptr,
    first,
    n,
    T: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    ASM: tl.constexpr,
    STEPS: tl.constexpr,
    R: tl.constexpr,
    TOGETHER: tl.constexpr,
    SUB: tl.constexpr,
):
    """Emit ``R`` tiles a program: a dense frame's tile whole, else its changed elements.
    ``STEPS``: one step per set bit of the word that has the most, each step taking every
    word's lowest one (about 3 steps at 1% changed), all ``R`` tiles at once; else a lane
    per element, one tile after another, ``SUB`` elements at a time (:func:`_emit_lanes`).
    ``TOGETHER``: how many first steps load together (:data:`EMIT_TOGETHER`)."""
    pid = tl.program_id(0).to(tl.int64)
    if not STEPS:  # (a compile-time test: each branch alone is compiled)
        for r in range(R):
            if pid * R + r < n:
                _emit_lanes(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, cum_ptr, bits_ptr,
                            plan_ptr, store_ptr, first + pid * R + r, T, MODE, BLOCK, ASM,
                            SUB)  # fmt: skip
        return
    k = pid * R + tl.arange(0, R)[:, None]
    g, live = first + k, k < n
    row, t, p, kind, new_ptr, values_at, index_at, ix, words, per_word, place = (
        _emit_start(
            tiles_ptr, routes_ptr, work_ptr, scratch_ptr, cum_ptr, bits_ptr, plan_ptr, store_ptr,
            g, live, T, BLOCK, ASM,
        )
    )  # fmt: skip
    if tl.max(tl.max((kind == 2).to(tl.int32), axis=1), axis=0) > 0:
        for r in range(R):
            if pid * R + r < n:
                _emit_one_dense(tiles_ptr, routes_ptr, work_ptr, scratch_ptr, plan_ptr,
                                store_ptr, first + pid * R + r, T, MODE, BLOCK, SUB)  # fmt: skip
    if tl.max(tl.max((kind == 3).to(tl.int32), axis=1), axis=0) > 0:
        for r in range(R):
            if pid * R + r < n:
                _emit_one_mask(tiles_ptr, routes_ptr, bits_ptr, plan_ptr, store_ptr,
                               first + pid * R + r, MODE, BLOCK, SUB)  # fmt: skip
    word_at = tl.arange(0, BLOCK // 32)[None, :] * 32
    # the first steps load their elements together, so that their latencies overlap
    tl.static_assert(TOGETHER == 2 or TOGETHER == 3, "2 or 3 steps together")
    u0, off0, hit0, words = _lowest(words, row, t, word_at, MODE, BLOCK, ASM)
    u1, off1, hit1, words = _lowest(words, row, t, word_at, MODE, BLOCK, ASM)
    if TOGETHER == 3:
        u2, off2, hit2, words = _lowest(words, row, t, word_at, MODE, BLOCK, ASM)
    new0 = tl.load(new_ptr + off0, mask=hit0, other=0)
    new1 = tl.load(new_ptr + off1, mask=hit1, other=0)
    if TOGETHER == 3:
        new2 = tl.load(new_ptr + off2, mask=hit2, other=0)
        _put(new2, u2, hit2, values_at, index_at, ix, place + 2)
    _put(new0, u0, hit0, values_at, index_at, ix, place)
    _put(new1, u1, hit1, values_at, index_at, ix, place + 1)
    place = place + TOGETHER
    for _ in range(tl.max(tl.max(per_word, axis=1), axis=0) - TOGETHER):
        u, off, hit, words = _lowest(words, row, t, word_at, MODE, BLOCK, ASM)
        _take(new_ptr, u, off, hit, values_at, index_at, ix, place, T)
        place = place + 1


@triton.jit
def _zero_kernel(chunks_ptr, store_ptr, CHUNK: tl.constexpr):
    """Zero chunk ``program_id`` of the bytes at ``store_ptr``: its first byte and its
    length (at most ``CHUNK``) at ``chunks_ptr``."""
    i = tl.program_id(0).to(tl.int64)
    at = tl.load(chunks_ptr + 2 * i)
    n = tl.load(chunks_ptr + 2 * i + 1)
    j = tl.arange(0, CHUNK)
    tl.store(store_ptr + at + j, tl.zeros([CHUNK], tl.uint8), mask=j < n)


@triton.jit
def _entry(entries_ptr, n, steps, pid):
    """Program ``pid``'s entry of ``n`` (``steps`` = bits of n - 1): the last one whose first
    tile is <= pid (entries sorted by it), found by bisection."""
    lo = pid * 0
    hi = lo + n
    for _ in range(steps):
        mid = (lo + hi) // 2
        ok = tl.load(entries_ptr + mid * _EF) <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return entries_ptr + lo * _EF


@triton.jit(do_not_specialize=["n", "steps"])
def _apply_kernel(
    entries_ptr,
    n,
    steps,
    targets_ptr,
    buf_ptr,
    faults_ptr,
    T: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    e = _entry(entries_ptr, n, steps, pid)
    k = (pid - tl.load(e)) * BLOCK + tl.arange(0, BLOCK)
    valid = k < tl.load(e + 4)
    sparse = tl.load(e + 7) != 0
    ix = tl.load(e + 5)
    lr = tl.load(e + 6)
    # sparse: value k belongs to unit k >> lr, whose first element is that unit's index << lr
    unit = k >> lr
    at = buf_ptr + tl.load(e + 3)
    # (tl.where: Triton's interpreter mistypes a block mask & a scalar condition)
    m4 = tl.where(sparse & (ix == 4), valid, False)
    i4 = tl.load(at.to(tl.pointer_type(tl.int32)) + unit, mask=m4, other=0)
    m8 = tl.where(sparse & (ix == 8), valid, False)
    i8 = tl.load(at.to(tl.pointer_type(tl.int64)) + unit, mask=m8, other=0)
    t = tl.where(sparse, ((i4.to(tl.int64) + i8) << lr) + (k - (unit << lr)), k)
    vals = tl.load((buf_ptr + tl.load(e + 2)).to(tl.pointer_type(T)) + k, mask=valid)
    route = tl.load(e + 1)
    row = targets_ptr + route * _TF
    # a damaged sparse frame's index may point anywhere: only elements of the route are written
    inside = (t >= 0) & (t < tl.load(row + 8))
    if CONTIGUOUS:
        off = t
    else:
        off = _flat(row + 1, t)
    tl.store(tl.load(row).to(tl.pointer_type(T)) + off, vals, mask=valid & inside)
    outside = tl.sum((valid & (inside == 0)).to(tl.int64), axis=0)
    if outside > 0:  # faults: elements refused, and the last route that had one (+1)
        tl.atomic_add(faults_ptr, outside)
        tl.atomic_max(faults_ptr + 1, route + 1)


@triton.jit(do_not_specialize=["n", "steps"])
def _mask_count_kernel(entries_ptr, n, steps, buf_ptr, counts_ptr, where_ptr,
                       BLOCK: tl.constexpr, ASM: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """Each tile's set bits of masked frames (entries as for :func:`_apply_mask_kernel`),
    at ``counts_ptr`` from 1 (0 at 0), for a cumsum: where each tile's values start; and
    its entry (its index, at ``where_ptr``), which the apply kernel then need not search."""
    pid = tl.program_id(0).to(tl.int64)
    e = _entry(entries_ptr, n, steps, pid)
    index = (e.to(tl.int64) - entries_ptr.to(tl.int64)) // (8 * _EF)
    tl.store(where_ptr + pid, index.to(tl.int32))
    at = (buf_ptr + tl.load(e + 3)).to(tl.pointer_type(tl.int32))
    words_in = (tl.load(e + 4) + 31) // 32
    first_word = (pid - tl.load(e)) * (BLOCK // 32)
    set_bits = pid * 0
    for s in range(BLOCK // SUB):
        w = first_word + s * (SUB // 32) + tl.arange(0, SUB // 32)
        words = tl.load(at + w, mask=w < words_in, other=0).to(tl.uint32, bitcast=True)
        set_bits += tl.sum(_popcount(words, ASM), axis=0)
    tl.store(counts_ptr + pid + 1, set_bits)
    tl.store(counts_ptr + pid * 0, pid * 0, mask=pid == 0)


@triton.jit
def _apply_mask_kernel(
    entries_ptr,
    targets_ptr,
    buf_ptr,
    cum_ptr,
    where_ptr,
    faults_ptr,
    T: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    BLOCK: tl.constexpr,
    ASM: tl.constexpr,
    SUB: tl.constexpr,
):
    """Masked frames into their routes' regions, a tile of ``BLOCK`` elements (of a route's
    flat order) a program, ``SUB`` at a time: the k-th set bit of a route's bitmask takes
    its k-th value, placed by ``cum_ptr`` (the cumsum of :func:`_mask_count_kernel`'s
    counts) and popcounts; its entry is the one at ``where_ptr`` (that kernel's too). A bit
    past the route's elements or past its values, and a route whose bits do not number its
    values (counted by its last tile), are faults, as for :func:`_apply_kernel`."""
    V: tl.constexpr = SUB // 32
    pid = tl.program_id(0).to(tl.int64)
    e = entries_ptr + tl.load(where_ptr + pid).to(tl.int64) * _EF
    t0 = tl.load(e)
    b = pid - t0
    nelem = tl.load(e + 4)
    words_in = (nelem + 31) // 32
    bits = (buf_ptr + tl.load(e + 3)).to(tl.pointer_type(tl.int32))
    route = tl.load(e + 1)
    row = targets_ptr + route * _TF
    numel = tl.load(row + 8)
    to = tl.load(row).to(tl.pointer_type(T))
    # the tile's first value (64 bits, once), then its elements' places from there (32 bits)
    first = tl.load(cum_ptr + pid) - tl.load(cum_ptr + t0)
    values = (buf_ptr + tl.load(e + 2)).to(tl.pointer_type(T)) + first
    left = tl.load(e + 5) - first
    lane = tl.arange(0, 32)[None, :].to(tl.uint32)
    outside = tl.zeros([SUB], tl.int32)
    for s in range(BLOCK // SUB):
        w = b * (BLOCK // 32) + s * V + tl.arange(0, V)
        words = tl.load(bits + w, mask=w < words_in, other=0).to(tl.uint32, bitcast=True)
        per_word = _popcount(words, ASM)
        below = _popcount(words[:, None] & ((tl.full([1, 32], 1, tl.uint32) << lane) - 1), ASM)
        within = tl.reshape((tl.cumsum(per_word, axis=0) - per_word)[:, None] + below, [SUB])
        hit = tl.reshape(((words[:, None] >> lane) & 1) != 0, [SUB])
        j = b * BLOCK + s * SUB + tl.arange(0, SUB)
        ok = hit & (j < numel) & (within < left)
        vals = tl.load(values + within, mask=ok)
        if CONTIGUOUS:
            tl.store(to + j, vals, mask=ok)
        else:
            tl.store(to + _flat(row + 1, j), vals, mask=ok)
        outside += (hit & (ok == 0)).to(tl.int32)
        step = tl.sum(per_word, axis=0)
        values += step
        left -= step
    bad = tl.sum(outside, axis=0).to(tl.int64)
    tiles = (nelem + BLOCK - 1) // BLOCK
    if b == tiles - 1:  # the route's last tile: do its bits number its values?
        total = tl.load(cum_ptr + t0 + tiles) - tl.load(cum_ptr + t0)
        bad += tl.abs(total - tl.load(e + 5))
    if bad > 0:  # faults: elements refused, and the last route that had one (+1)
        tl.atomic_add(faults_ptr, bad)
        tl.atomic_max(faults_ptr + 1, route + 1)


@triton.jit(do_not_specialize=["n", "steps"])
def _copy_in_kernel(
    entries_ptr,
    n,
    steps,
    targets_ptr,
    buf_ptr,
    T: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
):
    """Dense frames into contiguous regions: a copy of ``SUB`` x ``BLOCK`` elements a program
    (entries as for :func:`_apply_kernel`, their tiles of that many). ``ALIGNED``: the
    frames' values, the regions and the element counts are multiples of 16 bytes (``VEC``
    elements), so that loads and stores move 16 bytes each; the general kernel, which finds
    each element's place at run time, moves one element each (1.77 ms per GiB of bf16 on an
    H200, where this takes 0.54; 0.61 unaligned)."""
    pid = tl.program_id(0).to(tl.int64)
    e = _entry(entries_ptr, n, steps, pid)
    nelem = tl.load(e + 4)
    src = (buf_ptr + tl.load(e + 2)).to(tl.pointer_type(T))
    dst = tl.load(targets_ptr + tl.load(e + 1) * _TF).to(tl.pointer_type(T))
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        nelem = tl.multiple_of(nelem, VEC)
    start = (pid - tl.load(e)) * (SUB * BLOCK)
    for s in range(SUB):
        k = start + s * BLOCK + tl.arange(0, BLOCK)
        m = k < nelem
        tl.store(dst + k, tl.load(src + k, mask=m), mask=m)


# ---------------------------------------------------------------------------------------------
# host side: tables built at connect, launches
# ---------------------------------------------------------------------------------------------


def _collapse(shape: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """A region's dims as (extent, stride) with extent-1 dims dropped and dims that continue
    each other merged, outermost first: a contiguous region is one dim of stride 1."""
    out: list[tuple[int, int]] = []
    for n, s in zip(shape, strides, strict=True):
        if n == 1:
            continue
        if out and out[-1][1] == s * n:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    return out or [(1, 1)]


def _dims_row(dims: list[tuple[int, int]]) -> list[int]:
    """n3, s3, n2, s2, n1, s1, s0, 0 of up to 4 dims (leading ones padded with extent 1)."""
    pad = [(1, 0)] * (4 - len(dims)) + dims
    (_, s0), (n1, s1), (n2, s2), (n3, s3) = pad
    return [n3, s3, n2, s2, n1, s1, s0, 0]


def region_mode(x: torch.Tensor, block: int = BLOCK) -> int | None:
    """How the kernels address region ``x``: CONTIG, ROWS or FLAT; None beyond 4 dims."""
    dims = _collapse(x.shape, x.stride())
    if len(dims) == 1 and dims[0][1] == 1:
        return CONTIG
    if len(dims) > 4:
        return None
    return ROWS if dims[-1][0] >= block // 2 else FLAT


def _aligned_mode(mode: int, dims: list[tuple[int, int]], addr: int, old_at: int, numel: int):
    """ALIGNED or ALIGNED_ROWS for a route of ``mode`` (its region's collapsed ``dims``, the
    address or scratch offset of its new values and its shadow offset) that qualifies, else
    ``mode``: 16-byte boundaries, and multiples of 16 elements per route or row and per row
    stride (so that every row starts at such a boundary, whatever the element size)."""
    if addr % 16 or old_at % 16:
        return mode
    if mode == CONTIG and numel % 16 == 0:
        return ALIGNED
    (ncols, step), lead = dims[-1], dims[:-1]
    if mode == ROWS and step == 1 and ncols % 16 == 0 and all(s % 16 == 0 for _, s in lead):
        return ALIGNED_ROWS
    return mode


def _compare_shape(mode: int) -> tuple[int, int]:
    """Tiles a program and warps of a compare launch in addressing mode ``mode``."""
    return (1, COMPARE[1]) if mode in _UNALIGNED else COMPARE


def _unaligned(mode: int) -> int:
    """A launch group's addressing mode without the alignment promise: CONTIG for ALIGNED,
    ROWS for ALIGNED_ROWS. The emit pass always takes it (it reads the changed elements
    where they are, a few at a time), the compare pass where the window's buffers are off
    16-byte boundaries."""
    return _UNALIGNED.get(mode, mode)


def _launches(
    ent: np.ndarray, tiles: np.ndarray, keys: Sequence[np.ndarray]
) -> tuple[np.ndarray, list[tuple]]:
    """A reader's entries (one per frame, ``tiles`` each) in launches of equal ``keys`` (per
    entry; the last the most significant; stable within), each launch's tiles numbered from
    0 in the entries' first column: the sorted entries, and per launch (its first entry, its
    end, its tiles, then its keys' values)."""
    order = np.lexsort(keys)
    ent, tiles = ent[order], tiles[order]
    keys = [k[order] for k in keys]
    change = np.zeros(max(len(ent) - 1, 0), bool)
    for k in keys:
        change |= np.diff(k) != 0
    bounds = [0, *(np.flatnonzero(change) + 1).tolist(), len(ent)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        t = tiles[a:b]
        ent[a:b, 0] = np.cumsum(t) - t
        out.append((a, b, int(t.sum()), *(k[a].item() for k in keys)))
    return ent, out


def _device_context(device: torch.device):
    """Launch on ``device`` (Triton launches on the current CUDA device)."""
    if device.type == "cuda" and device.index is not None:
        if device.index != torch.cuda.current_device():
            return torch.cuda.device(device)
    return contextlib.nullcontext()


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device``, copied without waiting (pinned) on CUDA."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class WindowTable:
    """The routes of one writer window, for one-launch compare and emit kernels.

    ``routes``: per slot (the window's routes in order) ``(new, shape, itemsize, numel,
    scratch_at, old_at)``: ``new`` the live region of the route's new values in its wire dtype
    (any strides), or None when they are computed into the window's scratch at byte
    ``scratch_at`` (contiguous, of ``shape``); ``old_at`` where its bytes are in the window's
    shadow bytes. Raises ValueError for a region the kernels cannot address (more than 4 dims
    that do not merge).
    """

    def __init__(self, routes: Sequence[tuple], device: torch.device, block: int = BLOCK) -> None:
        self.device = torch.device(device)
        self.block = block
        self._whole = int(block * WHOLE_ABOVE)
        self.slots = len(routes)
        self.elements = sum(r[3] for r in routes)
        self.whole_words = np.ones(self.slots, bool)
        """Per slot: whether the emit pass stores a masked frame's bitmask as whole words
        (every tile's first element at a multiple of 32), rather than ORing its bits into
        words that must start at zero."""
        rows: list[tuple[tuple[int, int], int, list[int], int]] = []
        for slot, (new, _, isz, numel, scratch_at, old_at) in enumerate(routes):
            if numel == 0:
                continue
            if new is None:
                dims, addr, filled = [(numel, 1)], scratch_at, 1
            else:
                dims, addr, filled = _collapse(new.shape, new.stride()), new.data_ptr(), 0
            mode = region_mode(new, block) if new is not None else CONTIG
            if mode is None:
                raise ValueError(
                    f"route {slot}: a region of shape {tuple(new.shape)} and strides "
                    f"{tuple(new.stride())} has more than 4 dims that do not merge"
                )
            # (the outermost of 4 dims is never divided)
            if mode == FLAT and max(n for n, _ in dims[-3:]) >= 1 << 30:
                raise ValueError(
                    f"route {slot}: a region of shape {tuple(new.shape)} and strides "
                    f"{tuple(new.stride())} has an extent of 2^30 or more and rows of fewer "
                    f"than {block // 2} elements, which the kernels cannot address"
                )
            ncols = dims[-1][0]
            tpr = -(-ncols // block)
            tiles = (numel // ncols) * tpr if mode == ROWS else -(-numel // block)
            # whether each tile's bits are whole words of the route's flat bitmask (a masked
            # frame's), its first element at a multiple of 32: all but rows of other lengths
            words = int(mode != ROWS or ncols % 32 == 0)
            self.whole_words[slot] = bool(words)
            mode = _aligned_mode(mode, dims, addr, old_at, numel)
            row = [addr, filled, old_at, 0, numel, tpr, slot, words, *_dims_row(dims)]
            rows.append(((isz, mode), tiles, row, slot))
        rows.sort(key=lambda r: r[0])  # stable: route order within a group
        self.groups: list[tuple[int, int, int, int]] = []
        """Per launch: (itemsize, mode, first tile, tiles)."""
        table = np.zeros((max(len(rows), 1), _WF), np.int64)
        ends = np.zeros((2, self.slots), np.int64)
        owner = []
        tile = 0
        for i, (key, tiles, row, slot) in enumerate(rows):
            row[3] = tile
            table[i] = row
            ends[:, slot] = (tile, tile + tiles)
            owner.append(np.full(tiles, i, np.int32))
            if self.groups and self.groups[-1][:2] == key:
                isz, mode, first, n = self.groups[-1]
                self.groups[-1] = (isz, mode, first, n + tiles)
            else:
                self.groups.append((*key, tile, tiles))
            tile += tiles
        self.tiles = tile
        # a sample's tiles: every SAMPLE-th of each route from its first, listed per launch
        # group; and each route's elements in them (a route's or row's last tile may hold
        # fewer than a block)
        picks: list[np.ndarray] = []
        self.sample_groups: list[tuple[int, int, int, int]] = []
        """Per launch of :meth:`sample`: (itemsize, mode, first entry of its picks, picks)."""
        self.sampled = np.zeros(self.slots, np.int64)
        """Per slot: its elements in the tiles a :meth:`sample` compares."""
        taken = 0
        for key, tiles, row, slot in rows:
            numel, t0, tpr = row[4], row[3], row[5]
            mine = np.arange(0, tiles, SAMPLE)
            if key[1] in (ROWS, ALIGNED_ROWS):  # a row's last tile: what is left of the row
                ncols = numel // (tiles // tpr)
                sizes = np.where(mine % tpr == tpr - 1, ncols - (tpr - 1) * block, block)
            else:
                sizes = np.where(mine == tiles - 1, numel - (tiles - 1) * block, block)
            self.sampled[slot] = int(sizes.sum())
            picks.append((t0 + mine).astype(np.int32))
            if self.sample_groups and self.sample_groups[-1][:2] == key:
                isz, mode, first, n = self.sample_groups[-1]
                self.sample_groups[-1] = (isz, mode, first, n + len(mine))
            else:
                self.sample_groups.append((*key, taken, len(mine)))
            taken += len(mine)
        self._picks = torch.from_numpy(np.concatenate(picks or [np.zeros(1, np.int32)])).to(
            self.device
        )
        self._routes = torch.from_numpy(table).to(self.device)
        self._owner = torch.from_numpy(np.concatenate(owner or [np.zeros(0, np.int32)])).to(
            self.device
        )
        self._ends = torch.from_numpy(ends.reshape(-1)).to(self.device)

    def warm(self) -> None:
        """Compile every variant of the kernels that a sync may launch on this window, now
        (at connect) rather than in the sync that first needs it: a compile takes a few
        hundred milliseconds (the on-disk cache of Triton makes later processes' quick)."""
        if INTERPRETED or self.device.type != "cuda":
            return
        # of the dtypes of a sync's buffers (a variant is compiled per pointers' dtypes)
        dtypes = (torch.uint8, torch.int32, torch.int64)
        b, i, q = (torch.empty(1, dtype=d, device=self.device) for d in dtypes)
        with _device_context(self.device):
            for isz, mode, first, n in self.groups:
                # (counts and bitmask: the shadow's bytes where a pass has none)
                for update, count, counts, bits in ((1, 0, b, b), (1, 1, i, b), (0, 1, i, i)):
                    for m in {mode, _unaligned(mode)}:
                        r, warps = _compare_shape(m)
                        for pick in (False, True) if update and count else (False,):
                            # (pick: the sampled tally, :meth:`sample`)
                            _compare_kernel.warmup(
                                self._owner, self._picks, self._routes, b, b, counts, bits,
                                first, n, T=_INT[isz], MODE=m, UPDATE=bool(update),
                                COUNT=bool(count), BLOCK=self.block, R=r, WHOLE=self._whole,
                                PICK=pick, num_warps=warps, grid=(1,), enable_fp_fusion=False,
                            )  # fmt: skip
                for steps in (True, False):
                    r, warps = EMIT_STEPS if steps else EMIT_LANES
                    _emit_kernel.warmup(
                        self._owner, self._routes, b, b, q, i, q, b, first, n,
                        T=_INT[isz], MODE=_unaligned(mode), BLOCK=self.block, ASM=True,
                        STEPS=steps, R=r, TOGETHER=EMIT_TOGETHER[_unaligned(mode)],
                        SUB=min(LANES, self.block), num_warps=warps, grid=(1,), enable_fp_fusion=False,
                    )  # fmt: skip
            _zero_kernel.warmup(q, b, CHUNK=ZERO_CHUNK, grid=(1,), enable_fp_fusion=False)

    def compare(
        self,
        work: torch.Tensor,
        scratch: torch.Tensor | None,
        update: bool,
        stream: torch.cuda.Stream | None = None,
        count: bool = False,
    ):
        """Launch the compare pass (no waiting), on ``stream`` if given (its buffers are
        allocated on the current stream, which must wait for ``stream`` before using them;
        the counts are then summed and copied to the host there too, :meth:`_count_on`).
        ``update``: only bring the shadow up to date (every reader gets dense bytes),
        returning None (with ``count``, the state for :meth:`counts` alone); else return
        the pass's state for :meth:`counts` and :meth:`emit`."""
        if not self.tiles:
            return None if update and not count else (None, None, None)
        scratch = work if scratch is None else scratch
        counts = bits = work
        if count or not update:
            counts = torch.empty(self.tiles + 1, dtype=torch.int32, device=self.device)
        if not update:
            bits = torch.empty(
                self.tiles * (self.block // 32), dtype=torch.int32, device=self.device
            )
        self._launch_compare(
            self.groups, work, scratch, counts, bits, update, count or not update, False, stream
        )
        if update and not count:
            return None
        ready = self._count_on(counts, stream) if stream is not None else None
        return counts, None if update else bits, ready

    def _count_on(self, counts: torch.Tensor, stream: torch.cuda.Stream) -> tuple:
        """Queue on ``stream`` (the compare pass's) each slot's counts, copied to the host:
        :meth:`counts` then waits for that stream alone, not for what the current stream
        queued meanwhile (the previous window's emit pass, copies waiting for sends). Its
        tensors are allocated on the current stream, which waits for ``stream`` before
        using them; they stay referenced until :meth:`counts` waited for ``stream``, as
        the allocator would otherwise hand one freed here to the current stream's next
        allocation while ``stream`` still writes it (syncs failed so, with garbage counts,
        when this copy's device-side buffer was dropped on return)."""
        cum = torch.empty(counts.numel(), dtype=torch.int64, device=self.device)
        ends = torch.empty(self._ends.numel(), dtype=torch.int64, device=self.device)
        host = torch.empty(ends.numel(), dtype=torch.int64, pin_memory=True)
        with _device_context(self.device), torch.cuda.stream(stream):
            torch.cumsum(counts, 0, dtype=torch.int64, out=cum)
            torch.index_select(cum, 0, self._ends, out=ends)
            host.copy_(ends, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return cum, ends, host, done

    def _launch_compare(self, groups, work, scratch, counts, bits, update, count, pick, stream):
        """One compare launch per entry of ``groups`` (:attr:`groups`, or with ``pick``
        :attr:`sample_groups`), on ``stream`` if given."""
        on = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        # the ALIGNED routes' places are offsets in these two: aligned only if they are
        aligned = work.data_ptr() % 16 == 0 and scratch.data_ptr() % 16 == 0
        with _device_context(self.device), on:
            for isz, mode, first, n in groups:
                mode = mode if aligned else _unaligned(mode)
                r, warps = _compare_shape(mode)
                _compare_kernel[(-(-n // r),)](
                    self._owner, self._picks, self._routes, work, scratch, counts, bits,
                    first, n, T=_INT[isz], MODE=mode, UPDATE=update, COUNT=count,
                    BLOCK=self.block, R=r, WHOLE=self._whole, PICK=pick, num_warps=warps, enable_fp_fusion=False,
                )  # fmt: skip

    def sample(self, work: torch.Tensor, stream: torch.cuda.Stream | None = None):
        """Launch a compare pass over every :data:`SAMPLE`-th tile of each route, its first
        included (no waiting; the routes' new values must be live regions, not scratch), on
        ``stream`` if given: the state for :meth:`counts`, whose counts are then of those
        tiles alone (:attr:`sampled`: how many elements each route had there). Their changed
        elements go into the shadow, as a whole pass would."""
        counts = torch.zeros(self.tiles + 1, dtype=torch.int32, device=self.device)
        if self.tiles:
            self._launch_compare(
                self.sample_groups, work, work, counts, work, True, True, True, stream
            )
        return counts, None, None

    def counts(self, state) -> tuple[np.ndarray, object]:
        """Each slot's count of changed elements (waits for the compare pass: for its
        stream alone where it ran on one, else for the current stream)."""
        counts, bits, ready = state
        if counts is None:
            return np.zeros(self.slots, np.int64), (None, bits)
        if ready is None:
            cum = torch.cumsum(counts, 0, dtype=torch.int64)
            ends = cum.index_select(0, self._ends).cpu().numpy()
        else:
            cum, _, host, done = ready
            done.synchronize()
            ends = host.numpy()
        return ends[self.slots :] - ends[: self.slots], (cum, bits)

    def emit(self, state, work, scratch, plan: np.ndarray, store, changed: int) -> None:
        """Launch the emit pass with ``plan`` (per slot: kind, frame offset in ``store``,
        values offset, index size): frames into ``store``, changed elements into the shadow;
        ``changed``: how many elements changed in the window (which kernel is faster)."""
        cum, bits = state
        if cum is None:
            return
        scratch = work if scratch is None else scratch
        store = work if store is None else store
        rows = _on(plan.astype(np.int64), self.device)
        steps = changed < STEPS_BELOW * self.elements
        r, warps = EMIT_STEPS if steps else EMIT_LANES
        with _device_context(self.device):
            for isz, mode, first, n in self.groups:
                _emit_kernel[(-(-n // r),)](
                    self._owner, self._routes, work, scratch, cum, bits, rows, store, first, n,
                    T=_INT[isz], MODE=_unaligned(mode), BLOCK=self.block, ASM=not INTERPRETED,
                    STEPS=steps, R=r, TOGETHER=EMIT_TOGETHER[_unaligned(mode)],
                    SUB=min(LANES, self.block), num_warps=warps, enable_fp_fusion=False,
                )  # fmt: skip

    def zero(self, store: torch.Tensor, starts: np.ndarray, ends: np.ndarray) -> None:
        """Zero bytes ``starts[k]`` to ``ends[k]`` of ``store`` (uint8, on the device), in
        one launch (chunks of :data:`ZERO_CHUNK` bytes) on the current stream."""
        n = ends - starts
        keep = n > 0
        starts, n = starts[keep], n[keep]
        if not len(n):
            return
        per = -(-n // ZERO_CHUNK)
        first = np.cumsum(per) - per
        step = np.arange(int(per.sum())) - np.repeat(first, per)
        at = np.repeat(starts, per) + step * ZERO_CHUNK
        chunks = np.stack([at, np.minimum(ZERO_CHUNK, np.repeat(starts + n, per) - at)], 1)
        with _device_context(self.device):
            _zero_kernel[(len(chunks),)](
                _on(chunks, self.device), store, CHUNK=ZERO_CHUNK, enable_fp_fusion=False
            )


class TargetTable:
    """A reader's live regions (every route of every bucket), for one-launch apply kernels.

    ``regions``: the live region of each route, in the decoder's global route order. Raises
    ValueError for a region the kernels cannot address (more than 4 dims that do not merge).
    """

    def __init__(
        self, regions: Sequence[torch.Tensor], device: torch.device, block: int = BLOCK
    ) -> None:
        self.device = torch.device(device)
        self.block = block
        table = np.zeros((max(len(regions), 1), _TFH), np.int64)
        self.contiguous = np.zeros(len(regions), bool)
        self.itemsize = np.zeros(len(regions), np.int64)
        for i, x in enumerate(regions):
            mode = region_mode(x, block)
            if mode is None:
                raise ValueError(
                    f"a live region of shape {tuple(x.shape)} and strides {tuple(x.stride())} "
                    "has more than 4 dims that do not merge"
                )
            dims = _collapse(x.shape, x.stride())
            table[i] = [x.data_ptr(), *_dims_row(dims)[:7], x.numel()]
            self.contiguous[i] = mode == CONTIG
            self.itemsize[i] = x.element_size()
        self.address = table[: len(regions), 0].copy()
        self._targets = torch.from_numpy(table).to(self.device)
        self._faults = torch.zeros(2, dtype=torch.int64, device=self.device)

    def clear_faults(self) -> None:
        """Forget the faults counted so far (queued on the current stream, before the
        launches of a new sync)."""
        self._faults.zero_()

    def faults(self) -> tuple[int, int]:
        """Elements of sparse frames not written since the last call because their indices
        fell outside their regions, and the global route of one of them (-1: none). Waits
        for the launches queued on the current stream (call it once the sync's launches
        ran)."""
        count, route = self._faults.tolist()
        if count:
            self._faults.zero_()
        return count, route - 1

    def warm(self) -> None:
        """Compile the apply kernel's variants for these regions now (see
        :meth:`WindowTable.warm`)."""
        if INTERPRETED or self.device.type != "cuda":
            return
        entries = torch.empty(1, dtype=torch.int64, device=self.device)
        buf = torch.empty(1, dtype=torch.uint8, device=self.device)
        kinds = sorted(set(zip(self.itemsize.tolist(), self.contiguous.tolist(), strict=True)))
        sub, warps = COPY_IN
        counts = torch.empty(1, dtype=torch.int32, device=self.device)
        with _device_context(self.device):
            block, mask_warps = self._masked_shape()
            sub_masked = min(LANES, block)
            _mask_count_kernel.warmup(
                entries, 2, 1, buf, counts, counts, BLOCK=block, ASM=True, SUB=sub_masked,
                num_warps=mask_warps, grid=(1,), enable_fp_fusion=False,
            )  # fmt: skip
            for size, contig in kinds:
                _apply_kernel.warmup(
                    entries, 2, 1, self._targets, buf, self._faults, T=_INT[size],
                    CONTIGUOUS=contig, BLOCK=self.block, num_warps=4, grid=(1,), enable_fp_fusion=False,
                )  # fmt: skip
                _apply_mask_kernel.warmup(
                    entries, self._targets, buf, entries, counts, self._faults, T=_INT[size],
                    CONTIGUOUS=contig, BLOCK=block, ASM=True, SUB=sub_masked,
                    num_warps=mask_warps, grid=(1,), enable_fp_fusion=False,
                )  # fmt: skip
                for aligned in (True, False) if contig else ():
                    _copy_in_kernel.warmup(
                        entries, 2, 1, self._targets, buf, T=_INT[size], ALIGNED=aligned,
                        VEC=16 // size, BLOCK=self.block, SUB=sub, num_warps=warps, grid=(1,), enable_fp_fusion=False,
                    )  # fmt: skip

    def apply(
        self,
        buf: torch.Tensor,
        route: np.ndarray,
        values: np.ndarray,
        nelem: np.ndarray,
        index: np.ndarray,
        ix: np.ndarray,
        lr: np.ndarray,
    ) -> None:
        """Write frames of ``buf`` (uint8, on the device) into their routes' regions, one
        entry per frame: its global ``route``, the byte offset of its ``values``, ``nelem``
        elements to write, and for a sparse frame (``ix`` 4 or 8, 0 for a dense one) the byte
        offset of its unit ``index``\\ es and log2 of elements per unit ``lr``."""
        keep = nelem > 0
        route, values, nelem, index, ix, lr = (
            a[keep] for a in (route, values, nelem, index, ix, lr)
        )
        if not len(route):
            return
        isz = self.itemsize[route]
        contiguous = self.contiguous[route]
        # dense frames into contiguous regions are plain copies (16 bytes at a time where
        # aligned); the rest takes the general kernel (sparse frames, strided regions)
        copy = (ix == 0) & contiguous
        aligned = (
            copy
            & (self.address[route] % 16 == 0)
            & ((buf.data_ptr() + values) % 16 == 0)
            & (nelem * isz % 16 == 0)
        )
        flag = np.where(copy, aligned, contiguous)
        sub, warps = COPY_IN
        tiles = -(-nelem // np.where(copy, self.block * sub, self.block))
        ent = np.zeros((len(route), _EFH), np.int64)
        ent[:, 1:] = np.stack([route, values, index, nelem, ix, lr, ix > 0], 1)
        ent, launches = _launches(ent, tiles, (flag, isz, copy))
        entries = _on(ent, self.device)
        with _device_context(self.device):
            for a, b, n, f, size, is_copy in launches:
                n_ent = b - a
                at = entries[a:] if a else entries
                steps = max(n_ent - 1, 0).bit_length()
                if is_copy:
                    _copy_in_kernel[(n,)](
                        at, n_ent, steps, self._targets, buf, T=_INT[size], ALIGNED=f,
                        VEC=16 // size, BLOCK=self.block, SUB=sub, num_warps=warps, enable_fp_fusion=False,
                    )  # fmt: skip
                else:
                    _apply_kernel[(n,)](
                        at, n_ent, steps, self._targets, buf, self._faults, T=_INT[size],
                        CONTIGUOUS=f, BLOCK=self.block, num_warps=4, enable_fp_fusion=False,
                    )  # fmt: skip

    def _masked_shape(self) -> tuple[int, int]:
        """Elements a program and warps of the masked apply (:data:`APPLY_MASKED`)."""
        tiles, warps = APPLY_MASKED
        return tiles * self.block, warps

    def apply_masked(
        self,
        buf: torch.Tensor,
        route: np.ndarray,
        bits: np.ndarray,
        values: np.ndarray,
        numel: np.ndarray,
        count: np.ndarray,
    ) -> None:
        """Write masked frames of ``buf`` (uint8, on the device) into their routes' regions,
        one entry per frame: its global ``route``, the byte offsets of its ``bits`` (the
        bitmask) and its ``values``, the route's ``numel`` elements and the frame's ``count``
        of values. Per element size and addressing mode two launches (each tile's popcount,
        then the apply kernel), and one cumsum between them for all."""
        keep = numel > 0
        route, bits, values, numel, count = (a[keep] for a in (route, bits, values, numel, count))
        if not len(route):
            return
        block, warps = self._masked_shape()
        tiles = -(-numel // block)
        ent = np.zeros((len(route), _EFH), np.int64)
        ent[:, 1:6] = np.stack([route, values, bits, numel, count], 1)
        keys = (self.contiguous[route], self.itemsize[route])
        ent, groups = _launches(ent, tiles, keys)
        # each launch's counts from a slot of its own (a 0, then a count per tile: the
        # cumsum's differences are its prefixes)
        launches, slot = [], 0
        for a, b, n, contiguous, size in groups:
            launches.append((a, b, n, slot, contiguous, size))
            slot += n + 1
        entries = _on(ent, self.device)
        counts = torch.empty(slot, dtype=torch.int32, device=self.device)
        where = torch.empty(slot, dtype=torch.int32, device=self.device)
        asm = not INTERPRETED
        sub = min(LANES, block)
        with _device_context(self.device):
            for a, b, n, at, _, _ in launches:
                _mask_count_kernel[(n,)](
                    entries[a:] if a else entries, b - a, max(b - a - 1, 0).bit_length(), buf,
                    counts[at:], where[at:], BLOCK=block, ASM=asm, SUB=sub, num_warps=warps, enable_fp_fusion=False,
                )  # fmt: skip
            cum = torch.cumsum(counts, 0)
            for a, _, n, at, contiguous, size in launches:
                _apply_mask_kernel[(n,)](
                    entries[a:] if a else entries, self._targets, buf, cum[at:], where[at:],
                    self._faults, T=_INT[size], CONTIGUOUS=contiguous, BLOCK=block,
                    ASM=asm, SUB=sub, num_warps=warps, enable_fp_fusion=False,
                )  # fmt: skip
