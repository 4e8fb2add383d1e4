"""What writers and readers share: configuration, connect (layouts -> plan -> transport), results."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch

from weightbus import metrics as _metrics
from weightbus._green import amax_sms
from weightbus.codecs.delta import DeltaConfig, group_aligned, piece_posts
from weightbus.codecs.fp8 import Fp8Config
from weightbus.control import status as _status
from weightbus.control.store import MEMBERS, ControlConfig, ControlPlane, DictOf, Schema
from weightbus.errors import (
    MembershipError,
    PeerFailure,
    PlanMismatch,
    SyncTimeout,
    WeightbusError,
)
from weightbus.plan import PlanOptions, TransferPlan, build_program, make_plan
from weightbus.plan.codec_plan import (
    CodecConfig,
    check_codec_layouts,
    piece_tag,
    sent_ahead,
    wire_layout,
)
from weightbus.plan.program import BucketCopier, BucketOp, direct_view
from weightbus.spec import BoundLayout, Layout, LayoutError, Participant
from weightbus.transports.base import Program, Transport, transport_class
from weightbus.transports.links import LinkChoice, build_transport, check_choice, choose_links
from weightbus.verify import Verifier, level_mismatch

logger = logging.getLogger(__name__)

MiB = 1 << 20

Progress = Callable[[int, int], None]
"""Called as ``progress(bytes_posted, bytes_total)`` while a sync runs (posted: handed to the
transport; the sync returns once every reader has them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConfig:
    """How syncs run; writers and readers of one job must use equal plan-related fields."""

    bucket_bytes: int = 64 * MiB
    """Largest bucket: the size of one staging buffer."""
    staging_buffers: int = 4
    """Staging buffers per participant; staging memory is at most this x bucket_bytes (with
    FP8, a reader has at least 2 more than buckets are sent to it ahead: ``Fp8Config.ahead``). With
    deltas a buffer holds a window's buckets to one reader (``DeltaConfig.window_bytes``), and
    at most 2 are used, or one per peer where there are more (still at most this many)."""
    cast: Mapping[str, str] = field(default_factory=dict)
    """Dtype changes on the wire, writer dtype -> reader dtype, e.g. {"float32": "bfloat16"}."""
    ignore_unread: tuple[str, ...] = ()
    """fnmatch patterns of writer tensors no reader needs."""
    direct_bytes: int = 4 * MiB
    """Routes this large travel alone and, where contiguous and needing no cast, in place (with
    a codec on, only routes of ``bucket_bytes`` and more travel alone: see plan_options)."""
    pack_mixed: bool = True
    """With no codec on, a *mixed* link (one on which some large route would be staged on one
    side: a row-parallel engine weight from a trainer sharded by rows) whose transport asks
    for it (NCCL: :attr:`Transport.pack_mixed_links`) packs all its routes into buckets,
    fewer and larger messages (as :attr:`PlanOptions.pack_mixed <weightbus.plan.PlanOptions.pack_mixed>`
    does for every mixed link; CUDA IPC's links keep their large routes alone).
    False: large routes always travel alone. Must be equal on every participant."""
    transport: str | Mapping[str, str] = "auto"
    """"auto" (choose per link from hosts, GPUs and processes), one transport name for every
    link ("nccl"), or per link class (``{"same_host": "nccl"}``, or ``"same_host=nccl"``;
    classes left out stay automatic): see :mod:`weightbus.transports.links`. With "auto",
    ``$WEIGHTBUS_TRANSPORT`` (same forms) decides."""
    sync_timeout: timedelta = timedelta(minutes=5)
    """Longest one sync may take once it started, on any participant."""
    connect_timeout: timedelta = timedelta(minutes=5)
    """Longest connect may wait for the other participants."""
    step_timeout: timedelta = timedelta(minutes=30)
    """Longest a reader waits for the next sync to begin (a training step and its rollouts)."""
    fp8: Fp8Config | None = None
    """FP8 block quantization on the wire (:class:`weightbus.codecs.Fp8Config`); readers then
    bind FP8 engine parameters and their scales (``quantized_layout``). Equal on every side."""
    delta: DeltaConfig | None = None
    """Sparse, bit-exact deltas against the previous sync (:class:`weightbus.codecs.DeltaConfig`);
    every participant must enable it."""
    verify: str = "checksum"
    """Checks of every sync (:mod:`weightbus.verify`): "checksum" (per-route sums on both
    sides, compared before readers acknowledge), "full" (debug: every byte compared through
    the control store) or "off". Equal on every side."""
    apply: str = "auto"
    """Readers: "transactional" (receive into a copy of the tensors, copy it into the engine's
    tensors only once every byte arrived and verified), "in_place" (receive straight into the
    engine's tensors; a failed sync leaves them dirty) or "auto": transactional when a copy
    takes at most half the free memory of the reader's device at connect, else in place."""

    def __post_init__(self) -> None:
        if self.verify not in ("off", "checksum", "full"):
            raise ValueError(
                f"verify={self.verify!r} must be 'checksum' (the default), 'full' (debug) or 'off'"
            )
        if self.apply not in ("auto", "transactional", "in_place"):
            raise ValueError(f"apply={self.apply!r} must be 'auto', 'transactional' or 'in_place'")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise TypeError(
                f"fp8={self.fp8!r} must be a weightbus.codecs.Fp8Config or None (no FP8)"
            )
        if self.delta is not None and not isinstance(self.delta, DeltaConfig):
            raise TypeError(
                f"delta={self.delta!r} must be a weightbus.codecs.DeltaConfig or None (no deltas)"
            )
        if self.staging_buffers < 1:
            raise ValueError(f"staging_buffers={self.staging_buffers} must be at least 1")
        if self.bucket_bytes < 1 * MiB:
            raise ValueError(
                f"bucket_bytes={self.bucket_bytes} is below 1 MiB: use 64-512 MiB (256 by default)"
            )
        for name in ("sync_timeout", "connect_timeout", "step_timeout"):
            v = getattr(self, name)
            if not isinstance(v, timedelta) or v.total_seconds() <= 0:
                raise ValueError(f"{name}={v!r} must be a positive datetime.timedelta")
        object.__setattr__(self, "ignore_unread", tuple(self.ignore_unread))
        if self.transport != "auto":
            object.__setattr__(self, "transport", check_choice(self.transport))

    def plan_options(self) -> PlanOptions:
        """The planner's options from this config's plan-related fields, as its codecs plan
        them (:meth:`CodecConfig.plan_options <weightbus.plan.codec_plan.CodecConfig.plan_options>`)."""
        options = PlanOptions(
            bucket_bytes=self.bucket_bytes,
            cast=dict(self.cast),
            ignore_unread=self.ignore_unread,
            direct_bytes=self.direct_bytes,
        )
        return self.codecs().plan_options(options)

    def codecs(self) -> CodecConfig:
        """The codecs on the wire from this config's ``fp8`` and ``delta``."""
        return CodecConfig(fp8=self.fp8, delta=self.delta)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncResult:
    """One sync as seen by one participant."""

    participant: str
    """Name of the participant this result is from."""
    version: int
    """The version synced."""
    bytes: int
    """Bytes this participant sent (writer) or received (reader)."""
    seconds: float
    """Wall time of the whole sync on this participant."""
    phases: dict[str, float]
    """Seconds per phase: plan (planning again for new members before the sync, elastic
    membership; not part of ``seconds``), pack (packing and encoding), transfer (posting
    sends and receives, and waiting for them), unpack (unpacking and decoding), control."""

    @property
    def gbps(self) -> float:
        """``bytes / seconds`` in GB/s (0 when no time passed)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One line for logs: bytes, milliseconds, GB/s and each phase."""
        ph = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.phases.items())
        return (
            f"{self.participant} v{self.version}: {self.bytes / 1e6:.1f} MB in {self.seconds * 1e3:.1f} ms "
            f"({self.gbps:.2f} GB/s) {ph}"
        )


def _phase(phases: dict[str, float], name: str, since: float) -> float:
    """Add the time since ``since`` (a ``time.perf_counter()``) to phase ``name`` of a sync's
    ``phases``; return now, the next phase's start."""
    now = time.perf_counter()
    phases[name] += now - since
    return now


class _Session:
    """Connect-time work common to :class:`~weightbus.Writer` and :class:`~weightbus.Reader`."""

    role: str
    ready_order: int = 0  # a writer's (see Writer); pulling transports order sources by it

    def __init__(
        self, bound: BoundLayout, control: ControlConfig, config: SyncConfig | None = None
    ) -> None:
        if bound.layout.role != self.role:
            raise ValueError(
                f"{type(self).__name__} needs a {self.role} layout, got {bound.layout.role} "
                f"{bound.layout.name!r}: build the layout with role={self.role!r}"
            )
        self.bound = bound
        self.config = config or SyncConfig()
        self.control = ControlPlane(bound.layout.participant, control)
        self.plan: TransferPlan | None = None
        self.ops: tuple[BucketOp, ...] = ()
        self.bytes_per_sync = 0
        """Bytes this participant sends (writer) or receives (reader) per sync."""
        self.direct: list[torch.Tensor | None] = []
        """Per op: the live bytes it moves in place (one contiguous region), or None (staged)."""
        self.pulled: tuple[BucketOp, ...] = ()
        """The ops whose link pulls: the reader copies straight from the writer's tensors."""
        self.pushed: tuple[tuple[BucketOp, torch.Tensor | None], ...] = ()
        """The other ops, each with its ``direct`` entry: the writer sends them. In program
        order, except that FP8 buckets sent ahead (:attr:`ahead`) come first."""
        self.posts: tuple[tuple[tuple[BucketOp, torch.Tensor | None], ...], ...] = ()
        """:attr:`pushed` in the groups this participant posts at once (:func:`post_groups`)."""
        self.transport: Transport | None = None
        self.codec = None
        """The codecs' state (WriterCodec / ReaderCodec), or None when none applies here."""
        self._staging: list[torch.Tensor] = []
        self._directory_at: dict[int, torch.Tensor] = {}
        """Deltas: per group (its first bucket), where its directories travel from or land."""
        self._piece_posts: dict[int, list[list[tuple[int, int]]]] = {}
        """Deltas: per group (its first bucket), the posts of its pieces when it travels as
        pieces, each its pieces' (index, tag), the same on both sides (fixed at connect)."""
        self._first_groups: tuple[BucketOp, ...] = ()
        """Deltas: each peer's first group (its first bucket), in program order."""
        self.ahead: frozenset[int] = frozenset()
        """FP8: the buckets of this participant sent before the writers' check for non-finite
        weights (:func:`~weightbus.plan.codec_plan.sent_ahead`)."""
        self._passed = torch.zeros(1, dtype=torch.int64)
        self._passed_at: dict[int, int] = {}
        """FP8, per peer with buckets sent ahead: its place in :attr:`_passed`, where the
        writer's word whether its weights were finite (the version, or -1) travels from or
        lands."""
        self._device = torch.device("cpu")
        self._seq = 0  # this epoch's syncs: the number in the next sync's topics
        self.syncs = 0
        """Syncs this participant completed since connect."""
        self.version: int | None = None
        """The last version this participant synced (for a reader: the one its tensors hold)."""
        self._closed = False
        self._failed = ""
        self._live_ptrs: dict[str, int] = {}
        self.plan_seconds = 0.0
        self.plan_index = 0
        """This participant's place among the plan's writers or readers (its rank, while no
        reader has left)."""
        self._stale = False  # this epoch's plan no longer serves: a sync or connect failed
        self._checked = -1  # the sync number whose membership check is done
        self._refused = False  # a joining reader the running job would not take

    @property
    def name(self) -> str:
        return self.bound.layout.name

    def connect(self) -> TransferPlan:
        """Register, agree on the codecs, exchange layouts, plan, agree on the plan digest,
        build the codecs' state and the transport.

        A layout disagreement raises :class:`~weightbus.spec.LayoutError` here, and a codec
        disagreement :class:`~weightbus.errors.PlanMismatch`, on every participant, before any
        byte moves.

        A reader that connects while the job runs (elastic membership, see
        :class:`~weightbus.ControlConfig`) is admitted by writer rank 0 at the start of the
        writers' next sync; connect returns then, and that sync brings it to the current
        version. If its layout or codecs do not fit the running job, only it raises: the
        others go on without it.
        """
        try:
            self.control.connect()
            if self.control.joining:
                self.control.request_entry(-1)
                self.control.await_roster(-1, timeout=self.config.connect_timeout)
            plan = self._build()
        except BaseException as exc:
            if not self._refused:
                self._fail(exc)
            self._teardown()
            raise
        return plan

    def _build(self) -> TransferPlan:
        """Everything static, for the members of the control plane's current epoch: agree on
        the codecs, exchange layouts, plan, agree on the plan digest, build the codecs' state
        and the transport. Runs at connect and again whenever the members change."""
        self._seq = self._checked = 0  # sync numbers count from 0 in every epoch
        self.transport = None
        first = self.plan is None
        codecs = self.config.codecs()
        self._agree_codecs(codecs)
        # the verify level too: a joining reader with another one is refused alone
        self._agree("verify", self.config.verify, level_mismatch)
        refused: dict[str, Exception] = {}
        writers, readers = self.control.exchange_layouts(
            self._wire_layout(codecs), timeout=self.config.connect_timeout, refused=refused
        )
        self._refuse(refused)
        t_plan = time.perf_counter()
        cfg, job = self.config, self.control.config.job
        chosen: list[LinkChoice] = []

        def pack_mixed_links(people, links, mixed):
            # the transport per link, from the plan's links, before its buckets are made; the
            # mixed links whose transport asks for it (NCCL's) are packed: one plan
            chosen[:] = [_choose_transport(cfg.transport, people, codecs, job=job, links=links)]
            if not cfg.pack_mixed or codecs.active:
                return ()
            of = {(x.writer, x.reader): x.transport for x in chosen[0].links}
            return [
                (w, r) for w, r in mixed if transport_class(of[w.name, r.name]).pack_mixed_links
            ]

        plan = self._make_plan(writers, readers, pack_mixed_links)
        # (asked by every plan: the sessions' plan options never set pack_mixed themselves)
        (choice,) = chosen
        packed = plan.stats.packed_links
        if packed:
            logger.info(
                "weightbus: %s packs every route of %d of %d mixed links (%s) into buckets: "
                "a large route on each would be staged on one side (SyncConfig.pack_mixed)",
                self.name,
                len(packed),
                len(plan.stats.mixed_links),
                ", ".join(f"{plan.writers[w].name}->{plan.readers[r].name}" for w, r in packed[:4])
                + (", ..." if len(packed) > 4 else ""),
            )
        self.plan_seconds = time.perf_counter() - t_plan
        self._agree("plan", plan.digest, lambda exc: exc)
        mine = plan.writers if self.role == "writer" else plan.readers
        index = self.plan_index = [lay.name for lay in mine].index(self.name)
        self.codec = self._make_codec(plan, codecs) if codecs.active else None
        if self.codec is not None:
            self.ops = self.codec.ops
        else:
            self.ops = build_program(plan, self.role, index)
        # the transport's own per-operation bound must not cut a sync short: a writer's
        # sends wait for readers that may still be finishing their rollouts
        self.transport = build_transport(choice, timeout=max(cfg.sync_timeout, cfg.step_timeout))
        self.transport.connect(self.control, plan.participants)
        device = self._device = _device_of(self.bound)
        if self.codec is not None:
            self.direct = [self.codec.direct(op) for op in self.ops]
        else:
            self.direct = [direct_view(op, self.bound.tensors) for op in self.ops]
        # FP8: buckets sent before the writers' check for non-finite weights; readers that
        # receive into the engine's tensors hold them in staging (never in place) until their
        # writer's word that they were finite
        ahead = sent_ahead(plan, codecs)
        self.ahead = frozenset(op.bucket for op in self.ops if op.bucket in ahead)
        if self.role == "reader" and self.ahead and self._holds_ahead():
            self.direct = [
                None if op.bucket in self.ahead else d
                for op, d in zip(self.ops, self.direct, strict=True)
            ]
        # per op: does its link pull (readers copy straight from the writers' tensors)?
        pulls = [self.transport.pulls_from(op.peer_global) for op in self.ops]
        self.pulled = tuple(op for op, p in zip(self.ops, pulls, strict=True) if p)
        self.pushed = tuple(
            (op, d) for op, d, p in zip(self.ops, self.direct, pulls, strict=True) if not p
        )
        if self.ahead:
            # FP8: the buckets sent ahead of the writers' check go first on every link, then
            # the others in order (both sides post the same order)
            self.pushed = tuple(x for x in self.pushed if x[0].bucket in self.ahead) + tuple(
                x for x in self.pushed if x[0].bucket not in self.ahead
            )
        self.posts = self._post_groups(plan)
        self._live_ptrs = {
            c.key: self.bound.tensors[c.key].data_ptr()
            for op, live, p in zip(self.ops, self.direct, pulls, strict=True)
            if live is not None or p
            for c in op.copies
        }
        staged = [
            self.codec.capacity(op) if self.codec is not None else op.nbytes
            for op, d, p in zip(self.ops, self.direct, pulls, strict=True)
            if d is None and not p
        ]
        n = min(self.config.staging_buffers, len(staged))
        groups = self.codec.group_capacities() if self.codec is not None else None
        if groups is not None:
            # deltas: a window's buckets to one reader are staged together; two such buffers
            # keep a link busy (one filled while the other travels), one per peer lets
            # several links overlap
            staged = groups
            peers = len({op.peer for op in self.ops})
            n = min(self.config.staging_buffers, max(2, peers), len(staged))
        if self.role == "reader" and self.ahead and self._holds_ahead():
            # FP8: a reader holds every bucket sent ahead of the writers' check at once, and
            # has AHEAD_SPARE buffers more to post the next receives into while it waits for
            # the word (with none, a profile of S6 had the link idle 0.7 ms after the word).
            # A writer packs those that fit in its buffers, the others as buffers free up: it
            # need not take one per bucket of every reader.
            want = min(len(self.ahead) + AHEAD_SPARE, len(staged))
            if want > n:
                logger.info(
                    "%s: %d staging buffers instead of staging_buffers=%d, to hold the %d "
                    "buckets sent before the writers' check for non-finite weights "
                    "(Fp8Config.ahead) and receive the next ones meanwhile",
                    self.name,
                    want,
                    self.config.staging_buffers,
                    len(self.ahead),
                )
                n = want
        largest = max(staged, default=0)
        self._staging = _staging_buffers(self.name, n, largest, device, codecs)
        # deltas: each group's directories (the first of its two messages) have a place of
        # their own, so that they may travel before the previous group's buckets have left
        # a staging buffer
        starts = self.codec.group_starts() if self.codec is not None else []
        room = [group_aligned(g.directories) for _, g in starts]
        area = torch.empty(sum(room), dtype=torch.uint8, device=device)
        at = np.cumsum(room) - room
        self._directory_at = {
            op.bucket: area[a : a + g.directories]
            for (op, g), a in zip(starts, at.tolist(), strict=True)
        }
        self._piece_posts = {
            op.bucket: [
                [(j, piece_tag(plan, g, j)) for j in post] for post in piece_posts(g.pieces)
            ]
            for op, g in starts
        }
        firsts: dict[int, BucketOp] = {}
        for op, _ in starts:
            firsts.setdefault(op.peer, op)
        self._first_groups = tuple(firsts.values())
        # FP8 buckets sent ahead: per peer they go to or come from, the place of the word
        # whether the writer's weights were finite (the version, or -1)
        peers = sorted({op.peer for op in self.ops if op.bucket in self.ahead})
        self._passed_at = {peer: i for i, peer in enumerate(peers)}
        self._passed = torch.zeros(max(1, len(peers)), dtype=torch.int64, device=device)
        self.copier = BucketCopier()  # packs and unpacks them: one launch per bucket on CUDA
        # deltas: plain groups are sent from the writer's shadow; groups sent as pieces stage
        # some in rooms of their own
        extra = []
        if self.codec is not None:
            extra = (
                self.codec.send_buffers() if self.role == "writer" else self.codec.room_buffers()
            )
        self.transport.register(self._staging + ([area] if starts else []) + extra + [self._passed])
        if self.codec is not None and self.role == "writer":
            self.codec.send_from_stores(self.transport.sends_anywhere())
        tensors = self.codec.tensors if self.codec is not None else self.bound.tensors
        self.transport.expose(
            Program(self.ops, tensors, tuple(self.direct), ready_order=self.ready_order)
        )
        self.bytes_per_sync = sum(op.nbytes for op in self.ops)
        self.plan = plan
        self._on_build()
        self._stale = False
        self._failed = ""
        logger.info(
            "%s %s: %d buckets (%d in place), %.1f MB per sync on this %s, staging %d x "
            "%.1f MiB; plan %s (%s); transport %s; codecs %s; membership epoch %d with %d "
            "readers",
            self.name,
            "connected" if first else "planned again",
            len(self.ops),
            sum(d is not None for d in self.direct),
            self.bytes_per_sync / 1e6,
            self.role,
            len(self._staging),
            (self._staging[0].numel() if self._staging else 0) / 2**20,
            plan.digest[:12],
            plan.stats.summary(),
            self.transport.name,
            codecs.summary(),
            self.control.epoch,
            len(plan.readers),
        )
        _status.publish(self)
        _metrics.on_connect(self)
        return plan

    def _post_groups(self, plan: TransferPlan):
        """:attr:`pushed` in the groups both ends of each link post at once: each side says
        which of a link's buckets may join the previous one's group on its side
        (:func:`local_joins`), through the control plane, and both apply both answers."""
        assert self.transport is not None
        # a side with a codec posts its buckets itself, one at a time (Writer._send_coded,
        # Reader._receive_coded): it says so, so that its peers post singly too (an FP8
        # reader has no codec, and would otherwise group what its writer sends singly)
        coded = self.codec is not None
        mine = local_joins(self.pushed, lambda peer: not coded and self.transport.groups_with(peer))
        if not mine:
            return ()
        names = {peer: plan.participants[peer].name for peer in mine}
        self.control.post(
            "post-groups",
            {"links": {names[p]: rows.astype("<i8").tobytes() for p, rows in mine.items()}},
        )
        got = self.control.gather(
            "post-groups",
            names=sorted(names.values()),
            timeout=self.config.connect_timeout,
            schema=GROUPS,
        )
        theirs = {}
        for peer, name in names.items():
            blob = got[name]["links"].get(self.name)
            if blob is None:
                continue
            if len(blob) % 24:
                raise WeightbusError(
                    f"{self.name}: {name!r} posted post-groups of {len(blob)} bytes for this "
                    "link, not rows of three int64 (a bug: please report it)"
                )
            theirs[peer] = np.frombuffer(blob, dtype="<i8").reshape(-1, 3).astype(np.int64)
        return post_groups(self.pushed, mine, theirs)

    def _new_verifier(self) -> Verifier | None:
        """This epoch's verifier (``SyncConfig.verify``; None when off). Beside a pushing
        transport on a GPU its sums leave NCCL's kernels some SMs (:attr:`Verifier.sms`)."""
        if self.config.verify == "off":
            return None
        verifier = Verifier(self.config.verify)
        if self._device.type == "cuda" and not getattr(self.transport, "pulls", True):
            verifier.sms = amax_sms()
        return verifier

    def _on_build(self) -> None:
        """Subclasses: connect-time work of their own, run at the end of every
        :meth:`_build` (the first connect and each new membership epoch); collective work
        here must be done by every participant of the epoch."""

    def _make_plan(
        self,
        writers: list[Layout],
        readers: list[Layout],
        pack_mixed_links: Callable,
    ) -> TransferPlan:
        """The plan for this epoch's layouts. Readers are numbered by their place among the
        epoch's readers (ranks may have gaps once some left). A reader that joined in this
        epoch and whose layout cannot be planned is refused, and the others planned without
        it; the others' own disagreements raise as usual. ``pack_mixed_links(participants,
        links, mixed links)``: :func:`~weightbus.plan.make_plan`'s, with the plan's
        participants first."""
        options = self.config.plan_options()
        if not readers:
            raise MembershipError(
                f"{self.name}: no reader is left in membership epoch {self.control.epoch} of "
                f"job {self.control.config.job!r} (every reader left or died); syncs fail "
                "until one joins"
            )

        def plan_for(group: list[Layout]) -> TransferPlan:
            ranked = _numbered(group)
            check_codec_layouts(writers, ranked)
            people = [lay.participant for lay in (*writers, *ranked)]
            return make_plan(
                writers,
                ranked,
                options,
                pack_mixed_links=functools.partial(pack_mixed_links, people),
            )

        try:
            return plan_for(readers)
        except LayoutError:
            joined = [r for r in readers if r.name in self.control.joined]
            if not joined:
                raise
            base = [r for r in readers if r.name not in self.control.joined]
            bad: dict[str, Exception] = {}
            for r in joined:
                try:
                    plan_for(sorted([*base, r], key=lambda lay: lay.rank))
                except LayoutError as e:
                    bad[r.name] = e
            if not bad:
                raise
        self._refuse(bad)
        return plan_for([r for r in readers if r.name not in bad])

    def _agree(
        self, topic: str, digest: str, error: Callable[[PlanMismatch], BaseException]
    ) -> None:
        """Agree on ``digest`` with every participant; on a disagreement raise ``error(exc)``,
        unless only readers that joined in this epoch disagree with everyone else: those are
        refused and the others go on."""
        try:
            self.control.agree(topic, digest, timeout=self.config.connect_timeout)
        except PlanMismatch as exc:
            joined = set(self.control.joined)
            held = [d for d, names in exc.groups.items() if set(names) - joined]
            if not joined or len(held) != 1:
                raise error(exc) from None
            why = error(exc)
            refused = {n: why for d, names in exc.groups.items() if d != held[0] for n in names}
            self._refuse(refused)

    def _refuse(self, refused: Mapping[str, BaseException]) -> None:
        """Readers that joined in this epoch and do not fit the job: each of them raises its
        error (quietly: the others are fine), the others leave them out of this epoch."""
        if not refused:
            return
        if self.name in refused:
            self._refused = True
            err = refused[self.name]
            if err.args and isinstance(err.args[0], str):
                err.args = (
                    f"{self.name} cannot join the running job {self.control.config.job!r}: "
                    f"{err.args[0]}",
                    *err.args[1:],
                )
            raise err
        self.control.exclude(refused)
        for name, err in refused.items():
            logger.warning("%s: reader %r refused joining the job: %s", self.name, name, err)

    def _holds_ahead(self) -> bool:
        """FP8: whether this reader holds the buckets sent ahead of the writers' check in
        staging until their word (see :class:`~weightbus.Reader`)."""
        return True

    def _make_codec(self, plan: TransferPlan, codecs: CodecConfig):
        """This side's codec state for ``plan``, or None when this side needs none."""
        raise NotImplementedError

    def _agree_codecs(self, codecs: CodecConfig) -> None:
        """Every participant must put the same codecs on the wire: one that quantizes to FP8
        or sends deltas while another does not fails here, naming both sides."""

        def error(exc: PlanMismatch) -> PlanMismatch:
            parts = [
                f"{', '.join(names)} with {_codec_words(digest)}"
                for digest, names in sorted(exc.groups.items(), key=lambda kv: -len(kv[1]))
            ]
            same = len({d.split(":")[0] for d in exc.groups}) == 1
            return PlanMismatch(
                "participants disagree on the codecs on the wire: "
                + "; ".join(parts)
                + (" (the same codecs with other settings)" if same else "")
                + ". Pass equal SyncConfig.fp8 (Fp8Config, its ignore list included) and "
                "SyncConfig.delta (DeltaConfig.window_bytes included) to every writer and "
                "reader",
                exc.groups,
            )

        self._agree("codecs", codecs.digest(), error)

    def _wire_layout(self, codecs: CodecConfig) -> Layout:
        """The layout to declare: with FP8, a writer's quantized weights and scale grids (its
        live tensors stay as they are); a reader must have bound FP8 tensors already."""
        layout = self.bound.layout
        wire = wire_layout(layout, codecs)
        if self.role == "reader" and wire is not layout:
            assert codecs.fp8 is not None
            t = next(t for t in layout.tensors if codecs.fp8.quantizes(t))
            raise LayoutError(
                f"reader {self.name!r}: FP8 is on (SyncConfig.fp8), but this reader's layout "
                f"holds {t.name} as {t.dtype}: readers receive into FP8 engine parameters and "
                "their scales; bind weightbus.codecs.quantized_layout(layout, fp8) with "
                "float8_e4m3fn tensors and '<key>_scale_inv' float32 scale tensors, or list "
                "the tensor in Fp8Config.ignore on every participant"
            )
        return wire

    def _sync_failed(self, exc: BaseException, version: int) -> BaseException:
        """Report a failed sync; a timeout is restated against the whole sync's bound."""
        self._fail(exc)
        if isinstance(exc, SyncTimeout):
            return SyncTimeout(
                f"{self.name}: sync of version {version} did not finish within sync_timeout="
                f"{self.config.sync_timeout}: {exc}",
                exc.missing,
            )
        return exc

    def _finished(
        self, version: int, nbytes: int, seconds: float, phases: dict[str, float]
    ) -> SyncResult:
        """Record a completed sync: advance the sequence and version, log one INFO line."""
        self._seq += 1
        self.syncs += 1
        self.version = version
        result = SyncResult(
            participant=self.name, version=version, bytes=nbytes, seconds=seconds, phases=phases
        )
        logger.info("sync %s", result.line())
        _status.publish(self, result)
        _metrics.on_sync(self, result)
        return result

    def _fail(self, exc: BaseException) -> None:
        """Tell every other participant (unless the failure came from one of them), abort the
        transport so nothing stays in flight, and mark this epoch failed. With elastic
        membership the next sync forms a new epoch; without, further syncs are refused."""
        text = f"{type(exc).__name__}: {exc}"
        self._failed = self._failed or text.splitlines()[0]
        self._stale = True
        _metrics.on_failure(self)
        if not isinstance(exc, PeerFailure):
            try:
                self.control.fail(text)
            except Exception:  # the control plane itself may be what failed
                logger.debug("could not report failure of %s", self.name, exc_info=True)
        self.control.abort_epoch()
        _status.publish(self, error=text)
        if self.transport is not None:
            self.transport.abort(text)

    def _require_connected(self) -> None:
        if self._closed:
            raise WeightbusError(f"{self.name}: closed")
        if self._refused:
            raise WeightbusError(
                f"{self.name}: the running job refused it ({self._failed}) and it left; "
                f"connect a new {type(self).__name__} whose layout and configuration fit"
            )
        if self._failed and (self.plan is None or not self.control.config.elastic):
            raise WeightbusError(
                f"{self.name}: an earlier sync or connect failed ({self._failed}); build a new "
                f"{type(self).__name__} (every participant of the job has seen the failure)"
            )
        if self.plan is None:
            raise WeightbusError(f"{self.name}: call connect() before syncing")
        if not self._stale:  # a new epoch takes the tensors' pointers anew
            self._check_live_tensors()

    def _begin_sync(self, timeout: timedelta) -> float:
        """Elastic membership, first thing in every sync (writer) and wait (reader): follow
        writer rank 0 into a new epoch when the members changed or the last sync failed, and
        plan again for it. Returns the seconds spent planning again (0 when nothing changed):
        the sync's ``plan`` phase, not counted in its ``seconds``.

        ``timeout`` bounds a reader's wait for writer rank 0; :class:`SyncTimeout` from that
        wait means no sync began, and the reader may wait again.
        """
        if not self.control.config.elastic or (self._checked == self._seq and not self._stale):
            return 0.0
        try:
            moved = self._follow(timeout)
        except SyncTimeout as exc:
            if self.role == "reader":
                raise  # writer rank 0 began no sync: nothing is half done, wait again
            self._fail(exc)
            raise
        except BaseException as exc:
            self._fail(exc)
            raise
        seconds = 0.0
        if moved:
            t0 = time.perf_counter()
            try:
                self._build()
            except BaseException as exc:
                if self._refused:  # the others went on without it: it leaves quietly
                    self._failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    self._teardown()
                else:
                    self._fail(exc)
                raise
            seconds = time.perf_counter() - t0
        self._checked = self._seq
        return seconds

    def _follow(self, timeout: timedelta) -> bool:
        """Find out, for the sync about to begin, whether this participant moves to a new
        epoch, and if so get there (its roster entered, its old transport gone); True then."""
        control = self.control
        coordinator = self.role == "writer" and self.bound.layout.rank == 0
        if not self._stale and control.epoch_aborted():
            self._aborted_elsewhere()
        if not self._stale:
            if coordinator:
                change = control.membership_changed()
                if change and control.epoch_aborted():
                    self._aborted_elsewhere()
                control.post(f"members/{self._seq}", {"epoch": control.epoch + int(change)})
                if not change:
                    return False
            else:
                news = control.gather(
                    f"members/{self._seq}",
                    names=[control.coordinator],
                    timeout=timeout,
                    schema=MEMBERS,
                )
                if news[control.coordinator]["epoch"] == control.epoch:
                    return False
        self._stale = True
        self._drop_transport()
        after = control.epoch
        if coordinator:
            control.form_epoch(
                writers_timeout=self.config.connect_timeout,
                readers_timeout=control.config.rejoin_timeout,
            )
        else:
            control.request_entry(after)
            wait = timeout if self.role == "reader" else self.config.connect_timeout
            control.await_roster(after, timeout=wait)
        return True

    def _aborted_elsewhere(self) -> None:
        """A failure elsewhere ended this epoch while this participant was not syncing: it
        hears of it now (a failure reaches every participant) and comes back next time."""
        control = self.control
        control.raise_if_failed(fresh=True)
        raise PeerFailure(
            f"{self.name}: a sync or connect failed in membership epoch {control.epoch} while "
            "this participant was not syncing (a heartbeat or a transport said so); the next "
            f"{'sync' if self.role == 'writer' else 'wait'} goes on without whoever failed"
        )

    def _drop_transport(self) -> None:
        """Close this epoch's transport (abort it when the epoch failed)."""
        transport, self.transport = self.transport, None
        if transport is None:
            return
        try:
            if self._failed:
                transport.abort(self._failed)
            else:
                transport.close()
        except Exception:
            logger.debug(
                "%s: closing the transport of epoch %d",
                self.name,
                self.control.epoch,
                exc_info=True,
            )

    def _check_live_tensors(self) -> None:
        """In-place sends and receives hold views taken at connect: refuse to sync if the
        engine or trainer has since moved a tensor to new storage (``p.data = ...``)."""
        self._refuse_moved(self.bound.tensors, self._live_ptrs, "local tensor")

    def _refuse_moved(self, tensors: Mapping[str, torch.Tensor], ptrs: dict, what: str) -> None:
        """Fail the session if a tensor of ``tensors`` no longer starts at its ``ptrs`` address."""
        for key, ptr in ptrs.items():
            if tensors[key].data_ptr() != ptr:
                err = LayoutError(
                    f"{self.name}: {what} {key!r} moved to new storage after connect; "
                    "update tensors in place (copy_) or connect a new "
                    f"{type(self).__name__} after re-binding the model"
                )
                self._fail(err)
                raise err

    def _teardown(self) -> None:
        try:
            if self.transport is not None:
                self.transport.abort("connect failed")
        finally:
            try:
                self.control.close()
            except Exception:
                logger.debug("closing the control plane of %s", self.name, exc_info=True)

    def close(self) -> None:
        """Tear down the transport and leave the control plane. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.transport is not None:
                self.transport.close()
        finally:
            self.control.close()

    def __enter__(self):
        self.connect()  # tears down what it built if it fails
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Deadline:
    """One bound for a whole sync: each wait inside it gets what is left."""

    def __init__(self, limit: timedelta) -> None:
        self.end = time.monotonic() + limit.total_seconds()

    def left(self) -> timedelta:
        # never zero: a wait given nothing would fail before checking once
        return timedelta(seconds=max(self.end - time.monotonic(), 0.001))


def _codec_words(digest: str) -> str:
    """``"fp8+delta:1a2b..."`` -> ``"FP8 and deltas (fp8+delta:1a2b...)"``, for messages."""
    summary = digest.split(":")[0]
    fp8 = "FP8" if summary.startswith("fp8") else "no FP8"
    delta = "deltas" if summary.endswith("+delta") else "no deltas"
    return f"{fp8} and {delta} ({digest})"


AHEAD_SPARE = 2
"""FP8: staging buffers a reader has beyond the buckets sent to it ahead of the writers' check
for non-finite weights (``Fp8Config.ahead``), into which it receives the next buckets while
it holds those."""

GROUP_OPS = 16
GROUP_BYTES = 1 << 30
"""In-place sends and receives posted together (:meth:`Transport.send_many`): at most this
many, and bytes, per group. A group starts moving only once it is all posted, so groups stay
short enough for the first bytes to leave early. On 2 x H200, Llama-3-8B's tensors sent in
NCCL groups of 8 took 45.0 ms, of 32 44.9, all 291 in one group 48.0 (its posting first), a
send each 47.6."""

GROUPS: Schema = {"links": DictOf(str, bytes)}
"""``post-groups``, from each participant with pushed buckets: per peer, the link's buckets in
posting order with their bytes and whether each may join the previous one's group here."""


def local_joins(
    pushed: Sequence[tuple[BucketOp, torch.Tensor | None]],
    groups_with: Callable[[int], bool] = lambda peer: True,
) -> dict[int, np.ndarray]:
    """Per peer (global rank), its ops of ``pushed`` in order as rows ``(bucket, bytes, may
    join)``: an op may join the previous op of its link in one posted group where both are in
    place here and non-empty, and the transport can post groups to that peer
    (``groups_with``)."""
    rows: dict[int, list[tuple[int, int, int]]] = {}
    last: dict[int, tuple[BucketOp, torch.Tensor | None]] = {}  # peer -> its previous op
    for op, live in pushed:
        peer = op.peer_global
        prev = last.get(peer)
        join = (
            prev is not None
            and live is not None
            and prev[1] is not None
            and op.nbytes > 0
            and prev[0].nbytes > 0
            and groups_with(peer)
        )
        rows.setdefault(peer, []).append((op.bucket, op.nbytes, int(join)))
        last[peer] = (op, live)
    return {peer: np.array(r, dtype=np.int64).reshape(-1, 3) for peer, r in rows.items()}


def post_groups(
    pushed: Sequence[tuple[BucketOp, torch.Tensor | None]],
    mine: Mapping[int, np.ndarray],
    theirs: Mapping[int, np.ndarray],
) -> tuple[tuple[tuple[BucketOp, torch.Tensor | None], ...], ...]:
    """``pushed`` in posting groups, from this side's :func:`local_joins` (``mine``) and each
    peer's (``theirs``, per peer): an op joins the previous one of its link where both sides
    say it may, up to :data:`GROUP_OPS` ops and :data:`GROUP_BYTES` bytes. Both ends of a link
    compute the same groups, as NCCL requires (operations grouped differently on the two
    sides are undefined: a test of it hung). A group is posted where its first op was, ahead
    of ops to other peers posted between its members before (posting order only has to
    agree per peer, and its members wait for nothing: they are in place)."""
    join: dict[int, np.ndarray] = {}
    for peer, rows in mine.items():
        other = theirs.get(peer)
        if other is None:  # a peer that groups nothing
            join[peer] = np.zeros(len(rows), dtype=bool)
            continue
        if other.shape != rows.shape or not np.array_equal(other[:, :2], rows[:, :2]):
            raise WeightbusError(
                f"post groups: the link to participant {peer} lists buckets {rows[:8, 0].tolist()}"
                f"... here and {other[:8, 0].tolist()}... there: the two ends planned "
                "differently (a bug: please report it)"
            )
        join[peer] = (rows[:, 2] & other[:, 2]).astype(bool)
    groups: list[list[tuple[BucketOp, torch.Tensor | None]]] = []
    at: dict[int, int] = {}  # peer -> index of its next op in join[peer]
    open_: dict[int, tuple[list, int]] = {}  # peer -> (its open group, bytes in it)
    for op, live in pushed:
        peer = op.peer_global
        k = at.get(peer, 0)
        at[peer] = k + 1
        group = open_.get(peer)
        if (
            group is not None
            and join[peer][k]
            and len(group[0]) < GROUP_OPS
            and group[1] + op.nbytes <= GROUP_BYTES
        ):
            group[0].append((op, live))
            open_[peer] = (group[0], group[1] + op.nbytes)
            continue
        groups.append([(op, live)])
        open_[peer] = (groups[-1], op.nbytes)
    return tuple(tuple(g) for g in groups)


def _choose_transport(
    name: str | Mapping[str, str],
    plan: TransferPlan | Sequence[Participant],
    codecs: CodecConfig,
    job: str = "",
    links: Sequence[tuple[Participant, Participant]] | None = None,
) -> LinkChoice:
    """The job's transport, chosen per link (:func:`~weightbus.transports.links.choose_links`);
    with codecs, only transports whose writers send what they encoded.

    A pulling transport (CUDA IPC, local) has readers copy straight out of the writers'
    tensors, so no writer ever encodes: with codecs the automatic choice skips such
    transports, and one asked for (by name, per link class or in ``$WEIGHTBUS_TRANSPORT``) is
    refused rather than moving uncoded bytes. The choice depends only on the participants,
    the plan's links and the agreed codecs, so every process makes the same one; it is
    logged once per job. ``plan``: a plan, or the participants of one whose ``links`` are
    given (the planner's, before it makes buckets).
    """
    choice = choose_links(plan, links, transport=name, push_only=codecs.active)
    pulling = choice.pulling()
    if codecs.active and pulling:
        kind, pulls = next(iter(pulling.items()))
        why = transport_class("nccl").unsupported(choice.participants) or "it was not chosen"
        raise ValueError(
            f"codecs {codecs.summary()} need a transport whose writers encode and send each "
            f"bucket, but {pulls!r} pulls straight from the writers' tensors (no writer "
            f"encodes) on the {kind} links: use transport 'nccl' or 'gloo' (nccl here: {why}), "
            "or turn SyncConfig.fp8 / delta off for this job"
        )
    choice.log(job)
    return choice


def _staging_buffers(
    name: str, n: int, nbytes: int, device: torch.device, codecs: CodecConfig
) -> list[torch.Tensor]:
    """``n`` staging buffers of ``nbytes`` on ``device``; where they do not fit, an error that
    says how much was asked, what is free and what makes them smaller."""
    try:
        return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
    except torch.OutOfMemoryError as exc:
        free = ""
        if device.type == "cuda":
            free = f" ({torch.cuda.mem_get_info(device)[0] / 2**30:.2f} GiB free on {device})"
        knobs = (
            ", Fp8Config.bucket_bytes (0: SyncConfig.bucket_bytes; FP8 buckets are at least "
            f"{codecs.fp8.bucket_bytes >> 20} MiB) or Fp8Config.ahead"
            if codecs.fp8 is not None
            else ""
        )
        if codecs.delta is not None:  # (a window's group to one peer is staged whole)
            knobs += (
                f", or DeltaConfig.window_bytes ({codecs.delta.window_bytes / 2**20:.0f} MiB: "
                "a window's buckets to one peer are staged together)"
            )
        raise WeightbusError(
            f"{name}: {n} staging buffers of {nbytes / 2**20:.1f} MiB "
            f"({n * nbytes / 2**30:.2f} GiB) do not fit{free}: lower "
            f"SyncConfig.staging_buffers or bucket_bytes{knobs}, on every participant"
        ) from exc


def _numbered(readers: list[Layout]) -> list[Layout]:
    """``readers`` (sorted by rank) with ranks ``0..n-1`` as the planner takes them: once a
    reader left, the others keep their ranks but not their places."""
    out = []
    for i, lay in enumerate(readers):
        if lay.rank != i:
            who = dataclasses.replace(lay.participant, rank=i)
            lay = dataclasses.replace(lay, participant=who, _memo={})
        out.append(lay)
    return out


def _device_of(bound: BoundLayout) -> torch.device:
    devices = {t.device for t in bound.tensors.values()}
    if len(devices) > 1:
        raise ValueError(
            f"{bound.layout.name}: local tensors span several devices {sorted(map(str, devices))}"
        )
    return devices.pop() if devices else torch.device("cpu")
