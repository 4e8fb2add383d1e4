"""The NCCL transport's links (CPU): one group of two ranks per writer-reader pair, named and
ranked alike on both ends, created in one global order (weightbus.transports.nccl.link_order)."""

from __future__ import annotations

import pytest

from weightbus.control.store import Roster
from weightbus.spec import Participant
from weightbus.transports.nccl import link_order


@pytest.mark.parametrize("writers,readers", [(1, 1), (2, 2), (3, 1), (1, 4), (2, 5)])
def test_every_pair_is_one_link_alike_on_both_ends(writers, readers):
    roster = Roster.of(
        [Participant(role="writer", rank=i, device=f"cuda:{i}") for i in range(writers)]
        + [Participant(role="reader", rank=i, device=f"cuda:{writers + i}") for i in range(readers)]
    )
    seen: dict[str, list[tuple[int, int]]] = {}
    for p in roster.all:
        me = roster.global_rank(p.name)
        links = link_order(roster, p.name)
        others = readers if p.role == "writer" else writers
        assert len(links) == others, (p.name, links)
        peers = [peer for peer, _, _ in links]
        assert len(set(peers)) == others
        for peer, prefix, rank in links:
            assert roster.all[peer].role != p.role, (p.name, peer)
            w, r = (me, peer) if p.role == "writer" else (peer, me)
            assert prefix == f"{w}-{r}"
            assert rank == (0 if p.role == "writer" else 1)
            seen.setdefault(prefix, []).append((me, rank))
        # each participant's links in the global order of (writer, reader) pairs: two
        # participants never wait on each other's next link
        keys = [tuple(map(int, prefix.split("-"))) for _, prefix, _ in links]
        assert keys == sorted(keys)
    assert len(seen) == writers * readers
    assert all(sorted(r for _, r in ends) == [0, 1] for ends in seen.values()), seen
