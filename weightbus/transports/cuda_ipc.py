"""cuda_ipc: readers pull from the writers' GPU memory on the same host, through CUDA IPC.

EXPERIMENTAL, not chosen automatically: ask for it by name. In its one test on 4 x H200 the
reader process died silently at its first sync (no Python traceback; the writer then reported
it through heartbeats). ``WEIGHTBUS_HANG_DUMP_S`` and faulthandler in ``weightbus bench gpu``
are there to find out where.

No staging and no per-bucket handshake. At :meth:`expose` each writer shares, once, the CUDA
storages behind its sends (IPC memory handles) and an interprocess CUDA event, and posts a table
``(reader, tag) -> (storage, byte offset, bytes)``. Each sync goes like this:

1. the writer records the event on its stream once its tensors hold the new version
   (:meth:`begin`), then announces the sync;
2. the reader's stream waits for that event, and each receive is one copy from the mapped
   writer memory into the receive buffer (the engine's tensor itself when the region is
   contiguous): the copy engines between GPUs, a device-to-device copy on the same GPU
   (colocated trainer and engine);
3. a send completes at once, because the writer leaves its tensors untouched until the readers
   acknowledge. A receive completes when its copy has run.

Only data the writer holds contiguously and without a cast can be pulled; a plan that needs
the writer to pack (strided regions, casts) is refused at :meth:`expose` with the routes named.
Use ``nccl`` for those.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from weightbus.errors import WeightbusError
from weightbus.transports._cuda import EventPoller, cuda_device
from weightbus.transports.base import Handle, Transport, register_transport

__all__ = ["CudaIpcTransport"]

logger = logging.getLogger(__name__)


def _share(storage: torch.UntypedStorage) -> list:
    """An IPC description of a CUDA storage (what torch.multiprocessing sends, minus pickle)."""
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = (
        storage._share_cuda_()
    )
    return [
        int(device),
        bytes(handle),
        int(size),
        int(offset),
        bytes(ref_handle or b""),
        int(ref_offset),
        bytes(event_handle or b""),
        bool(event_sync),
    ]


def _open(desc: list) -> torch.UntypedStorage:
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = desc
    return torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync
    )


@register_transport
class CudaIpcTransport(Transport):
    """GPU memory between processes of one host, pulled by the readers; same GPU or not."""

    name = "cuda_ipc"
    devices = frozenset({"cuda"})
    cross_host = False
    same_gpu_zero_copy = True
    needs_staging = False
    priority = -1  # experimental: only by name (see the module docstring)

    def __init__(self, **fields: Any) -> None:
        super().__init__(fields.pop("timeout", None))
        if fields:
            raise TypeError(f"cuda_ipc: unknown options {sorted(fields)}")
        self._device: torch.device | None = None
        self._event: torch.cuda.Event | None = None
        self._poller: EventPoller | None = None
        self._shared: list[torch.UntypedStorage] = []  # a writer keeps what it shared alive
        self._sources: dict[tuple[int, int], torch.Tensor] = {}  # (writer, tag) -> bytes
        self._events: dict[int, torch.cuda.Event] = {}  # writer global rank -> its event
        self._waited: set[int] = set()
        self._exposed = False

    @classmethod
    def unsupported(cls, participants) -> str | None:
        people = list(participants)
        if not torch.cuda.is_available():
            return "cuda_ipc needs CUDA"
        if any(torch.device(p.device).type != "cuda" for p in people):
            return "cuda_ipc links CUDA devices only"
        hosts = {p.host for p in people}
        if len(hosts) > 1:
            return f"cuda_ipc links processes of one host, the job spans {sorted(hosts)}"
        return None

    def _connect(self) -> None:
        assert self.participant is not None
        self._device = cuda_device(self.participant)
        torch.cuda.set_device(self._device)
        self._poller = EventPoller(self)

    def expose(self, sends) -> None:
        self._require_connected()
        control, roster, me = self.control, self.roster, self.participant
        assert control is not None and roster is not None and me is not None
        topic = f"cuda_ipc/{control.sequence('cuda_ipc')}"
        if me.role == "writer":
            packed = [what for _, _, buf, what in sends if buf is None]
            if packed:
                raise WeightbusError(
                    f"cuda_ipc: writer {me.name!r} would have to pack {len(packed)} routes "
                    f"(e.g. {', '.join(packed[:3])}): their regions are not contiguous in its "
                    "tensors, need a cast, or were packed with others into one bucket; cuda_ipc "
                    "pulls contiguous, uncast routes that travel alone: set "
                    "SyncConfig(direct_bytes=1), or use transport='nccl' for this plan"
                )
            self._event = torch.cuda.Event(interprocess=True)
            self._event.record()
            storages: dict[int, int] = {}
            table = []
            for peer, tag, buf, _ in sends:
                st = buf.untyped_storage()
                key = st.data_ptr()
                if key not in storages:
                    storages[key] = len(self._shared)
                    self._shared.append(st)
                offset = buf.data_ptr() - st.data_ptr()
                table.append(
                    [int(peer), int(tag), storages[key], offset, buf.numel() * buf.element_size()]
                )
            control.post(
                topic,
                {
                    "device": self._device.index,
                    "event": bytes(self._event.ipc_handle()),
                    "storages": [_share(st) for st in self._shared],
                    "sends": table,
                },
            )
            # every reader has mapped what it pulls before the first sync
            control.gather(topic + "/opened", role="reader")
            self._exposed = True
            return
        tables = control.gather(topic, role="writer")
        mine = roster.global_rank(me.name)
        for name, t in tables.items():
            writer = roster.global_rank(name)
            opened: dict[int, torch.UntypedStorage] = {}
            for peer, tag, sidx, offset, nbytes in t["sends"]:
                if peer != mine:
                    continue
                if sidx not in opened:
                    opened[sidx] = _open(t["storages"][sidx])
                src = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", t["device"]))
                src.set_(opened[sidx], offset, (nbytes,), (1,))
                self._sources[(writer, tag)] = src
            self._events[writer] = torch.cuda.Event.from_ipc_handle(
                torch.device("cuda", t["device"]), t["event"]
            )
        control.post(topic + "/opened", {})
        self._exposed = True
        logger.debug("weightbus cuda_ipc: %s maps %d sources", me.name, len(self._sources))

    def begin(self) -> None:
        if self._event is not None:
            # the tensors are final once the current stream's work so far has run
            self._event.record()
        self._waited.clear()

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        # the reader pulls; the writer's tensors stay untouched until the readers acknowledge
        self._completed(handle)

    def _recv(self, handle: Handle, buf: torch.Tensor) -> None:
        assert self.roster is not None and self._poller is not None
        if not self._exposed:
            raise WeightbusError("cuda_ipc: expose() must run at connect, before any receive")
        writer = self.roster.global_rank(handle.peer.name)
        src = self._sources.get((writer, handle.tag))
        if src is None:
            raise WeightbusError(
                f"cuda_ipc: {handle.peer.name!r} shared no send with tag {handle.tag} for this reader"
            )
        flat = buf.reshape(-1).view(torch.uint8)
        if src.numel() != flat.numel():
            raise WeightbusError(
                f"cuda_ipc: tag {handle.tag} from {handle.peer.name!r} has {src.numel()} bytes, "
                f"the receive buffer {flat.numel()}: the two sides disagree on the plan"
            )
        stream = torch.cuda.current_stream(self._device)
        if writer not in self._waited:
            stream.wait_event(self._events[writer])
            self._waited.add(writer)
        flat.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        handle.native = (None, event, flat)
        self._poller.add(handle)

    def _stop(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None

    def _close(self) -> None:
        self._stop()
        self._sources.clear()
        self._events.clear()
        self._shared.clear()

    def _abort(self, reason: str) -> None:
        self._close()
