"""nccl: GPU bytes between processes over NVLink / PCIe / InfiniBand, through NCCL.

A ``ProcessGroupNCCL`` of its own, built from a ``PrefixStore`` over the control plane's
TCPStore (never the default process group, so it works beside the trainer's and the engine's
own groups), one GPU per process, global ranks writers-then-readers.

How a send or receive completes: it is posted on NCCL's stream, the caller's current stream is
made to wait for it (so a pack into, or unpack from, the same buffer is ordered after it on the
GPU without blocking the CPU), and a CUDA event recorded there marks it done; one poller thread
per transport watches those events. A dead peer leaves NCCL kernels spinning: the base class's
wait notices through the control plane (failure report or stale heartbeat) and :meth:`_abort`
aborts the communicators, which frees the GPU.

NCCL creates one communicator per pair of ranks on their first send/recv; :meth:`_connect`
warms up every writer-reader pair in a fixed global order so the first sync pays nothing.

A known hazard of groups (:meth:`_issue_many`): PyTorch runs a group's operations on the
process group's communicator of every participant, which the first group of each creates
together, as a collective. A participant that never posts a group (its links all staged, or
carrying one bucket a group, or a codec's), or that dies before its first, leaves the others'
first group waiting in NCCL's initialization, where no timeout of ours reaches; and that one
communicator's stream runs the groups of every link one after another. Where that bites,
``$WEIGHTBUS_NCCL_GROUPS=0`` on every participant of the job makes each post every operation
alone, on its pair's own communicator, as before groups (a participant with it set posts
singly, and so do its peers on their links with it, since both ends of a link agree on groups
at connect; links between participants without it still group). Lifting it for good takes a
process group of two ranks per link.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from weightbus._env import env_int
from weightbus.spec import Participant
from weightbus.transports._cuda import EventPoller, cuda_device
from weightbus.transports.base import Handle, Transport, register_transport

__all__ = ["NcclTransport"]

logger = logging.getLogger(__name__)


@register_transport
class NcclTransport(Transport):
    """GPU memory between processes on distinct GPUs, on one host or across hosts."""

    name = "nccl"
    devices = frozenset({"cuda"})
    cross_host = True
    same_gpu_zero_copy = False
    needs_staging = True
    priority = 10
    sends_any_buffer = True

    def __init__(self, **fields: Any) -> None:
        super().__init__(fields.pop("timeout", None))
        if fields:
            raise TypeError(f"nccl: unknown options {sorted(fields)}")
        self._pg: Any = None
        self._rank = -1
        self._poller: EventPoller | None = None
        self._device: torch.device | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._coalesce = False  # post groups as one NCCL group (where PyTorch can: connect)

    @classmethod
    def unsupported(cls, participants) -> str | None:
        people = list(participants)
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            return "nccl needs CUDA and a PyTorch built with NCCL"
        if any(torch.device(p.device).type != "cuda" for p in people):
            return "nccl links CUDA devices only, some participants are on " + ", ".join(
                sorted({p.device for p in people if torch.device(p.device).type != "cuda"})
            )
        seen: dict[tuple[str, str], str] = {}
        for p in people:
            # one GPU by its UUID (device strings differ with CUDA_VISIBLE_DEVICES)
            key = (p.host, p.gpu or str(cuda_device(p)))
            if key in seen:
                return (
                    f"nccl cannot link two processes on one GPU ({seen[key]!r} and {p.name!r} on "
                    f"{key[1]} of {key[0]}): use CUDA IPC for colocated participants"
                )
            seen[key] = p.name
        return None

    def _connect(self) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert (
            control is not None
            and roster is not None
            and me is not None
            and self.timeout is not None
        )
        self._device = cuda_device(me)
        torch.cuda.set_device(self._device)
        self._rank = roster.global_rank(me.name)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        self._pg = dist.ProcessGroupNCCL(control.substore("nccl"), self._rank, roster.size, options)
        self._poller = EventPoller(self)
        # ProcessGroupNCCL's groups (no argument in PyTorch 2.11); an empty group posts
        # nothing. $WEIGHTBUS_NCCL_GROUPS=0: every operation alone (the module docstring)
        if not env_int("WEIGHTBUS_NCCL_GROUPS", 1):
            logger.info("weightbus nccl: $WEIGHTBUS_NCCL_GROUPS=0: posting singly")
        else:
            try:
                self._pg._start_coalescing()
                self._pg._end_coalescing()
                self._coalesce = True
            except Exception as e:  # another signature, or none: post one at a time
                logger.info(
                    "weightbus nccl: no NCCL groups in this PyTorch (%s): posting singly", e
                )
        # warm up every writer-reader pair in one global order (pairs sorted by (writer,
        # reader)), so each pair's communicator exists before the first sync
        t0 = time.monotonic()
        one = torch.zeros(1, dtype=torch.uint8, device=self._device)
        writers = [p for p in roster.all if p.role == "writer"]
        readers = [p for p in roster.all if p.role == "reader"]
        for w in writers:
            for r in readers:
                if me.name == w.name:
                    self._pg.send([one], roster.global_rank(r.name), 0).wait()
                elif me.name == r.name:
                    self._pg.recv([one], roster.global_rank(w.name), 0).wait()
        torch.cuda.synchronize(self._device)
        logger.debug(
            "weightbus nccl: %s connected (rank %d) in %.2f s",
            me.name,
            self._rank,
            time.monotonic() - t0,
        )

    def _check_buffer(self, buf: torch.Tensor, what: str) -> None:
        # a local mistake, raised before anything is posted (not reported as the peer's failure)
        super()._check_buffer(buf, what)
        if self._device is not None and buf.device != self._device:
            raise ValueError(
                f"nccl: {what} is on {buf.device}, this participant uses {self._device}: keep the "
                "bound tensors and staging on the participant's device"
            )

    def _issue_many(self, handles: list[Handle], bufs: list[torch.Tensor | None]) -> None:
        """Post operations to one peer on its side stream (:meth:`_side`): one alone, more than
        one as one NCCL group (a launch for all; on 2 x H200 Llama-3-8B's 291 tensors, in
        groups of 8 to 32, took 44.9 ms against 47.6 for a send each, and 3-5 ms of host time
        against 26), which completes at once, with one event. Where PyTorch has no groups,
        each alone."""
        if len(handles) > 1 and not self._coalesce:
            super()._issue_many(handles, bufs)  # each through _send / _recv
            return
        assert self._pg is not None and self._poller is not None
        flats = [buf.reshape(-1) for buf in bufs if buf is not None]
        peer, side = self._side(handles[0])
        post = self._pg.send if handles[0].op == "send" else self._pg.recv
        with torch.cuda.stream(side):
            if len(flats) == 1:
                work = post(flats, peer, 0)
            else:
                self._pg._start_coalescing()
                try:
                    for flat in flats:
                        post([flat], peer, 0)
                finally:
                    work = self._pg._end_coalescing()
            work.wait()
            event = torch.cuda.Event()
            event.record(side)
        for handle, flat in zip(handles, flats, strict=True):
            handle.native = (work, event, flat)
        self._poller.add_many(handles)

    def groups_with(self, peer: Participant | str | int) -> bool:
        return self._coalesce

    def _side(self, handle: Handle) -> tuple[int, torch.cuda.Stream]:
        """``handle``'s peer (global rank) and the side stream its operations go through,
        made to wait for the caller's work so far. ProcessGroupNCCL makes its stream wait for
        the *current* stream at every operation; were that the caller's stream, made to wait
        for the previous operation, every link would queue behind every other. The side stream
        waits for the caller's work so far (the pack into a buffer, or the unpack that last
        used it), then carries the operation and its completion event."""
        assert self.roster is not None
        peer = self.roster.global_rank(handle.peer.name)
        side = self._streams.get(peer)
        if side is None:
            side = self._streams[peer] = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        return peer, side

    def done_event(self, handle: Handle) -> torch.cuda.Event | None:
        native = handle.native  # read once: the poller drops it when the operation is done
        return None if native is None else native[1]

    def _settle(self, handle: Handle) -> None:
        if self._poller is not None:
            self._poller.settle(handle)

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        self._issue_many([handle], [buf])

    def _recv(self, handle: Handle, buf: torch.Tensor) -> None:
        self._issue_many([handle], [buf])

    def _stop(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None

    def _close(self) -> None:
        self._stop()
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except Exception as e:  # older builds
                logger.debug("weightbus nccl: shutdown: %s", e)
            self._pg = None

    def _abort(self, reason: str) -> None:
        self._stop()
        if self._pg is not None:
            try:
                self._pg.abort()
            except Exception as e:
                logger.debug("weightbus nccl: abort: %s", e)
            self._pg = None
