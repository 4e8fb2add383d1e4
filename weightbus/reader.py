"""The inference side: ``Reader.wait()`` receives each new version in place into the engine."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch

from weightbus._session import SyncResult, _Deadline, _Session
from weightbus.errors import SyncTimeout, WeightbusError
from weightbus.plan.program import unpack

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

    def __init__(
        self, *args, on_version: Callable[[SyncResult], None] | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_version = on_version

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
            begins = control.gather(
                f"begin/{seq}",
                role="writer",
                timeout=cfg.step_timeout if timeout is None else timeout,
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
            ops = () if transport.pulls else self.ops
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
            control.gather(
                f"commit/{seq}", names=[self.plan.writers[0].name], timeout=deadline.left()
            )
            phases["control"] += time.perf_counter() - t
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
