"""Codecs in the sync path: the layouts both sides declare, and packing/unpacking through them.

Connect, on every participant:

1. ``codecs = CodecConfig(fp8=..., delta=...)``; agree on ``codecs.digest()`` (a mismatch,
   one side FP8 and the other not, fails here, naming who holds which);
2. declare ``wire_layout(bound.layout, codecs)`` in the layout exchange instead of the bound
   layout: FP8 weights and their ``*_scale_inv`` tensors are then canonical tensors like any
   other, planned and resharded by :func:`~weightbus.plan.make_plan`;
3. after planning, :func:`check_codec_layouts` (clear messages when layouts disagree on FP8),
   then build a :class:`WriterCodec` or :class:`ReaderCodec` from the plan.

Each sync, a writer calls ``readers_hold(...)`` with what every reader says it holds (deltas
only), ``begin(version)`` (the FP8 scales of this sync, the delta decision), ``pack(op, buf)``
per bucket (with deltas ``pack_group(op, buf)`` per group), ``end()`` once every bucket is
packed, and ``acknowledged(version, readers)`` after the acks (``abandon()`` when the sync
failed). A reader calls ``begin(version)``, ``unpack(op, buf)`` per bucket (with deltas
``take_group`` and ``unpack_group`` per group), and ``end(version)`` once committed.
:func:`run_sync` does all of it in one process: the reference the tests use;
:class:`~weightbus.Writer` and :class:`~weightbus.Reader` do it between processes.

On the wire (see :mod:`weightbus.codecs.delta`), a writer window's delta buckets to one
reader travel together as two messages at the first of them (:meth:`WriterCodec.group`,
:meth:`WriterCodec.pack_group`; :meth:`ReaderCodec.group_of`): their directories, of a size
fixed per group (tag ``op.bucket``), then the encoded buckets (tag :func:`rest_tag`), whose
size the reader reads from the directories (:meth:`ReaderCodec.take_group`, which keeps them
for :meth:`ReaderCodec.unpack_group`). FP8 buckets are one message of the plan's size, like
uncoded ones.

Everything about a bucket that does not change between syncs is found at connect: the live
regions of its routes, their scale cells, where each route's bytes go, and on CUDA the table
of a one-launch quantize kernel; a pack then only launches kernels. The live tensors must
stay in place (updated in place, as optimizers do); a writer whose tensors moved is noticed
at ``begin`` and re-derives them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightbus._green import amax_sms, partial_stream
from weightbus.codecs.delta import (
    GROUP_FORMAT,
    DeltaConfig,
    DeltaDecision,
    DeltaDecoder,
    DeltaEncoder,
    DeltaPolicy,
    Group,
    capacity,
    next_groups,
    window_index,
)
from weightbus.codecs.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    AmaxReduce,
    Fp8Config,
    QuantizePlan,
    WriterScales,
    quantized_layout,
)
from weightbus.errors import WeightbusError
from weightbus.plan.planner import PlanOptions, TransferPlan
from weightbus.plan.program import BucketCopier, BucketOp, build_program, direct_view
from weightbus.spec import Layout, LayoutError

logger = logging.getLogger(__name__)

__all__ = [
    "CodecConfig",
    "ReaderCodec",
    "WriterCodec",
    "check_codec_layouts",
    "checked_tag",
    "piece_tag",
    "rest_tag",
    "run_sync",
    "sent_ahead",
    "wire_layout",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecConfig:
    """The codecs on the wire; every participant of a job must use an equal one."""

    fp8: Fp8Config | None = None
    """FP8 block quantization of weights (None: weights travel in the readers' dtype)."""
    delta: DeltaConfig | None = None
    """Sparse deltas against the previous sync (None: every sync sends every byte)."""

    def key(self) -> str:
        """What both sides must agree on: FP8's options; of the delta options only the
        window (readers group the directories by it) and the groups' layout
        (:data:`~weightbus.codecs.delta.GROUP_FORMAT`), the others are the writers' alone."""
        parts = [
            self.fp8.key() if self.fp8 else "fp8=off",
            f"delta=on;groups={GROUP_FORMAT};window={self.delta.window_bytes}"
            if self.delta
            else "delta=off",
        ]
        return "|".join(parts)

    @property
    def active(self) -> bool:
        """Whether any codec is on (then writers encode every staged bucket)."""
        return self.fp8 is not None or self.delta is not None

    def summary(self) -> str:
        """``"fp8"``, ``"fp8+delta"``, ``"bf16+delta"`` or ``"bf16"`` (no codec: weights
        travel in the readers' dtype)."""
        return ("fp8" if self.fp8 else "bf16") + ("+delta" if self.delta else "")

    def digest(self) -> str:
        """A short digest of :meth:`key`, for the connect-time agreement."""
        return f"{self.summary()}:{hashlib.sha256(self.key().encode()).hexdigest()[:12]}"

    def plan_options(self, options: PlanOptions) -> PlanOptions:
        """``options`` as these codecs plan them. With a codec on, a route travels in a bucket
        of its own only from ``bucket_bytes`` up (``direct_bytes`` is raised to it): codecs
        encode into staging buffers and decode out of them, so no route lands in place, and a
        bucket per large route only adds staged rounds (FP8 on Llama-3-8B, 256 MiB buckets:
        67 instead of 241). With FP8 alone, where every bucket is one message, buckets are at
        least :attr:`Fp8Config.bucket_bytes <weightbus.codecs.Fp8Config.bucket_bytes>` and
        routes are cut to a quarter bucket, so that buckets hold 3/4 of ``bucket_bytes`` on
        average instead of half (Llama-3-8B, 256 MiB: 45 buckets instead of 67; 512 MiB: 23);
        with deltas a window's buckets travel together anyway."""
        if not self.active:
            return options
        fuller = self.fp8 is not None and self.delta is None
        bucket = options.bucket_bytes
        if fuller and self.fp8 is not None:
            bucket = max(bucket, self.fp8.bucket_bytes)
        direct = options.direct_bytes
        if direct > 0:
            direct = max(direct, bucket)
        return dataclasses.replace(
            options,
            bucket_bytes=bucket,
            direct_bytes=direct,
            route_bytes=bucket // 4 if fuller else options.route_bytes,
        )


def rest_tag(op: BucketOp, num_buckets: int) -> int:
    """The tag of a delta group's second message, the buckets, for the group that bucket
    ``op`` starts (its first, the directories, uses ``op.bucket``); ``num_buckets`` is the
    plan's bucket count."""
    return num_buckets + op.bucket


def piece_tag(plan: TransferPlan, group: Group, j: int) -> int:
    """The tag of piece ``j`` of a delta group sent as pieces (:attr:`Group.pieces`): after
    the plan's bucket and second-message tags and :func:`checked_tag`, the plan's global
    index of the piece's first route."""
    k, i = group.pieces[j].routes[0]
    return 2 * len(plan.buckets) + 1 + int(plan.buckets.first[group.ops[k].bucket]) + i


def sent_ahead(plan: TransferPlan, codecs: CodecConfig) -> frozenset[int]:
    """FP8 without deltas: the buckets that travel before the writers' check for non-finite
    weights (:attr:`~weightbus.codecs.Fp8Config.ahead`), the same on every participant: per
    reader, its first ``ahead`` buckets in execution order that hold neither FP8 weights nor
    scales (their bytes need no amax). Readers hold them in staging until their writer's
    :func:`checked_tag` word says its weights were finite; empty without FP8, or with
    deltas."""
    if codecs.fp8 is None or codecs.delta is not None or codecs.fp8.ahead == 0:
        return frozenset()
    coded = np.array(
        [t.dtype == FP8_DTYPE or t.name.endswith(SCALE_SUFFIX) for t in plan.tensors], bool
    )
    routes, buckets = plan.routes, plan.buckets
    needs_amax = np.zeros(len(buckets), dtype=bool)
    np.logical_or.at(needs_amax, routes.bucket, coded[routes.tensor])
    out: list[int] = []
    for r in range(len(plan.readers)):
        ids = plan.buckets_of("reader", r)
        out.extend(ids[~needs_amax[ids]][: codecs.fp8.ahead].tolist())
    return frozenset(out)


def checked_tag(num_buckets: int) -> int:
    """The tag of the word a writer sends each reader it sent buckets ahead to (see
    :func:`sent_ahead`): the version if its weights were finite, else -1; ``num_buckets`` is
    the plan's bucket count (buckets use tags below twice that)."""
    return 2 * num_buckets


def wire_layout(layout: Layout, codecs: CodecConfig) -> Layout:
    """The layout to declare at connect: with FP8, the quantized tensors and their scales."""
    if codecs.fp8 is None:
        return layout
    return quantized_layout(layout, codecs.fp8)


def check_codec_layouts(writers: Sequence[Layout], readers: Sequence[Layout]) -> None:
    """Explain an FP8 disagreement between the two sides before the planner's generic error."""
    wdtype = {t.name: t.dtype for lay in writers for t in lay.tensors}
    for lay in readers:
        for t in lay.tensors:
            w = wdtype.get(t.name)
            if w is not None and w != t.dtype and FP8_DTYPE in (w, t.dtype):
                side, other = ("writers", "reader") if w == FP8_DTYPE else ("reader", "writers")
                raise LayoutError(
                    f"{t.name}: writers send {w}, reader {lay.name!r} expects {t.dtype}: the "
                    f"{side} quantize to FP8 and the {other} do not; pass the same "
                    "Fp8Config (including its ignore list) on both sides"
                )
            if t.name.endswith(SCALE_SUFFIX) and w is None:
                raise LayoutError(
                    f"reader {lay.name!r} expects FP8 scales {t.name}, but writers do not "
                    "quantize: enable FP8 on the writers too, with the same Fp8Config"
                )


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors.values()}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def _origins(plan: TransferPlan, op: BucketOp) -> tuple[tuple[int, int], ...]:
    """Canonical (row, col) of each route's first element, in the op's copy order."""
    first = int(plan.buckets.first[op.bucket])
    starts = plan.routes.start[first : first + len(op.copies)]
    return tuple((int(s[-2]), int(s[-1])) if len(s) >= 2 else (0, int(s[-1])) for s in starts)


class _Packer:
    """How one bucket's dense wire bytes are made from the live tensors, fixed at connect."""

    __slots__ = ("copied", "copies", "quantize", "views")

    def __init__(
        self, copies: list, copied: BucketOp, quantize: QuantizePlan | None, views: tuple | None
    ) -> None:
        self.copies = copies
        """Routes copied as they are (or cast): (live region, offset, bytes, dtype, shape)."""
        self.copied = copied
        """The same routes as a bucket op, for a :class:`BucketCopier` (one launch on CUDA)."""
        self.quantize = quantize
        """The bucket's FP8 routes, or None."""
        self.views = views
        """Every route's live region when none needs computing (no FP8, no cast), else None."""

    def fill(
        self,
        out: torch.Tensor,
        copier: BucketCopier | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Write the bucket's wire bytes into ``out`` (uint8), each route at its offset. With a
        ``copier`` (and the ``tensors`` the routes are keyed in), the copied routes take one
        launch instead of a copy each: only for buffers that stay the same (staging), as the
        copier compiles per buffer."""
        if copier is not None and tensors is not None:
            if self.copied.copies:
                copier.pack(self.copied, tensors, out)
        else:
            for src, offset, nbytes, dtype, shape in self.copies:
                out[offset : offset + nbytes].view(dtype).view(shape).copy_(src)
        if self.quantize is not None:
            self.quantize.run(out)


class WriterCodec:
    """One writer's codecs: FP8 scales and quantizing pack, delta shadow and encoder."""

    def __init__(
        self,
        plan: TransferPlan,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        codecs: CodecConfig,
        *,
        amax_reduce: AmaxReduce | None = None,
    ) -> None:
        self.plan, self.index, self.codecs = plan, index, codecs
        self.name = plan.writers[index].name
        self.ops = build_program(plan, "writer", index)
        self.live = dict(tensors)
        self.amax_reduce = amax_reduce
        self.device = device = _device_of(self.live)
        self.scales: WriterScales | None = None
        self._fp8: frozenset[str] = frozenset()
        scale_tensors: dict[str, torch.Tensor] = {}
        if codecs.fp8 is not None:
            self.scales = WriterScales(plan.writers, index, codecs.fp8, device=device)
            if self.scales.exchange_size and amax_reduce is None:
                raise ValueError(
                    f"writer {self.name!r}: writer shards cut FP8 blocks "
                    f"({self.scales.cut_example()}), so writers must agree on those blocks' "
                    "amax every sync: pass amax_reduce (weightbus.codecs.fp8.all_reduce_max("
                    f"group) over the trainer ranks), or shard at multiples of {codecs.fp8.block}"
                )
            self._fp8 = frozenset(self.scales.quantized)
            scale_tensors = self.scales.tensors
        clash = scale_tensors.keys() & self.live.keys()
        if clash:
            raise LayoutError(
                f"writer {self.name!r}: local tensors {sorted(clash)} collide with FP8 scale grids"
            )
        self.tensors = {**self.live, **scale_tensors}
        """Local tensors by key: the live ones and the FP8 scale grids (what copies read)."""
        self._origins = {op.bucket: _origins(plan, op) for op in self.ops} if self._fp8 else {}
        self._packers: dict[int, _Packer] = {}
        self._where: list[int] = []
        self._prepare()
        self.encoder: DeltaEncoder | None = None
        self.policy: DeltaPolicy | None = None
        if codecs.delta is not None:
            self.encoder = DeltaEncoder(
                self.ops,
                codecs.delta,
                fill=lambda op, out: self._packers[op.bucket].fill(out),
                views=lambda op: self._packers[op.bucket].views,
                device=device,
                name=self.name,
            )
            self.policy = DeltaPolicy(codecs.delta, len(plan.readers))
        self._decision: DeltaDecision | None = None
        self._version: int | None = None
        self._amax_stream: torch.cuda.Stream | None = None

    def _prepare(self) -> None:
        """Find every bucket's regions, scale cells and offsets (see the module docstring)."""
        self._where = [t.data_ptr() for t in self.live.values()]
        if self.scales is not None:
            self.scales.bind(self.live)
        # a bucket's copied routes (bf16 ones of an FP8 job: norms, embeddings; the scales)
        # take one copy launch per pack; found again with the regions
        self._copier = BucketCopier()
        for op in self.ops:
            copies, copied, quant, views = [], [], [], []
            for i, c in enumerate(op.copies):
                region = self.tensors[c.key][c.index]
                if c.tensor in self._fp8:
                    quant.append((c.tensor, region, self._origins[op.bucket][i], c.offset))
                else:
                    copies.append((region, c.offset, c.nbytes, c.dtype, c.shape))
                    copied.append(c)
                    views.append(region if region.dtype == c.dtype else None)
            plan = self.scales.plan(quant) if quant and self.scales is not None else None
            whole = not quant and all(v is not None for v in views)
            self._packers[op.bucket] = _Packer(
                copies,
                dataclasses.replace(op, copies=tuple(copied)),
                plan,
                tuple(views) if whole else None,
            )

    def _check_in_place(self) -> None:
        """Re-derive the buckets if a live tensor moved since connect (its storage replaced)."""
        if [t.data_ptr() for t in self.live.values()] != self._where:
            logger.warning(
                "writer %r: live tensors moved since connect (storage replaced, not updated "
                "in place); finding their regions again",
                self.name,
            )
            self._prepare()

    # -- connect-time facts ------------------------------------------------------------------

    def capacity(self, op: BucketOp) -> int:
        """Staging bytes bucket ``op`` needs."""
        return capacity(op) if self.encoder else op.nbytes

    def group(self, op: BucketOp) -> Group | None:
        """Deltas: when bucket ``op`` is the first of its window's buckets to its reader,
        their :class:`~weightbus.codecs.delta.Group` (they travel together:
        :meth:`pack_group`); else None."""
        return self.encoder.group(op) if self.encoder is not None else None

    def pack_group(
        self, op: BucketOp, buf: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """Deltas: encode the group bucket ``op`` starts into ``buf``; return its directories
        (host bytes, the first message) and the messages after them, each (-1, or its
        piece's index; its bytes): the group's second message, bytes of ``buf`` or of the
        shadow for a group of plain buckets (:meth:`send_buffers`), or the group's pieces
        (:meth:`~weightbus.codecs.delta.DeltaEncoder.encode_group`)."""
        if self._version is None or self.encoder is None:
            raise RuntimeError(
                f"writer {self.name!r}: begin(version) with deltas before pack_group"
            )
        return self.encoder.encode_group(op, buf)

    def unstaged(self, op: BucketOp) -> bool:
        """Deltas: whether the group bucket ``op`` starts travels in this sync without a
        staging buffer (:meth:`~weightbus.codecs.delta.DeltaEncoder.unstaged`): then
        :meth:`pack_group` takes None for its buffer."""
        return self.encoder is not None and self.encoder.unstaged(op)

    def sent_live(self, op: BucketOp) -> bool:
        """Deltas: whether bucket ``op`` went out in this sync from the live tensors (as part
        of a group's pieces), so that its wire values are theirs, not yet the shadow's."""
        return self.encoder is not None and self.encoder.sent_live(op)

    def queued(self, op: BucketOp) -> None:
        """Deltas: the group bucket ``op`` starts was handed to the transport (its next
        pass's compare may start: :meth:`~weightbus.codecs.delta.DeltaEncoder.queued`)."""
        if self.encoder is not None:
            self.encoder.queued(op)

    def send_from_stores(self, ok: bool) -> None:
        """Deltas: whether a group's frames may leave from where the encoder computed them
        (``ok``: the transport sends from any memory of its device,
        :meth:`~weightbus.transports.base.Transport.sends_anywhere`), not copied into the
        staging buffer first (:attr:`~weightbus.codecs.delta.DeltaEncoder.sends_stores`)."""
        if self.encoder is not None:
            self.encoder.sends_stores = ok

    def send_buffers(self) -> list[torch.Tensor]:
        """What sends may read besides the staging buffers and live tensors (for transports
        that register memory): with deltas, a shadow on the writer's device, and the rooms
        of groups sent as pieces without a staging buffer."""
        if self.encoder is None:
            return []
        area = [self.encoder.pieces_area] if self.encoder.pieces_area.numel() else []
        return ([self.encoder.shadow] if self.encoder.sends_shadow else []) + area

    def group_capacities(self) -> list[int] | None:
        """Deltas: the staging bytes each group needs; None without deltas."""
        if self.encoder is None:
            return None
        return [g.capacity for _, g in self.group_starts()]

    def group_starts(self) -> list[tuple[BucketOp, Group]]:
        """Deltas: each group's first bucket and the group, in program order."""
        if self.encoder is None:
            return []
        return [(op, g) for op in self.ops if (g := self.encoder.group(op)) is not None]

    def ahead(self, op: BucketOp) -> tuple[BucketOp, torch.Tensor] | None:
        """Deltas, after :meth:`pack_group`: when the directories of the group ``op`` starts
        say so, the next group to that reader (its first bucket) and its directories, which
        go on the wire before this group's buckets; else None."""
        return self.encoder.ahead(op) if self.encoder is not None else None

    def direct(self, op: BucketOp) -> torch.Tensor | None:
        """The live bytes of a bucket that may be sent in place (one contiguous route in the
        wire dtype, no delta), else None: quantized routes and deltas are always staged."""
        if self.encoder is not None or any(c.tensor in self._fp8 for c in op.copies):
            return None
        return direct_view(op, self.tensors)

    # -- each sync ---------------------------------------------------------------------------

    def readers_hold(self, held: Sequence[int | None], *, checksum: bool = False) -> None:
        """Deltas: the version each reader (by index) says its tensors hold as this sync
        begins (None: nothing usable); a reader holding anything but what this writer last
        sent it gets every byte. ``checksum``: a reader asked for a checksum pass."""
        if self.policy is None:
            return
        self.policy.holding(held)
        if checksum:
            self.policy.request_checksum()

    def request_dense(self, readers: Iterable[int] | None = None) -> None:
        """Deltas: send the next sync dense to ``readers`` (indices; default all)."""
        if self.policy is not None:
            self.policy.request_dense(readers)

    def request_checksum(self) -> None:
        """Deltas: every bucket of the next sync carries a checksum the readers verify."""
        if self.policy is not None:
            self.policy.request_checksum()

    def announce(self) -> bool:
        """Deltas: whether the sync about to begin sends every group as pieces, each group's
        directories after its pieces
        (:meth:`~weightbus.codecs.delta.DeltaEncoder.announce`): the writer says so in its
        begin message, and passes it to :meth:`begin`."""
        return self.encoder is not None and self.encoder.announce()

    def announced_pieces(self, op: BucketOp) -> list[tuple[int, torch.Tensor]]:
        """Deltas, in a sync announced as pieces (:meth:`announce` said so; before
        :meth:`begin` too): the pieces of the group bucket ``op`` starts, before its window is
        analyzed (:meth:`~weightbus.codecs.delta.DeltaEncoder.announced_pieces`);
        :meth:`pack_group` then gives its directories alone."""
        if self.encoder is None:
            raise RuntimeError(f"writer {self.name!r}: announced_pieces is for deltas")
        return self.encoder.announced_pieces(op)

    def begin(
        self,
        version: int,
        *,
        scales_ready: bool = False,
        scales_later: bool = False,
        announced: bool = False,
    ) -> None:
        """Start the sync of ``version``: FP8 scales (amax pass and the writers' all-reduce,
        unless ``scales_ready``, or ``scales_later``: then between :meth:`start_scales` and
        :meth:`finish_scales`, and only buckets without FP8 content may be packed before) and
        the delta decision (``announced``: what :meth:`announce` said, and the readers were
        told)."""
        self._version = int(version)
        self._check_in_place()
        if self.scales is not None and not scales_ready and not scales_later:
            self.scales.update(self.live, self.amax_reduce, defer_check=True)
        if self.policy is not None:
            assert self.encoder is not None
            self._decision = self.policy.begin(self._version)
            self.encoder.begin(self._decision, announced=announced)

    def start_scales(self) -> bool:
        """FP8, after ``begin(..., scales_later=True)``: queue the amax pass where it can run
        beside the sends queued next on the current stream (on CUDA, on part of the GPU's SMs,
        :data:`~weightbus._green.AMAX_SMS`: a grid that fills the GPU holds back a kernel
        queued after it on another stream until its own last blocks have started);
        :meth:`finish_scales` then makes the current stream wait for it. Returns False where
        the pass cannot run beside sends (writers that exchange amaxes wait for theirs):
        :meth:`finish_scales` then does all of it."""
        assert self.scales is not None
        self._amax_stream = None
        if self.scales.exchange_size:
            return False
        stream = partial_stream(self.device, amax_sms())
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.scales.partial(self.live, defer_check=True)
            self._amax_stream = stream
        else:
            self.scales.partial(self.live, defer_check=True)
        return True

    def finish_scales(self, started: bool) -> torch.Tensor:
        """FP8: the scales of this sync, after :meth:`start_scales` (which returned
        ``started``); the check for non-finite weights waits for :meth:`check`. Returns the
        device flag that every weight is finite, in stream order."""
        assert self.scales is not None
        if not started:
            self.scales.update(self.live, self.amax_reduce, defer_check=True)
            return self.scales.finite
        if self._amax_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._amax_stream)
            # made on the pass's stream, read on this one: not reused before this one did
            self.scales.finite.record_stream(current)
            self._amax_stream = None
        self.scales.finish(None)
        return self.scales.finite

    def check(self) -> None:
        """FP8: raise for non-finite weights (see ``WriterScales.update``); call before the
        first byte of the sync leaves (packs may be queued before it). Later calls of the
        same sync return at once."""
        if self.scales is not None:
            self.scales.check()

    @torch.no_grad()
    def pack(self, op: BucketOp, buf: torch.Tensor) -> int:
        """Fill ``buf`` (uint8, :meth:`capacity` bytes) with bucket ``op``; return the bytes
        to send from its start."""
        if self._version is None:
            raise RuntimeError(f"writer {self.name!r}: begin(version) before pack")
        if self.encoder is None:
            self._packers[op.bucket].fill(buf, self._copier, self.tensors)
            return op.nbytes
        return self.encoder.encode(op, buf)

    def prepare(self, op: BucketOp) -> None:
        """Deltas: analyze the window of bucket ``op`` ahead of :meth:`pack` (a no-op after
        its first bucket), so the device works while the caller waits for a buffer."""
        if self.encoder is not None and self._version is not None:
            self.encoder.prepare(op)

    def end(self) -> None:
        """Every bucket of this sync is packed."""
        if self.policy is not None and self._decision is not None:
            self.policy.sent(self._decision)
        if self.encoder is not None:
            self.encoder.end()
        self._decision = None

    def acknowledged(self, version: int, readers: Iterable[int]) -> None:
        """``readers`` (indices) confirmed ``version``."""
        if self.policy is not None:
            self.policy.acknowledged(version, readers)

    def abandon(self) -> None:
        """The sync failed: the next one is dense for every reader."""
        if self.policy is not None:
            self.policy.abandon()
        if self.encoder is not None:
            self.encoder.end()
        self._decision = None


class ReaderCodec:
    """One reader's codecs: FP8 needs nothing here (its bytes land in FP8 engine tensors);
    deltas are applied in place."""

    def __init__(
        self,
        plan: TransferPlan,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        codecs: CodecConfig,
    ) -> None:
        self.name = plan.readers[index].name
        self.ops = build_program(plan, "reader", index)
        self.tensors = dict(tensors)
        self.device = _device_of(self.tensors)
        self.decoder = (
            DeltaDecoder(self.ops, self.tensors, self.name) if codecs.delta is not None else None
        )
        self._group: dict[int, Group] = {}
        self._next: dict[int, int] = {}
        if codecs.delta is not None:
            self._group = _directory_groups(plan, self.ops, codecs.delta.window_bytes)
            self._next = next_groups({b: g.ops for b, g in self._group.items()})
            assert self.decoder is not None
            self.decoder.expect(g.ops for g in self._group.values())  # at connect
        self.version: int | None = None
        """The version the live tensors hold."""
        self._syncing: int | None = None
        self._copier = BucketCopier()  # dense buckets: one launch each on CUDA

    def capacity(self, op: BucketOp) -> int:
        """Staging bytes bucket ``op`` needs."""
        return capacity(op) if self.decoder else op.nbytes

    def direct(self, op: BucketOp) -> torch.Tensor | None:
        """The live bytes a bucket may land in, in place (one contiguous route in the wire
        dtype, no delta), else None: delta buckets are always staged and decoded."""
        if self.decoder is not None:
            return None
        return direct_view(op, self.tensors)

    def group_of(self, op: BucketOp) -> Group | None:
        """Deltas: when ``op`` is the first of its writer's window's buckets to this reader,
        their :class:`~weightbus.codecs.delta.Group` (their directories arrive as one message,
        then the buckets as another); else None."""
        return self._group.get(op.bucket)

    def take_group(
        self, group: Group, raw: bytes, buf: torch.Tensor
    ) -> tuple[list[tuple[BucketOp, int]], int]:
        """Deltas: a group's directories (``raw``, the group's first message) for the group
        that lands in its staging buffer ``buf`` (or its :meth:`room`): each bucket and where
        its frames start
        there, and the bytes of the group's second message. Raises when the sizes do not add
        up."""
        assert self.decoder is not None, "take_group is for delta buckets"
        return self.decoder.take_group(group.ops, raw, buf[: group.capacity])

    def room(self, group: Group, raw: bytes) -> torch.Tensor | None:
        """Deltas: where a group's staged pieces land when its directories (``raw``) say it
        travels as pieces and it has a room of its own: then it takes no staging buffer
        (:meth:`~weightbus.codecs.delta.DeltaDecoder.room`); else None."""
        assert self.decoder is not None, "room is for delta buckets"
        return self.decoder.room(group.ops, raw)

    def announced_room(self, group: Group) -> torch.Tensor | None:
        """Deltas: the room of a group its writer announced as pieces (every group of that
        writer travels as pieces this sync), before its directories arrive; None where it
        has none (then its directories are read first, as without an announcement)."""
        assert self.decoder is not None, "announced_room is for delta buckets"
        return self.decoder.announced_room(group.ops)

    def announced_pieces(
        self, group: Group, buf: torch.Tensor, *, in_room: bool
    ) -> list[torch.Tensor]:
        """Deltas: where each piece of an announced group lands (the live tensors, or
        ``buf``: its room, :meth:`announced_room`, or a staging buffer), from the plan
        alone."""
        assert self.decoder is not None, "announced_pieces is for delta buckets"
        return self.decoder.announced_pieces(group.ops, buf, in_room=in_room)

    def check_announced(self, group: Group, *, in_room: bool) -> None:
        """Deltas, after :meth:`take_group` of an announced group: raise unless its
        directories say what the announcement did (pieces, no directories ahead; in its
        room where ``in_room``)."""
        assert self.decoder is not None, "check_announced is for delta buckets"
        self.decoder.check_announced(group.ops, in_room=in_room)

    def room_buffers(self) -> list[torch.Tensor]:
        """Deltas: what receives may write besides the staging buffers and live tensors (for
        transports that register memory): the rooms of groups sent as pieces."""
        if self.decoder is None or not self.decoder.pieces_area.numel():
            return []
        return [self.decoder.pieces_area]

    def pieces(self, group: Group, buf: torch.Tensor) -> list[torch.Tensor] | None:
        """Deltas, after :meth:`take_group`: when the group travels as pieces, where each of
        :attr:`Group.pieces <weightbus.codecs.delta.Group.pieces>` lands (the live tensors, or
        ``buf``); None when it travels as one message."""
        assert self.decoder is not None, "pieces is for delta buckets"
        return self.decoder.pieces(group.ops, buf[: group.capacity])

    @torch.no_grad()
    def unpack_group(self, parts: Sequence[tuple[BucketOp, int]], buf: torch.Tensor) -> None:
        """Deltas: apply a received group, each bucket ``(op, offset)`` in ``buf``."""
        if self._syncing is None or self.decoder is None:
            raise RuntimeError(f"reader {self.name!r}: begin(version) with deltas before unpack")
        self.decoder.decode_group(parts, buf, version=self._syncing, held=self.version)

    def group_capacities(self) -> list[int] | None:
        """Deltas: the staging bytes each group needs; None without deltas."""
        if self.decoder is None:
            return None
        return [g.capacity for g in self._group.values()]

    def group_starts(self) -> list[tuple[BucketOp, Group]]:
        """Deltas: each group's first bucket and the group, in program order."""
        return [(g.ops[0], g) for g in self._group.values()]

    def next_group(self, op: BucketOp) -> BucketOp | None:
        """Deltas: the first bucket of the next group from the writer of the group ``op``
        starts, or None for its last."""
        nxt = self._next.get(op.bucket)
        return None if nxt is None else self._group[nxt].ops[0]

    def ahead(self, op: BucketOp) -> BucketOp | None:
        """Deltas, after :meth:`take_group`: when the directories of the group ``op`` starts
        say that the next group's directories come before this group's buckets, the first
        bucket of that next group (else None). Raises when they say so of a writer's last
        group to this reader."""
        assert self.decoder is not None, "ahead is for delta buckets"
        if not self.decoder.ahead(op):
            return None
        nxt = self.next_group(op)
        if nxt is None:
            raise WeightbusError(
                f"reader {self.name!r}: the directories of bucket {op.bucket} from writer "
                f"{op.peer} announce the next group's before its buckets, but it is that "
                "writer's last group to this reader: the two sides disagree on the plan or run "
                "different weightbus versions"
            )
        return nxt

    def encoded_size(self, op: BucketOp, buf: torch.Tensor) -> int:
        """Deltas: the bytes of bucket ``op`` at the start of ``buf``, read from its directory
        (the first :func:`~weightbus.codecs.delta.directory_bytes`, all that must have
        arrived); the directory is kept for :meth:`unpack`, so a bucket costs one
        device-to-host copy."""
        assert self.decoder is not None, "encoded_size is for delta buckets"
        return self.decoder.encoded_size(op, buf)

    def begin(self, version: int) -> None:
        self._syncing = int(version)
        if self.decoder is not None:
            self.decoder.begin()

    @torch.no_grad()
    def unpack(self, op: BucketOp, buf: torch.Tensor) -> None:
        """Apply the received bucket at the start of ``buf`` to the live tensors."""
        if self.decoder is None:
            self._copier.unpack(op, self.tensors, buf[: op.nbytes])
            return
        if self._syncing is None:
            raise RuntimeError(f"reader {self.name!r}: begin(version) before unpack")
        self.decoder.decode(op, buf, version=self._syncing, held=self.version)

    def check(self) -> None:
        """Deltas: raise if frames of this sync were refused while applied on the device
        (indices outside their routes), once the launches queued on the current stream ran:
        call it before acknowledging the sync."""
        if self.decoder is not None:
            self.decoder.check()

    def end(self, version: int) -> None:
        """The sync of ``version`` is committed: the live tensors hold it."""
        self.version = int(version)
        self._syncing = None


def _directory_groups(
    plan: TransferPlan, ops: Sequence[BucketOp], window_bytes: int
) -> dict[int, Group]:
    """A reader's buckets grouped as their writers send them: per writer window
    (:func:`~weightbus.codecs.delta.window_index` over the writer's program in the plan),
    keyed by the group's first bucket."""
    window: dict[int, int] = {}
    for w in sorted({op.peer for op in ops}):
        ids = plan.buckets_of("writer", w)
        index = window_index(plan.buckets.nbytes[ids], window_bytes)
        window.update(zip(ids.tolist(), index, strict=True))
    groups: dict[tuple[int, int], list[BucketOp]] = {}
    for op in ops:
        groups.setdefault((op.peer, window[op.bucket]), []).append(op)
    return {g[0].bucket: Group.of(g) for g in groups.values()}


def _random_bytes(n: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)


def run_sync(
    plan: TransferPlan,
    writers: Sequence[WriterCodec],
    readers: Sequence[ReaderCodec],
    version: int,
    *,
    absent: Iterable[int] = (),
) -> int:
    """One sync in this process (the reference for tests): the FP8 amax all-reduce between
    the writers, every bucket packed, only its encoded bytes carried into a buffer of random
    bytes (with deltas, a window's buckets to a reader as one group, its directories read
    apart), unpacked. Readers in ``absent`` miss this sync. Returns the bytes that
    travelled."""
    absent = set(absent)
    if writers and writers[0].scales is not None:
        partials = [w.scales.partial(w.live) for w in writers if w.scales is not None]
        shared = [p for p in partials if p is not None]  # every writer's, or none (no block cut)
        merged = torch.stack(shared).amax(dim=0) if shared else None
        for w in writers:
            assert w.scales is not None
            w.scales.finish(merged)
    for w in writers:
        w.begin(version, scales_ready=True)
    for r in readers:
        r.begin(version)
    w_ops = {op.bucket: (w, op) for w in writers for op in w.ops}
    r_ops = {op.bucket: (i, r, op) for i, r in enumerate(readers) for op in r.ops}
    ahead: dict[int, bytes] = {}  # directories sent before the previous group's buckets
    moved = 0
    for b in range(len(plan.buckets)):
        w, wop = w_ops[b]
        ri, r, rop = r_ops[b]
        if w.encoder is None or r.decoder is None:
            # one message per bucket (codecs that differ are refused at connect; here the
            # decoder must notice)
            sent = _random_bytes(w.capacity(wop), w.device)
            used = w.pack(wop, sent)
            if ri in absent:
                continue
            got = _random_bytes(r.capacity(rop), r.device)
            got[:used] = sent[:used].to(r.device)
            if r.decoder is not None and r.encoded_size(rop, got) != used:
                raise AssertionError(f"bucket {b}: the directory disagrees with {used} bytes")
            r.unpack(rop, got)
            moved += used
            continue
        # deltas, as between processes: the first bucket of a window's group to a reader
        # brings the group, its directories first
        group, members = w.group(wop), r.group_of(rop)
        if (group is None) != (members is None) or (
            group is not None
            and members is not None
            and [g.bucket for g in group.ops] != [m.bucket for m in members.ops]
        ):
            raise AssertionError(f"bucket {b}: writer and reader group the buckets differently")
        if group is None or members is None:
            continue
        directories, messages = w.pack_group(wop, _random_bytes(group.capacity, w.device))
        raw = directories.numpy().tobytes()
        if b in ahead and ahead.pop(b) != raw:
            raise AssertionError(f"bucket {b}: the directories sent ahead differ")
        nxt = w.ahead(wop)
        if nxt is not None:
            ahead[nxt[0].bucket] = nxt[1].numpy().tobytes()
        w.queued(wop)  # (as a Writer does once the group's sends are posted)
        if ri in absent:
            continue
        # a group sent as pieces lands its staged ones in its room, if it has one (random
        # bytes there too: a missed one fails)
        room = r.room(members, raw)
        if room is None:
            got = _random_bytes(members.capacity, r.device)
        else:
            got = room.copy_(_random_bytes(room.numel(), r.device))
        taken, n = r.take_group(members, raw, got)
        expects = r.ahead(rop)
        if (expects is None) != (nxt is None) or (
            expects is not None and nxt is not None and expects.bucket != nxt[0].bucket
        ):
            raise AssertionError(
                f"bucket {b}: the reader expects the directories of bucket "
                f"{expects.bucket if expects else None} ahead, the writer sends those of "
                f"{nxt[0].bucket if nxt else None}"
            )
        landing = r.pieces(members, got)
        if landing is None:
            sent = messages[0][1] if messages else got[:0]
            if [j for j, _ in messages] not in ([], [-1]) or n != sent.numel():
                raise AssertionError(
                    f"bucket {b}: the directories say {n} bytes in one message, the writer "
                    f"sent {[(j, m.numel()) for j, m in messages]}"
                )
            got[:n] = sent.to(r.device)
            moved += n
        else:
            if [j for j, _ in messages] != list(range(len(landing))) or any(
                m.numel() != t.numel() for (_, m), t in zip(messages, landing, strict=True)
            ):
                raise AssertionError(
                    f"bucket {b}: the reader expects pieces of {[t.numel() for t in landing]} "
                    f"bytes, the writer sent {[(j, m.numel()) for j, m in messages]}"
                )
            for (_, m), t in zip(messages, landing, strict=True):
                t.copy_(m.to(r.device))
                moved += m.numel()
        r.unpack_group(taken, got)
        moved += len(raw)
    for w in writers:
        w.end()
    present = [i for i in range(len(readers)) if i not in absent]
    for i in present:
        readers[i].check()
    for i in present:
        readers[i].end(version)
    for w in writers:
        w.acknowledged(version, present)
    return moved
