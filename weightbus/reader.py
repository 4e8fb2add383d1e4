"""The inference side: ``Reader.wait()`` receives each new version into the engine's tensors.

Two ways to apply a version (``SyncConfig.apply``):

* transactional: the reader receives into its own copy of the engine's tensors, verifies it
  (``SyncConfig.verify``), and copies it into the engine's tensors only once every reader has
  acknowledged and the writers committed. Until then, and for good when the sync fails, the
  engine's tensors hold the previous version. Costs a second copy of the reader's weights and
  one device-local copy per sync.
* in place: bytes land straight in the engine's tensors. A sync that fails after the first
  byte may have landed leaves them holding a mix of versions: the reader is then
  :attr:`~Reader.dirty`, and the next sync sends it every byte (a delta writer is told the
  reader holds nothing; a new Reader's first sync is dense anyway).

``"auto"`` (the default) is transactional when the copy takes at most half of the memory free
on the reader's device at connect (``torch.cuda.mem_get_info``, or the host's available
memory), in place otherwise: engines that reserve most of the GPU for their KV cache (vLLM,
SGLang) run in place.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta

import torch

from weightbus._session import SyncResult, _Deadline, _phase, _Session
from weightbus._trace import mark
from weightbus.codecs.delta import Group
from weightbus.control.store import BEGIN, COMMIT
from weightbus.errors import SyncTimeout, WeightbusError
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, checked_tag, rest_tag
from weightbus.plan.program import BucketOp
from weightbus.spec import BoundLayout
from weightbus.transports.base import Handle
from weightbus.verify import RUN_BYTES, Verifier, check_reader, region_views, runs

logger = logging.getLogger(__name__)

__all__ = ["SHADOW_SHARE", "Reader"]

SHADOW_SHARE = 0.5
"""``apply="auto"`` is transactional when the copy of the reader's tensors takes at most this
share of the memory free on its device at connect."""


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def copy_bits(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i][...] = src[i]`` byte for byte (same dtypes and shapes), with one multi-tensor
    launch where torch has one. The tensors are copied as integers of their elements' width:
    torch's multi-tensor copy of floating tensors on CUDA goes through float32 and back, which
    turns every NaN into one (0x7fff in bf16, the payload lost), where a sync promises the
    sender's bits."""
    copy_all = getattr(torch, "_foreach_copy_", None)
    words: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for d, s in zip(dst, src, strict=True):
        bits = _BITS.get(d.element_size()) if d.dtype == s.dtype else None
        if copy_all is None or bits is None:
            d.copy_(s)  # same dtype: bit for bit; else a cast, as asked
        else:
            words[0].append(d.view(bits))
            words[1].append(s.view(bits))
    if words[0]:
        copy_all(*words)


class Reader(_Session):
    """One inference participant (one process, one device), writing into the engine's live
    tensors (in place, or through a copy committed at the end: ``SyncConfig.apply``); the
    engine keeps its tensor objects.

    >>> reader = Reader(bound, ControlConfig(address="trainer0:29700", num_writers=2, num_readers=2))
    >>> reader.connect()
    >>> while True:
    ...     result = reader.wait()          # blocks until the trainer's next sync is committed
    ...     generate_with(result.version)
    """

    role = "reader"
    """This side's role."""

    def __init__(
        self, *args, on_version: Callable[[SyncResult], None] | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_version = on_version
        """Called with each committed sync's :class:`~weightbus.SyncResult` (e.g. to refresh
        engine caches)."""
        self._told = -1  # the sync sequence number whose holds/ this reader posted last
        self._checksum = False
        self.live: dict[str, torch.Tensor] = self.bound.tensors
        """The engine's tensors, which it serves from. In place, also ``bound.tensors``;
        transactional, ``bound.tensors`` is this reader's copy, which syncs write, and these
        change only when a sync commits."""
        self.apply = "in_place"
        """How versions are applied, as decided at connect: "transactional" or "in_place"."""
        self.dirty = False
        """In place: a sync failed after bytes may have landed, so the engine's tensors hold a
        mix of versions (:attr:`version` is the last one committed). Serve nothing from them;
        the next sync sends every byte."""
        self._verifier: Verifier | None = None
        self._live_ptrs_at_connect: dict[str, int] = {}
        self._commit_keys: list[str] = []
        self._reads: torch.cuda.Stream | None = None  # directories' copies to the host

    def _holds_ahead(self) -> bool:
        """FP8: a reader that receives into the engine's tensors (in place) holds the buckets
        sent ahead of the writers' check in staging until each writer's word that its weights
        were finite, so that a failed check leaves those tensors as they were. A transactional
        reader receives into its own copy, which the engine never reads before a commit: those
        buckets land there at once (in place where their regions are contiguous), it takes no
        staging buffers to hold them, and it waits for the words before it acknowledges."""
        return self.apply != "transactional"

    def connect(self):
        """Connect (see :meth:`_Session.connect`): with ``apply`` transactional, first copy the
        engine's tensors, which syncs then write; afterwards agree on ``SyncConfig.verify``
        with every other participant."""
        self.apply = self._choose_apply()
        if self.apply == "transactional" and self.bound.tensors is self.live:
            with torch.no_grad():
                shadow = {k: t.detach().clone() for k, t in self.live.items()}
            self.bound = BoundLayout(layout=self.bound.layout, tensors=shadow)
        return super().connect()

    def _on_build(self) -> None:
        """At connect and in every new membership epoch (once every participant agreed on
        ``SyncConfig.verify``): the verifier, and what a transactional commit copies."""
        self._told = -1  # sync numbers start again in a new epoch
        self._verifier = self._new_verifier()
        self._commit_keys = sorted({c.key for op in self.ops for c in op.copies})
        # transactional: commits copy into the engine's tensors, which must stay where they are
        self._live_ptrs_at_connect = (
            {k: self.live[k].data_ptr() for k in self._commit_keys}
            if self.apply == "transactional"
            else {}
        )

    def _choose_apply(self) -> str:
        want = self.config.apply
        if want != "auto":
            return want
        need = sum(t.numel() * t.element_size() for t in self.live.values())
        devices = {t.device for t in self.live.values()}
        free = _free_memory(devices.pop()) if len(devices) == 1 else 0
        mode = "transactional" if need <= SHADOW_SHARE * free else "in_place"
        logger.info(
            "%s: apply=auto chose %s (a copy of its tensors takes %.1f MB, %.1f MB free)",
            self.name,
            mode,
            need / 1e6,
            free / 1e6,
        )
        return mode

    def _check_live_tensors(self) -> None:
        super()._check_live_tensors()
        self._refuse_moved(self.live, self._live_ptrs_at_connect, "engine tensor")

    def _make_codec(self, plan, codecs: CodecConfig) -> ReaderCodec | None:
        # FP8 bytes land in the engine's FP8 tensors like any others: only deltas need decoding
        if codecs.delta is None:
            return None
        return ReaderCodec(plan, self.plan_index, self.bound.tensors, codecs)

    def request_dense(self) -> None:
        """Deltas: this reader's tensors no longer hold the last version it received (the
        engine reloaded or discarded its weights, e.g. vLLM's sleep level 2): the next sync
        sends it every byte. Call it before :meth:`wait`. Without deltas every sync is dense."""
        self._before_wait("request_dense")
        if self.codec is not None:
            self.codec.version = None

    def request_checksum(self) -> None:
        """Deltas: every bucket of the next sync carries a checksum this reader verifies
        against its live tensors. Call it before :meth:`wait`."""
        self._before_wait("request_checksum")
        self._checksum = True

    def _before_wait(self, what: str) -> None:
        if self.codec is not None and self._told == self._seq:
            raise WeightbusError(
                f"{self.name}: {what}() after a wait() that timed out: the writers were already "
                "told what this reader holds for the next sync; call it before waiting, or "
                "after the next sync"
            )

    def wait(self, timeout: timedelta | None = None) -> SyncResult:
        """Receive the next sync; return once it is committed (every reader has it).

        ``timeout`` bounds the wait for the sync to *begin* (default ``step_timeout``); when
        it passes, :class:`~weightbus.errors.SyncTimeout` is raised and the reader may wait
        again. The sync itself is bounded by ``sync_timeout``; a failure during it is reported
        to every participant and leaves this reader unusable.
        """
        self._require_connected()
        cfg = self.config
        # elastic membership: when readers joined, left or died, plan again first
        replanned = self._begin_sync(cfg.step_timeout if timeout is None else timeout)
        control, transport = self.control, self.transport
        seq = self._seq
        phases = {"plan": replanned, "pack": 0.0, "transfer": 0.0, "unpack": 0.0, "control": 0.0}
        phases |= {"verify": 0.0, "commit": 0.0}
        verifier = self._verifier
        try:
            if self.codec is not None and self._told != seq:
                # deltas: the writers send dense to a reader that does not hold their last
                # version (None: it never synced, missed a version or lost its weights)
                held = self.codec.version
                control.post(f"holds/{seq}", {"holds": held, "checksum": self._checksum})
                self._told = seq
            with mark("begin"):
                begins = control.gather(
                    f"begin/{seq}",
                    role="writer",
                    timeout=cfg.step_timeout if timeout is None else timeout,
                    schema=BEGIN,
                )
        except SyncTimeout:
            raise  # no sync began: nothing is half done, the reader may wait again
        except BaseException as exc:
            self._fail(exc)
            raise
        version = -1  # until the writers' announcements are read
        touched = committing = False  # whether bytes may have landed in the engine's tensors
        try:
            t_start = time.perf_counter()
            deadline = _Deadline(cfg.sync_timeout)
            versions = {b["version"] for b in begins.values()}
            if len(versions) != 1:
                raise WeightbusError(
                    f"writers began different versions {sorted(versions)}: {begins}"
                )
            version = versions.pop()
            if self.version is not None and version <= self.version:
                raise WeightbusError(
                    f"{self.name}: writers sent version {version}, not newer than {self.version}"
                )
            total = self.bytes_per_sync
            staged: deque = deque()  # (handle, op, staging buffer), oldest first
            direct: list = []  # handles of pulls and in-place receives
            late: list[BucketOp] = []  # in-place receives summed once every one is done
            free = deque(self._staging)
            tensors = self.bound.tensors
            touched = self.apply == "in_place"
            if verifier is not None:
                verifier.begin()
            if self.codec is not None:
                # deltas: writers that said every group of theirs travels as pieces
                assert self.plan is not None
                announced = {
                    i for i, lay in enumerate(self.plan.writers) if begins[lay.name]["pieces"]
                }
                total = self._receive_coded(version, deadline, phases, announced)
            posts = () if self.codec is not None else self.posts
            # FP8: the buckets sent before the writers' check for non-finite weights come
            # first (into staging, where they wait for their writer's word), then the words,
            # then the others; per writer that sent some, the receive of its word until read
            words: dict[int, Handle] = {}
            if self.pulled:
                # the transport copies each bucket from the writer's tensors into ours
                direct = [transport.pull(op.peer_global, op.bucket) for op in self.pulled]
            i = 0  # ops posted so far (a group of in-place ones never holds a sent-ahead one)
            for group in posts:
                if i == len(self.ahead):
                    words = self._recv_words()
                i += len(group)
                op, live = group[0]
                if live is not None:
                    # contiguous regions of live tensors: received in place, no staging, a
                    # group from one peer posted at once
                    t = time.perf_counter()
                    handles = transport.recv_many(
                        op.peer_global, [(region, o.bucket) for o, region in group]
                    )
                    _phase(phases, "transfer", t)
                    direct += handles
                    for (o, _), handle in zip(group, handles, strict=True):
                        if verifier is not None and not self._queue_received(o, handle):
                            late.append(o)
                    continue
                if not free:
                    # only the oldest staged receive frees a buffer; in-place receives on other
                    # links go on meanwhile
                    free.append(
                        self._unpack_oldest(staged, tensors, phases, deadline, words, version)
                    )
                buf = free.popleft()
                t = time.perf_counter()
                staged.append(
                    (transport.recv(op.peer_global, buf[: op.nbytes], op.bucket), op, buf)
                )
                _phase(phases, "transfer", t)
            if self.ahead and i == len(self.ahead):
                words = self._recv_words()  # every bucket went ahead
            while staged:
                self._unpack_oldest(staged, tensors, phases, deadline, words, version)
            t = time.perf_counter()
            for peer in list(words):  # (transactional) each word before the buckets after it
                self._await_word(peer, words, version, deadline)
            transport.wait(direct, deadline.left())
            phases["transfer"] += time.perf_counter() - t
            if verifier is not None:
                t = time.perf_counter()
                # a pulling transport tells when each bucket landed: the sums of a run of
                # buckets overlap the later buckets' copies instead of following the last
                # one. (Queueing each run's sums as soon as its pulls were queued, before the
                # later pulls, made S1 with sums 1-2 ms slower on 2 x H200 and S3 no faster.)
                # Then the buckets received in place that the transport gave no event for.
                for run in runs(self.pulled, RUN_BYTES) + runs(late, RUN_BYTES):
                    views = [functools.partial(region_views, op, tensors) for op in run]
                    verifier.add_all(run, views, self._landed(run))
                phases["verify"] += time.perf_counter() - t
            if self._device.type == "cuda":
                # unpack kernels are queued on this stream: the bytes are in place only once
                # they ran, and only then may this reader acknowledge
                t = time.perf_counter()
                with mark("synchronize"):
                    torch.cuda.current_stream(self._device).synchronize()
                phases["transfer" if self.pulled else "unpack"] += time.perf_counter() - t
            if self.codec is not None:
                self.codec.check()  # frames the device refused to apply (damaged)
            if verifier is not None:
                t = time.perf_counter()
                check_reader(
                    control,
                    seq,
                    version,
                    verifier,
                    self.ops,
                    self.plan,
                    self.name,
                    deadline.left(),
                    self._state_after_failure(),
                )
                phases["verify"] += time.perf_counter() - t
            t = time.perf_counter()
            with mark("ack"):
                control.post(f"ack/{seq}", {"version": version, "ok": True, "bytes": total})
                commit = control.gather(
                    f"commit/{seq}",
                    names=[self.plan.writers[0].name],
                    timeout=deadline.left(),
                    schema=COMMIT,
                )
            committed = next(iter(commit.values()))["version"]
            if committed != version:
                raise WeightbusError(
                    f"{self.name}: writer {self.plan.writers[0].name!r} committed version "
                    f"{committed}, this sync carried {version}"
                )
            phases["control"] += time.perf_counter() - t
            if self.apply == "transactional":
                t = time.perf_counter()
                committing = True
                self._commit()
                committing = False
                phases["commit"] += time.perf_counter() - t
            if self.codec is not None:
                self.codec.end(version)
                self._checksum = False
            self.dirty = False  # every byte of this version landed (a dirty reader's is dense)
        except BaseException as exc:
            if touched or committing:
                self.dirty = True
            if self.codec is not None:
                self.codec.version = None  # what the tensors hold is unknown: next sync dense
            err = self._sync_failed(exc, version)
            if err is exc:
                raise
            raise err from exc
        result = self._finished(version, total, time.perf_counter() - t_start, phases)
        if self.on_version is not None:
            self.on_version(result)
        return result

    def _landed(self, ops: Sequence[BucketOp]) -> list:
        """The transport's events that fire once ``ops`` landed in this reader's tensors
        (a pulling transport's), else none: their sums then follow the current stream."""
        landed = getattr(self.transport, "landed", None)
        if landed is None:
            return []
        return [e for op in ops for e in landed(op.peer_global, op.bucket)]

    def _unpack_oldest(
        self,
        staged: deque,
        tensors,
        phases: dict[str, float],
        deadline: _Deadline,
        words: dict[int, Handle],
        version: int,
    ):
        """Wait for the oldest staged receive, unpack it; return its staging buffer. A bucket
        sent ahead of its writer's check for non-finite weights waits for the word that they
        were finite (the receives in ``words``, per writer, of the sync of ``version``) where
        this reader holds them (:meth:`_holds_ahead`); otherwise the first bucket after the
        word reads it."""
        handle, op, buf = staged.popleft()
        t = time.perf_counter()
        self.transport.wait([handle], deadline.left())
        if self._holds_ahead() if op.bucket in self.ahead else op.peer in words:
            # (transactional: a writer's word travels before its buckets not sent ahead, so
            # it is there by now; waiting for it at a bucket sent ahead could stall the link)
            self._await_word(op.peer, words, version, deadline)
        phases["transfer"] += time.perf_counter() - t
        t = time.perf_counter()
        self.copier.unpack(op, tensors, buf[: op.nbytes])
        phases["unpack"] += time.perf_counter() - t
        if self._verifier is not None:
            t = time.perf_counter()
            self._verifier.queue(op, region_views(op, tensors))  # a launch per run
            phases["verify"] += time.perf_counter() - t
        return buf

    def _queue_received(self, op: BucketOp, handle: Handle) -> bool:
        """Queue the sums of ``op``, received in place, to run once its bytes landed (with
        the next buckets', a launch per run): behind the transport's event for the receive,
        or at once where it is done. False where neither can be (no event, not done): the
        caller sums it once it waited for the receive."""
        assert self._verifier is not None and self.transport is not None
        event = self.transport.done_event(handle)
        if event is None and not (handle.done() and handle.error is None):
            return False
        tensors = self.bound.tensors
        views = functools.partial(region_views, op, tensors)
        self._verifier.queue(op, views, () if event is None else (event,))
        return True

    def _recv_words(self) -> dict[int, Handle]:
        """FP8: post the receive of each writer's word whether its weights were finite (after
        the buckets it sent ahead, before its others); return them per writer."""
        assert self.transport is not None and self.plan is not None
        tag = checked_tag(len(self.plan.buckets))
        return {
            peer: self.transport.recv(peer, self._passed[at : at + 1], tag)
            for peer, at in self._passed_at.items()
        }

    def _await_word(
        self, peer: int, words: dict[int, Handle], version: int, deadline: _Deadline
    ) -> None:
        """Wait for writer ``peer``'s word whether its weights were finite (its receive in
        ``words``, taken out once read): it must carry ``version`` (-1: they were not)."""
        handle = words.pop(peer, None)
        if handle is None:
            return  # already read
        assert self.transport is not None and self.plan is not None
        self.transport.wait([handle], deadline.left())
        got = int(self._passed[self._passed_at[peer]].item())
        writer = self.plan.writers[peer].name
        if got == -1:
            raise WeightbusError(
                f"{self.name}: writer {writer!r} found NaN or infinite weights in version "
                f"{version} (its own error names them); the buckets it sent before "
                "its check were not applied"
            )
        if got != version:
            raise WeightbusError(
                f"{self.name}: writer {writer!r} said its weights were finite for version "
                f"{got}, this sync carries {version}: the two sides run different "
                "weightbus versions or disagree on the plan"
            )

    def _commit(self) -> None:
        """Transactional: copy the verified version into the engine's tensors."""
        keys = self._commit_keys
        dst = [self.live[k] for k in keys]
        src = [self.bound.tensors[k] for k in keys]
        copy_bits(dst, src)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _state_after_failure(self) -> str:
        """What a failure of this sync leaves in the engine's tensors, for messages."""
        if self.apply == "transactional":
            return (
                f"nothing was committed: the engine's tensors keep version {self.version} "
                "(SyncConfig.apply='transactional')"
            )
        return (
            "this reader received in place, so its tensors are dirty (Reader.dirty) until a "
            "sync sends it every byte"
        )

    def _receive_coded(
        self,
        version: int,
        deadline: _Deadline,
        phases: dict[str, float],
        announced: Collection[int] = (),
    ) -> int:
        """Receive and decode every bucket of a delta sync; return the bytes received.

        A writer sends a window's buckets to this reader together, as two messages: their
        directories (whose size is fixed), then the buckets, whose size the directories give.
        A group's directories travel after the previous group's buckets or, when that group's
        directories say so, before them: the receive of a group's buckets is then posted
        while the previous group's travel, with no wait in between. Messages with one writer
        are posted in the order it sends them (NCCL matches by order alone); groups from other
        writers overlap meanwhile. A group sent as pieces whose staged pieces have a room of
        their own takes no staging buffer: its receives are posted as soon as its directories
        are read. From a writer that announced every group as pieces (``announced``, writer
        indices: its begin message, ``DeltaConfig.announce``), each group's directories follow
        its pieces: every receive of its groups is posted at once where each has a room
        (:meth:`_post_announced`), and the directories are read and checked as they arrive;
        else each group's pieces land in a staging buffer, posted as one is free, and its
        directories are read when it is applied.
        """
        codec = self.codec
        assert codec is not None
        codec.begin(version)
        free = deque(self._staging)
        pending: deque[_Group] = deque()  # oldest first
        heads: dict[int, Handle] = {}  # per group (first bucket): its directories' receive
        posted: dict[int, _Group] = {}  # per group posted ahead of its directories
        eager: dict[int, bool] = {}  # per writer that announced: every receive posted at once?
        received = 0

        def decode_oldest() -> None:
            group = pending.popleft()
            self._decode_group(group, deadline, phases)
            if group.staged:
                free.append(group.buf)

        def take_buffer() -> torch.Tensor:
            while not free:
                decode_oldest()  # (groups in rooms on the way are applied too)
            return free.popleft()

        def decode_landed() -> None:
            # the oldest groups whose bytes all landed are applied now, not once every group
            # is posted: groups that need no buffer (in rooms, or all posted at the begin
            # of an announced sync) waited until the end, and on two H100s at 50% changed
            # their applies made 1.1 ms of the sync's tail after its last byte
            while pending and pending[0].head is None and all(h.done() for h in pending[0].rest):
                decode_oldest()

        for op in self.ops:
            spec = codec.group_of(op)
            if spec is None:
                continue  # it comes with its group
            if op.peer in announced:
                if op.peer not in eager:  # its first group: all receives at once, with rooms
                    eager[op.peer] = self._post_announced(op, heads, posted, phases)
                early = posted.pop(op.bucket, None)
                if early is not None:
                    raw = self._read_directories(op, heads.pop(op.bucket), deadline, phases)
                    self._take_announced(early, raw, phases)
                    received += len(raw) + sum(h.nbytes for h in early.rest)
                    decode_landed()  # (the older ones: this one's bytes are likely on the way)
                else:  # (some group has no room) its pieces into a staging buffer
                    early = _Group(spec, take_buffer())
                    t = time.perf_counter()
                    pieces = codec.announced_pieces(spec, early.buf, in_room=False)
                    received += self._recv_pieces(early, pieces)
                    early.head = self._recv_directories(op)  # read when it is applied
                    received += self._directory_at[op.bucket].numel()
                    _phase(phases, "transfer", t)
                pending.append(early)
                continue
            if op.bucket not in heads:  # its writer's first group
                heads[op.bucket] = self._recv_directories(op)
            raw = self._read_directories(op, heads.pop(op.bucket), deadline, phases)
            # a group sent as pieces whose staged ones have a room of their own takes no
            # staging buffer: its receives are posted at once
            room = codec.room(spec, raw)
            group = _Group(spec, take_buffer() if room is None else room, staged=room is None)
            received += self._post_group(group, raw, heads, phases)
            decode_landed()
            pending.append(group)
        while pending:
            self._decode_group(pending.popleft(), deadline, phases)
        return received

    def _post_announced(
        self,
        first: BucketOp,
        heads: dict[int, Handle],
        posted: dict[int, _Group],
        phases: dict[str, float],
    ) -> bool:
        """Post every receive of the groups from the writer of the group ``first`` starts (its
        first to this reader), which announced every group as pieces: in the order it sends
        them, each group's pieces (into the live tensors, or its room), then its directories,
        so that nothing waits for a directory to be read (a profile of S7 at 50% changed on
        two H100s had a reader's first pieces posted 3.5 ms after its first directories'
        receive). The groups go into ``posted``, their directories' receives into ``heads``.
        Returns False, posting nothing, where some group has no room of its own: then each
        group's pieces go into a staging buffer as one is free (:meth:`_receive_coded`)."""
        codec = self.codec
        assert codec is not None and self.transport is not None
        chain: list[tuple[BucketOp, Group, torch.Tensor]] = []
        op: BucketOp | None = first
        while op is not None:
            spec = codec.group_of(op)
            assert spec is not None
            room = codec.announced_room(spec)
            if room is None:
                return False
            chain.append((op, spec, room))
            op = codec.next_group(op)
        t = time.perf_counter()
        with mark("post_announced"):
            for op, spec, room in chain:
                group = _Group(spec, room, staged=False)
                self._recv_pieces(group, codec.announced_pieces(spec, room, in_room=True))
                heads[op.bucket] = self._recv_directories(op)  # (they follow its pieces)
                posted[op.bucket] = group
        _phase(phases, "transfer", t)
        return True

    def _recv_directories(self, first: BucketOp) -> Handle:
        """Post the receive of the directories of the group bucket ``first`` starts."""
        assert self.transport is not None
        return self.transport.recv(
            first.peer_global, self._directory_at[first.bucket], first.bucket
        )

    def _read_directories(
        self, first: BucketOp, head: Handle, deadline: _Deadline, phases: dict[str, float]
    ) -> bytes:
        """Wait for the directories of the group bucket ``first`` starts (``head``) and read
        them (one device-to-host copy a window)."""
        assert self.transport is not None
        # waiting is transfer time, reading the directories unpack
        t = time.perf_counter()
        with mark("wait_directories"):
            self.transport.wait([head], deadline.left())
        t = _phase(phases, "transfer", t)
        with mark("read_directories"):
            raw = self._host_bytes(self._directory_at[first.bucket])
        _phase(phases, "unpack", t)
        return raw

    def _host_bytes(self, x: torch.Tensor) -> bytes:
        """The bytes of ``x``, a group's directories that arrived (their receive is done), on
        the host. A device's are copied on a stream of their own: the current stream holds
        the apply launches of the groups before, and a copy queued behind them kept the host
        from posting this group's receives until they ran, so the link sat idle meanwhile
        (on two GPUs at 50% changed with masked frames, 9 of 51 ms in these copies)."""
        if x.device.type != "cuda":
            return x.numpy().tobytes()
        if self._reads is None:
            self._reads = torch.cuda.Stream(x.device)
        with torch.cuda.stream(self._reads):
            return x.cpu().numpy().tobytes()

    def _post_group(
        self, group: _Group, raw: bytes, heads: dict[int, Handle], phases: dict[str, float]
    ) -> int:
        """Take a group's directories (``raw``), post the receive of its buckets (one
        message, or its pieces where the directories say so) and that of the next group's
        directories (into ``heads``) in the order the writer sends them; return the group's
        bytes."""
        codec = self.codec
        assert codec is not None and self.transport is not None and self.plan is not None
        first = group.spec.ops[0]
        # reading the directories is unpack time, posting receives transfer
        t = time.perf_counter()
        with mark("take_group"):
            group.parts, n = codec.take_group(group.spec, raw, group.buf)
            ahead = codec.ahead(first)
            landing = codec.pieces(group.spec, group.buf)
        t = _phase(phases, "unpack", t)
        if ahead is not None:
            heads[ahead.bucket] = self._recv_directories(ahead)
        if landing is not None:  # in place where the live tensors allow, else staged
            n = self._recv_pieces(group, landing)
        elif n:  # (no frames, nothing changed: the writer sends no second message)
            tag = rest_tag(first, len(self.plan.buckets))
            group.rest = [self.transport.recv(first.peer_global, group.buf[:n], tag)]
        nxt = codec.next_group(first)
        if nxt is not None and ahead is None:
            heads[nxt.bucket] = self._recv_directories(nxt)
        _phase(phases, "transfer", t)
        return len(raw) + n

    def _take_announced(self, group: _Group, raw: bytes, phases: dict[str, float]) -> None:
        """Take the directories (``raw``) of a group its writer announced as pieces, whose
        receives were posted before they were read, and check that they say so."""
        assert self.codec is not None
        t = time.perf_counter()
        with mark("take_group"):
            group.parts, _ = self.codec.take_group(group.spec, raw, group.buf)
            self.codec.check_announced(group.spec, in_room=not group.staged)
        _phase(phases, "unpack", t)

    def _recv_pieces(self, group: _Group, landing: Sequence[torch.Tensor]) -> int:
        """Post the receives of a group that travels as pieces, each where it lands
        (``landing``), in the posts both sides make of them; return their bytes."""
        assert self.transport is not None
        first = group.spec.ops[0]
        for post in self._piece_posts[first.bucket]:
            items = [(landing[j], tag) for j, tag in post]
            group.rest += self.transport.recv_many(first.peer_global, items)
        return sum(t.numel() for t in landing)

    def _decode_group(self, group: _Group, deadline: _Deadline, phases: dict[str, float]) -> None:
        """Wait for a whole group and apply it to the live tensors (an announced group in a
        staging buffer: once its directories, which follow its pieces, are read)."""
        if group.head is not None:
            raw = self._read_directories(group.spec.ops[0], group.head, deadline, phases)
            group.head = None
            self._take_announced(group, raw, phases)
        t = time.perf_counter()
        with mark("wait_group"):
            self.transport.wait(group.rest, deadline.left())
        phases["transfer"] += time.perf_counter() - t
        t = time.perf_counter()
        with mark("unpack_group"):
            self.codec.unpack_group(group.parts, group.buf)
        phases["unpack"] += time.perf_counter() - t
        if self._verifier is not None:
            t = time.perf_counter()
            for op in group.spec.ops:
                self._verifier.queue(op, region_views(op, self.codec.tensors))
            phases["verify"] += time.perf_counter() - t


class _Group:
    """A writer window's buckets to this reader being received: its staging buffer, then
    where each bucket lands there and the handles of their receives."""

    __slots__ = ("buf", "head", "parts", "rest", "spec", "staged")

    def __init__(self, spec: Group, buf: torch.Tensor, staged: bool = True) -> None:
        self.spec, self.buf = spec, buf
        self.staged = staged
        """Whether ``buf`` is a staging buffer (else the group's room, for its pieces)."""
        self.parts: list[tuple[BucketOp, int]] = []
        """Each bucket and where it starts in ``buf``, once the directories were read."""
        self.rest: list[Handle] = []
        """The receives of its buckets: one message, or its pieces."""
        self.head: Handle | None = None
        """The receive of its directories, where they are read when it is applied (an
        announced group whose pieces went into a staging buffer)."""


def _free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: the CUDA allocator's view of the GPU, or the host's
    available memory (0 when unknown, which selects in place)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
