"""Transports move bucket bytes between two participants; this module is their shared contract.

A transport is one way of moving bytes (gloo over TCP, NCCL, CUDA IPC, RDMA). The planner
decides *what* goes where; a transport only ever sees "these bytes, to/from that peer, under
that tag". Every transport passes the same contract test (``tests/transport_contract.py``).

Lifecycle, identical for every transport::

    1. construct        t = GlooTransport(GlooConfig(...))          (local, cheap, no I/O)
    2. connect          t.connect(control, roster)
                        Collective over *all* writers and readers of the roster: every
                        participant calls it, in the same order relative to other collectives.
                        Agrees on the transport's name through the control plane (a participant
                        that picked another one raises PlanMismatch), then builds communicators.
                        Global rank = writers by rank, then readers by rank (Roster.all).
    3. register         t.register(buffers)                          (once)
                        The staging buffers, or live tensors, that sends and receives will use.
                        Transports that must pin or register memory (RDMA, IPC) do it here;
                        others only check device and layout.
       expose           t.expose(program)                            (once, every participant)
                        Collective: each participant hands over what it moves in every sync
                        (its bucket ops, live tensors, and in-place buffers: :class:`Program`).
                        Pulling transports (CUDA IPC) share the writers' tensors here and build
                        the readers' copies, so a sync needs no handshake; others ignore it.
    4. per sync         t.begin()   (writers, before announcing the sync: the data is final)
                        h = t.send(peer, buf, tag)   /   h = t.recv(peer, buf, tag)
                        or, where ``t.pulls_from(peer)``: writers post nothing for that peer
                        and h = t.pull(peer, tag) on readers copies bucket ``tag`` from writer
                        ``peer``'s tensors straight into the reader's tensors; once the sync's
                        last bucket is pulled, the reader's current CUDA stream waits for every
                        copy. One transport pulls on every link or on none (``t.pulls``); a
                        job mixing transports (:mod:`weightbus.transports.links`) does per link.
                        Post and return at once; many may be in flight, to many peers. A send
                        matches the recv posted on the peer with the same tag. Per peer and
                        direction, handles complete in posting order, so both sides post in the
                        same order (the plan's bucket order). ``buf`` must stay untouched until
                        its handle is done.
                        hs = t.send_many(peer, [(buf, tag), ...])  /  t.recv_many(...)
                        posts a group to one peer at once (NCCL: one group, one launch); both
                        sides then post the same groups (NCCL leaves differently grouped
                        operations undefined; Writer and Reader agree on them at connect).
                        t.wait(handles, timeout)
                        Blocks until every handle is done. While waiting it polls the control
                        plane: a peer that reported a failure or stopped sending heartbeats
                        raises PeerFailure (naming it) instead of blocking until the
                        transport's own timeout. On any failure it reports the failure to the
                        control plane, aborts the transport, and raises: nothing is left
                        hanging, and the transport is unusable afterwards.
    5. close / abort    t.close()  after all handles are done (aborts if some are not);
                        t.abort(reason)  tears everything down at once, pending work included.
                        Both are idempotent and never hang.

Capability flags are class attributes, read by the per-link chooser
(:func:`weightbus.transports.links.choose_links`, behind :func:`select_transport`) without
building anything. Each writer->reader link gets a transport from its class (same GPU, same
host, other host; CPU: same process, same host, other host): the highest-priority transport
whose flags carry that class (:meth:`Transport.carries`). When every link gets the same one,
that transport serves the whole job; otherwise a composite
(:class:`~weightbus.transports.links.LinksTransport`) runs each over the participants its links
join. Transports register by name; the choice is logged once per job as a table and can be
overridden by name, per link class, or with ``$WEIGHTBUS_TRANSPORT``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightbus.errors import PeerFailure, SyncTimeout, WeightbusError
from weightbus.spec import Participant

if TYPE_CHECKING:
    from weightbus.control.store import ControlPlane, Roster
    from weightbus.plan.program import BucketOp

__all__ = [
    "MAX_TAG",
    "TRANSPORT_ENV",
    "Handle",
    "Program",
    "Transport",
    "available_transports",
    "register_transport",
    "select_transport",
    "transport_class",
]

logger = logging.getLogger(__name__)

TRANSPORT_ENV = "WEIGHTBUS_TRANSPORT"
"""Environment variable naming the transport to use instead of the automatic choice."""

MAX_TAG = 2**30 - 1
"""Largest tag callers may use; transports keep the tags above it for themselves."""

_POLL_FIRST_S = 0.0005
_POLL_LAST_S = 0.05


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} B"


@dataclass(frozen=True, slots=True)
class Program:
    """What one participant moves in every sync, as built at connect (see :meth:`Transport.expose`)."""

    ops: tuple[BucketOp, ...]
    """This participant's bucket ops, in execution order (tag = ``op.bucket``)."""
    tensors: Mapping[str, torch.Tensor]
    """Its live local tensors by key (the trainer's or the engine's own storage)."""
    direct: tuple[torch.Tensor | None, ...]
    """Per op: the live contiguous bytes it moves in place, or None when it is staged."""
    ready_order: int = 0
    """A writer's: when its tensors become final in a sync relative to the job's other writers
    (lower first, e.g. the chunk index of a host source staged chunk after chunk). Pulling
    transports take sources that are ready earlier first."""


class Handle:
    """One posted send or receive; done once its bytes have left (send) or landed (recv)."""

    __slots__ = ("_error", "_event", "native", "nbytes", "op", "peer", "tag")

    def __init__(self, op: str, peer: Participant, tag: int, nbytes: int) -> None:
        self.op = op
        self.peer = peer
        self.tag = tag
        self.nbytes = nbytes
        self.native: Any = None
        self._event = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        return self._event.is_set()

    @property
    def error(self) -> BaseException | None:
        """What went wrong, once done; None on success."""
        return self._error

    def _finish(self, error: BaseException | None = None) -> None:
        if self._event.is_set():
            return
        self._error = error
        self.native = None
        self._event.set()

    def __repr__(self) -> str:
        way = "to" if self.op == "send" else "from"
        state = "failed" if self._error else "done" if self.done() else "pending"
        return f"{self.op} {way} {self.peer.role} {self.peer.name!r} (tag {self.tag}, {_mib(self.nbytes)}, {state})"


class Transport:
    """Base of every transport; see the module docstring for the lifecycle.

    Subclasses set the capability flags and implement ``_connect``, ``_send``, ``_recv``,
    ``_close`` and ``_abort`` (and ``_register`` when they pre-register memory). The base class
    validates arguments, tracks state and pending handles, and implements :meth:`wait`.
    Subclasses call ``self._completed(handle, error)`` when an operation finishes.
    """

    name: ClassVar[str] = ""
    """Registry name (``"gloo"``)."""
    devices: ClassVar[frozenset[str]] = frozenset()
    """Device types whose memory it moves directly (``{"cpu"}``, ``{"cuda"}``)."""
    cross_host: ClassVar[bool] = False
    """Whether it links participants on different hosts."""
    same_gpu_zero_copy: ClassVar[bool] = False
    """Whether two processes on one GPU exchange without a copy through the host."""
    needs_staging: ClassVar[bool] = True
    """Whether bytes must be packed into contiguous buffers (no scatter from live tensors)."""
    priority: ClassVar[int] = 0
    """Higher wins in the automatic choice among transports that can serve a job."""
    pulls: ClassVar[bool] = False
    """Whether readers copy straight out of the writers' tensors (shared at :meth:`expose`):
    writers then post no sends and pack nothing, and readers call :meth:`pull`, not recv."""
    same_process: ClassVar[bool] = False
    """Whether it links only participants that are threads of one process."""
    pack_mixed_links: ClassVar[bool] = False
    """Whether its links are planned as :attr:`~weightbus.plan.PlanOptions.pack_mixed` plans
    (``SyncConfig.pack_mixed``): every route of a link on which some large route would be
    staged on one side is packed into buckets, so that the link moves fewer, larger
    messages."""
    sends_any_buffer: ClassVar[bool] = False
    """Whether a send may read any tensor of a device it moves, not only the buffers
    :meth:`register` declared and the live tensors, at no extra cost, and keeps it alive
    until done: a writer's codec then sends what it computed where it lies, without a copy
    into a staging buffer."""

    def sends_anywhere(self) -> bool:
        """Whether this participant's sends may read any tensor (:attr:`sends_any_buffer`),
        once connected: a transport of several (one per link) says so where every transport
        it sends through does."""
        return self.sends_any_buffer

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout
        self.control: ControlPlane | None = None
        self.roster: Roster | None = None
        self.participant: Participant | None = None
        self._state = "new"
        self._abort_reason: str | None = None
        self._registered = False
        self._lock = threading.Lock()
        self._pending: dict[int, Handle] = {}
        self._failed: list[Handle] = []

    def __repr__(self) -> str:
        who = self.participant.name if self.participant else "?"
        return f"{type(self).__name__}({who!r}, {self._state})"

    # -- capabilities --------------------------------------------------------------------------

    @classmethod
    def unsupported(cls, participants: Iterable[Participant]) -> str | None:
        """Why this transport cannot link all of ``participants``, or None when it can."""
        people = list(participants)
        kinds = {torch.device(p.device).type for p in people}
        if not kinds <= cls.devices:
            odd = sorted(
                {p.device for p in people if torch.device(p.device).type not in cls.devices}
            )
            return f"{cls.name} moves {sorted(cls.devices)} memory, the job has devices {odd}"
        hosts = {p.host for p in people}
        if len(hosts) > 1 and not cls.cross_host:
            return f"{cls.name} links one host only, the job spans hosts {sorted(hosts)}"
        return None

    @classmethod
    def carries(cls, link_class: str) -> bool:
        """Whether links of ``link_class`` (:data:`weightbus.transports.links.LINK_CLASSES`)
        fit this transport's flags; :meth:`unsupported` still has the last word on a job."""
        gpu, cpu = "cuda" in cls.devices, "cpu" in cls.devices
        apart = not cls.same_process  # links separate processes
        fits = {
            "same_gpu": gpu and cls.same_gpu_zero_copy and apart,
            "same_host": gpu and apart,
            "cross_host": gpu and cls.cross_host and apart,
            "cpu_same_process": cpu,
            "cpu_same_host": cpu and apart,
            "cpu_cross_host": cpu and cls.cross_host and apart,
            "cpu_gpu": cpu and gpu and cls.cross_host and apart,
        }
        if link_class not in fits:
            raise ValueError(f"unknown link class {link_class!r}; the classes are {sorted(fits)}")
        return fits[link_class]

    def pulls_from(self, peer: Participant | str | int) -> bool:
        """Whether this participant's link with ``peer`` pulls (the reader copies straight
        from the writer's tensors: :meth:`pull`) rather than pushes (:meth:`send` /
        :meth:`recv`). One transport does the same on every link (:attr:`pulls`)."""
        return self.pulls

    # -- lifecycle -----------------------------------------------------------------------------

    def connect(self, control: ControlPlane, roster: Roster | Iterable[Participant]) -> None:
        """Collective over all writers and readers: agree on the transport, build communicators.

        ``roster`` is the control plane's roster, or the same participants in any order
        (``TransferPlan.participants``); it must match who registered with the control plane.
        """
        from weightbus.control.store import Roster

        if self._state != "new":
            raise WeightbusError(f"{self!r}: connect() may be called once, on a new transport")
        if not isinstance(roster, Roster):
            roster = Roster.of(roster)
        registered = control.participants()
        if roster.names() != registered.names():
            raise ValueError(
                f"{self.name}: connect() was given participants {roster.names()}, but the control "
                f"plane has {registered.names()}: pass control.participants()"
            )
        me = control.participant
        if me.name not in roster:
            raise ValueError(f"{me.name!r} is not in the roster {roster.names()}")
        reason = self.unsupported(roster.all)
        if reason is not None:
            raise ValueError(f"{reason}: choose another transport (select_transport lists them)")
        self.control, self.roster, self.participant = control, roster, me
        if self.timeout is None:
            self.timeout = control.config.timeout
        self._state = "connecting"
        try:
            control.agree(f"transport/{control.sequence('transport')}", self.name)
            self._connect()
        except BaseException as e:
            self.abort(f"connect failed: {e}")
            raise
        self._state = "connected"
        logger.debug("weightbus %s: %s connected to %d peers", self.name, me.name, roster.size - 1)

    def register(self, buffers: Sequence[torch.Tensor]) -> None:
        """Declare, once, the buffers sends and receives will use (staging or live tensors)."""
        self._require_connected()
        if self._registered:
            raise WeightbusError(f"{self!r}: register() was already called; call it once")
        for i, buf in enumerate(buffers):
            self._check_buffer(buf, f"buffer {i}")
        self._register(list(buffers))
        self._registered = True

    def expose(self, program: Program) -> None:
        """Step 3b, collective over every participant: what this participant moves in every
        sync. Pulling transports share or map memory here; the default does nothing."""
        self._require_connected()

    def begin(self) -> None:
        """Called by a writer at the start of each sync, once its tensors hold the new
        version and before the readers are told; the default does nothing."""

    def send(self, peer: Participant | str | int, buf: torch.Tensor, tag: int) -> Handle:
        """Post sending all of ``buf`` to ``peer`` under ``tag``; returns at once.

        ``peer`` is a Participant, a name, or a global rank (index in ``Roster.all``).
        """
        self._refuse_if_pulling("send")
        return self._post("send", peer, buf, tag)

    def recv(self, peer: Participant | str | int, buf: torch.Tensor, tag: int) -> Handle:
        """Post receiving into all of ``buf`` from ``peer`` under ``tag``; returns at once."""
        self._refuse_if_pulling("recv")
        return self._post("recv", peer, buf, tag)

    def send_many(
        self, peer: Participant | str | int, items: Sequence[tuple[torch.Tensor, int]]
    ) -> list[Handle]:
        """Post sending each ``(buf, tag)`` of ``items`` to ``peer``, in order, as :meth:`send`
        posts one; returns their handles. A transport may post them as one group (NCCL: one
        launch for all), so every buffer must be ready when this is called, and the peer
        posts the matching receives as one group too (:meth:`recv_many` with the same items:
        NCCL leaves operations grouped differently on the two sides undefined). Every
        argument is checked before anything is posted."""
        self._refuse_if_pulling("send")
        return self._post_many("send", peer, items)

    def recv_many(
        self, peer: Participant | str | int, items: Sequence[tuple[torch.Tensor, int]]
    ) -> list[Handle]:
        """Post receiving into each ``(buf, tag)`` of ``items`` from ``peer``, in order: the
        peer's :meth:`send_many` of the same group (see there)."""
        self._refuse_if_pulling("recv")
        return self._post_many("recv", peer, items)

    def groups_with(self, peer: Participant | str | int) -> bool:
        """Whether this participant can post operations to ``peer`` in groups (the default
        posts a group's operations one at a time, which any grouping on the peer matches).
        Writer and Reader tell each other at connect, so a side that cannot group makes both
        post singly."""
        return True

    def _refuse_if_pulling(self, op: str) -> None:
        if self.pulls:
            raise WeightbusError(
                f"{self.name}: readers pull buckets straight into their tensors, nothing is "
                f"{op}: post pull(peer, tag) after expose() (Writer and Reader do)"
            )

    def pull(self, peer: Participant | str | int, tag: int) -> Handle:
        """Pulling transports, on a reader: post copying bucket ``tag`` of writer ``peer`` into
        this reader's tensors, as exposed; returns at once."""
        if not self.pulls:
            raise WeightbusError(f"{self.name} does not pull: post recv() for each bucket")
        return self._post("pull", peer, None, tag)

    def done_event(self, handle: Handle) -> torch.cuda.Event | None:
        """A CUDA event that fires once ``handle``'s operation is done on its GPU (a receive's
        bytes in place), so that later GPU work can wait for it without the host; None where
        this transport has none or the operation is done already (then :meth:`Handle.done`
        says which). Lets a reader sum what it received in place while later buckets are
        still arriving."""
        return None

    def wait(self, handles: Iterable[Handle], timeout: timedelta | None = None) -> None:
        """Block until every handle is done; raise PeerFailure / SyncTimeout and abort on failure."""
        self._require_connected()
        handles = list(handles)
        assert self.control is not None and self.timeout is not None
        seconds = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + seconds
        delay = _POLL_FIRST_S
        first = 0
        try:
            while True:
                self._raise_if_lost()
                while first < len(handles) and self._settled(handles[first]):
                    first += 1
                if first == len(handles):
                    bad = [h for h in handles if h.error is not None]
                    if bad:
                        self._lost_by(bad[0])
                    return
                self.control.raise_if_failed()
                now = time.monotonic()
                if now >= deadline:
                    self._give_up(self._timeout(handles[first:], seconds))
                handles[first]._event.wait(min(delay, deadline - now))
                delay = min(delay * 2, _POLL_LAST_S)
        except (PeerFailure, SyncTimeout) as e:
            self.abort(str(e))  # a peer's failure: reported already, so only tear down
            raise
        except BaseException as e:  # interrupted: still leave nothing in flight
            self._give_up(e)

    def _settled(self, handle: Handle) -> bool:
        """In :meth:`wait`: whether ``handle`` is done, asking the transport itself when its
        background thread has not said so yet (see :meth:`_settle`)."""
        if not handle.done():
            self._settle(handle)
        return handle.done()

    def _settle(self, handle: Handle) -> None:
        """Mark ``handle`` done now if the transport can tell, from the waiting thread, that it
        finished (NCCL: its CUDA event). The default leaves it to the transport's own thread."""

    def _raise_if_lost(self) -> None:
        """In :meth:`wait`: raise if this transport saw an operation fail (a composite
        transport asks each of its own)."""
        if self._failed:
            self._lost(self._failed[0])

    def _lost_by(self, handle: Handle) -> None:
        """In :meth:`wait`: raise for ``handle``, which failed, as the transport that carried
        it does (see :meth:`_lost`)."""
        self._lost(handle)

    def close(self) -> None:
        """Release everything; aborts first if operations are still pending. Idempotent."""
        if self._state in ("closed", "aborted"):
            return
        with self._lock:
            pending = len(self._pending)
        if pending:
            self.abort(f"closed with {pending} operations pending")
            return
        self._state = "closed"
        self._close()

    def abort(self, reason: str = "aborted") -> None:
        """Tear down at once, pending work included; the transport is unusable afterwards."""
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        self._abort_reason = reason
        logger.debug("weightbus %s: aborting: %s", self.name, reason)
        try:
            self._abort(reason)
        finally:
            with self._lock:
                left = list(self._pending.values())
                self._pending.clear()
            for h in left:
                if not h.done():
                    h._finish(WeightbusError(f"aborted: {reason}"))

    # -- for subclasses ------------------------------------------------------------------------

    def _connect(self) -> None:
        raise NotImplementedError

    def _register(self, buffers: list[torch.Tensor]) -> None:
        """Pre-register memory; the default keeps nothing."""

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        raise NotImplementedError

    def _recv(self, handle: Handle, buf: torch.Tensor) -> None:
        raise NotImplementedError

    def _pull(self, handle: Handle) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _abort(self, reason: str) -> None:
        raise NotImplementedError

    def _explain(self, error: BaseException) -> str:
        """One line saying what a native error means; override for known messages."""
        text = str(error).strip()
        return text.splitlines()[0] if text else type(error).__name__

    def _completed(self, handle: Handle, error: BaseException | None = None) -> None:
        """Mark ``handle`` done (from any thread)."""
        with self._lock:
            self._pending.pop(id(handle), None)
            if error is not None and self._state != "aborted":
                self._failed.append(handle)
        handle._finish(error)

    # -- internals -----------------------------------------------------------------------------

    def _require_connected(self) -> None:
        if self._state != "connected":
            extra = f" ({self._abort_reason})" if self._abort_reason else ""
            raise WeightbusError(
                f"{self!r} is {self._state}{extra}: "
                + ("call connect() first" if self._state == "new" else "build a new transport")
            )

    def _check_buffer(self, buf: torch.Tensor, what: str) -> None:
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{self.name}: {what} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.device.type not in self.devices:
            raise ValueError(
                f"{self.name}: {what} lives on {buf.device}, this transport moves "
                f"{sorted(self.devices)} memory: stage it there or choose another transport"
            )
        if not buf.is_contiguous():
            raise ValueError(
                f"{self.name}: {what} (shape {tuple(buf.shape)}, stride {buf.stride()}) is not "
                "contiguous: pass a contiguous staging buffer"
            )

    def _peer(self, peer: Participant | str | int) -> Participant:
        assert self.roster is not None
        if isinstance(peer, Participant):
            return self.roster[peer.name]
        if isinstance(peer, str):
            return self.roster[peer]
        if isinstance(peer, int) and not isinstance(peer, bool):
            if not 0 <= peer < self.roster.size:
                raise ValueError(
                    f"{self.name}: peer rank {peer} is outside the job's {self.roster.size} "
                    "participants (global ranks: writers, then readers)"
                )
            return self.roster.all[peer]
        raise TypeError(f"peer must be a Participant, a name or a global rank, got {peer!r}")

    def _post(
        self, op: str, peer: Participant | str | int, buf: torch.Tensor | None, tag: int
    ) -> Handle:
        return self._post_many(op, peer, [(buf, tag)])[0]

    def _post_many(
        self,
        op: str,
        peer: Participant | str | int,
        items: Sequence[tuple[torch.Tensor | None, int]],
    ) -> list[Handle]:
        self._require_connected()
        assert self.roster is not None and self.participant is not None
        target = self._peer(peer)
        name = target.name
        if target.name == self.participant.name:
            raise ValueError(f"{self.name}: {op} to itself ({name!r}); copy locally instead")
        handles, bufs = [], []
        for buf, tag in items:
            if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
                raise ValueError(f"{self.name}: tag {tag!r} must be an int in [0, {MAX_TAG}]")
            if buf is not None:
                self._check_buffer(buf, f"{op} buffer for {name!r} (tag {tag})")
            nbytes = 0 if buf is None else buf.numel() * buf.element_size()
            handles.append(Handle(op, target, tag, nbytes))
            bufs.append(buf)
        with self._lock:
            for handle in handles:
                self._pending[id(handle)] = handle
        try:
            self._issue_many(handles, bufs)
        except Exception as e:
            # posting can fail too, e.g. on a connection the peer already closed; the
            # transport is given up on below, so every handle of the group fails with it,
            # but for those that completed before it (a receive that landed)
            with self._lock:
                for handle in handles:
                    self._pending.pop(id(handle), None)
            for handle in handles:
                handle._finish(e)
            self._lost(next(h for h in handles if h.error is not None))
        return handles

    def _issue_many(self, handles: list[Handle], bufs: list[torch.Tensor | None]) -> None:
        """Post ``handles`` (one peer, one kind of operation, in order) with their buffers
        (None for pulls). The default posts each through ``_send`` / ``_recv`` / ``_pull``;
        a transport that can post a group at once overrides this."""
        for handle, buf in zip(handles, bufs, strict=True):
            if buf is None:
                self._pull(handle)
            elif handle.op == "send":
                self._send(handle, buf)
            else:
                self._recv(handle, buf)

    def _lost(self, handle: Handle) -> None:
        """Raise for a failed operation: the peer's own report if it made one, else ours."""
        assert self.control is not None and handle.error is not None
        try:
            # the peer's own report says more than "connection closed"
            self.control.raise_if_failed(fresh=True)
        except PeerFailure as e:
            self.abort(str(e))
            raise e from handle.error
        me = self.participant
        assert me is not None
        why = self._explain(handle.error)
        try:
            if self.control.has_closed(handle.peer.name):
                why = f"the peer closed its control plane and left the job ({why})"
        except PeerFailure:
            pass  # the store is gone too; the transport's own error still says what happened
        text = f"{self.name}: {me.role} {me.name!r} lost {handle!r}: {why}"
        self._give_up(PeerFailure(text, [(handle.peer.name, text)]), cause=handle.error)

    def _give_up(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Report a failure seen here to every participant, abort, raise."""
        assert self.control is not None
        text = (
            str(error)
            if isinstance(error, (PeerFailure, SyncTimeout))
            else f"{type(error).__name__}: {error}"
        )
        self.control.fail(text)
        self.abort(text)
        if cause is not None:
            raise error from cause
        raise error

    def _timeout(self, pending: list[Handle], seconds: float) -> SyncTimeout:
        me = self.participant
        assert me is not None
        shown = ", ".join(repr(h) for h in pending[:5])
        more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
        peers = list(dict.fromkeys(h.peer.name for h in pending))
        return SyncTimeout(
            f"{self.name}: {me.role} {me.name!r} timed out after {seconds:.1f} s with "
            f"{len(pending)} operations pending: {shown}{more}. The peers' heartbeats are fresh, "
            "so they are alive but did not post the matching operations: check that both sides "
            "post the same tags in the same order, or raise the timeout",
            peers,
        )


# ---------------------------------------------------------------------------------------------
# registry and choice
# ---------------------------------------------------------------------------------------------

_BUILTIN: dict[str, str] = {
    "gloo": "weightbus.transports.gloo:GlooTransport",
    "nccl": "weightbus.transports.nccl:NcclTransport",
    "cuda_ipc": "weightbus.transports.cuda_ipc:CudaIpcTransport",
    "local": "weightbus.transports.local:LocalTransport",
}
_REGISTRY: dict[str, type[Transport]] = {}


def register_transport(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Transport)) or not cls.name:
        raise TypeError(f"{cls!r} must be a Transport subclass with a non-empty name")
    old = _REGISTRY.get(cls.name)
    if old is not None and old is not cls:
        raise ValueError(
            f"transport name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}"
        )
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    for name, target in _BUILTIN.items():
        if name not in _REGISTRY:
            module, _, attr = target.partition(":")
            register_transport(getattr(importlib.import_module(module), attr))


def available_transports() -> list[str]:
    """Names of all known transports, highest priority first."""
    _load_builtins()
    return [c.name for c in sorted(_REGISTRY.values(), key=lambda c: (-c.priority, c.name))]


def transport_class(name: str) -> type[Transport]:
    """The transport class registered as ``name``."""
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; known: {available_transports()}")
    return _REGISTRY[name]


def select_transport(
    name: str | Mapping[str, str] | None = None,
    participants: Roster | Iterable[Participant] | Any = (),
    participant: Participant | None = None,
    **config: Any,
) -> Transport:
    """A new, unconnected transport for a job.

    ``name`` (or ``$WEIGHTBUS_TRANSPORT``) picks one by name for every link, or per link class
    (``{"same_host": "nccl"}``, or ``"same_host=nccl"``); None or ``"auto"`` chooses for each
    writer->reader link the highest-priority transport that carries its class (see
    :func:`weightbus.transports.links.choose_links`). ``participants`` is a :class:`Roster`,
    participants, or anything with a ``participants`` attribute (a ``TransferPlan``, whose
    buckets then say which links exist; otherwise every writer links every reader).
    ``participant`` is this process (checked to be among them). ``config`` goes to the
    transport's constructor (each transport's, when links get different ones). The choice is
    logged once, as a table of link classes.

    When every link gets the same transport, it is returned as it is; otherwise a
    :class:`~weightbus.transports.links.LinksTransport` holding one per name. The choice is
    a pure function of the participants (and the transports installed), so every process
    makes the same one; :meth:`Transport.connect` checks that they did.
    """
    from weightbus.transports.links import build_transport, choose_links

    choice = choose_links(participants, transport=name)
    if participant is not None and participant.name not in {p.name for p in choice.participants}:
        raise ValueError(f"{participant.name!r} is not among the participants")
    choice.log()
    return build_transport(choice, **config)
