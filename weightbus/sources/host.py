"""A checkpoint in host memory as the writer side of a sync: :class:`HostSource`.

Design. Inference fleets cold-start from a checkpoint, trainers offload weights to host memory,
new replicas join from a saved copy. Here the weights start in host memory, not in trainer GPU
tensors, and the job is checkpoint-engine's: every engine GPU must end with its part of the
model (all of it, for full replicas) in its own live tensors.

How it maps onto weightbus. A source is not a new kind of participant: it is one or more
ordinary :class:`~weightbus.Writer` objects whose layouts describe rows of the checkpoint
(:meth:`HostCheckpoint.layout`), so the planner, the plan digest, the control plane and every
transport work unchanged, and any reader layout (fused vLLM-style parameters, tensor parallel,
a subset of the model) is served through the same plan as a trainer's sync.

* Sharding. ``world`` source processes each hold one shard of the checkpoint
  (:func:`~weightbus.sources.checkpoint.open_checkpoint` with ``rank``/``world``): an equal,
  contiguous byte range of the files, cut at row boundaries, in pinned host memory (files in
  ``/dev/shm`` are page-locked where they lie). Every host's PCIe links then carry an equal
  share, and no process holds the whole model.
* CPU (``device="cpu"``): the writers' tensors *are* the host memory; gloo moves it to readers
  on the CPU. Nothing is copied before a sync.
* GPU (``device="cuda:N"``): a writer's tensors must be on its GPU for the GPU transports, so
  each source keeps a device mirror of its shard (1/world of the model) and *stages* it every
  sync: one ``cudaMemcpyAsync`` per contiguous run of host memory, on a stream of its own. The
  readers, one per engine GPU, then pull (cuda_ipc) or receive (NCCL) their regions from the
  mirrors of all sources. With cuda_ipc a writer's "tensors are final" event is recorded after
  its staging copies, so readers' copies wait for it on the GPU, not on the CPU.
* Pipelining (``chunks`` > 1). Each shard is cut in ``chunks`` parts, and each part is served
  by a writer of its own (writer rank ``chunk * world + rank``). The staging copies of part
  ``c + 1`` are queued behind those of part ``c`` on the same PCIe link, and part ``c``'s writer
  records its event right after its own copies, so readers start pulling part ``c`` (and
  relay it on over NVLink) while part ``c + 1`` still crosses PCIe: host->device copies,
  GPU->GPU fan-out and the in-place unpack overlap, and the slowest stage sets the pace. Readers
  pull sources in writer-rank order, rotated by reader rank, so chunk-major ranks mean every
  reader takes the first parts of all shards first.
* Fan-out. Readers that need identical regions (replicas) relay them to one another
  (cuda_ipc's relays): each byte crosses PCIe once, on its own shard's GPU, then NVLink.
* A subset of readers (new replicas). A source serves the readers of its job only. To bring
  new replicas up while the others keep serving, open a source on the same
  :class:`HostCheckpoint` in a job of its own (``ControlConfig(job=...)``) whose readers are
  the new replicas: the host memory is registered once and reused by every such job, and the
  serving replicas never see a byte or a pause. (They join the trainer's job for later syncs
  by reconnecting; the control plane has no live membership changes yet.)

Compared with checkpoint-engine (read from its 0.4.2 source): it copies a bucket host->device
on its owner rank, NCCL-broadcasts it to every rank into a staging buffer, and has each engine
load it through its ``load_weights``, bucket by bucket with a handshake each. Here the planner
gives each reader exactly its regions, copies land in place in the engine's tensors, relays
spread the fan-out over all NVLinks, and the per-bucket handshake is a GPU event.

Memory: the device mirror is 1/world of the model per source GPU; host memory is the shard.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightbus._session import SyncConfig, SyncResult
from weightbus.control.store import ControlConfig
from weightbus.errors import PeerFailure
from weightbus.plan import TransferPlan
from weightbus.sources.checkpoint import HostCheckpoint
from weightbus.spec import BoundLayout, Participant, torch_dtype
from weightbus.writer import Writer

__all__ = ["HostSource", "SourceConfig", "writer_rank"]

logger = logging.getLogger(__name__)

_ALIGN = 256


def writer_rank(rank: int, chunk: int, world: int) -> int:
    """The writer rank of part ``chunk`` of source ``rank`` of ``world`` (chunk-major)."""
    return chunk * world + rank


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceConfig:
    """Where a :class:`HostSource` serves its shard from."""

    device: str = "cpu"
    """Device of the writers' tensors: ``"cpu"`` serves host memory as it is (gloo),
    ``"cuda:N"`` stages it to that GPU at every sync (cuda_ipc, NCCL)."""
    stage: bool | None = None
    """Copy host memory into device tensors at every sync; None: on a GPU only. On the CPU it
    takes a snapshot, for host memory that changes while readers receive it."""
    name: str = "source"
    """Writer names: ``<name>-<rank>``, and ``.<chunk>`` after it when a shard has several."""
    host: str = field(default_factory=socket.gethostname)
    """Host id of the writers (participants of one host can use same-host transports)."""

    def __post_init__(self) -> None:
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={self.device!r} is not a device: pass 'cpu' or 'cuda:N'"
            ) from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: sources serve from 'cpu' or 'cuda:N'")
        if dev.type == "cuda" and self.stage is False:
            raise ValueError(
                f"device={self.device!r} with stage=False: GPU transports move GPU memory, so "
                "a GPU source must stage its host memory; leave stage=None"
            )
        if not self.name or any(ch.isspace() for ch in self.name):
            raise ValueError(f"name={self.name!r} must be non-empty without white space")


class HostSource:
    """Serves one shard of a :class:`HostCheckpoint` to the readers of a job.

    >>> ckpt = open_checkpoint("/dev/shm/model", rank=r, world=4, chunks=4)
    >>> control = ControlConfig(num_writers=4 * 4, num_readers=4, ...)
    >>> source = HostSource(ckpt, control, SyncConfig(), SourceConfig(device=f"cuda:{r}"))
    >>> source.connect()
    >>> source.sync(1)        # returns once every reader holds version 1

    The job's ``num_writers`` is ``world x chunks`` (every part of every shard is a writer);
    readers are ordinary :class:`~weightbus.Reader` objects. The checkpoint stays the
    caller's: :meth:`close` leaves it open for another job.
    """

    def __init__(
        self,
        checkpoint: HostCheckpoint,
        control: ControlConfig,
        sync: SyncConfig | None = None,
        config: SourceConfig | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.config = config or SourceConfig()
        self.sync_config = sync or SyncConfig()
        ck, cfg = checkpoint, self.config
        n = ck.world * ck.chunks
        if control.num_writers != n:
            raise ValueError(
                f"the checkpoint is cut into {ck.world} shards of {ck.chunks} chunk(s), {n} "
                f"writers in all, but ControlConfig.num_writers={control.num_writers}: pass "
                f"num_writers={n} on every writer and reader of the job"
            )
        device = torch.device(cfg.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        """Device of the writers' tensors."""
        self.staged = cfg.stage if cfg.stage is not None else device.type == "cuda"
        """Whether host memory is copied to device tensors at every sync."""
        if device.type == "cuda" and not ck.pinned:
            logger.warning(
                "%s-%d: the checkpoint's host memory is not page-locked, so host->device copies "
                "run at pageable speed; open it with pin=True",
                cfg.name,
                ck.rank,
            )
        self._copies: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._mirrors: list[torch.Tensor] = []
        self._streams: list[torch.cuda.Stream] = []
        self._staged_events: list[torch.cuda.Event] = []
        self.writers: tuple[Writer, ...] = tuple(
            Writer(self._bind(c), control, self.sync_config, ready_order=c)
            for c in range(ck.chunks)
        )
        """One writer per chunk of the shard, chunk 0 first."""
        self._pool = (
            ThreadPoolExecutor(ck.chunks, thread_name_prefix=f"weightbus-{cfg.name}")
            if ck.chunks > 1
            else None
        )
        self.version: int | None = None
        """The last version synced."""

    @property
    def name(self) -> str:
        """This source's name (its writers add ``.<chunk>`` with several chunks)."""
        return f"{self.config.name}-{self.checkpoint.rank}"

    def _bind(self, chunk: int) -> BoundLayout:
        ck, cfg = self.checkpoint, self.config
        name = self.name if ck.chunks == 1 else f"{self.name}.{chunk}"
        me = Participant(
            role="writer",
            rank=writer_rank(ck.rank, chunk, ck.world),
            name=name,
            host=cfg.host,
            device=str(self.device),
        )
        layout = ck.layout(me, chunk)
        if not self.staged:
            return BoundLayout(layout=layout, tensors=ck.tensors(chunk))
        # the mirror keeps each run's alignment (mod 256) so dtype views of it stay aligned
        runs = ck.runs(chunk)
        offsets, size = [], 0
        for _f, lo, hi, _host in runs:
            size += (lo % _ALIGN - size % _ALIGN) % _ALIGN
            offsets.append(size)
            size += hi - lo
        mirror = torch.empty(size, dtype=torch.uint8, device=self.device)
        copies, places = [], {}
        for (f, lo, hi, host), at in zip(runs, offsets, strict=True):
            copies.append((mirror[at : at + hi - lo], host))
            places[(f, lo)] = (at, hi)
        tensors = {}
        for p in ck.parts[chunk]:
            # the run holding this part: the last run of its file starting at or before it
            lo = max(lo for (f, lo) in places if f == p.file and lo <= p.begin)
            at, _ = places[(p.file, lo)]
            raw = mirror[at + p.begin - lo : at + p.begin - lo + p.nbytes]
            tensors[p.key] = raw.view(torch_dtype(p.spec.dtype)).view(p.shape)
        self._mirrors.append(mirror)
        self._copies.append(copies)
        if self.device.type == "cuda":
            self._streams.append(torch.cuda.Stream(self.device))
            self._staged_events.append(torch.cuda.Event())
        return BoundLayout(layout=layout, tensors=tensors)

    # -- lifecycle ----------------------------------------------------------------------------

    def connect(self) -> TransferPlan:
        """Connect every writer of this shard (a collective over the whole job, like
        :meth:`Writer.connect`); returns the plan."""
        plans = self._each(lambda w: w.connect())
        transport = self.writers[0].transport
        pushes = transport is not None and not transport.pulls
        if len(self.writers) > 1 and self.device.type == "cuda" and pushes:
            logger.warning(
                "%s: %d chunks over %s: each chunk's writer has a communicator of its own and "
                "their sends may interleave on the GPU; chunks pipeline best with cuda_ipc",
                self.name,
                len(self.writers),
                transport.name,
            )
        logger.info(
            "%s connected: %d writer(s), %.1f MB of host memory (%s, %s), %s",
            self.name,
            len(self.writers),
            self.checkpoint.nbytes / 1e6,
            "in place" if self.checkpoint.in_place else "copied",
            "pinned" if self.checkpoint.pinned else "pageable",
            f"staged to {self.device}" if self.staged else "served from host memory",
        )
        return plans[0]

    def sync(self, version: int) -> SyncResult:
        """Stage (on a GPU) and send this shard as ``version``; return once every reader of
        the job holds it and it is committed. Failures are those of :meth:`Writer.sync`.

        The host memory must not change until this returns (unstaged, readers read it
        throughout; staged, the copies to the device run asynchronously)."""
        version = int(version)
        t0 = time.perf_counter()
        stage = self._stage()
        results = self._each(lambda w: w.sync(version), streams=True)
        phases = {"stage": stage}
        for r in results:
            for k, v in r.phases.items():
                phases[k] = max(phases.get(k, 0.0), v)
        self.version = version
        return SyncResult(
            participant=self.name,
            version=version,
            bytes=sum(r.bytes for r in results),
            seconds=time.perf_counter() - t0,
            phases=phases,
        )

    def close(self) -> None:
        """Close the writers (the one hosting the control store last); the checkpoint stays
        open. Safe to call twice."""
        hosts = [w for w in self.writers if w.control.hosting]
        for w in [w for w in self.writers if w not in hosts] + hosts:
            try:
                w.close()
            except Exception:
                logger.debug("closing %s", w.name, exc_info=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._copies.clear()
        self._mirrors.clear()

    def __enter__(self) -> HostSource:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _stage(self) -> float:
        """Queue (GPU) or run (CPU) the copies of every chunk into its mirror; seconds spent."""
        if not self.staged:
            return 0.0
        t = time.perf_counter()
        if self.device.type != "cuda":
            for copies in self._copies:
                for dst, src in copies:
                    dst.copy_(src)
            return time.perf_counter() - t
        with torch.cuda.device(self.device):
            before = torch.cuda.current_stream(self.device)
            previous = None
            for copies, stream, done in zip(
                self._copies, self._streams, self._staged_events, strict=True
            ):
                # chunk c's copies queue behind chunk c - 1's on the same PCIe link, so each
                # chunk arrives as soon as it can, in order
                if previous is None:
                    stream.wait_stream(before)
                else:
                    stream.wait_event(previous)
                with torch.cuda.stream(stream):
                    for dst, src in copies:
                        dst.copy_(src, non_blocking=True)
                done.record(stream)
                previous = done
        return time.perf_counter() - t

    def _each(self, fn, *, streams: bool = False) -> list:
        """Run ``fn(writer)`` for every writer at once (each is one participant of a collective
        or a sync); on a GPU each writer runs with its chunk's staging stream current, so its
        "tensors are final" point follows its own copies. Raises the first failure, preferring
        one seen here over a peer's report of it."""

        def run(i: int):
            w = self.writers[i]
            if self.device.type != "cuda":
                return fn(w)
            with torch.cuda.device(self.device):  # a pool thread starts on device 0
                if not streams:
                    return fn(w)
                with torch.cuda.stream(self._streams[i]):
                    return fn(w)

        if self._pool is None:
            return [run(0)]
        futures = [self._pool.submit(run, i) for i in range(len(self.writers))]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # every writer has finished or failed: none is left
                errors.append(e)
        if errors:
            errors.sort(key=lambda e: isinstance(e, PeerFailure))
            raise errors[0]
        return results
