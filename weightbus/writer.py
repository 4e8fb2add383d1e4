"""The trainer side: after each optimizer step, ``Writer.sync(version)`` sends the new weights."""

from __future__ import annotations

import logging
import time
from collections import deque

from weightbus._session import Progress, SyncResult, _Deadline, _Session
from weightbus.errors import WeightbusError
from weightbus.plan.program import pack

logger = logging.getLogger(__name__)

__all__ = ["Writer"]


class Writer(_Session):
    """One trainer participant (one process, one device).

    >>> writer = Writer(bound, ControlConfig(address="trainer0:29700", num_writers=2, num_readers=2))
    >>> writer.connect()               # every writer and reader connects; plans once
    >>> result = writer.sync(step)     # after each optimizer step
    """

    role = "writer"

    def sync(self, version: int, *, progress: Progress | None = None) -> SyncResult:
        """Send this writer's share of the weights as ``version``; return once every reader
        has received and acknowledged it and the version is committed.

        Raises :class:`~weightbus.errors.PeerFailure` naming a participant that failed or
        died, :class:`~weightbus.errors.SyncTimeout` after ``sync_timeout``.
        """
        self._require_connected()
        version = int(version)
        if self.version is not None and version <= self.version:
            raise ValueError(
                f"{self.name}: version {version} must be greater than the last, {self.version}"
            )
        cfg, control, transport = self.config, self.control, self.transport
        seq = self._seq
        deadline = _Deadline(cfg.sync_timeout)
        phases = {"plan": 0.0, "pack": 0.0, "transfer": 0.0, "unpack": 0.0, "control": 0.0}
        t_start = time.perf_counter()
        try:
            transport.begin()
            control.post(f"begin/{seq}", {"version": version})
            total = self.bytes_per_sync
            done = 0
            free = deque(self._staging)
            staged: deque = deque()  # (handle, staging buffer), oldest first
            direct: list = []  # handles of in-place sends
            tensors = self.bound.tensors
            # a pulling transport's readers copy from this writer's tensors themselves
            ops = () if transport.pulls else self.ops
            for op, live in zip(ops, self.direct[: len(ops)], strict=True):
                if live is not None:
                    # one contiguous region of a live tensor: sent in place, no staging
                    direct.append(transport.send(op.peer_global, live, op.bucket))
                else:
                    if not free:
                        # only the oldest staged send frees a buffer; in-place sends on other
                        # links go on meanwhile
                        t = time.perf_counter()
                        handle, buf = staged.popleft()
                        transport.wait([handle], deadline.left())
                        phases["transfer"] += time.perf_counter() - t
                        free.append(buf)
                    buf = free.popleft()
                    t = time.perf_counter()
                    view = buf[: op.nbytes]
                    pack(op, tensors, view)
                    phases["pack"] += time.perf_counter() - t
                    staged.append((transport.send(op.peer_global, view, op.bucket), buf))
                done += op.nbytes
                if progress is not None:
                    progress(done, total)
            if progress is not None and not ops:
                progress(total, total)
            t = time.perf_counter()
            transport.wait(direct + [h for h, _ in staged], deadline.left())
            phases["transfer"] += time.perf_counter() - t

            t = time.perf_counter()
            acks = control.gather(f"ack/{seq}", role="reader", timeout=deadline.left())
            bad = {
                name: a
                for name, a in acks.items()
                if a.get("version") != version or not a.get("ok")
            }
            if bad:
                raise WeightbusError(
                    f"{self.name}: readers did not confirm version {version}: {bad}"
                )
            if self.bound.layout.rank == 0:
                control.post(f"commit/{seq}", {"version": version})
            phases["control"] += time.perf_counter() - t
        except BaseException as exc:
            err = self._sync_failed(exc, version)
            if err is exc:
                raise
            raise err from exc
        result = self._finished(version, total, time.perf_counter() - t_start, phases)
        return result
