"""A transport per link: link classes, the choice and its overrides, the local transport, and
jobs mixing transports (threads of this process, CPU).

GPU identities are fake UUIDs in the Participant fields, and the GPU transports' CUDA checks
are patched where a choice among them is tested: nothing here needs a GPU.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import uuid
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.threads import run_threads
from weightbus.control.store import PARTICIPANT, ControlConfig, ControlPlane, check_message
from weightbus.errors import PlanMismatch, ProtocolError, WeightbusError
from weightbus.spec import Participant, this_process
from weightbus.transports import base
from weightbus.transports.base import TRANSPORT_ENV, Program, select_transport, transport_class
from weightbus.transports.links import (
    LINK_CLASSES,
    LinksTransport,
    build_transport,
    check_choice,
    choose_links,
    link_class,
)
from weightbus.transports.local import LocalTransport

A, B, C = (f"{i:08x}-0000-0000-0000-00000000000{i}" for i in (1, 2, 3))  # fake GPU UUIDs


def _p(role: str, rank: int, device: str = "cpu", host: str = "h0", **kw) -> Participant:
    return Participant(role=role, rank=rank, device=device, host=host, **kw)


@pytest.fixture
def gpus(monkeypatch):
    """The GPU transports' own checks pass on this CPU machine (choices only: nothing runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)


# ---------------------------------------------------------------------------------------------
# identity and link classes
# ---------------------------------------------------------------------------------------------


def test_participant_carries_gpu_and_process_through_dicts_and_the_control_schema():
    me = _p("writer", 0)
    assert me.gpu == "" and me.process == this_process()  # CPU: no GPU; this process
    assert _p("reader", 0, "cuda:3").gpu == ""  # no CUDA here: unknown, never made up
    other = _p("reader", 1, "cuda:0", gpu=A, process="77-abc")
    d = other.to_dict()
    assert d["gpu"] == A and d["process"] == "77-abc"
    assert Participant.from_dict(d) == other
    assert check_message(d, PARTICIPANT, "reader 'reader-1'", "member/reader/1") == d
    # a dict from an older weightbus: unknown identities, not this process's
    old = {k: v for k, v in d.items() if k not in ("gpu", "process")}
    assert Participant.from_dict(old).gpu == "" and Participant.from_dict(old).process == ""
    # on the control plane, a peer without the fields is refused, saying what is missing
    with pytest.raises(ProtocolError, match=r"fields.*'gpu'.*'process'|the protocol has"):
        check_message(old, PARTICIPANT, "reader 'reader-1'", "member/reader/1")
    with pytest.raises(TypeError, match="gpu=3 must be a str"):
        Participant(role="reader", rank=0, gpu=3)


def test_this_process_is_one_id_for_every_thread_and_another_in_a_child():
    ids = set()
    threads = [threading.Thread(target=lambda: ids.add(this_process())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ids == {this_process()}
    child = subprocess.run(
        [sys.executable, "-c", "from weightbus.spec import this_process; print(this_process())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() not in ("", this_process())


@pytest.mark.parametrize(
    "writer, reader, kind",
    [
        # CUDA_VISIBLE_DEVICES differ: both say cuda:0, on two GPUs
        (dict(device="cuda:0", gpu=A), dict(device="cuda:0", gpu=B), "same_host"),
        # ... or cuda:0 and cuda:1 on one GPU
        (dict(device="cuda:0", gpu=A), dict(device="cuda:1", gpu=A), "same_gpu"),
        (dict(device="cuda:2", gpu=C), dict(device="cuda:2", gpu=C), "same_gpu"),
        # a UUID unknown (older peer): the device string decides, as before
        (dict(device="cuda:0", gpu=A), dict(device="cuda:0", gpu=""), "same_gpu"),
        (dict(device="cuda:0"), dict(device="cuda:1"), "same_host"),
        (dict(device="cuda", gpu=""), dict(device="cuda:0", gpu=""), "same_gpu"),
        # another host is another host, whatever the UUIDs say
        (dict(device="cuda:0", gpu=A), dict(device="cuda:0", gpu=A, host="h1"), "cross_host"),
        (dict(), dict(), "cpu_same_process"),
        (dict(process="1-a"), dict(process="2-b"), "cpu_same_host"),
        (dict(process=""), dict(process=""), "cpu_same_host"),  # unknown: not one process
        (dict(), dict(host="h1"), "cpu_cross_host"),
        (dict(), dict(device="cuda:0", gpu=A), "cpu_gpu"),
        (dict(device="cuda:1", gpu=B), dict(host="h9"), "cpu_gpu"),
    ],
)
def test_link_classes(writer, reader, kind):
    assert kind in LINK_CLASSES
    assert link_class(_p("writer", 0, **writer), _p("reader", 0, **reader)) == kind


def test_every_class_has_a_capability_rule():
    for kind in LINK_CLASSES:
        transport_class("gloo").carries(kind)  # raises for an unknown class
    with pytest.raises(ValueError, match="unknown link class 'same_rack'"):
        transport_class("gloo").carries("same_rack")
    assert transport_class("cuda_ipc").carries("same_gpu")
    assert not transport_class("nccl").carries("same_gpu")
    assert transport_class("local").carries("cpu_same_process")
    assert not transport_class("local").carries("cpu_same_host")
    assert transport_class("rdma").carries("cpu_gpu") and transport_class("rdma").priority < 0


# ---------------------------------------------------------------------------------------------
# the choice
# ---------------------------------------------------------------------------------------------


def _gpu_job() -> list[Participant]:
    """One writer on GPU A of host h0; readers colocated on A (but saying cuda:1: other
    CUDA_VISIBLE_DEVICES), on GPU B of h0, and on host h1."""
    return [
        _p("writer", 0, "cuda:0", gpu=A),
        _p("reader", 0, "cuda:1", gpu=A),
        _p("reader", 1, "cuda:2", gpu=B),
        _p("reader", 2, "cuda:0", gpu=C, host="h1"),
    ]


def test_automatic_choice_per_link_class(gpus, caplog):
    choice = choose_links(_gpu_job())
    kinds = {(x.writer, x.reader): (x.kind, x.transport) for x in choice.links}
    assert kinds == {
        ("writer-0", "reader-0"): ("same_gpu", "cuda_ipc"),
        ("writer-0", "reader-1"): ("same_host", "cuda_ipc"),
        ("writer-0", "reader-2"): ("cross_host", "nccl"),
    }
    assert choice.single is None and choice.transports == ("cuda_ipc", "nccl")
    assert choice.groups() == (
        ("cuda_ipc", ("writer-0", "reader-0", "reader-1")),
        ("nccl", ("writer-0", "reader-2")),
    )
    assert choice.pulling() == {"same_gpu": "cuda_ipc", "same_host": "cuda_ipc"}
    t = select_transport("auto", _gpu_job())
    assert isinstance(t, LinksTransport) and t.choice == choice
    # with codecs the pushing transport serves the same-host link; one GPU has none
    job = _gpu_job()
    pushing = choose_links([job[0], job[2], job[3]], push_only=True)
    assert {x.transport for x in pushing.links} == {"nccl"} and pushing.single == "nccl"
    with pytest.raises(ValueError, match=r"same_gpu links.*cuda_ipc pulls.*codecs"):
        choose_links(job[:2], push_only=True)


def test_a_one_host_transport_serves_each_host_apart(gpus):
    """Two hosts, each with a trainer GPU and an engine GPU, and the engines read from both
    trainers: CUDA IPC on each host (two groups, one per host), NCCL between the hosts (a
    group per set of participants its links connect)."""
    job = [
        _p("writer", 0, "cuda:0", gpu=A),
        _p("writer", 1, "cuda:0", gpu=C, host="h1"),
        _p("reader", 0, "cuda:1", gpu=B),
        _p("reader", 1, "cuda:1", gpu="d", host="h1"),
    ]
    choice = choose_links(job)
    assert choice.groups() == (
        ("cuda_ipc", ("writer-0", "reader-0")),
        ("cuda_ipc", ("writer-1", "reader-1")),
        ("nccl", ("writer-0", "reader-1")),
        ("nccl", ("writer-1", "reader-0")),
    )
    # colocated pairs on two hosts, each engine reading the other host's trainer: the NCCL
    # links form two groups, so no NCCL group holds two processes of one GPU
    colocated = [
        _p("writer", 0, "cuda:0", gpu=A),
        _p("writer", 1, "cuda:0", gpu=C, host="h1"),
        _p("reader", 0, "cuda:0", gpu=A),
        _p("reader", 1, "cuda:0", gpu=C, host="h1"),
    ]
    choice = choose_links(colocated)
    assert [g for g in choice.groups() if g[0] == "nccl"] == [
        ("nccl", ("writer-0", "reader-1")),
        ("nccl", ("writer-1", "reader-0")),
    ]
    # one transport over two hosts that cannot span them: one group per host, not "single"
    apart = [job[0], job[2]], [job[1], job[3]]
    links = [(w, r) for w, r in apart]
    two = choose_links(job, links=links)
    assert two.single is None and [g[0] for g in two.groups()] == ["cuda_ipc", "cuda_ipc"]


def test_colocated_trainer_and_engine_on_every_gpu_of_three_hosts(gpus):
    """A trainer and an engine process on each GPU (one GPU on each of three hosts), every
    engine reading from every trainer: CUDA IPC on each GPU, NCCL between the hosts, one NCCL
    group of all six processes, each GPU's two in it (a link per writer-reader pair, none
    between the two of one GPU). NCCL used to refuse a group holding two processes of one GPU,
    which left such a job no transport."""
    job = []
    for h, gpu in enumerate((A, B, C)):
        job += [_p(role, h, "cuda:0", gpu=gpu, host=f"h{h}") for role in ("writer", "reader")]
    choice = choose_links(job)
    assert [g for g in choice.groups() if g[0] == "cuda_ipc"] == [
        ("cuda_ipc", (f"writer-{h}", f"reader-{h}")) for h in range(3)
    ]
    nccl = [g for g in choice.groups() if g[0] == "nccl"]
    assert nccl == [("nccl", tuple(f"{r}-{h}" for r in ("writer", "reader") for h in range(3)))]
    assert {(x.writer, x.reader) for x in choice.links if x.transport == "nccl"} == {
        (f"writer-{w}", f"reader-{r}") for w in range(3) for r in range(3) if w != r
    }
    # one transport by name for every link: refused, naming what it cannot serve and the fix
    # (no single transport serves both classes; one per class, where it serves one)
    per_class = r"no one transport serves every link.*per link class \(same_gpu, cross_host\)"
    with pytest.raises(ValueError, match=rf"'nccl' was asked for but.*same_gpu.*{per_class}"):
        choose_links(job, transport="nccl")
    with pytest.raises(ValueError, match=rf"{per_class}, e\.g\..*'same_gpu': 'cuda_ipc'"):
        choose_links(job, transport="cuda_ipc")
    with pytest.raises(ValueError, match=rf"gloo moves \['cpu'\].*{per_class}$"):
        choose_links(job, transport="gloo")
    # two engine replicas on one GPU, both reading from a trainer on another: nccl alone
    replicas = [
        _p("writer", 0, "cuda:0", gpu=A),
        *(_p("reader", r, "cuda:1", gpu=B) for r in (0, 1)),
    ]
    assert choose_links(replicas, transport="nccl").single == "nccl"


def test_one_transport_for_every_link_is_that_transport_alone(gpus):
    one_host = _gpu_job()[:3]
    t = select_transport(None, one_host)
    assert type(t) is transport_class("cuda_ipc")
    t = select_transport("nccl", [_gpu_job()[0], _gpu_job()[2], _gpu_job()[3]])
    assert type(t) is transport_class("nccl")
    # the CPU jobs of the rest of the suite: gloo, whether the participants are threads of
    # one process or not (local is never automatic)
    assert type(select_transport(None, [_p("writer", 0), _p("reader", 0)])).__name__ == (
        "GlooTransport"
    )


def test_every_process_makes_the_same_choice(gpus):
    job = _gpu_job()
    mine = choose_links(job)
    # another order, and the participants as another process reads them from the store
    again = choose_links([Participant.from_dict(p.to_dict()) for p in reversed(job)])
    assert again.links == mine.links and again.digest() == mine.digest()
    # another process altogether (another process id, CUDA patched the same way)
    code = (
        "import json, sys, torch, torch.distributed as dist\n"
        "torch.cuda.is_available = lambda: True\n"
        "dist.is_nccl_available = lambda: True\n"
        "from weightbus.spec import Participant\n"
        "from weightbus.transports.links import choose_links\n"
        "people = [Participant.from_dict(d) for d in json.load(sys.stdin)]\n"
        "print(choose_links(people).digest())\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([p.to_dict() for p in job]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == mine.digest()


def test_override_per_link_class(gpus, monkeypatch):
    job = _gpu_job()
    choice = choose_links(job, transport={"same_host": "nccl"})
    got = {x.kind: x.transport for x in choice.links}
    assert got == {"same_gpu": "cuda_ipc", "same_host": "nccl", "cross_host": "nccl"}
    assert choice.how == {
        "same_gpu": "automatically",
        "same_host": "by name",
        "cross_host": "automatically",
    }
    assert choose_links(job, transport="same_host=nccl,same_gpu=auto").links == choice.links
    # the environment, only when nothing was asked for
    monkeypatch.setenv(TRANSPORT_ENV, "same_host=nccl")
    env = choose_links(job)
    assert env.links == choice.links and env.how["same_host"] == f"by ${TRANSPORT_ENV}"
    monkeypatch.setenv(TRANSPORT_ENV, "cuda_ipc")
    assert choose_links(job[:3]).single == "cuda_ipc"


def test_override_errors_name_the_key_the_value_and_the_fix(gpus, monkeypatch):
    from weightbus import SyncConfig

    with pytest.raises(ValueError, match=r"link class 'samehost'.*'same_host'.*e\.g\."):
        SyncConfig(transport={"samehost": "nccl"})
    with pytest.raises(ValueError, match=r"\['same_host'\]: unknown transport 'ncl'.*'nccl'"):
        SyncConfig(transport={"same_host": "ncl"})
    with pytest.raises(TypeError, match=r"\['same_host'\]=7 must be a transport name"):
        SyncConfig(transport={"same_host": 7})
    with pytest.raises(TypeError, match="mapping from link class to transport name"):
        SyncConfig(transport=["nccl"])
    with pytest.raises(ValueError, match=r"'same_host' is not 'link_class=transport'"):
        SyncConfig(transport="same_host,cross_host=rdma")
    with pytest.raises(ValueError, match="names link class 'same_host' twice"):
        SyncConfig(transport="same_host=nccl,same_host=gloo")
    with pytest.raises(ValueError, match="unknown transport 'nccl-typo'"):
        SyncConfig(transport="nccl-typo")
    assert SyncConfig(transport="same_host=nccl").transport == {"same_host": "nccl"}
    assert SyncConfig(transport={"cpu_same_process": "local"}).transport == {
        "cpu_same_process": "local"
    }
    assert SyncConfig(transport="gloo").transport == "gloo"
    monkeypatch.setenv(TRANSPORT_ENV, "same_gpu=gloo-typo")
    with pytest.raises(ValueError, match=rf"\${TRANSPORT_ENV}\['same_gpu'\]: unknown transport"):
        choose_links(_gpu_job())
    monkeypatch.delenv(TRANSPORT_ENV)
    # asked for a transport that cannot serve those links: said so, with the fix
    with pytest.raises(
        ValueError,
        match=r"'nccl' was asked for for the same_gpu links.*one GPU.*SyncConfig.transport=",
    ):
        choose_links(_gpu_job(), transport={"same_gpu": "nccl"})
    with pytest.raises(
        ValueError, match=r"no transport can link this job: its cpu_gpu links.*rdma"
    ):
        choose_links([_p("writer", 0), _p("reader", 0, "cuda:0", gpu=A)])
    two = [_p("writer", 0), _p("reader", 0, process="9-x")]
    with pytest.raises(ValueError, match=r"'local' was asked for.*cpu_same_host.*not carry them"):
        choose_links(two, transport={"cpu_same_host": "local"})
    with pytest.raises(ValueError, match=r"'local' was asked for.*threads of one process only"):
        choose_links(two, transport="local")


def test_the_table_is_logged_once_per_job(gpus, caplog):
    caplog.set_level(logging.INFO, logger="weightbus.transports.links")
    job = f"table-{uuid.uuid4().hex[:6]}"
    for _ in range(4):  # every participant of a job in this process
        choose_links(_gpu_job(), transport={"same_host": "nccl"}).log(job)
    lines = [r.getMessage() for r in caplog.records if job in r.getMessage()]
    assert len(lines) == 1, lines
    table = lines[0].split("\n", 1)[1]
    rows = [row.split() for row in table.splitlines()]
    assert rows[0][:2] == ["link", "class"]
    assert rows[1:] == [
        ["same_gpu", "cuda_ipc", "1", "automatically"],
        ["same_host", "nccl", "1", "by", "name"],
        ["cross_host", "nccl", "1", "automatically"],
    ]


# ---------------------------------------------------------------------------------------------
# the local transport: the contract as it applies to a pulling transport (threads)
# ---------------------------------------------------------------------------------------------

SIZES = (0, 1, 7, 4096, 4099, 65_536 + 13, 300_001, (1 << 20) + 3, 33)
ROUNDS = 3


def _payload(round_: int, writer: int, reader: int, bucket: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((round_ * 97 + writer) * 89 + reader) * 1009 + bucket)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _pull_program(role: str, rank: int, n_w: int, n_r: int) -> Program:
    """A writer's tensors for every reader (one per size), or a reader's for every writer; one
    single-route bucket per (writer, reader, size), tag unique per link."""
    from weightbus.plan.program import BucketOp, Copy

    peers = range(n_r) if role == "writer" else range(n_w)
    tensors, ops = {}, []
    for peer in peers:
        w, r = (rank, peer) if role == "writer" else (peer, rank)
        for b, n in enumerate(SIZES):
            key = f"w{w}r{r}b{b}"
            tensors[key] = torch.zeros(n, dtype=torch.uint8)
            copy = Copy(key=key, index=(slice(0, n),), shape=(n,), offset=0, nbytes=n,
                        dtype=torch.uint8, tensor=key)  # fmt: skip
            tag = (w * n_r + r) * len(SIZES) + b
            ops.append(
                BucketOp(
                    bucket=tag,
                    peer=peer,
                    peer_global=peer + (n_w if role == "writer" else 0),
                    wave=0,
                    nbytes=n,
                    copies=(copy,),
                )  # fmt: skip
            )
    return Program(tuple(ops), tensors, (None,) * len(ops))


def _control(role: str, rank: int, port: int, job: str, n_w: int, n_r: int, **who):
    cfg = ControlConfig(
        num_writers=n_w,
        num_readers=n_r,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=20),
        heartbeat_interval=timedelta(milliseconds=200),
        heartbeat_timeout=timedelta(seconds=2),
    )
    return ControlPlane(Participant(role=role, rank=rank, **who), cfg).connect()


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.mark.timeout(60)
def test_local_pull_contract_every_link_bit_exact_over_rounds(store):
    n_w = n_r = 2
    job = f"local-{uuid.uuid4().hex[:6]}"

    def body(role: str, rank: int):
        def run():
            control = _control(role, rank, store.port, job, n_w, n_r)
            t = select_transport("local", control.participants(), control.participant)
            try:
                t.connect(control, control.participants())
                t.register([])
                program = _pull_program(role, rank, n_w, n_r)
                t.expose(program)
                moved, bad = 0, []
                for k in range(ROUNDS):
                    if role == "writer":
                        t.begin()
                        for op in program.ops:
                            key = op.copies[0].key
                            program.tensors[key].copy_(
                                _payload(k, rank, op.peer, op.bucket % len(SIZES), op.nbytes)
                            )
                        control.post(f"ready/{k}", {})
                        control.gather(f"done/{k}", role="reader")
                        continue
                    control.gather(f"ready/{k}", role="writer")
                    for x in program.tensors.values():
                        x.fill_(0xAB)  # poisoned
                    # posted in another order than the writers': only per peer does it matter
                    handles = [t.pull(op.peer_global, op.bucket) for op in reversed(program.ops)]
                    t.wait(handles, timedelta(seconds=10))
                    moved += sum(h.nbytes for h in handles)
                    for op in program.ops:
                        want = _payload(k, op.peer, rank, op.bucket % len(SIZES), op.nbytes)
                        if not torch.equal(program.tensors[op.copies[0].key], want):
                            bad.append((k, op.bucket))
                    control.post(f"done/{k}", {})
                errors = []
                for call in (
                    lambda: t.send(0 if role == "reader" else n_w, torch.zeros(1), 0),
                    lambda: t.recv(0 if role == "reader" else n_w, torch.zeros(1), 0),
                ):
                    with pytest.raises(WeightbusError, match="readers pull buckets") as info:
                        call()
                    errors.append(str(info.value))
                return {"moved": moved, "bad": bad, "errors": len(errors)}
            finally:
                t.close()
                t.close()  # idempotent
                control.close()

        return run

    out = run_threads({f"{r}-{i}": body(r, i) for r in ("writer", "reader") for i in range(2)})
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
        assert got["bad"] == [] and got["errors"] == 2, (name, got)
    for r in range(n_r):
        assert out[f"reader-{r}"]["moved"] == sum(SIZES) * n_w * ROUNDS


@pytest.mark.timeout(60)
def test_local_a_failure_reported_by_a_reader_reaches_the_writer(store):
    """The contract's peer failure, as it applies here: a reader reports a failure instead of
    exposing; the writer, waiting for every reader at expose, raises it naming the reader."""
    from weightbus.errors import PeerFailure

    job = f"local-fail-{uuid.uuid4().hex[:6]}"

    def writer():
        control = _control("writer", 0, store.port, job, 1, 1)
        t = LocalTransport()
        try:
            t.connect(control, control.participants())
            t.expose(_pull_program("writer", 0, 1, 1))
        except Exception as exc:
            return exc
        finally:
            t.close()
            control.close()

    def reader():
        control = _control("reader", 0, store.port, job, 1, 1)
        t = LocalTransport()
        try:
            t.connect(control, control.participants())
            control.fail("reader-0 simulated an engine crash")
            return "failed"
        finally:
            t.abort("failed")
            control.close()

    out = run_threads({"writer": writer, "reader": reader})
    err = out["writer"]
    assert isinstance(err, PeerFailure), out
    assert "reader-0" in str(err) and "simulated an engine crash" in str(err)


def test_local_refuses_what_it_cannot_link(store):
    cls = transport_class("local")
    assert cls.pulls and cls.priority < 0 and cls is LocalTransport
    assert cls.unsupported([_p("writer", 0), _p("reader", 0)]) is None
    assert "one process only" in cls.unsupported([_p("writer", 0), _p("reader", 0, process="9")])
    assert "one host" in cls.unsupported([_p("writer", 0), _p("reader", 0, host="h1")])
    assert "cpu" in cls.unsupported([_p("writer", 0), _p("reader", 0, "cuda:0")])
    with pytest.raises(TypeError, match="unknown options"):
        LocalTransport(hostname="x")
    # a Participant built for another process, connected here: refused at connect
    job = f"elsewhere-{uuid.uuid4().hex[:6]}"
    fake = this_process() + "-not"

    def one(role: str):
        control = _control(role, 0, store.port, job, 1, 1, process=fake)
        t = LocalTransport()
        try:
            t.connect(control, control.participants())
        except Exception as exc:
            return exc
        finally:
            t.abort("done")
            control.close()

    out = run_threads({"writer": lambda: one("writer"), "reader": lambda: one("reader")})
    for got in out.values():
        assert isinstance(got, WeightbusError) and "says it runs in process" in str(got), got


# ---------------------------------------------------------------------------------------------
# Writer / Reader in a job mixing local and gloo (threads)
# ---------------------------------------------------------------------------------------------

MODEL = "tiny-llama"


def _canonical(model, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) + 7919 * version)
        out[t.name] = torch.randn(t.shape, generator=g)
    return out


def _configs(port: int, job: str, n_w: int, n_r: int, **control):
    """The fault tests' configs, with same-process links over ``local`` (the others: gloo)."""
    from tests.test_faults_membership import configs

    return configs(
        port,
        n_w,
        n_r,
        job,
        control=control,
        transport={"cpu_same_process": "local"},
        sync_timeout=timedelta(seconds=15),
    )


def _writer(model, rank: int, n_w: int, dtype: str = "float32"):
    from weightbus import BoundLayout
    from weightbus.layouts.fsdp import fsdp_layout
    from weightbus.plan import allocate

    layout = fsdp_layout(model, Participant(role="writer", rank=rank), shard=n_w,
                         shard_rank=rank, dtype=dtype)  # fmt: skip
    return BoundLayout(layout=layout, tensors=allocate(layout))


def _reader(model, rank: int, process: str | None):
    """A whole-model engine replica (fused qkv); ``process`` another than this one puts its
    links in cpu_same_host (gloo), though it runs as a thread here."""
    from weightbus import BoundLayout
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate

    me = Participant(role="reader", rank=rank, process=process)
    layout = engine_layout(model, me, tp=1, dtype="bfloat16")
    return BoundLayout(layout=layout, tensors=allocate(layout))


def _off(layout, tensors, model, version: int) -> int:
    """Bytes of ``tensors`` that differ from ``version`` (as the readers' bfloat16)."""
    from weightbus.plan import allocate, fill_from_canonical

    want = allocate(layout)
    canon = {k: v.to(torch.bfloat16) for k, v in _canonical(model, version).items()}
    fill_from_canonical(layout, canon, want)
    return sum(int((tensors[k].view(torch.uint8) != want[k].view(torch.uint8)).sum()) for k in want)


def _reader_syncs(model, rank: int, process: str | None, configs, syncs: int):
    """A thread's body: reader ``rank`` (:func:`_reader`) waits for ``syncs`` syncs, its
    tensors poisoned before each; returns per sync the bytes that differ from its version."""
    from weightbus import Reader

    def body():
        bound = _reader(model, rank, process)
        with Reader(bound, *configs()) as r:
            offs = []
            for _ in range(syncs):
                _poison(r)
                res = r.wait()
                offs.append(_off(bound.layout, r.live, model, res.version))
            return offs

    return body


def _poison(reader) -> None:
    from weightbus.plan import poison

    # the engine's tensors, and a transactional reader's copy (which syncs write)
    for t in {id(x): x for x in [*reader.live.values(), *reader.bound.tensors.values()]}.values():
        poison(t)


@pytest.mark.timeout(120)
def test_mixed_job_local_and_gloo_bit_exact_with_each_reader_getting_its_bytes(store, caplog):
    from weightbus import Reader, Writer
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    caplog.set_level(logging.INFO, logger="weightbus.transports.links")
    model = model_spec(MODEL)
    n_w, n_r, syncs = 2, 2, 3
    job = f"mixed-{uuid.uuid4().hex[:6]}"
    elsewhere = f"{this_process()}-elsewhere"

    def writer(rank):
        def body():
            bound = _writer(model, rank, n_w)
            with Writer(bound, *_configs(store.port, job, n_w, n_r)) as w:
                out = []
                for v in range(1, syncs + 1):
                    fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
                    out.append(w.sync(v))
                t = w.transport
                return (
                    out,
                    w.plan,
                    type(t).__name__,
                    t.pulls_from("reader-0"),
                    t.pulls_from("reader-1"),
                )

        return body

    def reader(rank, process, apply):
        def body():
            bound = _reader(model, rank, process)
            control, config = _configs(store.port, job, n_w, n_r)
            config = type(config)(**{**_fields(config), "apply": apply})
            with Reader(bound, control, config) as r:
                got = []
                for _ in range(syncs):
                    _poison(r)
                    res = r.wait()
                    got.append((res, _off(bound.layout, r.live, model, res.version)))
                routes: dict[int, int] = {}  # writer -> route bytes this reader takes
                for op in r.ops:
                    routes[op.peer] = routes.get(op.peer, 0) + sum(c.nbytes for c in op.copies)
                subs = sorted(getattr(r.transport, "_subs", {}))
                return got, r.plan_index, subs, routes

        return body

    out = run_threads(
        {
            "writer-0": writer(0),
            "writer-1": writer(1),
            "reader-0": reader(0, elsewhere, "transactional"),  # says another process: gloo
            "reader-1": reader(1, None, "in_place"),  # a thread of this process: local
        }
    )
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    results, plan, kind, pulls0, pulls1 = out["writer-0"]
    assert kind == "LinksTransport" and pulls1 and not pulls0
    stats, buckets = plan.stats, plan.buckets
    for w in range(n_w):
        bucket_bytes = int(buckets.nbytes[buckets.src == w].sum())
        assert [r.bytes for r in out[f"writer-{w}"][0]] == [bucket_bytes] * syncs
    links = {(w, r): n for w, r, n in stats.link_bytes}
    for name, subs in (("reader-0", ["gloo"]), ("reader-1", ["local"])):
        got, index, seen, routes = out[name]
        assert seen == subs, (name, seen)
        assert [res.version for res, _ in got] == list(range(1, syncs + 1))
        assert [off for _, off in got] == [0] * syncs, (name, got)  # bit exact, every sync
        # exactly its own bytes: its buckets, whose routes are the plan's for its links
        bucket_bytes = int(buckets.nbytes[buckets.dst == index].sum())
        assert [res.bytes for res, _ in got] == [bucket_bytes] * syncs
        assert routes == {w: links[(w, index)] for w in range(n_w)}, (name, routes)
        assert sum(routes.values()) == stats.reader_bytes[index] > 0
    tables = [r.getMessage() for r in caplog.records if job in r.getMessage()]
    assert len(tables) == 1, tables
    assert "cpu_same_process  local" in tables[0] and "cpu_same_host     gloo" in tables[0]


def _fields(config) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@pytest.mark.timeout(120)
def test_mixed_job_keeps_working_as_readers_leave_and_join(store):
    """reader-1 (local) leaves after sync 2, and the job runs over gloo alone; reader-2
    (local) joins after sync 3, and the job mixes again; reader-0 (gloo) stays. Every sync
    each reader takes is bit exact after poisoning."""
    from weightbus import Reader, Writer
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    model = model_spec(MODEL)
    n_w, n_r, steps, leave_after, join_after = 2, 2, 6, 2, 3
    job = f"mixed-members-{uuid.uuid4().hex[:6]}"
    joined = threading.Event()
    elsewhere = f"{this_process()}-elsewhere"

    def writer(rank):
        def body():
            bound = _writer(model, rank, n_w)
            control, config = _configs(store.port, job, n_w, n_r, max_readers=3)
            with Writer(bound, control, config) as w:
                kinds = []
                for v in range(1, steps + 1):
                    fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
                    w.sync(v)
                    kinds.append(sorted(getattr(w.transport, "_subs", {w.transport.name: 0})))
                    if v == join_after:
                        joined.set()
                    threading.Event().wait(0.3)  # the training step
                return kinds, w.control.epoch

        return body

    def reader(rank, process=None, last=steps, late=False):
        def body():
            if late:
                assert joined.wait(30)
            bound = _reader(model, rank, process)
            control, config = _configs(store.port, job, n_w, n_r, max_readers=3)
            with Reader(bound, control, config) as r:
                got, version = [], 0
                while version < last:
                    _poison(r)
                    version = r.wait().version
                    got.append((version, _off(bound.layout, r.live, model, version)))
                return got

        return body

    out = run_threads(
        {
            "writer-0": writer(0),
            "writer-1": writer(1),
            "reader-0": reader(0, elsewhere),
            "reader-1": reader(1, last=leave_after),
            "reader-2": reader(2, late=True),
        }
    )
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    for name in ("reader-0", "reader-1", "reader-2"):
        assert all(off == 0 for _, off in out[name]), (name, out[name])
    assert [v for v, _ in out["reader-0"]] == list(range(1, steps + 1))
    assert [v for v, _ in out["reader-1"]] == list(range(1, leave_after + 1))
    first = out["reader-2"][0][0]
    assert join_after < first <= join_after + 2 and out["reader-2"][-1][0] == steps
    kinds, epoch = out["writer-0"]
    assert epoch == 2, epoch  # one for the leave, one for the join
    # mixed while reader-1 is in, gloo alone once it left, mixed again with reader-2 (the
    # local transport then numbers reader-2, global rank 3, as its rank 2)
    assert kinds[0] == kinds[1] == ["gloo", "local"], kinds
    assert kinds[2] == ["gloo"] and kinds[-1] == ["gloo", "local"], kinds


def test_links_transport_before_connect_and_choices_that_differ(gpus):
    choice = choose_links(_gpu_job())
    t = LinksTransport(choice)
    with pytest.raises(WeightbusError, match="call connect"):
        t.send("reader-1", torch.zeros(1), 0)
    t.close()  # nothing connected: nothing to do, and idempotent
    t.abort("again")
    assert base.Transport.pulls_from(transport_class("gloo")(), "x") is False
    # a different request makes a different digest: connect's agreement tells them apart
    other = choose_links(_gpu_job(), transport={"same_host": "nccl"})
    assert other.digest() != choice.digest()


@base.register_transport
class _OtherGloo(transport_class("gloo")):
    name = "test-links-other"
    priority = -1


@pytest.mark.timeout(60)
def test_participants_that_chose_differently_are_stopped_at_connect(store):
    """writer-0 and reader-0 mix local and gloo; reader-1 asked for another transport on its
    link class: the per-link choices differ, and connect says so on every participant."""
    job = f"differ-{uuid.uuid4().hex[:6]}"
    asks = {
        "writer-0": {"cpu_same_process": "local"},
        "reader-0": {"cpu_same_process": "local"},
        "reader-1": {"cpu_same_process": "local", "cpu_same_host": "test-links-other"},
    }

    def one(role: str, rank: int, **who):
        control = _control(role, rank, store.port, job, 1, 2, **who)
        roster = control.participants()
        t = build_transport(choose_links(roster, transport=asks[control.participant.name]))
        try:
            t.connect(control, roster)
            return "connected"
        except Exception as exc:
            return exc
        finally:
            t.abort("done")
            control.close()

    out = run_threads(
        {
            "writer-0": lambda: one("writer", 0),
            "reader-0": lambda: one("reader", 0),
            "reader-1": lambda: one("reader", 1, process="elsewhere-1"),
        }
    )
    for name, got in out.items():
        assert isinstance(got, PlanMismatch), (name, got)
        assert "chose different transports for the links" in str(got), got


def test_check_choice_forms():
    assert check_choice("auto") == "auto"
    assert check_choice("gloo") == "gloo"
    assert check_choice(" same_host = nccl , cross_host=rdma ") == {
        "same_host": "nccl",
        "cross_host": "rdma",
    }
    assert check_choice({"same_gpu": "auto"}) == {"same_gpu": "auto"}


@base.register_transport
class _StagedGloo(transport_class("gloo")):
    """gloo whose sends, as those of a transport that registers memory, read only the buffers
    registered and the live tensors."""

    name = "test-links-staged"
    priority = -1
    sends_any_buffer = False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("other", ["test-links-other", "test-links-staged"])
def test_a_delta_writer_sends_frames_where_they_lie_where_every_link_it_sends_over_can(
    store, other
):
    """A writer of a job of two transports (one per link) sends its delta frames from the
    stores its encoder wrote them into only where both send from any buffer; where one does
    not, it copies them into its staging buffers. Either way every sync is bit exact."""
    from weightbus import DeltaConfig, Writer
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    model = model_spec(MODEL)
    n_w, n_r, syncs = 1, 2, 3
    job = f"stores-{uuid.uuid4().hex[:6]}"
    elsewhere = f"{this_process()}-elsewhere"

    def configs():
        from tests.test_faults_membership import configs

        return configs(
            store.port,
            n_w,
            n_r,
            job,
            transport={"cpu_same_process": other, "cpu_same_host": "gloo"},
            delta=DeltaConfig(checksum_every=2),
            sync_timeout=timedelta(seconds=15),
        )

    def writer():
        bound = _writer(model, 0, n_w)
        with Writer(bound, *configs()) as w:
            for v in range(1, syncs + 1):
                fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
                w.sync(v)
            assert w.codec is not None and w.codec.encoder is not None
            return type(w.transport).__name__, w.codec.encoder.sends_stores

    def reader(rank, process):
        return _reader_syncs(model, rank, process, configs, syncs)

    out = run_threads(
        {
            "writer-0": writer,
            "reader-0": reader(0, elsewhere),  # another process: cpu_same_host, gloo
            "reader-1": reader(1, None),  # this process: cpu_same_process, ``other``
        }
    )
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    assert out["writer-0"] == ("LinksTransport", other == "test-links-other")
    assert out["reader-0"] == out["reader-1"] == [0] * syncs
