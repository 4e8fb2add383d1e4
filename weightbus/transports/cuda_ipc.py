"""cuda_ipc: readers copy straight out of the writers' GPU memory on the same host (CUDA IPC).

No staging buffer and no packing on either side, and no per-bucket handshake:

1. at :meth:`expose` each writer shares, once, the CUDA storages behind the tensors its buckets
   read (IPC memory handles) and an interprocess CUDA event, and posts, per bucket, where each
   route's region lies in those tensors. Each reader maps what it pulls and pairs every route's
   source region with its own destination region (its live engine tensor);
2. each sync, the writer records its event once its tensors hold the new version
   (:meth:`begin`, before the readers are told). A reader's :meth:`pull` makes its streams wait
   for that event and queues each route's copy from the writer's tensor into its own. A region
   of one dtype whose bytes are rows at a constant pitch on both sides (contiguous, or e.g. a
   tensor-parallel column shard of an FSDP row shard) is one ``cudaMemcpyAsync`` /
   ``cudaMemcpy2DAsync``, queued through the CUDA runtime at a few microseconds apiece and run
   by the copy engines (GPU to GPU over NVLink, or device-to-device on the same GPU for a
   colocated trainer and engine). Casts and other strides run torch's ``copy_``;
3. the writer leaves its tensors untouched until every reader acknowledged the version, which
   readers do only once their copies ran.

A bucket of many regions (``$WEIGHTBUS_IPC_GRAPH_MEMCPYS``, default 32, or more) has its
memcpys captured once, at the first sync, as a CUDA graph on the source's GPU; each sync then
queues them with one graph launch instead of one runtime call per region.

A pull is done once its copies are queued; once the sync's last bucket is, the reader's
current stream is made to wait for all of them, so work the caller queues on that stream
afterwards (and ``synchronize``) sees the bytes.

Fan-out relays. When a writer sends several readers identical buckets (engine replicas: the
same regions, in the same order), only the first reader pulls the bucket from the writer; each
next one pulls it from the reader before it, so every GPU sends each byte once and the writer's
links are not shared three ways. The upstream reader records an interprocess event after each
chunk of relayed buckets (1/64 of them) and posts a control message saying so; the downstream
reader's copies wait for those events on the GPU, so the chain is pipelined, one chunk behind
per hop, with no per-bucket message. Chains are made only where they cut the writer's bytes out
(:func:`relay_pays`): fan-out to engine replicas, not a tensor-parallel engine's replicated
tensors.

Where the copies run: on streams of the source's GPU (its copy engines push), created by the
reader process. torch runs a cross-GPU ``copy_`` (the fallback) there too, borrowing the
source GPU's SMs for its kernel.

Order: a reader pulls from one source at a time, each reader starting at another writer, and
from relaying readers after the writers (see ``_expose_reader``); buckets of one source are
queued in the order the reader posts them, except that a reader pulls what it relays first.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgpack
import torch

from weightbus._env import env_int
from weightbus.control.store import ListOf, Row, Schema
from weightbus.errors import PlanMismatch, ProtocolError, WeightbusError
from weightbus.spec import Participant, gpu_uuid, torch_dtype
from weightbus.transports._cuda import Cudart, copy_job, cuda_device
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


_Job = tuple[int, int, int, int, int, int]  # (dst, dst pitch, src, src pitch, width, rows)
# relay events per sync and hop (fewer with a small topic window): each hop of a chain runs
# one chunk behind the one before
_RELAY_CHUNKS = env_int("WEIGHTBUS_IPC_RELAY_CHUNKS", 64)
# relays are used when they cut a writer's bytes out by more than this factor (relay_pays)
_RELAY_GAIN = float(os.environ.get("WEIGHTBUS_IPC_RELAY_GAIN", "1.25"))
# a bucket with this many memcpys queues them as one CUDA graph (captured at the first sync):
# one launch instead of a runtime call of a few microseconds per region
_GRAPH_JOBS = env_int("WEIGHTBUS_IPC_GRAPH_MEMCPYS", 32)
_GRAPH_FAILED: list[str] = []  # the first capture failure of this process (warned once)


class _Source:
    """A process whose GPU memory this reader pulls from: a writer, or an upstream reader."""

    __slots__ = ("device", "event", "last_ready", "name", "side", "stream", "waiter")

    def __init__(self, name: str, device: torch.device, reader_device: torch.device) -> None:
        self.name = name
        self.device = device
        self.event: torch.cuda.Event | None = None  # a writer's "tensors are final" event
        self.last_ready: torch.cuda.Event | None = None  # the upstream event waited last
        # ``stream``: on the source's GPU, where the memcpy jobs run (its copy engines push:
        # measured a little faster than pulling) and torch runs a cross-GPU ``copy_``;
        # ``side``: on the reader's GPU, which torch fences such a ``copy_`` with
        self.stream = torch.cuda.Stream(device)
        self.side = self.stream if device == reader_device else torch.cuda.Stream(reader_device)
        # an upstream reader's: waits for its interprocess events, off ``stream`` (below)
        self.waiter: torch.cuda.Stream | None = None


class _Bucket:
    """One bucket as this reader pulls it: memcpy jobs, and (dst, src, wire dtype) pairs left
    to ``Tensor.copy_`` (casts, odd strides)."""

    __slots__ = (
        "graph",
        "jobs",
        "landed",
        "nbytes",
        "pairs",
        "position",
        "ready",
        "ready_index",
        "relayed",
        "source",
    )

    def __init__(self, source: _Source, nbytes: int) -> None:
        self.source = source
        self.nbytes = nbytes
        self.jobs: list[_Job] = []
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, torch.dtype | None]] = []
        self.ready: torch.cuda.Event | None = None  # upstream reader's event for this bucket
        self.ready_index = -1  # which of the upstream's events that is
        self.position = 0  # where this reader queues it among its source's buckets
        self.landed: tuple[torch.cuda.Event, ...] = ()  # recorded after its copies, each sync
        # its memcpys as one CUDA graph, captured at the first sync when it has many (None:
        # not yet or too few; False: capture failed, the memcpys are queued one by one)
        self.graph: torch.cuda.CUDAGraph | bool | None = None
        # ours to record after this bucket, (event, index), when it ends a relayed chunk
        self.relayed: tuple[torch.cuda.Event, int] | None = None


def _bucket_rows(ops) -> tuple[list[str], list[list]]:
    """The tensor keys ``ops`` read, and per op ``[peer, tag, bytes, copies]`` with each copy
    as ``[key index, [[start, stop] per dim], offset, bytes]``: what a table describes."""
    keys: dict[str, int] = {}
    buckets = []
    for op in ops:
        copies = []
        for c in op.copies:
            tid = keys.setdefault(c.key, len(keys))
            copies.append([tid, [[x.start, x.stop] for x in c.index], c.offset, c.nbytes])
        buckets.append([op.peer_global, op.bucket, op.nbytes, copies])
    return list(keys), buckets


# What a participant posts at expose (``_share_table``), checked before anything is mapped:
# storages as ``_share`` describes them, tensors as [storage, offset, shape, stride, dtype],
# buckets as [peer, tag, bytes, copies] with copies as [tensor, box, offset, bytes].
_COPY = Row(int, ListOf(Row(int, int)), int, int)
TABLE: Schema = {
    "device": int,
    "event": bytes,
    "order": int,
    "events": ListOf(bytes),
    "storages": ListOf(Row(int, bytes, int, int, bytes, int, bytes, bool)),
    "tensors": ListOf(Row(int, int, ListOf(int), ListOf(int), str)),
    "buckets": ListOf(Row(int, int, int, ListOf(_COPY))),
}
"""``cuda_ipc/<n>`` from each writer: what it shares and where each bucket's routes lie."""
RELAY_TABLE: Schema = {**TABLE, "covers": ListOf(int)}
"""``cuda_ipc/<n>/relay`` from each reader: what it relays on, and per bucket its event."""
SIGNAL: Schema = {}
"""``cuda_ipc/<n>/opened`` and ``.../relayed/<sync>/<chunk>``: a bare signal."""


def _local_gpu(peer: Participant, posted: int) -> torch.device:
    """The GPU ``peer`` runs on, as this process numbers GPUs: found by its UUID (processes
    with different ``CUDA_VISIBLE_DEVICES`` number GPUs differently), else the index it
    posted (same numbering assumed)."""
    if peer.gpu:
        for i in range(torch.cuda.device_count()):
            if gpu_uuid(f"cuda:{i}") == peer.gpu:
                return torch.device("cuda", i)
        raise WeightbusError(
            f"cuda_ipc: {peer.name!r} runs on GPU {peer.gpu}, which this process cannot see "
            "(CUDA_VISIBLE_DEVICES): make every GPU of the job's cuda_ipc links visible to "
            "each of its processes, or use transport 'nccl' for these links"
        )
    return torch.device("cuda", posted)


def _check_table(table: dict, who: str, topic: str, participants: int) -> dict:
    """A table that passed :data:`TABLE`, whose cross references also hold: everything a
    reader indexes or maps with it exists. :class:`ProtocolError` otherwise."""

    def bad(what: str) -> ProtocolError:
        return ProtocolError(
            f"{who} posted {topic!r} with {what}: is it running the same weightbus version?"
        )

    storages, tensors, events = table["storages"], table["tensors"], table["events"]
    if table["device"] < 0:
        raise bad(f"device {table['device']}")
    for i, (storage, offset, shape, stride, dtype) in enumerate(tensors):
        if not 0 <= storage < len(storages):
            raise bad(f"tensors[{i}] in storage {storage} of {len(storages)}")
        if offset < 0 or len(shape) != len(stride) or any(n < 0 for n in shape):
            raise bad(f"tensors[{i}] at offset {offset}, shape {shape}, stride {stride}")
        try:
            torch_dtype(dtype)
        except Exception:
            raise bad(f"tensors[{i}] of unknown dtype {dtype!r:.40}") from None
    for b, (peer, _tag, _nbytes, copies) in enumerate(table["buckets"]):
        if not 0 <= peer < participants:
            raise bad(f"buckets[{b}] for participant {peer} of {participants}")
        for c, (tid, box, _offset, _n) in enumerate(copies):
            if not 0 <= tid < len(tensors):
                raise bad(f"buckets[{b}] copy {c} of tensor {tid} of {len(tensors)}")
            shape = tensors[tid][2]
            if len(box) != len(shape) or any(
                not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True)
            ):
                raise bad(f"buckets[{b}] copy {c} with box {box} of a {shape} tensor")
    covers = table.get("covers")
    if covers is not None and (
        len(covers) != len(table["buckets"]) or any(not 0 <= e < len(events) for e in covers)
    ):
        raise bad(f"covers {covers[:8]} for {len(table['buckets'])} buckets, {len(events)} events")
    return table


def relay_pays(direct: int, relayed: int, ingress: int) -> bool:
    """Whether a writer's readers should pass its identical buckets down a chain rather than
    each pull them from the writer: only when the writer's copies out, every reader pulling
    from it (``direct`` bytes), exceed ``_RELAY_GAIN`` x the larger of what it sends with the
    relays (``relayed``) and what its busiest reader takes in (``ingress``). A relay frees the
    writer's link but cannot make a reader take its bytes in faster, and each hop adds a chunk
    of lag and an upstream to wait for: a tensor-parallel engine's replicated embedding
    pulled from the other rank (8.55 GB out of each writer either way) made that rank finish
    last."""
    return direct > _RELAY_GAIN * max(relayed, ingress)


def _relays(tables: dict[str, dict], roster) -> dict[tuple[int, int], tuple[int, int, int]]:
    """Chains of identical buckets: (reader, writer, tag) keyed by (reader, tag) -> the
    upstream (reader, tag) it pulls from. Identical = same writer, same regions, same order.
    Only for writers whose links the chains relieve (:func:`relay_pays`)."""
    ingress: dict[int, int] = {}  # reader -> the bytes it takes in from every writer
    for t in tables.values():
        for peer, _tag, nbytes, _copies in t["buckets"]:
            ingress[peer] = ingress.get(peer, 0) + nbytes
    upstream: dict[tuple[int, int], tuple[int, int, int]] = {}
    for name, t in tables.items():
        writer = roster.global_rank(name)
        last: dict[bytes, tuple[int, int]] = {}
        chains: dict[tuple[int, int], tuple[int, int, int]] = {}
        direct = saved = 0
        for peer, tag, nbytes, copies in sorted(t["buckets"], key=lambda b: (b[0], b[1])):
            direct += nbytes
            key = msgpack.packb(copies)
            if key in last and last[key][0] != peer:
                chains[(peer, tag)] = (*last[key], writer)
                saved += nbytes
            last[key] = (peer, tag)
        busiest = max((ingress[b[0]] for b in t["buckets"]), default=0)
        if chains and relay_pays(direct, direct - saved, busiest):
            upstream.update(chains)
    return upstream


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
        self._event: torch.cuda.Event | None = None  # a writer's, recorded at begin()
        self._shared: list[torch.UntypedStorage] = []  # what this process shared, kept alive
        self._opened: list[torch.UntypedStorage] = []  # what it mapped, kept alive
        self._buckets: dict[tuple[int, int], _Bucket] = {}  # (writer, tag) -> how to pull it
        self._topic = ""
        self._cudart: Cudart | None = None
        self._graphs = 0  # buckets whose memcpys run as one CUDA graph
        # per sync, on a reader
        self._sync = 0
        self._pulled = 0
        self._waited: set[str] = set()
        self._order: list[_Source] = []  # the sources, in the order this reader pulls them
        self._stage_of: dict[str, int] = {}
        self._counts: list[int] = []  # buckets per source, in that order
        self._stage = 0  # the source being queued now
        self._held: list[dict[int, tuple[_Bucket, Handle]]] = []  # per source, by position
        self._cursor: list[int] = []  # per source: the position queued next

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

    # -- connect-time ---------------------------------------------------------------------------

    def expose(self, program: Program) -> None:
        self._require_connected()
        control, me = self.control, self.participant
        assert control is not None and me is not None
        self._topic = f"cuda_ipc/{control.sequence('cuda_ipc')}"
        if me.role == "writer":
            self._event = torch.cuda.Event(interprocess=True)
            self._event.record(torch.cuda.current_stream(self._device))
            control.post(self._topic, self._share_table(program, program.ops, event=self._event))
            # every reader has mapped what it pulls before the first sync
            control.gather(self._topic + "/opened", role="reader", schema=SIGNAL)
        else:
            self._expose_reader(program)

    def _share_table(self, program: Program, ops, event=None, events=()) -> dict:
        """Share the storages behind ``ops``' regions; the table a puller maps them from."""
        assert self._device is not None
        keys, buckets = _bucket_rows(ops)
        storages: dict[int, int] = {}  # storage data_ptr -> index in ``shared``
        shared: list[torch.UntypedStorage] = []
        table = []
        for key in keys:
            t = program.tensors[key]
            if t.device != self._device:
                raise ValueError(
                    f"cuda_ipc: tensor {key!r} is on {t.device}, this participant uses "
                    f"{self._device}: keep the bound tensors on its device"
                )
            st = t.untyped_storage()
            if st.data_ptr() not in storages:
                storages[st.data_ptr()] = len(shared)
                shared.append(st)
            dtype = str(t.dtype).removeprefix("torch.")
            table.append(
                [
                    storages[st.data_ptr()],
                    t.storage_offset(),
                    list(t.shape),
                    list(t.stride()),
                    dtype,
                ]
            )
        self._shared.extend(shared)
        return {
            "device": self._device.index,
            "event": b"" if event is None else bytes(event.ipc_handle()),
            "order": int(program.ready_order),
            "events": [bytes(e.ipc_handle()) for e in events],
            "storages": [_share(st) for st in shared],
            "tensors": table,
            "buckets": buckets,
        }

    def _expose_reader(self, program: Program) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert control is not None and roster is not None and me is not None
        assert self._device is not None
        self._cudart = Cudart.load()
        writers = control.gather(self._topic, role="writer", schema=TABLE)
        for name, t in writers.items():
            _check_table(t, f"writer {name!r}", self._topic, roster.size)
        mine = roster.global_rank(me.name)
        ops = {(op.peer_global, op.bucket): op for op in program.ops}
        upstream = _relays(writers, roster)

        def source_of(op) -> str:
            up = upstream.get((mine, op.bucket))
            return roster.all[op.peer_global if up is None else up[0]].name

        # Pull from one source at a time, each reader starting at another one: on these GPUs a
        # copy engine feeding two GPUs at once, or a GPU fed by two, halves every stream's
        # bandwidth (2 x 2 transfers between 4 H200s measured ~400 GB/s in all, two disjoint
        # links ~790), so readers of one writer group take turns instead of sharing.
        # Sources whose tensors are final earlier come first (``Program.ready_order``: a host
        # source's chunks reach its GPU one after the other); a relaying reader counts as
        # the earliest writer it relays.
        ready: dict[str, int] = {}
        for op in program.ops:
            n = source_of(op)
            w = int(writers[roster.all[op.peer_global].name].get("order", 0))
            ready[n] = min(ready.get(n, w), w)
        # Among sources ready alike, relaying readers come after the writers: their bytes
        # arrive only as they pull them (a reader that pulled the relay first would wait for
        # it, idle, with writer stages still to go).
        names = []
        for order in sorted(set(ready.values())):
            group = sorted((n for n in ready if ready[n] == order), key=roster.global_rank)
            ws = [n for n in group if n in writers]
            k = me.rank % len(ws) if ws else 0
            names += ws[k:] + ws[:k] + [n for n in group if n not in writers]
        stage = {n: i for i, n in enumerate(names)}
        # Relay tables go down the chains: an upstream reader always has a lower rank, so each
        # reader waits for its upstreams' tables (where they queue what they relay), then
        # posts its own. Within a source, buckets are queued in the order their bytes become
        # ready: relayed ones as the upstream queues (and announces) them, so each hop runs
        # one chunk behind the one before; a writer's as this reader posts them.
        ups = sorted(
            {roster.all[u[0]].name for (peer, _), u in upstream.items() if peer == mine},
            key=roster.global_rank,
        )
        relays = (
            control.gather(self._topic + "/relay", names=ups, schema=RELAY_TABLE) if ups else {}
        )
        for name, t in relays.items():
            _check_table(t, f"reader {name!r}", self._topic + "/relay", roster.size)
        posted = {(op.peer_global, op.bucket): i for i, op in enumerate(program.ops)}
        upstream_at: dict[tuple[int, int], int] = {}
        for op in program.ops:
            up = upstream.get((mine, op.bucket))
            if up is not None:
                tags = [bk[1] for bk in relays[roster.all[up[0]].name]["buckets"]]
                upstream_at[(op.peer_global, op.bucket)] = (
                    tags.index(up[1]) if up[1] in tags else -1
                )

        # buckets a later reader pulls from this one: our regions shared, and an event (and a
        # control message) per chunk of them in issue order: each wait on another process's
        # event pauses the waiting stream, so per-bucket events would throttle the relay,
        # and one chunk is the lag of each hop
        relayed_out = {up[1] for up in upstream.values() if up[0] == mine}

        def queued(op) -> tuple[int, int, int, int]:
            # within a source, what this reader relays goes first: the next reader waits for it
            key = (op.peer_global, op.bucket)
            relays = op.bucket not in relayed_out
            return stage[source_of(op)], relays, upstream_at.get(key, -1), posted[key]

        issue_order = sorted(program.ops, key=queued)
        out_ops = [op for op in issue_order if op.bucket in relayed_out]
        chunks = max(1, min(_RELAY_CHUNKS, control.config.topic_window // 4))
        chunk = max(sum(op.nbytes for op in out_ops) // chunks, 1)
        events, covers, run = [], [], 0
        for i, op in enumerate(out_ops):
            run += op.nbytes
            covers.append(len(events))
            if run >= chunk or i == len(out_ops) - 1:
                events.append(torch.cuda.Event(interprocess=True))
                events[-1].record(torch.cuda.current_stream(self._device))
                run = 0
        relay_events = {
            (op.peer_global, op.bucket): (events[covers[i]], covers[i])
            for i, op in enumerate(out_ops)
            if i == len(out_ops) - 1 or covers[i + 1] != covers[i]
        }
        table = self._share_table(program, out_ops, events=events)
        table["covers"] = covers
        control.post(self._topic + "/relay", table)
        opened_events: dict[tuple[str, int], torch.cuda.Event] = {}
        sources: dict[str, tuple[_Source, dict, dict]] = {}

        def source(name: str, t: dict) -> tuple[_Source, dict, dict]:
            if name not in sources:
                where = _local_gpu(roster.all[roster.global_rank(name)], int(t["device"]))
                src = _Source(name, where, self._device)
                # one small copy through torch: it enables peer access from the source's GPU
                torch.empty(1, device=self._device).copy_(torch.zeros(1, device=src.device))
                if t["event"]:
                    src.event = torch.cuda.Event.from_ipc_handle(src.device, t["event"])
                sources[name] = (src, {}, {})
            return sources[name]

        for wname, t in sorted(writers.items()):
            writer = roster.global_rank(wname)
            for peer, tag, nbytes, copies in t["buckets"]:
                if peer != mine:
                    continue
                op = ops.pop((writer, tag), None)
                if op is None or op.nbytes != nbytes:
                    raise PlanMismatch(
                        f"cuda_ipc: writer {wname!r} shares bucket {tag} ({nbytes} bytes) for "
                        f"{me.name!r}, whose plan has "
                        + ("no such bucket" if op is None else f"{op.nbytes} bytes in it")
                        + ": the two sides planned differently"
                    )
                up = upstream.get((mine, tag))
                if up is None:
                    src, storages, bases = source(wname, t)
                    b = self._bucket(src, op, program, t, copies, storages, bases)
                else:
                    uname = roster.all[up[0]].name
                    ut = relays[uname]
                    src, storages, bases = source(uname, ut)
                    at = [i for i, bk in enumerate(ut["buckets"]) if bk[1] == up[1]]
                    if len(at) != 1:
                        raise PlanMismatch(
                            f"cuda_ipc: reader {uname!r} relays bucket {up[1]} {len(at)} times "
                            f"in its table, {me.name!r} expects it once: the two planned "
                            "differently"
                        )
                    b = self._bucket(src, op, program, ut, ut["buckets"][at[0]][3], storages, bases)
                    e = ut["covers"][at[0]]
                    if (uname, e) not in opened_events:
                        opened_events[(uname, e)] = torch.cuda.Event.from_ipc_handle(
                            src.device, ut["events"][e]
                        )
                    b.ready, b.ready_index = opened_events[(uname, e)], e
                b.relayed = relay_events.get((writer, tag))
                self._buckets[(writer, tag)] = b
        if ops:
            (peer, tag), op = next(iter(ops.items()))
            raise PlanMismatch(
                f"cuda_ipc: {me.name!r} expects {len(ops)} buckets no writer shared, e.g. "
                f"bucket {tag} from {roster.all[peer].name!r} ({op.nbytes} bytes)"
            )
        self._order = [sources[n][0] for n in names]
        self._stage_of = {src.name: i for i, src in enumerate(self._order)}
        self._counts = [0] * len(self._order)
        for b in self._buckets.values():
            self._counts[self._stage_of[b.source.name]] += 1
        # each source's buckets are queued in issue order (see above), whatever order the
        # reader posts them in
        seen = [0] * len(self._order)
        for op in issue_order:
            b = self._buckets[(op.peer_global, op.bucket)]
            b.position = seen[self._stage_of[b.source.name]]
            seen[self._stage_of[b.source.name]] += 1
        self._held = [{} for _ in self._order]
        self._cursor = [0] * len(self._order)
        control.post(self._topic + "/opened", {})
        relayed = sum(b.ready is not None for b in self._buckets.values())
        logger.info(
            "weightbus cuda_ipc: %s pulls %d buckets (%d relayed from readers before it, %d "
            "memcpy regions, %d copy kernels); %d buckets relayed on to readers after it",
            me.name,
            len(self._buckets),
            relayed,
            sum(len(b.jobs) for b in self._buckets.values()),
            sum(len(b.pairs) for b in self._buckets.values()),
            len(out_ops),
        )

    def _bucket(self, src, op, program, table, copies, storages, bases) -> _Bucket:
        """Pair each route of ``op`` (ours) with its region in the source's shared tensors."""
        me = self.participant
        assert me is not None
        b = _Bucket(src, op.nbytes)
        by_offset = {c.offset: c for c in op.copies}
        for tid, index, offset, n in copies:
            if tid not in bases:
                sidx, soff, size, stride, dtype = table["tensors"][tid]
                if sidx not in storages:
                    storages[sidx] = _open(table["storages"][sidx])
                    self._opened.append(storages[sidx])
                bases[tid] = torch.empty(0, dtype=torch_dtype(dtype), device=src.device).set_(
                    storages[sidx], soff, size, stride
                )
            region = bases[tid][tuple(slice(a, b) for a, b in index)]
            c = by_offset.get(offset)
            if c is None or c.nbytes != n:
                raise PlanMismatch(
                    f"cuda_ipc: bucket {op.bucket} from {src.name!r}: it has a route at byte "
                    f"{offset} ({n} bytes) that {me.name!r} does not expect"
                )
            dst = program.tensors[c.key][c.index]
            if region.shape != dst.shape:
                if region.numel() != dst.numel():
                    raise PlanMismatch(
                        f"cuda_ipc: {c.tensor}: {src.name!r} region {tuple(region.shape)} and "
                        f"{me.name!r} region {tuple(dst.shape)} differ in size"
                    )
                region = region.view(dst.shape)  # the same box, up to leading 1-dims
            job = copy_job(dst, region) if self._cudart is not None else None
            if job is not None:
                b.jobs.append(job)
            else:
                # the wire dtype matters only when it differs from both ends' dtypes
                wire = c.dtype if c.dtype not in (region.dtype, dst.dtype) else None
                b.pairs.append((dst, region, wire))
        return b

    # -- per sync -------------------------------------------------------------------------------

    def begin(self) -> None:
        if self._event is not None:
            # the tensors are final once the current stream's work so far has run
            self._event.record(torch.cuda.current_stream(self._device))

    def _pull(self, handle: Handle) -> None:
        assert self.roster is not None
        b = self._buckets.get((self.roster.global_rank(handle.peer.name), handle.tag))
        if b is None:
            raise WeightbusError(
                f"cuda_ipc: {handle.peer.name!r} shared no bucket {handle.tag} for this reader"
            )
        handle.nbytes = b.nbytes
        # One source at a time, in this reader's rotated order (see _expose_reader): buckets
        # of a later source wait here until every bucket of the one before is queued.
        # Within a source, in issue order (``position``): a bucket waits here until every one
        # before it is queued.
        self._held[self._stage_of[b.source.name]][b.position] = (b, handle)
        while True:
            stage, held = self._stage, self._held[self._stage]
            while self._cursor[stage] in held:
                b2, h2 = held.pop(self._cursor[stage])
                self._cursor[stage] += 1
                self._issue(b2, h2)
            if self._cursor[stage] < self._counts[stage] or stage + 1 == len(self._order):
                break
            done, nxt = self._order[stage], self._order[stage + 1]
            self._stage += 1
            # the next source's copies start on the GPU once the previous source's are done
            for a in dict.fromkeys((done.stream, done.side)):
                for z in dict.fromkeys((nxt.stream, nxt.side)):
                    z.wait_stream(a)
        if self._pulled == len(self._buckets):  # every bucket of this sync is queued
            if self._sync == 0 and self._graphs:
                logger.info(
                    "weightbus cuda_ipc: %d of %d buckets run their memcpys as one CUDA graph",
                    self._graphs,
                    len(self._buckets),
                )
            main = torch.cuda.current_stream(self._device)
            for src in self._order:
                for z in dict.fromkeys((src.stream, src.side)):
                    main.wait_stream(z)
            self._sync += 1
            self._pulled = 0
            self._waited.clear()
            for src in self._order:
                src.last_ready = None
            self._stage = 0
            self._cursor = [0] * len(self._order)

    def _issue(self, b: _Bucket, handle: Handle) -> None:
        """Queue one bucket's copies. The reader's current stream waits for them all once the
        sync's last bucket is queued (see :meth:`_pull`)."""
        assert self._device is not None and self.control is not None
        src = b.source
        if src.name not in self._waited:
            # once per sync and source: its tensors are final (a writer's event; an upstream
            # reader's events below, once it has recorded them all), and this reader's earlier
            # work on its own tensors (the engine reading them) is done
            main = torch.cuda.current_stream(self._device)
            if src.event is not None:
                src.stream.wait_event(src.event)
            src.stream.wait_stream(main)
            if src.side is not src.stream:
                src.side.wait_stream(main)
                src.side.wait_stream(src.stream)
            self._waited.add(src.name)
        if b.ready is not None and b.ready is not src.last_ready:
            # the upstream reader has recorded this chunk's event in this sync
            self.control.gather(
                f"{self._topic}/relayed/{self._sync}/{b.ready_index}",
                names=[src.name],
                timeout=self.timeout,
                schema=SIGNAL,
            )
            # an interprocess event is waited on a stream of its own GPU (a wait from a stream
            # of another GPU crashed the process on H200s), then handed on. Not on the copy
            # stream: on H200s each such wait held the stream ~0.15 ms even when the event had
            # fired long before (1 -> 3 fan-out, 32 chunks: 50.9 ms, 46.7 off the stream); a
            # stream of its own takes that while the copies run, and the copy stream waits for
            # it through an event of this process
            if src.waiter is None:
                src.waiter = torch.cuda.Stream(src.device)
            src.waiter.wait_event(b.ready)
            src.stream.wait_stream(src.waiter)
            if b.pairs and src.side is not src.stream:
                src.side.wait_stream(src.stream)
            src.last_ready = b.ready
        if b.jobs:
            assert self._cudart is not None
            with torch.cuda.device(src.device):
                if b.graph is None and len(b.jobs) >= _GRAPH_JOBS:
                    b.graph = self._capture(b)
                if b.graph:
                    with torch.cuda.stream(src.stream):
                        b.graph.replay()
                else:
                    stream = src.stream.cuda_stream
                    for job in b.jobs:
                        self._cudart.copy(job, stream)
        if b.pairs:
            # torch runs a cross-GPU copy on the source GPU's current stream, fenced both ways
            # with the destination GPU's current stream
            with torch.no_grad(), torch.cuda.stream(src.side), torch.cuda.stream(src.stream):
                for dst, region, wire in b.pairs:
                    dst.copy_(region if wire is None else region.to(wire), non_blocking=True)
        if not b.landed:
            two = b.pairs and src.side is not src.stream
            b.landed = tuple(torch.cuda.Event() for _ in range(2 if two else 1))
        b.landed[0].record(src.stream)
        if len(b.landed) > 1:
            b.landed[1].record(src.side)
        if b.relayed is not None:
            # the buckets relayed so far are in our tensors once this fires
            main = torch.cuda.current_stream(self._device)
            for z in dict.fromkeys((src.stream, src.side)):
                main.wait_stream(z)
            event, index = b.relayed
            event.record(main)
            self.control.post(f"{self._topic}/relayed/{self._sync}/{index}", {})
        self._pulled += 1
        self._completed(handle)

    def _capture(self, b: _Bucket) -> torch.cuda.CUDAGraph | bool:
        """``b``'s memcpys as one CUDA graph (on the source's GPU, the current device), so
        a sync queues them with one launch instead of a runtime call each; False when the
        capture fails (logged once; the memcpys are then queued one by one)."""
        assert self._cudart is not None
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    for job in b.jobs:
                        self._cudart.copy(job, side.cuda_stream)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            if not _GRAPH_FAILED:
                _GRAPH_FAILED.append(str(exc))
                logger.warning(
                    "weightbus cuda_ipc: capturing a bucket's %d memcpys as a CUDA graph "
                    "failed (%s); queueing them one by one",
                    len(b.jobs),
                    exc,
                )
            return False
        self._graphs += 1
        return graph

    def landed(self, peer: Participant | str | int, tag: int) -> tuple[torch.cuda.Event, ...]:
        """Events that fire once bucket ``tag`` of writer ``peer`` is in this reader's tensors,
        in the sync whose pulls were last queued (so a reader can verify a bucket while later
        ones are still copied); () for a bucket this reader does not pull."""
        assert self.roster is not None
        b = self._buckets.get((self.roster.global_rank(self._peer(peer).name), tag))
        return () if b is None else b.landed

    def _close(self) -> None:
        self._buckets.clear()
        self._opened.clear()
        self._shared.clear()
        self._event = None

    def _abort(self, reason: str) -> None:
        self._close()
