"""Sparse deltas: bit exact over many steps and across resharding, with casts and with FP8."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_codec_fp8 import (
    Q,
    W,
    assert_reader_holds,
    canonical,
    expected_wire,
    fsdp_writers,
    in_process,
    tp_readers,
)
from weightbus.codecs.delta import (
    DeltaConfig,
    DeltaPolicy,
    _units,
    checksum,
    directory_bytes,
    encoded_size,
)
from weightbus.codecs.fp8 import Fp8Config, scale_name
from weightbus.errors import WeightbusError
from weightbus.plan import PlanOptions, allocate, fill_from_canonical, make_plan, poison
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, WriterCodec, run_sync, wire_layout
from weightbus.spec import Box, LayoutBuilder, Participant

# ---------------------------------------------------------------------------------------------
# a resharding scenario: 2 FSDP-style writers -> 3 readers with other cuts, a fused local, a
# transposed (non-contiguous) local, a replica, a cast (fp32 -> bf16), a 3-D tensor and column
# cuts (writer regions that are strided in the writer's tensor)
# ---------------------------------------------------------------------------------------------

TENSORS = {
    "a.weight": ((90, 64), "float32"),
    "b.weight": ((40, 33), "bfloat16"),
    "c.bias": ((77,), "bfloat16"),
    "d.experts": ((4, 10, 12), "bfloat16"),
    "e.weight": ((40, 33), "bfloat16"),
    "f.weight": ((40, 36), "bfloat16"),
}


def _layout(role, rank, pieces, locals_, dtype_of):
    b = LayoutBuilder(Participant(role=role, rank=rank))
    for t in dict.fromkeys(p[0] for p in pieces):
        b.add_tensor(t, TENSORS[t][0], dtype_of(t))
    for key, (shape, dt) in locals_.items():
        b.add_local(key, shape, dt)
    for t, start, stop, key, lstart in pieces:
        b.add_piece(
            t,
            Box(start, stop),
            key,
            Box.at(lstart, [e - s for s, e in zip(start, stop, strict=True)]),
        )
    return b.build()


def writers():
    out = []
    for rank in range(2):
        pieces, locals_ = [], {}
        for t, (shape, dt) in TENSORS.items():
            half = -(-shape[0] // 2)
            lo, hi = rank * half, min((rank + 1) * half, shape[0])
            start, stop = (lo,) + (0,) * (len(shape) - 1), (hi,) + shape[1:]
            pieces.append((t, start, stop, t, (0,) * len(shape)))
            locals_[t] = ((hi - lo,) + shape[1:], dt)
        out.append(_layout("writer", rank, pieces, locals_, lambda t: TENSORS[t][1]))
    return out


def readers():
    bf = "bfloat16"
    r0 = _layout(
        "reader",
        0,
        [
            ("a.weight", (0, 0), (90, 20), "a", (0, 0)),
            ("b.weight", (0, 0), (17, 33), "fused", (0, 0)),
            ("e.weight", (0, 0), (40, 33), "fused", (17, 0)),
            ("c.bias", (0,), (77,), "c", (0,)),
            ("d.experts", (0, 0, 0), (2, 10, 12), "d", (0, 0, 0)),
            ("f.weight", (0, 0), (40, 10), "f", (0, 0)),
        ],
        {
            "a": ((90, 20), bf),
            "fused": ((57, 33), bf),
            "c": ((77,), bf),
            "d": ((2, 10, 12), bf),
            "f": ((40, 10), bf),
        },
        lambda t: bf,
    )
    r1 = _layout(
        "reader",
        1,
        [
            ("a.weight", (0, 20), (90, 64), "a", (0, 0)),
            ("b.weight", (17, 0), (40, 33), "b", (0, 0)),
            ("d.experts", (2, 0, 0), (4, 10, 12), "d", (0, 0, 0)),
            ("f.weight", (0, 10), (40, 36), "f", (0, 0)),
        ],
        {"a": ((90, 44), bf), "b": ((23, 33), bf), "d": ((2, 10, 12), bf), "f": ((40, 26), bf)},
        lambda t: bf,
    )
    r2 = _layout(
        "reader",
        2,
        [("a.weight", (0, 0), (90, 64), "a", (0, 0)), ("c.bias", (0,), (77,), "c", (0,))],
        {"a": ((90, 64), bf), "c": ((77,), bf)},
        lambda t: bf,
    )
    return [r0, r1, r2]


def reader_tensors(lay):
    t = allocate(lay)
    if lay.rank == 1:
        # a transposed engine tensor: every region of it is non-contiguous
        a = torch.empty(44, 90, dtype=torch.bfloat16).t()
        poison(a)
        t["a"] = a
    return t


def start(codecs, bucket_bytes=2048):
    ws, rs = writers(), readers()
    plan = make_plan(
        [wire_layout(w, codecs) for w in ws],
        [wire_layout(r, codecs) for r in rs],
        PlanOptions(bucket_bytes=bucket_bytes, direct_bytes=0, cast={"float32": "bfloat16"}),
    )
    g = torch.Generator().manual_seed(0)
    canon = {
        t: torch.randn(shape, generator=g).to(getattr(torch, dt))
        for t, (shape, dt) in TENSORS.items()
    }
    live = [allocate(w) for w in ws]
    got = [reader_tensors(r) for r in rs]
    wcs = [WriterCodec(plan, i, live[i], codecs) for i in range(len(ws))]
    rcs = [ReaderCodec(plan, i, got[i], codecs) for i in range(len(rs))]
    return plan, ws, rs, canon, live, got, wcs, rcs


def assert_exact(rs, got, canon, skip=()):
    want = {t: v.to(torch.bfloat16) for t, v in canon.items()}
    for lay, g in zip(rs, got, strict=True):
        if lay.rank not in skip:
            assert_reader_holds(lay, g, want)


def change(canon, g, fraction):
    """Change about ``fraction`` of every tensor's elements; also NaN payloads and signed zeros."""
    for x in canon.values():
        flat = x.view(-1)
        n = max(1, int(fraction * flat.numel()))
        idx = torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] = torch.randn(n, generator=g).to(x.dtype)
        bits = flat.view(torch.int16 if x.element_size() == 2 else torch.int32)
        j = int(torch.randint(0, flat.numel(), (1,), generator=g))
        k = int(torch.randint(0, 3, (1,), generator=g))
        if k == 0:  # 0.0 <-> -0.0: equal as numbers, different bits
            flat[j] = 0.0 if torch.signbit(flat[j]) else -0.0
        elif k == 1:  # a NaN whose payload differs from the last one
            nan = 0x7FC0 if x.element_size() == 2 else 0x7FC00000
            bits[j] = nan + int(torch.randint(1, 60, (1,), generator=g))


@pytest.mark.parametrize("variant", ["one window", "small windows", "shadow copied per window"])
def test_bit_exact_over_50_steps_with_resharding(variant):
    window = 3000 if variant == "small windows" else 1 << 30
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=5, window_bytes=window))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    if variant == "small windows":
        assert all(len(w.encoder._windows) > 2 for w in wcs)
    if variant == "shadow copied per window":
        # what a GPU writer with a host shadow does: compare against a copy, write it back
        for w in wcs:
            w.encoder._local = False
    dense_bytes = plan.stats.total_bytes
    directories = sum(directory_bytes(op) for w in wcs for op in w.ops)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 51):
        absent = set()
        if step == 1:
            pass  # nothing sent before: dense
        elif step % 7 == 0:
            change(canon, g, 0.5)
        elif step % 11 == 0:
            pass  # nothing changed
        else:
            change(canon, g, 0.01)
        if step == 20:
            absent = {1}  # reader 1 misses this sync: the next one is dense to it
        if step == 33:
            # reader 2 is replaced by a fresh one (joined late): writers are told, send dense
            got[2] = reader_tensors(rs[2])
            rcs[2] = ReaderCodec(plan, 2, got[2], codecs)
            for w in wcs:
                w.policy.request_dense([2])
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        moved = run_sync(plan, wcs, rcs, step, absent=absent)
        assert_exact(rs, got, canon, skip=absent)
        if step == 1:
            assert moved > dense_bytes
        elif step % 11 == 0 and step != 33:
            assert moved == directories  # nothing changed: headers and directories only
        elif step % 7 != 0 and step not in (21, 33):
            assert moved < 0.25 * dense_bytes, (step, moved, dense_bytes)
    assert all(r.version == 50 for r in rcs)


def test_signed_zeros_and_nan_payloads_travel():
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for step in (1, 2):
        if step == 2:
            b = canon["b.weight"].view(-1)
            b[:5] = 0.0
            b.view(torch.int16)[5] = 0x7FC3
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        run_sync(plan, wcs, rcs, step)
    b = canon["b.weight"].view(-1)
    b[:5] = -0.0  # == 0.0 as numbers
    b.view(torch.int16)[5] = 0x7FC5  # another NaN
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    moved = run_sync(plan, wcs, rcs, 3)
    assert_exact(rs, got, canon)
    assert torch.signbit(got[0]["fused"][0, 0].float())
    directories = sum(directory_bytes(op) for w in wcs for op in w.ops)
    assert directories < moved <= directories + 128  # 6 elements of one route


def test_max_changed_fraction_sends_dense():
    sparse = CodecConfig(delta=DeltaConfig())
    dense_above = CodecConfig(delta=DeltaConfig(max_changed_fraction=0.001))
    moved = {}
    for name, codecs in (("auto", sparse), ("strict", dense_above)):
        plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
        g = torch.Generator().manual_seed(2)
        for step in (1, 2):
            if step == 2:
                change(canon, g, 0.02)
            for lay, t in zip(ws, live, strict=True):
                fill_from_canonical(lay, canon, t)
            moved[name] = run_sync(plan, wcs, rcs, step)
        assert_exact(rs, got, canon)
    assert moved["strict"] > 3 * moved["auto"]


def test_checksum_catches_changes_behind_the_codecs_back():
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for step in (1, 2):
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        run_sync(plan, wcs, rcs, step)
    got[1]["b"][3, 4] += 1.0  # the engine wrote into a tensor weightbus keeps in sync
    run_sync(plan, wcs, rcs, 3)  # unchanged weights: nothing is resent, nothing is checked
    for w in wcs:
        w.policy.request_checksum()
    with pytest.raises(
        WeightbusError, match=r"reader-1: bucket \d+ from writer \d+ .*b.weight.*checksum"
    ):
        run_sync(plan, wcs, rcs, 4)


def test_a_reader_without_the_base_version_refuses_a_delta():
    codecs = CodecConfig(delta=DeltaConfig())
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for step in (1, 2):
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        run_sync(plan, wcs, rcs, step)
    rcs[0] = ReaderCodec(plan, 0, reader_tensors(rs[0]), codecs)  # holds no version
    with pytest.raises(
        WeightbusError, match=r"reader-0: .*delta against version 2, but this reader holds None"
    ):
        run_sync(plan, wcs, rcs, 3)


def test_delta_on_one_side_only_is_refused():
    codecs = CodecConfig(delta=DeltaConfig())
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    plain = [WriterCodec(plan, i, live[i], CodecConfig()) for i in range(len(ws))]
    with pytest.raises(WeightbusError, match="not a delta bucket"):
        run_sync(plan, plain, rcs, 1)
    assert CodecConfig(delta=DeltaConfig()).digest() != CodecConfig().digest()
    # writer-side delta options do not have to match
    a = CodecConfig(delta=DeltaConfig(checksum_every=3, max_changed_fraction=0.1))
    assert a.digest() == codecs.digest()


def test_fp8_with_deltas_requantizes_changed_blocks_whole():
    cfg = Fp8Config()
    codecs = CodecConfig(fp8=cfg, delta=DeltaConfig(checksum_every=4))
    canon = canonical(4)
    ws, rsl = fsdp_writers(3), tp_readers()  # writers cut blocks, readers cut others
    wires_r = [wire_layout(r, codecs) for r in rsl]
    plan = make_plan(
        [wire_layout(w, codecs) for w in ws],
        wires_r,
        PlanOptions(bucket_bytes=16 << 10, direct_bytes=0),
    )
    live = [allocate(w) for w in ws]
    got = [allocate(r) for r in wires_r]
    wcs = [WriterCodec(plan, i, live[i], codecs, amax_reduce=in_process) for i in range(3)]
    rcs = [ReaderCodec(plan, i, got[i], codecs) for i in range(2)]
    dense_bytes = plan.stats.total_bytes
    g = torch.Generator().manual_seed(5)
    for step in range(1, 21):
        before = [{k: v.clone() for k, v in t.items()} for t in got]
        bump = step % 5 == 0
        if step > 1:
            for name in (W, Q):
                flat = canon[name].view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 200]
                flat[idx] = (flat[idx].float() * 1.01).to(torch.bfloat16)
            if bump:
                # raise the amax of block (0, 0) of W: the whole block re-quantizes
                blk = canon[W][:128, :128]
                i, j = divmod(int(blk.float().abs().argmax()), 128)
                blk[i, j] = blk[i, j] * 2
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        moved = run_sync(plan, wcs, rcs, step)
        want = expected_wire(canon, cfg)
        for lay, gt in zip(wires_r, got, strict=True):
            assert_reader_holds(lay, gt, want)
        if step > 1 and not bump:
            assert moved < 0.3 * dense_bytes, (step, moved, dense_bytes)
        if bump:
            # reader 0 holds W's columns 0..130: most of block (0, 0) changed its FP8 bytes
            old = before[0][W][:128, :128].view(torch.uint8)
            new = got[0][W][:128, :128].view(torch.uint8)
            assert float((old != new).float().mean()) > 0.5
            assert not torch.equal(
                before[0][W + "_scale_inv"][0, 0], got[0][W + "_scale_inv"][0, 0]
            )
    assert scale_name(W) in {t.name for t in plan.tensors}


def test_encoded_size_is_read_from_the_directory():
    codecs = CodecConfig(delta=DeltaConfig())
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    w = wcs[0]
    w.begin(1)
    op = w.ops[0]
    buf = torch.zeros(w.capacity(op), dtype=torch.uint8)
    used = w.pack(op, buf)
    assert encoded_size(buf[: directory_bytes(op)]) == used > directory_bytes(op)
    with pytest.raises(WeightbusError, match="not a delta bucket"):
        encoded_size(torch.zeros(directory_bytes(op), dtype=torch.uint8))


def test_units_are_words_where_the_region_allows():
    x = torch.zeros(6, 40, dtype=torch.bfloat16)
    assert _units(x)[0] == 8 and _units(x)[1].shape == (6, 10)
    assert _units(x[:, 4:12])[0] == 8  # rows of aligned words, strided
    assert _units(x[:, 2:12])[0] == 4
    assert _units(x[:, 1:12])[0] == 2  # odd start: elements
    assert _units(x.t())[0] == 2  # transposed: elements
    assert _units(torch.zeros(3, dtype=torch.float32))[0] == 4
    assert _units(torch.zeros((), dtype=torch.float32))[0] == 4
    assert _units(torch.zeros(5, dtype=torch.float8_e4m3fn).view(torch.uint8))[0] == 1


def test_word_frames_land_in_strided_and_element_only_readers():
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    g = torch.Generator().manual_seed(3)
    for step in (1, 2):
        if step == 2:
            change(canon, g, 0.01)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        run_sync(plan, wcs, rcs, step)
    assert_exact(rs, got, canon)
    # reader 1 holds a transposed tensor: the writer's 8-byte words arrive element by element
    ratios = {ratio for _, _, ratio in rcs[1].decoder._targets.values()}
    units = {u for (_, _, u) in rcs[1].decoder._targets}
    assert 8 in units and 4 in units and max(ratios) == 4
    # a live tensor whose storage the trainer replaced: the writer finds its regions again
    moved = live[0]["b.weight"]
    moved.data = moved.detach().clone()
    change(canon, g, 0.01)
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    run_sync(plan, wcs, rcs, 3)
    assert_exact(rs, got, canon)


class _OpCounter(TorchDispatchMode):
    """Counts aten ops: host syncs show up as nonzero and _local_scalar_dense (item, int)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_no_host_sync_per_route():
    """A sync waits for the device twice per window on the writer (one nonzero), once per
    bucket on the reader (its directory), whatever the number of routes."""
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, window_bytes=4096))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    run_sync(plan, wcs, rcs, 1)
    change(canon, torch.Generator().manual_seed(4), 0.01)
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    for w in wcs:
        w.begin(2)
    writer, reader = _OpCounter(), _OpCounter()
    w = wcs[0]
    by_bucket = {op.bucket: (rc, op) for rc in rcs for op in rc.ops}
    for rc in rcs:
        rc.begin(2)
    for op in w.ops:
        buf = torch.zeros(w.capacity(op), dtype=torch.uint8)
        with writer:
            w.pack(op, buf)
        rc, rop = by_bucket[op.bucket]
        with reader:
            rc.encoded_size(rop, buf)
            rc.unpack(rop, buf)
    routes = sum(len(op.copies) for op in w.ops)
    assert routes > 2 * len(w.encoder._windows) > 2
    assert writer.ops["nonzero"] == len(w.encoder._windows)
    assert writer.ops["_local_scalar_dense"] == 0 and reader.ops["_local_scalar_dense"] == 0
    assert reader.ops["nonzero"] == 0


def test_policy_rules():
    p = DeltaPolicy(DeltaConfig(checksum_every=3), num_readers=2)
    d = p.begin(1)
    assert d.dense == {0, 1} and d.base == (None, None) and not d.checksum
    p.sent(d)
    p.acknowledged(1, [0, 1])
    d = p.begin(2)
    assert d.dense == set() and d.base == (1, 1) and not d.checksum
    p.sent(d)
    p.acknowledged(2, [0])  # reader 1 did not confirm
    d = p.begin(3)
    assert d.dense == {1} and d.base == (2, None) and d.checksum  # third sync since a check
    p.sent(d)
    p.acknowledged(3, [0, 1])
    p.request_dense([0])
    p.request_checksum()
    d = p.begin(4)
    assert d.dense == {0} and d.checksum
    p.sent(d)
    p.acknowledged(4, [0, 1])
    p.begin(5)
    p.abandon()  # the sync failed part way
    assert p.begin(6).dense == {0, 1}
    with pytest.raises(ValueError, match="max_changed_fraction"):
        DeltaConfig(max_changed_fraction=0.0)
    with pytest.raises(ValueError, match="shadow"):
        DeltaConfig(shadow="disk")
    with pytest.raises(ValueError, match="window_bytes"):
        DeltaConfig(window_bytes=0)


def test_checksum_is_position_dependent():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=g)
    base = checksum(data)
    assert checksum(data.clone()) == base
    swapped = data.clone()
    swapped[[10, 50_000]] = swapped[[50_000, 10]]
    if swapped[10] != data[10]:
        assert checksum(swapped) != base
    tail = data.clone()
    tail[-1] ^= 1
    assert checksum(tail) != base
    assert checksum(data[1:]) != base
