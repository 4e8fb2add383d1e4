"""Sparse deltas on the wire: send only the words that changed since the last sync, bit exact.

The writer keeps the bytes it last sent on every route (its *shadow*: the dense bucket bytes,
in the plan's bucket layout, on the writer's device or in pinned host memory). A sync compares
each route's new wire values with the shadow by their raw bits, so the comparison is exact:
NaNs compare equal to themselves, ``-0.0`` and ``0.0`` differ, and any dtype works.

The comparison runs in *units*: 8-byte words where the route's region allows it (its rows
are 8-byte aligned runs, as in any contiguous tensor), else 4- or 2-byte words, else single
elements. A unit travels whole when any of its bytes changed. Words keep the compare pass
close to one read of the new and the previous bytes (the mask of changed units is an eighth
of it), at the price of sending up to a word per changed element. Units are numbered flat
and row-major within the route's canonical box, so deltas follow the routes through any
resharding.

The writer works on *windows* of consecutive buckets (about :attr:`DeltaConfig.window_bytes`
each): one compare pass over every route of the window into one mask, one ``nonzero`` over
it, the per-route counts of changed units split off with one ``searchsorted`` and read back
in one small copy; then, per route, sparse when its (indices, values) frame is smaller than
its dense bytes, dense otherwise, and the shadow takes the new values. So a sync costs the
host two waits per window, not per route, and packing a bucket only copies bytes.

Bucket wire format (little-endian, no pickle), one bucket = one byte buffer::

    header     48 bytes   magic "WBD2", frames, flags (1: checksum, 2: plain), reserved,
                          used bytes, version, base version (-1: no sparse frame), checksum
    directory  16 bytes per route, in the bucket's route order:
                          kind (1 dense, 2 sparse), itemsize, index size (0, 4, 8),
                          unit (bytes per sparse value), 0, count (elements, or units)
    frames     plain (every route dense): the plan's bucket bytes, at its route offsets;
               otherwise the dense routes' bytes, then the sparse routes' frames, each in
               route order at a 16-byte aligned offset; a sparse frame is its unit indices
               (count of them), padded to 16 bytes, then its unit values

The header and directory have a fixed size per bucket (:func:`directory_bytes`), so a transport
can receive them first and then exactly ``used - directory_bytes`` more bytes.

When the writer sends dense (:class:`DeltaPolicy`): the first sync (nothing sent before),
to a reader whose acknowledged version is not the one the shadow holds (it missed a sync or
joined late), after a failed sync, and on request. Every ``checksum_every`` syncs, and on
request, each bucket carries a checksum of its dense bytes and the reader verifies its live
regions against it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from weightbus.errors import WeightbusError
from weightbus.plan.program import BucketOp, Copy, pack

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
]

MAGIC = int.from_bytes(b"WBD2", "little")
DENSE, SPARSE = 1, 2
FLAG_CHECKSUM, FLAG_PLAIN = 1, 2
ALIGN = 16
# header: magic, frames, flags, reserved, used, version, base version, checksum
_HEAD = struct.Struct("<IIIIQqqQ")
# directory entry: kind, itemsize, index size, unit, reserved, count
_ENT = struct.Struct("<BBBBIQ")
assert _HEAD.size == 48 and _ENT.size == 16
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHADOWS = ("device", "host")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaConfig:
    """Sparse deltas on the wire (writer-side choices; both sides must enable it)."""

    max_changed_fraction: float | None = None
    """A route travels sparse only while at most this fraction of its units (8-byte words,
    or elements where its region has no aligned words) changed; None: whenever its sparse
    frame is smaller than its dense bytes (below 2/3 of its 8-byte words changed)."""
    checksum_every: int = 20
    """Every this many syncs the readers verify a checksum of every bucket; 0: only on request."""
    shadow: str = "device"
    """Where the writer keeps the bytes it last sent: "device" (with the weights) or "host"
    (pinned host memory, when the GPU has no room for a copy of the writer's share)."""
    window_bytes: int = 1 << 30
    """The writer compares this many bytes of buckets at once (at least one bucket): two host
    waits per window; its scratch (a byte per 8-byte word, the positions of changed words)
    grows with it."""

    def __post_init__(self) -> None:
        f = self.max_changed_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise ValueError(f"max_changed_fraction={f} must be in (0, 1], or None (automatic)")
        if self.checksum_every < 0:
            raise ValueError(f"checksum_every={self.checksum_every} must be >= 0 (0: on request)")
        if self.shadow not in _SHADOWS:
            raise ValueError(f"shadow={self.shadow!r} must be one of {_SHADOWS}")
        if self.window_bytes < 1:
            raise ValueError(
                f"window_bytes={self.window_bytes} must be >= 1 (e.g. 1 << 30; a window holds "
                "at least one bucket)"
            )


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same width (raw bits, for exact comparison)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _units(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The widest integer view of ``t`` (8, 4 or 2 bytes, else its own width) whose elements
    are whole runs of ``t``'s, in the same row-major order: (unit bytes, that view)."""
    if t.dim() == 0:
        t = t.reshape(1)
    isz = t.element_size()
    for unit in (8, 4, 2):
        if unit <= isz:
            break
        try:
            return unit, t.view(_INT_OF_SIZE[unit])
        except RuntimeError:
            continue
    return isz, _bits(t)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the device (pinned, async)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def directory_bytes(op: BucketOp) -> int:
    """Bytes of a bucket's header and directory: fixed per bucket, sent first."""
    return _align(_HEAD.size + _ENT.size * len(op.copies))


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
    """The largest encoded bucket (every route dense, plain or in frames), and room for the
    reader's checksum pass, which packs the bucket's dense bytes into the same buffer."""
    head = directory_bytes(op)
    return max(head + op.nbytes, head + sum(_align(c.nbytes) for c in op.copies), op.nbytes)


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


def _fill_unit(c: Copy) -> int:
    """The unit of a route compared from the plan's bucket layout (contiguous, aligned)."""
    isz = _itemsize(c.dtype)
    for unit in (8, 4, 2):
        if unit > isz and c.nbytes % unit == 0 and c.offset % unit == 0:
            return unit
    return isz


class _Bucket:
    """A writer's bucket, as far as fixed at connect."""

    __slots__ = ("base", "head", "op", "routes", "source", "template")

    def __init__(self, op: BucketOp, base: int) -> None:
        self.op, self.base = op, base
        self.head = directory_bytes(op)
        t = bytearray(self.head)
        _HEAD.pack_into(t, 0, MAGIC, len(op.copies), 0, 0, 0, 0, -1, 0)
        for i, c in enumerate(op.copies):
            isz = _itemsize(c.dtype)
            _ENT.pack_into(t, _HEAD.size + _ENT.size * i, DENSE, isz, 0, 0, 0, c.nbytes // isz)
        self.template = bytes(t)
        """Its header and directory with every route dense; a sync fills in the rest."""
        self.source: object = None
        """What ``routes`` were derived from: the live views' tuple, or the fill marker."""
        self.routes: list = []
        """Per route: (unit, new units or None (filled), their flat view or None, the
        shadow's units shaped like them or None (host shadow))."""


_FILLED = object()


class _Window:
    """One window of the current sync, from its compare pass until its last bucket is packed."""

    __slots__ = ("encoded", "mask", "meta", "scratch", "segs", "store", "work", "work_base")

    def __init__(self, work: torch.Tensor, work_base: int) -> None:
        self.work, self.work_base = work, work_base
        """The shadow's bytes the window compares with (the shadow itself, or a device copy
        of the window's part of a host shadow) and the shadow offset of ``work[0]``."""
        self.segs: list[tuple] = []
        """Compared routes: (bucket, route, unit, new units, their flat view or None, the
        shadow's units, start in the mask)."""
        self.mask: torch.Tensor | None = None
        """Per compared unit: whether it changed (until counted)."""
        self.scratch: list[torch.Tensor] = []
        """Filled buckets' new values, alive until the shadow took them."""
        self.encoded: dict[int, tuple] = {}
        """Per bucket: (meta offset, used, frames): ``frames`` None for a plain bucket, else
        (dense frames as (route, offset), (store offset, bucket offset, bytes) of the
        sparse frames); a plain bucket of a dense reader is filled at pack time."""
        self.store: torch.Tensor | None = None
        """The window's sparse frames, bucket after bucket, as they go on the wire."""
        self.meta: torch.Tensor | None = None
        """Every bucket's header and directory (pinned on CUDA, copied without waiting)."""


class DeltaEncoder:
    """A writer's shadow and its bucket encoder (see the module docstring for the format).

    ``fill`` and ``views`` give the new wire values (:data:`Fill`, :data:`Views`). Each sync:
    :meth:`begin` with the policy's decision, :meth:`encode` every bucket in program order
    (the first bucket of a window analyzes the whole window), :meth:`end`.
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
    ) -> None:
        self.config = config
        self.name = name
        self.device = torch.device(device)
        self._fill = fill
        self._views = views if views is not None else (lambda op: None)
        self._buckets: dict[int, _Bucket] = {}
        windows: list[list[_Bucket]] = []
        total = size = 0
        for op in ops:
            self._buckets[op.bucket] = bk = _Bucket(op, total)
            total += -(-op.nbytes // 256) * 256
            if not windows or size + op.nbytes > config.window_bytes:
                windows.append([])
                size = 0
            windows[-1].append(bk)
            size += op.nbytes
        self._windows = tuple(tuple(w) for w in windows)
        self._window_of = {bk.op.bucket: w for w, win in enumerate(windows) for bk in win}
        host = config.shadow == "host" or self.device.type == "cpu"
        pin = host and self.device.type == "cuda" and torch.cuda.is_available()
        self.shadow = torch.zeros(
            total, dtype=torch.uint8, device="cpu" if host else self.device, pin_memory=pin
        )
        """The bytes last sent, per bucket in the plan's layout (padding stays zero)."""
        self._local = self.shadow.device.type == self.device.type
        self._decision: DeltaDecision | None = None
        self._open: dict[int, _Window] = {}
        """Windows compared ahead, or analyzed with buckets not packed yet."""
        self._done: set[int] = set()

    def shadow_of(self, op: BucketOp) -> torch.Tensor:
        base = self._buckets[op.bucket].base
        return self.shadow[base : base + op.nbytes]

    def begin(self, decision: DeltaDecision) -> None:
        """Start a sync: what to send dense, the versions, whether to checksum."""
        self._decision = decision
        self._open.clear()
        self._done.clear()

    def end(self) -> None:
        """The sync is over (packed or abandoned): drop the windows' scratch."""
        self._decision = None
        self._open.clear()
        self._done.clear()

    @torch.no_grad()
    def encode(self, op: BucketOp, buf: torch.Tensor) -> int:
        """Encode bucket ``op`` into ``buf`` (uint8, at least :func:`capacity` bytes), update
        the shadow; return the bytes to send."""
        if self._decision is None:
            raise RuntimeError(f"{self.name}: DeltaEncoder.begin(decision) before encode")
        if op.bucket in self._done:
            raise RuntimeError(f"{self.name}: bucket {op.bucket} was encoded twice in one sync")
        self._done.add(op.bucket)
        w = self._window_of[op.bucket]
        win = self._open.get(w)
        if win is None:
            win = self._open[w] = self._compare(self._windows[w], self._decision)
        if win.meta is None:
            self._analyze(w, win, self._decision)
        enc = win.encoded.pop(op.bucket)
        if not win.encoded:
            del self._open[w]
        return self._emit(self._buckets[op.bucket], enc, win, buf)

    # -- analysis of a window: compare, count, decide, update the shadow ----------------------

    def _routes(self, bk: _Bucket) -> list:
        """``bk.routes``, derived again when the live views changed."""
        views = self._views(bk.op)
        source = _FILLED if views is None else views
        if bk.source is source:
            return bk.routes
        routes = []
        for i, c in enumerate(bk.op.copies):
            if views is None:
                unit, new, flat = _fill_unit(c), None, None
            else:
                unit, new = _units(views[i])
                flat = new.view(-1) if new.is_contiguous() else None
            old = None
            if self._local:
                at = bk.base + c.offset
                old = self.shadow[at : at + c.nbytes].view(_INT_OF_SIZE[unit])
                old = old.view(new.shape) if new is not None else old
            routes.append((unit, new, flat, old))
        bk.source, bk.routes = source, routes
        return routes

    def _work(self, bks: Sequence[_Bucket]) -> tuple[torch.Tensor, int]:
        if self._local:
            return self.shadow, 0
        a, b = bks[0].base, bks[-1].base + bks[-1].op.nbytes
        work = torch.empty(b - a, dtype=torch.uint8, device=self.device)
        return work.copy_(self.shadow[a:b], non_blocking=True), a

    def _compare(self, bks: Sequence[_Bucket], decision: DeltaDecision) -> _Window:
        """Start a window: launch its compare pass (no waiting) into a mask of changed units."""
        win = _Window(*self._work(bks))
        work, wb = win.work, win.work_base
        units = 0
        for bk in bks:
            if bk.op.peer in decision.dense:
                continue
            routes = self._routes(bk)
            fresh = None
            if bk.source is _FILLED:
                fresh = torch.empty(bk.op.nbytes, dtype=torch.uint8, device=self.device)
                self._fill(bk.op, fresh)
                win.scratch.append(fresh)
            for i, (unit, new, flat, old) in enumerate(routes):
                c = bk.op.copies[i]
                if fresh is not None:
                    new = flat = fresh[c.offset : c.offset + c.nbytes].view(_INT_OF_SIZE[unit])
                if old is None:
                    at = bk.base - wb + c.offset
                    old = work[at : at + c.nbytes].view(_INT_OF_SIZE[unit]).view(new.shape)
                win.segs.append((bk, i, unit, new, flat, old, units))
                units += new.numel()
        if units:
            win.mask = mask = torch.empty(units, dtype=torch.bool, device=self.device)
            for _, _, _, new, _, old, start in win.segs:
                torch.ne(new, old, out=mask[start : start + new.numel()].view(new.shape))
        return win

    def _analyze(self, w: int, win: _Window, decision: DeltaDecision) -> None:
        """Count each route's changed units (the window's two waits for the device), decide
        sparse or dense, lay out the frames, update the shadow; meanwhile the next window's
        compare pass runs on the device."""
        segs = win.segs
        counts = np.zeros(len(segs), np.int64)
        bounds = np.zeros(len(segs) + 1, np.int64)
        pos = None
        if win.mask is not None:
            pos = win.mask.nonzero().view(-1)  # waits for the window's compare pass
            win.mask = None
            ends = [sg[6] for sg in segs] + [segs[-1][6] + segs[-1][3].numel()]
            starts = np.array(ends, np.int64)
            bounds = torch.searchsorted(pos, _to_device(starts, self.device)).cpu().numpy()
            counts = np.diff(bounds)
        ahead = self._windows[w + 1] if w + 1 < len(self._windows) else ()
        if ahead and w + 1 not in self._open and ahead[0].op.bucket not in self._done:
            self._open[w + 1] = self._compare(ahead, decision)
        sparse = self._choose(segs, counts)
        frames = self._layout(win, self._windows[w], decision, segs, counts, sparse)
        for k, (_, _, unit, new, flat, old, start) in enumerate(segs):
            if not sparse[k]:
                old.copy_(new)
                continue
            n = int(counts[k])
            if not n:
                continue
            at, ix = frames[k]
            assert win.store is not None and pos is not None
            idx = win.store[at : at + n * ix].view(_INT_OF_SIZE[ix])
            v = at + _align(n * ix)
            vals = win.store[v : v + n * unit].view(_INT_OF_SIZE[unit])
            got = pos[bounds[k] : bounds[k + 1]]
            if flat is not None:
                torch.sub(got, start, out=idx)
                torch.index_select(flat, 0, idx, out=vals)
            else:
                local = got - start
                idx.copy_(local)
                torch.take(new, local, out=vals)
            old.view(-1).index_put_((idx,), vals)
        if not self._local:
            # a host shadow: take the window's new bytes back before anything reads them
            self.shadow[win.work_base : win.work_base + len(win.work)].copy_(win.work)
        win.segs, win.scratch = [], []

    def _choose(self, segs: Sequence[tuple], counts: np.ndarray) -> np.ndarray:
        """Per compared route: whether it travels sparse."""
        m = np.array([sg[3].numel() for sg in segs], np.int64)
        unit = np.array([sg[2] for sg in segs], np.int64)
        ix = np.where(m < 2**31, 4, 8)
        frame = -(-(counts * ix) // ALIGN) * ALIGN + counts * unit
        ok = -(-frame // ALIGN) < -(-(m * unit) // ALIGN)
        f = self.config.max_changed_fraction
        if f is not None:
            ok &= counts <= f * m
        return ok

    def _layout(self, win, bks, decision, segs, counts, sparse) -> dict[int, tuple[int, int]]:
        """Each bucket's frames, directory and place in the window's store; returns where
        each sparse route's frame goes in the store: (offset, index size) by segment."""
        where: dict[int, tuple[int, int]] = {}
        meta = bytearray(sum(bk.head for bk in bks))
        flags = FLAG_CHECKSUM if decision.checksum else 0
        store = m_at = k = 0
        for bk in bks:
            op, head = bk.op, bk.head
            meta[m_at : m_at + head] = bk.template
            frames, used, base = None, head + op.nbytes, -1
            if op.peer not in decision.dense:
                ks = range(k, k + len(op.copies))
                k += len(op.copies)
                if sparse[ks.start : ks.stop].any():
                    dense, off = [], head
                    for i, kk in enumerate(ks):
                        if not sparse[kk]:
                            dense.append((i, off))
                            off = _align(off + op.copies[i].nbytes)
                    first = end = off
                    for i, kk in enumerate(ks):
                        if sparse[kk]:
                            unit, n = segs[kk][2], int(counts[kk])
                            ix = 4 if segs[kk][3].numel() < 2**31 else 8
                            isz = _itemsize(op.copies[i].dtype)
                            at = m_at + _HEAD.size + _ENT.size * i
                            _ENT.pack_into(meta, at, SPARSE, isz, ix, unit, 0, n)
                            where[kk] = (store + off - first, ix)
                            end = off + _align(n * ix) + n * unit
                            off = _align(end)
                    frames = (tuple(dense), (store, first, end - first))
                    store = _align(store + end - first)
                    used, base = end, decision.base[op.peer]
            _HEAD.pack_into(
                meta,
                m_at,
                MAGIC,
                len(op.copies),
                flags | (FLAG_PLAIN if frames is None else 0),
                0,
                used,
                decision.version,
                -1 if base is None else base,
                0,
            )
            win.encoded[op.bucket] = (m_at, used, frames)
            m_at += head
        host = (
            torch.frombuffer(meta, dtype=torch.uint8) if meta else torch.empty(0, dtype=torch.uint8)
        )
        win.meta = host.pin_memory() if self.device.type == "cuda" else host.clone()
        if store:
            win.store = torch.empty(store, dtype=torch.uint8, device=self.device)
        return where

    # -- packing one bucket: copies only -------------------------------------------------------

    def _emit(self, bk: _Bucket, enc: tuple, win: _Window, buf: torch.Tensor) -> int:
        decision = self._decision
        assert decision is not None and win.meta is not None
        op, head = bk.op, bk.head
        m_at, used, frames = enc
        at = bk.base - win.work_base
        work = win.work[at : at + op.nbytes]
        if frames is None:
            if op.peer in decision.dense:
                self._fill(op, work)
                if not self._local:
                    self.shadow_of(op).copy_(work)
            buf[head : head + op.nbytes].copy_(work)
        else:
            dense, (so, bo, n) = frames
            for i, off in dense:
                c = op.copies[i]
                buf[off : off + c.nbytes].copy_(work[c.offset : c.offset + c.nbytes])
            if n:
                assert win.store is not None
                buf[bo : bo + n].copy_(win.store[so : so + n])
        meta = win.meta[m_at : m_at + head]
        if decision.checksum:
            sums = np.array([checksum(self.shadow_of(op))], "<u8").view(np.uint8)
            meta.numpy()[_HEAD.size - 8 : _HEAD.size] = sums
        buf[:head].copy_(meta, non_blocking=True)
        return used


# ---------------------------------------------------------------------------------------------
# reader: apply buckets in place
# ---------------------------------------------------------------------------------------------


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
class _Directory:
    """A received bucket's header and directory, parsed, with where each frame lies."""

    buf: int
    """The address of the buffer it was read from (a later bucket there is another)."""
    version: int
    base: int
    used: int
    flags: int
    checksum: int
    frames: tuple[tuple[int, int, int, int, int], ...]
    """Per route: (kind, frame offset, index size, unit, count)."""


class DeltaDecoder:
    """A reader's side of the delta codec: applies encoded buckets to live tensors in place.

    The live regions of every bucket are taken once, at construction; each bucket then costs
    one small device-to-host copy (its directory, read by :meth:`encoded_size` or
    :meth:`decode`, whichever comes first) and a kernel or two per route, no other wait.
    """

    def __init__(
        self, ops: Sequence[BucketOp], tensors: Mapping[str, torch.Tensor], name: str = "reader"
    ) -> None:
        self.name = name
        self.tensors = tensors
        self._regions = {op.bucket: tuple(tensors[c.key][c.index] for c in op.copies) for op in ops}
        self._targets: dict[tuple[int, int, int], tuple] = {}
        self._read: dict[int, _Directory] = {}

    def _error(self, op: BucketOp, what: str) -> WeightbusError:
        tensors = ", ".join(sorted({c.tensor for c in op.copies})[:4])
        return WeightbusError(
            f"{self.name}: bucket {op.bucket} from writer {op.peer} ({tensors}): {what}"
        )

    def _parse(self, op: BucketOp, buf: torch.Tensor) -> _Directory:
        head_bytes = directory_bytes(op)
        # bytes, a copy: on CPU .numpy() would share memory with buf, which is reused
        raw = buf[:head_bytes].cpu().numpy().tobytes()
        magic, n, flags, _, used, version, base, sums = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC or n != len(op.copies):
            raise self._error(
                op,
                f"not a delta bucket of {len(op.copies)} routes (magic {magic:#x}, {n} "
                "frames): both sides must enable the same codecs and run the same weightbus "
                "version",
            )
        plain = bool(flags & FLAG_PLAIN)
        frames = []
        off = head_bytes
        sparse = []
        for i, c in enumerate(op.copies):
            kind, isz, ix, unit, _, count = _ENT.unpack_from(raw, _HEAD.size + _ENT.size * i)
            want = _itemsize(c.dtype)
            if kind == DENSE and isz == want and count * want == c.nbytes:
                if plain:
                    frames.append((DENSE, head_bytes + c.offset, 0, 0, count))
                else:
                    frames.append((DENSE, off, 0, 0, count))
                    off = _align(off + c.nbytes)
                continue
            if (
                kind == SPARSE
                and not plain
                and isz == want
                and ix in (4, 8)
                and unit in (1, 2, 4, 8)
                and unit % want == 0
                and c.nbytes % unit == 0
                and count <= c.nbytes // unit
            ):
                frames.append((SPARSE, 0, ix, unit, count))
                sparse.append(i)
                continue
            raise self._error(
                op,
                f"frame of {c.tensor} is kind {kind}, itemsize {isz}, unit {unit}, index size "
                f"{ix}, count {count}{' in a plain bucket' if plain else ''}; expected "
                f"{c.dtype} of {c.nbytes} bytes",
            )
        end = head_bytes + op.nbytes if plain else off
        for i in sparse:
            _, _, ix, unit, count = frames[i]
            frames[i] = (SPARSE, off, ix, unit, count)
            end = off + _align(count * ix) + count * unit
            off = _align(end)
        if end != used:
            raise self._error(op, f"frames end at byte {end}, the header says {used}")
        if used > buf.numel():
            raise self._error(op, f"claims {used} bytes, the buffer holds {buf.numel()}")
        return _Directory(buf.data_ptr(), version, base, used, flags, sums, tuple(frames))

    def encoded_size(self, op: BucketOp, buf: torch.Tensor) -> int:
        """The bytes of bucket ``op`` encoded at the start of ``buf``, of which only the first
        :func:`directory_bytes` need to have arrived. The directory is kept for
        :meth:`decode`, so that the bucket costs one device-to-host copy in all."""
        d = self._parse(op, buf)
        self._read[op.bucket] = d
        return d.used

    def _target(self, op: BucketOp, i: int, unit: int) -> tuple:
        """Where route ``i``'s sparse values of ``unit`` bytes land: (flat view or None, unit
        view, elements per unit): its own units where its strides allow (flat when
        contiguous), else its elements (``ratio`` > 1: each unit's elements one by one)."""
        key = (op.bucket, i, unit)
        hit = self._targets.get(key)
        if hit is None:
            region = self._regions[op.bucket][i]
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
        d = self._read.pop(op.bucket, None)
        if d is None or d.buf != buf.data_ptr():
            d = self._parse(op, buf)
        if d.version != version:
            raise self._error(op, f"carries version {d.version}, expected {version}")
        if d.base >= 0 and d.base != held:
            raise self._error(
                op,
                f"is a delta against version {d.base}, but this reader holds {held}: the writer "
                "must send it dense (it does for a reader that missed a sync)",
            )
        regions = self._regions[op.bucket]
        for i, (kind, off, ix, unit, count) in enumerate(d.frames):
            c = op.copies[i]
            if kind == DENSE:
                regions[i].copy_(buf[off : off + c.nbytes].view(c.dtype).view(c.shape))
                continue
            if not count:
                continue
            idx = buf[off : off + count * ix].view(_INT_OF_SIZE[ix])
            v = off + _align(count * ix)
            vals = buf[v : v + count * unit].view(_INT_OF_SIZE[unit])
            flat, view, ratio = self._target(op, i, unit)
            if ratio > 1:
                step = torch.arange(ratio, dtype=torch.int64, device=idx.device)
                idx = (idx.to(torch.int64)[:, None] * ratio + step).view(-1)
                vals = vals.view(view.dtype)
            if flat is not None:
                flat.index_put_((idx,), vals)
            else:
                _scatter(view, idx, vals)
        if d.flags & FLAG_CHECKSUM:
            scratch = buf[: op.nbytes]
            scratch.zero_()
            pack(op, self.tensors, scratch)
            got = checksum(scratch)
            if got != d.checksum:
                raise self._error(
                    op,
                    f"checksum of the live tensors after version {version} is {got:#018x}, the "
                    f"writer's is {d.checksum:#018x}: these tensors were changed "
                    "outside weightbus or a delta was lost; the next sync must be dense",
                )
