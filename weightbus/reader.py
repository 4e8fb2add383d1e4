"""The inference side: ``Reader.wait()`` receives each new version in place into the engine."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch

from weightbus._session import SyncResult, _Deadline, _Session
from weightbus.codecs.delta import directory_bytes, encoded_size
from weightbus.control.store import BEGIN, COMMIT
from weightbus.errors import SyncTimeout, WeightbusError
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, rest_tag
from weightbus.plan.program import BucketOp, unpack
from weightbus.transports.base import Handle

logger = logging.getLogger(__name__)

__all__ = ["Reader"]


class Reader(_Session):
    """One inference participant (one process, one device), writing into the engine's live
    tensors in place: the engine keeps its tensor objects.

    >>> reader = Reader(bound, ControlConfig(address="trainer0:29700", num_writers=2, num_readers=2))
    >>> reader.connect()
    >>> while True:
    ...     result = reader.wait()          # blocks until the trainer's next sync is committed
    ...     generate_with(result.version)
    """

    role = "reader"
    """This side's role."""

    def __init__(
        self, *args, on_version: Callable[[SyncResult], None] | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_version = on_version
        """Called with each committed sync's :class:`~weightbus.SyncResult` (e.g. to refresh
        engine caches)."""
        self._told = -1  # the sync sequence number whose holds/ this reader posted last
        self._checksum = False

    def _make_codec(self, plan, codecs: CodecConfig) -> ReaderCodec | None:
        # FP8 bytes land in the engine's FP8 tensors like any others: only deltas need decoding
        if codecs.delta is None:
            return None
        return ReaderCodec(plan, self.bound.layout.rank, self.bound.tensors, codecs)

    def request_dense(self) -> None:
        """Deltas: this reader's tensors no longer hold the last version it received (the
        engine reloaded or discarded its weights, e.g. vLLM's sleep level 2): the next sync
        sends it every byte. Call it before :meth:`wait`. Without deltas every sync is dense."""
        self._before_wait("request_dense")
        if self.codec is not None:
            self.codec.version = None

    def request_checksum(self) -> None:
        """Deltas: every bucket of the next sync carries a checksum this reader verifies
        against its live tensors. Call it before :meth:`wait`."""
        self._before_wait("request_checksum")
        self._checksum = True

    def _before_wait(self, what: str) -> None:
        if self.codec is not None and self._told == self._seq:
            raise WeightbusError(
                f"{self.name}: {what}() after a wait() that timed out: the writers were already "
                "told what this reader holds for the next sync; call it before waiting, or "
                "after the next sync"
            )

    def wait(self, timeout: timedelta | None = None) -> SyncResult:
        """Receive the next sync; return once it is committed (every reader has it).

        ``timeout`` bounds the wait for the sync to *begin* (default ``step_timeout``); when
        it passes, :class:`~weightbus.errors.SyncTimeout` is raised and the reader may wait
        again. The sync itself is bounded by ``sync_timeout``; a failure during it is reported
        to every participant and leaves this reader unusable.
        """
        self._require_connected()
        cfg, control, transport = self.config, self.control, self.transport
        seq = self._seq
        phases = {"plan": 0.0, "pack": 0.0, "transfer": 0.0, "unpack": 0.0, "control": 0.0}
        try:
            if self.codec is not None and self._told != seq:
                # deltas: the writers send dense to a reader that does not hold their last
                # version (None: it never synced, missed a version or lost its weights)
                held = self.codec.version
                control.post(f"holds/{seq}", {"holds": held, "checksum": self._checksum})
                self._told = seq
            begins = control.gather(
                f"begin/{seq}",
                role="writer",
                timeout=cfg.step_timeout if timeout is None else timeout,
                schema=BEGIN,
            )
        except SyncTimeout:
            raise  # no sync began: nothing is half done, the reader may wait again
        except BaseException as exc:
            self._fail(exc)
            raise
        version = -1  # until the writers' announcements are read
        try:
            t_start = time.perf_counter()
            deadline = _Deadline(cfg.sync_timeout)
            versions = {b["version"] for b in begins.values()}
            if len(versions) != 1:
                raise WeightbusError(
                    f"writers began different versions {sorted(versions)}: {begins}"
                )
            version = versions.pop()
            if self.version is not None and version <= self.version:
                raise WeightbusError(
                    f"{self.name}: writers sent version {version}, not newer than {self.version}"
                )
            total = self.bytes_per_sync
            staged: deque = deque()  # (handle, op, staging buffer), oldest first
            direct: list = []  # handles of in-place receives
            free = deque(self._staging)
            tensors = self.bound.tensors
            if self.codec is not None:
                total = self._receive_coded(version, deadline, phases)
            ops = () if transport.pulls or self.codec is not None else self.ops
            if transport.pulls:
                # the transport copies each bucket from the writer's tensors into ours
                direct = [transport.pull(op.peer_global, op.bucket) for op in self.ops]
            for op, live in zip(ops, self.direct[: len(ops)], strict=True):
                if live is not None:
                    # one contiguous region of a live tensor: received in place, no staging
                    direct.append(transport.recv(op.peer_global, live, op.bucket))
                    continue
                if not free:
                    # only the oldest staged receive frees a buffer; in-place receives on other
                    # links go on meanwhile
                    free.append(self._unpack_oldest(staged, tensors, phases, deadline))
                buf = free.popleft()
                staged.append(
                    (transport.recv(op.peer_global, buf[: op.nbytes], op.bucket), op, buf)
                )
            while staged:
                self._unpack_oldest(staged, tensors, phases, deadline)
            t = time.perf_counter()
            transport.wait(direct, deadline.left())
            phases["transfer"] += time.perf_counter() - t
            if self._device.type == "cuda":
                # unpack kernels are queued on this stream: the bytes are in place only once
                # they ran, and only then may this reader acknowledge
                t = time.perf_counter()
                torch.cuda.current_stream(self._device).synchronize()
                phases["transfer" if transport.pulls else "unpack"] += time.perf_counter() - t
            t = time.perf_counter()
            control.post(f"ack/{seq}", {"version": version, "ok": True, "bytes": total})
            commit = control.gather(
                f"commit/{seq}",
                names=[self.plan.writers[0].name],
                timeout=deadline.left(),
                schema=COMMIT,
            )
            committed = next(iter(commit.values()))["version"]
            if committed != version:
                raise WeightbusError(
                    f"{self.name}: writer {self.plan.writers[0].name!r} committed version "
                    f"{committed}, this sync carried {version}"
                )
            phases["control"] += time.perf_counter() - t
            if self.codec is not None:
                self.codec.end(version)
                self._checksum = False
        except BaseException as exc:
            err = self._sync_failed(exc, version)
            if err is exc:
                raise
            raise err from exc
        result = self._finished(version, total, time.perf_counter() - t_start, phases)
        if self.on_version is not None:
            self.on_version(result)
        return result

    def _unpack_oldest(self, staged: deque, tensors, phases: dict[str, float], deadline: _Deadline):
        """Wait for the oldest staged receive, unpack it; return its staging buffer."""
        handle, op, buf = staged.popleft()
        t = time.perf_counter()
        self.transport.wait([handle], deadline.left())
        phases["transfer"] += time.perf_counter() - t
        t = time.perf_counter()
        unpack(op, tensors, buf[: op.nbytes])
        phases["unpack"] += time.perf_counter() - t
        return buf

    def _receive_coded(self, version: int, deadline: _Deadline, phases: dict[str, float]) -> int:
        """Receive and decode every bucket of a delta sync; return the bytes received.

        Each bucket is two messages: a directory of fixed size, then the rest, whose size the
        directory gives. Messages with one writer must be posted in the order it sends them
        (NCCL matches by order alone), so a bucket's rest is posted before the next bucket
        from the same writer; buckets from other writers overlap meanwhile.
        """
        codec = self.codec
        assert codec is not None
        codec.begin(version)
        free = deque(self._staging)
        pending: deque[_Incoming] = deque()  # oldest first
        open_dir: dict[int, _Incoming] = {}  # per writer: the bucket whose rest is not posted
        received = 0
        for op in self.ops:
            previous = open_dir.pop(op.peer_global, None)
            if previous is not None:
                received += self._resolve(previous, deadline, phases)
            if not free:
                item = pending.popleft()
                received += self._decode(item, deadline, phases)
                free.append(item.buf)
            buf = free.popleft()
            head = directory_bytes(op)
            item = _Incoming(op, buf, self.transport.recv(op.peer_global, buf[:head], op.bucket))
            pending.append(item)
            open_dir[op.peer_global] = item
        while pending:
            received += self._decode(pending.popleft(), deadline, phases)
        return received

    def _resolve(self, item: _Incoming, deadline: _Deadline, phases: dict[str, float]) -> int:
        """Wait for a bucket's directory and post the receive of its rest; return its bytes."""
        if item.size:
            return 0
        t = time.perf_counter()
        self.transport.wait([item.head], deadline.left())
        phases["transfer"] += time.perf_counter() - t
        op, head = item.op, directory_bytes(item.op)
        used = encoded_size(item.buf[:head])
        if not head <= used <= item.buf.numel():
            raise WeightbusError(
                f"{self.name}: bucket {op.bucket} from writer {self.plan.writers[op.peer].name!r} "
                f"says it is {used} bytes; it must be {head} to {item.buf.numel()}: the two sides "
                "run different weightbus versions or codecs"
            )
        if used > head:
            tag = rest_tag(op, len(self.plan.buckets))
            item.rest = self.transport.recv(op.peer_global, item.buf[head:used], tag)
        item.size = used
        return used

    def _decode(self, item: _Incoming, deadline: _Deadline, phases: dict[str, float]) -> int:
        """Wait for a whole bucket and apply it to the live tensors; return the bytes not yet
        counted."""
        got = self._resolve(item, deadline, phases)
        if item.rest is not None:
            t = time.perf_counter()
            self.transport.wait([item.rest], deadline.left())
            phases["transfer"] += time.perf_counter() - t
        t = time.perf_counter()
        self.codec.unpack(item.op, item.buf)
        phases["unpack"] += time.perf_counter() - t
        return got


class _Incoming:
    """A delta bucket being received: its directory's handle, then its rest's."""

    __slots__ = ("buf", "head", "op", "rest", "size")

    def __init__(self, op: BucketOp, buf: torch.Tensor, head: Handle) -> None:
        self.op, self.buf, self.head = op, buf, head
        self.rest: Handle | None = None
        self.size = 0
        """The bucket's encoded bytes, once its directory arrived (0 until then)."""
