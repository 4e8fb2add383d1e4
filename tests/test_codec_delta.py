"""Sparse deltas: bit exact over many steps and across resharding, with casts and with FP8;
the Triton kernels equal to the torch path in Triton's CPU interpreter (``pip install triton``;
run directly with ``TRITON_INTERPRET=1 python -m pytest tests/test_codec_delta.py -k interp_``)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.interp import INTERPRETER, run_interpreted
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
    _ENT,
    _HEAD,
    FLAG_AHEAD,
    FLAG_PIECES,
    FLAG_PLAIN,
    GROUP_ALIGN,
    MAGIC,
    MASKED,
    SPARSE,
    DeltaConfig,
    DeltaDecision,
    DeltaDecoder,
    DeltaEncoder,
    DeltaPolicy,
    _TorchWindow,
    capacity,
    checksum,
    directory_bytes,
    encoded_size,
    group_layout,
    group_pieces,
    piece_posts,
)
from weightbus.codecs.fp8 import Fp8Config, scale_name
from weightbus.errors import WeightbusError
from weightbus.plan import PlanOptions, allocate, fill_from_canonical, make_plan, poison
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, WriterCodec, run_sync, wire_layout
from weightbus.plan.program import BucketOp, Copy, pack
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


def unchanged_sync_bytes(rcs):
    """What travels when nothing changed: per reader's group, its directories (the first
    message); the second has no frames."""
    return sum(directory_bytes(op) for rc in rcs for op in rc.ops if rc.decoder is not None)


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


@pytest.mark.parametrize("window", [1, 3000, 1 << 30])
def test_a_windows_directories_travel_as_one_message_per_reader(window):
    """Writer and reader group the directories alike: one message per writer window and
    reader (per bucket for windows of one bucket), sent with the group's first bucket, and
    the reader decodes from it alone (run_sync gives each bucket's buffer only its frames)."""
    from weightbus.codecs.delta import window_index

    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, window_bytes=window))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    expected = set()
    for i, w in enumerate(wcs):
        index = window_index([op.nbytes for op in w.ops], window)
        expected |= {(op.peer, i, wi) for op, wi in zip(w.ops, index, strict=True)}
    groups = [(r, rc.group_of(op)) for r, rc in enumerate(rcs) for op in rc.ops]
    groups = [(r, g) for r, g in groups if g is not None]
    for r, g in groups:  # each group's directories laid out at connect, before any sync
        assert tuple(op.bucket for op in g.ops) in rcs[r].decoder._spans
    assert len(groups) == len(expected)  # one per (reader, writer, window) that has buckets
    if window == 1:
        assert len(groups) == len(plan.buckets)
    if window == 1 << 30:
        assert len(groups) == len({(op.peer, r) for r, rc in enumerate(rcs) for op in rc.ops})
        assert len(groups) < len(plan.buckets)
    for version, fraction in ((1, None), (2, 0.05), (3, 0.01)):
        if fraction is not None:
            change(canon, torch.Generator().manual_seed(version), fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        if version == 1:  # dense; later syncs are deltas against what readers hold
            for g in got:
                for x in g.values():
                    poison(x)
        run_sync(plan, wcs, rcs, version)  # checks the groups' sizes and the directories
        assert_exact(rs, got, canon)


def _group_at_sync_2(fraction: float = 0.02, masks: bool = False):
    """A reader's group of at least 3 buckets at sync 2 (``fraction`` changed, after a dense
    sync 1): (reader codec, group, its writer codec, the group's directories and frames as
    sent); every codec has begun sync 2, nothing of it applied yet."""
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, window_bytes=1 << 30, masks=masks))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for version in (1, 2):
        if version == 2:
            change(canon, torch.Generator().manual_seed(5), fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        if version == 1:
            run_sync(plan, wcs, rcs, 1)
    w_of = {op.bucket: (w, op) for w in wcs for op in w.ops}
    rc, members = next(
        (rc, g)
        for rc in rcs
        for g in (rc.group_of(op) for op in rc.ops)
        if g is not None and len(g.ops) >= 3
    )
    w, wop = w_of[members.ops[0].bucket]
    for c in (w, *rcs):
        c.begin(2)
    directories, rest = w.pack_group(wop, torch.zeros(w.group(wop).capacity, dtype=torch.uint8))
    assert [j for j, _ in rest] == [-1]  # (frames: one message)
    return rc, members, w, directories.numpy().tobytes(), rest[0][1]


def test_a_groups_directories_are_checked_before_anything_is_applied():
    """A group's directories are read at once: a bad entry, a wrong size or a short buffer in
    any of its buckets is refused naming that bucket and tensor, before a byte is applied,
    and the intact group still applies afterwards."""
    rc, members, w, raw, sent = _group_at_sync_2()
    w_of = {op.bucket: op for op in w.ops}
    before = {k: v.clone() for k, v in rc.tensors.items()}
    third = members.ops[2]
    at = sum(directory_bytes(op) for op in members.ops[:2])  # the third bucket's header
    tensor = third.copies[0].tensor

    def bad(raw, pattern, buf=None):
        buf = torch.zeros(members.capacity, dtype=torch.uint8) if buf is None else buf
        with pytest.raises(WeightbusError, match=pattern):
            rc.take_group(members, raw, buf)

    entry = bytearray(raw)
    entry[at + _HEAD.size] = 7  # the kind of the third bucket's first route
    bad(bytes(entry), rf"bucket {third.bucket} from writer \d+ .*{tensor}.*: frame of "
        rf"{tensor} is kind 7")  # fmt: skip
    used = bytearray(raw)
    _HEAD.pack_into(used, at, *(_HEAD.unpack_from(raw, at)[:4]), 10**6, 2, 1, 0)
    bad(bytes(used), rf"bucket {third.bucket} .*frames end at byte \d+, the header says 1000000")
    magic = bytearray(raw)
    magic[at] ^= 1
    bad(bytes(magic), rf"bucket {third.bucket} .*not a delta bucket of {len(third.copies)} routes")
    bad(raw[:-16], rf"bucket {members.ops[0].bucket} .*directories of {len(raw) - 16} bytes")
    small = torch.zeros(sent.numel() - 1, dtype=torch.uint8)
    bad(raw, f"has {sent.numel()} bytes of frames, the buffer holds {sent.numel() - 1}", small)
    for k, v in rc.tensors.items():  # nothing applied
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k
    buf = torch.zeros(members.capacity, dtype=torch.uint8)
    parts, n = rc.take_group(members, raw, buf)
    assert n == sent.numel() and len(parts) == len(members.ops)
    buf[:n] = sent
    with pytest.raises(RuntimeError, match="not taken for their frames in this buffer"):
        rc.unpack_group(parts, buf.clone())
    # a sparse frame's index beyond its route (the frames, not the directories, damaged)
    rc.take_group(members, raw, buf)
    d = rc.decoder._read[members.ops[0].bucket]
    j = int(np.flatnonzero(d.sparse & (d.count > 0) & (d.span.bucket > 0))[0])
    k = int(d.span.bucket[j])
    op, at = parts[k]
    tensor = op.copies[j - int(d.span.starts[k])].tensor
    units = int(d.span.nbytes[j]) // int(d.unit[j])
    bad = buf.clone()
    place = at + int(d.offset[j]) + (int(d.count[j]) - 1) * int(d.ix[j])
    bad[place : place + 4] = torch.tensor([units], dtype=torch.int32).view(torch.uint8)
    rc.take_group(members, raw, bad)
    with pytest.raises(
        WeightbusError, match=rf"bucket {op.bucket} .*sparse frame of {tensor} has index {units}"
    ):
        rc.unpack_group(parts, bad)
    for key, v in rc.tensors.items():  # nothing of the group applied
        assert torch.equal(v.view(torch.uint8), before[key].view(torch.uint8)), key
    rc.take_group(members, raw, buf)
    rc.unpack_group(parts, buf)
    changed = 0
    for op in members.ops:  # the group's buckets now hold version 2, as the writer packs them
        mine, theirs, old = (torch.zeros(op.nbytes, dtype=torch.uint8) for _ in range(3))
        pack(op, rc.tensors, mine)
        pack(w_of[op.bucket], w.live, theirs)
        pack(op, before, old)
        assert torch.equal(mine, theirs), op.bucket
        changed += not torch.equal(mine, old)
    assert changed


def damaged_mask_case(device: str, impl: str) -> None:
    """A group whose masked frame sets a bit more than its count of values, or a bit past its
    route's elements: the torch path refuses either before applying anything (the intact
    group then gives the writer's bytes); the apply kernels write only the route's elements
    (all of the group but that route right) and the reader's check then raises naming the
    tensor (a sync whose check failed leaves the next one dense)."""
    rc, members, w, raw, sent = _group_at_sync_2(0.3, masks=True)
    tensors = {k: v.to(device) for k, v in rc.tensors.items()}
    dec = DeltaDecoder(rc.ops, tensors, "r", impl=impl)
    buf = torch.zeros(members.capacity, dtype=torch.uint8, device=device)
    parts, n = dec.take_group(members.ops, raw, buf)
    buf[:n] = sent.to(device)
    d = dec._read[members.ops[0].bucket]
    assert not d.sparse.any()  # (at 30% changed every delta frame is masked)
    numels = d.span.nbytes // d.span.isz
    j = int(np.flatnonzero(d.masked & (d.count > 0) & (numels % 32 != 0))[0])
    k = int(d.span.bucket[j])
    op, at = parts[k]
    c = op.copies[j - int(d.span.starts[k])]
    numel = int(d.span.nbytes[j] // d.span.isz[j])
    start = at + int(d.offset[j])
    bits = np.unpackbits(buf[start : start + int(d.lead[j])].cpu().numpy(), bitorder="little")
    assert bits.sum() == d.count[j] and not bits[numel:].any()
    before = {k: v.clone() for k, v in tensors.items()}

    def damaged(bit: int) -> torch.Tensor:
        bad = buf.clone()
        bad[start + bit // 8] |= 1 << (bit % 8)
        dec.take_group(members.ops, raw, bad)
        return bad

    unset = int(np.flatnonzero(bits[:numel] == 0)[0])
    if impl == "torch":
        pattern = rf"masked frame of {c.tensor} sets {int(d.count[j]) + 1} bits \(0 past"
        with pytest.raises(WeightbusError, match=pattern):
            dec.decode_group(parts, damaged(unset), version=2, held=1)
        with pytest.raises(WeightbusError, match=rf"\(1 past its {numel} elements\)"):
            dec.decode_group(parts, damaged(numel), version=2, held=1)
        for key, v in tensors.items():  # nothing of the group applied
            assert torch.equal(v.view(torch.uint8), before[key].view(torch.uint8)), key
    w_of = {op.bucket: op for op in w.ops}

    def holds_writers(but=None) -> None:
        """The group's routes hold the writer's bytes, but route ``but``."""
        host = {k: v.cpu() for k, v in tensors.items()}
        for b, op in enumerate(members.ops):
            mine, theirs = (torch.zeros(op.nbytes, dtype=torch.uint8) for _ in range(2))
            pack(op, host, mine)
            pack(w_of[op.bucket], w.live, theirs)  # (wire bytes: casts done)
            for i, r in enumerate(op.copies):
                if (b, i) != but:
                    at = slice(r.offset, r.offset + r.nbytes)
                    assert torch.equal(mine[at], theirs[at]), (op.bucket, i)

    if impl != "torch":
        # a bit past the route's elements: not written (its neighbours in the storage keep
        # their bytes), the rest applied
        dec.decode_group(parts, damaged(numel), version=2, held=1)
        with pytest.raises(WeightbusError, match=rf"\d elements of delta frames \(of {c.tensor}"):
            dec.check()
        holds_writers()
        # a bit more than its values: the route is wrong, the others applied
        dec.decode_group(parts, damaged(unset), version=2, held=1)
        with pytest.raises(WeightbusError, match=rf"elements of delta frames \(of {c.tensor}"):
            dec.check()
        holds_writers(but=(k, j - int(d.span.starts[k])))
        return
    dec.take_group(members.ops, raw, buf)
    dec.decode_group(parts, buf, version=2, held=1)
    dec.check()
    holds_writers()


def test_a_damaged_masked_frame_is_refused_on_the_torch_path():
    damaged_mask_case("cpu", "torch")


def test_masked_frames_take_about_half_the_bytes_at_half_changed():
    """At 50% of the elements changed a bf16 route travels masked (a bit per element, then
    its changed values): about 9/16 of its dense bytes, bit exact across resharding, casts
    and strided regions; with masks off it goes dense."""
    moved = {}
    for masks in (True, False):
        codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, masks=masks))
        plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
        g = torch.Generator().manual_seed(8)
        for step in (1, 2, 3):
            if step > 1:
                change(canon, g, 0.5)
            for lay, t in zip(ws, live, strict=True):
                fill_from_canonical(lay, canon, t)
            moved[masks, step] = run_sync(plan, wcs, rcs, step)
            assert_exact(rs, got, canon)
        dense, fixed = plan.stats.total_bytes, unchanged_sync_bytes(rcs)
    # (fixed: the directories; the frames of these small routes also pad to 16 bytes, and
    # each bucket to GROUP_ALIGN: 62% here)
    for step in (2, 3):
        assert moved[True, step] - fixed < 0.65 * (moved[False, step] - fixed), moved
        assert moved[False, step] == moved[False, 1] > dense, moved


def damaged_index_case(device: str, impl: str) -> None:
    """A group whose sparse frame has an index just past its route (whose next element is
    another route's, in the same storage): the torch path refuses it before applying anything;
    the apply kernel writes everything else, not that element, and the reader's check then
    raises naming the tensor. Applying the intact group afterwards gives the writer's bytes
    everywhere: no element outside the damaged one was touched."""
    rc, members, w, raw, sent = _group_at_sync_2()
    tensors = {k: v.to(device) for k, v in rc.tensors.items()}
    before = {k: v.clone() for k, v in tensors.items()}
    dec = DeltaDecoder(rc.ops, tensors, "r", impl=impl)
    assert (dec._table is None) == (impl == "torch")
    buf = torch.zeros(members.capacity, dtype=torch.uint8, device=device)
    parts, n = dec.take_group(members.ops, raw, buf)
    buf[:n] = sent.to(device)
    d = dec._read[members.ops[0].bucket]
    sparse = np.flatnonzero(d.sparse & (d.count > 0) & (d.unit == d.span.isz))
    # a contiguous route with elements after it in its storage
    for j in sparse.tolist():
        k = int(d.span.bucket[j])
        op, at = parts[k]
        c = op.copies[j - int(d.span.starts[k])]
        region = tensors[c.key][c.index]
        if region.is_contiguous() and region.storage_offset() + region.numel() < (
            tensors[c.key].numel()
        ):
            break
    else:
        raise AssertionError("no sparse route with room after it")
    units = region.numel()
    bad = buf.clone()
    place = at + int(d.offset[j]) + (int(d.count[j]) - 1) * int(d.ix[j])
    index = torch.tensor([units], dtype=torch.int32 if d.ix[j] == 4 else torch.int64)
    bad[place : place + int(d.ix[j])] = index.view(torch.uint8).to(device)
    dec.take_group(members.ops, raw, bad)
    if impl == "torch":
        with pytest.raises(WeightbusError, match=rf"sparse frame of {c.tensor} has index {units}"):
            dec.decode_group(parts, bad, version=2, held=1)
        for key, v in tensors.items():  # nothing of the group applied
            assert torch.equal(v.view(torch.uint8), before[key].view(torch.uint8)), key
    else:
        dec.decode_group(parts, bad, version=2, held=1)
        with pytest.raises(
            WeightbusError,
            match=rf"bucket {op.bucket} .*1 elements of delta frames \(of {c.tensor} among",
        ):
            dec.check()
        dec.check()  # counted once
        changed = [k for k, v in tensors.items() if not torch.equal(v, before[k])]
        assert changed  # the rest was applied
        # a sync that failed before its check: the next one does not inherit its faults
        dec.take_group(members.ops, raw, bad)
        dec.decode_group(parts, bad, version=2, held=1)
        dec.begin()
    dec.take_group(members.ops, raw, buf)
    dec.decode_group(parts, buf, version=2, held=1)
    dec.check()
    w_of = {op.bucket: op for op in w.ops}
    group = {op.bucket for op in members.ops}
    host, old = ({k: v.cpu() for k, v in t.items()} for t in (tensors, before))
    for op in rc.ops:  # the group's buckets: the writer's bytes; the others: untouched
        mine, theirs = (torch.zeros(op.nbytes, dtype=torch.uint8) for _ in range(2))
        pack(op, host, mine)
        if op.bucket in group:
            pack(w_of[op.bucket], w.live, theirs)
        else:
            pack(op, old, theirs)
        assert torch.equal(mine, theirs), op.bucket
    assert len(group) < len(rc.ops)


def test_a_damaged_sparse_index_is_refused_on_the_torch_path():
    damaged_index_case("cpu", "torch")


def test_corrupt_group_directories_are_refused_or_stay_inside_the_buffer():
    """Bytes of a group's directories changed at random: reading them raises WeightbusError,
    never another exception, or (a field the frames' layout does not depend on: versions,
    checksums, reserved bytes) gives the intact bytes' layout, inside the group's second
    message, which fits the staging buffer. (Flips that change sizes consistently across
    the entries and the headers would be read as a new layout; random flips of a few bytes
    do not make one.)"""
    rc, members, _, raw, sent = _group_at_sync_2()
    buf = torch.zeros(members.capacity, dtype=torch.uint8)
    room = members.capacity
    first = members.ops[0].bucket
    intact_parts, _ = rc.take_group(members, raw, buf)
    intact = rc.decoder._read[first]
    flips = st.lists(
        st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=4
    )
    outcomes = collections.Counter()

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(flips)
    def check(flips):
        bad = bytearray(raw)
        for at, value in flips:
            bad[at] = value
        try:
            parts, n = rc.take_group(members, bytes(bad), buf)
        except WeightbusError:
            outcomes["refused"] += 1
            return
        outcomes["read"] += 1
        assert n <= room and n == sent.numel() and parts == intact_parts
        d = rc.decoder._read[first]
        for field in ("sparse", "masked", "offset", "lead", "count"):
            assert (getattr(d, field) == getattr(intact, field)).all(), field
        for k, (_, at) in enumerate(parts):
            assert at + d.frames[k] <= n
            mine = d.span.routes_of(k)
            delta, count = d.sparse[mine] | d.masked[mine], d.count[mine]
            size = np.where(delta, d.lead[mine] + count * d.unit[mine], d.span.nbytes[mine])
            assert (d.offset[mine] >= 0).all()
            assert (d.offset[mine] + size <= d.frames[k]).all()

    check()
    parts, n = rc.take_group(members, raw, buf)  # the intact bytes still read
    assert n == sent.numel() and outcomes["refused"] > 100 and outcomes["read"] > 0


@pytest.mark.parametrize(
    "variant",
    [
        "one window",
        "small windows",
        "small windows, one a pass",
        "shadow copied per window",
        "small windows, masks",
    ],
)
def test_bit_exact_over_50_steps_with_resharding(variant):
    small = variant.startswith("small windows")
    per_pass = 1 if variant.endswith("one a pass") else 2
    codecs = CodecConfig(
        delta=DeltaConfig(
            checksum_every=5,
            window_bytes=3000 if small else 1 << 30,
            windows_per_pass=per_pass,
            masks=variant.endswith("masks"),
        )
    )
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    if small:
        assert all(len(w.encoder._windows) > 2 for w in wcs)
    if variant == "shadow copied per window":
        # what a GPU writer with a host shadow does: compare against a copy, write it back
        for w in wcs:
            w.encoder._local = False
    dense_bytes = plan.stats.total_bytes
    fixed = unchanged_sync_bytes(rcs)
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
        elif step % 11 == 0 and step != 33 and step % 7 != 1:
            assert moved == fixed  # nothing changed: headers and directories only
        elif step % 7 > 1 and step not in (21, 33):
            # (after a 50% step, windows that went dense are sent dense once more while their
            # changes are counted; the sync after is sparse again)
            assert moved - fixed < 0.25 * dense_bytes, (step, moved, fixed, dense_bytes)
        elif step % 7 == 0 and step != 21 and variant.endswith("masks"):
            # 50% changed, masked: a bit per element and the changed values
            assert moved - fixed < 0.7 * dense_bytes, (step, moved, fixed, dense_bytes)
    assert all(r.version == 50 for r in rcs)


def test_groups_of_plain_buckets_are_sent_from_the_shadow(monkeypatch):
    """A group whose buckets all travel whole (dense) is sent straight from the writer's
    shadow, which lays out each group as its second message does; other groups from the
    staging buffer, in one copy (their plain buckets too). Windows holding buckets to
    several readers, readers bit exact."""
    plain_groups_case(monkeypatch, "torch", pieces=False)


def test_groups_of_plain_buckets_are_sent_as_pieces(monkeypatch):
    """With DeltaConfig.pieces, a group whose buckets all travel whole is sent as its
    pieces, from the writer's live tensors where a piece lies contiguous there (else
    staged), into the reader's where it does there (else staged and copied out); where a
    route's wire values are computed (a cast), from the writer's shadow. Other groups as
    without it; readers bit exact."""
    plain_groups_case(monkeypatch, "torch", pieces=True)


def plain_groups_case(monkeypatch, impl: str, pieces: bool) -> None:
    monkeypatch.setattr("weightbus.codecs.delta.PIECE_BYTES", 500)  # (small tensors here)
    codecs = CodecConfig(delta=DeltaConfig(window_bytes=6000, pieces=pieces))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for w in wcs:
        e = w.encoder
        w.encoder = DeltaEncoder(w.ops, codecs.delta, fill=e._fill, views=e._views, impl=impl)
    for r in rcs:
        r.decoder = DeltaDecoder(r.ops, r.tensors, r.name, impl=impl)
    assert any(len({bk.op.peer for bk in win}) > 1 for w in wcs for win in w.encoder._windows)
    for w in wcs:  # a group's staged pieces fit its plain layout, which a staging buffer holds
        for lay in w.encoder._layouts:
            for first, src in lay.pieces.items():
                group = w.encoder._group[first]
                plain = -(-group_layout([op.nbytes for op in group.ops])[1] // 16) * 16
                assert src is None or src.staged <= plain <= group.capacity
    kinds: list[tuple[str, bool]] = []  # per group: how it went, whether a route is cast
    mixed = []  # groups with plain and framed buckets
    from_live = collections.Counter()  # pieces sent from live tensors / staged
    live_storages = {t.untyped_storage().data_ptr() for lv in live for t in lv.values()}
    pack_group = WriterCodec.pack_group

    def spy(self, op, buf):
        directories, rest = pack_group(self, op, buf)
        group = self.group(op)
        raw, at, plain = directories.numpy().tobytes(), 0, set()
        for m in group.ops:
            plain.add(bool(_HEAD.unpack_from(raw, at)[2] & FLAG_PLAIN))
            at += directory_bytes(m)
        mixed.append(len(plain) == 2)
        cast = any(c.tensor == "a.weight" for m in group.ops for c in m.copies)
        where = [m.untyped_storage().data_ptr() for _, m in rest]
        staging = buf.untyped_storage().data_ptr()
        if _HEAD.unpack_from(raw, 0)[2] & FLAG_PIECES:
            assert plain == {True} and not cast
            assert [j for j, _ in rest] == list(range(len(group.pieces)))
            assert [m.numel() for _, m in rest] == [p.nbytes for p in group.pieces]
            assert set(where) <= live_storages | {staging}
            from_live.update(w in live_storages for w in where)
            kinds.append(("pieces", cast))
        else:
            assert [j for j, _ in rest] == [-1]
            assert where[0] in (staging, self.encoder.shadow.untyped_storage().data_ptr())
            kinds.append(("buf" if where[0] == staging else "shadow", cast))
        return directories, rest

    monkeypatch.setattr(WriterCodec, "pack_group", spy)
    g = torch.Generator().manual_seed(3)
    # dense (nothing sent before), 1% changed (frames), every element changed (dense again,
    # and so is the next sync, while the changes are counted), then one tensor wholly and the
    # others 1% (groups of plain and framed buckets)
    steps = [(1, 0.0, True), (2, 0.01, False), (3, 1.0, True), (4, "a.weight", True)]
    steps.append((5, "a.weight", None))  # (groups of a.weight's buckets alone: plain)
    for step, fraction, dense in steps:
        if fraction == "a.weight":
            change({"a.weight": canon["a.weight"]}, g, 1.0)
            change({t: v for t, v in canon.items() if t != "a.weight"}, g, 0.01)
        elif fraction:
            change(canon, g, fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        if dense:  # every byte travels: a missed one fails
            for r in got:
                for t in r.values():
                    poison(t)
        kinds.clear()
        mixed.clear()
        run_sync(plan, wcs, rcs, step)
        assert_exact(rs, got, canon)
        if dense and pieces:  # as pieces, but groups with a cast route: from the shadow
            assert kinds and all(k == ("shadow" if cast else "pieces") for k, cast in kinds)
            assert {k for k, _ in kinds} == {"shadow", "pieces"}
        elif dense:
            assert kinds and {k for k, _ in kinds} == {"shadow"}
        elif dense is False:
            assert kinds and {k for k, _ in kinds} == {"buf"}
        assert any(mixed) == (step == 5), (step, mixed)
    if not pieces:
        assert not from_live and not any(r.decoder._landing for r in rcs)
        return
    assert from_live[True] and from_live[False]  # some pieces in place on the writer, some not
    landed = np.concatenate([x[2] for r in rcs for x in r.decoder._landing.values()])
    assert landed.any() and not landed.all()  # and on the readers


def test_a_groups_pieces_are_its_large_routes_alone_and_the_small_ones_together(monkeypatch):
    """group_pieces: each route of at least PIECE_BYTES is a piece of its own, the smaller
    ones between two such travel together (with the padding between them, across buckets),
    empty routes are left out; the pieces tile the group's plain layout in order, and both
    sides post them in the same groups of PIECES_PER_POST."""
    monkeypatch.setattr("weightbus.codecs.delta.PIECE_BYTES", 100)
    bf = torch.bfloat16

    def op(bucket, sizes):
        copies, at = [], 0
        for n in sizes:
            copies.append(
                Copy(
                    key="k",
                    index=(slice(0, n // 2),),
                    shape=(n // 2,),
                    offset=at,
                    nbytes=n,
                    dtype=bf,
                    tensor=f"t{bucket}.{at}",
                )
            )
            at += n + (16 if n else 0)  # (the plan aligns routes: some padding between)
        return BucketOp(bucket=bucket, peer=0, peer_global=1, wave=0, nbytes=at, copies=copies)

    ops = [op(3, [40, 200, 0, 20, 30]), op(4, [60, 100, 8]), op(5, [300])]
    pieces = group_pieces(ops)
    starts = group_layout([o.nbytes for o in ops])[0]
    s0, s1, s2 = starts
    assert [(p.routes, p.at, p.nbytes) for p in pieces] == [
        (((0, 0),), s0, 40),
        (((0, 1),), s0 + 56, 200),
        (((0, 3), (0, 4), (1, 0)), s0 + 272, s1 + 60 - (s0 + 272)),  # across buckets
        (((1, 1),), s1 + 76, 100),
        (((1, 2),), s1 + 192, 8),  # (alone: a large route follows)
        (((2, 0),), s2, 300),
    ]
    for p in pieces:  # each covers its routes exactly, first to last, in the plain layout
        (k0, i0), (k1, i1) = p.routes[0], p.routes[-1]
        assert p.at == starts[k0] + ops[k0].copies[i0].offset
        last = ops[k1].copies[i1]
        assert p.at + p.nbytes == starts[k1] + last.offset + last.nbytes
    assert all(a.at + a.nbytes <= b.at for a, b in zip(pieces, pieces[1:], strict=False))
    posts = piece_posts(list(pieces) * 5)
    assert [list(r) for r in posts] == [list(range(a, min(a + 8, 30))) for a in (0, 8, 16, 24)]


def test_windows_that_went_dense_are_sent_dense_until_they_would_not():
    """A window whose every route went dense is sent dense the next sync without an emit pass
    (its changes are still counted); once they are few, it is compared and sparse again."""
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    dense_bytes = plan.stats.total_bytes
    g = torch.Generator().manual_seed(3)
    moved = {}
    for step, fraction in ((1, 0.0), (2, 0.98), (3, 0.98), (4, 0.01), (5, 0.01)):
        if fraction:
            change(canon, g, fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        moved[step] = run_sync(plan, wcs, rcs, step)
        assert_exact(rs, got, canon)
        guessed = [set(w.encoder._dense) for w in wcs]
        if step in (2, 3):  # every route went dense (or was sent so): dense next time
            assert all(guessed) and all(
                len(s) == len(w.encoder._windows) for s, w in zip(guessed, wcs, strict=True)
            )
        if step == 4:  # sent dense, but its counts say few changed: compared next time
            assert not any(guessed)
    assert moved[3] > dense_bytes and moved[4] > dense_bytes
    assert moved[5] - unchanged_sync_bytes(rcs) < 0.25 * dense_bytes


def test_the_next_groups_directories_go_ahead_when_ready_without_the_device(monkeypatch):
    """A group's directories announce (FLAG_AHEAD) that the next group's to the same reader
    travel before this group's buckets when they are ready without waiting for the device:
    analyzed in the same pass, or of a window sent dense (first sync, or a window whose
    routes all went dense last time). run_sync checks that the reader expects what the writer
    sends and that the directories sent ahead equal the group's."""
    # two windows a pass (one is the default): next groups in the same pass and in the next
    delta = DeltaConfig(checksum_every=0, window_bytes=3000, windows_per_pass=2)
    codecs = CodecConfig(delta=delta)
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    went: list = []
    real = WriterCodec.ahead

    def ahead(self, op):
        nxt = real(self, op)
        went.append((self.encoder, op.bucket, nxt is not None))
        return nxt

    monkeypatch.setattr(WriterCodec, "ahead", ahead)
    g = torch.Generator().manual_seed(4)
    for step, fraction in ((1, 0.0), (2, 0.98), (3, 0.98), (4, 0.01), (5, 0.01)):
        if fraction:
            change(canon, g, fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, canon, t)
        went.clear()
        run_sync(plan, wcs, rcs, step)
        assert_exact(rs, got, canon)
        following = [(enc, b, a) for enc, b, a in went if b in enc._next]
        assert following and not any(a for enc, b, a in went if b not in enc._next)
        same_pass = [enc._window_of[b] == enc._window_of[enc._next[b]] for enc, b, _ in following]
        assert any(same_pass) and not all(same_pass)  # (so both cases are seen)
        if step in (1, 3, 4):  # every window sent dense: every next group goes ahead
            assert all(a for _, _, a in following), step
        else:  # compared: the next group goes ahead only from its own pass
            assert [a for _, _, a in following] == same_pass, step


def test_a_reader_refuses_directories_announced_ahead_after_a_writers_last_group():
    """FLAG_AHEAD on a writer's last group to a reader (a peer that disagrees on the plan)
    is refused, naming the bucket; on another group it names the next group."""
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, window_bytes=3000))
    plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    run_sync(plan, wcs, rcs, 1)
    w_of = {op.bucket: (w, op) for w in wcs for op in w.ops}
    for c in (*wcs, *rcs):
        c.begin(2)
    rc = rcs[0]
    starts = [op for op, _ in rc.group_starts()]
    last = next(op for op in starts if rc.next_group(op) is None)
    middle = next(op for op in starts if rc.next_group(op) is not None)
    for rop in (middle, last):
        w, wop = w_of[rop.bucket]
        members = rc.group_of(rop)
        directories, _ = w.pack_group(wop, torch.zeros(members.capacity, dtype=torch.uint8))
        raw = bytearray(directories.numpy().tobytes())
        raw[8] |= FLAG_AHEAD  # the group's first header's flags
        rc.take_group(members, bytes(raw), torch.zeros(members.capacity, dtype=torch.uint8))
        if rop is middle:
            assert rc.ahead(rop) == rc.next_group(rop)
        else:
            with pytest.raises(WeightbusError, match=rf"bucket {rop.bucket} from writer .*last"):
                rc.ahead(rop)


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
    fixed = unchanged_sync_bytes(rcs)
    # 6 elements of one route, and its group's buckets shifted by at most the alignment
    assert fixed <= moved <= fixed + 128 + GROUP_ALIGN


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


def test_element_frames_land_in_strided_readers():
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
    # reader 1 holds a transposed tensor: element frames land through its strides
    targets = rcs[1].decoder._targets
    assert {u for (_, _, u) in targets} == {2}
    assert any(flat is None for flat, _, _ in targets.values())
    # a live tensor whose storage the trainer replaced: the writer finds its regions again
    moved = live[0]["b.weight"]
    moved.data = moved.detach().clone()
    change(canon, g, 0.01)
    for lay, t in zip(ws, live, strict=True):
        fill_from_canonical(lay, canon, t)
    run_sync(plan, wcs, rcs, 3)
    assert_exact(rs, got, canon)


def word_frame_bucket(old: torch.Tensor, new: torch.Tensor, version: int):
    """A bucket of one bf16 route whose sparse frame has 8-byte units (4 elements each), as
    a writer comparing words sends it: (its op, its bytes)."""
    copy = Copy(
        key="t", index=(slice(0, old.shape[0]), slice(0, old.shape[1])), shape=tuple(old.shape),
        offset=0, nbytes=old.numel() * 2, dtype=torch.bfloat16, tensor="t.weight",
    )  # fmt: skip
    op = BucketOp(bucket=0, peer=0, peer_global=0, wave=0, nbytes=copy.nbytes, copies=(copy,))
    a, b = old.contiguous().view(torch.int64).view(-1), new.contiguous().view(torch.int64).view(-1)
    idx = (a != b).nonzero().view(-1)
    n, head = len(idx), directory_bytes(op)
    at = head + -(-n * 4 // 16) * 16
    used = at + n * 8
    buf = torch.zeros(capacity(op), dtype=torch.uint8)
    meta = bytearray(head)
    _HEAD.pack_into(meta, 0, MAGIC, 1, 0, 0, used, version, version - 1, 0)
    _ENT.pack_into(meta, _HEAD.size, SPARSE, 2, 4, 8, 0, n)
    buf[:head] = torch.frombuffer(meta, dtype=torch.uint8)
    buf[head : head + n * 4] = idx.to(torch.int32).view(torch.uint8)
    buf[at:used] = b[idx].view(torch.uint8)
    return op, buf


@pytest.mark.parametrize("target", ["contiguous", "transposed"])
def test_readers_accept_frames_of_words(target, impl="torch"):
    g = torch.Generator().manual_seed(6)
    old = torch.randn(6, 40, generator=g).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[torch.randperm(240, generator=g)[:9]] = -0.0
    op, buf = word_frame_bucket(old, new, version=2)
    t = old.clone() if target == "contiguous" else old.t().contiguous().t()
    dec = DeltaDecoder([op], {"t": t}, impl=impl)
    assert encoded_size(buf[: directory_bytes(op)]) < op.nbytes
    dec.decode(op, buf, version=2, held=1)
    assert torch.equal(t.view(torch.int16), new.view(torch.int16))


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
    with pytest.raises(ValueError, match="compare_ahead"):
        DeltaConfig(compare_ahead=0)


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


# ---------------------------------------------------------------------------------------------
# the Triton kernels against the torch path: in Triton's CPU interpreter here (a child pytest,
# since the interpreter must be on before triton is first imported), on CUDA in
# test_delta_gpu.py
# ---------------------------------------------------------------------------------------------

interpreted = pytest.mark.skipif(
    not INTERPRETER, reason="runs under TRITON_INTERPRET=1 (test_triton_kernels_in_the_interpreter)"
)

# writer tensors of every element size, contiguous, transposed, 3-D and 4-D
WRITER_TENSORS = {
    "w16": lambda g: torch.randn(40, 70, generator=g).to(torch.bfloat16),
    "wt": lambda g: torch.randn(50, 30, generator=g).t(),
    "w3": lambda g: torch.randn(3, 9, 33, generator=g).to(torch.bfloat16),
    "w8": lambda g: torch.randint(0, 256, (64, 40), dtype=torch.uint8, generator=g),
    "w64": lambda g: torch.randn(20, 12, dtype=torch.float64, generator=g),
    "w4d": lambda g: torch.randn(2, 3, 5, 7, generator=g).to(torch.float16),
    "wr": lambda g: torch.randn(6, 300, generator=g).to(torch.bfloat16),
}


def _box(shape, g, empty: bool) -> tuple[slice, ...]:
    out = []
    for n in shape:
        a = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(a + 1, n + 1, (1,), generator=g))
        out.append(slice(a, b))
    if empty:
        out[0] = slice(out[0].start, out[0].start)
    return tuple(out)


def _target(shape, dtype, g, device) -> torch.Tensor:
    """A reader's live region of ``shape``: contiguous, inside a larger tensor, or transposed."""
    kind = int(torch.randint(0, 3, (1,), generator=g))
    if kind == 0 or not shape:
        return torch.empty(shape, dtype=dtype, device=device)
    if kind == 1:
        t = torch.empty([n + 2 for n in shape], dtype=dtype, device=device)
        return t[tuple(slice(1, 1 + n) for n in shape)]
    t = torch.empty(tuple(reversed(shape)), dtype=dtype, device=device)
    return t.permute(*reversed(range(len(shape))))


class RandomRoutes:
    """Buckets of random routes between random writer regions and reader regions, for two
    readers (peers 0 and 1); some buckets are computed (filled), not live views."""

    def __init__(self, seed: int, n_buckets: int = 9, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.writer = {k: make(g).to(device) for k, make in WRITER_TENSORS.items()}
        self.w_ops, self.r_ops, self.targets = [], [], {}
        for b in range(n_buckets):
            copies, rcopies, at = [], [], 0
            for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
                key = list(self.writer)[int(torch.randint(0, len(self.writer), (1,), generator=g))]
                t = self.writer[key]
                empty = bool(torch.rand(1, generator=g) < 0.1)
                index = _box(t.shape, g, empty)
                region = t[index]
                n = region.numel() * region.element_size()
                name = f"r{len(self.targets)}"
                self.targets[name] = (tuple(region.shape), region.dtype)
                common = dict(shape=tuple(region.shape), offset=at, nbytes=n, dtype=region.dtype)
                copies.append(Copy(key=key, index=index, tensor=name, **common))
                full = tuple(slice(0, k) for k in region.shape)
                rcopies.append(Copy(key=name, index=full, tensor=name, **common))
                at += -(-n // 256) * 256
            peer = b % 2
            op = dict(bucket=b, wave=0, nbytes=max(at, 256))
            self.w_ops.append(BucketOp(peer=peer, peer_global=2 + peer, copies=tuple(copies), **op))
            self.r_ops.append(BucketOp(peer=0, peer_global=0, copies=tuple(rcopies), **op))
        self.filled = {op.bucket for op in self.w_ops if op.bucket % 3 == 2}
        self._views = {
            op.bucket: tuple(self.writer[c.key][c.index] for c in op.copies) for op in self.w_ops
        }
        self.device = device

    def reader_tensors(self, seed: int) -> dict[str, torch.Tensor]:
        """Fresh, poisoned live regions for the routes (the same strides for the same seed)."""
        g = torch.Generator().manual_seed(seed)
        out = {k: _target(shape, dt, g, self.device) for k, (shape, dt) in self.targets.items()}
        for t in out.values():
            poison(t)
        return out

    def fill(self, op: BucketOp, out: torch.Tensor) -> None:
        pack(op, self.writer, out)

    def views(self, op: BucketOp):
        return None if op.bucket in self.filled else self._views[op.bucket]

    def change(self, fraction: float) -> None:
        """Change ``fraction`` of every writer tensor's elements: new values, NaN payloads,
        signed zeros."""
        for t in self.writer.values():
            bits = t.view(_bits_dtype(t))
            flat = bits.reshape(-1) if bits.is_contiguous() else None
            n = int(fraction * t.numel())
            if not n:
                continue
            idx = torch.randperm(t.numel(), generator=self.g)[:n]
            vals = torch.randint(-(2**15), 2**15, (n,), generator=self.g).to(bits.dtype)
            if t.is_floating_point():
                vals[::7] = 0  # +0.0 where -0.0 may have been, and the reverse below
                vals[1::7] = torch.tensor(-0.0, dtype=t.dtype).view(bits.dtype)
            if flat is None:
                tmp = bits.contiguous()
                tmp.view(-1)[idx.to(tmp.device)] = vals.to(tmp.device)
                bits.copy_(tmp)
            else:
                flat[idx.to(flat.device)] = vals.to(flat.device)

    def assert_readers_hold(self, tensors: dict, peers=(0, 1)) -> None:
        for wop, rop in zip(self.w_ops, self.r_ops, strict=True):
            if wop.peer not in peers:
                continue
            for wc, rc in zip(wop.copies, rop.copies, strict=True):
                want = self.writer[wc.key][wc.index]
                have = tensors[rc.key]
                assert torch.equal(have.view(_bits_dtype(have)), want.view(_bits_dtype(want))), (
                    wop.bucket,
                    wc.key,
                    wc.index,
                )


def _bits_dtype(t: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def kernels_equal_torch(
    seed: int, device: str, window: int, host_copy: bool, shadow: str = "device"
) -> None:
    """The same syncs through the torch path and the Triton path: every encoded bucket equal
    byte for byte (the Triton path's stores poisoned first), the shadows equal, both readers
    bit exact after every sync. ``host_copy``: compare through a copy of the shadow per
    window, as a GPU writer with a host shadow does."""
    rr = RandomRoutes(seed, device=device)
    cfg = DeltaConfig(window_bytes=window, shadow=shadow, masks=True)
    enc = {
        impl: DeltaEncoder(
            rr.w_ops, cfg, fill=rr.fill, views=rr.views, device=device, impl=impl, name=impl
        )
        for impl in ("torch", "triton")
    }
    assert len(enc["triton"]._windows) > 1 or window > 1 << 20
    assert not any(isinstance(lay.table, _TorchWindow) for lay in enc["triton"]._layouts)
    # the Triton path zeros only what its emit pass does not write: a byte it misses shows
    enc["triton"]._poison_stores = True
    if host_copy:
        for e in enc.values():
            e._local = False  # a GPU writer's host shadow: compared through a copy per window
    tensors = {impl: rr.reader_tensors(seed) for impl in enc}
    dec = {impl: DeltaDecoder(rr.r_ops, tensors[impl], impl, impl=impl) for impl in enc}
    assert dec["triton"]._table is not None and dec["torch"]._table is None
    held: list[int | None] = [None, None]
    # changed fraction, readers sent dense (the first sync: both)
    steps = [(1, None), (0.01, None), (0.0, None), (0.5, {1}), (1.0, None)]
    kinds: collections.Counter = collections.Counter()
    for v, (fraction, dense) in enumerate(steps, start=1):
        if fraction:
            rr.change(fraction)
        dense = {0, 1} if v == 1 else (dense or set())
        decision = DeltaDecision(
            version=v,
            dense=frozenset(dense),
            base=tuple(None if p in dense else held[p] for p in (0, 1)),
            checksum=v % 3 == 0,
        )
        for e in enc.values():
            e.begin(decision)
        for wop, rop in zip(rr.w_ops, rr.r_ops, strict=True):
            bufs = {}
            for impl, e in enc.items():
                buf = torch.randint(0, 256, (capacity(wop),), dtype=torch.uint8, device=device)
                bufs[impl] = (buf, e.encode(wop, buf))
            (a, na), (b, nb) = bufs["torch"], bufs["triton"]
            assert na == nb and torch.equal(a[:na], b[:nb]), (v, wop.bucket)
            kinds.update((v, a[_HEAD.size + _ENT.size * i].item()) for i in range(len(wop.copies)))
            for impl, (buf, _) in bufs.items():
                dec[impl].decode(rop, buf, version=v, held=held[wop.peer])
        for e in enc.values():
            e.end()
        held = [v, v]
        assert torch.equal(enc["torch"].shadow, enc["triton"].shadow)
        for impl in enc:
            rr.assert_readers_hold(tensors[impl])
    # every kind of frame was compared: sparse at 1%, masked at 50%
    assert kinds[2, SPARSE] and kinds[4, MASKED], kinds


@interpreted
@pytest.mark.parametrize(
    "seed,window,host_copy,wide,tiles,lanes",
    [
        (0, 1500, False, False, None, None),
        (1, 4000, True, True, None, None),
        (2, 2500, False, False, 4, None),
        (3, 2500, False, False, None, 32),
    ],
)
def test_interp_kernels_equal_the_torch_path(
    seed, window, host_copy, wide, tiles, lanes, monkeypatch
):
    """``tiles``: programs of that many tiles (compare, and emit by steps), every window
    emitted by steps (also at 50% changed, and its dense frames' tiles). ``lanes``: the
    kernels with a lane per element take that many elements at a time (:data:`LANES`), so
    that their loops over a tile (4 steps) and over a masked apply's program (32) carry
    places and values from step to step."""
    from weightbus.codecs import _delta_triton, delta

    # small tiles: routes of many tiles, rows split in tiles, all three addressing modes
    monkeypatch.setattr(_delta_triton, "BLOCK", 128)
    if lanes:
        monkeypatch.setattr(_delta_triton, "LANES", lanes)
    if wide:  # 8-byte indices from 300 elements up, as for routes of 2**31 elements or more
        monkeypatch.setattr(delta, "_WIDE", 300)
    if tiles:  # (a launch's last program may hold fewer)
        monkeypatch.setattr(_delta_triton, "COMPARE", (tiles, 4))
        monkeypatch.setattr(_delta_triton, "EMIT_STEPS", (tiles, 2))
        monkeypatch.setattr(_delta_triton, "STEPS_BELOW", 1.1)
    kernels_equal_torch(seed, "cpu", window, host_copy)


@interpreted
@pytest.mark.parametrize("pieces", [False, True])
def test_interp_groups_of_plain_buckets(monkeypatch, pieces):
    """As test_groups_of_plain_buckets_are_sent_from_the_shadow and _as_pieces, on the
    Triton path: plain buckets of groups with framed ones are written whole by the emit
    pass, and pieces staged on a reader are copied out by the apply kernel."""
    plain_groups_case(monkeypatch, "triton", pieces)


@interpreted
def test_interp_the_apply_kernel_skips_and_reports_indices_outside_their_route():
    damaged_index_case("cpu", "triton")


@interpreted
def test_interp_the_apply_kernels_report_masked_frames_whose_bits_disagree():
    damaged_mask_case("cpu", "triton")


def aligned_routes_case(device: str) -> None:
    """Routes whose new values and shadow bytes start at 16-byte boundaries (and whose
    element counts, per route or per contiguous row, and row strides are multiples of 16)
    take the ALIGNED or ALIGNED_ROWS compare; the others, and every route when the shadow's
    window itself starts off a boundary, the general one. Either way the counts, the frames
    (into a poisoned store) and the shadow equal the torch path's, through a compare with the
    bitmask and one that only brings the shadow up to date."""
    from weightbus.codecs import _delta_triton as k

    g = torch.Generator().manual_seed(5)

    def bf16(*shape):
        x = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g)
        return x.view(torch.bfloat16).to(device)

    flat, grid = bf16(6000), bf16(16, 512)
    # aligned, off a boundary by one element, a count not a multiple of 16, aligned again;
    # rows: aligned (208 of 512 columns from column 128: a tile and part of one per row), and
    # off a boundary
    regions = [flat[0:512], flat[9:265], flat[1024:1124], flat[2048:3648]]
    regions += [grid[:, 128:336], grid[2:9, 3:259]]
    routes, at = [], 0
    for x in regions:
        routes.append((x, tuple(x.shape), 2, x.numel(), 0, at))
        at += -(-x.numel() * 2 // 16) * 16
    routes.append((None, (300,), 2, 300, 64, at))  # computed into the window's scratch
    at += 600
    table = k.WindowTable(routes, torch.device(device), 128)
    modes = {m for _, m, _, _ in table.groups}
    assert {k.ALIGNED, k.ALIGNED_ROWS, k.CONTIG, k.ROWS} <= modes, table.groups
    torch_table = _TorchWindow(routes, torch.device(device))
    scratch = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=g).to(device)
    news = [*regions, scratch[64:664].view(torch.bfloat16)]
    for shift in (0, 2):  # the window's shadow bytes at a 16-byte boundary, then 2 bytes off
        shadow = torch.zeros(at + 16, dtype=torch.uint8, device=device)
        work0 = shadow[shift : shift + at]
        for x, (*_, old_at) in zip(news, routes, strict=True):
            work0[old_at : old_at + x.numel() * 2].view(torch.bfloat16).view(x.shape).copy_(x)
        # 3% of the elements change (by their bits), and every route's first and last ones
        for t in (flat, grid, scratch[64:664].view(torch.bfloat16)):
            flip = (torch.rand(t.shape, generator=g) < 0.03).to(device)
            t.view(torch.int16)[flip] ^= 0x0101
        for x in news:
            x16 = x.view(torch.int16)
            x16[(0,) * x.dim()] ^= 1
            x16[tuple(n - 1 for n in x.shape)] ^= 1
        outs = {}
        for name, tab in (("torch", torch_table), ("kernels", table)):
            work = work0.clone() if shift == 0 else shadow.clone()[shift : shift + at]
            state = tab.compare(work, scratch, False)
            counts, state = tab.counts(state)
            sizes = np.array([r[3] * 2 for r in routes])
            plan = np.zeros((len(routes), 4), np.int64)
            plan[:, 0] = np.where(np.arange(len(routes)) % 2 == 0, 1, 2)  # sparse, dense
            plan[:, 1] = np.cumsum(sizes * 4) - sizes * 4
            plan[:, 2] = plan[:, 1] + sizes * 2
            plan[:, 3] = 4
            store = torch.full((int(sizes.sum() * 4),), 0xA5, dtype=torch.uint8, device=device)
            tab.emit(state, work, scratch, plan, store, int(counts.sum()))
            updated = work0.clone() if shift == 0 else shadow.clone()[shift : shift + at]
            tab.compare(updated, scratch, True)
            outs[name] = (counts, store.cpu(), work.cpu(), updated.cpu())
        (c0, s0, w0, u0), (c1, s1, w1, u1) = outs["torch"], outs["kernels"]
        assert np.array_equal(c0, c1) and (c0 >= 2).all(), (c0, c1)
        assert torch.equal(s0, s1), shift
        assert torch.equal(w0, w1) and torch.equal(u0, u1) and torch.equal(w1, u1), shift


@interpreted
def test_interp_aligned_routes_take_the_aligned_compare():
    aligned_routes_case("cpu")


def test_a_window_sent_dense_copies_its_routes_into_the_shadow():
    """``_byte_runs``: contiguous routes become byte runs (merged where they follow each other
    in the shadow and in one storage), strided ones stay regions, and the copies leave the
    shadow holding every route's bytes at its offset; a computed route: no copies."""
    from weightbus.codecs.delta import _byte_runs, _copy_runs

    a = torch.randn(100).to(torch.bfloat16)
    b = torch.randn(6, 10)
    routes = [
        (a[:40], (40,), 2, 40, 0, 0),
        (a[40:], (60,), 2, 60, 0, 80),  # follows the first on both sides
        (b[:, 2:7], (6, 5), 4, 30, 0, 208),
        (b[1], (10,), 4, 10, 0, 336),
        (b[2], (10,), 4, 10, 0, 384),  # follows in the storage, not in the shadow
    ]
    runs = _byte_runs(routes)
    assert [(at, src.is_contiguous(), src.numel() * src.element_size()) for at, src in runs] == [
        (0, True, 200), (208, False, 120), (336, True, 40), (384, True, 40)
    ]  # fmt: skip
    work = torch.full((432,), 0xFF, dtype=torch.uint8)
    _copy_runs(work, runs)
    for new, shape, width, numel, _, at in routes:
        got = work[at : at + width * numel].view(new.dtype).view(shape)
        assert torch.equal(got.view(torch.uint8), new.contiguous().view(torch.uint8))
    assert _byte_runs([*routes, (None, (4,), 2, 4, 0, 424)]) is None


@interpreted
def test_interp_a_sample_compares_every_sampleth_tile_of_each_route(monkeypatch):
    """``WindowTable.sample`` (the tally of a window sent dense on a guess) compares tiles 0,
    SAMPLE, 2 SAMPLE, ... of every route, in each addressing mode: with every element changed
    its counts are the elements of those tiles (a row's or route's last tile holds fewer; a
    route of one tile is compared whole), those tiles' new values and no others are then in
    the shadow, and a second sample counts nothing."""
    from weightbus.codecs import _delta_triton as k

    monkeypatch.setattr(k, "SAMPLE", 4)
    block = 128
    g = torch.Generator().manual_seed(0)
    regions = {
        k.ALIGNED: torch.randn(1024, generator=g).to(torch.bfloat16),
        k.CONTIG: torch.randn(1000, generator=g).to(torch.bfloat16),
        k.ROWS: torch.randn(40, 300, generator=g)[:, 20:290],  # float32, 3 tiles a row
        k.FLAT: torch.randn(30, 40, generator=g).to(torch.bfloat16)[:, :10],
        -1: torch.randn(50, generator=g).to(torch.bfloat16),  # one tile
    }
    ints = {2: torch.int16, 4: torch.int32}
    routes, at = [], 0
    for v in regions.values():
        routes.append((v, tuple(v.shape), v.element_size(), v.numel(), 0, at))
        at += -(-v.numel() * v.element_size() // 16) * 16
    work = torch.zeros(at, dtype=torch.uint8)

    def shadow(r):
        v, _, isz, n, _, o = r
        return work[o : o + n * isz].view(ints[isz])

    def bits(v):
        return v.contiguous().view(-1).view(ints[v.element_size()])

    for r in routes:
        shadow(r).copy_(~bits(r[0]))  # every element differs from the shadow
    table = k.WindowTable(routes, torch.device("cpu"), block)
    modes = {int(m) for _, m, _, _ in table.groups}
    assert {k.ALIGNED, k.CONTIG, k.ROWS, k.FLAT} <= modes, modes

    def expected(v):
        if v.dim() == 2 and v.shape[1] >= block // 2:  # ROWS: tiles row by row
            ncols = v.shape[1]
            tpr = -(-ncols // block)
            sizes = [min(block, ncols - (t % tpr) * block) for t in range(v.shape[0] * tpr)]
        else:
            sizes = [min(block, v.numel() - t * block) for t in range(-(-v.numel() // block))]
        return sum(sizes[:: k.SAMPLE])

    want = [expected(v) for v in regions.values()]
    assert table.sampled.tolist() == want
    counts, _ = table.counts(table.sample(work))
    assert counts.tolist() == want
    assert [int((shadow(r) == bits(r[0])).sum()) for r in routes] == want
    again, _ = table.counts(table.sample(work))
    assert again.tolist() == [0] * len(routes)


@interpreted
def test_interp_addressing_modes():
    from weightbus.codecs._delta_triton import CONTIG, FLAT, ROWS, region_mode

    x = torch.zeros(4, 6, 100)
    assert region_mode(x, 64) == CONTIG and region_mode(x[1:3], 64) == CONTIG
    assert region_mode(x[:, :, 10:90], 64) == ROWS and region_mode(x[:, 1:3, :20], 64) == FLAT
    assert region_mode(x.permute(2, 0, 1), 64) == FLAT
    assert region_mode(torch.zeros(()), 64) == CONTIG
    assert region_mode(torch.zeros(3, 3, 3, 3, 5)[:2, :2, :2, :2, :4], 64) is None


@interpreted
def test_interp_flat_routes_with_extents_the_kernels_cannot_divide_are_refused():
    from weightbus.codecs._delta_triton import WindowTable

    # rows of 4 elements, 2^30 of them (a view: no memory behind the extent)
    wide = torch.zeros(8).as_strided((1 << 30, 4), (0, 1))
    with pytest.raises(ValueError, match=r"route 1: .*\(1073741824, 4\).*2\^30"):
        WindowTable(
            [(torch.zeros(64), (64,), 4, 64, 0, 0), (wide, (1 << 30, 4), 4, 1 << 32, 0, 256)], "cpu"
        )


@pytest.mark.parametrize("block", [2048, 1 << 20])
def test_flat_row_by_float_reciprocal_is_exact(block):
    """The compare and emit kernels find the row of a FLAT route's element within its tile as
    ``(x + 0.5) * (1 / n3)`` in float32, truncated (``_flat_at``): equal to ``x // n3`` for
    every row length of such routes (below half a tile) and every ``x`` they compute (below
    n3 + BLOCK), even with the reciprocal 2 units in the last place off (a GPU's division
    may be approximate)."""
    lengths = np.unique(np.r_[np.arange(1, min(block // 2, 1100)), block // 2 - np.arange(1, 64)])
    for n3 in lengths:
        x = np.arange(0, int(n3) + block, dtype=np.int64)
        if len(x) > 1 << 16:  # the ends, where the quotient is largest, and a sample
            x = np.r_[x[:4096], x[-4096:], x[:: len(x) // 4096]]
        xf = x.astype(np.float32) + np.float32(0.5)
        rec = np.float32(1) / np.float32(n3)
        for ulps in (-2, -1, 0, 1, 2):
            r = rec
            for _ in range(abs(ulps)):
                r = np.nextafter(r, np.float32(np.sign(ulps) * np.inf), dtype=np.float32)
            q = (xf * r).astype(np.int64)  # (truncation: the values are positive)
            assert np.array_equal(q, x // n3), (n3, ulps)


@interpreted
def test_interp_resharding_syncs_are_bit_exact_and_equal_the_torch_path():
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=3, window_bytes=6000))
    runs = {}
    for impl in ("torch", "triton"):
        plan, ws, rs, canon, live, got, wcs, rcs = start(codecs)
        for w in wcs:
            e = w.encoder
            w.encoder = DeltaEncoder(
                w.ops, codecs.delta, fill=e._fill, views=e._views, name=w.name, impl=impl
            )
        for r in rcs:
            r.decoder = DeltaDecoder(r.ops, r.tensors, r.name, impl=impl)
        runs[impl] = (plan, ws, rs, canon, live, got, wcs, rcs, [])
    # dense, 1%, 50% (dense frames) that reader 1 misses, 1% (dense to reader 1)
    for step in range(1, 5):
        fraction = {1: 0.0, 3: 0.5}.get(step, 0.01)
        absent = {1} if step == 3 else set()
        for plan, ws, rs, canon, live, got, wcs, rcs, moved in runs.values():
            if fraction:
                change(canon, torch.Generator().manual_seed(step), fraction)
            for lay, t in zip(ws, live, strict=True):
                fill_from_canonical(lay, canon, t)
            moved.append(run_sync(plan, wcs, rcs, step, absent=absent))
            assert_exact(rs, got, canon, skip=absent)
    assert runs["torch"][-1] == runs["triton"][-1]


@pytest.mark.skipif(INTERPRETER, reason="already in the interpreter")
@pytest.mark.timeout(300)
def test_triton_kernels_in_the_interpreter():
    """This module's ``test_interp_*`` tests in a child pytest under TRITON_INTERPRET=1."""
    run_interpreted(__file__)


class _CountedKernel:
    """A kernel whose launches are counted, and whose torch ops inside the interpreter (its
    handling of tensor arguments) are left out of the op counter that is active."""

    def __init__(self, kernel, name: str, log: dict) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            counter = self.log["counter"]
            before = sum(counter.ops.values()) if counter else 0
            self.kernel[grid](*args, **kwargs)
            if counter:
                self.log["inside"][counter] += sum(counter.ops.values()) - before
                self.log["launches"][self.name] += 1

        return launch


@interpreted
def test_interp_torch_ops_per_sync_do_not_grow_with_routes(monkeypatch):
    """On the Triton path a 1% sync costs a few torch ops per bucket and a few launches per
    window (writer) or one per bucket (reader), however many routes a bucket holds."""
    from weightbus.codecs import _delta_triton
    from weightbus.layouts.describe import build_layouts
    from weightbus.layouts.families import model_spec

    log = {"counter": None, "inside": collections.Counter(), "launches": collections.Counter()}
    for name in ("_compare_kernel", "_emit_kernel", "_apply_kernel", "_zero_kernel"):
        kernel = _CountedKernel(getattr(_delta_triton, name), name, log)
        monkeypatch.setattr(_delta_triton, name, kernel)
    config = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    model = model_spec(config, dtype="bfloat16")
    w = build_layouts(model, "whole", "writer")[0]
    r = build_layouts(model, "vllm:tp=1", "reader")[0]
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, window_bytes=64 << 10))
    plan = make_plan([w], [r], PlanOptions(bucket_bytes=48 << 10, direct_bytes=0))
    live, got = allocate(w), allocate(r)
    g = torch.Generator().manual_seed(0)
    for t in live.values():
        t.copy_(torch.randn(t.shape, generator=g))
    wc, rc = WriterCodec(plan, 0, live, codecs), ReaderCodec(plan, 0, got, codecs)
    e = wc.encoder
    wc.encoder = DeltaEncoder(wc.ops, codecs.delta, fill=e._fill, views=e._views, impl="triton")
    rc.decoder = DeltaDecoder(rc.ops, rc.tensors, impl="triton")
    run_sync(plan, [wc], [rc], 1)
    for t in live.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100]
        flat[idx] = torch.randn(len(idx), generator=g).to(t.dtype)
    wc.begin(2)
    rc.begin(2)
    writer, reader = _OpCounter(), _OpCounter()
    for op, rop in zip(wc.ops, rc.ops, strict=True):
        buf = torch.zeros(wc.capacity(op), dtype=torch.uint8)
        with writer:
            log["counter"] = writer
            wc.pack(op, buf)
        with reader:
            log["counter"] = reader
            rc.encoded_size(rop, buf)
            rc.unpack(rop, buf)
        log["counter"] = None
    wc.end()
    rc.end(2)
    buckets, windows = len(wc.ops), len(wc.encoder._windows)
    routes = sum(len(op.copies) for op in wc.ops)
    assert routes >= 8 * buckets and buckets > windows > 1
    groups = sum(len(lay.table.groups) for lay in wc.encoder._layouts)
    assert log["launches"] == {
        "_compare_kernel": groups,
        "_emit_kernel": groups,
        "_apply_kernel": buckets,
        "_zero_kernel": windows,  # (each window's store: the bytes no frame fills)
    }
    w_ops = sum(writer.ops.values()) - log["inside"][writer]
    r_ops = sum(reader.ops.values()) - log["inside"][reader]
    assert w_ops <= 8 * buckets + 12 * windows, writer.ops
    assert r_ops <= 4 * buckets, reader.ops
    for per_route in ("ne", "nonzero", "index_put_", "take", "_local_scalar_dense"):
        assert per_route not in writer.ops and per_route not in reader.ops
    # each route's count: a cumsum over the tiles, read at the routes' ends, once per window
    assert writer.ops["cumsum"] == writer.ops["index_select"] == windows
    canon = {p.tensor: live[p.key] for p in w.iter_pieces()}  # the writer holds them whole
    want = allocate(r)
    fill_from_canonical(r, canon, want)
    for k, t in want.items():
        assert torch.equal(got[k].view(torch.int16), t.view(torch.int16)), k


def test_tuning_variables_refuse_what_is_not_an_integer(monkeypatch):
    from weightbus._env import env_int

    monkeypatch.delenv("WEIGHTBUS_DELTA_EMIT_PRIORITY", raising=False)
    assert env_int("WEIGHTBUS_DELTA_EMIT_PRIORITY", -1) == -1
    monkeypatch.setenv("WEIGHTBUS_DELTA_EMIT_PRIORITY", " 0 ")
    assert env_int("WEIGHTBUS_DELTA_EMIT_PRIORITY", -1) == 0
    monkeypatch.setenv("WEIGHTBUS_DELTA_EMIT_PRIORITY", "")
    assert env_int("WEIGHTBUS_DELTA_EMIT_PRIORITY", -1) == -1
    monkeypatch.setenv("WEIGHTBUS_DELTA_EMIT_PRIORITY", "high")
    with pytest.raises(ValueError, match=r"\$WEIGHTBUS_DELTA_EMIT_PRIORITY='high': an integer"):
        env_int("WEIGHTBUS_DELTA_EMIT_PRIORITY", -1)
