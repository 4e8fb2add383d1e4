"""gloo: CPU bytes between processes over TCP, on any hosts.

A ``ProcessGroupGloo`` of its own, built straight from a ``PrefixStore`` over the control
plane's TCPStore (never the default process group), with global ranks writers-then-readers.
Sends and receives are gloo's unbound-buffer operations, tagged, many in flight at once.

Two facts about gloo shape this module (measured on torch 2.13):

* A send/recv ``Work`` only learns it is complete inside ``wait()``; ``is_completed()`` stays
  False until then, and there is no future. So each (peer, direction) gets a waiter thread
  that calls ``wait()`` on its handles in posting order (gloo releases the GIL meanwhile).
* gloo has no abort for a group (``abort()`` and ``shutdown()`` do nothing), but a wait that
  passes its *own* timeout closes every connection of the group ("Application timeout caused
  pair closure"): all pending operations here fail at once, and every peer sees "Connection
  closed by peer" on its operations with us. :meth:`GlooTransport._abort` uses exactly that: a
  1 ms wait on a receive that can never match. It must be posted on a connection that is still
  open (on one the peer already closed, posting fails at once and closes nothing), so it tries
  the peers in turn. A process whose peer died, or that gives up, so tears down within
  milliseconds and can exit. A peer that dies (even by SIGKILL) closes its sockets, so
  operations with it fail at once too, and so does posting a new one.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from weightbus.errors import SyncTimeout, WeightbusError
from weightbus.transports.base import MAX_TAG, Handle, Transport, register_transport

if TYPE_CHECKING:
    from weightbus.control.store import ControlPlane

__all__ = ["GlooConfig", "GlooTransport"]

logger = logging.getLogger(__name__)

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""gloo's own variable naming the network interface(s) to use (torch reads it too)."""

# A tag above every caller's (MAX_TAG) that no one ever sends on: waiting on it can only time out.
_ABORT_TAG = 2**31 - 1
assert _ABORT_TAG > MAX_TAG


@dataclass(frozen=True, slots=True, kw_only=True)
class GlooConfig:
    """How the gloo transport binds and how long gloo itself may wait."""

    timeout: timedelta | None = None
    """Bound on connecting and on one send/recv inside gloo; None: the control plane's timeout."""
    hostname: str | None = None
    """Address to bind and advertise to peers; None: ``interface``, else this host's name."""
    interface: str | None = field(default_factory=lambda: os.environ.get(GLOO_IFNAME_ENV) or None)
    """Network interface to bind (``"eth0"``); default ``$GLOO_SOCKET_IFNAME`` (first entry)."""

    def __post_init__(self) -> None:
        if self.timeout is not None and (
            not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0
        ):
            raise ValueError(
                f"timeout={self.timeout!r} must be a positive datetime.timedelta or None"
            )
        if self.hostname and self.interface:
            logger.warning(
                "weightbus gloo: hostname %r is set, so interface %r is ignored",
                self.hostname,
                self.interface,
            )
        if self.interface is not None and "," in self.interface:
            first = self.interface.split(",")[0].strip()
            logger.warning(
                "weightbus gloo: interface %r lists several; using the first, %r",
                self.interface,
                first,
            )
            object.__setattr__(self, "interface", first)


class _Rendezvous(dist.Store):
    """The store gloo's rendezvous talks to.

    gloo blocks in ``wait``/``get`` until every rank has published its address. Here those
    calls poll instead, asking the control plane between polls, so a participant that failed or
    died before joining raises PeerFailure out of the ``ProcessGroupGloo`` constructor at once.
    Nothing is left blocked on a socket: a thread stuck in a store call that returns while the
    interpreter shuts down kills the process ("terminate called without an active exception").
    """

    def __init__(self, inner: dist.Store, control: ControlPlane, timeout: timedelta) -> None:
        super().__init__()
        self._inner, self._control, self._timeout = inner, control, timeout

    def _wait(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self._timeout.total_seconds()
        delay = 0.001
        while not self._inner.check(keys):
            self._control.raise_if_failed()
            if time.monotonic() >= deadline:
                raise SyncTimeout(
                    f"gloo: {self._control.participant.name!r} waited "
                    f"{self._timeout.total_seconds():.1f} s for {self._who(keys)} to join the "
                    "gloo group; every participant must build the transport (their heartbeats "
                    "are fresh, so they are alive but elsewhere)",
                    self._who(keys, names=True),
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _who(self, keys: list[str], names: bool = False) -> Any:
        roster = self._control.roster
        found = []
        for key in keys:
            if self._inner.check([key]):
                continue
            tail = key.rsplit("/", 1)[-1]
            if roster is not None and tail.isdigit() and int(tail) < roster.size:
                found.append(roster.all[int(tail)].name)
            else:
                found.append(key)
        return found if names else ", ".join(repr(n) for n in found)

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys))

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(list(keys))
        return self._inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._inner.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def append(self, key: str, value: Any) -> None:
        self._inner.append(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()


class _Waiter:
    """A thread that waits, in posting order, on the operations with one peer in one direction."""

    def __init__(self, transport: GlooTransport, label: str) -> None:
        self.queue: queue.SimpleQueue[Handle | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, args=(transport,), name=f"weightbus-gloo-{label}", daemon=True
        )
        self.thread.start()

    def _run(self, transport: GlooTransport) -> None:
        while True:
            handle = self.queue.get()
            if handle is None:
                return
            native = handle.native
            if native is None:  # already finished by an abort
                continue
            try:
                native[0].wait()
                error = None
            except Exception as e:
                error = e
            transport._completed(handle, error)


@register_transport
class GlooTransport(Transport):
    """CPU memory between any two processes, on one host or across hosts, over TCP."""

    name = "gloo"
    devices = frozenset({"cpu"})
    cross_host = True
    same_gpu_zero_copy = False
    needs_staging = True
    sends_any_buffer = True
    priority = 0

    def __init__(self, config: GlooConfig | None = None, **fields: Any) -> None:
        if config is not None and fields:
            raise TypeError("pass either a GlooConfig or its fields as keywords, not both")
        self.config = config if config is not None else GlooConfig(**fields)
        super().__init__(self.config.timeout)
        self._pg: ProcessGroupGloo | None = None
        self._rank = -1
        self._size = 0
        self._waiters: dict[tuple[int, str], _Waiter] = {}

    # -- connect -------------------------------------------------------------------------------

    def _options(self, timeout: timedelta) -> ProcessGroupGloo._Options:
        cfg = self.config
        if cfg.hostname:
            device = ProcessGroupGloo.create_device(hostname=cfg.hostname)
        elif cfg.interface:
            device = ProcessGroupGloo.create_device(interface=cfg.interface)
        else:
            device = ProcessGroupGloo.create_default_device()
        options = ProcessGroupGloo._Options()
        # exactly one device, so one gloo context: one timed-out wait in _abort tears it all down
        options._devices = [device]
        options._timeout = timeout
        options._threads = 2
        return options

    def _connect(self) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert control is not None and roster is not None and me is not None
        assert self.timeout is not None
        self._rank, self._size = roster.global_rank(me.name), roster.size
        store = _Rendezvous(control.substore("gloo"), control, self.timeout)
        t0 = time.monotonic()
        try:
            self._pg = ProcessGroupGloo(store, self._rank, self._size, self._options(self.timeout))
        except WeightbusError:
            raise
        except Exception as e:
            raise WeightbusError(
                f"gloo: {me.name!r} (global rank {self._rank} of {self._size}) could not connect: "
                f"{self._explain(e)}; check the network between hosts and GlooConfig.hostname / "
                f"interface (or ${GLOO_IFNAME_ENV})"
            ) from e
        logger.debug(
            "weightbus gloo: %s is rank %d of %d, connected in %.2f s",
            me.name,
            self._rank,
            self._size,
            time.monotonic() - t0,
        )

    # -- data ----------------------------------------------------------------------------------

    def _post_native(self, handle: Handle, buf: torch.Tensor) -> None:
        assert self._pg is not None and self.roster is not None
        peer = self.roster.global_rank(handle.peer.name)
        flat = buf.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        op = self._pg.send if handle.op == "send" else self._pg.recv
        work = op([flat], peer, handle.tag)
        # the handle keeps the byte view (and so the caller's storage) alive until done
        handle.native = (work, flat)
        key = (peer, handle.op)
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = _Waiter(self, f"{handle.op}-{handle.peer.name}")
        waiter.queue.put(handle)

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        self._post_native(handle, buf)

    def _recv(self, handle: Handle, buf: torch.Tensor) -> None:
        self._post_native(handle, buf)

    def _explain(self, error: BaseException) -> str:
        text = super()._explain(error)
        closed = re.search(r"Connection (closed by peer|reset by peer)[^.]*", text)
        if closed:
            return f"the connection closed: the peer exited, crashed or aborted (gloo: {closed[0]})"
        if "Application timeout caused pair closure" in text:
            return "this process tore the gloo group down (an abort, or gloo's own timeout)"
        if "Timed out" in text:
            return f"gloo's own timeout passed (GlooConfig.timeout): {text}"
        return text

    # -- teardown ------------------------------------------------------------------------------

    def _stop_waiters(self, wait_s: float) -> None:
        waiters, self._waiters = list(self._waiters.values()), {}
        for w in waiters:
            w.queue.put(None)
        deadline = time.monotonic() + wait_s
        for w in waiters:
            w.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(w.thread.is_alive() for w in waiters)
        if stuck:
            logger.warning("weightbus gloo: %d waiter threads still blocked after teardown", stuck)

    def _close(self) -> None:
        self._stop_waiters(5.0)
        self._pg = None

    def _abort(self, reason: str) -> None:
        pg = self._pg
        # Only a wait that times out on a live connection closes the whole group; on a pair the
        # peer already closed it fails at once and closes nothing, so go on to the next peer.
        for step in range(1, self._size if pg is not None else 0):
            other = (self._rank + step) % self._size
            try:
                pg.recv([torch.empty(1, dtype=torch.uint8)], other, _ABORT_TAG).wait(
                    timedelta(milliseconds=1)
                )
            except Exception as e:
                logger.debug("weightbus gloo: teardown via rank %d: %s", other, self._explain(e))
                if "Timed out" in str(e):
                    break
        self._stop_waiters(5.0)
        self._pg = None
