"""The NCCL transport's links (CPU): one group of two ranks per writer-reader pair, named and
ranked alike on both ends, created in one global order (weightbus.transports.nccl.link_order),
and all aborted at once."""

from __future__ import annotations

import threading
import time

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


def test_a_writer_and_a_reader_of_one_gpu_have_no_link():
    """Colocated: writer i and reader i on GPU i (UUIDs; device strings alike), every writer
    with every reader otherwise. Each pair of two GPUs is one link alike on both ends; a pair
    of one GPU none (NCCL cannot join two ranks of one GPU; CUDA IPC serves them). Writers
    sharing a GPU each keep their links to readers elsewhere."""
    gpus = ["g0", "g1", "g2"]
    roster = Roster.of(
        [Participant(role="writer", rank=i, device="cuda:0", gpu=g) for i, g in enumerate(gpus)]
        + [Participant(role="reader", rank=i, device="cuda:0", gpu=g) for i, g in enumerate(gpus)]
    )
    ends: dict[str, set[str]] = {}
    for p in roster.all:
        links = link_order(roster, p.name)
        peers = {roster.all[peer].name for peer, _, _ in links}
        other = "reader" if p.role == "writer" else "writer"
        assert peers == {f"{other}-{i}" for i in range(3) if i != p.rank}, (p.name, peers)
        for _, prefix, _ in links:
            ends.setdefault(prefix, set()).add(p.name)
    assert len(ends) == 6 and all(len(v) == 2 for v in ends.values()), ends
    shared = Roster.of(
        [Participant(role="writer", rank=i, device="cuda:0", gpu="g0") for i in range(2)]
        + [Participant(role="reader", rank=i, device="cuda:1", gpu="g1") for i in range(2)]
    )
    assert [len(link_order(shared, p.name)) for p in shared.all] == [2, 2, 2, 2]


def test_a_send_to_a_peer_without_a_link_names_both_and_why():
    from weightbus.transports.base import Handle
    from weightbus.transports.nccl import NcclTransport

    roster = Roster.of(
        [
            Participant(role="writer", rank=0, device="cuda:0", gpu="g0"),
            Participant(role="writer", rank=1, device="cuda:1", gpu="g1"),
            Participant(role="reader", rank=0, device="cuda:0", gpu="g0"),
        ]
    )
    t = NcclTransport()
    t.roster, t.participant = roster, roster["writer-0"]
    with pytest.raises(
        ValueError, match=r"'reader-0' and 'writer-0' have no link.*GPU g0.*CUDA IPC"
    ):
        t._side(Handle("send", roster["reader-0"], 0, 1))
    with pytest.raises(
        ValueError, match=r"'writer-1' and 'writer-0' have no link.*not a writer and a reader"
    ):
        t._side(Handle("send", roster["writer-1"], 0, 1))


@pytest.mark.parametrize(
    "writers,readers,budget,want",
    [
        (1, 1, 32, 32),
        (1, 3, 32, 10),
        (2, 2, 32, 16),
        (8, 8, 32, 4),
        (1, 64, 32, 2),
        (4, 2, 8, 2),
        (1, 2, 1, 1),
    ],
)
def test_channels_split_among_the_links_of_the_busier_end(writers, readers, budget, want):
    """Each link gets the budget over the links of its busier end (at least 2, never more than
    the budget), so one participant's links together ask about the budget, alike on both ends
    (keyed by the link's prefix)."""
    from weightbus.transports.nccl import link_channels

    roster = Roster.of(
        [Participant(role="writer", rank=i, device=f"cuda:{i}") for i in range(writers)]
        + [Participant(role="reader", rank=i, device=f"cuda:{writers + i}") for i in range(readers)]
    )
    got = link_channels(roster, dict.fromkeys(range(roster.size), budget))
    prefixes = {prefix for p in roster.all for _, prefix, _ in link_order(roster, p.name)}
    assert set(got) == prefixes
    assert set(got.values()) == {want}, got
    assert link_channels(roster, dict.fromkeys(range(roster.size), 0)) == {}


def test_each_link_takes_the_smaller_offer_of_its_ends():
    """Budgets per participant (global rank): writers 0 and 1, readers 2 and 3, every pair a
    link (two each). Writer 0 offers 32 / 2, writer 1 has 0 (NCCL's choice: no limit), reader
    2 offers 8 / 2, reader 3 the minimum of 2 from a budget of 3; a link of two unlimited ends
    is left out, and so is one whose other end's budget is unknown."""
    from weightbus.transports.nccl import link_channels

    roster = Roster.of(
        [Participant(role="writer", rank=i, device=f"cuda:{i}") for i in range(2)]
        + [Participant(role="reader", rank=i, device=f"cuda:{2 + i}") for i in range(2)]
    )
    got = link_channels(roster, {0: 32, 1: 0, 2: 8, 3: 3})
    assert got == {"0-2": 4, "0-3": 2, "1-2": 4, "1-3": 2}
    assert link_channels(roster, {0: 0, 1: 0, 2: 0, 3: 0}) == {}
    assert link_channels(roster, {0: 32, 2: 8}) == {"0-2": 4}


def test_channels_count_only_links():
    """Colocated pairs have no link, so they take none of the split: writer-0 on g0 and
    readers on g0 and g1 has one link, of the whole budget."""
    from weightbus.transports.nccl import link_channels

    roster = Roster.of(
        [
            Participant(role="writer", rank=0, device="cuda:0", gpu="g0"),
            Participant(role="reader", rank=0, device="cuda:0", gpu="g0"),
            Participant(role="reader", rank=1, device="cuda:1", gpu="g1"),
        ]
    )
    assert link_channels(roster, {0: 32, 1: 32, 2: 32}) == {"0-2": 32}


class _Link:
    """A link's process group whose abort waits (up to ``wait_s``) for ``needs`` to abort
    first, as a communicator's teardown waits for the GPU where the other link's kernel spins
    on a dead peer until that link's own abort."""

    def __init__(self, needs: threading.Event | None, done: threading.Event, wait_s: float):
        self.needs, self.done, self.wait_s = needs, done, wait_s

    def abort(self) -> None:
        if self.needs is not None and not self.needs.wait(self.wait_s):
            raise AssertionError("aborted before the link it waits for")
        self.done.set()


@pytest.mark.parametrize("order", ["live first", "dead first"])
def test_abort_tears_down_every_link_at_once(order):
    """Aborting one link after another hung on GPUs in the first link's abort (the live
    reader's; it likely waited for the dead one's, modelled here): every link's abort now
    starts at once, whatever the order."""
    from weightbus.transports.nccl import NcclTransport

    live_done, dead_done = threading.Event(), threading.Event()
    live = _Link(needs=dead_done, done=live_done, wait_s=3.0)
    dead = _Link(needs=None, done=dead_done, wait_s=0.0)
    t = NcclTransport()
    t._links = {2: live, 3: dead} if order == "live first" else {3: dead, 2: live}
    t0 = time.monotonic()
    t._abort("reader-1 died")
    assert live_done.is_set() and dead_done.is_set()
    assert time.monotonic() - t0 < 2.0
    assert t._links == {}


def test_abort_waits_a_bounded_time_for_a_link_that_never_aborts(monkeypatch):
    """A link whose abort never returns is left to a background thread after ABORT_WAIT_S,
    with a warning, so the error that made the abort is raised."""
    from weightbus.transports import nccl

    monkeypatch.setattr(nccl, "ABORT_WAIT_S", 0.3)
    stuck = _Link(needs=threading.Event(), done=threading.Event(), wait_s=2.0)
    t = nccl.NcclTransport()
    t._links = {2: stuck}
    t0 = time.monotonic()
    t._abort("reader-1 died")
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert not stuck.done.is_set()


# ---------------------------------------------------------------------------------------------
# making the links at connect: several at once, started in the global order
# ---------------------------------------------------------------------------------------------


def _make_all(roster, at_once, order=None, stall_s=5.0, hold_s=0.0):
    """Every participant of ``roster`` a thread running make_in_order over its links, each
    link a two-party barrier (as NCCL makes a communicator: both ends block until both came),
    held ``hold_s`` once met; ``at_once`` and ``order`` (the link list as given) per name.
    Per name: None, or the exception raised; and per name the most links it had started and
    not finished at one time."""
    from weightbus.transports.nccl import make_in_order

    barriers = {
        prefix: threading.Barrier(2, timeout=stall_s * 3)
        for p in roster.all
        for _, prefix, _ in link_order(roster, p.name)
    }
    out: dict[str, BaseException | None] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()

    def participant(name):
        links = link_order(roster, name)
        if order is not None:
            links = order(name, links)
        busy = [0]

        def make(prefix):
            with lock:
                busy[0] += 1
                most[name] = max(most.get(name, 0), busy[0])
            barriers[prefix].wait()
            time.sleep(hold_s)
            with lock:
                busy[0] -= 1

        try:
            jobs = [lambda prefix=prefix: make(prefix) for _, prefix, _ in links]
            make_in_order(jobs, at_once(name), stall_s=stall_s)
            out[name] = None
        except BaseException as e:
            out[name] = e

    threads = [threading.Thread(target=participant, args=(p.name,)) for p in roster.all]
    for t in threads:
        t.start()
    for t in threads:
        t.join(stall_s * 6)
    assert not any(t.is_alive() for t in threads)
    return out, most


def _all_pairs(writers, readers):
    return Roster.of(
        [Participant(role="writer", rank=i, device=f"cuda:{i}") for i in range(writers)]
        + [Participant(role="reader", rank=i, device=f"cuda:{writers + i}") for i in range(readers)]
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "writers,readers,at_once",
    [(3, 4, {}), (2, 5, {"writer-0": 1, "reader-2": 2}), (4, 4, {"reader-0": 3, "writer-3": 1})],
)
def test_links_made_several_at_once_in_the_global_order_never_wait_for_ever(
    writers, readers, at_once
):
    """Every participant makes its links up to some number at a time (1 to its links, not
    alike: `$WEIGHTBUS_NCCL_CONNECT_AT_ONCE` may differ), started in link_order: every link
    is made, however their ends' numbers differ; a participant that may make 8 at once has
    more than one link in the making at once."""
    roster = _all_pairs(writers, readers)
    out, most = _make_all(roster, lambda name: at_once.get(name, 8), hold_s=0.05)
    assert out == dict.fromkeys(roster.names(), None)
    for name, n in at_once.items():
        assert most[name] <= n, (name, most)
    assert max(most[name] for name in roster.names() if name not in at_once) > 1, most


@pytest.mark.timeout(60)
def test_links_started_out_of_the_global_order_can_wait_for_ever():
    """The control for the test above: one link at a time, with writer-1 and reader-0
    starting theirs in reverse, each end waits for another link of its peer's (writer-0 on
    reader-0, reader-0 on writer-1, writer-1 on reader-1, reader-1 on writer-0): no link is
    made, and each participant gives up after the stall time, naming the links not made."""
    roster = _all_pairs(2, 2)

    def order(name, links):
        return links[::-1] if name in ("writer-1", "reader-0") else links

    out, _ = _make_all(roster, lambda name: 1, order=order, stall_s=0.5)
    for name, e in out.items():
        assert isinstance(e, TimeoutError), (name, e)
        assert e.args[1] == [0, 1], (name, e.args)


def test_make_in_order_raises_a_job_error_and_a_poll_error():
    from weightbus.transports.nccl import make_in_order

    ran = []

    def fail():
        raise RuntimeError("link 1 broke")

    with pytest.raises(RuntimeError, match="link 1 broke"):
        make_in_order([lambda: ran.append(0), fail, lambda: time.sleep(0.2)], 1, stall_s=5)
    assert ran == [0]

    def poll():
        raise ValueError("reader-3 reported a failure")

    gate = threading.Event()
    with pytest.raises(ValueError, match="reader-3"):
        make_in_order([lambda: gate.wait(5)], 2, stall_s=5, poll=poll)
    gate.set()
    make_in_order([], 4, stall_s=1)  # nothing to make


def test_participants_sharing_a_gpu_share_its_links_at_once():
    """CONNECT_AT_ONCE (16) over the participants on one's GPU: 8 writers on one GPU and 8
    readers on another make 2 each at once; a writer alone on its GPU with 16 readers on
    another 16 (each reader 1); a writer and a reader colocated on each GPU 8 each."""
    from weightbus.transports.nccl import CONNECT_AT_ONCE, connect_at_once

    assert CONNECT_AT_ONCE == 16

    def roster(writers, readers):
        return Roster.of(
            [Participant(role="writer", rank=i, device="cuda:0", gpu=g) for i, g in writers]
            + [Participant(role="reader", rank=i, device="cuda:0", gpu=g) for i, g in readers]
        )

    eight = roster([(i, "g0") for i in range(8)], [(i, "g1") for i in range(8)])
    assert {connect_at_once(eight, p.name) for p in eight.all} == {2}
    fan = roster([(0, "g0")], [(i, "g1") for i in range(16)])
    assert connect_at_once(fan, "writer-0") == 16
    assert {connect_at_once(fan, f"reader-{i}") for i in range(16)} == {1}
    colocated = roster([(i, f"g{i}") for i in range(4)], [(i, f"g{i}") for i in range(4)])
    assert {connect_at_once(colocated, p.name) for p in colocated.all} == {8}


@pytest.mark.parametrize("own", [True, False])
def test_each_link_rendezvous_on_a_connection_of_its_own(own):
    """Links' communicators are made at once, each waiting in the store for its peer's key. A
    store client serves one request at a time, so on one shared connection a link's wait
    holds back every other link's writes (until it times out: a deadlock where both ends
    wait, as Gloo's rendezvous does). On a connection of its own (``_own_connection``, as
    connect makes each link's store) another link writes at once, under the same prefix."""
    from datetime import timedelta

    import torch.distributed as dist

    from weightbus.transports.nccl import _own_connection

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
    base = dist.PrefixStore("nccl", client)
    conn = _own_connection if own else (lambda s: s)
    waiting, other = dist.PrefixStore("0-1", conn(base)), dist.PrefixStore("0-2", conn(base))
    got: list = []

    def wait_for_peer():
        try:
            got.append(waiting.get("peer"))
        except Exception as exc:  # (the shared connection: timed out)
            got.append(type(exc).__name__)

    t = threading.Thread(target=wait_for_peer, daemon=True)
    t.start()
    time.sleep(0.3)  # the first link waits for its peer's key
    t0 = time.perf_counter()
    try:
        other.set("mine", "1")
    except Exception:  # the shared connection's wait timed out under it
        pass
    took = time.perf_counter() - t0
    server.set("nccl/0-1/peer", "here")
    t.join(10)
    if own:
        assert took < 1.0, took
        assert got == [b"here"] and server.get("nccl/0-2/mine") == b"1"
    else:
        assert took > 2.0, took  # held back until the first link's wait timed out
