"""cuda_ipc: readers copy straight out of the writers' GPU memory on the same host (CUDA IPC).

No staging buffer and no packing on either side, and no per-bucket handshake:

1. at :meth:`expose` each writer shares, once, the CUDA storages behind the tensors its buckets
   read (IPC memory handles) and an interprocess CUDA event, and posts, per bucket, where each
   route's region lies in those tensors. Each reader maps what it pulls and pairs every route's
   source region with its own destination region (its live engine tensor);
2. each sync, the writer records its event once its tensors hold the new version
   (:meth:`begin`, before the readers are told). A reader's :meth:`pull` makes its streams wait
   for that event and queues one ``copy_`` per route, from the writer's tensor into its own:
   contiguous regions of one dtype go through the copy engines (``cudaMemcpyAsync``, GPU to GPU
   over NVLink, or device-to-device on the same GPU for a colocated trainer and engine);
   strided regions and casts run torch's copy kernel;
3. the writer leaves its tensors untouched until every reader acknowledged the version, which
   readers do only once their copies ran.

A pull is done once its copies are queued, in the order of the reader's current stream: work
the caller queues on that stream afterwards (and ``synchronize``) sees the bytes. Copies from
different writers run on streams of their own, so a reader pulls from all of them at once.

Where the copies run: torch runs a cross-GPU copy on the *source* GPU's stream (of the reader
process), so strided copies and casts from another GPU borrow the writer GPU's SMs for their
kernels; contiguous ones use its copy engines only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from weightbus.errors import PlanMismatch, WeightbusError
from weightbus.spec import torch_dtype
from weightbus.transports._cuda import cuda_device
from weightbus.transports.base import Handle, Program, Transport, register_transport

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
    # torch checks every handle is bytes (empty when unused), as its own unpickler passes them
    return torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync
    )


class _Link:
    """What one reader pulls from one writer: the writer's event and per-bucket copy lists."""

    __slots__ = ("buckets", "device", "event", "side", "source")

    def __init__(self, device: torch.device, event: torch.cuda.Event, reader_device) -> None:
        self.device = device
        self.event = event
        # ``source``: a stream on the writer's GPU (torch runs cross-GPU copies there);
        # ``side``: one on the reader's GPU, so that links do not queue behind each other
        self.source = torch.cuda.Stream(device)
        self.side = self.source if device == reader_device else torch.cuda.Stream(reader_device)
        self.buckets: dict[int, tuple[int, list[tuple[torch.Tensor, torch.Tensor, Any]]]] = {}


@register_transport
class CudaIpcTransport(Transport):
    """GPU memory between processes of one host, pulled by the readers; same GPU or not."""

    name = "cuda_ipc"
    devices = frozenset({"cuda"})
    cross_host = False
    same_gpu_zero_copy = True
    needs_staging = False
    pulls = True
    priority = 20  # above nccl: copy engines, no staging, no SMs for contiguous regions

    def __init__(self, **fields: Any) -> None:
        super().__init__(fields.pop("timeout", None))
        if fields:
            raise TypeError(f"cuda_ipc: unknown options {sorted(fields)}")
        self._device: torch.device | None = None
        self._event: torch.cuda.Event | None = None
        self._shared: list[torch.UntypedStorage] = []  # a writer keeps what it shared alive
        self._opened: list[torch.UntypedStorage] = []  # a reader keeps what it mapped
        self._links: dict[int, _Link] = {}  # writer global rank -> link
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

    def _check_buffer(self, buf: torch.Tensor, what: str) -> None:
        super()._check_buffer(buf, what)
        raise WeightbusError(
            f"cuda_ipc: {what}: readers pull buckets straight into their tensors; post "
            "pull(peer, tag) after expose() (Writer and Reader do), not send/recv of buffers"
        )

    # -- connect-time ---------------------------------------------------------------------------

    def expose(self, program: Program) -> None:
        self._require_connected()
        control, me = self.control, self.participant
        assert control is not None and me is not None
        topic = f"cuda_ipc/{control.sequence('cuda_ipc')}"
        if me.role == "writer":
            self._expose_writer(topic, program)
        else:
            self._expose_reader(topic, program)
        self._exposed = True

    def _expose_writer(self, topic: str, program: Program) -> None:
        assert self.control is not None and self._device is not None
        self._event = torch.cuda.Event(interprocess=True)
        self._event.record()
        storages: dict[int, int] = {}  # storage data_ptr -> index in self._shared
        tensors: dict[str, int] = {}  # tensor key -> index in the table
        table = []
        buckets = []
        for op in program.ops:
            copies = []
            for c in op.copies:
                if c.key not in tensors:
                    t = program.tensors[c.key]
                    self._check_tensor(t, c.key)
                    st = t.untyped_storage()
                    if st.data_ptr() not in storages:
                        storages[st.data_ptr()] = len(self._shared)
                        self._shared.append(st)
                    tensors[c.key] = len(table)
                    table.append(
                        [
                            storages[st.data_ptr()],
                            t.storage_offset(),
                            list(t.shape),
                            list(t.stride()),
                            str(t.dtype).removeprefix("torch."),
                        ]
                    )
                index = [[s.start, s.stop] for s in c.index]
                copies.append([tensors[c.key], index, c.offset, c.nbytes])
            buckets.append([op.peer_global, op.bucket, op.nbytes, copies])
        self.control.post(
            topic,
            {
                "device": self._device.index,
                "event": bytes(self._event.ipc_handle()),
                "storages": [_share(st) for st in self._shared],
                "tensors": table,
                "buckets": buckets,
            },
        )
        # every reader has mapped what it pulls before the first sync
        self.control.gather(topic + "/opened", role="reader")
        logger.debug(
            "weightbus cuda_ipc: %s shares %d storages (%d tensors)",
            self.participant.name if self.participant else "?",
            len(self._shared),
            len(table),
        )

    def _check_tensor(self, t: torch.Tensor, key: str) -> None:
        if self._device is None or t.device != self._device:
            raise ValueError(
                f"cuda_ipc: tensor {key!r} is on {t.device}, this participant uses "
                f"{self._device}: keep the bound tensors on the participant's device"
            )

    def _expose_reader(self, topic: str, program: Program) -> None:
        assert self.control is not None and self.roster is not None and self._device is not None
        tables = self.control.gather(topic, role="writer")
        me = self.participant
        assert me is not None
        mine = self.roster.global_rank(me.name)
        ops = {(op.peer_global, op.bucket): op for op in program.ops}
        for name, t in sorted(tables.items()):
            writer = self.roster.global_rank(name)
            device = torch.device("cuda", int(t["device"]))
            event = torch.cuda.Event.from_ipc_handle(device, t["event"])
            link = _Link(device, event, self._device)
            storages: dict[int, torch.UntypedStorage] = {}
            bases: dict[int, torch.Tensor] = {}
            for peer, tag, nbytes, copies in t["buckets"]:
                if peer != mine:
                    continue
                op = ops.pop((writer, tag), None)
                if op is None or op.nbytes != nbytes:
                    raise PlanMismatch(
                        f"cuda_ipc: writer {name!r} shares bucket {tag} ({nbytes} bytes) for "
                        f"{me.name!r}, whose plan has "
                        + ("no such bucket" if op is None else f"{op.nbytes} bytes in it")
                        + ": the two sides planned differently"
                    )
                by_offset = {c.offset: c for c in op.copies}
                pairs = []
                for tid, index, offset, n in copies:
                    if tid not in bases:
                        sidx, soff, size, stride, dtype = t["tensors"][tid]
                        if sidx not in storages:
                            storages[sidx] = _open(t["storages"][sidx])
                            self._opened.append(storages[sidx])
                        bases[tid] = torch.empty(0, dtype=torch_dtype(dtype), device=device).set_(
                            storages[sidx], soff, size, stride
                        )
                    src = bases[tid][tuple(slice(a, b) for a, b in index)]
                    c = by_offset.get(offset)
                    if c is None or c.nbytes != n:
                        raise PlanMismatch(
                            f"cuda_ipc: bucket {tag} from {name!r}: the writer has a route at "
                            f"byte {offset} ({n} bytes) that {me.name!r} does not expect"
                        )
                    dst = program.tensors[c.key][c.index]
                    if src.shape != dst.shape:
                        if src.numel() != dst.numel():
                            raise PlanMismatch(
                                f"cuda_ipc: {c.tensor}: writer {name!r} region {tuple(src.shape)} "
                                f"and reader region {tuple(dst.shape)} differ in size"
                            )
                        src = src.view(dst.shape)  # the same box, up to leading 1-dims
                    # the wire dtype matters only when it differs from both ends' dtypes
                    wire = c.dtype if c.dtype not in (src.dtype, dst.dtype) else None
                    pairs.append((dst, src, wire))
                link.buckets[tag] = (nbytes, pairs)
            self._links[writer] = link
        if ops:
            (peer, tag), op = next(iter(ops.items()))
            raise PlanMismatch(
                f"cuda_ipc: {me.name!r} expects {len(ops)} buckets no writer shared, e.g. "
                f"bucket {tag} from {self.roster.all[peer].name!r} ({op.nbytes} bytes)"
            )
        self.control.post(topic + "/opened", {})
        logger.debug(
            "weightbus cuda_ipc: %s maps %d storages from %d writers",
            me.name,
            len(self._opened),
            len(self._links),
        )

    # -- per sync -------------------------------------------------------------------------------

    def begin(self) -> None:
        if self._event is not None:
            # the tensors are final once the current stream's work so far has run
            self._event.record(torch.cuda.current_stream(self._device))
        self._waited.clear()

    def _pull(self, handle: Handle) -> None:
        assert self.roster is not None and self._device is not None
        if not self._exposed:
            raise WeightbusError("cuda_ipc: expose() must run at connect, before any pull")
        writer = self.roster.global_rank(handle.peer.name)
        link = self._links.get(writer)
        entry = None if link is None else link.buckets.get(handle.tag)
        if entry is None:
            raise WeightbusError(
                f"cuda_ipc: {handle.peer.name!r} shared no bucket {handle.tag} for this reader"
            )
        nbytes, pairs = entry
        handle.nbytes = nbytes
        main = torch.cuda.current_stream(self._device)
        if writer not in self._waited:
            # once per sync and link: the writer's tensors are final, and this reader's earlier
            # work on them (the engine reading its weights) is done before they are overwritten
            link.source.wait_event(link.event)
            link.side.wait_stream(main)
            self._waited.add(writer)
        with torch.cuda.stream(link.side), torch.cuda.stream(link.source):
            for dst, src, wire in pairs:
                dst.copy_(src if wire is None else src.to(wire), non_blocking=True)
        main.wait_stream(link.side)
        self._completed(handle)

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        raise AssertionError("unreachable: _check_buffer refuses buffers")

    _recv = _send

    def _close(self) -> None:
        self._links.clear()
        self._opened.clear()
        self._shared.clear()
        self._event = None

    def _abort(self, reason: str) -> None:
        self._close()
