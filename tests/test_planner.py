"""Planner properties: exact coverage, bit-exact reference execution, determinism, balance."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oracle import check_plan
from weightbus.plan import PlanOptions, allocate, execute, fill_from_canonical, make_plan
from weightbus.spec import Box, LayoutBuilder, Participant

# ---------------------------------------------------------------------------------------------
# random scenarios: grid shardings, replicas, mixed writer shardings, fused/stacked reader locals
# ---------------------------------------------------------------------------------------------


def _grid(draw, shape):
    """A random grid partition of ``shape``: list of boxes."""
    cuts = []
    for n in shape:
        inner = (
            sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3)))) if n > 1 else []
        )
        cuts.append([0, *inner, n])
    boxes = []
    for idx in itertools.product(*[range(len(c) - 1) for c in cuts]):
        boxes.append(
            Box(
                tuple(c[i] for c, i in zip(cuts, idx, strict=True)),
                tuple(c[i + 1] for c, i in zip(cuts, idx, strict=True)),
            )
        )
    return boxes


@st.composite
def scenarios(draw):
    n_t = draw(st.integers(1, 4))
    tensors = {}
    for i in range(n_t):
        nd = draw(st.integers(1, 3))
        tensors[f"t{i}"] = tuple(draw(st.integers(1, 7)) for _ in range(nd))
    n_w, n_r = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    wpieces = {w: [] for w in range(n_w)}
    rpieces = {r: [] for r in range(n_r)}
    for name, shape in tensors.items():
        shardings = 2 if draw(st.booleans()) and draw(st.booleans()) else 1  # mixed shardings
        for _ in range(shardings):
            for box in _grid(draw, shape):
                holders = draw(
                    st.lists(st.integers(0, n_w - 1), min_size=1, max_size=n_w, unique=True)
                )
                for w in holders:
                    if (name, box) not in [(t, b) for t, b in wpieces[w]]:
                        wpieces[w].append((name, box))
        for box in _grid(draw, shape):
            readers = draw(st.lists(st.integers(0, n_r - 1), max_size=n_r, unique=True))
            for r in readers:
                rpieces[r].append((name, box))
    reader_dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    fuse = draw(st.booleans())
    pad = draw(st.integers(0, 2))
    bucket = draw(st.sampled_from([512, 2048, 1 << 20]))
    direct = draw(st.sampled_from([0, 8, 64, 4 << 20]))
    # routes of half a bucket (0), or of a quarter where that is at least 2 alignments
    route = draw(st.sampled_from([0, bucket // 4])) if bucket >= 2048 else 0
    return tensors, wpieces, rpieces, reader_dtype, fuse, pad, (bucket, route), direct


def _writer_layout(rank, tensors, pieces, pad):
    b = LayoutBuilder(Participant(role="writer", rank=rank))
    for i, (name, box) in enumerate(pieces):
        b.add_tensor(name, tensors[name], "float32")
        # each piece in its own local tensor, sometimes at an offset inside a larger one
        shape = tuple(e + pad for e in box.shape)
        b.add_local(f"w{i}", shape, "float32")
        b.add_piece(name, box, f"w{i}", Box.at((pad,) * box.ndim, box.shape))
    return b.build()


def _reader_layout(rank, tensors, pieces, dtype, fuse, pad):
    b = LayoutBuilder(Participant(role="reader", rank=rank))
    for name, _ in pieces:
        b.add_tensor(name, tensors[name], dtype)
    by_ndim = {}
    for name, box in pieces:
        by_ndim.setdefault(box.ndim, []).append((name, box))
    for nd, group in sorted(by_ndim.items()):
        if fuse:
            # stacked: local (len(group), *max extents + pad); piece i at [i, 0:e...]
            ext = [max(box.shape[d] for _, box in group) + pad for d in range(nd)]
            key = f"stack{nd}"
            b.add_local(key, (len(group), *ext), dtype)
            for i, (name, box) in enumerate(group):
                b.add_piece(name, box, key, Box.at((i,) + (0,) * nd, (1, *box.shape)))
        else:
            for i, (name, box) in enumerate(group):
                key = f"r{nd}_{i}"
                b.add_local(key, (box.shape[0] + pad, *box.shape[1:]), dtype)
                b.add_piece(name, box, key, Box.at((pad,) + (0,) * (nd - 1), box.shape))
    return b.build()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_layouts_reference_execution_is_exact(sc):
    tensors, wpieces, rpieces, rdtype, fuse, pad, (bucket, route), direct = sc
    gen = torch.Generator().manual_seed(1)
    canon = {n: torch.randn(s, generator=gen) for n, s in tensors.items()}
    writers = [_writer_layout(w, tensors, p, pad) for w, p in wpieces.items()]
    readers = [_reader_layout(r, tensors, p, rdtype, fuse, pad) for r, p in rpieces.items()]
    # a tensor no reader wants is allowed here through ignore_unread
    opts = PlanOptions(
        bucket_bytes=bucket,
        route_bytes=route,
        cast={"float32": rdtype},
        ignore_unread=("t*",),
        direct_bytes=direct,
    )
    plan = make_plan(writers, readers, opts)

    check_plan(plan, writers, readers, canon, getattr(torch, rdtype))

    # buckets respect the budget and hold routes of one link; big routes travel alone;
    # routes of more than one element fit the route limit
    assert (plan.buckets.nbytes <= bucket).all()
    elems = np.prod(plan.routes.stop - plan.routes.start, axis=1)
    assert (plan.routes.nbytes[elems > 1] <= opts.route_limit).all()
    if direct:
        big = np.flatnonzero(plan.routes.nbytes >= direct)
        assert (plan.buckets.count[plan.routes.bucket[big]] == 1).all()
    r = plan.routes
    assert (plan.buckets.src[r.bucket] == r.src).all() and (
        plan.buckets.dst[r.bucket] == r.dst
    ).all()


# ---------------------------------------------------------------------------------------------


def _simple(n_writers=2, n_readers=2, dtype="float32", rows=8, cols=6):
    writers = []
    for w in range(n_writers):
        b = LayoutBuilder(Participant(role="writer", rank=w))
        lo, hi = rows * w // n_writers, rows * (w + 1) // n_writers
        b.add_tensor("x", (rows, cols), "float32")
        b.add_local("x", (hi - lo, cols), "float32")
        b.add_piece("x", Box((lo, 0), (hi, cols)), "x", Box((0, 0), (hi - lo, cols)))
        writers.append(b.build())
    readers = []
    for r in range(n_readers):
        b = LayoutBuilder(Participant(role="reader", rank=r))
        lo, hi = cols * r // n_readers, cols * (r + 1) // n_readers
        b.add_tensor("x", (rows, cols), dtype)
        b.add_local("x", (rows, hi - lo), dtype)
        b.add_piece("x", Box((0, lo), (rows, hi)), "x", Box((0, 0), (rows, hi - lo)))
        readers.append(b.build())
    return writers, readers


def test_plan_digest_is_stable_across_processes_and_hash_seeds():
    code = (
        "from tests.test_planner import _simple;from weightbus.plan import make_plan;"
        "w,r=_simple(3,2);print(make_plan(w,r).digest)"
    )
    digests = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    w, r = _simple(3, 2)
    digests.add(make_plan(w, r).digest)
    assert len(digests) == 1, digests
    w2, r2 = _simple(3, 3)
    assert make_plan(w2, r2).digest not in digests


def test_bucket_waves_interleave_links():
    w, r = _simple(2, 2, rows=64, cols=64)
    plan = make_plan(w, r, PlanOptions(bucket_bytes=1024))
    pos = plan.buckets.position
    assert (np.diff(pos) >= 0).all(), "buckets execute in the order of their place in their link"
    waves = plan.buckets.wave
    first_wave_links = {
        (int(a), int(b))
        for a, b, v in zip(plan.buckets.src, plan.buckets.dst, waves, strict=True)
        if v == 0
    }
    assert first_wave_links == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_replicated_writers_share_the_load():
    """4 data-parallel replicas, each tensor-parallel 2 (column and row parallel), -> 1 reader."""
    shapes = {
        "embed": ((32000, 512), 0),
        **{f"l{i}.q": ((512, 512), 0) for i in range(8)},
        **{f"l{i}.o": ((512, 512), 1) for i in range(8)},
        **{f"l{i}.up": ((2048, 512), 0) for i in range(8)},
        **{f"l{i}.down": ((512, 2048), 1) for i in range(8)},
        **{f"l{i}.norm": ((512,), None) for i in range(8)},
    }
    writers = []
    for rank in range(8):
        tp = rank % 2
        b = LayoutBuilder(Participant(role="writer", rank=rank))
        for name, (shape, dim) in shapes.items():
            b.add_tensor(name, shape, "bfloat16")
            if dim is None:
                box = Box.whole(shape)
            else:
                n = shape[dim] // 2
                start = [0] * len(shape)
                start[dim] = tp * n
                ext = list(shape)
                ext[dim] = n
                box = Box.at(start, ext)
            b.add_local(name, box.shape, "bfloat16")
            b.add_piece(name, box, name, Box.whole(box.shape))
        writers.append(b.build())
    rb = LayoutBuilder(Participant(role="reader", rank=0))
    for name, (shape, _) in shapes.items():
        rb.add_tensor(name, shape, "bfloat16")
        rb.add_local(name, shape, "bfloat16")
        rb.add_piece(name, Box.whole(shape), name, Box.whole(shape))
    plan = make_plan(writers, [rb.build()])
    wb = np.array(plan.stats.writer_bytes)
    assert wb.min() > 0, wb
    assert wb.max() <= 1.05 * wb.mean(), (wb, plan.stats.writer_imbalance)
    assert plan.stats.total_bytes == sum(np.prod(s) * 2 for s, _ in shapes.values())


def test_single_writer_single_reader_sends_everything_once():
    w, r = _simple(1, 1)
    plan = make_plan(w, r)
    assert plan.stats.total_bytes == 8 * 6 * 4
    assert plan.stats.writer_bytes == (8 * 6 * 4,)


def test_quarter_routes_fill_buckets_to_three_quarters():
    w, r = _simple(1, 1, rows=400, cols=400)  # 640,000 bytes, one link
    bucket = 64 << 10
    half = make_plan(w, r, PlanOptions(bucket_bytes=bucket, direct_bytes=0))
    opts = PlanOptions(bucket_bytes=bucket, route_bytes=bucket // 4, direct_bytes=0)
    fuller = make_plan(w, r, opts)
    for plan in (half, fuller):
        assert (plan.buckets.nbytes <= bucket).all() and plan.stats.total_bytes == 640_000
    assert (fuller.routes.nbytes <= bucket // 4).all()
    # all but the last bucket hold at least 3/4 of bucket_bytes less a route, and half as
    # many buckets would not fit: on average about 3/4 full, against about 1/2
    assert (fuller.buckets.nbytes[:-1] >= bucket // 2).all()
    assert len(fuller.buckets) <= -(-640_000 // (bucket * 3 // 4)) + 1 < len(half.buckets)
    assert fuller.digest != half.digest
    wt = [allocate(lay) for lay in w]
    canon = {"x": torch.randn(400, 400)}
    fill_from_canonical(w[0], canon, wt[0])
    rt = [allocate(lay) for lay in r]
    execute(fuller, wt, rt)
    assert torch.equal(rt[0]["x"], canon["x"])
    with pytest.raises(ValueError, match="route_bytes=40000 must be 0"):
        PlanOptions(bucket_bytes=bucket, route_bytes=40_000)


@pytest.mark.parametrize("bucket", [512, 4096])
def test_large_routes_are_cut_to_fit_buckets(bucket):
    w, r = _simple(1, 1, rows=40, cols=40)
    plan = make_plan(w, r, PlanOptions(bucket_bytes=bucket))
    assert (plan.buckets.nbytes <= bucket).all()
    assert plan.stats.total_bytes == 40 * 40 * 4
    wt = [allocate(lay) for lay in w]
    canon = {"x": torch.arange(1600, dtype=torch.float32).reshape(40, 40)}
    fill_from_canonical(w[0], canon, wt[0])
    rt = [allocate(lay) for lay in r]
    execute(plan, wt, rt)
    assert torch.equal(rt[0]["x"], canon["x"])


def test_a_tensor_cut_into_routes_of_one_bucket_travels_in_place():
    """A bucket whose routes are contiguous pieces of one tensor, lying in memory as in the
    bucket (the planner's quarter-bucket routes of a whole tensor), is one in-place byte range
    on both sides: what a writer's range holds is what packing gives, and writing it into the
    reader's range lands every element (the reader's tensor poisoned first). Buckets that
    mix tensors, hold strided regions, leave gaps or lie out of order in memory stay staged."""
    import dataclasses

    from weightbus.plan import build_program, poison
    from weightbus.plan.program import direct_view, pack

    w, r = _simple(1, 1, rows=400, cols=512)  # rows of 2 KiB: routes end on 128-byte bounds
    bucket = 64 << 10
    plan = make_plan(w, r, PlanOptions(bucket_bytes=bucket, route_bytes=bucket // 4))
    wt, rt = allocate(w[0]), allocate(r[0])
    canon = {"x": torch.randn(400, 512)}
    fill_from_canonical(w[0], canon, wt)
    poison(rt["x"])
    wops, rops = build_program(plan, "writer", 0), build_program(plan, "reader", 0)
    assert max(len(op.copies) for op in wops) >= 3  # routes cut to a quarter bucket
    for wop, rop in zip(wops, rops, strict=True):
        src, dst = direct_view(wop, wt), direct_view(rop, rt)
        assert src is not None and dst is not None and src.numel() == wop.nbytes
        buf = torch.empty(wop.nbytes, dtype=torch.uint8)
        pack(wop, wt, buf)
        assert torch.equal(src, buf), wop.bucket
        dst.copy_(src)
    assert torch.equal(rt["x"], canon["x"])

    op = next(o for o in wops if len(o.copies) >= 2)
    a, b = op.copies[0], op.copies[1]
    swapped = (dataclasses.replace(a, offset=b.offset), dataclasses.replace(b, offset=a.offset))
    cases = {
        "out of order": dataclasses.replace(op, copies=swapped + op.copies[2:]),
        "gap": dataclasses.replace(op, copies=op.copies[1:]),  # bytes no longer fill it
        # a route twice instead of the next one: the byte count adds up, the bucket has a hole
        "twice": dataclasses.replace(op, copies=(a, a) + op.copies[2:]),
        "two tensors": dataclasses.replace(op, copies=(a, dataclasses.replace(b, key="y"))),
    }
    tensors = dict(wt, y=wt["x"])
    for what, bad in cases.items():
        assert direct_view(bad, tensors) is None, what
    # rows of 1600 bytes: the planner pads each route to 128 bytes, so the bucket has gaps
    w2, r2 = _simple(1, 1, rows=400, cols=400)
    padded = make_plan(w2, r2, PlanOptions(bucket_bytes=bucket, route_bytes=bucket // 4))
    ops = build_program(padded, "writer", 0)
    assert all(direct_view(o, allocate(w2[0])) is None for o in ops if len(o.copies) > 1)
    # column halves of the reader's tensor: strided, staged
    _, halves = _simple(1, 2, rows=400, cols=512)
    plan = make_plan(w, halves, PlanOptions(bucket_bytes=bucket, route_bytes=bucket // 4))
    ht = allocate(halves[0])
    assert all(direct_view(o, wt) is None for o in build_program(plan, "writer", 0))
    assert all(direct_view(o, ht) is not None for o in build_program(plan, "reader", 0))


def test_contiguous_regions():
    from weightbus.plan.planner import _contiguous

    shape = np.array([[4, 6, 8]] * 7)
    ext = np.array(
        [
            [4, 6, 8],  # whole
            [2, 6, 8],  # rows of whole planes
            [1, 3, 8],  # whole rows of one plane
            [1, 1, 5],  # part of one row
            [1, 3, 5],  # parts of rows: strided
            [2, 3, 8],  # rows of two planes: strided
            [4, 6, 4],  # the left halves of every row: strided
        ]
    )
    assert _contiguous(ext, shape).tolist() == [True, True, True, True, False, False, False]
    assert _contiguous(np.zeros((2, 0), np.int64), np.zeros((2, 0), np.int64)).tolist() == [
        True,
        True,
    ]


def _executes_bit_exact(plan, w, r) -> None:
    """The reference executor moves random writer tensors into poisoned reader tensors, bit
    exact."""
    from weightbus.plan import poison

    wt = [allocate(lay) for lay in w]
    canon = {s.name: torch.randn(s.shape) for s in plan.tensors}
    for lay, t in zip(w, wt, strict=True):
        fill_from_canonical(lay, canon, t)
    rt = [allocate(lay) for lay in r]
    for t in rt:
        for x in t.values():
            poison(x)
    execute(plan, wt, rt)
    for lay, got in zip(r, rt, strict=True):
        want = allocate(lay)
        fill_from_canonical(lay, canon, want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("pack", [False, True])
def test_mixed_links_pack_every_route_when_asked(pack):
    """FSDP on 2 writers (rows) -> tensor parallel 2 (row-parallel weights split by columns):
    every link carries a large route strided on the writer, so every link is mixed. Packed,
    no route travels alone (each bucket holds up to half a bucket's worth of routes more
    than a lone route could), far fewer buckets, the same bytes, exact by the reference
    executor with the readers poisoned. A job without such routes (whole -> one replica)
    has no mixed link and plans alike either way."""
    from weightbus.layouts import describe
    from weightbus.layouts.families import model_spec

    model = model_spec("tiny-llama")
    w = describe.build_layouts(model, "fsdp:shard=2", "writer", dtype="float32")
    r = describe.build_layouts(model, "vllm:tp=2", "reader", dtype="float32")
    opts = PlanOptions(bucket_bytes=64 << 10, direct_bytes=2 << 10, pack_mixed=pack)
    plan = make_plan(w, r, opts)
    alone = make_plan(w, r, dataclasses.replace(opts, pack_mixed=False))
    assert plan.stats.mixed_links == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert plan.stats.total_bytes == alone.stats.total_bytes
    b = plan.buckets
    if pack:
        assert len(b) < len(alone.buckets) // 2, (len(b), len(alone.buckets))
        assert plan.digest != alone.digest
        # each link's buckets as packed routes make them: one per stretch of a bucket less
        # the largest route (a lone route would be a bucket of its own)
        stretch = opts.bucket_bytes - opts.route_limit
        for (wi, ri), nbytes in zip(
            plan.stats.mixed_links, [x[2] for x in plan.stats.link_bytes], strict=True
        ):
            n = int(((b.src == wi) & (b.dst == ri)).sum())
            assert n <= -(-nbytes // stretch) + 1, (wi, ri, n, nbytes)
    else:
        assert plan.digest == alone.digest
    _executes_bit_exact(plan, w, r)
    whole = describe.build_layouts(model, "whole", "writer", dtype="float32")
    one = describe.build_layouts(model, "vllm:tp=1", "reader", dtype="float32")
    a, c = (
        make_plan(whole, one, opts),
        make_plan(whole, one, dataclasses.replace(opts, pack_mixed=False)),
    )
    assert a.stats.mixed_links == () and np.array_equal(a.buckets.count, c.buckets.count)


@pytest.mark.parametrize("pick", ["none", "some", "all"])
def test_pack_mixed_links_picks_them_in_one_plan(pick):
    """``pack_mixed_links`` sees every link and the mixed ones as participant pairs before
    any bucket is made, and the mixed links it returns are packed: all of them is exactly
    the plan ``options.pack_mixed`` makes, none the plan without; some packs those alone
    (their routes in buckets, the other links' large routes alone), bit exact. Without
    mixed links it changes nothing; with ``options.pack_mixed`` set it is not asked; a link
    that is not mixed is refused, naming it."""
    from weightbus.layouts import describe
    from weightbus.layouts.families import model_spec

    model = model_spec("tiny-llama")
    w = describe.build_layouts(model, "fsdp:shard=2", "writer", dtype="float32")
    r = describe.build_layouts(model, "vllm:tp=2", "reader", dtype="float32")
    opts = PlanOptions(bucket_bytes=64 << 10, direct_bytes=2 << 10)
    pairs = tuple((a.participant, b.participant) for a in w for b in r)
    picked = {"none": (), "some": pairs[1:3], "all": pairs}[pick]
    asked = []

    def pack_mixed_links(links, mixed):
        asked.append((links, mixed))
        return picked

    plan = make_plan(w, r, opts, pack_mixed_links=pack_mixed_links)
    assert asked == [(pairs, pairs)]
    assert plan.stats.packed_links == {"none": (), "some": ((0, 1), (1, 0))}.get(
        pick, plan.stats.mixed_links
    )
    assert plan.options.pack_mixed is (pick == "all")
    alone = make_plan(w, r, opts)
    packed = make_plan(w, r, dataclasses.replace(opts, pack_mixed=True))
    if pick != "some":
        want = packed if pick == "all" else alone
        assert plan.digest == want.digest
        assert np.array_equal(plan.buckets.nbytes, want.buckets.nbytes)
    else:
        b = plan.buckets
        for wi, ri in ((0, 0), (0, 1), (1, 0), (1, 1)):
            ref = packed if (wi, ri) in plan.stats.packed_links else alone
            on = (b.src == wi) & (b.dst == ri)
            ref_on = (ref.buckets.src == wi) & (ref.buckets.dst == ri)
            assert np.array_equal(b.nbytes[on], ref.buckets.nbytes[ref_on]), (wi, ri)
        _executes_bit_exact(plan, w, r)
    asked.clear()
    make_plan(w, r, packed.options, pack_mixed_links=pack_mixed_links)
    assert asked == []
    whole = describe.build_layouts(model, "whole", "writer", dtype="float32")
    two = describe.build_layouts(model, "vllm:tp=1,dp=2", "reader", dtype="float32")
    plain = make_plan(whole, two, opts, pack_mixed_links=lambda links, mixed: mixed)
    assert plain.stats.packed_links == () and plain.options.pack_mixed is False
    assert plain.digest == make_plan(whole, two, opts).digest
    with pytest.raises(ValueError, match="writer-0->reader-0, which is not a mixed link"):
        make_plan(whole, two, opts, pack_mixed_links=lambda links, mixed: links[:1])
