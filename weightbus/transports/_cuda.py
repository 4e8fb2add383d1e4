"""What the CUDA transports share: a participant's device, and completion through CUDA events."""

from __future__ import annotations

import threading
import time

import torch

from weightbus.spec import Participant
from weightbus.transports.base import Handle, Transport

__all__ = ["EventPoller", "cuda_device"]


def cuda_device(p: Participant) -> torch.device:
    d = torch.device(p.device)
    if d.type != "cuda":
        raise ValueError(
            f"participant {p.name!r} is on {p.device}; CUDA transports move CUDA memory"
        )
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


class EventPoller:
    """Marks handles done when the CUDA event recorded after their NCCL work completes.

    Handles with the same peer complete in the order they were added (their operations run
    on one stream, each link's in posting order), so each round asks only the oldest pending
    handle of each peer, and each event once (a group of operations shares one): a round costs
    a query per link, not per handle. Asking every handle made each round grow with the
    handles in flight (~300 when a delta sync sends its groups as pieces); a profile of one
    showed the poller's queries between the calls of the thread posting the sends, which
    needs the interpreter the poller holds while it asks."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.items: list[Handle] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stop = False
        self.thread = threading.Thread(
            target=self._run, name=f"weightbus-{transport.name}-poller", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        """Stop the thread (bounded: it never blocks for long)."""
        self.stop = True
        self.wake.set()
        self.thread.join(2.0)

    def add(self, handle: Handle) -> None:
        self.add_many([handle])

    def add_many(self, handles: list[Handle]) -> None:
        with self.lock:
            self.items.extend(handles)
        self.wake.set()

    def settle(self, handle: Handle) -> None:
        """Mark ``handle`` done now if its event completed, from the thread that waits for
        it, which then need not wait for this poller to be scheduled: while another thread
        runs Python (the writer packing its next buckets), the poller gets the interpreter
        only when that thread blocks or after the switch interval (5 ms). A profile showed a
        staging buffer reused 1.7 ms after its send had finished."""
        native = handle.native
        if native is None:
            return
        try:
            finished = native[1].query()
        except Exception:  # a sticky CUDA error: the poller reports it for every handle
            return
        if not finished:
            return
        with self.lock:  # whoever takes it out of the list completes it: exactly one thread
            if not any(h is handle for h in self.items):
                return  # the poller has it
            self.items = [h for h in self.items if h is not handle]
        self.transport._completed(handle)

    def _run(self) -> None:
        while not self.stop:
            with self.lock:
                items = list(self.items)
            if not items:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            done = []
            blocked: set[str] = set()  # peers whose oldest pending operation is not done
            asked: dict[int, bool] = {}  # per event (id): done?
            try:
                for h in items:
                    native = h.native
                    if native is None:
                        done.append(h)
                        continue
                    if h.peer.name in blocked:
                        continue  # an older operation of its link is still running
                    finished = asked.get(id(native[1]))
                    if finished is None:
                        finished = asked[id(native[1])] = bool(native[1].query())
                    if finished:
                        done.append(h)
                    else:
                        blocked.add(h.peer.name)
            except Exception as e:  # a sticky CUDA error: nothing pending can finish now
                with self.lock:
                    failed, self.items = self.items, []
                for h in failed:
                    self.transport._completed(h, e)
                return
            if done:
                gone = set(map(id, done))
                with self.lock:  # not those a waiting thread settled meanwhile (see settle)
                    mine = [h for h in self.items if id(h) in gone]
                    self.items = [h for h in self.items if id(h) not in gone]
                for h in mine:
                    self.transport._completed(h)
            else:
                time.sleep(50e-6)


class Cudart:
    """The CUDA runtime that torch loaded, for the copies torch has no call for: many
    ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` on one stream at a few microseconds each,
    strided 2-D regions included, all on the copy engines. :meth:`load` returns None when the
    runtime is not a shared library this process mapped (callers then use ``Tensor.copy_``)."""

    _DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses

    def __init__(self, lib) -> None:
        import ctypes

        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.restype = ctypes.c_int
        self._memcpy.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._memcpy2d = lib.cudaMemcpy2DAsync
        self._memcpy2d.restype = ctypes.c_int
        self._memcpy2d.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._error = lib.cudaGetErrorString
        self._error.restype = ctypes.c_char_p
        self._error.argtypes = [ctypes.c_int]

    _loaded: Cudart | None | bool = False

    @classmethod
    def load(cls) -> Cudart | None:
        """The runtime torch uses (once CUDA is initialised), or None."""
        if cls._loaded is False:
            cls._loaded = None
            try:
                import ctypes

                with open("/proc/self/maps") as f:
                    paths = {line.split()[-1] for line in f if "libcudart.so" in line}
                if len(paths) == 1:
                    cls._loaded = cls(ctypes.CDLL(paths.pop()))
            except (OSError, AttributeError):
                cls._loaded = None
        return cls._loaded  # type: ignore[return-value]

    def copy(self, job: tuple[int, int, int, int, int, int], stream: int) -> None:
        """Queue one copy ``(dst, dst_pitch, src, src_pitch, width, rows)`` (bytes) on ``stream``."""
        dst, dpitch, src, spitch, width, rows = job
        if rows == 1:
            rc = self._memcpy(dst, src, width, self._DEFAULT, stream)
        else:
            rc = self._memcpy2d(dst, dpitch, src, spitch, width, rows, self._DEFAULT, stream)
        if rc != 0:
            raise RuntimeError(f"CUDA error {rc}: {self._error(rc).decode()}")


def copy_job(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int, int, int] | None:
    """``dst.copy_(src)`` as one 2-D memcpy (rows of contiguous bytes at a constant pitch on
    both sides), or None when the regions differ in dtype or are strided in more than one way."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    es = dst.element_size()
    dims = [
        (n, ds, ss)
        for n, ds, ss in zip(dst.shape, dst.stride(), src.stride(), strict=True)
        if n != 1
    ]
    width = 1
    while dims and dims[-1][1] == width and dims[-1][2] == width:
        width *= dims.pop()[0]
    if not dims:
        return (dst.data_ptr(), 0, src.data_ptr(), 0, width * es, 1)
    rows, dpitch, spitch = dims.pop()
    if dpitch < width or spitch < width:  # overlapping rows (broadcast views): not a memcpy
        return None
    while dims:  # outer dims must continue the same pitch on both sides
        n, ds, ss = dims.pop()
        if ds != dpitch * rows or ss != spitch * rows:
            return None
        rows *= n
    return (dst.data_ptr(), dpitch * es, src.data_ptr(), spitch * es, width * es, rows)
