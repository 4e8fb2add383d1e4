"""`weightbus status` against a running job: real processes sync over gloo, the CLI reads them.

One writer and two readers (plain modules, float32, received in place) sync two versions and
stay alive while ``weightbus status --store ... --json`` and the plain view run. Then one
reader fails for real (its engine moved a tensor to new storage) and status shows who failed,
with what, and what the others saw.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import subprocess
import sys
import threading
import time
import traceback
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from weightbus.control import status
from weightbus.errors import WeightbusError

pytestmark = pytest.mark.timeout(120)

VERSIONS = (1, 2)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)).to(dtype)


def _values(model: torch.nn.Module, version: int) -> None:
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _configs(port: int, job: str):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=1,
        num_readers=2,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=30),
        heartbeat_interval=timedelta(seconds=0.2),
        heartbeat_timeout=timedelta(seconds=5),
    )
    sync = SyncConfig(
        bucket_bytes=1 << 20,
        direct_bytes=1024,  # the weights are received in place, the biases staged
        transport="gloo",
        sync_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=30),
        step_timeout=timedelta(seconds=30),
    )
    return control, sync


def _participant(role: str, rank: int, port: int, job: str, q, go) -> None:
    name = f"{role}-{rank}"
    try:
        from weightbus import Reader, Writer
        from weightbus.engines.module import bind
        from weightbus.plan import poison

        torch.set_num_threads(1)
        model = _model(torch.float32)
        control, sync = _configs(port, job)
        session = (Writer if role == "writer" else Reader)(bind(model, role, rank), control, sync)
        session.connect()
        want = _model(torch.float32)
        for v in VERSIONS:
            if role == "writer":
                _values(model, v)
                session.sync(v)
            else:
                for p in model.parameters():
                    poison(p.data)
                result = session.wait()
                _values(want, result.version)
                for a, b in zip(model.parameters(), want.parameters(), strict=True):
                    assert torch.equal(a, b), f"{name}: version {v} not bit exact"
        q.put((name, "synced", ""))
        go.wait(60)
        # the second act: reader-1's engine replaces a tensor it receives in place, so its
        # next sync fails at once, and everyone else hears of it
        try:
            if role == "writer":
                _values(model, 3)
                session.sync(3)
            else:
                if rank == 1:
                    model[0].weight.data = model[0].weight.data.clone()
                session.wait()
            q.put((name, "no error", ""))
        except Exception as e:
            q.put((name, type(e).__name__, str(e)))
        go.wait(60)  # stays alive until the test has looked
        session.close()
    except BaseException as exc:
        q.put((name, "crashed", f"{exc}\n{traceback.format_exc()}"))


def _status_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightbus.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _collect(q, n: int, limit: float) -> dict:
    out: dict = {}
    deadline = time.monotonic() + limit
    while len(out) < n and time.monotonic() < deadline:
        try:
            name, what, text = q.get(timeout=0.5)
        except queue.Empty:
            continue
        assert what != "crashed", (name, text)
        out[name] = (what, text)
    assert len(out) == n, f"only {sorted(out)} reported within {limit} s"
    return out


def test_status_shows_a_running_job_and_its_failures(capsys):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"status-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    roles = [("writer", 0), ("reader", 0), ("reader", 1)]
    procs = [
        ctx.Process(target=_participant, args=(role, rank, store.port, job, q, go))
        for role, rank in roles
    ]
    for p in procs:
        p.start()
    try:
        _collect(q, 3, 90)
        address = f"127.0.0.1:{store.port}"

        # the job, found without naming it, as JSON
        out = _status_cli("--store", address, "--json")
        assert out.returncode == 0, out.stderr
        (state,) = json.loads(out.stdout)["jobs"]
        assert state["job"] == job and state["registered"] == 3 and state["missing"] == []
        assert state["committed"] == 2 and state["in_progress"] is None
        assert state["failures"] == []
        people = {p["name"]: p for p in state["participants"]}
        assert list(people) == ["writer-0", "reader-0", "reader-1"]
        n_params = sum(t.numel() for t in _model(torch.float32).parameters())
        for name, p in people.items():
            assert p["state"] == "ready", (name, p)
            assert p["version"] == 2 and p["syncs"] == 2 and p["transport"] == "gloo"
            assert p["bytes_per_sync"] == n_params * 4 * (2 if name == "writer-0" else 1)
            last = p["last_sync"]
            assert last["version"] == 2 and last["bytes"] == p["bytes_per_sync"]
            assert last["seconds"] > 0 and last["gbps"] > 0
            assert set(last["phases"]) >= {"pack", "transfer", "unpack", "control"}
        assert len({p["plan"] for p in people.values()}) == 1
        assert state["last_sync"]["version"] == 2
        assert state["last_sync"]["bytes"] == 2 * n_params * 4  # both readers' bytes
        assert state["version_lag"] == {"reader-0": 0, "reader-1": 0}

        # the same for people (in this process from here on: it reads the same)
        assert status.main(["--store", address, "--job", job, "--sample", "0"]) == 0
        text = capsys.readouterr().out
        assert f"job {job!r} at {address}: 1 writer, 2 readers; 3 of 3 registered" in text
        assert "committed version 2" in text and "last sync: version 2" in text
        assert "failures: none" in text
        for name in people:
            assert any(line.startswith(name) and " ready " in line for line in text.splitlines())

        # reader-1 fails; every participant ends with an error naming it
        go.set()
        ends = _collect(q, 3, 60)
        assert ends["reader-1"][0] == "LayoutError", ends
        for name in ("writer-0", "reader-0"):
            assert ends[name][0] == "PeerFailure" and "reader-1" in ends[name][1], ends
        assert status.main(["--store", address, "--job", job, "--json", "--sample", "0"]) == 0
        (state,) = json.loads(capsys.readouterr().out)["jobs"]
        people = {p["name"]: p for p in state["participants"]}
        assert [f[0] for f in state["failures"]] == ["reader-1"]
        assert "moved to new storage" in state["failures"][0][1]
        assert all(p["state"] == "failed" for p in people.values()), people
        assert "reader-1" in people["writer-0"]["error"]
        assert people["reader-0"]["version"] == 2  # what its tensors hold
        assert status.main(["--store", address, "--job", job, "--sample", "0"]) == 0
        assert "failures (first first):\n  reader-1: LayoutError" in capsys.readouterr().out
    finally:
        go.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_status_marks_silent_and_joining_participants_and_names_missing_ones():
    """A participant whose heartbeat stopped is 'silent', one that has not finished connect is
    'joining', a rank nobody registered is listed as missing (control planes in threads)."""
    from weightbus import ControlConfig, Participant
    from weightbus.control.store import ControlPlane

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"silent-{uuid.uuid4().hex[:8]}"
    cfg = ControlConfig(
        num_writers=1,
        num_readers=2,
        address=f"127.0.0.1:{store.port}",
        host_store=False,
        job=job,
        heartbeat_interval=timedelta(seconds=0.1),
        heartbeat_timeout=timedelta(seconds=1),
    )
    writer = ControlPlane(Participant(role="writer", rank=0), cfg).connect()
    reader = ControlPlane(Participant(role="reader", rank=0), cfg).connect()
    try:
        # stop the reader's heartbeat thread without closing it: as if its process hung
        reader._hb_stop.set()
        reader._hb_thread.join(timeout=5)
        (state,) = status.read_status(cfg.address, job, sample=0.5)
        people = {p.name: p for p in state.participants}
        assert people["writer-0"].state == "joining"
        assert people["reader-0"].state == "silent"
        assert state.missing == ("reader rank 1",)
        assert "(missing reader rank 1)" in state.render()
    finally:
        reader.close()
        writer.close()
    (state,) = status.read_status(cfg.address, job, sample=0)
    assert {p.state for p in state.participants} == {"closed"}


def test_status_errors_name_the_fix(capsys):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    with pytest.raises(KeyError, match="no weightbus job has registered"):
        status.read_status(address)
    store.set("weightbus/other/counts", "1,1")
    with pytest.raises(KeyError, match=r"no weightbus job 'nope'.*jobs \['other'\]: pass one"):
        status.read_status(address, "nope")
    assert status.main(["--store", address, "--job", "nope", "--json"]) == 1
    assert "no weightbus job 'nope'" in json.loads(capsys.readouterr().out)["error"]
    with pytest.raises(SystemExit) as exit_:
        status.main(["--store", "nohost"])
    assert exit_.value.code == 2 and "is not 'host:port'" in capsys.readouterr().err
    # nothing listens on a port just freed
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(
        WeightbusError, match=f"could not reach a control store at 127.0.0.1:{free}"
    ):
        status.read_status(f"127.0.0.1:{free}", timeout=timedelta(seconds=1))


def test_status_record_is_published_by_threads_in_one_process():
    """What publish() writes at connect and after a sync is what read_status reads."""
    from weightbus import ControlConfig, Reader, SyncConfig, Writer
    from weightbus.engines.module import bind

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"thread-{uuid.uuid4().hex[:8]}"
    cfg = ControlConfig(
        num_writers=1,
        num_readers=1,
        address=f"127.0.0.1:{store.port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=20),
    )
    sync = SyncConfig(transport="gloo", cast={"float32": "bfloat16"})
    errors: list = []

    def run(session, fn) -> None:
        try:
            session.connect()
            fn(session)
        except Exception as e:
            errors.append(e)

    w = Writer(bind(_model(torch.float32), "writer", 0), cfg, sync)
    r = Reader(bind(_model(torch.bfloat16), "reader", 0), cfg, sync)
    threads = [
        threading.Thread(target=run, args=(w, lambda s: s.sync(7))),
        threading.Thread(target=run, args=(r, lambda s: s.wait())),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    (state,) = status.read_status(cfg.address, job, sample=0)
    assert state.committed == 7
    assert [p.last_sync["version"] for p in state.participants] == [7, 7]
    payload = sum(t.numel() * 2 for t in _model(torch.float32).parameters())  # bfloat16
    assert state.participants[1].last_sync["bytes"] == r.bytes_per_sync >= payload
    w.close()
    r.close()
