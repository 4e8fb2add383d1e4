"""The nccl transport's own logic in CI, on CPU (``tests/nccl_on_cpu.py``: Gloo in place of
NCCL, host stand-ins for CUDA streams and events): the transport contract, a peer killed mid
transfer and a peer's reported failure. NCCL's behaviour itself is the GPU tests' part
(``tests/test_gpu.py``)."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from tests import transport_contract

NAME = "test-nccl-on-cpu"


@pytest.mark.timeout(120)
def test_contract_nccl_logic_on_cpu():
    reports = transport_contract.run_contract(NAME)
    assert set(reports) == {"writer-0", "writer-1", "reader-0", "reader-1"}


@pytest.mark.timeout(120)
def test_contract_nccl_logic_on_cpu_one_link_at_a_time(monkeypatch):
    """The contract with each participant making its links one after another at connect
    (the default makes several at once; the stand-in makes a link's group at its first
    operation, blocking until the other end's, as NCCL does)."""
    monkeypatch.setenv("WEIGHTBUS_NCCL_CONNECT_AT_ONCE", "1")
    reports = transport_contract.run_contract(NAME)
    assert set(reports) == {"writer-0", "writer-1", "reader-0", "reader-1"}


@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer_nccl_logic_on_cpu():
    reports = transport_contract.run_peer_death(NAME)
    assert max(r["detect_s"] for r in reports.values() if "detect_s" in r) < (
        transport_contract.DETECT_S
    )


@pytest.mark.timeout(120)
def test_peer_reported_failure_nccl_logic_on_cpu():
    reports = transport_contract.run_peer_failure(NAME)
    assert max(r["detect_s"] for r in reports.values()) < transport_contract.DETECT_S


def test_the_stand_in_is_never_chosen_automatically():
    from weightbus.transports.base import transport_class

    assert transport_class(NAME).priority < 0


# ---------------------------------------------------------------------------------------------
# Writer and Readers over it (threads of this process)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def nccl_stand_ins(monkeypatch):
    """The nccl module pointed at the CPU stand-ins for this test alone."""
    from tests import nccl_on_cpu
    from weightbus.transports import nccl

    for name, value in nccl_on_cpu.stand_ins().items():
        monkeypatch.setattr(nccl, name, value)
    monkeypatch.setattr(nccl_on_cpu._GlooAsNccl, "groups", 0)
    return nccl_on_cpu._GlooAsNccl


_MARKED = threading.local()  # the thread of the one participant a test sets apart


def _marked() -> bool:
    return getattr(_MARKED, "on", False)


def _job(syncs: int, extra: dict | None = None, marked: str | None = None) -> dict:
    """Writer-0 and readers 0 and 1 (engine replicas) over the nccl transport's logic, for
    ``syncs`` syncs, each reader's tensors poisoned before each; ``marked``: the participant
    whose thread is marked (:func:`_marked`). Per participant: the writer's transport class
    name, a reader's bytes off per sync, or the exception raised."""
    from tests.test_transport_links import MODEL, _canonical, _reader_syncs, _writer
    from tests.threads import run_threads
    from weightbus import Writer
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    model = model_spec(MODEL)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"nccl-cpu-{uuid.uuid4().hex[:6]}"

    def configs():
        from tests.test_faults_membership import configs

        return configs(
            store.port, 1, 2, job, transport=NAME, sync_timeout=timedelta(seconds=15),
            **(extra or {}),
        )  # fmt: skip

    def writer():
        # (in the readers' dtype: buckets go in place on both ends, where groups form)
        bound = _writer(model, 0, 1, dtype="bfloat16")
        with Writer(bound, *configs()) as w:
            for v in range(1, syncs + 1):
                fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
                w.sync(v)
            return type(w.transport).__name__

    def mark(name, body):
        def go():
            _MARKED.on = name == marked
            return body()

        return go

    bodies = {"writer-0": writer}
    bodies.update({f"reader-{r}": _reader_syncs(model, r, None, configs, syncs) for r in (0, 1)})
    return run_threads({name: mark(name, body) for name, body in bodies.items()})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["plain", "delta", "reader-1 ungrouped"])
def test_writer_and_readers_over_the_nccl_logic_are_bit_exact(nccl_stand_ins, monkeypatch, case):
    """One writer, two engine replicas, a few syncs over the nccl transport's logic: in-place
    buckets posted as groups (both ends agreeing at connect), or, with a delta codec, every
    bucket alone, or with $WEIGHTBUS_NCCL_GROUPS=0 on one reader, its buckets alone and the
    other's in groups; each reader's poisoned tensors bit exact after each sync."""
    from weightbus import DeltaConfig
    from weightbus.transports import nccl

    syncs = 3
    real_env, real_end = nccl.env_int, nccl_stand_ins._end_coalescing
    sizes: list[tuple[bool, int]] = []  # per posted group: (marked thread, operations)

    def end(link):
        sizes.append((_marked(), link._grouped or 0))
        return real_end(link)

    monkeypatch.setattr(nccl_stand_ins, "_end_coalescing", end)
    monkeypatch.setattr(
        nccl,
        "env_int",
        lambda name, default: (
            0 if _marked() and name == "WEIGHTBUS_NCCL_GROUPS" else real_env(name, default)
        ),
    )
    extra = {"delta": DeltaConfig(checksum_every=2)} if case == "delta" else {}
    out = _job(syncs, extra, marked="reader-1" if case == "reader-1 ungrouped" else None)
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    assert out["writer-0"] == "NcclOnCpu"
    assert out["reader-0"] == out["reader-1"] == [0] * syncs
    if case == "delta":
        assert nccl_stand_ins.groups == 0  # a codec's side posts every bucket alone
    else:
        assert nccl_stand_ins.groups > 0  # the in-place buckets went in groups
    if case == "reader-1 ungrouped":
        # its operations alone (each an NCCL group of one, as its peers post them)
        mine = [n for marked, n in sizes if marked]
        assert mine and max(mine) == 1, sizes


@pytest.mark.timeout(120)
def test_a_reader_whose_pytorch_has_no_groups_posts_singly_with_its_writer(
    nccl_stand_ins, monkeypatch
):
    """One reader whose PyTorch posts no NCCL groups, the others grouping: a group (even of
    one) and an operation alone go through different NCCL communicators and would wait for
    each other for good, so the ends of each link settle at connect: the writer posts
    singly to that reader and in groups to the other; every sync bit exact. (Participants
    used to have to agree, so such a reader, joining, failed the job's connect for all.)"""
    real = nccl_stand_ins._start_coalescing

    def start(link):
        if _marked():
            raise TypeError("_start_coalescing() takes 2 positional arguments but 1 was given")
        return real(link)

    monkeypatch.setattr(nccl_stand_ins, "_start_coalescing", start)
    nccl_stand_ins.grouped.clear()
    out = _job(3, marked="reader-1")
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    assert out["reader-0"] == out["reader-1"] == [0] * 3
    # writer-0 is global rank 0, reader-0 1, reader-1 2: only the link to reader-0 grouped
    assert nccl_stand_ins.grouped == {"0-1"}, nccl_stand_ins.grouped


@pytest.mark.timeout(120)
def test_each_link_asks_its_share_of_the_channels(nccl_stand_ins, monkeypatch):
    """Writer-0's two links (to the two readers) ask 32 / 2 channels each; with
    $WEIGHTBUS_NCCL_CHANNELS=0 on every participant, NCCL's own choice (nothing set)."""
    nccl_stand_ins.channels.clear()
    out = _job(1)
    assert all(not isinstance(got, BaseException) for got in out.values()), out
    assert sorted(nccl_stand_ins.channels.items()) == [("0-1", {16}), ("0-2", {16})]
    nccl_stand_ins.channels.clear()
    monkeypatch.setenv("WEIGHTBUS_NCCL_CHANNELS", "0")
    out = _job(1)
    assert all(not isinstance(got, BaseException) for got in out.values()), out
    assert sorted(nccl_stand_ins.channels.items()) == [("0-1", {-1}), ("0-2", {-1})]
    monkeypatch.setenv("WEIGHTBUS_NCCL_CHANNELS", "-4")
    out = _job(1)
    for name, got in out.items():
        assert isinstance(got, ValueError) and "WEIGHTBUS_NCCL_CHANNELS=-4" in str(got), (name, got)


@pytest.mark.timeout(120)
def test_ends_with_other_channel_budgets_settle_per_link(nccl_stand_ins, monkeypatch):
    """One reader with $WEIGHTBUS_NCCL_CHANNELS=8, the others at the default: writer-0 offers
    each of its two links 32 / 2, reader-1 its one link 8, so that link asks 8 on both ends
    and the other 16; bit exact. (Participants used to have to agree on the budget.)"""
    from weightbus.transports import nccl

    real_env = nccl.env_int
    monkeypatch.setattr(
        nccl,
        "env_int",
        lambda name, default: (
            8 if _marked() and name == "WEIGHTBUS_NCCL_CHANNELS" else real_env(name, default)
        ),
    )
    nccl_stand_ins.channels.clear()
    out = _job(2, marked="reader-1")
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    assert out["reader-0"] == out["reader-1"] == [0] * 2
    assert sorted(nccl_stand_ins.channels.items()) == [("0-1", {16}), ("0-2", {8})]


ALL_LINKS = ((0, 0), (0, 1), (1, 0), (1, 1))
# reader-0 says it is another process: its links are cpu_same_host, reader-1's cpu_same_process
PER_LINK = {"cpu_same_host": NAME, "cpu_same_process": "local"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "transport,pack_mixed,packed",
    [
        (NAME, True, ALL_LINKS),
        (NAME, False, ()),
        ("gloo", True, ()),
        (PER_LINK, True, ((0, 0), (1, 0))),
    ],
)
def test_fsdp_to_tensor_parallel_packs_mixed_links_over_nccl(
    nccl_stand_ins, monkeypatch, transport, pack_mixed, packed
):
    """FSDP on 2 writers -> tensor parallel 2: every link carries a large row-parallel route
    strided on its writer (a mixed link). Over the nccl transport (its logic on CPU) the job
    is planned with every route of those links packed (``SyncConfig.pack_mixed``, on by
    default), alike on every participant; with it off, or over gloo, large routes travel
    alone; in a job mixing it with the local transport (a pulling one, as CUDA IPC), only its
    links pack. Each reader's poisoned tensors bit exact after each of 3 syncs. Each
    participant plans once (the transport is chosen from the plan's links before its
    buckets)."""
    from tests.test_faults_membership import configs
    from tests.test_transport_links import MODEL, _canonical, _off, _poison, _writer
    from tests.threads import run_threads
    from weightbus import BoundLayout, Reader, Writer
    from weightbus.layouts.families import model_spec
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate, fill_from_canonical
    from weightbus.spec import Participant, this_process

    model = model_spec(MODEL)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"nccl-cpu-mixed-{uuid.uuid4().hex[:6]}"
    syncs = 3
    from weightbus import _session

    planned = []  # (list.append is atomic across threads)
    make_plan = _session.make_plan

    def counted(*args, **kwargs):
        planned.append(threading.current_thread().name)
        return make_plan(*args, **kwargs)

    monkeypatch.setattr(_session, "make_plan", counted)

    def cfg():
        return configs(
            store.port, 2, 2, job, transport=transport, direct_bytes=2048,
            pack_mixed=pack_mixed, sync_timeout=timedelta(seconds=15),
        )  # fmt: skip

    def writer(rank):
        def body():
            bound = _writer(model, rank, 2)
            with Writer(bound, *cfg()) as w:
                for v in range(1, syncs + 1):
                    fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
                    w.sync(v)
                return w.plan

        return body

    def reader(rank):
        def body():
            process = f"{this_process()}-elsewhere" if rank == 0 else None
            me = Participant(role="reader", rank=rank, process=process)
            layout = engine_layout(model, me, tp=2, tp_rank=rank, dtype="bfloat16")
            bound = BoundLayout(layout=layout, tensors=allocate(layout))
            with Reader(bound, *cfg()) as r:
                offs = []
                for _ in range(syncs):
                    _poison(r)
                    res = r.wait()
                    offs.append(_off(layout, r.live, model, res.version))
                return r.plan, offs

        return body

    bodies = {f"writer-{i}": writer(i) for i in range(2)}
    bodies.update({f"reader-{i}": reader(i) for i in range(2)})
    out = run_threads(bodies)
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    plans = [out["writer-0"], out["writer-1"], out["reader-0"][0], out["reader-1"][0]]
    assert len({p.digest for p in plans}) == 1
    plan = plans[0]
    assert plan.stats.mixed_links == ALL_LINKS
    assert plan.stats.packed_links == packed
    assert plan.options.pack_mixed is (packed == ALL_LINKS)
    assert len(planned) == 4, planned
    assert out["reader-0"][1] == out["reader-1"][1] == [0] * syncs
