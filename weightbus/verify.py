"""Verification of every sync: per-route checksums on both sides, compared through the control plane.

Levels (``SyncConfig.verify``):

``"off"``
    nothing is checked.
``"checksum"`` (the default)
    each writer sums what it sends, route by route, and each reader sums what landed in its
    tensors (after unpacking or decoding, so a wrong scatter is caught as well as a byte
    changed in transit). Writers post their sums; each reader compares before it acknowledges,
    and a mismatch fails the sync with :class:`~weightbus.errors.ChecksumMismatch` naming the
    tensor, its region, the bucket, the writer, the reader and both sums.
``"full"``
    debug: besides the sums, writers post every byte they send and readers compare them
    exactly, naming the first element that differs. It moves the whole model through the
    control store: small models only.

What is summed, per route: its elements in the wire dtype, in row-major order over the
route's box, read as little-endian integers of their own width (1-byte dtypes as uint8,
2-byte as int16, 4-byte as int32, 8-byte as two int32 words). Writers sum what they send:
the packed bucket (casts and FP8 quantization included), the live region of a bucket sent in
place, the writer's tensors cast to the wire dtype for a pulling transport (CUDA IPC, where
nothing is packed: an extra read on each side), and with deltas the writer's shadow, i.e. the
dense values the reader must hold once the delta is applied. Readers sum their own regions.

Two sums per route, over its words ``w[0..n)``::

    s1 = sum(w[i])                      exact in int64 (n < 2**32 words)
    s2 = sum((i + 1) * w[i])  mod p     p = 2**31 - 1

``s1`` changes with any changed word (a flipped byte changes one word by a nonzero amount
below 2**32); ``s2`` also changes when two different words trade places (it moves by their
difference times their distance, the distance is below the prime, and the difference is a
multiple of it for about one pair of int32 words in 2**31, never for narrower words).
Nothing overflows and no floating point is used, so CPU and CUDA give the same numbers for
any reduction order. The big work is two integer reductions over each route's words (its row
sums and column sums over the route's last dimension; on CPU a block at a time, converted to
int64 in cache); the position weights are applied to those partial sums, for every route of a
bucket at once. Each side moves its sums to the host once per sync.

On the wire, per writer and sync, two control messages: ``verify/<seq>`` (small: per bucket,
its first route, route count, byte offset and a 64-bit digest of its sums), read by every
reader it sends to, and ``verify-routes/<seq>`` (the sums of every route), read only by a
reader whose digest differs, to name the route. With ``"full"``, ``verify-bytes/<seq>``
carries the wire bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch

from weightbus.errors import ChecksumMismatch, PlanMismatch, ProtocolError, WeightbusError

if TYPE_CHECKING:
    from weightbus.control.store import ControlPlane
    from weightbus.plan.planner import TransferPlan
    from weightbus.plan.program import BucketOp, Copy

__all__ = [
    "LEVELS",
    "PRIME",
    "VERIFY",
    "Verifier",
    "buffer_views",
    "check_reader",
    "level_mismatch",
    "post_writer",
    "region_views",
    "route_sums",
]

logger = logging.getLogger(__name__)

LEVELS = ("off", "checksum", "full")
"""Values of ``SyncConfig.verify``."""

PRIME = 2**31 - 1
"""Modulus of the position-weighted sum (a prime: products of two residues fit in int64)."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # tests: the kernel on CPU tensors
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_ROW = 4096  # words per row when a contiguous route is cut into rows
_MIN_ROW = 64  # a contiguous route whose last dim is shorter is cut into _ROW-word rows
_CPU_BLOCK = 1 << 18  # words converted to int64 at a time on CPU (stays in cache)
_TABLE_COLS = 5  # per bucket: id, first route, routes, byte offset, digest

VERIFY = {"version": int, "level": str, "buckets": bytes}
"""``verify/<seq>``, from each writer: the version, its level, and per bucket it sent
``(bucket, first route, routes, byte offset, digest)`` as little-endian int64."""


# ---------------------------------------------------------------------------------------------
# sums
# ---------------------------------------------------------------------------------------------


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x`` reinterpreted as integers of its element width (8-byte elements as int32 pairs)."""
    size = x.element_size()
    if size not in _WORD:
        raise ValueError(f"cannot checksum elements of {size} bytes ({x.dtype})")
    if x.dim() == 0:
        x = x.reshape(1)
    if size == 8 and x.stride(-1) != 1:
        # (not .contiguous(): a last dim of extent 1 may keep any stride)
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(_WORD[size])


def _pieces(w: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Views of at least 2 dims covering ``w``'s words in row-major order, with the position
    of each one's first word. No copy: a route keeps its own shape unless it is contiguous with
    a short last dim (a bias, a norm, a flat shard), which is cut into rows of ``_ROW``."""
    n = w.numel()
    if n == 0:
        return []
    if w.is_contiguous() and (w.dim() < 2 or w.shape[-1] < _MIN_ROW):
        flat = w.reshape(-1)
        rows = n // _ROW
        out = []
        if rows:
            out.append((flat[: rows * _ROW].view(rows, _ROW), 0))
        if n % _ROW:
            out.append((flat[rows * _ROW :].view(1, -1), rows * _ROW))
        return out
    if w.dim() < 2:
        w = w.reshape(1, -1)
    return [(w, 0)]


def _row_blocks(x: torch.Tensor):
    """2-D views ``(rows, last dim)`` of ``x`` in row-major order, without copying."""
    if x.dim() == 2:
        yield x
        return
    try:
        yield x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims that do not collapse (e.g. a slice of a 3-D tensor)
        for i in range(x.shape[0]):
            yield from _row_blocks(x[i])


def _partials(x: torch.Tensor, blocked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums (over the last dim, row-major) and column sums (over all leading dims) of the
    integer words ``x``, exactly in int64. ``blocked``: convert a block at a time (CPU, where
    a reduction that changes dtype is slow on large inputs); else one reduction each."""
    if not blocked:
        rows = x.sum(dim=-1, dtype=torch.int64).reshape(-1)
        cols = x.sum(dim=tuple(range(x.dim() - 1)), dtype=torch.int64)
        return rows, cols
    width = x.shape[-1]
    step = max(1, _CPU_BLOCK // max(width, 1))
    rows = []
    cols = torch.zeros(width, dtype=torch.int64, device=x.device)
    for block in _row_blocks(x):
        for a in range(0, block.shape[0], step):
            y = block[a : a + step].to(torch.int64)
            rows.append(y.sum(dim=1))
            cols += y.sum(dim=0)
    return torch.cat(rows), cols


def _weights(geometry: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    """For partial sums laid out as ``geometry`` (per route, per piece: rows, width, start):
    each partial's position weight mod PRIME, its route, and whether it is a row sum."""
    weights, seg, is_row = [], [], []
    for route, pieces in enumerate(geometry):
        for rows, width, start in pieces:
            # element (a, b) of a piece sits at start + a * width + b; weight = position + 1:
            # rows carry (start + a * width), columns (b + 1)
            weights.append((start + np.arange(rows, dtype=np.int64) * width) % PRIME)
            weights.append(np.arange(1, width + 1, dtype=np.int64) % PRIME)
            seg.append(np.full(rows + width, route, dtype=np.int64))
            is_row.append(np.r_[np.ones(rows, np.int64), np.zeros(width, np.int64)])
    if not weights:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, empty

    def cat(parts):
        return torch.from_numpy(np.concatenate(parts)).to(device)

    return cat(weights), cat(seg), cat(is_row)


def route_sums(
    views: Sequence[torch.Tensor], *, cache: dict | None = None, blocked: bool | None = None
) -> torch.Tensor:
    """``(len(views), 2)`` int64: ``s1`` and ``s2`` (see the module docstring) of each view
    (a route in its wire dtype: any shape and strides), on the views' device; nothing moves to
    the host. ``cache`` keeps the position weights per geometry between calls. ``blocked``:
    the CPU strategy (default: on CPU tensors)."""
    if not views:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = views[0].device
    if blocked is None:
        blocked = device.type == "cpu"
    parts: list[torch.Tensor] = []
    geometry = []
    for x in views:
        pieces = []
        for piece, start in _pieces(_words(x)):
            rows, cols = _partials(piece, blocked)
            parts += (rows, cols)
            pieces.append((rows.numel(), cols.numel(), start))
        geometry.append(tuple(pieces))
    key = tuple(geometry)
    tables = cache.get(key) if cache is not None else None
    if tables is None:
        tables = _weights(key, device)
        if cache is not None:
            cache[key] = tables
    weights, seg, is_row = tables
    s1 = torch.zeros(len(views), dtype=torch.int64, device=device)
    s2 = torch.zeros(len(views), dtype=torch.int64, device=device)
    if parts:
        vals = torch.cat(parts)
        s1.index_add_(0, seg, vals * is_row)
        s2.index_add_(0, seg, vals.remainder(PRIME).mul_(weights).remainder_(PRIME))
        s2.remainder_(PRIME)
    return torch.stack([s1, s2], dim=1)


def buffer_views(op: BucketOp, buf: torch.Tensor) -> list[torch.Tensor]:
    """The routes of bucket ``op`` inside its packed bytes ``buf`` (uint8), in the wire dtype."""
    return [buf[c.offset : c.offset + c.nbytes].view(c.dtype).view(c.shape) for c in op.copies]


def region_views(op: BucketOp, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The routes of bucket ``op`` as regions of local ``tensors``, in the wire dtype (a cast
    region is converted: what a writer sends, or what a reader holds in wire terms)."""
    out = []
    for c in op.copies:
        region = tensors[c.key][c.index]
        out.append(region if region.dtype == c.dtype else region.to(c.dtype))
    return out


def _raw(x: torch.Tensor) -> np.ndarray:
    """A copy of the bytes of ``x`` in row-major order, on the host."""
    return x.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().copy()


def _digest(sums: np.ndarray) -> int:
    h = hashlib.blake2b(np.ascontiguousarray(sums, dtype="<i8").tobytes(), digest_size=8)
    return int.from_bytes(h.digest(), "little", signed=True)


# ---------------------------------------------------------------------------------------------
# one participant's sums in one sync
# ---------------------------------------------------------------------------------------------


RUN_BYTES = 512 << 20
"""Buckets that readers pull are summed in runs of about this many bytes, a launch per run
(:meth:`Verifier.add_all`): by their writer as the sync starts, by a reader once a run's last
bucket landed (so its last run's sum follows the last copy: about 0.16 ms at the kernel's 3.3
TB/s on an H200)."""


def runs(ops: Sequence[BucketOp], nbytes: int) -> list[list[BucketOp]]:
    """``ops`` in order, cut into runs of at least ``nbytes`` (the last may hold fewer)."""
    out: list[list[BucketOp]] = []
    size = nbytes
    for op in ops:
        if size >= nbytes:
            out.append([])
            size = 0
        out[-1].append(op)
        size += op.nbytes
    return out


class Verifier:
    """The sums of one participant's buckets in one sync (and, at ``"full"``, their bytes).

    >>> v = Verifier("checksum"); v.begin()
    >>> v.add(op, buffer_views(op, staging))     # per bucket, once its bytes are final
    >>> v.queue(op, buffer_views(op, staging))   # or with the next ones, a launch per run
    >>> v.flush()                                # before ``staging`` is written again
    >>> sums = v.collect()                       # {bucket: (routes, 2) int64}, one host copy
    """

    def __init__(self, level: str) -> None:
        if level not in LEVELS[1:]:
            raise ValueError(f"verify level {level!r} must be one of {LEVELS[1:]} here")
        self.level = level
        self._cache: dict = {}
        self._gpu = None  # GpuSums once a CUDA bucket came (False: Triton is missing)
        self._side: dict = {}  # per device, the stream of sums that wait for events
        self._pending: dict[int, torch.Tensor] = {}
        self._bytes: dict[int, list[np.ndarray]] = {}
        self._queued: list[tuple[BucketOp, object, tuple]] = []  # see queue()
        self._queued_bytes = 0
        self.sms = 0
        """SMs of the stream the sums run on, 0 for the whole GPU (set on a GPU only). Beside
        NCCL (a pushing transport) the session sets :func:`~weightbus._green.amax_sms`: a sum grid that
        fills the GPU holds back the transport's next kernel until its own last blocks have
        started, as the FP8 amax pass did."""

    def begin(self) -> None:
        """Forget the previous sync."""
        self._pending, self._bytes = {}, {}
        self._queued, self._queued_bytes = [], 0

    def queue(
        self,
        op: BucketOp,
        views: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]],
        after: Sequence[torch.cuda.Event] = (),
    ) -> None:
        """Sum bucket ``op`` (as :meth:`add` takes it) together with the buckets queued next:
        one :meth:`add_all` per :data:`RUN_BYTES` of them, or at :meth:`flush`. A launch per
        bucket costs its host work each time: a writer that summed each of Llama-3-8B's 241
        buckets as it sent them over NCCL took 74.7 ms a sync instead of 48.8 (2 x H200),
        its host the bottleneck. The caller flushes before it writes again into memory that
        queued ``views`` are of (a staging buffer it reuses)."""
        self._queued.append((op, views, tuple(after)))
        self._queued_bytes += op.nbytes
        if self._queued_bytes >= RUN_BYTES:
            self.flush()

    def flush(self, reuse: bool = False) -> None:
        """Queue the sums of the buckets :meth:`queue` holds (on a GPU, the launch; no wait).
        Buckets that came with events are summed once those fired and, on the same stream,
        after the current stream's work so far (where the others' bytes were made).
        ``reuse``: the caller writes next into memory that sums queued so far read (a staging
        buffer), so the current stream waits for them."""
        if self._queued:
            ops = [op for op, _, _ in self._queued]
            views = [v for _, v, _ in self._queued]
            events = [e for _, _, after in self._queued for e in after]
            self._queued, self._queued_bytes = [], 0
            if events or self.sms:
                with self._after(events, ordered=True):
                    self.add_all(ops, views)
            else:
                self.add_all(ops, views)
        if reuse:
            for stream in self._side.values():
                torch.cuda.current_stream(stream.device).wait_stream(stream)

    @torch.no_grad()
    def add(
        self,
        op: BucketOp,
        views: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]],
        after: Sequence[torch.cuda.Event] = (),
    ) -> None:
        """Sum bucket ``op``'s routes, given as ``views`` (one per copy, in copy order).

        ``after``: CUDA events that fire once the bucket's bytes are in place (a pulling
        transport's :meth:`landed`). The sums then run on a stream of their own as soon as
        those fire, overlapping the later buckets' copies, instead of after everything;
        ``views`` is then a function making the views, called on that stream (a cast region
        is made there too, after the events).
        """
        self.add_all([op], [views], after)

    @contextlib.contextmanager
    def _after(self, events: Sequence[torch.cuda.Event], ordered: bool = False):
        """This participant's stream of sums that wait for ``events`` (and, if ``ordered``,
        for the current stream's work so far), made current."""
        device = torch.cuda.current_device()  # this participant's (views live there)
        stream = self._side.get(device)
        if stream is None:
            from weightbus._green import partial_stream

            part = partial_stream(torch.device("cuda", device), self.sms, "verify")
            stream = self._side[device] = part or torch.cuda.Stream(device)
        if ordered:
            stream.wait_stream(torch.cuda.current_stream(device))
        for event in events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield

    @torch.no_grad()
    def add_all(
        self,
        ops: Sequence[BucketOp],
        views: Sequence[Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]]],
        after: Sequence[torch.cuda.Event] = (),
    ) -> None:
        """Sum buckets ``ops`` (``views`` and ``after`` as :meth:`add` takes them, ``after``
        for all of them): on a GPU one launch for all of them instead of one per bucket.
        Both the launch and the host work per launch count: on an H200 a 66 MB bucket's sum
        took 33 us alone (2 TB/s) against ~3.3 TB/s for a launch over 2 GiB, and a reader
        that queued a launch per bucket of Llama-3-8B (241) after its pulls finished them
        15 ms after its last copy, bound by its host (colocated, 2 x H200)."""
        if after:
            with self._after(after):
                self.add_all(ops, views)
            return
        views = [list(v() if callable(v) else v) for v in views]
        for op, v in zip(ops, views, strict=True):
            if len(v) != len(op.copies):
                raise WeightbusError(
                    f"bucket {op.bucket}: {len(v)} views for {len(op.copies)} routes"
                )
        sums = self._on_gpu([x for v in views for x in v])
        if sums is not None:
            parts, at = [], 0
            for v in views:
                parts.append(sums[at : at + len(v)])
                at += len(v)
        elif len(views) > 1:  # a bucket the kernel cannot read: each bucket apart
            parts = [self._on_gpu(v) for v in views]
        else:
            parts = [None]
        for op, v, part in zip(ops, views, parts, strict=True):
            self._pending[op.bucket] = (
                part if part is not None else route_sums(v, cache=self._cache)
            )
            if self.level == "full":
                self._bytes[op.bucket] = [_raw(x) for x in v]

    def _on_gpu(self, views: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The sums by the Triton kernel (``s2`` reduced in :meth:`collect`), or None where
        it does not apply (CPU tensors, no Triton, a column stride other than 1)."""
        if not views or not (views[0].is_cuda or _INTERPRETED):
            return None
        if self._gpu is None:
            try:
                from weightbus._verify_triton import GpuSums
            except ImportError:  # pragma: no cover - Triton ships with CUDA builds of torch
                self._gpu = False
            else:
                self._gpu = GpuSums()
        if self._gpu is False:
            return None
        return self._gpu.add([_pieces(_words(x)) for x in views])

    def collect(self) -> dict[int, np.ndarray]:
        """Every bucket's sums on the host, ``{bucket: (routes, 2) int64}`` (one copy)."""
        self.flush()
        if not self._pending:
            return {}
        for stream in self._side.values():  # sums made on streams of their own
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        ids = list(self._pending)
        parts = [self._pending[b] for b in ids]
        if len({t.device for t in parts}) > 1:  # e.g. a delta shadow in host memory
            parts = [t.cpu() for t in parts]
        both = torch.cat(parts)
        both[:, 1] %= PRIME  # the GPU kernel's s2 comes unreduced (idempotent on the others)
        host = both.cpu().numpy()  # the one device-to-host copy of the sync
        out, at = {}, 0
        for b in ids:
            n = self._pending[b].shape[0]
            out[b] = host[at : at + n]
            at += n
        return out

    def bytes_of(self, bucket: int) -> list[np.ndarray]:
        """At ``"full"``: the routes' bytes of ``bucket``, as added."""
        return self._bytes[bucket]


# ---------------------------------------------------------------------------------------------
# writers post, readers compare
# ---------------------------------------------------------------------------------------------


def post_writer(
    control: ControlPlane,
    seq: int,
    version: int,
    verifier: Verifier,
    ops: Sequence[BucketOp],
) -> list[str]:
    """Post this writer's sums of sync ``seq`` (and its bytes at ``"full"``); returns the
    topics to drop once every reader acknowledged."""
    sums = verifier.collect()
    table = np.zeros((len(ops), _TABLE_COLS), dtype="<i8")
    routes, raw = [], []
    first = offset = 0
    for i, op in enumerate(ops):
        s = sums[op.bucket]
        nbytes = sum(c.nbytes for c in op.copies)
        table[i] = (op.bucket, first, len(op.copies), offset, _digest(s))
        routes.append(s)
        if verifier.level == "full":
            raw += verifier.bytes_of(op.bucket)
        first += len(op.copies)
        offset += nbytes
    all_routes = np.concatenate(routes) if routes else np.zeros((0, 2), np.int64)
    dropped = [f"verify-routes/{seq}"]
    control.post(dropped[0], np.ascontiguousarray(all_routes, dtype="<i8").tobytes())
    if verifier.level == "full":
        dropped.append(f"verify-bytes/{seq}")
        control.post(dropped[1], b"".join(r.tobytes() for r in raw))
    control.post(
        f"verify/{seq}", {"version": version, "level": verifier.level, "buckets": table.tobytes()}
    )
    return dropped


def _box(plan: TransferPlan, op: BucketOp, i: int) -> str:
    """The canonical box of route ``i`` of bucket ``op``, as ``[a:b, c:d]``."""
    row = int(plan.buckets.first[op.bucket]) + i
    nd = len(plan.tensors[int(plan.routes.tensor[row])].shape)
    start = plan.routes.start[row][plan.routes.start.shape[1] - nd :]
    stop = plan.routes.stop[row][plan.routes.stop.shape[1] - nd :]
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(start, stop, strict=True)) + "]"


def _local(c: Copy) -> str:
    return f"{c.key!r}[" + ", ".join(f"{s.start}:{s.stop}" for s in c.index) + "]"


def _table(who: str, topic: str, msg: dict, version: int, level: str) -> np.ndarray:
    if msg["version"] != version:
        raise ProtocolError(f"{who} posted {topic!r} for version {msg['version']}, not {version}")
    if msg["level"] != level:
        raise WeightbusError(
            f"{who} verifies at level {msg['level']!r}, this reader at {level!r}: pass the same "
            "SyncConfig.verify to every writer and reader"
        )
    data = msg["buckets"]
    if len(data) % (8 * _TABLE_COLS):
        raise ProtocolError(f"{who} posted {topic!r} with {len(data)} bytes of bucket table")
    return np.frombuffer(data, dtype="<i8").reshape(-1, _TABLE_COLS)


def check_reader(
    control: ControlPlane,
    seq: int,
    version: int,
    verifier: Verifier,
    ops: Sequence[BucketOp],
    plan: TransferPlan,
    reader: str,
    timeout: timedelta,
    state: str,
) -> None:
    """Compare this reader's sums of sync ``seq`` with its writers'; raise
    :class:`ChecksumMismatch` naming the first route that differs. ``state`` says, for the
    message, what became of this reader's tensors."""
    mine = verifier.collect()
    by_writer: dict[int, list[BucketOp]] = {}
    for op in ops:
        by_writer.setdefault(op.peer, []).append(op)
    names = [plan.writers[w].name for w in sorted(by_writer)]
    if not names:
        return
    posted = control.gather(f"verify/{seq}", names=names, timeout=timeout, schema=VERIFY)
    for w in sorted(by_writer):
        writer = plan.writers[w].name
        who = f"writer {writer!r}"
        table = _table(who, f"verify/{seq}", posted[writer], version, verifier.level)
        rows = {int(r[0]): r for r in table}
        bad = []
        for op in by_writer[w]:
            row = rows.get(op.bucket)
            if row is None or int(row[2]) != len(op.copies):
                raise ProtocolError(
                    f"{who} posted no sums of bucket {op.bucket} with {len(op.copies)} routes "
                    f"for version {version}: the two sides planned differently"
                )
            if int(row[4]) != _digest(mine[op.bucket]):
                bad.append((op, row))
        where = (seq, plan, writer, reader, version, state, timeout)
        if verifier.level == "full":  # names the element, so before the sums
            _compare_bytes(control, verifier, by_writer[w], rows, *where)
        if bad:
            _name_route(control, bad, mine, *where)


def _name_route(control, bad, mine, seq, plan, writer, reader, version, state, timeout) -> None:
    """A bucket digest differs: read the writer's route sums and raise for the first route."""
    topic = f"verify-routes/{seq}"
    data = control.gather(topic, names=[writer], timeout=timeout)[writer]
    if not isinstance(data, bytes) or len(data) % 16:
        raise ProtocolError(f"writer {writer!r} posted {topic!r} that is not route sums")
    theirs = np.frombuffer(data, dtype="<i8").reshape(-1, 2)
    found = []
    for op, row in bad:
        first, n = int(row[1]), int(row[2])
        if not 0 <= first <= len(theirs) - n:
            raise ProtocolError(
                f"writer {writer!r} posted {len(theirs)} route sums, fewer than its table"
            )
        for i in range(n):
            a, b = theirs[first + i], mine[op.bucket][i]
            if not np.array_equal(a, b):
                found.append((op, i, (int(a[0]), int(a[1])), (int(b[0]), int(b[1]))))
    if not found:
        op = bad[0][0]
        raise ChecksumMismatch(
            f"reader {reader!r}: the digest of bucket {op.bucket} from writer {writer!r} differs "
            f"in version {version} although every route sum matches: {state}",
            tensor="",
            writer=writer,
            reader=reader,
            bucket=op.bucket,
            expected=None,
            got=None,
        )
    op, i, want, got = found[0]
    c = op.copies[i]
    more = f" ({len(found) - 1} more routes differ too)" if len(found) > 1 else ""
    raise ChecksumMismatch(
        f"reader {reader!r}: checksum mismatch in version {version} on {c.tensor} "
        f"{_box(plan, op, i)} (this reader's {_local(c)}, bucket {op.bucket}) from writer "
        f"{writer!r}: the writer sent sums {want}, the reader holds {got}{more}. The bytes "
        f"changed in transit or while being unpacked; {state}. Check the link between the two "
        "(or run with SyncConfig.verify='full' to see the first element that differs)",
        tensor=c.tensor,
        writer=writer,
        reader=reader,
        bucket=op.bucket,
        expected=want,
        got=got,
    )


def _compare_bytes(
    control, verifier, ops, rows, seq, plan, writer, reader, version, state, timeout
) -> None:
    """At ``"full"``: compare every byte with the writer's; raise at the first element."""
    topic = f"verify-bytes/{seq}"
    data = control.gather(topic, names=[writer], timeout=timeout)[writer]
    if not isinstance(data, bytes):
        raise ProtocolError(f"writer {writer!r} posted {topic!r} that is not bytes")
    for op in ops:
        at = int(rows[op.bucket][3])
        for i, (c, got) in enumerate(zip(op.copies, verifier.bytes_of(op.bucket), strict=True)):
            if not 0 <= at <= len(data) - c.nbytes:
                raise ProtocolError(
                    f"writer {writer!r} posted {len(data)} bytes under {topic!r}, too few for "
                    f"bucket {op.bucket} at byte {at}"
                )
            want = np.frombuffer(data, dtype=np.uint8, count=c.nbytes, offset=at)
            at += c.nbytes
            if not np.array_equal(want, got):
                diff = int(np.flatnonzero(want != got)[0])
                size = torch.empty((), dtype=c.dtype).element_size()
                k = diff // size
                w_raw, g_raw = want[k * size : (k + 1) * size], got[k * size : (k + 1) * size]
                w_el = torch.from_numpy(w_raw.copy()).view(c.dtype).item()
                g_el = torch.from_numpy(g_raw.copy()).view(c.dtype).item()
                raise ChecksumMismatch(
                    f"reader {reader!r}: full compare of version {version}: {c.tensor} "
                    f"{_box(plan, op, i)} (this reader's {_local(c)}, bucket {op.bucket}) from "
                    f"writer {writer!r} differs first at element {k} of the route (row-major): "
                    f"the writer sent {w_el!r} (bytes {w_raw.tobytes().hex()}), the reader "
                    f"holds {g_el!r} (bytes {g_raw.tobytes().hex()}); {state}",
                    tensor=c.tensor,
                    writer=writer,
                    reader=reader,
                    bucket=op.bucket,
                    expected=None,
                    got=None,
                )


def level_mismatch(exc: PlanMismatch) -> PlanMismatch:
    """The error when participants verify at different levels (they must agree at connect:
    readers wait for sums that writers post only when they verify), naming who holds which."""
    parts = [f"{d!r} held by {', '.join(n)}" for d, n in exc.groups.items()]
    return PlanMismatch(
        "participants disagree on SyncConfig.verify: "
        + "; ".join(parts)
        + ": pass the same verify level to every writer and reader",
        exc.groups,
    )
