"""Every layout disagreement fails at planning time with a message naming tensor, values, fix."""

from __future__ import annotations

import pytest

from weightbus.plan import PlanOptions, make_plan
from weightbus.spec import Box, LayoutBuilder, LayoutError, Participant


def _layout(role, rank, pieces, dtype="float32", shapes=None, local_shapes=None):
    """pieces: list of (tensor, box, key, local_box)."""
    b = LayoutBuilder(Participant(role=role, rank=rank))
    shapes = shapes or {}
    local_shapes = local_shapes or {}
    for tensor, box, key, lbox in pieces:
        b.add_tensor(tensor, shapes.get(tensor, (8, 4)), dtype)
        b.add_local(key, local_shapes.get(key, lbox.stop), dtype)
        b.add_piece(tensor, box, key, lbox)
    return b.build()


def _whole(name, shape=(8, 4)):
    return (name, Box.whole(shape), name, Box.whole(shape))


def test_reader_tensor_missing_on_writers():
    w = [_layout("writer", 0, [_whole("a")])]
    r = [_layout("reader", 0, [_whole("a"), _whole("b")])]
    with pytest.raises(
        LayoutError, match=r"reader 'reader-0' expects b \(8, 4\) float32, but no writer holds it"
    ):
        make_plan(w, r)


def test_writer_tensor_missing_on_readers_and_ignore_unread():
    w = [_layout("writer", 0, [_whole("a"), _whole("value_head.w")])]
    r = [_layout("reader", 0, [_whole("a")])]
    with pytest.raises(
        LayoutError,
        match=r"writer 'writer-0' holds value_head.w .* no reader expects it: pass ignore_unread",
    ):
        make_plan(w, r)
    plan = make_plan(w, r, PlanOptions(ignore_unread=("value_head.*",)))
    assert plan.stats.total_bytes == 8 * 4 * 4


def test_shape_disagreement():
    w = [_layout("writer", 0, [_whole("a")])]
    r = [
        _layout(
            "reader", 0, [("a", Box.whole((8, 5)), "a", Box.whole((8, 5)))], shapes={"a": (8, 5)}
        )
    ]
    with pytest.raises(
        LayoutError,
        match=r"^a: reader 'reader-0' has shape \(8, 5\), writer 'writer-0' has \(8, 4\)",
    ):
        make_plan(w, r)


def test_dtype_disagreement_needs_explicit_cast():
    w = [_layout("writer", 0, [_whole("a")], dtype="float32")]
    r = [_layout("reader", 0, [_whole("a")], dtype="bfloat16")]
    msg = r"reader 'reader-0' expects a as \(8, 4\) bfloat16, writers hold \(8, 4\) float32 .*pass cast=\{'float32': 'bfloat16'\}"
    with pytest.raises(LayoutError, match=msg):
        make_plan(w, r)
    assert make_plan(w, r, PlanOptions(cast={"float32": "bfloat16"})).stats.total_bytes == 8 * 4 * 2


def test_writers_disagree_on_dtype():
    w = [
        _layout("writer", 0, [_whole("a")], dtype="float32"),
        _layout("writer", 1, [_whole("a")], dtype="bfloat16"),
    ]
    r = [_layout("reader", 0, [_whole("a")])]
    with pytest.raises(
        LayoutError, match=r"a: writer 'writer-1' holds bfloat16, writer 'writer-0' holds float32"
    ):
        make_plan(w, r)


def test_reader_region_not_covered():
    w = [_layout("writer", 0, [("a", Box((0, 0), (4, 4)), "a", Box.whole((4, 4)))])]
    r = [_layout("reader", 0, [_whole("a")])]
    msg = r"reader 'reader-0' needs \[0:8, 0:4\] of a \(8, 4\), but writers hold only 16 of its 32 elements \(writer boxes: \[0:4, 0:4\]\)"
    with pytest.raises(LayoutError, match=msg):
        make_plan(w, r)


def test_overlapping_reader_pieces():
    w = [_layout("writer", 0, [_whole("a")])]
    r = [
        _layout(
            "reader",
            0,
            [
                ("a", Box((0, 0), (5, 4)), "p", Box.whole((5, 4))),
                ("a", Box((4, 0), (8, 4)), "q", Box.whole((4, 4))),
            ],
        )
    ]
    with pytest.raises(
        LayoutError, match=r"reader 'reader-0': pieces \[0:5, 0:4\] and \[4:8, 0:4\] of a overlap"
    ):
        make_plan(w, r)


def test_overlapping_local_boxes():
    w = [_layout("writer", 0, [_whole("a"), _whole("b")])]
    r = [
        _layout(
            "reader",
            0,
            [
                ("a", Box.whole((8, 4)), "fused", Box((0, 0), (8, 4))),
                ("b", Box.whole((8, 4)), "fused", Box((4, 0), (12, 4))),
            ],
            local_shapes={"fused": (12, 4)},
        )
    ]
    with pytest.raises(
        LayoutError,
        match=r"pieces of a and b both write local tensor 'fused' at \[0:8, 0:4\] and \[4:12, 0:4\]",
    ):
        make_plan(w, r)


def test_piece_outside_its_tensor():
    w = [_layout("writer", 0, [("a", Box((0, 0), (9, 4)), "a", Box.whole((9, 4)))])]
    r = [_layout("reader", 0, [_whole("a")])]
    with pytest.raises(
        LayoutError,
        match=r"writer 'writer-0': piece \[0:9, 0:4\] of a lies outside the tensor's shape \(8, 4\)",
    ):
        make_plan(w, r)


def test_piece_outside_its_local_tensor():
    w = [_layout("writer", 0, [_whole("a")])]
    r = [
        _layout(
            "reader",
            0,
            [("a", Box.whole((8, 4)), "a", Box((2, 0), (10, 4)))],
            local_shapes={"a": (8, 4)},
        )
    ]
    with pytest.raises(
        LayoutError,
        match=r"reader 'reader-0': piece \[0:8, 0:4\] of a is placed at \[2:10, 0:4\] of local tensor 'a' \(8, 4\), outside it",
    ):
        make_plan(w, r)


def test_piece_extent_mismatch_is_refused_by_the_builder():
    b = LayoutBuilder(Participant(role="reader", rank=0))
    b.add_tensor("a", (8, 4), "float32")
    b.add_local("a", (8, 4), "float32")
    with pytest.raises(LayoutError, match=r"does not fit local box"):
        b.add_piece("a", Box.whole((8, 4)), "a", Box((0, 0), (4, 4)))


def test_local_dtype_must_match_declared_dtype():
    b = LayoutBuilder(Participant(role="reader", rank=0))
    b.add_tensor("a", (8, 4), "float32")
    b.add_local("a", (8, 4), "bfloat16")
    b.add_piece("a", Box.whole((8, 4)), "a", Box.whole((8, 4)))
    w = [_layout("writer", 0, [_whole("a")])]
    with pytest.raises(
        LayoutError,
        match=r"a is declared float32 but its piece lives in local tensor 'a' of dtype bfloat16",
    ):
        make_plan(w, [b.build()])


def test_ranks_and_roles_are_checked():
    w = [_layout("writer", 0, [_whole("a")])]
    r = [_layout("reader", 1, [_whole("a")])]
    with pytest.raises(LayoutError, match=r"reader ranks must be 0..0 in order, got \[1\]"):
        make_plan(w, r)
    with pytest.raises(LayoutError, match=r"has role 'writer' but was passed as a reader"):
        make_plan(w, w)
    with pytest.raises(LayoutError, match="no reader layouts"):
        make_plan(w, [])


def test_bad_options():
    with pytest.raises(ValueError, match="align=100 must be a power of two"):
        PlanOptions(align=100)
    with pytest.raises(ValueError, match="bucket_bytes=10 is too small"):
        PlanOptions(bucket_bytes=10)


def test_sync_config_reaches_the_planner():
    from weightbus import SyncConfig

    opts = SyncConfig(
        direct_bytes=4096, bucket_bytes=2 << 20, cast={"float32": "bfloat16"}
    ).plan_options()
    assert (opts.direct_bytes, opts.bucket_bytes, opts.cast) == (
        4096,
        2 << 20,
        (("float32", "bfloat16"),),
    )


def test_participant_names_without_white_space():
    with pytest.raises(ValueError, match="contains white space"):
        Participant(role="reader", rank=0, name="reader zero")
