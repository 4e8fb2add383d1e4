"""The nccl transport's own logic on CPU: ``test-nccl-on-cpu`` is :class:`NcclTransport` with
``ProcessGroupNCCL`` stood in by ``ProcessGroupGloo`` and CUDA streams and events by host
objects that follow the Gloo operations posted under them, so that the transport contract
(``tests/transport_contract.py``) runs its connect, warm-up order, posting (alone and in
groups), completion, failure detection and teardown in every CPU suite.

What it does not model is NCCL's own behaviour: which communicator an operation uses, what a
kernel does when its peer died. It does make a link's group at its first operation, which
blocks until the other end's first (Gloo's rendezvous), as NCCL makes a communicator, so the
order in which connect makes links is tested. A Gloo operation whose peer died fails; here
it stays pending, as an NCCL kernel spins, so that only the control plane can end the wait, as
on GPUs. The GPU contract tests (``tests/test_gpu.py``) cover the rest.

Nothing is replaced until a ``test-nccl-on-cpu`` transport is built: for good in the
contract's participant processes, which use no other nccl transport, and for one test in the
test process, which sets the stand-ins with ``monkeypatch`` first (:func:`stand_ins`). This
module is imported (for the registration) wherever ``tests/transport_contract.py`` is, the
real nccl transport's tests included.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import types
from typing import Any

import torch
import torch.distributed as dist

from weightbus.transports import nccl
from weightbus.transports.base import register_transport

_local = threading.local()


def _current() -> _Stream:
    s = getattr(_local, "stream", None)
    if s is None:
        s = _local.stream = _Stream()
    return s


class _Stream:
    """A CUDA stream: the Gloo operations posted while it was current, completed in order by
    a thread of its own (a Gloo send or receive learns it is done only inside ``wait()``)."""

    def __init__(self, device: Any = None) -> None:
        self.works: list[_Op] = []
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        # (for the process's life: with threads that ended when idle, the test process
        # aborted at exit, "terminate called without an active exception", likely Gloo torn
        # down during Python's exit once no thread held its operations)
        threading.Thread(target=self._complete, daemon=True).start()

    def wait_stream(self, other: _Stream) -> None:
        pass  # (host memory: what was written before a post is there when it runs)

    def wait_event(self, event: _Event) -> None:
        pass

    def add(self, work: Any) -> None:
        op = _Op(work)
        with self.lock:
            self.works = [w for w in self.works if not w.done.is_set()] + [op]
        self.queue.put(op)

    def _complete(self) -> None:
        while True:
            op = self.queue.get()
            try:
                op.work.wait()
            except Exception:
                # its peer died: it stays pending, as an NCCL kernel whose peer died spins
                continue
            op.done.set()


class _Op:
    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()


class _Event:
    """A CUDA event: done once the operations its stream held when recorded are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.works: list[_Op] = []

    def record(self, stream: _Stream | None = None) -> None:
        stream = stream if stream is not None else _current()
        with stream.lock:
            self.works = list(stream.works)

    def query(self) -> bool:
        return all(op.done.is_set() for op in self.works)


@contextlib.contextmanager
def _stream(stream: _Stream):
    before = _current()
    _local.stream = stream
    try:
        yield
    finally:
        _local.stream = before


_CUDA = types.SimpleNamespace(
    Stream=_Stream,
    Event=_Event,
    stream=_stream,
    current_stream=lambda device=None: _current(),
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
)


class _Torch(types.SimpleNamespace):
    """``torch`` as the nccl module sees it: the real one, but for ``torch.cuda``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _Posted:
    """What ProcessGroupNCCL returns for a post: ``wait`` orders the current stream after it
    (here nothing: the event recorded next follows the operations themselves)."""

    def wait(self) -> None:
        pass


class _GlooAsNccl:
    """``ProcessGroupNCCL(store, rank, size, options)`` over Gloo: every operation goes on
    the current (stand-in) stream, a group's as they are posted."""

    class Options:
        def __init__(self) -> None:
            self._timeout: Any = None
            self.config = types.SimpleNamespace(max_ctas=-1)  # -1: NCCL's choice

    channels: dict[str, set[int]] = {}
    """Per store prefix of the groups made in this process: the channels each end asked for."""

    grouped: set[str] = set()
    """Store prefixes of the groups made in this process that posted a group of operations."""

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        self._rank = rank
        self._prefix = getattr(store, "prefix", "?")
        type(self).channels.setdefault(self._prefix, set()).add(options.config.max_ctas)
        # made by the first operation, which blocks until the other end's first operation
        # (Gloo's rendezvous), as NCCL makes a communicator: connect's order is tested so
        self._made = lambda: dist.ProcessGroupGloo(store, rank, size, options._timeout)
        self._pg_made: Any = None
        self._lock = threading.Lock()
        self._grouped: int | None = None  # operations in the open group

    @property
    def _pg(self) -> Any:
        with self._lock:
            if self._pg_made is None:
                self._pg_made = self._made()
            return self._pg_made

    def rank(self) -> int:
        return self._rank

    groups = 0
    """Groups of more than one operation posted in this process (tests read it)."""

    def _start_coalescing(self) -> None:
        self._grouped = 0

    def _end_coalescing(self) -> _Posted:
        if self._grouped is not None and self._grouped > 1:
            type(self).groups += 1
        if self._grouped:
            type(self).grouped.add(self._prefix)
        self._grouped = None
        return _Posted()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Posted:
        return self._post(self._pg.send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Posted:
        return self._post(self._pg.recv(tensors, src, tag))

    def _post(self, work: Any) -> _Posted:
        _current().add(work)
        if self._grouped is not None:
            self._grouped += 1
        return _Posted()

    def abort(self) -> None:
        pass  # (the process exits, or the test ends, with Gloo's sockets)

    def shutdown(self) -> None:
        pass


class _PrefixStore(dist.PrefixStore):
    """A PrefixStore that says its prefix (the link it was made for)."""

    def __init__(self, prefix: str, store: Any) -> None:
        super().__init__(prefix, store)
        self.prefix = prefix


def stand_ins() -> dict[str, Any]:
    """The nccl module's names and their stand-ins."""
    return {
        "torch": _Torch(cuda=_CUDA),
        "dist": types.SimpleNamespace(ProcessGroupNCCL=_GlooAsNccl, PrefixStore=_PrefixStore),
        "cuda_device": lambda p: torch.device("cpu"),
    }


def _stand_in() -> None:
    """Point the nccl module at the stand-ins, for good: in a participant process of the
    contract, which uses no other nccl transport. A test that builds the transport in the
    test process sets them with ``monkeypatch`` first (:func:`stand_ins`), so that they go
    when it ends."""
    if isinstance(nccl.torch, _Torch):
        return
    for name, value in stand_ins().items():
        setattr(nccl, name, value)


@register_transport
class NcclOnCpu(nccl.NcclTransport):
    """:class:`NcclTransport` on CPU (module docstring); never chosen automatically."""

    name = "test-nccl-on-cpu"
    devices = frozenset({"cpu"})
    priority = -1

    def __init__(self, **fields: Any) -> None:
        _stand_in()
        super().__init__(**fields)

    @classmethod
    def unsupported(cls, participants) -> str | None:
        return None

    def done_event(self, handle):
        return None  # (a reader's sums wait for the operation, not for a CUDA event)
