"""Sparse deltas on the wire: send only the elements that changed since the last sync, bit exact.

The writer keeps the bytes it last sent on every route (its *shadow*: the dense bucket bytes,
in the plan's bucket layout, on the writer's device or in pinned host memory). A sync compares
each route's new wire values with the shadow by their raw bits, so the comparison is exact:
NaNs compare equal to themselves, ``-0.0`` and ``0.0`` differ, and any dtype works. A route
whose changed elements make a smaller frame than the dense bytes travels as (indices, values),
the indices flat and row-major within the route's canonical box, so deltas follow the
routes through any resharding; otherwise it travels dense. The reader writes the values into
its live tensors in place.

Bucket wire format (little-endian, no pickle), one bucket = one byte buffer::

    header     48 bytes   magic "WBD1", frames, flags, reserved,
                          used bytes, version, base version (-1: no sparse frame), checksum
    directory  16 bytes per route, in the bucket's route order:
                          kind (1 dense, 2 sparse), itemsize, index size (0, 4, 8), 0, 0, count
    frames     one per route, each at a 16-byte aligned offset, in route order:
                          dense:  the route's elements (count = numel)
                          sparse: count indices, padded to 16 bytes, then count values

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

MAGIC = int.from_bytes(b"WBD1", "little")
DENSE, SPARSE = 1, 2
FLAG_CHECKSUM = 1
ALIGN = 16
_HEADER = np.dtype(
    [
        ("magic", "<u4"),
        ("frames", "<u4"),
        ("flags", "<u4"),
        ("reserved", "<u4"),
        ("used", "<u8"),
        ("version", "<i8"),
        ("base_version", "<i8"),
        ("checksum", "<u8"),
    ]
)
_ENTRY = np.dtype(
    [
        ("kind", "u1"),
        ("itemsize", "u1"),
        ("index_size", "u1"),
        ("reserved", "u1"),
        ("reserved2", "<u4"),
        ("count", "<u8"),
    ]
)
assert _HEADER.itemsize == 48 and _ENTRY.itemsize == 16
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHADOWS = ("device", "host")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaConfig:
    """Sparse deltas on the wire (writer-side choices; both sides must enable it)."""

    max_changed_fraction: float | None = None
    """A route travels sparse only while at most this fraction of its elements changed; None:
    whenever its sparse frame is smaller than its dense bytes (below 1/3 changed for bf16)."""
    checksum_every: int = 20
    """Every this many syncs the readers verify a checksum of every bucket; 0: only on request."""
    shadow: str = "device"
    """Where the writer keeps the bytes it last sent: "device" (with the weights) or "host"
    (pinned host memory, when the GPU has no room for a copy of the writer's share)."""

    def __post_init__(self) -> None:
        f = self.max_changed_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise ValueError(f"max_changed_fraction={f} must be in (0, 1], or None (automatic)")
        if self.checksum_every < 0:
            raise ValueError(f"checksum_every={self.checksum_every} must be >= 0 (0: on request)")
        if self.shadow not in _SHADOWS:
            raise ValueError(f"shadow={self.shadow!r} must be one of {_SHADOWS}")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers of the same width (raw bits, for exact comparison)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def directory_bytes(op: BucketOp) -> int:
    """Bytes of a bucket's header and directory: fixed per bucket, sent first."""
    return _align(_HEADER.itemsize + _ENTRY.itemsize * len(op.copies))


def encoded_size(directory: torch.Tensor) -> int:
    """The bytes of a whole encoded bucket, read from its first :func:`directory_bytes`
    bytes: a receiver takes the directory first, then the rest."""
    head = directory[: _HEADER.itemsize].cpu().numpy().copy().view(_HEADER)[0]
    if int(head["magic"]) != MAGIC:
        raise WeightbusError(
            f"not a delta bucket (magic {int(head['magic']):#x}): both sides must enable deltas"
        )
    return int(head["used"])


def capacity(op: BucketOp) -> int:
    """The largest encoded bucket (every route dense), and room for the reader's checksum
    pass, which packs the bucket's dense bytes into the same buffer."""
    return max(directory_bytes(op) + sum(_align(c.nbytes) for c in op.copies), op.nbytes)


def checksum(data: torch.Tensor) -> int:
    """A 64-bit checksum of a uint8 tensor, equal on every device: position-weighted sums of
    32-bit words in chunks of 2**15 (exact in int64), hashed with BLAKE2b. For detecting
    corruption and bookkeeping errors, not adversaries."""
    data = data.reshape(-1)
    n = data.numel()
    n4 = n - n % 4
    words = data[:n4]
    if n4 and words.data_ptr() % 4:
        words = words.clone()
    words = words.view(torch.int32)
    chunk, stride = 1 << 15, 1 << 22
    weights = torch.arange(1, chunk + 1, dtype=torch.int64, device=data.device)
    h = hashlib.blake2b(digest_size=8)
    h.update(n.to_bytes(8, "little"))
    for start in range(0, len(words), stride):
        w = words[start : start + stride].to(torch.int64)
        full = len(w) - len(w) % chunk
        blocks = w[:full].view(-1, chunk)
        tail = w[full:]
        s1 = torch.cat([blocks.sum(1), tail.sum().view(1)])
        s2 = torch.cat([(blocks * weights).sum(1), (tail * weights[: len(tail)]).sum().view(1)])
        h.update(torch.stack([s1, s2]).cpu().numpy().astype("<i8").tobytes())
    h.update(data[n4:].cpu().numpy().tobytes())
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

Source = Callable[[int, Copy], torch.Tensor]
"""``source(i, copy)``: route ``i`` of a bucket's new wire values, of ``copy.shape`` and
``copy.dtype`` (a live view, or a freshly cast or quantized tensor)."""


class DeltaEncoder:
    """A writer's shadow and its bucket encoder (see the module docstring for the format)."""

    def __init__(
        self,
        ops: Sequence[BucketOp],
        config: DeltaConfig,
        *,
        device: torch.device | str = "cpu",
        name: str = "writer",
    ) -> None:
        self.config = config
        self.name = name
        self.device = torch.device(device)
        self._base: dict[int, int] = {}
        total = 0
        for op in ops:
            self._base[op.bucket] = total
            total += -(-op.nbytes // 256) * 256
        host = config.shadow == "host" or self.device.type == "cpu"
        pin = host and self.device.type == "cuda" and torch.cuda.is_available()
        self.shadow = torch.zeros(
            total, dtype=torch.uint8, device="cpu" if host else self.device, pin_memory=pin
        )
        """The bytes last sent, per bucket in the plan's layout (padding stays zero)."""

    def shadow_of(self, op: BucketOp) -> torch.Tensor:
        base = self._base[op.bucket]
        return self.shadow[base : base + op.nbytes]

    def _sparse_ok(self, count: int, numel: int, nbytes: int, sparse_bytes: int) -> bool:
        f = self.config.max_changed_fraction
        if f is not None and count > f * numel:
            return False
        return _align(sparse_bytes) < _align(nbytes)

    @torch.no_grad()
    def encode(
        self,
        op: BucketOp,
        source: Source,
        buf: torch.Tensor,
        *,
        decision: DeltaDecision,
    ) -> int:
        """Encode bucket ``op`` into ``buf`` (uint8, at least :func:`capacity` bytes), update
        the shadow; return the bytes to send."""
        dense = op.peer in decision.dense
        base_version = decision.base[op.peer]
        head_bytes = directory_bytes(op)
        entries = np.zeros(len(op.copies), _ENTRY)
        shadow = self.shadow_of(op)
        off, end, any_sparse = head_bytes, head_bytes, False
        for i, c in enumerate(op.copies):
            cur = source(i, c)
            isz = _itemsize(c.dtype)
            numel = c.nbytes // isz
            prev_store = shadow[c.offset : c.offset + c.nbytes]
            prev = prev_store.to(cur.device) if prev_store.device != cur.device else prev_store
            prev = prev.view(c.dtype)
            kind, count, ix = DENSE, numel, 0
            if not dense:
                changed = _bits(cur) != _bits(prev.view(c.shape))
                n_changed = int(changed.sum())
                ix_try = 4 if numel < 2**31 else 8
                sparse_bytes = _align(n_changed * ix_try) + n_changed * isz
                if self._sparse_ok(n_changed, numel, c.nbytes, sparse_bytes):
                    kind, count, ix = SPARSE, n_changed, ix_try
            if kind == SPARSE:
                any_sparse = True
                idx = changed.reshape(-1).nonzero().view(-1)
                vals = cur[changed]  # row-major, like the indices
                buf[off : off + count * ix].view(_INT_OF_SIZE[ix]).copy_(idx)
                voff = off + _align(count * ix)
                buf[voff : voff + count * isz].view(c.dtype).copy_(vals)
                prev[idx] = vals
                end = voff + count * isz
            else:
                dst = buf[off : off + c.nbytes].view(c.dtype)
                dst.view(c.shape).copy_(cur)
                prev.copy_(dst)
                end = off + c.nbytes
            if prev_store.device != prev.device:
                prev_store.copy_(prev.view(torch.uint8))
            entries[i] = (kind, isz, ix, 0, 0, count)
            off = _align(end)
        head = np.zeros(1, _HEADER)
        head["magic"], head["frames"] = MAGIC, len(op.copies)
        head["used"], head["version"] = end, decision.version
        head["base_version"] = base_version if any_sparse else -1
        if decision.checksum:
            head["flags"] = FLAG_CHECKSUM
            head["checksum"] = checksum(shadow)
        meta = np.concatenate([head.view(np.uint8), entries.view(np.uint8)])
        buf[: len(meta)].copy_(torch.from_numpy(meta))
        return end


# ---------------------------------------------------------------------------------------------
# reader: apply buckets in place
# ---------------------------------------------------------------------------------------------


def _scatter(region: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``region.reshape(-1)[idx] = vals``, in place whatever ``region``'s strides."""
    if region.is_contiguous():
        region.view(-1)[idx] = vals
        return
    offs = torch.zeros_like(idx)
    rem = idx
    for n, s in zip(reversed(region.shape), reversed(region.stride()), strict=True):
        offs += (rem % n) * s
        rem = rem // n
    span = sum((n - 1) * s for n, s in zip(region.shape, region.stride(), strict=True)) + 1
    region.as_strided((span,), (1,))[offs] = vals


class DeltaDecoder:
    """A reader's side of the delta codec: applies encoded buckets to live tensors in place."""

    def __init__(self, name: str = "reader") -> None:
        self.name = name

    def _error(self, op: BucketOp, what: str) -> WeightbusError:
        tensors = ", ".join(sorted({c.tensor for c in op.copies})[:4])
        return WeightbusError(
            f"{self.name}: bucket {op.bucket} from writer {op.peer} ({tensors}): {what}"
        )

    @torch.no_grad()
    def decode(
        self,
        op: BucketOp,
        tensors: Mapping[str, torch.Tensor],
        buf: torch.Tensor,
        *,
        version: int,
        held: int | None,
    ) -> None:
        """Apply the encoded bucket at the start of ``buf`` (uint8, :func:`capacity` bytes)
        to ``tensors``; ``held`` is the version the reader's tensors hold before it."""
        head_bytes = directory_bytes(op)
        # a copy: on CPU .numpy() would share memory with buf, which the checksum pass reuses
        meta = buf[:head_bytes].cpu().numpy().copy()
        head = meta[: _HEADER.itemsize].view(_HEADER)[0]
        entries = meta[_HEADER.itemsize : _HEADER.itemsize + _ENTRY.itemsize * len(op.copies)]
        entries = entries.view(_ENTRY)
        if int(head["magic"]) != MAGIC or int(head["frames"]) != len(op.copies):
            raise self._error(
                op,
                f"not a delta bucket of {len(op.copies)} routes (magic {int(head['magic']):#x}, "
                f"{int(head['frames'])} frames): both sides must enable the same codecs",
            )
        if int(head["version"]) != version:
            raise self._error(op, f"carries version {int(head['version'])}, expected {version}")
        used = int(head["used"])
        if used > buf.numel():
            raise self._error(op, f"claims {used} bytes, the buffer holds {buf.numel()}")
        base = int(head["base_version"])
        if base >= 0 and base != held:
            raise self._error(
                op,
                f"is a delta against version {base}, but this reader holds {held}: the writer "
                "must send it dense (it does for a reader that missed a sync)",
            )
        off = head_bytes
        for c, e in zip(op.copies, entries, strict=True):
            kind, isz, ix, count = (int(e[k]) for k in ("kind", "itemsize", "index_size", "count"))
            numel = c.nbytes // _itemsize(c.dtype)
            if isz != _itemsize(c.dtype) or kind not in (DENSE, SPARSE) or count > numel:
                raise self._error(
                    op,
                    f"frame of {c.tensor} is kind {kind}, itemsize {isz}, {count} elements; "
                    f"expected {c.dtype} with at most {numel}",
                )
            region = tensors[c.key][c.index]
            if kind == DENSE:
                if count != numel:
                    raise self._error(op, f"dense frame of {c.tensor} has {count} of {numel}")
                region.copy_(buf[off : off + c.nbytes].view(c.dtype).view(c.shape))
                end = off + c.nbytes
            else:
                if ix not in (4, 8):
                    raise self._error(op, f"frame of {c.tensor} has index size {ix}")
                idx = buf[off : off + count * ix].view(_INT_OF_SIZE[ix]).to(torch.int64)
                voff = off + _align(count * ix)
                vals = buf[voff : voff + count * isz].view(c.dtype)
                if count:
                    _scatter(region, idx, vals)
                end = voff + count * isz
            off = _align(end)
        if end != used:
            raise self._error(op, f"frames end at byte {end}, the header says {used}")
        if int(head["flags"]) & FLAG_CHECKSUM:
            scratch = buf[: op.nbytes]
            scratch.zero_()
            pack(op, tensors, scratch)
            got = checksum(scratch)
            if got != int(head["checksum"]):
                raise self._error(
                    op,
                    f"checksum of the live tensors after version {version} is {got:#018x}, the "
                    f"writer's is {int(head['checksum']):#018x}: these tensors were changed "
                    "outside weightbus or a delta was lost; the next sync must be dense",
                )
