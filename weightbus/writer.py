"""The trainer side: after each optimizer step, ``Writer.sync(version)`` sends the new weights."""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from weightbus._session import Progress, SyncResult, _Deadline, _phase, _Session
from weightbus._trace import mark
from weightbus.codecs.fp8 import AmaxReduce
from weightbus.control.store import ACK, HOLDS
from weightbus.errors import WeightbusError
from weightbus.plan.codec_plan import CodecConfig, WriterCodec, checked_tag, rest_tag
from weightbus.plan.program import BucketOp
from weightbus.transports.base import Handle
from weightbus.verify import RUN_BYTES, Verifier, buffer_views, post_writer, region_views, runs

logger = logging.getLogger(__name__)

__all__ = ["Writer"]


class Writer(_Session):
    """One trainer participant (one process, one device).

    >>> writer = Writer(bound, ControlConfig(address="trainer0:29700", num_writers=2, num_readers=2))
    >>> writer.connect()               # every writer and reader connects; plans once
    >>> result = writer.sync(step)     # after each optimizer step
    """

    role = "writer"
    """This side's role."""

    def __init__(
        self, *args, amax_reduce: AmaxReduce | None = None, ready_order: int = 0, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ready_order = int(ready_order)
        """When this writer's tensors become final in a sync relative to the job's other
        writers (lower first): pulling transports (CUDA IPC) take earlier ones first. Host
        sources set it to the chunk index, since chunks reach the GPU in order."""
        self.amax_reduce = amax_reduce
        """With FP8 (``SyncConfig.fp8``) and writer shards that cut 128 x 128 blocks: an
        all-reduce (MAX) over the trainer's ranks holding the weights, through which writers
        agree on those blocks' scales every sync
        (``weightbus.codecs.fp8.all_reduce_max(group)``)."""
        self._verifier: Verifier | None = None
        self._directories: list[torch.Tensor] = []
        """Deltas: the windows' directories sent in the current sync (pinned host memory),
        kept until their copies to the device are done."""
        self._ahead: set[int] = set()
        """Deltas: groups (first buckets) whose directories went with the previous group's
        buckets in the current sync."""

    def _on_build(self) -> None:
        """At connect and in every new membership epoch (once every participant agreed on
        ``SyncConfig.verify``): the verifier."""
        self._verifier = self._new_verifier()

    def _make_codec(self, plan, codecs: CodecConfig) -> WriterCodec:
        return WriterCodec(
            plan, self.bound.layout.rank, self.bound.tensors, codecs, amax_reduce=self.amax_reduce
        )

    def request_dense(self) -> None:
        """Deltas: send every byte to every reader in the next sync."""
        if self.codec is not None:
            self.codec.request_dense()

    def request_checksum(self) -> None:
        """Deltas: readers verify a checksum of every bucket in the next sync (besides every
        ``DeltaConfig.checksum_every`` syncs)."""
        if self.codec is not None:
            self.codec.request_checksum()

    def sync(self, version: int, *, progress: Progress | None = None) -> SyncResult:
        """Send this writer's share of the weights as ``version``; return once every reader
        has received and acknowledged it and the version is committed.

        Raises :class:`~weightbus.errors.PeerFailure` naming a participant that failed or
        died, :class:`~weightbus.errors.SyncTimeout` after ``sync_timeout``.
        """
        self._require_connected()
        version = int(version)
        if self.version is not None and version <= self.version:
            raise ValueError(
                f"{self.name}: version {version} must be greater than the last, {self.version}"
            )
        # elastic membership: when readers joined, left or died, plan again first
        replanned = self._begin_sync(self.config.sync_timeout)
        cfg, control, transport = self.config, self.control, self.transport
        seq = self._seq
        deadline = _Deadline(cfg.sync_timeout)
        phases = {"plan": replanned, "pack": 0.0, "transfer": 0.0, "unpack": 0.0, "control": 0.0}
        phases["verify"] = 0.0
        verifier = self._verifier
        t_start = time.perf_counter()
        try:
            with mark("begin"):
                transport.begin()
                # deltas: whether every group travels as pieces, so that readers post every
                # receive at once (DeltaConfig.announce)
                announce = self.codec is not None and self.codec.announce()
                control.post(f"begin/{seq}", {"version": version, "pieces": announce})
            total = sent = self.bytes_per_sync
            done = 0
            if verifier is not None:
                verifier.begin()
            if self.codec is not None:
                sent = self._send_coded(version, seq, deadline, phases, progress, announce)
            elif self.pulled and verifier is not None:
                # readers copy from these tensors: sum them as the readers will receive them
                t = time.perf_counter()
                # in runs of buckets, a launch each (see Verifier.add_all). On 2 x H200, S3
                # with sums (the reader's sums share this GPU) took 30.4 ms with a launch per
                # bucket on both sides, 21.2 with runs; one launch over the whole model here
                # made S1 with sums ~1 ms slower than runs (the readers pull beside it)
                tensors = self.bound.tensors
                for run in runs(self.pulled, RUN_BYTES):
                    verifier.add_all(run, [region_views(op, tensors) for op in run])
                phases["verify"] += time.perf_counter() - t
            free = deque(self._staging)
            staged: deque = deque()  # (handle, staging buffer), oldest first
            direct: list = []  # handles of in-place sends
            tensors = self.bound.tensors
            # a pulling transport's readers copy from this writer's tensors themselves (and
            # with codecs every bucket went out above)
            posts = () if self.codec is not None else self.posts
            for group in posts:
                op, live = group[0]
                if live is not None:
                    # contiguous regions of live tensors: sent in place, no staging, a group
                    # to one peer posted at once
                    t = time.perf_counter()
                    direct += transport.send_many(
                        op.peer_global, [(region, o.bucket) for o, region in group]
                    )
                    _phase(phases, "transfer", t)
                    posted = [
                        (o, region_views(o, tensors) if verifier is not None else None)
                        for o, _ in group
                    ]
                else:
                    if not free:
                        # only the oldest staged send frees a buffer; in-place sends on other
                        # links go on meanwhile
                        if verifier is not None:
                            t = time.perf_counter()
                            verifier.flush(reuse=True)  # the queued sums read the buffer first
                            phases["verify"] += time.perf_counter() - t
                        t = time.perf_counter()
                        handle, buf = staged.popleft()
                        transport.wait([handle], deadline.left())
                        phases["transfer"] += time.perf_counter() - t
                        free.append(buf)
                    buf = free.popleft()
                    t = time.perf_counter()
                    view = buf[: op.nbytes]
                    self.copier.pack(op, tensors, view)
                    t = _phase(phases, "pack", t)
                    staged.append((transport.send(op.peer_global, view, op.bucket), buf))
                    _phase(phases, "transfer", t)
                    posted = [(op, buffer_views(op, view) if verifier is not None else None)]
                for o, sums in posted:
                    if sums is not None:
                        # while the bytes travel, with the next buckets' (a launch per run);
                        # a buffer is reused only after its send is done and its sums queued
                        t = time.perf_counter()
                        verifier.queue(o, sums)
                        phases["verify"] += time.perf_counter() - t
                    done += o.nbytes
                    if progress is not None:
                        progress(done, total)
            if progress is not None and (done < total or not posts):
                progress(total, total)
            drop: list[str] = []
            if verifier is not None:
                t = time.perf_counter()
                drop = post_writer(control, seq, version, verifier, self.ops)
                phases["verify"] += time.perf_counter() - t
            t = time.perf_counter()
            with mark("wait_rest"):
                transport.wait(direct + [h for h, _ in staged], deadline.left())
            phases["transfer"] += time.perf_counter() - t

            t = time.perf_counter()
            with mark("acks"):
                acks = control.gather(
                    f"ack/{seq}", role="reader", timeout=deadline.left(), schema=ACK
                )
            bad = {
                name: a
                for name, a in acks.items()
                if a.get("version") != version or not a.get("ok")
            }
            if bad:
                raise WeightbusError(
                    f"{self.name}: readers did not confirm version {version}: {bad}"
                )
            if self.codec is not None:
                self.codec.acknowledged(version, range(len(self.plan.readers)))
            if self.bound.layout.rank == 0:
                control.post(f"commit/{seq}", {"version": version})
            for topic in drop:  # every reader has read what it needed
                control.drop(topic)
            phases["control"] += time.perf_counter() - t
        except BaseException as exc:
            if self.codec is not None:
                self.codec.abandon()  # nothing is known of what readers hold: next sync dense
            err = self._sync_failed(exc, version)
            if err is exc:
                raise
            raise err from exc
        result = self._finished(version, sent, time.perf_counter() - t_start, phases)
        return result

    def _send_coded(
        self,
        version: int,
        seq: int,
        deadline: _Deadline,
        phases: dict[str, float],
        progress: Progress | None,
        announced: bool = False,
    ) -> int:
        """Encode and send every bucket through the codecs (FP8, deltas); return the bytes
        sent. The same pipeline as uncoded syncs: in-place sends go at once, staged buckets
        (with deltas, a window's buckets to one reader together) take turns on the staging
        buffers. ``announced``: the begin message said every group travels as pieces; each
        goes pieces first (:meth:`_send_announced`), and the windows' copies and sample passes
        are launched once every group is posted."""
        codec, control, transport = self.codec, self.control, self.transport
        assert codec is not None and self.plan is not None
        early: dict[int, list[Handle]] = {}  # announced: groups whose pieces went already
        if announced:
            # every byte of an announced sync is the live tensors' whatever the readers hold:
            # each reader's first group leaves before their word on what they hold is read
            for op in self._first_groups:
                early[op.bucket] = self._send_pieces(op, phases)
        if codec.policy is not None:
            # deltas: each reader says what its tensors hold, so one that missed a version
            # or lost its weights gets every byte
            t = time.perf_counter()
            with mark("holds"):
                states = control.gather(
                    f"holds/{seq}", role="reader", timeout=deadline.left(), schema=HOLDS
                )
            index = {lay.name: i for i, lay in enumerate(self.plan.readers)}
            held: list[int | None] = [None] * len(index)
            for name, state in states.items():
                held[index[name]] = state.get("holds")
            codec.readers_hold(held, checksum=any(s.get("checksum") for s in states.values()))
            phases["control"] += time.perf_counter() - t
        # codecs never pull: every op is pushed, those sent ahead first
        ahead, rest = self.pushed[: len(self.ahead)], self.pushed[len(self.ahead) :]
        t = time.perf_counter()
        # FP8: the amax pass and the writers' all-reduce; where buckets go ahead of its check
        # (they need no scales), it is queued below, once they are packed
        with mark("codec_begin"):
            codec.begin(version, scales_later=bool(ahead), announced=announced)
        phases["pack"] += time.perf_counter() - t
        self._directories = []
        self._ahead = set()
        total, done, sent = self.bytes_per_sync, 0, 0
        free = deque(self._staging)
        staged: deque = deque()  # (handles, staging buffer), oldest first
        direct: list[Handle] = []
        verifier = self._verifier
        deltas = codec.encoder is not None
        later: list[BucketOp] = []  # announced: groups whose windows' passes wait for the rest

        def post(op: BucketOp, live: torch.Tensor | None, packed=None) -> int:
            """Send bucket ``op`` (in place, or packed into a staging buffer, with deltas as
            its group; ``packed``: the buffer it was packed into, and its bytes); return the
            bytes posted."""
            group = codec.group(op) if deltas else None
            n, buf = 0, None
            if packed is not None:
                buf, n = packed
                t = time.perf_counter()
                staged.append(([transport.send(op.peer_global, buf[:n], op.bucket)], buf))
                _phase(phases, "transfer", t)
            elif live is not None:
                if op.bucket not in self.ahead:
                    codec.check()  # FP8: non-finite weights raise before the first send
                t = time.perf_counter()
                direct.append(transport.send(op.peer_global, live, op.bucket))
                _phase(phases, "transfer", t)
                n = op.nbytes
            elif group is not None and announced:
                codec.check()
                handles, n = self._send_announced(op, phases, early.pop(op.bucket, None))
                direct.extend(handles)
                later.append(op)
            elif group is not None and self._unstaged(op, phases):
                # deltas: a group sent as pieces from the live tensors (its staged ones in a
                # room of its own) waits for no staging buffer, as sends in place do
                codec.check()
                handles, n = self._send_group(op, None, phases)
                direct.extend(handles)
            elif not deltas or group is not None:
                if not free:
                    # deltas: the window's frames are computed while the oldest send drains
                    t = time.perf_counter()
                    codec.prepare(op)
                    phases["pack"] += time.perf_counter() - t
                    if verifier is not None:
                        t = time.perf_counter()
                        verifier.flush(reuse=True)  # the queued sums read the buffer first
                        phases["verify"] += time.perf_counter() - t
                    t = time.perf_counter()
                    handles, oldest = staged.popleft()
                    transport.wait(handles, deadline.left())
                    phases["transfer"] += time.perf_counter() - t
                    free.append(oldest)
                buf = free.popleft()
                if group is None:
                    t = time.perf_counter()
                    n = codec.pack(op, buf)
                    if op.bucket not in self.ahead:
                        codec.check()  # after the first pack was queued behind the amax pass
                    t = _phase(phases, "pack", t)
                    handles = [transport.send(op.peer_global, buf[:n], op.bucket)]
                    _phase(phases, "transfer", t)
                else:
                    codec.check()
                    handles, n = self._send_group(op, buf, phases)
                staged.append((handles, buf))
            if verifier is not None:
                # in place (deltas: as part of a group's pieces): the live bytes; deltas: the
                # shadow, which holds the dense values the reader must end up with; otherwise
                # the packed bytes (FP8 included)
                if live is not None or (deltas and codec.sent_live(op)):
                    sums = region_views(op, codec.tensors)
                elif deltas:
                    sums = buffer_views(op, codec.encoder.shadow_of(op))
                else:
                    sums = buffer_views(op, buf)
                t = time.perf_counter()
                verifier.queue(op, sums)
                phases["verify"] += time.perf_counter() - t
            return n

        if ahead:
            # FP8: the buckets that need no scales go first. The first one's send is posted
            # as soon as it is packed, so that the link is busy while the others are packed
            # and the host queues the amax pass (a profile of S6 had the first byte leave 1.5
            # ms into the sync, after all of that); the others travel beside the pass. Then
            # every reader sent some learns from the device whether the weights were finite.
            def pack_ahead(op: BucketOp, live: torch.Tensor | None):
                if live is not None or not free:
                    return None  # in place, or packed by post() as sends free a buffer
                t = time.perf_counter()
                buf = free.popleft()
                packed = (buf, codec.pack(op, buf))
                phases["pack"] += time.perf_counter() - t
                return packed

            first, others = ahead[0], ahead[1:]
            sent += post(*first, pack_ahead(*first))
            packed = [pack_ahead(op, live) for op, live in others]
            t = time.perf_counter()
            started = codec.start_scales()  # on part of the GPU: the sends need the rest
            phases["pack"] += time.perf_counter() - t
            for (op, live), pk in zip(others, packed, strict=True):
                sent += post(op, live, pk)
            t = time.perf_counter()
            finite = codec.finish_scales(started)
            phases["pack"] += time.perf_counter() - t
            self._send_passed(version, finite, direct)
        done = sum(op.nbytes for op, _ in ahead)
        for op, live in rest:
            sent += post(op, live)
            done += op.nbytes
            if progress is not None:
                progress(done, total)
        t = time.perf_counter()
        with mark("queued"):
            for op in later:
                # the windows' copies and sample passes: on the GPU beside the sends, all
                # posted by now (posting is the writer's host work that the link waits for)
                codec.queued(op)
        phases["pack"] += time.perf_counter() - t
        t = time.perf_counter()
        with mark("end"):
            codec.check()  # where nothing else was sent, the weights' fault is still this sync's
            codec.end()  # (deltas: reads the counts of the windows sent dense, after copies)
        t = _phase(phases, "pack", t)
        with mark("wait"):
            transport.wait(direct + [h for handles, _ in staged for h in handles], deadline.left())
        phases["transfer"] += time.perf_counter() - t
        with mark("release"):  # (the directories' pinned host copies)
            self._directories = []
        return sent

    def _unstaged(self, op: BucketOp, phases: dict[str, float]) -> bool:
        """Deltas: whether the group bucket ``op`` starts needs no staging buffer in this sync
        (its window analyzed to know: pack time)."""
        assert self.codec is not None
        t = time.perf_counter()
        with mark("unstaged"):
            unstaged = self.codec.unstaged(op)
        _phase(phases, "pack", t)
        return unstaged

    def _send_passed(self, version: int, finite: torch.Tensor, handles: list[Handle]) -> None:
        """FP8: tell each reader this writer sent buckets ahead whether its weights were
        finite (one word: the version if they were, else -1), after those buckets and before
        the others. The word is written on the device once the amax pass ran (``finite``), so
        the host sends it without waiting for that pass."""
        assert self.transport is not None and self.plan is not None
        if not self._passed_at:
            return
        self._passed.fill_(version).masked_fill_(~finite, -1)
        tag = checked_tag(len(self.plan.buckets))
        for peer, at in self._passed_at.items():
            peer_global = len(self.plan.writers) + peer
            handles.append(self.transport.send(peer_global, self._passed[at : at + 1], tag))

    def _send_group(
        self, op: BucketOp, buf: torch.Tensor | None, phases: dict[str, float]
    ) -> tuple[list[Handle], int]:
        """Deltas: encode the window's buckets to ``op``'s reader into ``buf`` (None: a group
        that needs none, :meth:`WriterCodec.unstaged`) and send them:
        their directories (whose sizes the reader knows), unless they went ahead with the
        previous group's, then the buckets themselves, as one message or, where they say so,
        as the group's pieces (from the live tensors); the next group's directories go
        before the buckets where this group's say so (the reader then posts its next
        receive while these buckets travel). Return the handles and the bytes sent."""
        assert self.transport is not None and self.codec is not None and self.plan is not None
        nb = len(self.plan.buckets)
        # encoding is pack time, posting the sends (their directories' copies too) transfer
        t = time.perf_counter()
        # the rest: one message (in buf, or the shadow's) or the pieces (live, or in buf)
        with mark("pack_group"):
            directories, rest = self.codec.pack_group(op, buf)
        t = _phase(phases, "pack", t)
        handles: list[Handle] = []
        if op.bucket in self._ahead:
            self._ahead.discard(op.bucket)  # sent with the previous group's buckets
        else:
            handles.append(self._send_directories(op, directories))
        t = _phase(phases, "transfer", t)
        with mark("ahead"):
            nxt = self.codec.ahead(op)
        t = _phase(phases, "pack", t)
        if nxt is not None:
            handles.append(self._send_directories(*nxt))
            self._ahead.add(nxt[0].bucket)
        with mark("send"):
            if rest and rest[0][0] < 0:
                handles.append(self.transport.send(op.peer_global, rest[0][1], rest_tag(op, nb)))
            elif rest:
                handles += self._post_pieces(op, rest)
        # (no rest: nothing changed in the group, no second message)
        t = _phase(phases, "transfer", t)
        with mark("queued"):
            self.codec.queued(op)
        _phase(phases, "pack", t)
        return handles, sum(h.nbytes for h in handles)

    def _send_announced(
        self, op: BucketOp, phases: dict[str, float], sent: list[Handle] | None
    ) -> tuple[list[Handle], int]:
        """Deltas, in a sync announced as pieces: send the group bucket ``op`` starts, its
        pieces first (:meth:`_send_pieces`; ``sent``: their handles, where they went
        already), then its directories, which the readers check once they arrive (they
        posted every receive at the sync's begin). A profile of S7 at 50% changed on two
        H100s had the first pieces leave 2.4 ms after the writer's first GPU event, its host
        analyzing the first two windows meanwhile. Return the handles and the bytes sent."""
        assert self.codec is not None
        handles = self._send_pieces(op, phases) if sent is None else list(sent)
        t = time.perf_counter()
        with mark("pack_group"):
            directories, _ = self.codec.pack_group(op, None)
        t = _phase(phases, "pack", t)
        with mark("directories"):
            handles.append(self._send_directories(op, directories))
        _phase(phases, "transfer", t)
        return handles, sum(h.nbytes for h in handles)

    def _send_pieces(self, op: BucketOp, phases: dict[str, float]) -> list[Handle]:
        """Deltas, in a sync announced as pieces: send the pieces of the group bucket ``op``
        starts (from the live tensors and its room: known from the plan, before its window
        is analyzed); return their handles."""
        assert self.transport is not None and self.codec is not None
        t = time.perf_counter()
        with mark("pieces"):
            pieces = self.codec.announced_pieces(op)
        t = _phase(phases, "pack", t)
        with mark("send"):
            handles = self._post_pieces(op, pieces)
        _phase(phases, "transfer", t)
        return handles

    def _post_pieces(self, op: BucketOp, pieces: list[tuple[int, torch.Tensor]]) -> list[Handle]:
        """Send the pieces of the group bucket ``op`` starts (each (its index, its bytes)),
        in the posts the reader makes of them (:attr:`_piece_posts`)."""
        assert self.transport is not None
        handles: list[Handle] = []
        for post in self._piece_posts[op.bucket]:
            handles += self.transport.send_many(
                op.peer_global, [(pieces[j][1], tag) for j, tag in post]
            )
        return handles

    def _send_directories(self, first: BucketOp, directories: torch.Tensor) -> Handle:
        """Send the directories of the group bucket ``first`` starts from their place on the
        device (:attr:`_directory_at`), copied there from ``directories`` (host bytes)."""
        assert self.transport is not None
        on_device = self._directory_at[first.bucket]
        on_device.copy_(directories, non_blocking=True)
        self._directories.append(directories)  # alive until the sync is over: the copy reads it
        return self.transport.send(first.peer_global, on_device, first.bucket)
