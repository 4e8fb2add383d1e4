"""The CUDA transports' helpers, checked on CPU: copy_job turns a region copy into one 2-D
memcpy (replayed on CPU); a waiting thread completes NCCL handles itself (EventPoller.settle,
Transport.wait) instead of waiting for the poller thread to be scheduled."""

from __future__ import annotations

import collections
import random
import time
from datetime import timedelta
from types import SimpleNamespace

import torch

from weightbus.spec import Participant
from weightbus.transports._cuda import EventPoller, copy_job
from weightbus.transports.base import Handle, Transport


def _replay(job, dst_base: torch.Tensor, src_base: torch.Tensor) -> None:
    """Run a (dst, dpitch, src, spitch, width, rows) job on CPU tensors' bytes."""
    dst, dpitch, src, spitch, width, rows = job
    d = dst_base.view(-1).view(torch.uint8)
    s = src_base.view(-1).view(torch.uint8)
    do, so = dst - dst_base.data_ptr(), src - src_base.data_ptr()
    for r in range(rows):
        d[do + r * dpitch : do + r * dpitch + width] = s[so + r * spitch : so + r * spitch + width]


def _region(shape: tuple[int, ...], rng: random.Random) -> tuple[slice, ...]:
    out = []
    for n in shape:
        a = rng.randrange(n)
        out.append(slice(a, rng.randrange(a + 1, n + 1)))
    return tuple(out)


def test_copy_job_equals_copy_on_random_regions():
    rng = random.Random(0)
    seen_2d = seen_none = 0
    for _ in range(400):
        nd = rng.choice([1, 2, 3])
        shape = tuple(rng.randint(1, 7) for _ in range(nd))
        src_base = torch.randn(*shape).to(torch.bfloat16)
        region = _region(shape, rng)
        ext = tuple(s.stop - s.start for s in region)
        # the destination region sits somewhere in a tensor of its own, maybe wider
        dshape = tuple(e + rng.randint(0, 3) for e in ext)
        dst_base = torch.full(dshape, float("nan"), dtype=torch.bfloat16)
        at = tuple(
            slice(o, o + e)
            for o, e in zip(
                (rng.randint(0, d - e) for d, e in zip(dshape, ext, strict=True)), ext, strict=True
            )
        )
        want = dst_base.clone()
        want[at].copy_(src_base[region])
        job = copy_job(dst_base[at], src_base[region])
        if job is None:
            seen_none += 1
            continue
        seen_2d += job[5] > 1
        _replay(job, dst_base, src_base)
        assert torch.equal(dst_base.view(torch.int16), want.view(torch.int16)), (
            shape,
            region,
            dshape,
            at,
            job,
        )
    assert seen_2d > 50 and seen_none > 10  # both paths were exercised


def test_copy_job_refuses_casts_and_broadcasts():
    a = torch.zeros(4, 4)
    assert copy_job(a, a.to(torch.float64)) is None
    assert copy_job(a, torch.zeros(1, 4).expand(4, 4)) is None
    src = torch.zeros(4, 4)
    assert copy_job(a[:, :2], src[:, 2:]) == (a.data_ptr(), 16, src.data_ptr() + 8, 16, 8, 4)


def _writer_tables(writers: str, readers: str) -> tuple[dict, object, object]:
    """What each writer of a tiny-llama plan would post at expose (without sharing memory)."""
    from weightbus.control.store import Roster
    from weightbus.layouts.describe import build_layouts
    from weightbus.layouts.families import model_spec
    from weightbus.plan import PlanOptions, build_program, make_plan
    from weightbus.transports.cuda_ipc import _bucket_rows

    model = model_spec("tiny-llama", dtype="bfloat16")
    plan = make_plan(
        build_layouts(model, writers, "writer"),
        build_layouts(model, readers, "reader"),
        PlanOptions(bucket_bytes=1 << 20, direct_bytes=4096),
    )
    tables = {}
    for w in plan.writers:
        _, buckets = _bucket_rows(build_program(plan, "writer", w.rank))
        tables[w.name] = {"buckets": buckets}
    return tables, Roster.of(plan.participants), plan


def test_replicas_are_chained_bucket_by_bucket():
    """1 writer -> 3 identical engine replicas: the 2nd pulls every bucket from the 1st, the
    3rd from the 2nd; nothing is relayed between readers of different layouts."""
    from weightbus.transports.cuda_ipc import _relays

    tables, roster, plan = _writer_tables("whole", "vllm:tp=1,dp=3")
    up = _relays(tables, roster)
    r0, r1, r2 = (roster.global_rank(r.name) for r in plan.readers)
    per_reader = {
        r: [b for b in tables[plan.writers[0].name]["buckets"] if b[0] == r] for r in (r0, r1, r2)
    }
    assert len(per_reader[r0]) == len(per_reader[r1]) == len(per_reader[r2]) > 10
    assert not any(k[0] == r0 for k in up)  # the first replica pulls from the writer
    for reader, before in ((r1, r0), (r2, r1)):
        for peer, tag, _nbytes, _copies in per_reader[reader]:
            assert up[(peer, tag)][0] == before and up[(peer, tag)][2] == 0
    # two tensor-parallel ranks hold different halves: no bucket of one is another's
    tables, roster, _ = _writer_tables("whole", "vllm:tp=2")
    assert _relays(tables, roster) == {}


class _Stream:
    """Records which streams a stream was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name, self.waits = name, []

    def wait_stream(self, other) -> None:
        self.waits.append(other.name)


def test_pulls_are_queued_source_by_source_in_issue_order(monkeypatch):
    """However the reader posts its pulls, each source's buckets are queued in issue order
    (``position``), one source after the other, and the next sync starts over."""
    from types import SimpleNamespace

    from weightbus.transports import cuda_ipc

    sources = [SimpleNamespace(name=n, stream=_Stream(n), side=_Stream(n + "/side")) for n in "abc"]
    counts = [3, 1, 4]
    buckets, issued = {}, []
    for s, (src, n) in enumerate(zip(sources, counts, strict=True)):
        for pos in range(n):
            b = SimpleNamespace(source=src, position=pos, nbytes=1)
            buckets[(s, 10 * s + (n - 1 - pos))] = b  # tags run against positions
    t = cuda_ipc.CudaIpcTransport.__new__(cuda_ipc.CudaIpcTransport)
    t.roster = SimpleNamespace(global_rank=lambda name: "abc".index(name))
    t._buckets, t._order, t._counts = buckets, sources, counts
    t._stage_of = {src.name: i for i, src in enumerate(sources)}
    t._held, t._cursor, t._stage = [{} for _ in sources], [0] * 3, 0
    t._pulled, t._sync, t._waited, t._device, t._graphs = 0, 0, set(), None, 0
    main = _Stream("main")
    monkeypatch.setattr(cuda_ipc.torch.cuda, "current_stream", lambda device: main)

    def issue(b, handle):
        issued.append((b.source.name, b.position))
        t._pulled += 1

    monkeypatch.setattr(t, "_issue", issue)
    rng = random.Random(5)
    for sync in range(2):
        keys = list(buckets)
        rng.shuffle(keys)
        for peer, tag in keys:
            t._pull(SimpleNamespace(peer=SimpleNamespace(name="abc"[peer]), tag=tag))
        want = [(n, p) for n, c in zip("abc", counts, strict=True) for p in range(c)]
        assert issued == want, (sync, issued)
        assert t._sync == sync + 1 and t._stage == 0 and not any(t._held)
        issued.clear()
    # each next source's streams waited for the one before it
    assert "a" in sources[1].stream.waits and "b" in sources[2].stream.waits


def test_replicated_tensors_are_relayed_only_where_that_cuts_the_writers_bytes():
    """Two tensor-parallel ranks that both hold a replicated tensor (an embedding) from one
    writer: each takes in as much as the writer sends either way, so no chain; three whole
    replicas: the writer would send 3x what a reader takes in, so the chains stay."""
    from weightbus.control.store import Roster
    from weightbus.spec import Participant
    from weightbus.transports.cuda_ipc import _relays, relay_pays

    w = Participant(role="writer", rank=0)
    rs = [Participant(role="reader", rank=i) for i in range(3)]
    roster = Roster.of([w, *rs])
    r0, r1, r2 = (roster.global_rank(r.name) for r in rs)
    emb = [[0, [[0, 1024], [0, 64]], 0, 131072]]  # the same regions for both ranks
    tp = {  # a replicated embedding bucket each, then each rank's own half of the rest
        w.name: {
            "buckets": [
                [r0, 0, 131072, emb],
                [r0, 1, 1 << 20, [[1, [[0, 512]], 0, 1 << 20]]],
                [r1, 2, 131072, emb],
                [r1, 3, 1 << 20, [[1, [[512, 1024]], 0, 1 << 20]]],
            ]
        }
    }
    assert _relays(tp, roster) == {}
    replicas = {w.name: {"buckets": [[r, r, 1 << 20, emb] for r in (r0, r1, r2)]}}
    assert _relays(replicas, roster) == {(r1, r1): (r0, r0, 0), (r2, r2): (r1, r1, 0)}
    # the rule itself: 3 GB out instead of 1 GB, readers taking 1 GB each: relay
    assert relay_pays(3 << 30, 1 << 30, 1 << 30)
    # S4e's writers: 8.55 GB out without relays, 8.03 with, each reader taking 8.56 in: no
    assert not relay_pays(855 << 20, 803 << 20, 856 << 20)


class _Event:
    """Stands for the CUDA event recorded after a handle's NCCL work."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        time.sleep(0)  # lets the other thread run, as a call into CUDA may
        return self.finished


class _Polled(Transport):
    """Just enough of a transport for wait(): its handles complete through an EventPoller."""

    name = "test-polled"
    devices = frozenset({"cpu"})

    def __init__(self) -> None:
        super().__init__(timedelta(seconds=5))
        self._state = "connected"  # wait() needs no more of connect()
        self.control = SimpleNamespace(raise_if_failed=lambda: None)
        self.completions: list[Handle] = []
        self.poller = EventPoller(self)

    def _completed(self, handle: Handle, error: BaseException | None = None) -> None:
        self.completions.append(handle)  # list.append: safe from both threads
        super()._completed(handle, error)

    def _settle(self, handle: Handle) -> None:
        self.poller.settle(handle)

    def handle(self) -> tuple[Handle, _Event]:
        h = Handle("send", Participant(role="reader", rank=0), 0, 8)
        event = _Event()
        h.native = (None, event, None)
        self.poller.add(h)
        return h, event


def test_a_waiting_thread_settles_handles_without_the_poller():
    t = _Polled()
    t.poller.close()  # its thread is gone: only the waiting thread can complete handles now
    assert not t.poller.thread.is_alive()
    h, event = t.handle()
    t.poller.settle(h)
    assert not h.done() and t.poller.items == [h]  # not finished: left to the poller
    event.finished = True
    start = time.monotonic()
    t.wait([h], timedelta(seconds=2))
    assert h.done() and h.error is None and t.poller.items == []
    assert time.monotonic() - start < 0.5
    t.poller.settle(h)  # again, once done: nothing happens
    assert h.done() and h.error is None


def test_the_poller_still_completes_handles_nobody_waits_for():
    t = _Polled()
    try:
        h, event = t.handle()
        event.finished = True
        deadline = time.monotonic() + 2
        while not h.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert h.done() and t.poller.items == []
    finally:
        t.poller.close()


def test_each_handle_is_completed_once_by_the_poller_or_the_waiting_thread():
    # subclasses act on completion (the fault tests flip a received byte there): never twice
    t = _Polled()
    try:
        handles = []
        for _ in range(300):
            h, event = t.handle()
            event.finished = True
            handles.append(h)
            t.poller.settle(h)  # races the poller thread, which sees the same events
        t.wait(handles, timedelta(seconds=2))
        assert sorted(map(id, t.completions)) == sorted(map(id, handles))
    finally:
        t.poller.close()


def test_the_poller_asks_only_each_links_oldest_operation_and_each_event_once():
    """Operations of one link complete in posting order (one stream), so a round asks the
    oldest pending one of each peer only, and an event shared by a group once: a round
    costs a query per link, however many handles are pending (~300 pieces of a delta sync)."""
    t = _Polled()
    try:
        asked: collections.Counter = collections.Counter()

        class Counted(_Event):
            def query(self) -> bool:
                asked[id(self)] += 1
                return super().query()

        links = {}
        for rank in (0, 1):
            peer = Participant(role="reader", rank=rank)
            shared = Counted()  # the first two: one group, one event
            events = [shared, shared, *(Counted() for _ in range(100))]
            handles = [Handle("send", peer, i, 8) for i in range(len(events))]
            for h, e in zip(handles, events, strict=True):
                h.native = (None, e, None)
            t.poller.add_many(handles)
            links[rank] = (handles, events)
        time.sleep(0.05)  # many rounds
        for _, events in links.values():
            assert asked[id(events[0])] > 3  # the oldest: asked every round
            assert not any(asked[id(e)] for e in events[2:])  # the others: never yet
        # rounds ask each event once: the shared one as often as the round count, no more
        rounds = max(asked.values())
        assert all(n <= rounds for n in asked.values())
        for _, events in links.values():  # they finish in order
            for e in events:
                e.finished = True
        t.wait([h for handles, _ in links.values() for h in handles], timedelta(seconds=2))
        assert len(t.completions) == 204
    finally:
        t.poller.close()
