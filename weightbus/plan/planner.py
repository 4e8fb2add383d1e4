"""The planner: every writer layout + every reader layout -> who sends which box to whom.

A pure, deterministic function. The same layouts give the same plan, and the same digest, on
every process and under any ``PYTHONHASHSEED``. It works on the layouts' piece columns with
numpy, so a DeepSeek-V3-sized model over hundreds of participants plans in about a second.

How a plan is made:

1. Agree on the canonical tensors: every participant that names a tensor must give the same
   shape; writers must agree on its dtype, and readers on theirs; when the two sides' dtypes
   differ a cast must be asked for (``PlanOptions.cast``). Pieces must lie inside their tensor
   and their local tensor. A reader's pieces must not overlap, in the canonical tensor or in
   its local tensors.
2. Source regions: the distinct writer boxes of each tensor. Writers that hold the same box
   (data-parallel replicas, replicated norms) are that region's *holders*. Where distinct
   writer boxes overlap each other (mixed shardings of one tensor), the tensor is cut into
   disjoint cells first, and a cell's holders are the writers whose box contains it.
3. Each distinct reader box is joined with the source regions it overlaps (a sweep, not all
   pairs) and must be covered completely; every reader holding that box gets one route per
   overlapping region, so each reader receives exactly its own region, once.
4. Routes larger than half a bucket (or ``route_bytes``) are cut along their outermost dim of
   extent > 1.
5. Load balancing, the rule: routes whose region has the same holder set are laid out in a
   fixed order (reader, tensor, box) and cut into as many contiguous runs of equal bytes as
   there are holders; run ``j`` goes to holder ``(j + r) % k``, where ``r`` rotates with the
   holder set so rounding remainders do not pile up on one writer. Each holder therefore sends
   its holder set's bytes divided by its size, within one route (at most half a bucket, or
   ``route_bytes``).
6. Buckets: a route of at least ``direct_bytes`` is a bucket of its own (then a side whose
   region of it is contiguous in memory moves it in place, without staging). The other routes
   of each (writer, reader) link, in that fixed order, are packed into buckets of at most
   ``bucket_bytes`` (each route starts at an aligned offset): a bucket takes the routes that
   start in its stretch of ``bucket_bytes`` minus the largest route, so buckets hold that
   much on average (half a bucket by default; 3/4 with ``route_bytes`` a quarter). Buckets
   are numbered in the order of where they start in their link's byte stream, so executing
   them in order keeps every link busy at once, each advancing at the same rate in bytes.
   With ``pack_mixed``, a link where some route of at least ``direct_bytes`` is not
   contiguous in its writer's or reader's local tensor (it would travel alone, but staged on
   that side) has every route packed: fewer, larger messages.
"""

from __future__ import annotations

import fnmatch
import gc
import hashlib
import itertools
import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from weightbus.plan._boxes import (
    expand_ranges,
    group_starts,
    lexsort_rows,
    overlap_join,
    volume,
)
from weightbus.spec import Layout, LayoutError, Participant, TensorSpec, dtype_name, itemsize

logger = logging.getLogger(__name__)

__all__ = ["PlanOptions", "PlanStats", "Routes", "Buckets", "TransferPlan", "make_plan"]

MiB = 1 << 20
_MIN_SPLIT = 64 << 10


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """Options of the planner."""

    bucket_bytes: int = 256 * MiB
    """Largest bucket in bytes: one staging buffer. Routes are cut to fit half of it."""
    route_bytes: int = 0
    """Largest route, at most half a bucket; 0: half a bucket. Buckets of packed routes hold
    ``bucket_bytes - route_bytes`` on average, so a quarter fills them to 3/4: fewer, fuller
    messages where every route is staged (FP8), at the price of more routes."""
    cast: tuple[tuple[str, str], ...] = ()
    """Allowed dtype changes on the wire, writer dtype -> reader dtype, e.g. {"float32": "bfloat16"}."""
    ignore_unread: tuple[str, ...] = ()
    """fnmatch patterns of writer tensors that no reader needs (e.g. "value_head.*")."""
    align: int = 256
    """Byte alignment of every route inside its bucket."""
    direct_bytes: int = 4 * MiB
    """Routes of at least this many bytes get a bucket of their own, so that a side whose region
    is contiguous sends or receives it in place, without staging; 0 turns this off."""
    pack_mixed: bool = False
    """On a *mixed* link (one with a route of at least ``direct_bytes`` whose region is not
    contiguous in its writer's or its reader's local tensor, so it would travel alone but
    staged on that side: a row-parallel engine weight from a trainer sharded by rows, say),
    no route travels alone: all are packed into buckets (:attr:`PlanStats.mixed_links`).
    Fewer, larger messages; a copy more on each side. The sessions set it for jobs over NCCL
    alone, where it was measured (``SyncConfig`` and :attr:`Transport.pack_mixed_links`)."""

    def __post_init__(self) -> None:
        cast = self.cast.items() if isinstance(self.cast, Mapping) else self.cast
        norm = tuple(sorted((dtype_name(a), dtype_name(b)) for a, b in cast))
        object.__setattr__(self, "cast", norm)
        object.__setattr__(self, "ignore_unread", tuple(self.ignore_unread))
        if self.align < 16 or self.align & (self.align - 1):
            raise ValueError(f"align={self.align} must be a power of two >= 16")
        if self.bucket_bytes < 2 * self.align:
            raise ValueError(
                f"bucket_bytes={self.bucket_bytes} is too small: use at least {2 * self.align} "
                "(a few MiB or more for real models)"
            )
        if self.route_bytes and not 2 * self.align <= self.route_bytes <= self.bucket_bytes // 2:
            raise ValueError(
                f"route_bytes={self.route_bytes} must be 0 (half a bucket) or between "
                f"{2 * self.align} and half of bucket_bytes={self.bucket_bytes}"
            )

    def cast_to(self, src: str, dst: str) -> bool:
        """Whether writers holding dtype ``src`` may feed readers holding ``dst``."""
        return src == dst or (src, dst) in self.cast

    @property
    def route_limit(self) -> int:
        """The largest route: ``route_bytes``, or half a bucket."""
        return self.route_bytes or self.bucket_bytes // 2

    def key(self) -> str:
        """These options as one string, part of the plan's digest."""
        route = f"route={self.route_bytes};" if self.route_bytes else ""
        mixed = "pack_mixed;" if self.pack_mixed else ""
        return (
            f"bucket={self.bucket_bytes};{route}align={self.align};direct={self.direct_bytes};"
            f"{mixed}cast={self.cast};ignore={self.ignore_unread}"
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Routes:
    """Column-wise routes; row ``i`` sends canonical box ``start[i]:stop[i]`` of ``tensor[i]``
    from writer ``src[i]`` (local tensor ``src_key[i]`` at ``src_local[i]``) to reader
    ``dst[i]`` (local ``dst_key[i]`` at ``dst_local[i]``), at byte ``offset[i]`` of bucket
    ``bucket[i]``. Rows are sorted by bucket, then offset."""

    src: np.ndarray
    dst: np.ndarray
    tensor: np.ndarray
    src_key: np.ndarray
    dst_key: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    src_local: np.ndarray
    dst_local: np.ndarray
    nbytes: np.ndarray
    bucket: np.ndarray
    offset: np.ndarray

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Buckets:
    """Column-wise buckets in execution order (by ``position``): link (``src`` writer, ``dst``
    reader), bytes, wave (index within the link), and the range ``[first, first + count)`` of
    their routes."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    wave: np.ndarray
    first: np.ndarray
    count: np.ndarray
    position: np.ndarray
    """Byte position of the bucket's first route in its link's stream (the execution order)."""

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStats:
    """How the bytes spread: per writer, per reader, per link, and the writers' imbalance."""

    total_bytes: int
    routes: int
    buckets: int
    writer_bytes: tuple[int, ...]
    reader_bytes: tuple[int, ...]
    link_bytes: tuple[tuple[int, int, int], ...]
    """(writer index, reader index, bytes) per link that carries data."""
    writer_imbalance: float
    """max / mean bytes over writers that hold any data the readers need (1.0 is perfect)."""
    reader_imbalance: float
    seconds: float
    mixed_links: tuple[tuple[int, int], ...] = ()
    """(writer index, reader index) of each mixed link (see :attr:`PlanOptions.pack_mixed`),
    whether or not the plan packed them."""
    packed_links: tuple[tuple[int, int], ...] = ()
    """The mixed links whose every route the plan packed (all of them with
    :attr:`PlanOptions.pack_mixed`; those a caller picked, see :func:`make_plan`)."""

    def summary(self) -> str:
        return (
            f"{self.total_bytes / 1e9:.3f} GB in {self.routes} routes, {self.buckets} buckets, "
            f"{len(self.link_bytes)} links; writer max/mean {self.writer_imbalance:.3f}, "
            f"reader max/mean {self.reader_imbalance:.3f}; planned in {self.seconds:.3f} s"
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TransferPlan:
    """The result of :func:`make_plan`: routes grouped into buckets, with a digest."""

    writers: tuple[Layout, ...]
    """The writers' layouts, by rank."""
    readers: tuple[Layout, ...]
    """The readers' layouts, by rank."""
    tensors: tuple[TensorSpec, ...]
    """Canonical tensors with the *readers'* dtype, sorted by name."""
    src_dtypes: tuple[str, ...]
    """The writers' dtype of each tensor (equal to ``tensors[i].dtype`` unless cast)."""
    routes: Routes
    """Every route (one box of one tensor from one writer to one reader), column-wise."""
    buckets: Buckets
    """Routes grouped per link under the byte budget, in execution order."""
    options: PlanOptions
    """The options the plan was made with."""
    stats: PlanStats
    """Bytes, routes and balance figures for logs and the CLI."""
    digest: str
    """Hash of everything above; every participant must compute the same one."""
    _index: dict = field(default_factory=dict, repr=False)

    @property
    def participants(self) -> tuple[Participant, ...]:
        """Writers by rank, then readers by rank (the global ranks transports use)."""
        return tuple(w.participant for w in self.writers) + tuple(
            r.participant for r in self.readers
        )

    def buckets_of(self, role: str, index: int) -> np.ndarray:
        """Bucket ids in execution order where writer/reader ``index`` takes part."""
        cache_key = (role, index)
        if cache_key not in self._index:
            col = self.buckets.src if role == "writer" else self.buckets.dst
            self._index[cache_key] = np.flatnonzero(col == index)
        return self._index[cache_key]


# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Side:
    """All pieces of one side (writers or readers), widened to the plan's ndim."""

    part: np.ndarray  # participant index within the side
    tensor: np.ndarray  # global tensor id
    key: np.ndarray  # local key index within its participant
    start: np.ndarray
    stop: np.ndarray
    local: np.ndarray
    local_shape: np.ndarray  # shape of the piece's local tensor, right-aligned


def _who(layouts: Sequence[Layout], part: int) -> str:
    p = layouts[part].participant
    return f"{p.role} {p.name!r}"


def _check_participants(writers: Sequence[Layout], readers: Sequence[Layout]) -> None:
    if not writers:
        raise LayoutError("no writer layouts: a plan needs at least one writer")
    if not readers:
        raise LayoutError("no reader layouts: a plan needs at least one reader")
    names: dict[str, str] = {}
    for role, group in (("writer", writers), ("reader", readers)):
        for i, lay in enumerate(group):
            p = lay.participant
            if p.role != role:
                raise LayoutError(f"{p.name!r} has role {p.role!r} but was passed as a {role}")
            if p.rank != i:
                ranks = [x.participant.rank for x in group]
                raise LayoutError(
                    f"{role} ranks must be 0..{len(group) - 1} in order, got {ranks}: "
                    "sort the layouts by rank and number them without gaps"
                )
            if p.name in names:
                raise LayoutError(
                    f"participant name {p.name!r} is used twice: names must be unique"
                )
            names[p.name] = role


def _unique_specs(group: Sequence[Layout]) -> tuple[list[TensorSpec], list[int], list[np.ndarray]]:
    """The distinct TensorSpec objects of a group of layouts (by identity: layouts built from
    one model share them), the layout each first appears in, and per layout the position of
    each of its tensors in that list."""
    flat = list(itertools.chain.from_iterable(lay.tensors for lay in group))
    ids = np.fromiter(map(id, flat), np.int64, len(flat))
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    # order by first appearance, not by memory address, so results and messages are stable
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    first, inverse = first[order], rank[inverse]
    sizes = np.cumsum([0] + [len(lay.tensors) for lay in group])
    owner = np.searchsorted(sizes, first, side="right") - 1
    per_layout = [inverse[sizes[i] : sizes[i + 1]] for i in range(len(group))]
    return [flat[i] for i in first.tolist()], owner.tolist(), per_layout


def _role_specs(group: Sequence[Layout]) -> tuple[dict[str, TensorSpec], list, list[np.ndarray]]:
    """One spec per tensor name for a group of layouts; all of the group's participants must
    agree on its shape and dtype."""
    specs, owner, per_layout = _unique_specs(group)
    by_name = dict(zip(map(_NAME, specs), specs, strict=True))
    if len(by_name) != len(specs):  # several spec objects for one name (e.g. deserialised)
        first: dict[str, tuple[TensorSpec, Layout]] = {}
        for spec, o in zip(specs, owner, strict=True):
            lay = group[o]
            seen = first.setdefault(spec.name, (spec, lay))
            if seen[0].shape != spec.shape:
                raise LayoutError(
                    f"{spec.name}: {_who([lay], 0)} has shape {spec.shape}, "
                    f"{_who([seen[1]], 0)} has {seen[0].shape}: both sides must describe the "
                    "same checkpoint (check the model config on both sides)"
                )
            if seen[0].dtype != spec.dtype:
                raise LayoutError(
                    f"{spec.name}: {_who([lay], 0)} holds {spec.dtype}, {_who([seen[1]], 0)} "
                    f"holds {seen[0].dtype}: all {lay.role}s must use one dtype per tensor"
                )
    return by_name, specs, per_layout


def _holder(group: Sequence[Layout], name: str) -> Layout:
    """The first layout of a group that names tensor ``name`` (for messages)."""
    return next(lay for lay in group if any(t.name == name for t in lay.tensors))


def _merge_tensors(
    writers: Sequence[Layout], readers: Sequence[Layout], opts: PlanOptions
) -> tuple[list[TensorSpec], list[str], list[np.ndarray], list[np.ndarray]]:
    """One global tensor table; checks shapes and dtypes; maps each layout's tensor ids."""
    wmap, wspecs, wper = _role_specs(writers)
    rmap, rspecs, rper = _role_specs(readers)
    for n in rmap.keys() - wmap.keys():
        unheld = rmap[n]
        lay = _holder(readers, n)
        raise LayoutError(
            f"{lay.role} {lay.name!r} expects {n} {unheld.shape} {unheld.dtype}, but no writer holds it: "
            "add it to the trainer's layout, or drop it from the reader's"
        )
    names = sorted(wmap)
    specs, src_dtypes = [], []
    for n in names:
        ws = wmap[n]
        rs = rmap.get(n)
        if rs is None:
            if not any(fnmatch.fnmatchcase(n, pat) for pat in opts.ignore_unread):
                lay = _holder(writers, n)
                raise LayoutError(
                    f"{lay.role} {lay.name!r} holds {n} {ws.shape} {ws.dtype}, but no reader expects it: "
                    f"pass ignore_unread=({n!r},) (or a pattern) if the engine does not need it"
                )
            rs = ws
        elif rs is not ws:
            if rs.shape != ws.shape:
                raise LayoutError(
                    f"{n}: reader {_holder(readers, n).name!r} has shape {rs.shape}, "
                    f"writer {_holder(writers, n).name!r} has {ws.shape}: both sides must describe the "
                    "same checkpoint (check the model config on both sides)"
                )
            if not opts.cast_to(ws.dtype, rs.dtype):
                raise LayoutError(
                    f"reader {_holder(readers, n).name!r} expects {n} as {rs.shape} {rs.dtype}, writers hold "
                    f"{ws.shape} {ws.dtype} ({_holder(writers, n).name!r}): pass cast={{{ws.dtype!r}: {rs.dtype!r}}}"
                )
        specs.append(rs)
        src_dtypes.append(ws.dtype)
    index = {n: i for i, n in enumerate(names)}
    wglob = np.fromiter(map(index.__getitem__, map(_NAME, wspecs)), np.int64, len(wspecs))
    rglob = np.fromiter(map(index.__getitem__, map(_NAME, rspecs)), np.int64, len(rspecs))
    return specs, src_dtypes, [wglob[inv] for inv in wper], [rglob[inv] for inv in rper]


def _shape_table(shapes: Sequence[tuple[int, ...]], ndim: int) -> np.ndarray:
    """Shapes right-aligned to ``ndim`` columns (padded with 1) as one int64 array."""
    pads = [(1,) * (ndim - k) for k in range(ndim + 1)]
    flat = itertools.chain.from_iterable(pads[len(sh)] + sh for sh in shapes)
    return np.fromiter(flat, np.int64, len(shapes) * ndim).reshape(len(shapes), ndim)


def _local_shapes(lay: Layout, ndim: int) -> np.ndarray:
    """Shapes of a layout's local tensors, right-aligned to ``ndim`` columns."""
    key = ("local_shapes", ndim)
    table = lay._memo.get(key)
    if table is None:
        shapes = list(map(_SHAPE, lay.locals))
        table = lay._memo[key] = (
            _shape_table(shapes, ndim) if shapes else np.ones((1, ndim), np.int64)
        )
    return table


_NAME = operator.attrgetter("name")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_KEY = operator.attrgetter("key")


def _gather_side(layouts: Sequence[Layout], tmaps: list[np.ndarray], ndim: int) -> _Side:
    parts, tens, keys, starts, stops, locs, lshapes = [], [], [], [], [], [], []
    for i, (lay, tmap) in enumerate(zip(layouts, tmaps, strict=True)):
        p = lay.pieces.widened(ndim)
        n = len(p)
        parts.append(np.full(n, i, np.int64))
        tens.append(tmap[p.tensor] if n else np.zeros(0, np.int64))
        keys.append(p.key.astype(np.int64))
        starts.append(p.start)
        stops.append(p.stop)
        locs.append(p.local_start)
        shapes = _local_shapes(lay, ndim)
        lshapes.append(shapes[p.key] if n else np.zeros((0, ndim), np.int64))
    cat = np.concatenate
    return _Side(
        part=cat(parts),
        tensor=cat(tens),
        key=cat(keys),
        start=cat(starts).reshape(-1, ndim),
        stop=cat(stops).reshape(-1, ndim),
        local=cat(locs).reshape(-1, ndim),
        local_shape=cat(lshapes).reshape(-1, ndim),
    )


def _any_col(mask: np.ndarray) -> np.ndarray:
    """Row-wise any() of a narrow 2-D mask (faster than ``mask.any(axis=1)``)."""
    out = mask[:, 0].copy()
    for d in range(1, mask.shape[1]):
        out |= mask[:, d]
    return out


_DTYPE_CODE: dict[str, int] = {}


def _dtype_codes(names) -> np.ndarray:
    """Small integer codes for dtype names (stable within this process)."""
    return np.fromiter((_DTYPE_CODE.setdefault(d, len(_DTYPE_CODE)) for d in names), np.int64)


def _local_dtypes(lay: Layout) -> np.ndarray:
    codes = lay._memo.get("local_dtypes")
    if codes is None:
        codes = lay._memo["local_dtypes"] = _dtype_codes(map(_DTYPE, lay.locals))
    return codes


def _check_local_dtypes(
    layouts: Sequence[Layout], side: _Side, role_dtypes: list[str], specs: list[TensorSpec]
) -> None:
    """A piece's local tensor must have the dtype its participant declares for the tensor."""
    want = _dtype_codes(role_dtypes)
    local = np.concatenate([_local_dtypes(lay)[lay.pieces.key] for lay in layouts])
    bad = np.flatnonzero(local != want[side.tensor])
    if len(bad):
        i = int(bad[0])
        lay = layouts[side.part[i]]
        spec, lt = specs[side.tensor[i]], lay.locals[side.key[i]]
        raise LayoutError(
            f"{lay.role} {lay.name!r}: {spec.name} is declared {role_dtypes[side.tensor[i]]} but its "
            f"piece lives in local tensor {lt.key!r} of dtype {lt.dtype}: declare the tensor with "
            "the local dtype (casts happen between participants, through PlanOptions.cast)"
        )


def _fmt_box(start: np.ndarray, stop: np.ndarray, nd: int) -> str:
    s, e = start[len(start) - nd :], stop[len(stop) - nd :]
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(s.tolist(), e.tolist(), strict=True)) + "]"


def _check_bounds(
    side: _Side, layouts: Sequence[Layout], shapes: np.ndarray, specs: list[TensorSpec]
) -> None:
    extent = side.stop - side.start
    bad_empty = _any_col(extent <= 0)
    bad_canon = _any_col(side.start < 0) | _any_col(side.stop > shapes[side.tensor])
    bad_local = _any_col(side.local < 0) | _any_col(side.local + extent > side.local_shape)
    for mask, what in ((bad_empty, "empty"), (bad_canon, "canonical"), (bad_local, "local")):
        hit = np.flatnonzero(mask)
        if len(hit) == 0:
            continue
        i = int(hit[0])
        lay = layouts[side.part[i]]
        spec = specs[side.tensor[i]]
        box = _fmt_box(side.start[i], side.stop[i], len(spec.shape))
        more = f" (and {len(hit) - 1} more pieces)" if len(hit) > 1 else ""
        if what == "empty":
            raise LayoutError(
                f"{_who(layouts, side.part[i])}: piece {box} of {spec.name} is empty{more}: "
                "leave empty shards out of the layout"
            )
        if what == "canonical":
            raise LayoutError(
                f"{_who(layouts, side.part[i])}: piece {box} of {spec.name} lies outside the "
                f"tensor's shape {spec.shape}{more}: fix the shard offsets in this layout"
            )
        local = lay.locals[side.key[i]]
        lstart = side.local[i]
        lbox = _fmt_box(lstart, lstart + extent[i], len(local.shape))
        raise LayoutError(
            f"{_who(layouts, side.part[i])}: piece {box} of {spec.name} is placed at {lbox} of "
            f"local tensor {local.key!r} {local.shape}, outside it{more}: fix the local offsets"
        )


def _self_overlaps(
    group: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``i < j`` of rows in the same group whose boxes overlap (only groups of 2+ rows)."""
    _, inv, counts = np.unique(group, return_inverse=True, return_counts=True)
    rows = np.flatnonzero(counts[inv] > 1)
    if len(rows) == 0:
        return rows, rows
    g = inv[rows]
    ia, ib = overlap_join(g, start[rows], stop[rows], g, start[rows], stop[rows], int(g.max()) + 1)
    keep = ia < ib
    return rows[ia[keep]], rows[ib[keep]]


def _check_reader_overlaps(side: _Side, layouts: Sequence[Layout], specs: list[TensorSpec]) -> None:
    # canonical: a reader must not want the same element twice
    ia, ib = _self_overlaps(side.part * len(specs) + side.tensor, side.start, side.stop)
    if len(ia):
        i, j = int(ia[0]), int(ib[0])
        spec = specs[side.tensor[i]]
        nd = len(spec.shape)
        raise LayoutError(
            f"{_who(layouts, side.part[i])}: pieces {_fmt_box(side.start[i], side.stop[i], nd)} and "
            f"{_fmt_box(side.start[j], side.stop[j], nd)} of {spec.name} overlap: a reader may "
            "receive each element once (for tied weights, declare one piece and share the tensor)"
        )
    # local: two pieces must not write the same local element
    n_k = max((len(lay.locals) for lay in layouts), default=1)
    lstop = side.local + (side.stop - side.start)
    ia, ib = _self_overlaps(side.part * n_k + side.key, side.local, lstop)
    if len(ia):
        i, j = int(ia[0]), int(ib[0])
        local = layouts[side.part[i]].locals[side.key[i]]
        nd = len(local.shape)
        raise LayoutError(
            f"{_who(layouts, side.part[i])}: pieces of {specs[side.tensor[i]].name} and "
            f"{specs[side.tensor[j]].name} both write local tensor {local.key!r} at "
            f"{_fmt_box(side.local[i], lstop[i], nd)} and {_fmt_box(side.local[j], lstop[j], nd)}: "
            "local boxes of one reader must not overlap"
        )


@dataclass(slots=True)
class _Regions:
    """Disjoint source regions with their holders (CSR over writer piece rows)."""

    tensor: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    hold_ptr: np.ndarray  # region r's holders are hold_rows[hold_ptr[r]:hold_ptr[r+1]]
    hold_rows: np.ndarray  # writer piece rows, sorted by writer index within a region


def _source_regions(w: _Side, n_tensors: int) -> _Regions:
    order = lexsort_rows(w.tensor, w.start, w.stop, w.part)
    t, s, e = w.tensor[order], w.start[order], w.stop[order]
    firsts = group_starts([t, s, e])
    ptr = np.append(firsts, len(order))
    reg = _Regions(tensor=t[firsts], start=s[firsts], stop=e[firsts], hold_ptr=ptr, hold_rows=order)
    # distinct writer boxes of one tensor that overlap each other are cut into disjoint cells
    ia, ib = overlap_join(
        reg.tensor, reg.start, reg.stop, reg.tensor, reg.start, reg.stop, n_tensors
    )
    mixed = np.unique(reg.tensor[ia[ia != ib]])
    if len(mixed):
        reg = _cut_mixed(reg, mixed, w)
    return reg


def _cut_mixed(reg: _Regions, mixed: np.ndarray, w: _Side) -> _Regions:
    """Replace the regions of tensors in ``mixed`` by disjoint grid cells (rare: mixed shardings)."""
    keep = ~np.isin(reg.tensor, mixed)
    tens, starts, stops, holders = [], [], [], []
    for r in np.flatnonzero(keep):
        tens.append(reg.tensor[r])
        starts.append(reg.start[r])
        stops.append(reg.stop[r])
        holders.append(reg.hold_rows[reg.hold_ptr[r] : reg.hold_ptr[r + 1]])
    for t in mixed.tolist():
        rs = np.flatnonzero(reg.tensor == t)
        cuts = [
            np.unique(np.concatenate([reg.start[rs, d], reg.stop[rs, d]]))
            for d in range(reg.start.shape[1])
        ]
        grids = np.meshgrid(*[np.arange(len(c) - 1) for c in cuts], indexing="ij")
        idx = np.stack([g.reshape(-1) for g in grids], axis=1)
        cs = np.stack([cuts[d][idx[:, d]] for d in range(len(cuts))], axis=1)
        ce = np.stack([cuts[d][idx[:, d] + 1] for d in range(len(cuts))], axis=1)
        inside = np.all(
            (reg.start[rs][None, :, :] <= cs[:, None, :])
            & (ce[:, None, :] <= reg.stop[rs][None, :, :]),
            axis=2,
        )
        for c in np.flatnonzero(inside.any(axis=1)):
            rows = np.concatenate(
                [reg.hold_rows[reg.hold_ptr[r] : reg.hold_ptr[r + 1]] for r in rs[inside[c]]]
            )
            rows = rows[np.argsort(w.part[rows], kind="stable")]
            tens.append(t)
            starts.append(cs[c])
            stops.append(ce[c])
            holders.append(rows)
    order = lexsort_rows(np.asarray(tens), np.asarray(starts), np.asarray(stops))
    counts = np.array([len(holders[i]) for i in order], np.int64)
    return _Regions(
        tensor=np.asarray(tens, np.int64)[order],
        start=np.asarray(starts, np.int64)[order],
        stop=np.asarray(stops, np.int64)[order],
        hold_ptr=np.concatenate([[0], np.cumsum(counts)]),
        hold_rows=np.concatenate([holders[i] for i in order]).astype(np.int64),
    )


def _split_large(
    start: np.ndarray, stop: np.ndarray, elem_bytes: np.ndarray, limit: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut boxes over ``limit`` bytes (per box) along their outermost dim of extent > 1.

    Returns (source row of each output box, starts, stops): the boxes that fit first, then
    the pieces of the cut ones.
    """
    rows = np.arange(len(start), dtype=np.int64)
    nbytes = volume(start, stop) * elem_bytes
    big = (nbytes > np.maximum(limit, 1)) & _any_col(stop - start > 1)
    out_rows, out_start, out_stop = [rows[~big]], [start[~big]], [stop[~big]]
    rows, start, stop = rows[big], start[big], stop[big]
    while len(rows):
        extent = stop - start
        nbytes = volume(start, stop) * elem_bytes[rows]
        lim = np.maximum(limit[rows], 1)
        dim = np.argmax(extent > 1, axis=1)  # outermost dim with extent > 1
        ext_d = extent[np.arange(len(rows)), dim]
        parts = np.minimum(-(-nbytes // lim), ext_d)
        step = -(-ext_d // parts)
        parts = -(-ext_d // step)
        src, k = expand_ranges(np.zeros(len(rows), np.int64), parts)
        new_start, new_stop = start[src], stop[src]
        d = dim[src]
        sel = np.arange(len(src))
        new_start[sel, d] = start[src, d] + k * step[src]
        new_stop[sel, d] = np.minimum(new_start[sel, d] + step[src], stop[src, d])
        rows, start, stop = rows[src], new_start, new_stop
        # a single element cannot be cut further, whatever the limit
        still = (volume(start, stop) * elem_bytes[rows] > np.maximum(limit[rows], 1)) & _any_col(
            stop - start > 1
        )
        out_rows.append(rows[~still])
        out_start.append(start[~still])
        out_stop.append(stop[~still])
        rows, start, stop = rows[still], start[still], stop[still]
    return np.concatenate(out_rows), np.concatenate(out_start), np.concatenate(out_stop)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _holder_sets(reg: _Regions, w: _Side) -> tuple[np.ndarray, np.ndarray]:
    """Per region: a signature of its holder set (order-independent hash of the holders'
    writer indices, mixed with their count) and the number of holders."""
    counts = np.diff(reg.hold_ptr)
    with np.errstate(over="ignore"):
        h = _splitmix64(w.part[reg.hold_rows].astype(np.uint64) + np.uint64(1))
        sig = np.add.reduceat(h, reg.hold_ptr[:-1]) if len(h) else np.zeros(0, np.uint64)
        sig = sig ^ _splitmix64(counts.astype(np.uint64))
    return sig, counts


def _assign_holders(
    region: np.ndarray,
    nbytes: np.ndarray,
    reg: _Regions,
    w: _Side,
    sig_reg: np.ndarray,
    counts: np.ndarray,
) -> np.ndarray:
    """Pick one holder (a writer piece row) per route; see rule 5 in the module docstring.

    Routes arrive in a fixed order (reader piece, then region); within a holder set that order
    is kept (a stable sort by signature).
    """
    choice = reg.hold_rows[reg.hold_ptr[region]]
    multi = np.flatnonzero(counts[region] > 1)
    if len(multi) == 0:
        return choice
    region_m = region[multi]
    sig = sig_reg[region_m]
    order = np.argsort(sig, kind="stable")
    sig_o, b_o, k_o = sig[order], nbytes[multi][order].astype(np.float64), counts[region_m][order]
    firsts = group_starts([sig_o])
    gid = np.repeat(np.arange(len(firsts)), np.diff(np.append(firsts, len(order))))
    cum = np.cumsum(b_o)
    base = np.append(0.0, cum)[firsts][gid]
    total = np.add.reduceat(b_o, firsts)[gid]
    mid = (cum - b_o - base) + 0.5 * b_o
    j = np.minimum((mid * k_o / np.maximum(total, 1.0)).astype(np.int64), k_o - 1)
    j = (j + gid) % k_o
    picked = reg.hold_rows[reg.hold_ptr[region_m[order]] + j]
    # same signature must mean the same holder set: check the chosen writer per set position
    rep_rows = reg.hold_rows[reg.hold_ptr[region_m[order[firsts]][gid]] + j]
    assert np.array_equal(w.part[picked], w.part[rep_rows]), "holder-set hash collision"
    choice[multi[order]] = picked
    return choice


Pair = tuple[Participant, Participant]
"""A link: (writer, reader)."""
PackMixedLinks = Callable[[tuple[Pair, ...], tuple[Pair, ...]], Iterable[Pair]]
"""``(links, mixed links) -> the mixed links to pack``: see :func:`make_plan`."""


def make_plan(
    writers: Sequence[Layout],
    readers: Sequence[Layout],
    options: PlanOptions | None = None,
    *,
    pack_mixed_links: PackMixedLinks | None = None,
) -> TransferPlan:
    """Plan a transfer from ``writers`` to ``readers`` (each sorted by rank 0..n-1).

    ``pack_mixed_links``: called once the routes are known and before any bucket is made,
    with every link that carries data and the mixed ones among them, as (writer, reader)
    participant pairs sorted by ranks; it returns the mixed links to pack, as
    ``options.pack_mixed`` packs every one (:attr:`PlanStats.packed_links` lists them; where
    they are all of them, :attr:`TransferPlan.options` says ``pack_mixed``). For a caller
    whose choice depends on the plan's links (a session choosing a transport per link, where
    NCCL's links pack and CUDA IPC's need not): one plan instead of two. Not called when
    ``options.pack_mixed`` is set.

    Raises :class:`~weightbus.spec.LayoutError` naming the tensor, the participants and the
    fix when the layouts cannot be satisfied; nothing is planned then.
    """
    # planning allocates millions of small objects while millions more are alive; the cyclic
    # collector would rescan them all many times over, for nothing (no cycles are made here)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _make_plan(writers, readers, options, pack_mixed_links)
    finally:
        if gc_was_enabled:
            gc.enable()


def _make_plan(
    writers: Sequence[Layout],
    readers: Sequence[Layout],
    options: PlanOptions | None,
    pack_mixed_links: PackMixedLinks | None,
) -> TransferPlan:
    t0 = time.perf_counter()
    opts = options or PlanOptions()
    writers, readers = tuple(writers), tuple(readers)
    _check_participants(writers, readers)
    specs, src_dtypes, wmaps, rmaps = _merge_tensors(writers, readers, opts)
    ndim = max([lay.pieces.ndim for lay in (*writers, *readers)] + [1])
    for lay in (*writers, *readers):
        ndim = max(ndim, max(map(len, map(_SHAPE, lay.locals)), default=1))
    shapes = _shape_table([s.shape for s in specs], ndim)
    wire_size = np.array([itemsize(s.dtype) for s in specs], np.int64)

    w = _gather_side(writers, wmaps, ndim)
    r = _gather_side(readers, rmaps, ndim)
    _check_local_dtypes(writers, w, src_dtypes, specs)
    _check_local_dtypes(readers, r, [sp.dtype for sp in specs], specs)
    _check_bounds(w, writers, shapes, specs)
    _check_bounds(r, readers, shapes, specs)
    _check_reader_overlaps(r, readers, specs)

    n_t = len(specs)
    reg = _source_regions(w, n_t)

    # distinct reader boxes, joined with the source regions they overlap
    rorder = lexsort_rows(r.tensor, r.start, r.stop, r.part)
    rfirst = group_starts([r.tensor[rorder], r.start[rorder], r.stop[rorder]])
    dst_t, dst_s, dst_e = r.tensor[rorder][rfirst], r.start[rorder][rfirst], r.stop[rorder][rfirst]
    ia, ib = overlap_join(dst_t, dst_s, dst_e, reg.tensor, reg.start, reg.stop, n_t)
    ist = np.maximum(dst_s[ia], reg.start[ib])
    ien = np.minimum(dst_e[ia], reg.stop[ib])
    covered = np.bincount(ia, weights=volume(ist, ien), minlength=len(dst_t))
    need = volume(dst_s, dst_e)
    short = np.flatnonzero(covered != need)
    if len(short):
        d = int(short[0])
        row = rorder[rfirst[d]]
        spec = specs[dst_t[d]]
        nd = len(spec.shape)
        held = [
            _fmt_box(reg.start[x], reg.stop[x], nd)
            for x in np.flatnonzero(reg.tensor == dst_t[d])[:8]
        ]
        raise LayoutError(
            f"{_who(readers, r.part[row])} needs {_fmt_box(dst_s[d], dst_e[d], nd)} of {spec.name} "
            f"{spec.shape}, but writers hold only {int(covered[d])} of its {int(need[d])} elements "
            f"(writer boxes: {', '.join(held) or 'none'}): every reader region must be held by "
            "some writer; check the trainer's sharding covers the whole tensor"
        )

    # every reader holding a distinct box gets one route per overlapping region
    grp_ptr = np.append(rfirst, len(rorder))
    by_dst = np.argsort(ia, kind="stable")
    ia, ib, ist, ien = ia[by_dst], ib[by_dst], ist[by_dst], ien[by_dst]
    inter_ptr = np.searchsorted(ia, np.arange(len(dst_t) + 1))
    # pairs (reader piece row, intersection index)
    reader_group = np.empty(len(rorder), np.int64)
    reader_group[rorder] = np.repeat(np.arange(len(dst_t)), np.diff(grp_ptr))
    rrow, inter = expand_ranges(inter_ptr[reader_group], inter_ptr[reader_group + 1])
    rrow = rrow.astype(np.int64)
    region = ib[inter]
    rs, re_ = ist[inter], ien[inter]
    tens = r.tensor[rrow]

    # cut routes to at most half a bucket (route_bytes), and routes of replicated regions
    # finer, to 1/64 of a holder's share, so that rule 5's runs come out even
    limit = opts.route_limit
    sig_reg, counts = _holder_sets(reg, w)
    k = counts[region]
    _, set_of_region = np.unique(sig_reg, return_inverse=True)
    set_id = set_of_region[region]
    share = np.bincount(set_id, weights=volume(rs, re_) * wire_size[tens])[set_id] / k
    route_limit = np.where(k > 1, np.clip(share / 64, _MIN_SPLIT, limit), limit) - opts.align
    src_idx, rs, re_ = _split_large(rs, re_, wire_size[tens], route_limit.astype(np.int64))
    rrow, region, tens = rrow[src_idx], region[src_idx], tens[src_idx]
    nbytes = volume(rs, re_) * wire_size[tens]

    wrow = _assign_holders(region, nbytes, reg, w, sig_reg, counts)
    src, dst = w.part[wrow], r.part[rrow]

    # bucket by link, keeping the fixed route order within a link; number buckets wave by wave
    link_key = (src.astype(np.int64) * len(readers) + dst) << 40 | np.arange(
        len(src), dtype=np.int64
    )
    order = np.argsort(link_key)
    src, dst, tens, rs, re_ = src[order], dst[order], tens[order], rs[order], re_[order]
    wrow, rrow, nbytes = wrow[order], rrow[order], nbytes[order]
    padded = -(-nbytes // opts.align) * opts.align
    n = len(src)
    link_first = group_starts([src, dst])
    link_id = np.repeat(np.arange(len(link_first)), np.diff(np.append(link_first, n)))
    # routes of at least direct_bytes travel alone (a sender or receiver whose region is
    # contiguous then skips staging); the others are packed into buckets, per link, in order
    alone = nbytes >= opts.direct_bytes if opts.direct_bytes > 0 else np.zeros(n, bool)
    # mixed links: one of their lone routes is not contiguous on one side (staged there)
    lone = np.flatnonzero(alone)
    ext = re_[lone] - rs[lone]
    flat = _contiguous(ext, w.local_shape[wrow[lone]]) & _contiguous(ext, r.local_shape[rrow[lone]])
    mixed = np.zeros(len(link_first), bool)
    mixed[link_id[lone[~flat]]] = True
    mixed_links = tuple((int(src[i]), int(dst[i])) for i in link_first[np.flatnonzero(mixed)])
    pack = mixed if opts.pack_mixed else np.zeros_like(mixed)
    if pack_mixed_links is not None and not opts.pack_mixed:
        opts, pack = _ask_pack(
            pack_mixed_links, opts, mixed, writers, readers, src, dst, link_first
        )
    packed_links = tuple((int(src[i]), int(dst[i])) for i in link_first[np.flatnonzero(pack)])
    alone &= ~pack[link_id]
    packed = np.where(alone, 0, padded)
    cum = np.cumsum(packed)
    link_base = np.append(0, cum)[link_first][link_id]
    pos = cum - packed - link_base
    seq = np.arange(n, dtype=np.int64)
    # packed routes: a bucket per (link, chunk), in route order; lone routes: a bucket each
    small = np.flatnonzero(~alone)
    chunk = pos[small] // (opts.bucket_bytes - limit)  # + a last route of <= limit: fits
    starts = group_starts([link_id[small], chunk])
    b_of_route = np.empty(n, np.int64)
    b_of_route[small] = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(small))))
    b_of_route[alone] = len(starts) + np.arange(int(alone.sum()))
    n_b = int(b_of_route.max()) + 1 if n else 0
    b_first_route = np.full(n_b, n, np.int64)
    np.minimum.at(b_first_route, b_of_route, seq)
    offset = np.where(alone, 0, pos - pos[b_first_route][b_of_route])
    # a bucket ends where its last route ends (no trailing padding): both sides move exactly this
    b_bytes = np.zeros(n_b, np.int64)
    np.maximum.at(b_bytes, b_of_route, offset + nbytes)
    b_count = np.bincount(b_of_route, minlength=n_b)
    # wave = the bucket's place in its link, by its first route; buckets execute in the order
    # of where they start in their link's byte stream, so every link advances at the same rate
    # in bytes whatever its buckets' sizes
    b_link = link_id[b_first_route]
    by_first = np.argsort(b_first_route, kind="stable")
    b_wave = np.empty(n_b, np.int64)
    link_start = np.searchsorted(b_link[by_first], b_link[by_first], side="left")
    b_wave[by_first] = np.arange(n_b) - link_start
    all_cum = np.cumsum(padded)
    stream_pos = (all_cum - padded - np.append(0, all_cum)[link_first][link_id])[b_first_route]
    b_src, b_dst = src[b_first_route], dst[b_first_route]
    exec_order = np.lexsort((b_dst, b_src, stream_pos))
    new_id = np.empty(n_b, np.int64)
    new_id[exec_order] = np.arange(n_b)
    bucket = new_id[b_of_route]
    # routes sorted by (bucket, offset)
    rord = np.argsort(bucket * (int(offset.max(initial=0)) + 1) + offset)
    first = np.searchsorted(bucket[rord], np.arange(n_b))
    routes = Routes(
        src=src[rord].astype(np.int32),
        dst=dst[rord].astype(np.int32),
        tensor=tens[rord].astype(np.int32),
        src_key=w.key[wrow][rord].astype(np.int32),
        dst_key=r.key[rrow][rord].astype(np.int32),
        start=rs[rord],
        stop=re_[rord],
        src_local=(w.local[wrow] + rs - w.start[wrow])[rord],
        dst_local=(r.local[rrow] + rs - r.start[rrow])[rord],
        nbytes=nbytes[rord],
        bucket=bucket[rord].astype(np.int32),
        offset=offset[rord],
    )
    buckets = Buckets(
        src=b_src[exec_order].astype(np.int32),
        dst=b_dst[exec_order].astype(np.int32),
        nbytes=b_bytes[exec_order],
        wave=b_wave[exec_order].astype(np.int32),
        first=first,
        count=b_count[exec_order],
        position=stream_pos[exec_order],
    )
    seconds = time.perf_counter() - t0
    stats = _stats(routes, buckets, len(writers), len(readers), seconds, mixed_links, packed_links)
    digest = _digest(writers, readers, specs, src_dtypes, routes, buckets, opts, ndim)
    plan = TransferPlan(
        writers=writers,
        readers=readers,
        tensors=tuple(specs),
        src_dtypes=tuple(src_dtypes),
        routes=routes,
        buckets=buckets,
        options=opts,
        stats=stats,
        digest=digest,
    )
    logger.debug("plan %s: %s", digest[:12], stats.summary())
    return plan


def _ask_pack(
    ask: PackMixedLinks,
    opts: PlanOptions,
    mixed: np.ndarray,
    writers: Sequence[Layout],
    readers: Sequence[Layout],
    src: np.ndarray,
    dst: np.ndarray,
    link_first: np.ndarray,
) -> tuple[PlanOptions, np.ndarray]:
    """:func:`make_plan`'s ``pack_mixed_links`` asked: the options (``pack_mixed`` where it
    picked every mixed link) and, per link, whether to pack it."""
    pairs = [(writers[src[i]].participant, readers[dst[i]].participant) for i in link_first]
    place = {(w.name, r.name): k for k, (w, r) in enumerate(pairs)}
    mixed_pairs = tuple(pairs[k] for k in np.flatnonzero(mixed))
    pack = np.zeros_like(mixed)
    for w, r in ask(tuple(pairs), mixed_pairs):
        k = place.get((w.name, r.name))
        if k is None or not mixed[k]:
            raise ValueError(
                f"pack_mixed_links returned {w.name}->{r.name}, which is not a mixed link of "
                f"this plan (mixed: {', '.join(f'{a.name}->{b.name}' for a, b in mixed_pairs)})"
            )
        pack[k] = True
    if mixed.any() and pack[mixed].all():
        opts = replace(opts, pack_mixed=True)
    return opts, pack


def _contiguous(extent: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Per row, whether a region of ``extent`` (per dim, right-aligned) lies contiguous in a
    row-major tensor of ``shape`` (the same dims): every dim is of extent 1 or all the dims
    after it are whole."""
    if extent.shape[1] == 0:
        return np.ones(len(extent), bool)
    whole = extent == shape
    # after[:, i]: every dim after i is whole
    after = np.ones_like(whole)
    after[:, :-1] = np.logical_and.accumulate(whole[:, ::-1], axis=1)[:, ::-1][:, 1:]
    return ((extent == 1) | after).all(axis=1)


def _stats(
    routes: Routes,
    buckets: Buckets,
    n_w: int,
    n_r: int,
    seconds: float,
    mixed_links: tuple[tuple[int, int], ...] = (),
    packed_links: tuple[tuple[int, int], ...] = (),
) -> PlanStats:
    wb = np.bincount(routes.src, weights=routes.nbytes, minlength=n_w).astype(np.int64)
    rb = np.bincount(routes.dst, weights=routes.nbytes, minlength=n_r).astype(np.int64)
    link = np.bincount(
        routes.src.astype(np.int64) * n_r + routes.dst, weights=routes.nbytes, minlength=n_w * n_r
    )
    links = tuple((int(i // n_r), int(i % n_r), int(link[i])) for i in np.flatnonzero(link))
    active_w = wb[wb > 0]

    def imbalance(a: np.ndarray) -> float:
        return float(a.max() / a.mean()) if len(a) and a.mean() > 0 else 1.0

    return PlanStats(
        total_bytes=int(routes.nbytes.sum()),
        routes=len(routes),
        buckets=len(buckets),
        writer_bytes=tuple(int(x) for x in wb),
        reader_bytes=tuple(int(x) for x in rb),
        link_bytes=links,
        writer_imbalance=imbalance(active_w),
        reader_imbalance=imbalance(rb),
        seconds=seconds,
        mixed_links=mixed_links,
        packed_links=packed_links,
    )


def _digest(
    writers,
    readers,
    specs,
    src_dtypes,
    routes: Routes,
    buckets: Buckets,
    opts: PlanOptions,
    ndim: int,
) -> str:
    h = hashlib.sha256()
    h.update(b"weightbus.plan/1\0")
    h.update(opts.key().encode())
    for lay in (*writers, *readers):
        p = lay.participant
        h.update(f"\0{p.role}|{p.rank}|{p.name}|{p.host}|{p.device}\0".encode())
        h.update("|".join(map(_KEY, lay.locals)).encode())
        h.update(_local_shapes(lay, ndim).tobytes())
        h.update("|".join(map(_DTYPE, lay.locals)).encode())
    h.update(
        repr(
            [(s.name, s.shape, sd, s.dtype) for s, sd in zip(specs, src_dtypes, strict=True)]
        ).encode()
    )
    # the other route columns follow from these and the layouts
    for f in ("src", "dst", "tensor", "start", "stop", "bucket", "offset"):
        a = getattr(routes, f)
        h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
    for f in Buckets.__dataclass_fields__:
        a = getattr(buckets, f)
        h.update(np.ascontiguousarray(a, dtype=np.dtype("<i8")).tobytes())
    return h.hexdigest()
