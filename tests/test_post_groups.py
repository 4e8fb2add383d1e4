"""Posting groups (in-place sends and receives posted together): both ends of a link compute
the same groups from what each side says may join, whatever their layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightbus._session import GROUP_BYTES, GROUP_OPS, local_joins, post_groups
from weightbus.errors import WeightbusError
from weightbus.plan.program import BucketOp


def _op(bucket: int, peer: int, nbytes: int) -> BucketOp:
    return BucketOp(bucket=bucket, peer=peer, peer_global=peer, wave=0, nbytes=nbytes, copies=())


LIVE = torch.zeros(1)


def _side(spec):
    """``spec``: (bucket, peer, bytes, in place) per op, in posting order."""
    return tuple((_op(b, p, n), LIVE if live else None) for b, p, n, live in spec)


def _buckets(groups):
    return [[op.bucket for op, _ in g] for g in groups]


def _link(groups, peer):
    return [[op.bucket for op, _ in g] for g in groups if g[0][0].peer_global == peer]


def test_both_ends_of_a_link_post_the_same_groups_whatever_is_in_place_on_each():
    # the writer sends buckets 0-5 to reader 1; bucket 3 is staged on the reader only, bucket 1
    # is staged on the writer only
    writer = _side([(0, 1, 8, True), (1, 1, 8, False), (2, 1, 8, True), (3, 1, 8, True),
                    (4, 1, 8, True), (5, 1, 8, True)])  # fmt: skip
    reader = _side([(0, 0, 8, True), (1, 0, 8, True), (2, 0, 8, True), (3, 0, 8, False),
                    (4, 0, 8, True), (5, 0, 8, True)])  # fmt: skip
    w, r = local_joins(writer), local_joins(reader)
    on_writer = post_groups(writer, w, {1: r[0]})
    on_reader = post_groups(reader, r, {0: w[1]})
    assert _buckets(on_writer) == _buckets(on_reader) == [[0], [1], [2], [3], [4, 5]]
    # alone, each side would have grouped more: the other side's cuts count
    assert _buckets(post_groups(writer, w, {1: w[1]})) == [[0], [1], [2, 3, 4, 5]]


def test_groups_span_other_peers_ops_and_stop_at_empty_ops_and_the_limits():
    n = GROUP_OPS + 12
    spec = [(b, 1, 8, True) for b in range(n)]  # buckets 0..n-1 to peer 1
    spec.insert(5, (100, 2, 8, True))  # an op to another peer between: posted after the group
    spec.insert(9, (101, 1, 0, True))  # an empty op travels alone
    side = _side(spec)
    mine = local_joins(side)
    groups = post_groups(side, mine, mine)
    assert sorted(op.bucket for g in groups for op, _ in g) == sorted(b for b, *_ in spec)
    assert _link(groups, 2) == [[100]]
    cap = list(range(8, 8 + GROUP_OPS))
    assert _link(groups, 1) == [list(range(8)), [101], cap, list(range(8 + GROUP_OPS, n))]
    assert _buckets(groups)[:2] == [list(range(8)), [100]]  # the group goes where 0 was
    assert all(len(g) <= GROUP_OPS for g in groups)
    big = _side([(b, 1, GROUP_BYTES // 2 + 1, True) for b in range(3)])
    rows = local_joins(big)
    assert _buckets(post_groups(big, rows, rows)) == [[0], [1], [2]]  # two would pass the bytes


def test_a_peer_that_sends_nothing_grouped_leaves_every_op_alone():
    side = _side([(b, 1, 8, True) for b in range(4)])
    assert _buckets(post_groups(side, local_joins(side), {})) == [[0], [1], [2], [3]]


def test_the_two_ends_listing_different_buckets_is_refused():
    side = _side([(b, 1, 8, True) for b in range(4)])
    mine = local_joins(side)
    other = {1: mine[1].copy()}
    other[1][2, 0] = 9
    with pytest.raises(WeightbusError, match=r"lists buckets \[0, 1, 2, 3\].*\[0, 1, 9, 3\]"):
        post_groups(side, mine, other)
    with pytest.raises(WeightbusError, match="planned differently"):
        post_groups(side, mine, {1: mine[1][:3]})
    assert np.array_equal(mine[1][:, 2], [0, 1, 1, 1])


@pytest.mark.timeout(120)
def test_a_session_posts_in_place_buckets_in_groups_both_ends_alike_bit_exact():
    """One writer holding whole bfloat16 tensors, two tensor-parallel engine readers (fused
    qkv and gate_up), over gloo: the writer sends its in-place buckets in groups, each reader
    receives the same groups, and every byte lands (poisoned readers, three syncs)."""
    import uuid

    import torch.distributed as dist

    from tests.test_faults_membership import configs
    from tests.test_transport_links import _canonical
    from tests.threads import run_threads
    from weightbus import BoundLayout, Participant, Reader, Writer
    from weightbus.layouts.describe import build_layouts
    from weightbus.layouts.families import model_spec
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate, fill_from_canonical, poison

    model = model_spec("tiny-llama")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"groups-{uuid.uuid4().hex[:6]}"
    n_r, syncs = 2, 3

    def side(bound, role):
        control, sync = configs(store.port, 1, n_r, job)
        return (Writer if role == "writer" else Reader)(bound, control, sync)

    def groups(s):
        names = [p.name for p in s.plan.participants]
        out: dict[tuple[str, str], list] = {}
        for group in s.posts:
            peer = names[group[0][0].peer_global]
            link = (s.name, peer) if s.role == "writer" else (peer, s.name)
            out.setdefault(link, []).append([op.bucket for op, _ in group])
        return out

    def writer():
        layout = build_layouts(model, "whole", "writer", dtype="bfloat16")[0]
        bound = BoundLayout(layout=layout, tensors=allocate(layout))
        with side(bound, "writer") as w:  # connects
            for v in range(1, syncs + 1):
                canon = {k: t.to(torch.bfloat16) for k, t in _canonical(model, v).items()}
                fill_from_canonical(layout, canon, bound.tensors)
                w.sync(v)
            return groups(w)

    def reader(rank):
        def body():
            me = Participant(role="reader", rank=rank, process=f"elsewhere-{rank}")
            layout = engine_layout(model, me, tp=n_r, tp_rank=rank, dtype="bfloat16")
            bound = BoundLayout(layout=layout, tensors=allocate(layout))
            bad = []
            with side(bound, "reader") as r:
                for _ in range(syncs):
                    for t in bound.tensors.values():
                        poison(t)
                    v = r.wait().version
                    want = allocate(layout)
                    canon = {k: t.to(torch.bfloat16) for k, t in _canonical(model, v).items()}
                    fill_from_canonical(layout, canon, want)
                    bad += [
                        (v, k)
                        for k in want
                        if not torch.equal(
                            bound.tensors[k].view(torch.uint8), want[k].view(torch.uint8)
                        )
                    ]
                return groups(r), bad

        return body

    out = run_threads({"writer-0": writer, "reader-0": reader(0), "reader-1": reader(1)})
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    on_writer = out["writer-0"]
    for rank in range(n_r):
        on_reader, bad = out[f"reader-{rank}"]
        assert not bad, bad[:5]
        link = ("writer-0", f"reader-{rank}")
        assert on_reader[link] == on_writer[link], link
        assert max(len(g) for g in on_reader[link]) > 1, on_reader[link]


def test_a_side_whose_transport_cannot_group_makes_both_post_singly():
    side = _side([(b, 1, 8, True) for b in range(4)])
    cannot = local_joins(side, lambda peer: False)
    assert not cannot[1][:, 2].any()
    mine = local_joins(side)
    assert _buckets(post_groups(side, mine, cannot)) == [[0], [1], [2], [3]]
    assert _buckets(post_groups(side, mine, mine)) == [[0, 1, 2, 3]]
