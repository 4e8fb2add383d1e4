"""Sparse deltas on the wire: send only the elements that changed since the last sync, bit exact.

The writer keeps the bytes it last sent on every route (its *shadow*: the dense bucket bytes,
in the plan's bucket layout, on the writer's device or in pinned host memory). A sync compares
each route's new wire values with the shadow by their raw bits (integers of the element's
width), so the comparison is exact: NaNs compare equal to themselves, ``-0.0`` and ``0.0``
differ, and any dtype works. A route travels sparse as the indices of its changed elements,
numbered flat and row-major within the route's canonical box (so deltas follow the routes
through any resharding), and their values.

Elements, not 8-byte words, are the unit compared and sent. Measured on CPU (128 MiB of bf16,
1% of the elements changed): 3.8% of the 8-byte words changed, so words put 5.7% of the dense
bytes on the wire (a 4-byte index and 8 bytes per word) and elements 2.9% (a 4-byte index and
2 bytes per element); a bf16 route stays sparse up to 1/3 of its elements changed instead of
about 1/4. On a GPU the compare is a kernel that reads the new and the previous values once
whatever the unit; elements only make its bitmask of changed ones 1/16 of the bytes compared
instead of 1/64, a few percent more memory traffic, for half the bytes on the wire and half the frame
writes. The torch path (CPU tensors) pays more: its compare and ``nonzero`` over elements took
2 to 3 times as long as over words on 2 busy cores (about 120 against 50 ms for the 128 MiB),
which CPU jobs, few and small, can afford for one wire format on both paths. Frames whose units
are wider than their elements (each unit's elements travel together, as earlier writers sent
8-byte words) are still accepted by readers.

The writer works on *windows* of consecutive buckets (about :attr:`DeltaConfig.window_bytes`
each). On a GPU (Triton, :mod:`weightbus.codecs._delta_triton`), a table of the window's routes
built at connect makes the work per window a fixed number of launches whatever its number of
routes: one compare pass (per tile of 2048 elements: a count of changed elements and their
bitmask), a cumsum of the counts and one small device-to-host copy of each route's count (the
window's only wait for the device), then, once the host has chosen each route's frame (sparse
when its (indices, values) frame is smaller than its dense bytes, dense otherwise), one emit
pass that writes the window's frames into a store and the changed elements into the shadow.
The emit pass takes the changed elements word by word of the bitmask (at 1% changed, a few
steps per tile instead of a lane per element). Packing a group then copies its buckets' frames
(the store's, or the shadow's for a bucket sent whole), or nothing when they all travel whole
(then the group is sent from the shadow). Every variant of the kernels is compiled at
connect, not in the sync that first needs one. The compare passes run on a stream of their
own, and a window every route of which went dense is sent dense in the next sync without
waiting for its counts or an emit pass: it is copied into the shadow (the copy engines for
contiguous live bytes, leaving the SMs to the sends) after a compare of every 16th tile of
each of its routes counts its changes, so that it is compared again once some route would go
sparse (when its groups travel as pieces, from the live tensors, only the sample's tiles of
the shadow are brought up to date, and the window goes dense once more, copied whole, before
it is compared: the copies beside the sends slowed NCCL's kernels); on the torch path, or
where some route is computed (FP8, a cast), its compare pass does both, queued after the
previous window's sends, which a compare grid queued first would hold back. Readers apply a window's group of buckets with a launch or two (per element
size): a copy of the dense frames that go to contiguous regions, and one that writes the
other dense frames and scatters every sparse frame into the live tensors, after one small
device-to-host copy of the group's directories and one small host-to-device copy of where
its frames go. On CPU the same steps
are torch operations per route.

Bucket wire format (little-endian, no pickle), one bucket = one byte buffer::

    header     48 bytes   magic "WBD2", frames, flags (1: checksum, 2: plain, 4 and 8: see
                          below), reserved,
                          used bytes, version, base version (-1: no sparse frame), checksum
    directory  16 bytes per route, in the bucket's route order:
                          kind (1 dense, 2 sparse, 3 masked), itemsize, index size (0, 4,
                          8; 0 for masked), unit (bytes per value: the itemsize; readers
                          also take a multiple of it in sparse frames), 0, count (values:
                          elements, or units)
    frames     plain (every route dense): the plan's bucket bytes, at its route offsets;
               otherwise the dense routes' bytes, then the delta routes' frames, each in
               route order at a 16-byte aligned offset; a sparse frame is its unit indices
               (count of them), padded to 16 bytes, then its unit values; a masked frame
               (:attr:`DeltaConfig.masks`) is a bitmask of the route's elements in the same
               flat order (bit k of little-endian 32-bit word w: element 32 w + k), padded
               to 16 bytes (:func:`mask_bytes`), then the changed elements' values in that
               order (count of them, as many as the bits set)

The header and directory have a fixed size per bucket (:func:`directory_bytes`), so a reader
can read them first and then take exactly ``used`` bytes. Between processes a writer sends a
window's buckets to one reader together (a *group*, :meth:`DeltaEncoder.encode_group`), as
two messages: the group's directories, concatenated (a size the reader knows from the plan,
as it derives the same windows: :func:`window_index`), then the buckets' frames one after the
other, each at a :data:`GROUP_ALIGN` boundary (:func:`group_layout`), whose size the
directories give. The shadow lays out each group's buckets the same way, so a group whose
buckets all travel plain (a dense sync, or every route changed enough) is sent straight from
the shadow, without a copy. A group's directories go after the previous group's buckets (to
the same reader) or, when the previous group's first header has flag 4 (``FLAG_AHEAD``),
before them: the writer does so when it has them without waiting for its device (a group of
the same pass, or of a window sent dense, whose directories follow from the plan), and the
reader then posts the receive of a group's buckets while the previous group's travel (on two
GPUs at 50% changed, waiting for the directories behind the buckets left the link idle ~0.7
ms per 1 GiB group). A reader so waits for sizes once per window, not once per bucket, and
applies a group with one launch: measured on two GPUs, each such wait (the directory's
arrival, a device-to-host copy, posting the receive) and each apply (its directory read, its
table copied, its launch) cost about a millisecond of host time per bucket at 256 MiB
buckets, most of a sync with 1% of the elements changed. With :attr:`DeltaConfig.pieces`, a
group of plain buckets whose routes are all live regions on the writer travels, when its first
header has flag 8 (``FLAG_PIECES``), as its pieces instead of its second message
(:func:`group_pieces`, the same on both sides): each from the writer's tensors where it lies
contiguous there, each into the reader's where it does there, the others staged (in rooms
of their own where they fit, so that such a group takes no staging buffer on either side).
With :attr:`DeltaConfig.announce`, a writer whose every window goes dense for sure and
whose every group has a room says in its begin message that every group of its travels as
pieces, each group's directories after its pieces (:meth:`DeltaEncoder.announce`): it sends
a group's pieces before analyzing its window (:meth:`DeltaEncoder.announced_pieces`); a
reader with a room for each of those groups then posts all their receives at once, in that
order, and checks each group's directories as they arrive
(:meth:`DeltaDecoder.check_announced`).

When the writer sends dense (:class:`DeltaPolicy`): the first sync (nothing sent before),
to a reader whose acknowledged version is not the one the shadow holds (it missed a sync or
joined late), after a failed sync, and on request. Every ``checksum_every`` syncs, and on
request, each bucket carries a checksum of its dense bytes and the reader verifies its live
regions against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from weightbus._env import env_int
from weightbus._trace import mark
from weightbus.errors import WeightbusError
from weightbus.plan.program import BucketOp, pack

logger = logging.getLogger(__name__)

__all__ = [
    "DeltaConfig",
    "DeltaDecision",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaPolicy",
    "capacity",
    "checksum",
    "directory_bytes",
    "encoded_size",
    "GROUP_FORMAT",
    "Group",
    "group_aligned",
    "group_layout",
    "group_pieces",
    "Piece",
    "piece_posts",
    "window_index",
]

MAGIC = int.from_bytes(b"WBD2", "little")
DENSE, SPARSE, MASKED = 1, 2, 3
FLAG_CHECKSUM, FLAG_PLAIN, FLAG_AHEAD, FLAG_PIECES = 1, 2, 4, 8
ALIGN = 16
# header: magic, frames, flags, reserved, used, version, base version, checksum
_HEAD = struct.Struct("<IIIIQqqQ")
# directory entry: kind, itemsize, index size, unit, reserved, count
_ENT = struct.Struct("<BBBBIQ")
assert _HEAD.size == 48 and _ENT.size == 16
_ENT_FIELDS = np.dtype(
    [("kind", "u1"), ("isz", "u1"), ("ix", "u1"), ("unit", "u1"), ("zero", "<u4"), ("count", "<u8")]
)
assert _ENT_FIELDS.itemsize == _ENT.size
_HEAD_FIELDS = np.dtype(
    [("magic", "<u4"), ("frames", "<u4"), ("flags", "<u4"), ("reserved", "<u4"),
     ("used", "<u8"), ("version", "<i8"), ("base", "<i8"), ("checksum", "<u8")]
)  # fmt: skip
assert _HEAD_FIELDS.itemsize == _HEAD.size and _HEAD.size % ALIGN == 0
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHADOWS = ("device", "host")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaConfig:
    """Sparse deltas on the wire (writer-side choices; both sides must enable it)."""

    max_changed_fraction: float | None = None
    """A route travels as a delta (sparse or masked) only while at most this fraction of its
    elements changed; None: whenever that frame is smaller than its dense bytes (below 1/3
    of a bf16 route's elements changed, below 15/16 with :attr:`masks`)."""
    masks: bool = True
    """Whether a route may travel as a masked frame (a bit per element, then the changed
    values) where that is smaller than its sparse frame (indices and values) and its dense
    bytes: for bf16 from about 3% to 15/16 of its elements changed. At 50% changed a bf16
    route then takes 56% of its dense bytes, where a sparse frame would take 150% (so it
    goes dense without masks). On two H200s (Llama-3-8B, 50% changed, two rounds of 12
    timed syncs) syncs took 44.8 and 45.2 ms with masks (7.3 GB on the wire) against 49.6
    and 49.1 ms without (16.1 GB, sent dense from the live tensors), S1 46.1-46.6; per 2
    GiB of bf16 on an H200 the writer's emit pass takes 2.0 ms and a reader's masked apply
    2.1 ms, whatever the fraction changed (a device copy of it: 1.0). Over a slower link
    (across hosts) the bytes saved count for more. False: sparse or dense frames only.
    Writer-side only (readers take either)."""
    checksum_every: int = 20
    """Every this many syncs the readers verify a checksum of every bucket; 0: only on request."""
    shadow: str = "device"
    """Where the writer keeps the bytes it last sent: "device" (with the weights) or "host"
    (pinned host memory, when the GPU has no room for a copy of the writer's share)."""
    window_bytes: int = 2 << 30
    """The writer compares this many bytes of buckets at once (at least one bucket): one host
    wait per window (two on the torch path); its scratch (on GPU a bit per element, on CPU a
    byte per element and the positions of the changed ones; and the window's frames) grows
    with it. A window's buckets to one reader travel as one group (its directories, then its
    frames: one round trip per window and reader), so readers must use the same value: it is
    part of the codecs both sides agree on. Each side stages two such groups (one per peer
    where there are more, at most ``SyncConfig.staging_buffers``), each at its dense size:
    with the default 4 GiB on each side of one writer and one reader, up to 8 GiB on a
    participant with four peers or more; half that with 1 GiB windows (two a pass, the
    defaults before), where memory is short. Each group costs both hosts a fixed amount of
    work (a reader about 1 ms: its directories' copy and parse, the apply launches), which
    bounds a sync where few elements changed: on two H200s (Llama-3-8B, 16 GB; two rounds of
    10 timed syncs each, in one run) 2 GiB windows synced 1% changed in 19.1 and 20.4 ms
    against 30.9 and 35.8 with 1 GiB windows two to a pass, and 50% changed in 42.5 and 42.7
    ms against 45.5 and 45.3 (S1 over NCCL 46.2-46.7 ms); 4 GiB windows took 20.4 and 19.8
    ms at 1%, 46.7 and 46.4 at 50% (their first pass, before any byte leaves, is twice as
    long)."""
    windows_per_pass: int = 1
    """The writer analyzes this many consecutive windows at once: one compare and one emit
    pass, and one host wait, for all of them (its scratch grows accordingly). Its host work
    per pass (the wait, the frames' layout, the launches) is about fixed: with 1 GiB windows
    one a pass left the writer waiting on its own host, and two a pass was the default until
    windows of 2 GiB were. The first window goes alone, as nothing is sent before its pass is
    done. Four 1 GiB windows a pass did not help (S7 at 1% on two H200s: 34.9 and 37.6 ms
    against 34.1 and 34.0 with two): the per-group work, not the per-pass work, bounds
    it. Writer-side only."""
    compare_ahead: int = 2
    """How many passes after the one the writer waits for may have their compare passes
    queued already (on the Triton path with the shadow on the device; else one): the device
    then runs them back to back while the host lays out frames and posts sends. Each holds
    its bitmask until its emit pass (a bit per element: 128 MiB per 2 GiB of bf16). Before,
    the next pass's compare was queued only once the host had this one's counts, so the
    device sat idle while the host worked. On two H100s (Llama-3-8B, S7 at 1% changed, 10
    timed syncs a round): 21.2, 26.0, 24.4, 29.6, 21.4, 24.2 and 23.5 ms with 2 over three
    runs, against 27.8, 28.9, 28.1, 22.9 and 24.5 for the tree before in two of them; 1
    took 22.9 and 25.2, 4 took 29.9 and 27.4, 8 took 24.8 and 25.1. The device's passes
    (about 2 ms a 2 GiB window there) and the host's work per window (2.2-2.6 ms) now bound
    such a sync about equally. Writer-side only."""
    pieces: bool = True
    """Whether a group of plain buckets (every route dense: a dense sync, or a window that
    changed enough) whose routes are all live regions travels as its pieces
    (:func:`group_pieces`): from the writer's tensors and, where the reader's regions are
    contiguous in the wire dtype, straight into them; nothing is copied into or out of a
    staging buffer (the pieces that are not contiguous go through small rooms of their own
    on both sides). With the shadow on the writer's GPU, such a window's copies into the
    shadow run once its sends are posted, and while it goes dense on a guess only its
    sample's tiles are brought up to date (it goes dense once more, copied whole, before it
    is compared again). Writer-side only (readers take either). On two H100s (Llama-3-8B,
    50% of the elements changed every sync): 49.0-49.9 ms with it, 52.4 without, S1 46.1-46.8
    (the copies whole beside the sends had slowed NCCL's kernels: 55.5-56.0); see
    docs/history.md."""

    announce: bool = False
    """Whether a writer says at a sync's begin (its ``begin`` message) when every group of
    its will travel as pieces, each group's directories after its pieces (every window goes
    dense for sure, :meth:`DeltaEncoder.announce`); the writer then posts a group's pieces
    before it analyzes the group's window, and launches the windows' copies and sample
    passes once every group is posted; readers post every receive of that writer's groups
    at once, as syncs without codecs do, instead of reading each group's directories first.
    In a profile of S7 at 50% changed (two H100s), a reader posted its first pieces about
    3.5 ms after its first directories' receive, and the writer its first 2.4 ms after its
    first GPU event (analyzing its first two windows), while the link waited. Writer-side
    only (readers follow the announcement where every group has a room of their own, else
    read directories first)."""

    def __post_init__(self) -> None:
        f = self.max_changed_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise ValueError(f"max_changed_fraction={f} must be in (0, 1], or None (automatic)")
        if self.checksum_every < 0:
            raise ValueError(f"checksum_every={self.checksum_every} must be >= 0 (0: on request)")
        if self.shadow not in _SHADOWS:
            raise ValueError(f"shadow={self.shadow!r} must be one of {_SHADOWS}")
        if self.windows_per_pass < 1:
            raise ValueError(f"windows_per_pass={self.windows_per_pass} must be >= 1")
        if self.compare_ahead < 1:
            raise ValueError(f"compare_ahead={self.compare_ahead} must be >= 1")
        if self.window_bytes < 1:
            raise ValueError(
                f"window_bytes={self.window_bytes} must be >= 1 (e.g. 2 << 30; a window holds "
                "at least one bucket)"
            )


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _aligned(n: np.ndarray) -> np.ndarray:
    return -(-n // ALIGN) * ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same width (raw bits, for exact comparison)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the device (pinned, async)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def directory_bytes(op: BucketOp) -> int:
    """Bytes of a bucket's header and directory: fixed per bucket, sent first."""
    return _align(_HEAD.size + _ENT.size * len(op.copies))


def window_index(nbytes: Sequence[int], window_bytes: int) -> list[int]:
    """Per bucket of one writer's program (its buckets' bytes, in order): the index of its
    window, consecutive buckets of about ``window_bytes`` (at least one each). Readers
    derive the same windows from the plan to know which directories travel together."""
    out: list[int] = []
    size = 0
    for n in nbytes:
        if not out or size + int(n) > window_bytes:
            size = 0
            out.append(out[-1] + 1 if out else 0)
        else:
            out.append(out[-1])
        size += int(n)
    return out


GROUP_ALIGN = 256
"""Where each bucket of a window's group starts in the group's message (bytes)."""
GROUP_FORMAT = 5
"""The layout and order of a group's messages, part of the codec agreement: 5, a route may
travel as a masked frame (kind 3: a bitmask, then the changed values); 4, a group of
plain buckets may travel as its pieces (``FLAG_PIECES``, :func:`group_pieces`); 3, a group's
directories may come before the previous group's buckets (``FLAG_AHEAD``); 2, always after
them; 1 repeated each bucket's directory in the second message."""

PIECE_BYTES = 1 << 20
"""In a group sent as pieces, a route of at least this many bytes is a piece of its own (sent
from and received into the live tensors where they are contiguous); the smaller routes
between two such travel together, staged (norms, biases: a message each would cost more than
their bytes)."""

PIECES_AREA_BYTES = 256 << 20
"""A writer stages the pieces of its groups that are not live bytes in rooms of their own
(then such a group needs no staging buffer) where they take at most this many bytes in all;
otherwise each group sent as pieces takes a staging buffer."""

PIECES_PER_POST = 8
"""A group's pieces are posted this many at a time (one NCCL group each), the same on both
sides: a post moves only once it is all posted, and a message each was slower (on 2 x H200,
Llama-3-8B's tensors in groups of 8: 45.0 ms, a send each: 47.6)."""


def group_aligned(n):
    """``n`` bytes (an int or an integer array) rounded up to a :data:`GROUP_ALIGN` boundary."""
    return -(-n // GROUP_ALIGN) * GROUP_ALIGN


def group_layout(used: Sequence[int]) -> tuple[list[int], int]:
    """A window's group on the wire, its second message: its buckets' frames (``used``
    bytes each; their directories came in the first message), one after the other at
    :data:`GROUP_ALIGN`-byte boundaries; returns each one's offset and the message's bytes.
    The shadow holds a group's buckets the same way, so plain ones are sent from it as is."""
    starts, at = [], 0
    for n in used:
        starts.append(at)
        at = group_aligned(at + int(n))
    end = starts[-1] + int(used[-1]) if starts else 0
    return starts, end


@dataclass(frozen=True, slots=True)
class Group:
    """A writer window's buckets to one reader, which travel together (fixed at connect, the
    same on both sides): their directories, then the encoded buckets (:func:`group_layout`),
    which are staged (the directories have a place of their own, so that they may travel
    before the previous group's buckets)."""

    ops: tuple[BucketOp, ...]
    capacity: int
    """Staging bytes the group's buckets need (every bucket's frames at :func:`capacity`)."""
    directories: int
    """The directories' bytes (the first message)."""
    pieces: tuple[Piece, ...]
    """Its messages after the directories when they say it travels as pieces (every bucket
    plain): :func:`group_pieces`."""

    @classmethod
    def of(cls, ops: Sequence[BucketOp]) -> Group:
        end = group_layout([capacity(op) - directory_bytes(op) for op in ops])[1]
        return cls(
            tuple(ops),
            group_aligned(end),
            sum(directory_bytes(op) for op in ops),
            group_pieces(ops),
        )


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a group of plain buckets sent as pieces (:func:`group_pieces`): bytes
    ``[at, at + nbytes)`` of the group's plain layout (:func:`group_layout` of its buckets'
    bytes), holding ``routes``, each (bucket's place in the group, route in the bucket)."""

    at: int
    nbytes: int
    routes: tuple[tuple[int, int], ...]


def group_pieces(ops: Sequence[BucketOp]) -> tuple[Piece, ...]:
    """A group of plain buckets (``ops``) as the messages it travels in when its first header
    carries ``FLAG_PIECES``, the same on both sides: each route of at least
    :data:`PIECE_BYTES` alone, the routes between two such together (with the padding between
    them), every empty route left out. A piece of one route goes from and to the live
    tensors where they hold it contiguous in the wire dtype, so that neither side copies it:
    a window sent dense costs what a sync without codecs does."""
    starts = group_layout([op.nbytes for op in ops])[0]
    pieces: list[Piece] = []
    small: list[tuple[int, int, int, int]] = []  # (k, i, start, end) not yet in a piece

    def flush() -> None:
        if small:
            lo, hi = small[0][2], small[-1][3]
            pieces.append(Piece(lo, hi - lo, tuple((k, i) for k, i, _, _ in small)))
            small.clear()

    for k, op in enumerate(ops):
        for i, c in enumerate(op.copies):
            if not c.nbytes:
                continue
            at = starts[k] + c.offset
            if c.nbytes >= PIECE_BYTES:
                flush()
                pieces.append(Piece(at, c.nbytes, ((k, i),)))
            else:
                small.append((k, i, at, at + c.nbytes))
    flush()
    return tuple(pieces)


def piece_posts(pieces: Sequence[Piece]) -> list[range]:
    """The pieces of a group (their indices) in the posts both sides make of them."""
    n = len(pieces)
    return [range(a, min(a + PIECES_PER_POST, n)) for a in range(0, n, PIECES_PER_POST)]


def next_groups(groups: Mapping[int, Sequence[BucketOp]]) -> dict[int, int]:
    """Per group (its first bucket; ``groups`` in program order, each its buckets): the first
    bucket of the next group between the same writer and reader, where there is one. Its
    directories go on the wire either after this group's buckets or, when this group's
    directories carry ``FLAG_AHEAD``, before them, so that the reader posts the next group's
    receive while this one's buckets travel."""
    out: dict[int, int] = {}
    last: dict[int, int] = {}
    for first, ops in groups.items():
        peer = ops[0].peer
        if peer in last:
            out[last[peer]] = first
        last[peer] = first
    return out


def encoded_size(directory: torch.Tensor) -> int:
    """The bytes of a whole encoded bucket, read from its first :func:`directory_bytes`
    bytes: a receiver takes the directory first, then the rest."""
    magic, _, _, _, used, *_ = _HEAD.unpack(directory[: _HEAD.size].cpu().numpy().tobytes())
    if magic != MAGIC:
        raise WeightbusError(
            f"not a delta bucket (magic {magic:#x}): both sides must enable deltas and run the "
            "same weightbus version"
        )
    return used


def capacity(op: BucketOp) -> int:
    """The largest encoded bucket (every route dense, plain or in frames)."""
    head = directory_bytes(op)
    return max(head + op.nbytes, head + sum(_align(c.nbytes) for c in op.copies))


def checksum(data: torch.Tensor) -> int:
    """A 64-bit checksum of a uint8 tensor, equal on every device: position-weighted sums of
    32-bit words in chunks of 2**15 (exact in int64), hashed with BLAKE2b. For detecting
    corruption and bookkeeping errors, not adversaries. One device-to-host copy."""
    data = data.reshape(-1)
    n = data.numel()
    n4 = n - n % 4
    words = data[:n4]
    if n4 and words.data_ptr() % 4:
        words = words.clone()
    words = words.view(torch.int32)
    chunk, stride = 1 << 15, 1 << 22
    weights = torch.arange(1, chunk + 1, dtype=torch.int64, device=data.device)
    parts = []
    for start in range(0, len(words), stride):
        w = words[start : start + stride].to(torch.int64)
        full = len(w) - len(w) % chunk
        blocks = w[:full].view(-1, chunk)
        tail = w[full:]
        s1 = torch.cat([blocks.sum(1), tail.sum().view(1)])
        s2 = torch.cat([(blocks * weights).sum(1), (tail * weights[: len(tail)]).sum().view(1)])
        parts.append(torch.stack([s1, s2]).view(-1))
    parts.append(data[n4:].to(torch.int64))
    host = torch.cat(parts).cpu().numpy()
    h = hashlib.blake2b(digest_size=8)
    h.update(n.to_bytes(8, "little"))
    at = 0
    for p in parts[:-1]:
        h.update(host[at : at + len(p)].astype("<i8").tobytes())
        at += len(p)
    h.update(host[at:].astype(np.uint8).tobytes())
    return int.from_bytes(h.digest(), "little")


# ---------------------------------------------------------------------------------------------
# when to send dense, when to verify
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaDecision:
    """What one writer does in one sync."""

    version: int
    dense: frozenset[int]
    """Readers (indices) whose routes travel dense."""
    base: tuple[int | None, ...]
    """Per reader: the version its sparse frames apply to (None: dense)."""
    checksum: bool
    """Whether every bucket carries a checksum the reader verifies."""


@dataclass(slots=True)
class DeltaPolicy:
    """One writer's record of what each reader holds, and the rules for dense and checksums."""

    config: DeltaConfig
    num_readers: int
    _sent: list = field(init=False)
    """Per reader: the version the shadow of its routes holds (None: unknown)."""
    _held: list = field(init=False)
    """Per reader: the version it last acknowledged (None: none, or unknown)."""
    _dense: set = field(init=False, default_factory=set)
    _checksum: bool = field(init=False, default=False)
    _since_checksum: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._sent = [None] * self.num_readers
        self._held = [None] * self.num_readers

    def request_dense(self, readers: Iterable[int] | None = None) -> None:
        """Send the next sync dense, to ``readers`` (default: all)."""
        self._dense.update(range(self.num_readers) if readers is None else readers)

    def request_checksum(self) -> None:
        """Verify a checksum of every bucket in the next sync."""
        self._checksum = True

    def holding(self, held: Sequence[int | None]) -> None:
        """What each reader says its live tensors hold as a sync begins (None: nothing this
        writer sent, e.g. the engine reloaded its weights); replaces what the acks implied."""
        if len(held) != self.num_readers:
            raise ValueError(
                f"holding() needs {self.num_readers} readers' versions, got {len(held)}"
            )
        self._held = [None if v is None else int(v) for v in held]

    def begin(self, version: int) -> DeltaDecision:
        """Decide the sync of ``version``; the shadow is in flux until :meth:`sent`."""
        dense = frozenset(
            r
            for r in range(self.num_readers)
            if self._sent[r] is None or self._held[r] != self._sent[r] or r in self._dense
        )
        every = self.config.checksum_every
        do_checksum = self._checksum or (every > 0 and self._since_checksum + 1 >= every)
        decision = DeltaDecision(
            version=version,
            dense=dense,
            base=tuple(None if r in dense else self._sent[r] for r in range(self.num_readers)),
            checksum=do_checksum,
        )
        # until every route is packed, the shadow holds a mix of versions
        self._sent = [None] * self.num_readers
        return decision

    def sent(self, decision: DeltaDecision) -> None:
        """Every bucket of the sync was packed: the shadow holds ``decision.version``."""
        self._sent = [decision.version] * self.num_readers
        self._dense.clear()
        if decision.checksum:
            self._checksum = False
            self._since_checksum = 0
        else:
            self._since_checksum += 1

    def acknowledged(self, version: int, readers: Iterable[int]) -> None:
        """``readers`` confirmed ``version``; any other reader's state is unknown from now."""
        ok = set(readers)
        self._held = [version if r in ok else None for r in range(self.num_readers)]

    def abandon(self) -> None:
        """A sync failed part way: nothing is known about any reader."""
        self._sent = [None] * self.num_readers
        self._held = [None] * self.num_readers


# ---------------------------------------------------------------------------------------------
# writer: encode buckets against the shadow
# ---------------------------------------------------------------------------------------------

Fill = Callable[[BucketOp, torch.Tensor], None]
"""``fill(op, out)``: write bucket ``op``'s new wire values into ``out`` (uint8, ``op.nbytes``
bytes) in the plan's bucket layout, each route at its offset; other bytes stay as they were."""

Views = Callable[[BucketOp], Sequence[torch.Tensor] | None]
"""``views(op)``: every route's new wire values as tensors that need no computing (live views
in the wire dtype, of ``copy.shape``), or None when some route is computed (FP8, a cast), so
the bucket is filled into scratch first. The same tuple object while the views stay valid."""

EMIT_PRIORITY = env_int("WEIGHTBUS_DELTA_EMIT_PRIORITY", -1)
"""The CUDA stream priority of a writer's emit passes (lower is more urgent; CUDA maps it into
its range), or 0: they run on the current stream (:meth:`DeltaEncoder._emitting`).
``$WEIGHTBUS_DELTA_EMIT_PRIORITY`` overrides it. On two H100s, S7 at 1% changed, three rounds
of 10 timed syncs alternating in one run: 21.9, 22.3 and 22.5 ms with it, 21.4, 24.2 and 23.5
without; at 50% 48.6 against 49.0 (S1 over NCCL 46.3-47.1)."""
_IMPLS = ("auto", "torch", "triton")
TRITON_ENV = "WEIGHTBUS_DELTA_TRITON"
"""Set to 0 for torch ops on CUDA under ``impl="auto"`` (default there: the Triton kernels)."""
_WIDE = 2**31
"""Routes of at least this many elements number them with 8-byte indices, others 4-byte."""
# what the emit pass does with a route (a plan row's kind, shared with the Triton kernels):
# only bring its shadow up to date (it travels in a bucket sent whole; the Triton kernels'
# compare pass already did), write its sparse frame, its dense frame, or its masked frame
_KEEP, _SPARSE_FRAME, _DENSE_FRAME, _MASK_FRAME = 0, 1, 2, 3


def mask_bytes(numel: int | np.ndarray):
    """Bytes of a masked frame's bitmask over ``numel`` elements: 32-bit words, padded to
    :data:`ALIGN` (its values follow)."""
    return _aligned(-(-np.asarray(numel, np.int64) // 32) * 4)


def _pack_mask(mask: torch.Tensor, out: torch.Tensor) -> None:
    """Write bool ``mask`` (flat) as bits into ``out`` (uint8): bit ``k`` of byte ``b`` is
    element ``8 b + k`` (so bit ``k`` of little-endian word ``w`` is element ``32 w + k``)."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    out[: len(padded) // 8].copy_((padded.view(-1, 8) << shifts).sum(1, dtype=torch.uint8))


def _unpack_mask(bits: torch.Tensor) -> torch.Tensor:
    """Every bit of ``bits`` (uint8) as a bool, in :func:`_pack_mask`'s order."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.view(-1, 1) >> shifts) & 1).view(-1).bool()


@functools.cache
def _load_triton():
    """The Triton kernels module, or None (logged once) where Triton is not importable."""
    try:
        from weightbus.codecs import _delta_triton
    except ImportError as exc:
        logger.warning(
            "sparse deltas on GPU fall back to torch ops per route: triton is unusable (%s)", exc
        )
        return None
    return _delta_triton


def _kernels(impl: str, device: torch.device, who: str):
    """The Triton kernels module for ``impl`` on ``device``, or None (torch ops)."""
    if impl not in _IMPLS:
        raise ValueError(f"{who}: impl={impl!r} must be one of {_IMPLS}")
    if impl == "auto" and os.environ.get(TRITON_ENV) == "0":
        return None
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return None
    kernels = _load_triton()
    if kernels is None:
        if impl == "triton":
            raise ImportError(f"{who}: impl='triton' needs triton, which is not importable here")
        return None
    if device.type != "cuda" and not kernels.INTERPRETED:
        raise ValueError(
            f"{who}: impl='triton' takes CUDA tensors, these are on {device} (CPU tensors "
            "only run in Triton's interpreter, TRITON_INTERPRET=1); use impl='auto'"
        )
    return kernels


class _Bucket:
    """A writer's bucket, as far as fixed at connect."""

    __slots__ = ("base", "head", "op", "template")

    def __init__(self, op: BucketOp, base: int) -> None:
        self.op, self.base = op, base
        """The bucket op, and where its bytes start in the shadow."""
        self.head = directory_bytes(op)
        t = bytearray(self.head)
        _HEAD.pack_into(t, 0, MAGIC, len(op.copies), 0, 0, 0, 0, -1, 0)
        for i, c in enumerate(op.copies):
            isz = _itemsize(c.dtype)
            _ENT.pack_into(t, _HEAD.size + _ENT.size * i, DENSE, isz, 0, 0, 0, c.nbytes // isz)
        self.template = bytes(t)
        """Its header and directory with every route dense; a sync fills in the rest."""


class _TorchWindow:
    """A window's routes for torch ops on any device (the CPU path): per route, a compare
    into one mask, and after one ``nonzero`` over it, the frames and the shadow update.

    ``routes``: per slot ``(new, shape, itemsize, numel, scratch_at, old_at)`` as for
    :class:`weightbus.codecs._delta_triton.WindowTable`.
    """

    def __init__(self, routes: Sequence[tuple], device: torch.device) -> None:
        self.routes = routes
        self.device = device
        numel = np.array([r[3] for r in routes], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(numel)])
        """Where each slot's elements start in the window's mask."""
        self._starts = _to_device(self.starts, device)
        self._key: tuple = ()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def warm(self) -> None:
        """Nothing to compile (the kernels' tables compile theirs at connect)."""

    def _views(self, work: torch.Tensor, scratch: torch.Tensor | None) -> list:
        """Per slot: its new values and its shadow bytes as integers of the element's width
        (kept while ``work`` and ``scratch`` are the same buffers)."""
        key = (work.data_ptr(), None if scratch is None else scratch.data_ptr())
        if key != self._key:
            self._pairs = []
            for new, shape, isz, numel, scratch_at, old_at in self.routes:
                as_int = _INT_OF_SIZE[isz]
                if new is None:
                    assert scratch is not None
                    new = scratch[scratch_at : scratch_at + numel * isz].view(as_int).view(shape)
                else:
                    new = new.view(as_int)
                old = work[old_at : old_at + numel * isz].view(as_int).view(new.shape)
                self._pairs.append((new, old))
            self._key = key
        return self._pairs

    def compare(
        self, work: torch.Tensor, scratch: torch.Tensor | None, update: bool, count: bool = False
    ):
        pairs = self._views(work, scratch)
        mask = None
        if count or not update:
            mask = torch.empty(int(self.starts[-1]), dtype=torch.bool, device=self.device)
            for (new, old), start in zip(pairs, self.starts[:-1].tolist(), strict=True):
                if new.numel():
                    torch.ne(new, old, out=mask[start : start + new.numel()].view(new.shape))
        if update:
            for new, old in pairs:
                old.copy_(new)
        return mask

    def counts(self, mask) -> tuple[np.ndarray, object]:
        pos = mask.nonzero().view(-1)  # waits for the compare
        bounds = torch.searchsorted(pos, self._starts).cpu().numpy()
        return np.diff(bounds), (pos, bounds, mask)

    def emit(self, state, work, scratch, plan: np.ndarray, store, changed: int = 0) -> None:
        pos, bounds, mask = state
        pairs = self._views(work, scratch)
        starts = self.starts.tolist()
        for k, (kind, at, vat, ix) in enumerate(plan.tolist()):
            new, old = pairs[k]
            b0, b1 = int(bounds[k]), int(bounds[k + 1])
            if kind == _DENSE_FRAME and new.numel():
                store[at : at + new.numel() * new.element_size()].view(new.dtype).view(
                    new.shape
                ).copy_(new)
            if kind == _MASK_FRAME:
                _pack_mask(mask[starts[k] : starts[k + 1]], store[at:vat])
            elif kind != _SPARSE_FRAME:
                if b1 > b0:
                    old.copy_(new)
                continue
            n = b1 - b0
            if not n:
                continue
            vals = store[vat : vat + n * new.element_size()].view(new.dtype)
            if kind == _MASK_FRAME:
                idx = pos[b0:b1] - starts[k]
            else:
                idx = store[at : at + n * ix].view(_INT_OF_SIZE[ix])
                torch.sub(pos[b0:b1], starts[k], out=idx)
            if new.is_contiguous():
                torch.index_select(new.view(-1), 0, idx, out=vals)
            else:
                torch.take(new, idx.to(torch.int64), out=vals)
            old.view(-1).index_put_((idx,), vals)


@dataclass(slots=True, kw_only=True)
class _Layout:
    """One window's routes and buckets as fixed at connect (found again if live views move)."""

    bks: Sequence[_Bucket]
    sources: list
    """What each bucket's routes were derived from: its live views' tuple, or None (filled)."""
    base: int
    end: int
    """The window's bytes in the shadow: ``shadow[base:end]``."""
    filled: list[tuple[_Bucket, int]]
    """Buckets whose new values are computed (FP8, casts): where each goes in the scratch."""
    scratch_bytes: int
    bucket: np.ndarray
    """Per route (the window's routes in order): its bucket's index in the window."""
    isz: np.ndarray
    numel: np.ndarray
    nbytes: np.ndarray
    mask_bytes: np.ndarray
    """Per route: the bytes of its masked frame's bitmask (:func:`mask_bytes`)."""
    index_size: np.ndarray
    """Per route: the bytes of each index of its sparse frame (4, or 8 from :data:`_WIDE`
    elements)."""
    mask_written: np.ndarray
    """Per route: the bytes of its masked frame's bitmask that the Triton emit pass writes
    whole (whole words, where the table stores them so: ``WindowTable.whole_words``); 0
    where it ORs bits into words that start at zero, or on the torch path (:meth:`_store`)."""
    meta_at: np.ndarray
    """Per bucket: where its header and directory start among the window's."""
    records: np.ndarray
    """Per route: its directory entry's index among the window's 16-byte records."""
    offset: np.ndarray
    """Per route: its offset in its bucket (the plan's layout, as a plain bucket sends it)."""
    groups: tuple[tuple[int, tuple[int, ...]], ...]
    """Per group of the window: its first bucket and its buckets' indices in the window."""
    group: np.ndarray
    """Per bucket: its group's index in the window."""
    bucket_bytes: np.ndarray
    """Per bucket: its bytes."""
    order: np.ndarray
    """The window's buckets (indices) as the shadow holds them: group by group."""
    template: bytes
    """Every bucket's header and directory, every route dense."""
    table: Any
    """The compare and emit passes over the window's routes: a Triton ``WindowTable`` or a
    :class:`_TorchWindow` (the same methods; only the Triton one's compare takes a stream)."""
    copies: tuple[tuple[int, torch.Tensor], ...] | None
    """With a Triton table, where every route's new values are live regions: the copies that
    bring the window's shadow up to date when it is sent dense (:func:`_byte_runs`); else
    None."""
    pieces: dict[int, _PieceSources | None]
    """With :attr:`DeltaConfig.pieces`, per group (its first bucket): where its pieces
    (:attr:`Group.pieces`) come from, where every route's new values are live regions; else
    None."""
    all_pieces: bool
    """Whether every group of the window has its piece sources (:attr:`pieces`): sent dense,
    it travels all as pieces from the live tensors."""


class _Window:
    """One window of the current sync, from its compare pass until its last bucket is packed."""

    __slots__ = (
        "dense", "encoded", "event", "guess", "launched", "lay", "meta", "pieces", "scratch",
        "spans", "state", "store", "work",
    )  # fmt: skip

    def __init__(self, lay: _Layout, work: torch.Tensor, dense: bool, guess: bool) -> None:
        self.lay, self.work, self.dense, self.guess = lay, work, dense, guess
        """``work``: the shadow's bytes of the window (the shadow itself, or a device copy of
        a host shadow's); ``dense``: every bucket goes to readers that get dense bytes;
        ``guess``: sent dense on a guess, its changes only counted."""
        self.launched = False
        """Whether its compare pass was launched (a dense window's directories may be laid
        out before)."""
        self.scratch: torch.Tensor | None = None
        """Computed buckets' new values (FP8, casts), alive until the shadow took them."""
        self.state: object = None
        """The compare pass's state, until the emit pass."""
        self.encoded: dict[int, tuple[int, int, int | None]] = {}
        """Per bucket: (meta offset, used bytes, store offset of its frames or None: sent
        whole, from the shadow)."""
        self.store: torch.Tensor | None = None
        """The second messages of the window's groups that have framed buckets, as they go on
        the wire (their plain buckets too, whole)."""
        self.spans: dict[int, tuple[int, int] | None] = {}
        """Per group (its first bucket): its second message's bytes in :attr:`store`, or None
        when all its buckets are plain (it is sent from :attr:`work`)."""
        self.meta: torch.Tensor | None = None
        """Every bucket's header and directory (pinned on CUDA, copied without waiting)."""
        self.event: torch.cuda.Event | None = None
        """Recorded after its compare pass where that ran on the encoder's own stream, until
        the current stream waited for it."""
        self.pieces: set[int] = set()
        """Its groups (first buckets) sent as pieces (``FLAG_PIECES``): from the live
        tensors, so their sends need not wait for the pass that updates the shadow."""


class DeltaEncoder:
    """A writer's shadow and its bucket encoder (see the module docstring for the format).

    ``fill`` and ``views`` give the new wire values (:data:`Fill`, :data:`Views`). Each sync:
    :meth:`begin` with the policy's decision, :meth:`encode` every bucket in program order
    (the first bucket of a window analyzes the whole window), :meth:`end`. ``impl``: "auto"
    (Triton kernels for CUDA tensors, torch ops otherwise), "torch", or "triton".
    """

    def __init__(
        self,
        ops: Sequence[BucketOp],
        config: DeltaConfig,
        *,
        fill: Fill,
        views: Views | None = None,
        device: torch.device | str = "cpu",
        name: str = "writer",
        impl: str = "auto",
    ) -> None:
        self.config = config
        self.name = name
        self.device = torch.device(device)
        self._kernels = _kernels(impl, self.device, name)
        self._fill = fill
        self._views = views if views is not None else (lambda op: None)
        index = window_index([op.nbytes for op in ops], config.window_bytes)
        by_window: list[list[BucketOp]] = []
        for op, w in zip(ops, index, strict=True):
            if w == len(by_window):
                by_window.append([])
            by_window[-1].append(op)
        # a window's buckets to one reader travel together (a group, keyed by its first
        # bucket); the shadow holds each group's buckets one after the other, as the group's
        # second message lays out plain buckets, so a group of plain buckets is sent straight
        # from the shadow
        self._buckets: dict[int, _Bucket] = {}
        self._groups: dict[int, list[BucketOp]] = {}
        total = 0
        for win_ops in by_window:
            groups: dict[int, list[BucketOp]] = {}
            for op in win_ops:
                groups.setdefault(op.peer, []).append(op)
            for members in groups.values():
                self._groups[members[0].bucket] = members
                for op in members:
                    self._buckets[op.bucket] = _Bucket(op, total)
                    total += group_aligned(op.nbytes)
        # analyzed windows_per_pass windows at a time, but the first alone (its compare pass
        # precedes the first byte sent): from here on a "window" is such a pass
        n = len(by_window)
        cuts = [0, *range(1, n, config.windows_per_pass)] if n else []
        passes = [sum(by_window[a:b], []) for a, b in zip(cuts, [*cuts[1:], n], strict=True)]
        self._windows = tuple(tuple(self._buckets[op.bucket] for op in w) for w in passes)
        self._window_of = {op.bucket: w for w, win in enumerate(passes) for op in win}
        self._group = {b: Group.of(members) for b, members in self._groups.items()}
        """The groups, as both sides describe them (first bucket -> :class:`Group`)."""
        self._next = next_groups(self._groups)
        self._ahead: set[int] = set()
        """This sync's groups whose directories say that the next group's go before their
        buckets (:meth:`ahead`)."""
        self._directories: dict[int, torch.Tensor] = {}
        host = config.shadow == "host" or self.device.type == "cpu"
        pin = host and self.device.type == "cuda" and torch.cuda.is_available()
        self.shadow = torch.zeros(
            total, dtype=torch.uint8, device="cpu" if host else self.device, pin_memory=pin
        )
        """The bytes last sent, per bucket in the plan's layout (padding stays zero)."""
        self._local = self.shadow.device.type == self.device.type
        cuda = self.device.type == "cuda" and self._kernels is not None
        self._side = torch.cuda.Stream(self.device) if cuda else None
        """On CUDA, the compare passes' stream, so that a window's compare pass may run
        beside the previous window's emit pass (one is bound by memory, the other by
        compute). On an H200 with 1 GiB windows they hardly overlap: the compare grid fills
        the GPU."""
        self._emit_stream = (
            torch.cuda.Stream(self.device, priority=EMIT_PRIORITY)
            if cuda and EMIT_PRIORITY
            else None
        )
        """On CUDA with :data:`EMIT_PRIORITY`: the emit passes' stream (:meth:`_emitting`)."""
        self._layouts: list[_Layout | None] = [None] * len(self._windows)
        for w in range(len(self._windows)):
            self._layout_of(w).table.warm()  # the tables and their kernels, at connect
        # each group sent as pieces stages those that are not live bytes in a room of its own
        # (norms, biases, strided regions), while they take at most PIECES_AREA_BYTES in all:
        # such a group then needs no staging buffer
        need = {
            first: src.staged
            for lay in self._layouts
            if lay is not None
            for first, src in lay.pieces.items()
            if src is not None
        }
        total = sum(need.values())
        self._rooms: dict[int, tuple[int, int]] = {}
        if config.pieces and self._local and total <= PIECES_AREA_BYTES:
            at = 0
            for first, n in need.items():
                self._rooms[first] = (at, n)
                at += n
        self.pieces_area = torch.empty(
            total if self._rooms else 0, dtype=torch.uint8, device=self.device
        )
        """Where groups sent as pieces without a staging buffer stage the pieces that are not
        live bytes (each group its room); sends read it."""
        self._decision: DeltaDecision | None = None
        self._dense: set[int] = set()
        """Windows every route of which went dense in the last sync: the next sync sends them
        dense without waiting for their counts or an emit pass; their compare pass (on the
        Triton path a compare of a sample of their tiles, before they are copied: :meth:`_copy`)
        still counts, so a window that would go sparse again leaves the set (and costs one
        dense sync more)."""
        self._tally: dict[int, tuple[object, bool]] = {}
        """This sync's counts of the windows sent dense that way, read at :meth:`end`."""
        self._open: dict[int, _Window] = {}
        """Windows compared ahead, or analyzed with buckets not packed yet."""
        self._later: dict[int, _Window] = {}
        """Windows whose copies into the shadow wait until their sends are posted
        (:meth:`_deferred`)."""
        self._stale: set[int] = set()
        """Windows sent as pieces on a guess whose shadow holds the bytes last sent only in
        their sample's tiles (:meth:`_copy`): sent dense and copied whole before any compare
        reads it (:meth:`_goes_dense`)."""
        self._done: set[int] = set()
        self._in_pieces: set[int] = set()
        """This sync's buckets sent as pieces (:meth:`sent_live`)."""
        self._announced = False
        """Whether this sync's begin announced every group as pieces (:meth:`announce`)."""
        self._early: set[int] = set()
        """This sync's groups (first buckets) whose pieces went before their window was
        analyzed (:meth:`announced_pieces`)."""
        self._poison_stores = False
        """Tests: fill each window's store with a byte other than zero before its zeros and
        frames are written (:meth:`_store`)."""
        self.sends_stores = False
        """Whether a group's frames leave from the store its window's emit pass wrote them
        into (allocated each sync), not from a copy of them in the staging buffer that
        :meth:`encode_group` takes: where the transport sends from any memory of its device
        and holds what it sends until it is done (NCCL, gloo). Set by the writer once its
        transport is known. On two H200s at 50% changed with masked frames, the copies took
        0.4 ms per pass of two 1 GiB windows on the stream the passes run on, each before
        its send. The writer still takes a staging buffer for such a group (so as many are
        in flight as before), and each store now lives until its sends are done: GPU memory
        for as many stores as staging buffers, besides the buffers themselves."""

    def shadow_of(self, op: BucketOp) -> torch.Tensor:
        base = self._buckets[op.bucket].base
        return self.shadow[base : base + op.nbytes]

    def announce(self) -> bool:
        """Whether the sync about to begin sends every group as pieces, its directories
        after them, whatever its decision says (dense readers, a checksum):
        :attr:`DeltaConfig.announce` and pieces are on, the shadow is on this device, every
        window goes dense for sure (sent dense on a guess, or stale: :meth:`_goes_dense`),
        every group's routes are live regions and its staged pieces fit its room. The
        writer says so in its begin message and passes it to :meth:`begin`; readers may then
        post every receive of its groups at once, in the order it sends them. Once it said
        yes, :meth:`announced_pieces` may give groups' pieces before :meth:`begin` (they do
        not depend on what the readers hold)."""
        self._announced = False
        if not (self.config.announce and self.config.pieces and self._local):
            return False
        for w in range(len(self._windows)):
            if w not in self._dense and w not in self._stale:
                return False
            lay = self._layout_of(w)
            if not lay.all_pieces:
                return False
            for first, src in lay.pieces.items():
                assert src is not None  # (all_pieces)
                if not self._fits(first, src):
                    return False
        self._announced = True
        return True

    def begin(self, decision: DeltaDecision, *, announced: bool = False) -> None:
        """Start a sync: what to send dense, the versions, whether to checksum; ``announced``:
        what :meth:`announce` said, and the writer told its readers (groups whose pieces went
        since stay sent: :meth:`announced_pieces`)."""
        if self._early and not announced:
            raise RuntimeError(f"{self.name}: pieces went before a sync that is not announced")
        self._decision = decision
        self._announced = announced
        self._open.clear()
        self._later.clear()
        self._done.clear()
        self._in_pieces.clear()
        self._directories.clear()
        self._ahead.clear()

    def end(self) -> None:
        """The sync is over (packed or abandoned): drop the windows' scratch."""
        for w in list(self._later):
            self._launch_later(w)  # (none should be left: every group was queued)
        if self._side is not None:
            # what the current stream does next comes after any compare pass still running
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        for w, (state, sampled) in self._tally.items():
            lay = self._layouts[w]
            assert lay is not None
            counts, _ = lay.table.counts(state)
            if sampled:  # the sampled tiles' count, scaled to the whole route
                counts = counts * lay.numel // np.maximum(lay.table.sampled, 1)
            if (self._choose(lay, counts) != DENSE).any():
                self._dense.discard(w)  # some route would have gone sparse: compare next time
        self._tally.clear()
        self._decision = None
        self._announced = False
        self._open.clear()
        self._done.clear()
        self._in_pieces.clear()
        self._early.clear()
        self._directories.clear()
        self._ahead.clear()

    @torch.no_grad()
    def encode(self, op: BucketOp, buf: torch.Tensor) -> int:
        """Encode bucket ``op`` into ``buf`` (uint8, at least :func:`capacity` bytes: its
        directory, then its frames), update the shadow; return the bytes to send."""
        bk, enc, win = self._take(op)
        m_at, used, _ = enc
        self._emit(bk, enc, win, buf[bk.head :])
        assert win.meta is not None  # (laid out when the window was analyzed)
        buf[: bk.head].copy_(win.meta[m_at : m_at + bk.head], non_blocking=True)
        return used

    def group(self, op: BucketOp) -> Group | None:
        """When bucket ``op`` is the first of its window's buckets to its reader: their
        :class:`Group` (they travel together, :meth:`encode_group`); else None."""
        return self._group.get(op.bucket)

    def unstaged(self, op: BucketOp) -> bool:
        """Whether the group bucket ``op`` starts travels in this sync as pieces that need no
        staging buffer (:meth:`encode_group` with ``buf`` None): its pieces that are not live
        bytes fit in its room of :attr:`pieces_area`. Analyzes its window first (a window
        sent dense needs no wait for the device), as :meth:`prepare` would. A writer that
        takes a staging buffer for every group sends only as many groups ahead as it has
        buffers; pieces leave from the live tensors, and on two GPUs at 50% changed the link
        sat idle while the host issued the next pass's copies and posted its sends."""
        if self._decision is None or op.bucket not in self._rooms:
            return False  # (without pieces, or rooms, no group is: nothing analyzed here)
        w = self._window_of[op.bucket]
        win = self._open.get(w)
        if (win is None or win.meta is None) and not self._goes_dense(w, self._decision)[0]:
            # its analysis waits for the device: not before a buffer is needed (should it go
            # as pieces after all, they are staged in that buffer)
            return False
        win = self._ready(w, self._decision)
        src = win.lay.pieces.get(op.bucket)
        return (
            op.bucket in win.pieces and src is not None and self._room(op.bucket, src) is not None
        )

    def _fits(self, first: int, src: _PieceSources) -> bool:
        """Whether the group bucket ``first`` starts has a room its staged pieces fit."""
        return src.staged <= self._rooms.get(first, (0, -1))[1]

    def _room(self, first: int, src: _PieceSources) -> torch.Tensor | None:
        """The room of the group bucket ``first`` starts for its staged pieces in
        :attr:`pieces_area`, where they fit."""
        if not self._fits(first, src):
            return None
        at = self._rooms[first][0]
        return self.pieces_area[at : at + src.staged]

    @torch.no_grad()
    def announced_pieces(self, op: BucketOp) -> list[tuple[int, torch.Tensor]]:
        """In a sync announced as pieces (:meth:`announce`, even before :meth:`begin`): the
        pieces of the group bucket ``op`` starts, as :meth:`encode_group` gives them, from
        the window's layout alone (the live tensors, and its room for the staged ones, copied
        there on the current stream), so that they leave before the window is analyzed;
        :meth:`encode_group` then gives only the group's directories. Each stays untouched
        until the sync ends."""
        group = self.group(op)
        src = (
            None
            if group is None
            else self._layout_of(self._window_of[op.bucket]).pieces.get(op.bucket)
        )
        room = None if src is None else self._room(op.bucket, src)
        if not self._announced or group is None or src is None or room is None:
            raise RuntimeError(
                f"{self.name}: bucket {op.bucket} does not start a group of a sync announced "
                "as pieces"
            )
        self._early.add(op.bucket)
        return self._pieces(group, src, room)

    @staticmethod
    def _pieces(
        group: Group, src: _PieceSources, room: torch.Tensor
    ) -> list[tuple[int, torch.Tensor]]:
        """The pieces of ``group``: live bytes, or staged in ``room`` (copied now)."""
        out = []
        for j, piece in enumerate(group.pieces):
            live = src.live[j]
            if live is None:
                live = room[src.at[j] : src.at[j] + piece.nbytes]
                _copy_runs(live, src.runs[j])
            out.append((j, live))
        return out

    def sent_live(self, op: BucketOp) -> bool:
        """Whether bucket ``op`` went out in this sync as part of a group's pieces: its wire
        values are the live regions' (the shadow's copy of them may still be in progress)."""
        return op.bucket in self._in_pieces

    @property
    def sends_shadow(self) -> bool:
        """Whether :meth:`encode_group` may return bytes of :attr:`shadow` to send (a shadow
        on the writer's device), which the transport should then register."""
        return self._local

    @torch.no_grad()
    def encode_group(
        self, op: BucketOp, buf: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """Encode the group that bucket ``op`` starts (:meth:`group`), laid out as
        :func:`group_layout` says; return its directories (a host tensor, pinned on CUDA: the
        message a reader takes first) and the messages that follow them, each (its piece's
        index in :attr:`Group.pieces`, or -1 for the group's one second message; its bytes).
        That second message is bytes of ``buf`` (at least its :attr:`Group.capacity`), of
        the shadow when every bucket of the group is sent whole, or of the window's store
        with :attr:`sends_stores` (then nothing is copied); none when nothing changed. A
        group of plain buckets whose routes are all live regions travels as its pieces
        instead (``FLAG_PIECES``): live bytes, or staged ones, in ``buf`` or, where ``buf``
        is None (:meth:`unstaged`), in a room of the group's own. Each stays untouched
        until the sync ends. A group whose pieces went already (:meth:`announced_pieces`)
        gets its directories alone."""
        group = self.group(op)
        if group is None:
            raise RuntimeError(f"{self.name}: bucket {op.bucket} does not start a group")
        w = self._window_of[op.bucket]
        pieces = self._decision is not None and op.bucket in self._ready(w, self._decision).pieces
        taken = [self._take(m, settle=not pieces) for m in group.ops]
        directories = self._directories.pop(op.bucket)
        win = taken[0][2]
        span = win.spans.pop(op.bucket)
        if pieces:
            # from the live tensors: the copies into the shadow run beside these sends
            self._in_pieces.update(m.bucket for m in group.ops)
            if op.bucket in self._early:
                return directories, []  # (its pieces went before this analysis)
            src = win.lay.pieces[op.bucket]
            assert src is not None  # (as _analyze checked)
            room = self._room(op.bucket, src) if buf is None else buf
            if room is None:
                raise RuntimeError(f"{self.name}: group {op.bucket} needs a buffer (unstaged)")
            return directories, self._pieces(group, src, room)
        if buf is None:
            raise RuntimeError(f"{self.name}: group {op.bucket} needs a buffer (unstaged)")
        if span is None:  # every bucket plain: their bytes as the shadow holds them
            first, last = taken[0][0], taken[-1][0]
            o = first.base - win.lay.base
            whole = win.work[o : last.base - win.lay.base + last.op.nbytes]
            if self._local:
                return directories, [(-1, whole)]
            n = whole.numel()
            buf[:n].copy_(whole)  # a host shadow's device copy: dropped with its window
            return directories, [(-1, buf[:n])]
        n = span[1] - span[0]
        if not n:
            return directories, []  # nothing changed: no frames, no second message
        assert win.store is not None
        frames = win.store[span[0] : span[1]]
        if self.sends_stores:
            return directories, [(-1, frames)]  # (the send holds the store until it is done)
        buf[:n].copy_(frames)
        return directories, [(-1, buf[:n])]

    def prepare(self, op: BucketOp) -> None:
        """Analyze the window of bucket ``op`` now, unless done: its frames and the shadow
        are then computed on the device while the caller waits for a buffer to
        :meth:`encode` into (which then only copies). The current stream does not wait for
        the window's pass here: groups sent as pieces never do."""
        if self._decision is not None and op.bucket not in self._done:
            self._ready(self._window_of[op.bucket], self._decision)

    def ahead(self, op: BucketOp) -> tuple[BucketOp, torch.Tensor] | None:
        """When the directories of the group bucket ``op`` starts (encoded) carry
        ``FLAG_AHEAD``: the next group to its reader (its first bucket) and that group's
        directories, which go on the wire before this group's buckets; else None."""
        if op.bucket not in self._ahead:
            return None
        assert self._decision is not None
        first = self._next[op.bucket]
        w = self._window_of[first]
        win = self._open.get(w)
        if win is None:
            win = self._open[w] = self._open_window(w, self._decision)
        if win.meta is None:
            self._analyze(w, win, self._decision)  # a dense window: no wait for the device
        return self._groups[first][0], self._directories[first]

    def queued(self, op: BucketOp) -> None:
        """The group bucket ``op`` starts was handed to the transport: where the next pass
        goes dense and is copied into the shadow (:meth:`_copy`), start its copies now, if
        nothing did. A pass analyzed from its counts starts the next one's compare pass
        itself; after a pass sent dense the next would start only when the writer took its
        first buffer, once an older send was over, and its sends come from the shadow its
        copies write. A compare pass is not started here: its grid, queued before this
        pass's sends started, would hold them back."""
        if self._decision is None or self._side is None:
            return
        w = self._window_of[op.bucket]
        self._launch_later(w)  # (its sends are posted: its copies now run beside them)
        nxt = w + 1
        if nxt == len(self._windows) or self._windows[nxt][0].op.bucket in self._done:
            return
        if self._layout_of(nxt).copies is None or not self._goes_dense(nxt, self._decision)[0]:
            return
        if self._deferred(nxt, self._decision):
            return  # (its copies wait for its own sends)
        win = self._open.get(nxt)
        if win is None:
            self._open[nxt] = self._compare(nxt, self._decision)
        elif not win.launched:
            self._launch(nxt, win)  # (opened for its directories, which went ahead)

    def _goes_ahead(self, first: int, w: int, decision: DeltaDecision) -> bool:
        """Whether the next group after group ``first`` (of window ``w``) has its directories
        ready by the time this group's buckets leave without waiting for the device: it is
        analyzed with this one, or its window goes dense (its directories follow from the
        plan; its compare pass only brings the shadow up to date, and runs once the window's
        buckets are packed). In a sync announced as pieces (:meth:`announce`), never: each
        group's directories follow its pieces, and the readers posted every receive."""
        nxt = self._next.get(first)
        if nxt is None or self._announced:
            return False
        w2 = self._window_of[nxt]
        if w2 == w:
            return True
        if not self._local or decision.checksum:
            return False  # (the window's analysis would read the shadow: wait for its pass)
        win = self._open.get(w2)
        if win is not None:
            return win.meta is not None or win.dense
        return self._goes_dense(w2, decision)[0]

    def _goes_dense(self, w: int, decision: DeltaDecision) -> tuple[bool, bool]:
        """Whether window ``w`` is sent dense this sync, and whether only on a guess: every
        route of it went dense last time (then its changes are still counted). A window whose
        shadow holds only its sample's tiles (:meth:`_copy`) is sent dense, not on a guess,
        once more: copied whole, before it is compared."""
        dense = all(bk.op.peer in decision.dense for bk in self._windows[w])
        guess = not dense and w in self._dense
        # a window whose shadow holds only its sample's tiles (see _copy) goes dense once
        # more, copied whole, before it is compared again
        refresh = not dense and not guess and w in self._stale
        return dense or guess or refresh, guess

    def _ready(self, w: int, decision: DeltaDecision) -> _Window:
        """Window ``w``, compared (or its pass launched) and analyzed."""
        win = self._open.get(w)
        if win is None:
            win = self._open[w] = self._open_window(w, decision)
        if not win.launched:
            if self._deferred(w, decision):
                self._later[w] = win  # launched once its first group's sends are posted
            else:
                with mark("launch"):
                    self._launch(w, win)
        if win.meta is None:
            with mark("analyze"):
                self._analyze(w, win, decision)
        return win

    def _deferred(self, w: int, decision: DeltaDecision) -> bool:
        """Whether window ``w``'s copies into the shadow wait until one of its groups was
        handed to the transport (:meth:`queued`): every group of it travels as pieces from
        the live tensors (sent dense, pieces on, the shadow on this device, no checksum read
        from it), so its sends need no copy, and the copies (a host call each, some 40 a pass
        on Llama-3-8B) would only hold the sends back. A profile on two H200s at 50% changed
        had the link idle about 2 ms before each pass's sends while the host issued them."""
        if not (self.config.pieces and self._local and self._side is not None):
            return False
        lay = self._layout_of(w)
        return (
            not decision.checksum
            and lay.copies is not None
            and self._goes_dense(w, decision)[0]
            and lay.all_pieces
        )

    def _launch_later(self, w: int) -> None:
        """Launch window ``w``'s copies if they waited for its sends (:meth:`_deferred`)."""
        win = self._later.pop(w, None)
        if win is not None:
            self._launch(w, win)

    def _settle(self, win: _Window) -> None:
        """What the current stream does next comes after the window's pass (a dense window
        analyzed before it ran, or without waiting for it): the sends of its shadow."""
        if win.event is not None:
            torch.cuda.current_stream(self.device).wait_event(win.event)
            win.event = None
            win.scratch = win.state = None

    # -- a window's routes, fixed at connect --------------------------------------------------

    def _layout_of(self, w: int) -> _Layout:
        """Window ``w``'s routes and tables, derived again when the live views changed."""
        bks = self._windows[w]
        sources = [self._views(bk.op) for bk in bks]
        lay = self._layouts[w]
        if lay is not None and all(a is b for a, b in zip(lay.sources, sources, strict=True)):
            return lay
        # the window's bytes in the shadow: its groups one after the other
        base = min(bk.base for bk in bks)
        routes, filled, scratch = [], [], 0
        for bk, views in zip(bks, sources, strict=True):
            if views is None:
                filled.append((bk, scratch))
            for i, c in enumerate(bk.op.copies):
                width = _itemsize(c.dtype)
                new = None if views is None else views[i]
                at = bk.base - base + c.offset
                routes.append((new, c.shape, width, c.nbytes // width, scratch + c.offset, at))
            if views is None:
                scratch += -(-bk.op.nbytes // 256) * 256
        per_bucket = [len(bk.op.copies) for bk in bks]
        where = {bk.op.bucket: i for i, bk in enumerate(bks)}
        groups = tuple(
            (bk.op.bucket, tuple(where[m.bucket] for m in self._groups[bk.op.bucket]))
            for bk in bks
            if bk.op.bucket in self._groups
        )
        group = np.zeros(len(bks), np.int64)
        for g, (_, members) in enumerate(groups):
            group[list(members)] = g
        cut = np.cumsum([0, *per_bucket]).tolist()
        pieces = {
            first: _piece_sources(
                self._group[first], [routes[cut[b] : cut[b + 1]] for b in members]
            )
            for first, members in groups
            if self.config.pieces
        }
        isz = np.array([r[2] for r in routes], np.int64)
        numel = np.array([r[3] for r in routes], np.int64)
        heads = np.array([bk.head for bk in bks], np.int64)
        meta_at = np.cumsum(heads) - heads
        # each route's directory entry among the 16-byte records of the window's directories
        first = np.repeat(meta_at + _HEAD.size, per_bucket)
        within = np.concatenate([np.arange(n) for n in per_bucket])
        table = None
        if self._kernels is not None:
            try:
                table = self._kernels.WindowTable(routes, self.device, self._kernels.BLOCK)
            except ValueError as exc:
                logger.warning(
                    "%s: torch ops per route for buckets %d to %d: %s",
                    self.name,
                    bks[0].op.bucket,
                    bks[-1].op.bucket,
                    exc,
                )
        lay = self._layouts[w] = _Layout(
            bks=bks,
            sources=sources,
            base=base,
            end=max(bk.base + bk.op.nbytes for bk in bks),
            filled=filled,
            scratch_bytes=scratch,
            bucket=np.repeat(np.arange(len(bks)), per_bucket),
            isz=isz,
            numel=numel,
            nbytes=isz * numel,
            mask_bytes=mask_bytes(numel),
            index_size=np.where(numel < _WIDE, 4, 8),
            mask_written=(
                np.where(table.whole_words, 4 * -(-numel // 32), 0)
                if table is not None
                else np.zeros(len(numel), np.int64)
            ),
            meta_at=meta_at,
            records=(first + _ENT.size * within) // _ENT.size,
            offset=np.array([c.offset for bk in bks for c in bk.op.copies], np.int64),
            groups=groups,
            group=group,
            bucket_bytes=np.array([bk.op.nbytes for bk in bks], np.int64),
            order=np.argsort([bk.base for bk in bks], kind="stable"),
            template=b"".join(bk.template for bk in bks),
            table=table if table is not None else _TorchWindow(routes, self.device),
            copies=_byte_runs(routes) if table is not None else None,
            pieces=pieces,
            all_pieces=bool(pieces) and all(src is not None for src in pieces.values()),
        )
        return lay

    # -- analysis of a window: compare, count, decide, update the shadow ----------------------

    def _work(self, lay: _Layout) -> torch.Tensor:
        if self._local:
            return self.shadow[lay.base : lay.end]
        work = torch.empty(lay.end - lay.base, dtype=torch.uint8, device=self.device)
        return work.copy_(self.shadow[lay.base : lay.end], non_blocking=True)

    def _open_window(self, w: int, decision: DeltaDecision) -> _Window:
        """Window ``w`` of this sync, not compared yet; a window whose readers all get dense
        bytes will only bring the shadow up to date."""
        lay = self._layout_of(w)
        dense, guess = self._goes_dense(w, decision)
        return _Window(lay, self._work(lay), dense, guess)

    def _compare(self, w: int, decision: DeltaDecision) -> _Window:
        """Window ``w``, opened and its compare pass launched."""
        win = self._open_window(w, decision)
        self._launch(w, win)
        return win

    def _launch(self, w: int, win: _Window) -> None:
        """Fill the window's computed buckets and launch its compare pass (no waiting)."""
        lay = win.lay
        guess = win.guess
        win.launched = True
        if lay.scratch_bytes:
            win.scratch = torch.empty(lay.scratch_bytes, dtype=torch.uint8, device=self.device)
            for bk, at in lay.filled:
                self._fill(bk.op, win.scratch[at : at + bk.op.nbytes])
        side = None if isinstance(lay.table, _TorchWindow) else self._side
        if win.dense and lay.copies is not None and side is not None:
            self._copy(w, win)
            return
        if side is None:
            win.state = lay.table.compare(win.work, win.scratch, win.dense, count=guess)
        else:
            # after everything queued so far (the weights' update, the fills), on its own
            # stream
            side.wait_stream(torch.cuda.current_stream(self.device))
            win.state = lay.table.compare(
                win.work, win.scratch, win.dense, stream=side, count=guess
            )
            win.event = torch.cuda.Event()
            win.event.record(side)
        if guess:
            self._tally[w] = (win.state, False)

    def _copy(self, w: int, win: _Window) -> None:
        """Bring the shadow of window ``w``, sent dense, up to date by copies of the live bytes
        on the encoder's stream, after, where it was sent dense on a guess, a compare pass over
        a sample of its tiles, whose counts tell whether it goes dense again (:meth:`end`).
        A window sent as pieces on a guess (:meth:`_deferred`) is not copied: the sample
        brought its tiles up to date, and the window is *stale* (``_stale``) until a sync
        sends it dense, not on a guess, and copies it whole (:meth:`_goes_dense`).

        A compare pass fills the GPU, and held back the sends queued behind it: NCCL's kernel
        for the next message started only once the pass's last tiles had, and the sends of a
        window sent dense come from the shadow the pass writes. A profile of S7 at 50% changed
        on two H100s had the link idle 0.4 to 1.6 ms before most messages. Copies of
        contiguous bytes run on the copy engines and leave the SMs to NCCL; the sample reads a
        16th of the window (``SAMPLE`` of the kernels' module). S7 at 50% on two H100s: 53.9
        and 53.5 ms against 56.2 and 57.0 for the compare passes (one machine, one after the
        other); on two H200s 50.8 and 48.6 against 48.2, no gain shown there."""
        side, copies = self._side, win.lay.copies
        assert side is not None and copies is not None  # (as _launch checked)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            if win.guess:
                # before the copies: it compares with the bytes sent last time (and brings
                # its tiles of the shadow up to date)
                win.state = win.lay.table.sample(win.work, stream=side)
                self._tally[w] = (win.state, True)
            decision = self._decision
            if win.guess and decision is not None and self._deferred(w, decision):
                # sent from the live tensors, and compared only on the sample's tiles while
                # it goes dense on a guess: the rest of the shadow is copied once it stops
                # (_goes_dense), not in every such sync. The copies, 16 GB read and written
                # beside the sends for Llama-3-8B, slowed NCCL's kernels: on two H100s, at
                # 50% changed, syncs took 55.5-56.0 ms with them and 49.0 without
                self._stale.add(w)
            else:
                _copy_runs(win.work, copies)
                self._stale.discard(w)
        win.event = torch.cuda.Event()
        win.event.record(side)

    def _analyze(self, w: int, win: _Window, decision: DeltaDecision) -> None:
        """Count each route's changed elements (the window's wait for the device), decide
        sparse or dense, lay out the frames, write them and update the shadow (on the GPU
        its compare pass did); meanwhile the next window's compare pass runs on the device."""
        lay = win.lay
        # a dense window's directories need no counts: its pass is waited for once its
        # buckets are packed (:meth:`_ready`), not before this one's are sent
        defer = win.dense and self._local and not decision.checksum
        if not win.dense:
            self._compare_ahead(w, decision)
        if win.event is not None and not defer:
            torch.cuda.current_stream(self.device).wait_event(win.event)
            win.event = None
        counts = np.zeros(len(lay.numel), np.int64)
        if not win.dense:
            counts, win.state = lay.table.counts(win.state)
        dense_peer = np.array([bk.op.peer in decision.dense for bk in lay.bks], bool)
        if win.dense:
            kind = np.full(len(lay.numel), DENSE, np.int64)
        else:
            kind = np.where(dense_peer[lay.bucket], DENSE, self._choose(lay, counts))
            if len(kind) and (kind == DENSE).all() and not dense_peer.any():
                self._dense.add(w)  # every route went dense: so will the next sync, likely
            else:
                self._dense.discard(w)
        with self._emitting(not win.dense):
            plan = self._plan(win, decision, counts, kind)
            if not win.dense:
                lay.table.emit(win.state, win.work, win.scratch, plan, win.store, int(counts.sum()))
        if not self._local:
            # a host shadow: take the window's new bytes back before anything reads them
            self.shadow[lay.base : lay.end].copy_(win.work)
        if win.event is None:  # (else the compare pass may still read them)
            win.scratch = win.state = None
        assert win.meta is not None
        meta = win.meta.numpy()
        if decision.checksum:
            # every bucket's checksum now: the directories leave with the window's first
            for b, bk in enumerate(lay.bks):
                m_at = int(lay.meta_at[b])
                sums = np.array([checksum(self.shadow_of(bk.op))], "<u8").view(np.uint8)
                meta[m_at + _HEAD.size - 8 : m_at + _HEAD.size] = sums
        for first, members in lay.groups:
            parts = [meta[lay.meta_at[i] : lay.meta_at[i] + lay.bks[i].head] for i in members]
            joined = np.concatenate(parts)
            flags = joined[8:12].view("<u4")  # the first header's
            if self._goes_ahead(first, w, decision):
                self._ahead.add(first)
                flags[0] |= FLAG_AHEAD
            if self._local and lay.pieces.get(first) is not None and win.spans[first] is None:
                # every bucket plain and every route live: sent from the live tensors
                win.pieces.add(first)
                flags[0] |= FLAG_PIECES
            elif self._announced:  # (announce() checked what makes a group pieces)
                raise RuntimeError(
                    f"{self.name}: the group of bucket {first} was announced as pieces, but "
                    "its window is not sent dense from live regions"
                )
            group = torch.from_numpy(joined)
            self._directories[first] = group.pin_memory() if self.device.type == "cuda" else group

    def _compare_ahead(self, w: int, decision: DeltaDecision) -> None:
        """Before the host waits for the counts of window ``w`` (analyzed from them), queue
        the compare passes of the next windows, up to :attr:`DeltaConfig.compare_ahead`, so
        that the device runs them back to back while the host lays out frames, launches
        emit passes and posts sends. The next window's pass is always queued (it then runs
        beside this one's emit pass); those after it only on the Triton path with the
        shadow on the device, while they go sparse (a pass sent dense brings the shadow up
        to date once its sends are queued: :meth:`queued`) and need no scratch. After a
        window sent dense (no emit pass), none is: a compare grid queued before its sends
        would hold them back until its last tiles started (measured on two GPUs at 50%
        changed, the first send waited for two passes)."""
        far = self.config.compare_ahead if self._kernels is not None and self._local else 1
        for k in range(w + 1, min(w + 1 + far, len(self._windows))):
            if self._windows[k][0].op.bucket in self._done:
                return
            if k > w + 1:
                if self._goes_dense(k, decision)[0] or self._layout_of(k).scratch_bytes:
                    return
            if k not in self._open:
                self._open[k] = self._compare(k, decision)
            elif not self._open[k].launched:
                return  # (opened for directories that went ahead: launched by its turn)

    @contextlib.contextmanager
    def _emitting(self, on: bool):
        """Where ``on`` and :data:`EMIT_PRIORITY` is set: what is queued inside (the window's
        store, its zeros and its emit pass) goes on the encoder's stream of that priority,
        after what the current stream holds, and the current stream waits for it. Compare
        passes queued ahead (:meth:`_compare_ahead`) fill the GPU; an emit pass queued
        behind them on a stream of the same priority started only once their last tiles
        had (a profile on two H100s: the first window's emit pass after the next two
        compare passes). The store is allocated on that stream, and the memory it frees goes
        back to it: whatever the current stream queued on a store before it was dropped (its
        frames' copies into staging) comes before the stream's next use of that memory, as
        every section begins with the wait for the current stream."""
        e = self._emit_stream
        if not on or e is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        e.wait_stream(current)
        try:
            with torch.cuda.stream(e):
                yield
        finally:
            # (also on an error: what it allocated may be freed and taken again at once)
            current.wait_stream(e)

    def _choose(self, lay: _Layout, counts: np.ndarray) -> np.ndarray:
        """Per route: its frame's kind (DENSE, SPARSE or MASKED), the smallest on the wire
        (sparse where it ties with masked)."""
        m, isz = lay.numel, lay.isz
        size = _aligned(_aligned(counts * lay.index_size) + counts * isz)
        kind = np.full(len(m), SPARSE, np.int64)
        if self.config.masks:
            masked = _aligned(lay.mask_bytes + counts * isz)
            kind = np.where(masked < size, MASKED, SPARSE)
            size = np.minimum(size, masked)
        ok = size < _aligned(m * isz)
        f = self.config.max_changed_fraction
        if f is not None:
            ok &= counts <= f * m
        return np.where(ok, kind, DENSE)

    def _plan(self, win: _Window, decision: DeltaDecision, counts, kind) -> np.ndarray:
        """Each bucket's frames (``kind`` per route, :meth:`_choose`), directory and place in
        the window's store; returns the emit pass's plan: per route (kind, frame offset in
        the store, values offset, index size)."""
        lay = win.lay
        nb = len(lay.bks)
        sparse, masked = kind == SPARSE, kind == MASKED
        delta = sparse | masked
        ix = np.where(sparse, lay.index_size, 0)
        # a delta frame: its indices or its bitmask, then its values
        index_bytes = np.where(masked, lay.mask_bytes, _aligned(counts * ix))
        size = np.where(delta, index_bytes + counts * lay.isz, lay.nbytes)
        framed = np.bincount(lay.bucket, weights=delta, minlength=nb) > 0
        in_frames = framed[lay.bucket]
        # within a framed bucket: dense routes first, then delta ones, each in route order
        order = np.lexsort((np.arange(len(delta)), delta, lay.bucket))
        step = np.where(in_frames, _aligned(size), 0)[order]
        at = np.cumsum(step) - step
        opens = np.searchsorted(lay.bucket[order], np.arange(nb))  # each bucket's first
        start = np.zeros(len(delta), np.int64)
        start[order] = at - at[np.minimum(opens, len(at) - 1)][lay.bucket[order]]
        body = np.zeros(nb, np.int64)  # bytes after the directory
        np.maximum.at(body, lay.bucket, np.where(in_frames, start + size, 0))
        # the store holds the second message of every group with a framed bucket, its plain
        # buckets whole (written by the emit pass as dense frames at their routes' offsets),
        # so that the message leaves in one copy; groups of plain buckets only stay out
        stored = (np.bincount(lay.group, weights=framed) > 0)[lay.group]
        whole = stored & ~framed
        body = np.where(whole, lay.bucket_bytes, body)
        room = np.where(stored, group_aligned(body), 0)[lay.order]
        store_at = np.zeros(nb, np.int64)
        store_at[lay.order] = np.cumsum(room) - room
        in_whole = whole[lay.bucket]
        frame = store_at[lay.bucket] + np.where(in_whole, lay.offset, start)
        plan = np.zeros((len(delta), 4), np.int64)
        dense = np.where(in_frames | in_whole, _DENSE_FRAME, _KEEP)
        plan[:, 0] = np.where(sparse, _SPARSE_FRAME, np.where(masked, _MASK_FRAME, dense))
        plan[:, 1] = frame
        plan[:, 2] = frame + index_bytes
        plan[:, 3] = ix
        # directories: the template (every route dense), then the delta entries and headers
        meta = bytearray(lay.template)
        if delta.any():
            ent = np.frombuffer(meta, dtype=_ENT_FIELDS)
            rec = lay.records[delta]
            ent["kind"][rec] = kind[delta]
            ent["ix"][rec] = ix[delta]
            ent["unit"][rec] = lay.isz[delta]
            ent["count"][rec] = counts[delta]
        flags = FLAG_CHECKSUM if decision.checksum else 0
        for b, bk in enumerate(lay.bks):
            op, head, m_at = bk.op, bk.head, int(lay.meta_at[b])
            if framed[b]:
                base = decision.base[op.peer]
                used = head + int(body[b])
                _HEAD.pack_into(
                    meta, m_at, MAGIC, len(op.copies), flags, 0, used, decision.version,
                    -1 if base is None else base, 0,
                )  # fmt: skip
            else:
                used = head + op.nbytes
                _HEAD.pack_into(
                    meta, m_at, MAGIC, len(op.copies), flags | FLAG_PLAIN, 0, used,
                    decision.version, -1, 0,
                )  # fmt: skip
            win.encoded[op.bucket] = (m_at, used, int(store_at[b]) if stored[b] else None)
        for first, members in lay.groups:
            b, last = members[0], members[-1]
            span = (int(store_at[b]), int(store_at[last] + body[last]))
            win.spans[first] = span if stored[b] else None
        host = torch.frombuffer(meta, dtype=torch.uint8)
        win.meta = host.pin_memory() if self.device.type == "cuda" else host.clone()
        total = int(room.sum())
        if total:
            win.store = self._store(lay, total, plan, counts)
        return plan

    def _store(self, lay: _Layout, total: int, plan: np.ndarray, counts) -> torch.Tensor:
        """A window's store of ``total`` bytes for its emit pass (``plan``, :meth:`_plan`),
        whose bytes that pass does not write are zeros: the padding between frames goes on
        the wire too, the same every time, and a masked frame whose bits are ORed in
        (rows of a length not a multiple of 32) starts from zeros. On the Triton path only
        those bytes are zeroed, in one launch: at 50% changed with masked frames, zeroing
        the whole store took 0.25 ms per pass of two 1 GiB windows on two H200s, on the
        stream the passes run on."""
        table = lay.table
        if isinstance(table, _TorchWindow):
            return torch.zeros(total, dtype=torch.uint8, device=self.device)
        store = torch.empty(total, dtype=torch.uint8, device=self.device)
        if self._poison_stores:
            store.fill_(0xA5)  # (tests: a byte neither written nor zeroed shows)
        kind, frame, values, ix = plan.T
        delta = (kind == _SPARSE_FRAME) | (kind == _MASK_FRAME)
        # what the emit pass writes of each route's frame: a dense frame whole; a delta
        # frame's indices, or its bitmask where stored as whole words; its values
        head = np.select(
            [kind == _DENSE_FRAME, kind == _SPARSE_FRAME, kind == _MASK_FRAME],
            [lay.nbytes, counts * ix, lay.mask_written],
            0,
        )
        starts = np.concatenate([frame, values[delta]])
        ends = np.concatenate([frame + head, values[delta] + counts[delta] * lay.isz[delta]])
        keep = (ends > starts) & np.concatenate([kind != _KEEP, np.ones(delta.sum(), bool)])
        order = np.argsort(starts[keep], kind="stable")
        s, e = starts[keep][order], ends[keep][order]
        # the gaps between them (were two to overlap, zeroing some of one before the emit
        # pass writes it would do no harm)
        table.zero(store, np.concatenate([[0], e]), np.concatenate([s, [total]]))
        return store

    # -- packing one bucket: copies only -------------------------------------------------------

    def _take(self, op: BucketOp, settle: bool = True) -> tuple[_Bucket, tuple, _Window]:
        """Bucket ``op``'s window, analyzed (with ``settle``, the current stream after its
        pass), and its place in it (once per bucket and sync)."""
        if self._decision is None:
            raise RuntimeError(f"{self.name}: DeltaEncoder.begin(decision) before encode")
        if op.bucket in self._done:
            raise RuntimeError(f"{self.name}: bucket {op.bucket} was encoded twice in one sync")
        self._done.add(op.bucket)
        w = self._window_of[op.bucket]
        win = self._ready(w, self._decision)
        if settle:
            self._launch_later(w)  # (sent from the shadow after all: copied first)
            self._settle(win)
        enc = win.encoded.pop(op.bucket)
        if not win.encoded:
            del self._open[w]
        return self._buckets[op.bucket], enc, win

    def _emit(self, bk: _Bucket, enc: tuple, win: _Window, out: torch.Tensor) -> int:
        """Copy bucket ``bk``'s frames to the start of ``out``; return their bytes."""
        op, head = bk.op, bk.head
        _, used, at = enc
        if at is None:
            o = bk.base - win.lay.base
            out[: op.nbytes].copy_(win.work[o : o + op.nbytes])
        elif used > head:
            assert win.store is not None
            out[: used - head].copy_(win.store[at : at + used - head])
        return used - head


# ---------------------------------------------------------------------------------------------
# reader: apply buckets in place
# ---------------------------------------------------------------------------------------------


def _byte_runs(routes: Sequence[tuple]) -> tuple[tuple[int, torch.Tensor], ...] | None:
    """A window's routes (as :meth:`DeltaEncoder._layout_of` lists them) as copies into its
    shadow: (offset in the window's shadow bytes, the new values: contiguous live bytes as
    uint8, routes that follow each other in the shadow and in one storage merged, or a
    strided live region); None where some route's new values are computed (scratch)."""
    out: list = []  # offset, then bytes, storage, its byte offset; or a strided region
    for new, _, width, numel, _, at in routes:
        if new is None:
            return None
        n = width * numel
        if not n:
            continue
        if not new.is_contiguous():
            out.append((at, new))
            continue
        storage = new.untyped_storage()
        lo = new.storage_offset() * new.element_size()
        last = out[-1] if out and isinstance(out[-1], list) else None
        if (
            last is not None
            and last[0] + last[1] == at
            and last[2].data_ptr() == storage.data_ptr()
            and last[3] + last[1] == lo
        ):
            last[1] += n
        else:
            out.append([at, n, storage, lo])
    runs = []
    for run in out:
        if isinstance(run, list):
            at, n, storage, lo = run
            src = torch.empty(0, dtype=torch.uint8, device=storage.device)
            runs.append((at, src.set_(storage, lo, (n,), (1,))))
        else:
            runs.append(run)
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class _PieceSources:
    """Where a group's pieces come from on the writer (:func:`_piece_sources`)."""

    live: tuple[torch.Tensor | None, ...]
    """Per piece: its live bytes where they lie contiguous, as one byte run; else None (it
    is staged)."""
    runs: tuple[tuple, ...]
    """Per piece: the copies that stage it (:func:`_byte_runs`, offsets from its start)."""
    at: tuple[int, ...]
    """Per piece: where it is staged (staged pieces one after the other, 16-byte aligned)."""
    staged: int
    """The bytes its staged pieces take."""


def _piece_sources(group: Group, routes: Sequence[Sequence[tuple]]) -> _PieceSources | None:
    """Where the pieces of ``group`` (:attr:`Group.pieces`) come from on the writer, its
    buckets' ``routes`` as :meth:`DeltaEncoder._layout_of` lists them; None where some
    route's new values are computed (they exist only once the window's pass wrote them)."""
    starts = group_layout([op.nbytes for op in group.ops])[0]
    live, all_runs, ats, staged = [], [], [], 0
    for piece in group.pieces:
        mine = []
        for k, i in piece.routes:
            new, shape, width, numel, _, _ = routes[k][i]
            if new is None:
                return None
            at = starts[k] + group.ops[k].copies[i].offset - piece.at
            mine.append((new, shape, width, numel, 0, at))
        runs = _byte_runs(mine)
        assert runs is not None  # (every route is live)
        src = runs[0][1] if len(runs) == 1 and runs[0][0] == 0 else None
        whole = src is not None and src.is_contiguous() and src.numel() == piece.nbytes
        live.append(src if whole else None)
        all_runs.append(runs)
        ats.append(staged)
        if not whole:
            # 16 bytes apart, as routes are at least in their buckets: the staged pieces take
            # no more than the group's plain layout (what a staging buffer holds)
            staged = _align(staged + piece.nbytes)
    return _PieceSources(tuple(live), tuple(all_runs), tuple(ats), staged)


def _copy_runs(work: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Copy :func:`_byte_runs`' ``runs`` into a window's shadow bytes ``work`` (on the current
    stream; byte runs by the copy engines, strided regions by a copy kernel)."""
    for at, src in runs:
        dst = work[at : at + src.numel() * src.element_size()]
        if not src.is_contiguous():
            dst = dst.view(src.dtype).view(src.shape)
        dst.copy_(src, non_blocking=True)


def _scatter(region: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``region.reshape(-1)[idx] = vals`` in place, for a strided ``region`` (a contiguous
    one takes ``region.view(-1).index_put_``)."""
    idx = idx.to(torch.int64)
    offs = torch.zeros_like(idx)
    rem = idx
    for n, s in zip(reversed(region.shape), reversed(region.stride()), strict=True):
        offs += (rem % n) * s
        rem = rem // n
    span = sum((n - 1) * s for n, s in zip(region.shape, region.stride(), strict=True)) + 1
    region.as_strided((span,), (1,))[offs] = vals


@dataclass(frozen=True, slots=True)
class _Span:
    """Buckets whose headers and directories arrive together (a window's group, or one
    bucket): where each header and entry lies in their bytes, and the routes' expected
    frames. Routes are numbered across the buckets, in order."""

    ops: tuple[BucketOp, ...]
    size: int
    """The bytes of their headers and directories."""
    heads: np.ndarray
    """Per bucket: the 16-byte row its header starts at (three rows each)."""
    head_bytes: np.ndarray
    """Per bucket: its header and directory's bytes."""
    nbytes_op: np.ndarray
    """Per bucket: its dense bytes."""
    starts: np.ndarray
    """Per bucket: its first route."""
    counts: np.ndarray
    """Per bucket: its routes."""
    entries: np.ndarray
    """Per route: the 16-byte row of its directory entry."""
    bucket: np.ndarray
    """Per route: its bucket (an index into ``ops``)."""
    row: np.ndarray
    """Per route: its row in the target table (the decoder's global route order)."""
    isz: np.ndarray
    nbytes: np.ndarray
    offset: np.ndarray
    """Per route: its byte offset in its bucket's plain layout."""
    unshifted: np.ndarray
    """Per route: 0, the shift of frames that lie at their places (no room: :class:`_Room`)."""

    @classmethod
    def of(cls, ops: Sequence[BucketOp], routes: Mapping[int, _Routes]) -> _Span:
        heads = np.array([directory_bytes(op) for op in ops], np.int64)
        at = np.cumsum(heads) - heads
        counts = np.array([len(op.copies) for op in ops], np.int64)
        assert counts.min() > 0, "a bucket carries at least one route"
        rows = [a // ALIGN + (_HEAD.size + _ENT.size * np.arange(n)) // ALIGN
                for a, n in zip(at.tolist(), counts.tolist(), strict=True)]  # fmt: skip
        st = [routes[op.bucket] for op in ops]
        return cls(
            ops=tuple(ops),
            size=int(heads.sum()),
            heads=at // ALIGN,
            head_bytes=heads,
            nbytes_op=np.array([op.nbytes for op in ops], np.int64),
            starts=np.cumsum(counts) - counts,
            counts=counts,
            entries=np.concatenate(rows),
            bucket=np.repeat(np.arange(len(ops)), counts),
            row=np.concatenate([s.first + np.arange(len(s.isz)) for s in st]),
            isz=np.concatenate([s.isz for s in st]),
            nbytes=np.concatenate([s.nbytes for s in st]),
            offset=np.concatenate([s.offset for s in st]),
            unshifted=np.zeros(int(counts.sum()), np.int64),
        )

    def routes_of(self, k: int) -> slice:
        """Bucket ``k``'s routes."""
        return slice(int(self.starts[k]), int(self.starts[k] + self.counts[k]))


@dataclass(slots=True)
class _Directories:
    """Received headers and directories of a :class:`_Span`, parsed: each bucket's header and
    where its frames lie."""

    span: _Span
    frames: np.ndarray
    """Per bucket: the bytes of its frames (the header's used bytes less the directory's)."""
    version: np.ndarray
    base: np.ndarray
    flags: np.ndarray
    checksum: np.ndarray
    sparse: np.ndarray
    """Per route: whether its frame is sparse (indices, then values)."""
    masked: np.ndarray
    """Per route: whether its frame is masked (a bitmask, then values); else (neither) dense."""
    offset: np.ndarray
    """Per route: its frame's byte offset from its bucket's first frame."""
    lead: np.ndarray
    """Per route: the bytes of its frame before its values (indices or bitmask; 0: dense)."""
    ix: np.ndarray
    unit: np.ndarray
    count: np.ndarray
    address: int = 0
    """The buffer the frames (will) land in (a later message there is another)."""
    at: tuple[int, ...] = ()
    """Per bucket: the byte its frames start at in that buffer."""
    room: _Room | None = None
    """Where that buffer is the group's room (:meth:`DeltaDecoder.room`): how its staged
    pieces lie there, one after the other, not at their places in the group's layout."""


@dataclass(frozen=True, slots=True)
class _Room:
    """Where a group sent as pieces lands its staged pieces on a reader (fixed at connect,
    :meth:`DeltaDecoder.expect`): ``nbytes`` of :attr:`DeltaDecoder.pieces_area` from ``at``."""

    at: int
    nbytes: int
    shift: np.ndarray
    """Per route of the group's span: how far its bytes lie in the room from their place in
    the group's layout (0 for those that land in place)."""
    pieces: tuple[int, ...]
    """Per piece: where it lies in the room (-1: it lands in place)."""
    buf: torch.Tensor | None = None
    """Its bytes of :attr:`DeltaDecoder.pieces_area` (cut once that is allocated)."""


@dataclass(frozen=True, slots=True)
class _Routes:
    """A reader's bucket as fixed at connect."""

    regions: tuple[torch.Tensor, ...]
    first: int
    """Its first route's index among all the reader's routes (the target table's rows)."""
    isz: np.ndarray
    nbytes: np.ndarray
    offset: np.ndarray


def _frames_of(
    parts: Sequence[tuple[BucketOp, int]], d: _Directories, select: np.ndarray
) -> list[tuple[int, int, int, int]]:
    """The frames of routes ``select`` marks (per route of ``d``'s span), each (its bucket's
    place in ``parts``, its route in the bucket, its row in the span, its byte in the
    buffer)."""
    out = []
    for k, (_, at) in enumerate(parts):
        mine = d.span.routes_of(k)
        for i in np.flatnonzero(select[mine]).tolist():
            out.append((k, i, mine.start + i, at + int(d.offset[mine.start + i])))
    return out


def _within(x: np.ndarray, starts: np.ndarray, bucket: np.ndarray) -> np.ndarray:
    """Per route, the sum of ``x`` over the routes before it in its bucket."""
    before = np.cumsum(x) - x
    return before - before[starts][bucket]


class DeltaDecoder:
    """A reader's side of the delta codec: applies encoded buckets to live tensors in place.

    The live regions of every bucket are taken once, at construction (on CUDA, with the
    Triton table of their addresses). The headers and directories of a window's group
    arrive together and are read at once (:meth:`take_group`, one device-to-host copy and a
    fixed number of numpy operations per group, whatever its number of buckets: read bucket
    by bucket they cost about a millisecond of host time per group of 7 buckets, measured on
    two GPUs, as much as the rest of a 1% delta sync); a bucket received alone is read from
    its buffer (:meth:`encoded_size`, :meth:`decode`). On CUDA a group (:meth:`decode_group`)
    costs one small host-to-device copy of its frames' places and one launch, no wait (on
    CPU, torch ops per route). ``impl`` as for :class:`DeltaEncoder`.
    """

    def __init__(
        self,
        ops: Sequence[BucketOp],
        tensors: Mapping[str, torch.Tensor],
        name: str = "reader",
        *,
        impl: str = "auto",
    ) -> None:
        self.name = name
        self.tensors = tensors
        self._routes: dict[int, _Routes] = {}
        regions: list[torch.Tensor] = []
        for op in ops:
            here = tuple(tensors[c.key][c.index] for c in op.copies)
            self._routes[op.bucket] = _Routes(
                regions=here,
                first=len(regions),
                isz=np.array([_itemsize(c.dtype) for c in op.copies], np.int64),
                nbytes=np.array([c.nbytes for c in op.copies], np.int64),
                offset=np.array([c.offset for c in op.copies], np.int64),
            )
            regions.extend(here)
        self._ops = list(ops)
        self._firsts = np.array([self._routes[op.bucket].first for op in ops], np.int64)
        devices = {r.device for r in regions}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        kernels = _kernels(impl, device, name)
        wire = [c.dtype for op in ops for c in op.copies]
        if any(r.dtype != d for r, d in zip(regions, wire, strict=True)):
            kernels = None  # frames land as raw bits: only torch ops cast a dense frame
        self._table = None
        if kernels is not None:
            try:
                self._table = kernels.TargetTable(regions, device, kernels.BLOCK)
                self._table.warm()  # its kernel's variants, compiled at connect
            except ValueError as exc:
                logger.warning("%s: torch ops per route to apply deltas: %s", name, exc)
        self._targets: dict[tuple[int, int, int], tuple] = {}
        self._spans: dict[tuple[int, ...], _Span] = {}
        self._landing: dict[tuple[int, ...], tuple] = {}
        """Per group of buckets (those expected at connect, :meth:`expect`, others once they
        come as pieces): its pieces, per piece the live bytes it lands in or None (staged),
        and per route of its span whether it lands in place."""
        self._rooms: dict[tuple[int, ...], _Room] = {}
        """Per group of buckets: its room in :attr:`pieces_area` (:meth:`expect`,
        :meth:`room`)."""
        self.pieces_area = torch.empty(0, dtype=torch.uint8)
        """Where groups that travel as pieces without a staging buffer land their staged
        pieces (each group its room); receives write it."""
        self._read: dict[int, _Directories] = {}
        """Directories taken, by their first bucket, until applied."""
        self._unchecked = False
        """Whether apply kernels ran since the last :meth:`check` (their faults unread)."""

    def _error(self, op: BucketOp, what: str) -> WeightbusError:
        tensors = ", ".join(sorted({c.tensor for c in op.copies})[:4])
        return WeightbusError(
            f"{self.name}: bucket {op.bucket} from writer {op.peer} ({tensors}): {what}"
        )

    def expect(self, groups: Iterable[Sequence[BucketOp]]) -> None:
        """The groups whose directories will arrive together (each a window's buckets from
        one writer): their spans are laid out now, at connect, not in the first sync (a
        bucket read alone gets its span when it first comes)."""
        spans = [self._span(ops) for ops in groups]
        # where each group's staged pieces land when it travels as pieces: a room of its own,
        # while they take at most PIECES_AREA_BYTES in all (then such a group takes no
        # staging buffer)
        rooms, total = {}, 0
        for span in spans:
            pieces, live, _ = self._landing_of(span)
            shift = np.zeros(len(span.row), np.int64)
            places, at = [], 0
            for p, v in zip(pieces, live, strict=True):
                places.append(-1 if v is not None else at)
                if v is None:
                    for k, i in p.routes:
                        shift[int(span.starts[k]) + i] = at - p.at
                    at = group_aligned(at + p.nbytes)  # (as aligned as in the layout)
            rooms[tuple(op.bucket for op in span.ops)] = _Room(total, at, shift, tuple(places))
            total += at
        if total > PIECES_AREA_BYTES:
            return
        device = self._table.device if self._table is not None else None
        if device is None:
            devices = {r.device for rt in self._routes.values() for r in rt.regions}
            device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self.pieces_area = area = torch.empty(total, dtype=torch.uint8, device=device)
        self._rooms = {
            key: dataclasses.replace(r, buf=area[r.at : r.at + r.nbytes])
            for key, r in rooms.items()
        }

    def room(self, ops: Sequence[BucketOp], raw: bytes) -> torch.Tensor | None:
        """Where the staged pieces of a group (``ops``) land, when its directories (``raw``)
        say it travels as pieces and it has a room of its own in :attr:`pieces_area` (set up
        by :meth:`expect`): then it needs no staging buffer, and a reader posts its receives
        as soon as it has its directories, not once an older group left a buffer (on two
        H200s at 50% changed, a reader with two buffers posted each group's pieces just in
        time and the link waited for it); else None."""
        if len(raw) < 12 or not struct.unpack_from("<I", raw, 8)[0] & FLAG_PIECES:
            return None
        return self.announced_room(ops)

    def announced_room(self, ops: Sequence[BucketOp]) -> torch.Tensor | None:
        """The room of the group ``ops`` (:meth:`room`), whatever its directories say: for a
        group its writer announced as pieces; None where it has none."""
        hit = self._rooms.get(tuple(op.bucket for op in ops))
        return None if hit is None else hit.buf

    def announced_pieces(
        self, ops: Sequence[BucketOp], buf: torch.Tensor, *, in_room: bool
    ) -> list[torch.Tensor]:
        """Where each piece of the group ``ops`` lands when it travels as pieces, with
        ``buf`` its room (:meth:`announced_room`, ``in_room``) or a staging buffer, from the
        plan alone: as :meth:`pieces` gives once its directories are taken into ``buf``."""
        places = self._rooms[tuple(op.bucket for op in ops)].pieces if in_room else None
        return self._lands(self._span(ops), buf, places)

    def check_announced(self, ops: Sequence[BucketOp], *, in_room: bool) -> None:
        """After :meth:`take_group` of a group whose writer announced every group as pieces
        (its receives posted before its directories were read, which follow its pieces):
        raise unless they say it travels as pieces, with no directories ahead of its
        buckets, and landed in its room where it was posted there (``in_room``)."""
        d = self._read.get(ops[0].bucket)
        if d is None:
            raise RuntimeError(
                f"{self.name}: the directories of bucket {ops[0].bucket} were not taken"
            )
        flags = int(d.flags[0])
        roomless = in_room and d.room is None
        if not flags & FLAG_PIECES or roomless or flags & FLAG_AHEAD:
            raise self._error(
                ops[0],
                f"its writer announced every group as pieces, its directories after them "
                f"and none ahead, but this group's first header has flags {flags:#x}"
                f"{' (not landed in its room)' if roomless else ''}: the two sides run "
                "different weightbus versions",
            )

    def _in_room(self, ops: Sequence[BucketOp], d: _Directories, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is the room (:meth:`room`) of the group ``d`` describes; keeps it."""
        room = self._rooms.get(tuple(op.bucket for op in ops)) if d.flags[0] & FLAG_PIECES else None
        if room is None or room.buf is None or room.buf.data_ptr() != buf.data_ptr():
            return False
        d.room = room
        return True

    def _span(self, ops: Sequence[BucketOp]) -> _Span:
        key = tuple(op.bucket for op in ops)
        span = self._spans.get(key)
        if span is None:
            span = self._spans[key] = _Span.of(ops, self._routes)
        return span

    def _parse(self, span: _Span, raw: bytes) -> _Directories:
        """The headers and directories of ``span``'s buckets from their ``raw`` bytes,
        checked (the caller places their frames: address and offsets)."""
        if len(raw) != span.size:
            raise self._error(
                span.ops[0],
                f"{len(span.ops)} directories of {len(raw)} bytes, expected {span.size}: the "
                "two sides run different weightbus versions or codecs",
            )
        rows = np.frombuffer(raw, np.uint8).reshape(-1, ALIGN)
        heads = rows[span.heads[:, None] + np.arange(_HEAD.size // ALIGN)]
        head = heads.reshape(len(span.ops), _HEAD.size).view(_HEAD_FIELDS)[:, 0]
        ent = rows[span.entries].view(_ENT_FIELDS)[:, 0]
        n = span.counts
        bad = np.flatnonzero((head["magic"] != MAGIC) | (head["frames"] != n))
        if len(bad):
            k = int(bad[0])
            raise self._error(
                span.ops[k],
                f"not a delta bucket of {n[k]} routes (magic {head['magic'][k]:#x}, "
                f"{head['frames'][k]} frames): both sides must enable the same codecs and run "
                "the same weightbus version",
            )
        plain = (head["flags"] & FLAG_PLAIN) != 0
        kind, isz, ix, unit = (ent[f].astype(np.int64) for f in ("kind", "isz", "ix", "unit"))
        count = ent["count"]  # uint64 from the wire: compared as such before any arithmetic
        want, nbytes = span.isz, span.nbytes
        per_unit = np.maximum(unit, 1)
        dense = (kind == DENSE) & (isz == want) & (count == (nbytes // want).astype(np.uint64))
        sparse = (
            (kind == SPARSE)
            & ~plain[span.bucket]
            & (isz == want)
            & ((ix == 4) | (ix == 8))
            & ((unit == 1) | (unit == 2) | (unit == 4) | (unit == 8))
            & (unit % want == 0)
            & (nbytes % per_unit == 0)
            & (count <= (nbytes // per_unit).astype(np.uint64))
        )
        masked = (
            (kind == MASKED)
            & ~plain[span.bucket]
            & (isz == want)
            & (ix == 0)
            & (unit == want)
            & (count <= (nbytes // want).astype(np.uint64))
        )
        bad = np.flatnonzero(~(dense | sparse | masked))
        if len(bad):
            i = int(bad[0])
            k = int(span.bucket[i])
            c = span.ops[k].copies[i - int(span.starts[k])]
            raise self._error(
                span.ops[k],
                f"frame of {c.tensor} is kind {kind[i]}, itemsize {isz[i]}, unit {unit[i]}, "
                f"index size {ix[i]}, count {count[i]}"
                f"{' in a plain bucket' if plain[k] else ''}; expected {c.dtype} of {c.nbytes} "
                "bytes",
            )
        count = count.astype(np.int64)
        step = np.where(dense, _aligned(nbytes), 0)
        first = np.add.reduceat(step, span.starts)  # per bucket: where its sparse frames start
        # a delta frame: its indices or its bitmask, then its values
        lead = np.where(sparse, _aligned(count * ix), 0)
        lead = np.where(masked, mask_bytes(nbytes // want), lead)
        frame = np.where(sparse | masked, lead + count * unit, 0)
        offset = np.where(
            dense,
            _within(step, span.starts, span.bucket),
            first[span.bucket] + _within(_aligned(frame), span.starts, span.bucket),
        )
        offset = np.where(plain[span.bucket], span.offset, offset)
        # a bucket's frames end with its last delta frame, or its dense ones
        end = np.maximum(
            first,
            np.maximum.reduceat(np.where(sparse | masked, offset + frame, 0), span.starts),
        )
        end = np.where(plain, span.nbytes_op, end)
        bad = np.flatnonzero(span.head_bytes + end != head["used"].astype(np.int64))
        if len(bad):
            k = int(bad[0])
            raise self._error(
                span.ops[k],
                f"frames end at byte {span.head_bytes[k] + end[k]}, the header says "
                f"{head['used'][k]}",
            )
        return _Directories(
            span,
            end,
            head["version"].astype(np.int64),
            head["base"].astype(np.int64),
            head["flags"].astype(np.int64),
            head["checksum"],
            sparse,
            masked,
            offset,
            lead,
            ix,
            unit,
            count,
        )

    def _keep(self, d: _Directories, buf: torch.Tensor, at: Sequence[int]) -> None:
        """Keep ``d`` for :meth:`decode_group`, its frames at ``at`` in ``buf``."""
        d.address, d.at = buf.data_ptr(), tuple(at)
        self._read[d.span.ops[0].bucket] = d

    def encoded_size(self, op: BucketOp, buf: torch.Tensor) -> int:
        """The bytes of bucket ``op`` encoded at the start of ``buf`` (its directory, then its
        frames), of which only the first :func:`directory_bytes` need to have arrived. The
        directory is kept for :meth:`decode`, so that the bucket costs one device-to-host
        copy in all."""
        span = self._span((op,))
        # bytes, a copy: on CPU .numpy() would share memory with buf, which is reused
        raw = buf[: span.size].cpu().numpy().tobytes()
        d = self._parse(span, raw)
        used = span.size + int(d.frames[0])
        if used > buf.numel():
            raise self._error(op, f"has {used} bytes, the buffer holds {buf.numel()}")
        self._keep(d, buf, [span.size])
        return used

    def take_group(
        self, ops: Sequence[BucketOp], raw: bytes, buf: torch.Tensor
    ) -> tuple[list[tuple[BucketOp, int]], int]:
        """The headers and directories of a window's group (``raw``, the group's first
        message), for its frames, which will land in ``buf`` (:func:`group_layout`): each
        bucket and the byte its frames start at, and the bytes of the group's second message.
        Kept for :meth:`decode_group`. Raises when the sizes do not add up."""
        span = self._span(ops)
        d = self._parse(span, raw)
        if d.flags[0] & FLAG_PIECES and not (d.flags & FLAG_PLAIN).all():
            k = int(np.flatnonzero((d.flags & FLAG_PLAIN) == 0)[0])
            raise self._error(
                ops[k],
                "has frames, but its group travels as pieces (only plain buckets do): the two "
                "sides run different weightbus versions",
            )
        at, total = group_layout(d.frames.tolist())
        # (in its room, its staged pieces lie one after the other)
        if not self._in_room(ops, d, buf) and total > buf.numel():
            raise self._error(
                ops[0],
                f"a group of {len(ops)} buckets has {total} bytes of frames, the buffer holds "
                f"{buf.numel()}: the two sides run different weightbus versions or codecs",
            )
        self._keep(d, buf, at)
        return list(zip(ops, at, strict=True)), total

    def pieces(self, ops: Sequence[BucketOp], buf: torch.Tensor) -> list[torch.Tensor] | None:
        """After :meth:`take_group`: when the group's directories say it travels as pieces
        (``FLAG_PIECES``, :func:`group_pieces`), where each piece lands: the live tensors'
        bytes where the piece is all of a region that is contiguous in the wire dtype (then
        nothing is copied), else its place in ``buf`` (:meth:`decode_group` copies it out);
        None when the group travels as one message."""
        d = self._read.get(ops[0].bucket)
        if d is None:
            raise RuntimeError(
                f"{self.name}: the directories of bucket {ops[0].bucket} were not taken"
            )
        if not d.flags[0] & FLAG_PIECES:
            return None
        return self._lands(d.span, buf, d.room.pieces if d.room is not None else None)

    def _lands(
        self, span: _Span, buf: torch.Tensor, places: Sequence[int] | None
    ) -> list[torch.Tensor]:
        """Where each piece of ``span``'s group lands: its live bytes, else ``buf`` at its
        place there (``places``, a room's; None: its place in the group's plain layout)."""
        pieces, live, _ = self._landing_of(span)
        at = [p.at for p in pieces] if places is None else places
        return [
            buf[a : a + p.nbytes] if v is None else v
            for p, v, a in zip(pieces, live, at, strict=True)
        ]

    def _landing_of(self, span: _Span) -> tuple:
        key = tuple(op.bucket for op in span.ops)
        hit = self._landing.get(key)
        if hit is not None:
            return hit
        pieces = group_pieces(span.ops)
        live: list[torch.Tensor | None] = []
        in_place = np.zeros(len(span.row), bool)
        for p in pieces:
            view = None
            if len(p.routes) == 1:
                k, i = p.routes[0]
                c = span.ops[k].copies[i]
                region = self._routes[span.ops[k].bucket].regions[i]
                if region.dtype == c.dtype and region.is_contiguous():
                    view = region.reshape(-1).view(torch.uint8)
                    in_place[int(span.starts[k]) + i] = True
            live.append(view)
        hit = self._landing[key] = (pieces, tuple(live), in_place)
        return hit

    def _target(self, op: BucketOp, i: int, unit: int) -> tuple:
        """Where route ``i``'s sparse values of ``unit`` bytes land: (flat view or None, unit
        view, elements per unit): its own units where its strides allow (flat when
        contiguous), else its elements (``ratio`` > 1: each unit's elements one by one)."""
        key = (op.bucket, i, unit)
        hit = self._targets.get(key)
        if hit is None:
            region = self._routes[op.bucket].regions[i]
            if region.dim() == 0:
                region = region.reshape(1)
            try:
                view, ratio = region.view(_INT_OF_SIZE[unit]), 1
            except RuntimeError:
                view, ratio = _bits(region), unit // region.element_size()
            flat = view.view(-1) if view.is_contiguous() else None
            hit = self._targets[key] = (flat, view, ratio)
        return hit

    @torch.no_grad()
    def decode(self, op: BucketOp, buf: torch.Tensor, *, version: int, held: int | None) -> None:
        """Apply the encoded bucket at the start of ``buf`` (uint8, :func:`capacity` bytes)
        to the live tensors; ``held`` is the version they hold before it."""
        head = directory_bytes(op)
        d = self._read.get(op.bucket)
        if d is None or d.address != buf.data_ptr() or d.at != (head,) or len(d.span.ops) != 1:
            self.encoded_size(op, buf)
        self.decode_group([(op, head)], buf, version=version, held=held)

    @torch.no_grad()
    def decode_group(
        self,
        parts: Sequence[tuple[BucketOp, int]],
        buf: torch.Tensor,
        *,
        version: int,
        held: int | None,
    ) -> None:
        """Apply the frames of buckets that lie in ``buf`` (uint8), each ``(op, offset)``
        starting at byte ``offset``, their directories taken before (:meth:`take_group`,
        or :meth:`encoded_size` for one bucket). On CUDA one launch (per element size and
        addressing mode) applies all of them."""
        first = parts[0][0]
        d = self._read.pop(first.bucket, None)
        if (
            d is None
            or d.address != buf.data_ptr()
            or tuple(at for _, at in parts) != d.at
            or [op.bucket for op, _ in parts] != [op.bucket for op in d.span.ops]
        ):
            raise RuntimeError(
                f"{self.name}: the directories of buckets {[op.bucket for op, _ in parts]} were "
                "not taken for their frames in this buffer (take_group or encoded_size first)"
            )
        span = d.span
        bad = np.flatnonzero(d.version != version)
        if len(bad):
            k = int(bad[0])
            raise self._error(span.ops[k], f"carries version {d.version[k]}, expected {version}")
        bad = np.flatnonzero((d.base >= 0) & (d.base != (-1 if held is None else held)))
        if len(bad):
            k = int(bad[0])
            raise self._error(
                span.ops[k],
                f"is a delta against version {d.base[k]}, but this reader holds {held}: the "
                "writer must send it dense (it does for a reader that missed a sync)",
            )
        # a group sent as pieces: those that landed in place are done
        skip = self._landing_of(span)[2] if d.flags[0] & FLAG_PIECES else None
        shift = d.room.shift if d.room is not None else span.unshifted
        if skip is not None and skip.all():
            pass  # every route landed in place: nothing to apply
        elif self._table is not None:
            self._apply(buf, d, skip, shift)
        else:
            changed = self._check_indices(parts, buf, d)
            for k, (op, at) in enumerate(parts):
                mine = span.routes_of(k)
                self._apply_torch(
                    op, buf, at + shift[mine], d, mine, changed,
                    None if skip is None else skip[mine],
                )  # fmt: skip
        for k in np.flatnonzero(d.flags & FLAG_CHECKSUM).tolist():
            op = span.ops[k]
            scratch = torch.zeros(op.nbytes, dtype=torch.uint8, device=buf.device)
            pack(op, self.tensors, scratch)
            got = checksum(scratch)
            if got != int(d.checksum[k]):
                raise self._error(
                    op,
                    f"checksum of the live tensors after version {version} is {got:#018x}, "
                    f"the writer's is {int(d.checksum[k]):#018x}: these tensors were changed "
                    "outside weightbus or a delta was lost; the next sync must be dense",
                )

    def _check_indices(
        self, parts: Sequence[tuple[BucketOp, int]], buf: torch.Tensor, d: _Directories
    ) -> dict[int, torch.Tensor]:
        """Raise, before anything is applied, for a sparse frame whose indices fall outside
        its route, or a masked frame whose bits do not number its values within its route
        (torch path; the apply kernels skip and count such elements instead, see
        :meth:`check`): with frames in host memory a numpy pass over their indices, ~4 bytes
        per changed element; on a GPU two reductions per frame and one wait per group, where
        an index out of range would otherwise stop the device. Returns the masked frames'
        changed elements (:meth:`_check_masks`)."""
        changed = self._check_masks(parts, buf, d)
        frames = [
            (k, i, j, off, off + int(d.count[j]) * int(d.ix[j]))
            for k, i, j, off in _frames_of(parts, d, d.sparse & (d.count > 0))
        ]
        if not frames:
            return changed
        if buf.device.type == "cpu":
            host = buf.numpy()  # the same bytes (numpy: no torch op per frame)
            ints = [host[a:b].view("<i4" if d.ix[j] == 4 else "<i8") for _, _, j, a, b in frames]
            ends = np.array([(x.min(), x.max()) for x in ints], np.int64)
        else:
            idx = [buf[a:b].view(_INT_OF_SIZE[int(d.ix[j])]).long() for _, _, j, a, b in frames]
            ends = torch.stack([torch.stack(torch.aminmax(x)) for x in idx]).cpu().numpy()
        units = np.array([d.span.nbytes[j] // d.unit[j] for _, _, j, _, _ in frames], np.int64)
        bad = np.flatnonzero((ends[:, 0] < 0) | (ends[:, 1] >= units))
        if len(bad):
            f = int(bad[0])
            k, i, j = frames[f][:3]
            lo, hi = (int(x) for x in ends[f])
            op = parts[k][0]
            raise self._error(
                op,
                f"sparse frame of {op.copies[i].tensor} has index {lo if lo < 0 else hi} for "
                f"{int(units[f])} units of {int(d.unit[j])} bytes in its route: the frame was "
                "damaged in transit or the two sides disagree on the plan; nothing of this "
                "group was applied",
            )
        return changed

    def _check_masks(
        self, parts: Sequence[tuple[BucketOp, int]], buf: torch.Tensor, d: _Directories
    ) -> dict[int, torch.Tensor]:
        """Raise, before anything is applied, for a masked frame whose bitmask sets another
        number of bits than its count of values, or bits past its route's elements; else
        return, per masked route (its row in the span), its changed elements' flat indices
        (read once: :meth:`_apply_torch` scatters its values there)."""
        frames = [
            (k, i, j, off, off + int(d.lead[j])) for k, i, j, off in _frames_of(parts, d, d.masked)
        ]
        if not frames:
            return {}
        numel = [int(d.span.nbytes[j] // d.span.isz[j]) for _, _, j, _, _ in frames]
        if buf.device.type == "cpu":
            host = buf.numpy()  # the same bytes (numpy: no torch op per frame)
            bits = [np.unpackbits(host[a:b], bitorder="little") for _, _, _, a, b in frames]
            sums = np.array([(x.sum(), x[n:].sum()) for x, n in zip(bits, numel, strict=True)])
            changed = [
                torch.from_numpy(np.flatnonzero(x[:n])) for x, n in zip(bits, numel, strict=True)
            ]
        else:
            on = [_unpack_mask(buf[a:b]) for _, _, _, a, b in frames]
            sums = torch.stack(
                [torch.stack([x.sum(), x[n:].sum()]) for x, n in zip(on, numel, strict=True)]
            ).cpu().numpy()  # fmt: skip
            changed = [x[:n].nonzero().view(-1) for x, n in zip(on, numel, strict=True)]
        want = np.array([d.count[j] for _, _, j, _, _ in frames], np.int64)
        bad = np.flatnonzero((sums[:, 0] != want) | (sums[:, 1] != 0))
        if len(bad):
            f = int(bad[0])
            k, i = frames[f][:2]
            op = parts[k][0]
            raise self._error(
                op,
                f"masked frame of {op.copies[i].tensor} sets {int(sums[f, 0])} bits "
                f"({int(sums[f, 1])} past its {numel[f]} elements) for {int(want[f])} values: "
                "the frame was damaged in transit or the two sides disagree on the plan; "
                "nothing of this group was applied",
            )
        return {j: x for (_, _, j, _, _), x in zip(frames, changed, strict=True)}

    def ahead(self, op: BucketOp) -> bool:
        """Whether the directories taken for the group bucket ``op`` starts say that the next
        group's directories come before this group's buckets (``FLAG_AHEAD``)."""
        d = self._read.get(op.bucket)
        if d is None:
            raise RuntimeError(f"{self.name}: the directories of bucket {op.bucket} were not taken")
        return bool(d.flags[0] & FLAG_AHEAD)

    def begin(self) -> None:
        """A sync starts: elements refused in an earlier sync (one that failed before its
        :meth:`check`) are not this one's."""
        if self._unchecked:
            assert self._table is not None  # (only its launches leave elements unchecked)
            self._table.clear_faults()
            self._unchecked = False

    def check(self) -> None:
        """Raise if the apply kernel refused elements of this sync's sparse frames (indices
        outside their routes: damaged frames) once the launches queued on the current stream
        ran; a reader calls it once per sync, before acknowledging. The rest of the sync
        was applied: the live tensors hold part of it, and the next sync must be dense."""
        if not self._unchecked:
            return  # nothing launched since the last check
        self._unchecked = False
        assert self._table is not None
        count, route = self._table.faults()
        if not count:
            return
        k = int(np.searchsorted(self._firsts, route, side="right")) - 1
        op = self._ops[k]
        tensor = op.copies[route - self._firsts[k]].tensor
        raise self._error(
            op,
            f"{count} elements of delta frames (of {tensor} among others) had indices outside "
            "their routes, or bits that did not number their values, and were not written: "
            "frames were damaged in transit or the two "
            "sides disagree on the plan; the live tensors hold part of this sync, the next "
            "one must be dense",
        )

    def _apply(
        self,
        buf: torch.Tensor,
        d: _Directories,
        skip: np.ndarray | None,
        shift: np.ndarray,
    ) -> None:
        """Every frame of the buckets (but the routes ``skip`` marks) in one launch (per
        element size and addressing mode); ``shift``: per route, how far its frame lies from
        its place (in a room, :class:`_Room`; else 0)."""
        assert self._table is not None
        self._unchecked = True  # the launch's faults: read by check()
        span, sp, mk = d.span, d.sparse, d.masked
        frame = np.array(d.at, np.int64)[span.bucket] + shift + d.offset
        ratio = np.where(sp, d.unit // span.isz, 1)
        numel = span.nbytes // span.isz
        nelem = np.where(sp, d.count * ratio, numel)
        if skip is not None:
            nelem = np.where(skip, 0, nelem)
        self._table.apply(
            buf,
            route=span.row,
            values=frame + d.lead,
            nelem=np.where(mk, 0, nelem),
            index=np.where(sp, frame, 0),
            ix=np.where(sp, d.ix, 0),
            lr=(ratio > 1).astype(np.int64) + (ratio > 2) + (ratio > 4),
        )
        if mk.any():
            keep = mk & (nelem > 0)
            self._table.apply_masked(
                buf,
                route=span.row[keep],
                bits=frame[keep],
                values=(frame + d.lead)[keep],
                numel=numel[keep],
                count=d.count[keep],
            )

    def _apply_torch(
        self,
        op: BucketOp,
        buf: torch.Tensor,
        base: np.ndarray,
        d: _Directories,
        mine: slice,
        changed: Mapping[int, torch.Tensor],
        skip: np.ndarray | None = None,
    ) -> None:
        """Bucket ``op``'s frames (its routes ``mine`` of the span), route ``i``'s at byte
        ``base[i]`` of ``buf`` plus its offset (the bucket's start, shifted in a room), but
        the routes ``skip`` marks; ``changed``: per masked route (row in the span), its
        changed elements (:meth:`_check_masks`)."""
        regions = self._routes[op.bucket].regions
        sparse, masked, offset, lead, count, ix, unit = (
            a[mine] for a in (d.sparse, d.masked, d.offset, d.lead, d.count, d.ix, d.unit)
        )
        for i, c in enumerate(op.copies):
            if skip is not None and skip[i]:
                continue  # (landed in place)
            off = int(base[i]) + int(offset[i])
            if not (sparse[i] or masked[i]):
                regions[i].copy_(buf[off : off + c.nbytes].view(c.dtype).view(c.shape))
                continue
            n, size, width = int(count[i]), int(ix[i]), int(unit[i])
            if not n:
                continue
            v = off + int(lead[i])
            vals = buf[v : v + n * width].view(_INT_OF_SIZE[width])
            if masked[i]:
                idx = changed[mine.start + i].to(buf.device)
            else:
                idx = buf[off : off + n * size].view(_INT_OF_SIZE[size])
            flat, view, ratio = self._target(op, i, width)
            if ratio > 1:
                step = torch.arange(ratio, dtype=torch.int64, device=idx.device)
                idx = (idx.to(torch.int64)[:, None] * ratio + step).view(-1)
                vals = vals.view(view.dtype)
            if flat is not None:
                flat.index_put_((idx,), vals)
            else:
                _scatter(view, idx, vals)
