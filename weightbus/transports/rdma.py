"""rdma: one-sided writes between processes on any hosts, through NIXL (UCX underneath).

NIXL (``pip install nixl``, the ``rdma`` extra) is NVIDIA's transfer library: it registers
memory once and moves it with one-sided reads and writes over a backend. This transport uses
its UCX backend, which takes RDMA verbs where there is an RDMA NIC and TCP where there is not;
``RdmaConfig.ucx_tls="tcp"`` forces TCP (the tests do, on loopback and across network
namespaces). Why NIXL and not Mooncake's transfer engine: README, "RDMA transport".

How one bucket moves (the reader's buffer is the target of a one-sided write)::

    reader  recv(writer, buf, tag)  -> notification READY(tag, address, length, device, epoch)
    writer  send(reader, buf, tag)  ... once READY(tag) is in: WRITE buf -> (address, length),
                                        NIXL notifies DONE(tag) after the bytes landed
    writer  handle done when its WRITE completes; reader handle done when DONE(tag) arrives

The READY notice is what lets a reader decide when its buffer may be overwritten (a live
engine tensor only once the sync began). Notifications are a kind byte plus fixed-width
little-endian fields (:data:`_READY`, :data:`_DONE`), never pickled objects.

Memory is registered once: staging buffers at :meth:`register`, every contiguous live tensor
at :meth:`expose` (in-place sends read from them, in-place receives land in them), and any
other buffer the first time it is used. A remote writer can only write where it knows the
reader's registrations, so every registration republishes this agent's metadata under a new
*epoch* (a store key); READY carries the reader's epoch, and a writer that has an older one
loads the newer metadata before it writes.

Threads: one progress thread per transport does every agent call of a sync (posting writes,
notifications, polling) in order; posting only queues work for it. CUDA buffers: a send waits
for the work queued on the caller's stream (the pack) before it writes, a receive before it
announces READY (an unpack still reading the buffer); the GPU path is written but has not run
on GPUs yet.

Failures: UCX reports transfers to a dead peer as errors (error handling mode "peer") and the
base class's wait notices a dead peer's heartbeats or a reported failure; :meth:`_abort` stops
the progress thread and releases everything without waiting on any peer.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import struct
import threading
import uuid
from bisect import bisect_right
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from weightbus.errors import ProtocolError, WeightbusError
from weightbus.transports.base import Handle, Program, Transport, register_transport

__all__ = ["RdmaConfig", "RdmaTransport", "UCX_TLS_ENV", "DEVICES_ENV", "nixl_available"]

logger = logging.getLogger(__name__)

UCX_TLS_ENV = "WEIGHTBUS_RDMA_UCX_TLS"
"""Default of :attr:`RdmaConfig.ucx_tls` (e.g. ``tcp``)."""
DEVICES_ENV = "WEIGHTBUS_RDMA_DEVICES"
"""Default of :attr:`RdmaConfig.devices` (e.g. ``mlx5_0:1`` or ``eth1``)."""

# notifications: kind byte, then fixed fields
_READY = struct.Struct("<cIQQiBQ")  # b"R", tag, address, length, device index, is_cuda, epoch
_DONE = struct.Struct("<cI")  # b"D", tag
_ERROR = struct.Struct("<cI")  # b"E", tag, then a UTF-8 message

_IDLE_FIRST_S = 20e-6
_IDLE_LAST_S = 2e-3


def nixl_available() -> bool:
    """Whether the NIXL Python package is installed (``pip install nixl``)."""
    return importlib.util.find_spec("nixl") is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class RdmaConfig:
    """How the rdma transport starts its NIXL agent."""

    timeout: timedelta | None = None
    """Bound on connecting and on one transfer; None: the control plane's timeout."""
    ucx_tls: str | None = field(default_factory=lambda: os.environ.get(UCX_TLS_ENV) or None)
    """UCX transports to use (sets ``$UCX_TLS`` for this process before the agent starts):
    ``"tcp"`` for TCP only; None (default ``$WEIGHTBUS_RDMA_UCX_TLS``): UCX's own choice,
    RDMA verbs where an RDMA NIC is present."""
    devices: str | None = field(default_factory=lambda: os.environ.get(DEVICES_ENV) or None)
    """Network devices UCX may use (``"mlx5_0:1"``, ``"eth1"``; comma-separated); None
    (default ``$WEIGHTBUS_RDMA_DEVICES``): all."""

    def __post_init__(self) -> None:
        if self.timeout is not None and (
            not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0
        ):
            raise ValueError(
                f"timeout={self.timeout!r} must be a positive datetime.timedelta or None"
            )
        for name in ("ucx_tls", "devices"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}={value!r} must be a non-empty string or None")


@dataclass(slots=True)
class _Post:
    """A send or receive waiting for the progress thread."""

    handle: Handle
    buf: torch.Tensor
    agent: str
    """The peer's NIXL agent name."""
    event: Any = None
    """CUDA event marking the caller's work on ``buf`` so far, or None (CPU)."""


@dataclass(slots=True)
class _Ready:
    """A reader's announcement: where the bytes of one tag go."""

    address: int
    length: int
    device: int
    cuda: bool
    epoch: int


def _mem(buf: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", buf.device.index or 0) if buf.is_cuda else ("DRAM", 0)


@register_transport
class RdmaTransport(Transport):
    """CPU or GPU memory between any two processes, on one host or across hosts, by one-sided
    writes through NIXL. Chosen by name only (``transport="rdma"``) for now."""

    name = "rdma"
    devices = frozenset({"cpu", "cuda"})
    cross_host = True
    same_gpu_zero_copy = False
    needs_staging = True
    priority = -1  # never the automatic choice until it has run on RDMA hardware

    def __init__(self, config: RdmaConfig | None = None, **fields: Any) -> None:
        if config is not None and fields:
            raise TypeError("pass either an RdmaConfig or its fields as keywords, not both")
        self.config = config if config is not None else RdmaConfig(**fields)
        super().__init__(self.config.timeout)
        self._agent: Any = None
        self._me = ""  # this participant's agent name
        self._peers: dict[str, str] = {}  # participant name -> agent name
        self._who: dict[str, str] = {}  # agent name -> participant name
        self._loaded: dict[str, int] = {}  # agent name -> metadata epoch loaded
        self._epoch = 0
        self._store: Any = None
        self._prefix = ""
        self._regs: list[Any] = []
        self._regions: list[tuple[int, int, bool, int]] = []  # (start, end, cuda, device), sorted
        self._agent_lock = threading.Lock()
        self._queue: collections.deque[_Post] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # progress-thread state
        self._announce: list[_Post] = []  # receives whose READY is not sent yet
        self._expect: dict[tuple[str, int], collections.deque[_Post]] = {}  # awaiting DONE
        self._sends: dict[tuple[str, int], collections.deque[_Post]] = {}  # awaiting READY
        self._readies: dict[tuple[str, int], collections.deque[_Ready]] = {}
        self._writes: list[tuple[Any, _Post]] = []  # (NIXL transfer handle, post) in flight

    @classmethod
    def unsupported(cls, participants) -> str | None:
        if not nixl_available():
            return "rdma needs the NIXL library: pip install 'weightbus[rdma]' (or nixl)"
        return super().unsupported(participants)

    # -- connect -------------------------------------------------------------------------------

    def _connect(self) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert control is not None and roster is not None and me is not None
        cfg = self.config
        if cfg.ucx_tls:
            old = os.environ.get("UCX_TLS")
            if old and old != cfg.ucx_tls:
                logger.warning(
                    "weightbus rdma: $UCX_TLS=%r is replaced by RdmaConfig.ucx_tls=%r",
                    old,
                    cfg.ucx_tls,
                )
            os.environ["UCX_TLS"] = cfg.ucx_tls
        from nixl._api import nixl_agent, nixl_agent_config

        self._me = f"{me.name}.{uuid.uuid4().hex[:8]}"
        params = {"ucx_devices": cfg.devices} if cfg.devices else {}
        agent = nixl_agent(self._me, nixl_agent_config(backends=[]))
        try:
            agent.create_backend("UCX", params)
        except Exception as e:
            raise WeightbusError(
                f"rdma: {me.name!r} could not start NIXL's UCX backend ({self._explain(e)}); "
                "check RdmaConfig.devices and ucx_tls"
            ) from e
        self._agent = agent
        seq = control.sequence("rdma")
        self._prefix = f"rdma/{seq}"
        self._store = control.substore("rdma")
        # everyone needs the other side's agents: writers write into readers, readers notify
        # writers
        other = "reader" if me.role == "writer" else "writer"
        control.post(
            f"{self._prefix}/agent", self._me.encode() + b"\0" + agent.get_agent_metadata()
        )
        got = control.gather(f"{self._prefix}/agent", role=other, timeout=self.timeout)
        for name, blob in got.items():
            agent_name, meta = _agent_blob(blob, name, f"{self._prefix}/agent")
            loaded = agent.add_remote_agent(meta)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != agent_name:
                raise WeightbusError(
                    f"rdma: {name!r} published agent {agent_name!r} but its metadata "
                    f"names {loaded!r}"
                )
            self._peers[name], self._who[loaded] = loaded, name
            self._loaded[loaded] = 0
        # nobody announces before every peer has loaded everyone's agent
        control.barrier(f"{self._prefix}/loaded", timeout=self.timeout)
        self._thread = threading.Thread(
            target=self._run, name=f"weightbus-rdma-{me.name}", daemon=True
        )
        self._thread.start()
        logger.debug("weightbus rdma: %s connected as agent %s", me.name, self._me)

    # -- memory --------------------------------------------------------------------------------

    def _register(self, buffers: list[torch.Tensor]) -> None:
        self._register_regions(buffers)

    def expose(self, program: Program) -> None:
        super().expose(program)
        # in-place sends and receives use views of the live tensors: register them whole
        live = [t.detach() for t in program.tensors.values() if t.is_contiguous()]
        self._register_regions(live)

    def _covered(self, buf: torch.Tensor) -> bool:
        start, cuda, dev = buf.data_ptr(), buf.is_cuda, _mem(buf)[1]
        end = start + buf.numel() * buf.element_size()
        i = bisect_right(self._regions, (start, float("inf"))) - 1
        return i >= 0 and self._regions[i][1] >= end and self._regions[i][2:] == (cuda, dev)

    def _register_regions(self, tensors: list[torch.Tensor]) -> None:
        """Register the tensors not yet covered, then publish the agent's metadata anew."""
        new = [
            t
            for t in tensors
            if t.device.type in self.devices and t.numel() > 0 and not self._covered(t)
        ]
        # one registration per distinct storage range
        seen: dict[tuple[int, int, bool, int], torch.Tensor] = {}
        for t in new:
            start = t.data_ptr()
            key = (start, start + t.numel() * t.element_size(), t.is_cuda, _mem(t)[1])
            seen.setdefault(key, t)
        if not seen:
            return
        assert self._agent is not None and self._store is not None and self.participant
        with self._agent_lock:
            for (start, end, cuda, dev), t in sorted(seen.items()):
                flat = t.reshape(-1)
                try:
                    self._regs.append(self._agent.register_memory(flat))
                except Exception as e:
                    raise WeightbusError(
                        f"rdma: {self.participant.name!r} could not register {end - start} bytes "
                        f"of {t.device} memory at {start:#x}: {self._explain(e)}"
                    ) from e
                self._regions.append((start, end, cuda, dev))
            self._regions.sort()
            # published before the epoch can appear in an announcement (same lock)
            self._store.set(
                f"md/{self.participant.name}/{self._epoch + 1}", self._agent.get_agent_metadata()
            )
            self._epoch += 1

    # -- posting -------------------------------------------------------------------------------

    def _post_native(self, handle: Handle, buf: torch.Tensor) -> None:
        flat = buf.reshape(-1)
        if flat.numel() and not self._covered(flat):
            self._register_regions([flat])
        event = None
        if flat.is_cuda and flat.numel():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flat.device))
        # the post keeps the byte view (and so the caller's storage) alive until done
        handle.native = flat
        self._queue.append(_Post(handle, flat, self._peers[handle.peer.name], event))
        self._wake.set()

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        self._post_native(handle, buf)

    def _recv(self, handle: Handle, buf: torch.Tensor) -> None:
        self._post_native(handle, buf)

    # -- the progress thread -------------------------------------------------------------------

    def _run(self) -> None:
        delay = _IDLE_FIRST_S
        while not self._stop.is_set():
            try:
                with self._agent_lock:
                    if self._stop.is_set():
                        return
                    busy = self._step()
            except Exception as e:  # a broken agent: fail everything pending, loudly
                logger.debug("weightbus rdma: progress failed", exc_info=True)
                self._fail_all(e)
                return
            if busy:
                delay = _IDLE_FIRST_S
                continue
            self._wake.wait(delay)
            self._wake.clear()
            delay = min(delay * 2, _IDLE_LAST_S)

    def _step(self) -> bool:
        """One round of progress; True if anything moved."""
        agent = self._agent
        busy = False
        while self._queue:
            post = self._queue.popleft()
            busy = True
            key = (post.agent, post.handle.tag)
            if post.handle.op == "recv":
                self._announce.append(post)
            else:
                self._sends.setdefault(key, collections.deque()).append(post)
        if self._announce:
            waiting = []
            for post in self._announce:
                if post.event is not None and not post.event.query():
                    waiting.append(post)
                    continue
                kind, dev = _mem(post.buf)
                msg = _READY.pack(
                    b"R",
                    post.handle.tag,
                    post.buf.data_ptr(),
                    post.buf.numel(),
                    dev,
                    kind == "VRAM",
                    self._epoch,
                )
                self._expect.setdefault((post.agent, post.handle.tag), collections.deque()).append(
                    post
                )
                agent.send_notif(post.agent, msg)
                busy = True
            self._announce = waiting
        for sender, msgs in agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for msg in msgs:
                busy = True
                self._notified(sender, bytes(msg))
        for key in [k for k in self._sends if k in self._readies]:
            sends, readies = self._sends[key], self._readies[key]
            while sends and readies:
                if sends[0].event is not None and not sends[0].event.query():
                    break
                self._write(sends.popleft(), readies.popleft())
                busy = True
            if not sends:
                del self._sends[key]
            if not readies:
                del self._readies[key]
        if self._writes:
            still = []
            for xfer, post in self._writes:
                state = agent.check_xfer_state(xfer)
                if state == "PROC":
                    still.append((xfer, post))
                    continue
                busy = True
                agent.release_xfer_handle(xfer)
                post.handle.native = None
                error = None
                if state != "DONE":
                    error = WeightbusError(
                        f"NIXL reported {state} for the write of tag {post.handle.tag} to "
                        f"{self._who.get(post.agent, post.agent)!r}"
                    )
                self._completed(post.handle, error)
            self._writes = still
        return busy

    def _notified(self, sender: str, msg: bytes) -> None:
        kind = msg[:1]
        if kind == b"R" and len(msg) == _READY.size:
            _, tag, address, length, dev, cuda, epoch = _READY.unpack(msg)
            ready = _Ready(address, length, dev, bool(cuda), epoch)
            self._readies.setdefault((sender, tag), collections.deque()).append(ready)
        elif kind in (b"D", b"E") and len(msg) >= _DONE.size:
            _, tag = _DONE.unpack_from(msg)
            queue = self._expect.get((sender, tag))
            if not queue:
                logger.warning(
                    "weightbus rdma: %s got %r for tag %d from %r, which it did not expect",
                    self._me,
                    kind,
                    tag,
                    self._who.get(sender, sender),
                )
                return
            post = queue.popleft()
            if not queue:
                del self._expect[(sender, tag)]
            post.handle.native = None
            error = None
            if kind == b"E":
                error = WeightbusError(msg[_ERROR.size :].decode(errors="replace"))
            self._completed(post.handle, error)
        else:
            logger.warning("weightbus rdma: %s got an unknown notification %r", self._me, msg[:16])

    def _write(self, post: _Post, ready: _Ready) -> None:
        agent, handle = self._agent, post.handle
        n = post.buf.numel()
        if n != ready.length:
            peer = self._who.get(post.agent, post.agent)
            text = (
                f"rdma: tag {handle.tag}: writer {self.participant.name!r} sends {n} bytes, "
                f"reader {peer!r} posted a {ready.length}-byte buffer; both sides must post the "
                "same bucket sizes (the same plan)"
            )
            agent.send_notif(post.agent, _ERROR.pack(b"E", handle.tag) + text.encode())
            handle.native = None
            self._completed(handle, WeightbusError(text))
            return
        if n == 0:
            agent.send_notif(post.agent, _DONE.pack(b"D", handle.tag))
            handle.native = None
            self._completed(handle)
            return
        if self._loaded.get(post.agent, 0) < ready.epoch:
            self._load(post.agent, ready.epoch)
        kind, dev = _mem(post.buf)
        local = agent.get_xfer_descs([(post.buf.data_ptr(), n, dev)], kind)
        remote = agent.get_xfer_descs(
            [(ready.address, n, ready.device)], "VRAM" if ready.cuda else "DRAM"
        )
        xfer = agent.initialize_xfer(
            "WRITE", local, remote, post.agent, _DONE.pack(b"D", handle.tag)
        )
        state = agent.transfer(xfer)
        if state == "ERR":
            agent.release_xfer_handle(xfer)
            handle.native = None
            self._completed(
                handle,
                WeightbusError(f"NIXL refused the write of tag {handle.tag} to {post.agent!r}"),
            )
            return
        self._writes.append((xfer, post))

    def _load(self, agent_name: str, epoch: int) -> None:
        """Load a reader's metadata of ``epoch`` (it published it before announcing)."""
        peer = self._who[agent_name]
        key = f"md/{peer}/{epoch}"
        if not self._store.check([key]):
            raise WeightbusError(
                f"rdma: {peer!r} announced registration epoch {epoch} but did not publish it"
            )
        self._agent.add_remote_agent(self._store.get(key))
        self._loaded[agent_name] = epoch

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for h in pending:
            self._completed(h, error)

    # -- teardown ------------------------------------------------------------------------------

    def _explain(self, error: BaseException) -> str:
        text = super()._explain(error)
        if "NIXL_ERR_REMOTE_DISCONNECT" in text or "Connection reset" in text:
            return f"the peer's connection closed: it exited, crashed or aborted ({text})"
        return text

    def _shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
            if self._thread.is_alive():
                logger.warning("weightbus rdma: the progress thread did not stop within 5 s")
        self._thread = None
        agent, self._agent = self._agent, None
        if agent is None:
            return
        # a call stuck inside the library (a peer that vanished mid-call) must not hang us
        if not self._agent_lock.acquire(timeout=5.0):
            logger.warning("weightbus rdma: the NIXL agent is busy; leaving it to the process")
            return
        try:
            for xfer, _ in self._writes:
                try:
                    agent.release_xfer_handle(xfer)
                except Exception as e:  # still in flight towards a dead peer
                    logger.debug("weightbus rdma: releasing a transfer: %s", e)
            self._writes = []
            for reg in self._regs:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    logger.debug("weightbus rdma: deregistering: %s", e)
            self._regs = []
            for name in self._peers.values():
                try:
                    agent.remove_remote_agent(name)
                except Exception as e:
                    logger.debug("weightbus rdma: forgetting %s: %s", name, e)
        finally:
            self._agent_lock.release()
        del agent

    def _close(self) -> None:
        self._shutdown()

    def _abort(self, reason: str) -> None:
        self._shutdown()


def _agent_blob(blob: object, name: str, topic: str) -> tuple[str, bytes]:
    """``<agent name> NUL <NIXL metadata>`` as a peer posts it at connect, checked:
    (agent name, metadata), or :class:`ProtocolError` naming the peer."""
    if isinstance(blob, bytes) and b"\0" in blob:
        raw, _, meta = blob.partition(b"\0")
        try:
            agent_name = raw.decode("ascii")
        except UnicodeDecodeError:
            agent_name = ""
        if 0 < len(agent_name) <= 256 and agent_name.isprintable() and meta:
            return agent_name, meta
    raise ProtocolError(
        f"participant {name!r} posted {topic!r} as {blob!r:.60}, not '<agent name> NUL "
        "<metadata>': is it running the same weightbus version?"
    )
