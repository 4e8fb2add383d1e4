"""Change marks: the trainer marks what it changes, and the writer's delta passes read the marks
instead of comparing every byte (the torch path here; the Triton pass in
``test_codec_delta.py::test_interp_marked_passes_equal_the_torch_path`` and on GPU)."""

from __future__ import annotations

import collections

import pytest
import torch

from tests.test_codec_delta import (
    TENSORS,
    assert_exact,
    change,
    reader_tensors,
    readers,
    writers,
)
from weightbus import BoundLayout, ControlConfig, SyncConfig, Writer
from weightbus.codecs.delta import DeltaConfig
from weightbus.codecs.marks import ChangeMarks, flags_of
from weightbus.errors import WeightbusError
from weightbus.plan import PlanOptions, allocate, make_plan
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, WriterCodec, run_sync, wire_layout


def marked(marks: ChangeMarks, x: torch.Tensor) -> torch.Tensor:
    """The marks of view ``x``'s elements, as bools of its shape."""
    words, _ = marks.locate(x)
    lo = x.storage_offset()
    hi = lo + 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True))
    flags = flags_of(words, lo, hi)
    return flags.as_strided(x.shape, x.stride(), flags.storage_offset())


def test_copy_marks_exactly_the_elements_whose_bits_changed():
    base = torch.randn(37, 70).to(torch.bfloat16)
    marks = ChangeMarks({"w": base})
    dst = base[3:30, 5:66]  # strided, not at a word boundary
    src = dst.clone()
    src[0, 0] = -src[0, 0]
    src[4, 7] = 0.0 if torch.signbit(src[4, 7]) else -0.0  # equal as numbers, not as bits
    src.view(torch.int16)[9, 9] = 0x7FC1  # a NaN
    src[20, 60] = src[20, 60]  # written, not changed
    want = dst.view(torch.int16) != src.view(torch.int16)
    assert marks.copy_(dst, src) is dst
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    assert torch.equal(marked(marks, dst), want) and marks.count() == 3
    # a second copy ORs into the marks; nothing outside the view is marked
    src2 = dst.clone()
    src2[26, 0] += 1
    marks.copy_(dst, src2)
    assert marks.count() == 4 and marked(marks, base).sum() == 4
    marks.clear()
    assert marks.count() == 0 and not marks.stale


def test_mark_sets_a_views_elements_or_those_where_true():
    a, b = torch.zeros(10, 33), torch.zeros(64, dtype=torch.bfloat16)
    marks = ChangeMarks({"a": a, "b": b, "a2": a[2:]})  # a view of a marked storage: one marks
    marks.mark(a[:, 32])
    where = torch.zeros(16, dtype=torch.bool)
    where[[0, 15]] = True
    marks.mark(b[40:56], where)
    assert marked(marks, a)[:, 32].all() and marks.count() == 12
    assert marked(marks, b).nonzero().view(-1).tolist() == [40, 55]


def test_bad_marks_are_refused_with_the_fix():
    a = torch.zeros(4, 8)
    marks = ChangeMarks({"a": a}, name="writer-0")
    with pytest.raises(WeightbusError, match=r"writer-0: copy_: .* not a view of any"):
        marks.copy_(torch.zeros(4, 8), a)
    with pytest.raises(WeightbusError, match=r"view of 'a' as torch.int16 .* own dtype"):
        marks.mark(a.view(torch.int16))
    with pytest.raises(ValueError, match=r"where has shape \(3,\), the view \(4, 8\)"):
        marks.mark(a, torch.ones(3, dtype=torch.bool))


def test_a_replaced_storage_gets_marks_of_its_own_and_the_next_sync_compares():
    a = torch.zeros(64)
    marks = ChangeMarks({"a": a})
    a.set_(torch.ones(64))  # the trainer replaced the storage
    marks.mark(a[3:5])  # found again on first use
    assert marks.stale and marks.count() == 2 and marks.locate(a) is not None


def _start(window: int, checksum_every: int):
    codecs = CodecConfig(
        delta=DeltaConfig(window_bytes=window, checksum_every=checksum_every, change_marks=True)
    )
    ws, rs = writers(), readers()
    plan = make_plan(
        [wire_layout(w, codecs) for w in ws],
        [wire_layout(r, codecs) for r in rs],
        PlanOptions(bucket_bytes=2048, direct_bytes=0, cast={"float32": "bfloat16"}),
    )
    g = torch.Generator().manual_seed(0)
    canon = {
        t: torch.randn(shape, generator=g).to(getattr(torch, dt))
        for t, (shape, dt) in TENSORS.items()
    }
    live = [allocate(w) for w in ws]
    marks = [ChangeMarks(t, name=f"writer-{i}") for i, t in enumerate(live)]
    got = [reader_tensors(r) for r in rs]
    wcs = [WriterCodec(plan, i, live[i], codecs, marks=marks[i]) for i in range(len(ws))]
    rcs = [ReaderCodec(plan, i, got[i], codecs) for i in range(len(rs))]
    return plan, ws, rs, canon, live, marks, got, wcs, rcs


def _marked_fill(layout, canon, tensors, marks: ChangeMarks) -> None:
    """fill_from_canonical, through the marks: what a trainer's last copy of a step does."""
    for p in layout.iter_pieces():
        dst = tensors[p.key][p.local_box.slices()]
        marks.copy_(dst, canon[p.tensor][p.box.slices()].reshape(dst.shape))


def test_marked_syncs_are_bit_exact_over_30_steps_with_resharding():
    plan, ws, rs, canon, live, marks, got, wcs, rcs = _start(3000, checksum_every=5)
    used = collections.Counter()
    for w in wcs:
        enc = w.encoder
        orig = enc._marked

        def spy(win, orig=orig):
            used[orig(win)] += 1
            return orig(win)

        enc._marked = spy
    dense_bytes = plan.stats.total_bytes
    g = torch.Generator().manual_seed(1)
    for step in range(1, 31):
        change(canon, g, 0.5 if step % 9 == 0 else 0.01)
        for lay, t, m in zip(ws, live, marks, strict=True):
            _marked_fill(lay, canon, t, m)
        moved = run_sync(plan, wcs, rcs, step)
        assert_exact(rs, got, canon)
        assert all(m.count() == 0 for m in marks)  # cleared at the sync's end
        if step > 1 and step % 9 not in (0, 1) and step % 5:
            assert moved < 0.25 * dense_bytes, (step, moved, dense_bytes)
    # windows of bf16 routes read the marks; those with a cast (float32 -> bf16) compare
    assert used[True] > 30 and used[False] > 0, used


def test_a_change_not_marked_arrives_with_the_next_checksum():
    plan, ws, rs, canon, live, marks, got, wcs, rcs = _start(1 << 30, checksum_every=4)
    for lay, t, m in zip(ws, live, marks, strict=True):
        _marked_fill(lay, canon, t, m)
    run_sync(plan, wcs, rcs, 1)  # dense
    # writer 0's share of c.bias changes behind the marks' back (bf16 routes: marks read)
    canon["c.bias"][:10] += 1.0
    for lay, t in zip(ws, live, strict=True):
        for p in lay.iter_pieces():
            dst = t[p.key][p.local_box.slices()]
            dst.copy_(canon[p.tensor][p.box.slices()].reshape(dst.shape))
    for step in (2, 3):
        run_sync(plan, wcs, rcs, step)
        with pytest.raises(AssertionError):
            assert_exact(rs, got, canon)  # not sent: it was not marked
    run_sync(plan, wcs, rcs, 4)  # a checksum: every byte compared
    assert_exact(rs, got, canon)


def test_writer_change_marks_needs_the_option():
    layout = writers()[0]
    bound = BoundLayout(layout=layout, tensors=allocate(layout))
    control = ControlConfig(address="127.0.0.1:1", num_writers=2, num_readers=3)
    on = Writer(bound, control, SyncConfig(delta=DeltaConfig(change_marks=True)))
    assert isinstance(on.change_marks, ChangeMarks)
    on.change_marks.mark(bound.tensors["c.bias"])
    assert on.change_marks.count() == bound.tensors["c.bias"].numel()
    off = Writer(bound, control, SyncConfig(delta=DeltaConfig()))
    with pytest.raises(WeightbusError, match=r"change_marks=True"):
        _ = off.change_marks
