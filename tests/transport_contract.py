"""The contract every transport passes, run in real processes (2 writers x 2 readers).

    run_contract(name)      many buckets of assorted sizes, every link at once, several rounds,
                            received bytes compared bit for bit
    run_peer_death(name)    a reader is SIGKILLed mid-transfer: every survivor's wait raises
                            PeerFailure naming it within seconds, and every survivor exits
    run_peer_failure(name)  a reader reports a failure (control.fail) and stays alive: every
                            other participant's wait raises PeerFailure carrying its text

A new transport's test module calls these with its registry name (and ``devices`` mapping
participant names to devices, e.g. ``{"writer-0": "cuda:0", ...}``). The test process hosts the
control store; participants run in spawned processes that exit on their own if this process
dies, and any still alive when a run ends are killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed import TCPStore

import tests.nccl_on_cpu  # noqa: F401  (registers test-nccl-on-cpu)
import weightbus.control.store  # noqa: F401  (preloaded into the forkserver)
import weightbus.transports.gloo  # noqa: F401
from tests.procs import Spawned

NUM_WRITERS = 2
NUM_READERS = 2
# bucket sizes per link and round: empty, tiny, odd, page-sized, a few hundred KiB, > 1 MiB
SIZES = (0, 1, 7, 4096, 4099, 65_536 + 13, 300_001, 1 << 20, (1 << 20) + 3, 33, 123_457, 8)
ROUNDS = 3
CHILD_LIMIT_S = 45.0
# Detection normally takes well under a second. The bound allows for one new TCPStore
# connection (a transport's connect opens one) stalling 5 s on a reverse-DNS lookup, as a few
# percent of them do on machines with unreliable DNS.
DETECT_S = 12.0


def _names(shape: tuple[int, int]) -> list[tuple[str, int]]:
    writers, readers = shape
    return [("writer", r) for r in range(writers)] + [("reader", r) for r in range(readers)]


def _payload(round_: int, writer: int, reader: int, bucket: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((round_ * 97 + writer) * 89 + reader) * 1009 + bucket)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _tag(round_: int, bucket: int) -> int:
    return round_ * 1000 + bucket


# ---------------------------------------------------------------------------------------------
# inside a participant process
# ---------------------------------------------------------------------------------------------


def _watchdog(parent: int) -> None:
    """Exit if the test process dies or the child overstays, so nothing is left behind."""
    start = time.monotonic()
    while True:
        time.sleep(0.2)
        if os.getppid() != parent or time.monotonic() - start > CHILD_LIMIT_S:
            os._exit(3)


def _child(
    scenario: str,
    transport: str,
    port: int,
    job: str,
    role: str,
    rank: int,
    device: str,
    shape: tuple[int, int],
) -> None:
    threading.Thread(target=_watchdog, args=(os.getppid(),), daemon=True).start()
    # the test process asks for every thread's stack (SIGUSR1) when this one hangs
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from weightbus.control.store import ControlConfig, ControlPlane
    from weightbus.errors import WeightbusError
    from weightbus.spec import Participant
    from weightbus.transports.base import select_transport

    me = Participant(role=role, rank=rank, device=device)
    results = TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    config = ControlConfig(
        num_writers=shape[0],
        num_readers=shape[1],
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=20),
        heartbeat_interval=timedelta(milliseconds=200),
        heartbeat_timeout=timedelta(seconds=2),
    )
    control = ControlPlane(me, config).connect()
    report: dict = {"name": me.name}
    t = None
    try:
        roster = control.participants()
        t = select_transport(transport, roster, me)
        t.connect(control, roster)
        report.update(_ROLES[scenario](me, control, t, results, job, device))
    except Exception as e:
        report.update(error=type(e).__name__, message=str(e), at=time.time())
        if not isinstance(e, WeightbusError):
            report["traceback"] = traceback.format_exc()
    finally:
        if t is not None:
            t.close()
        control.close()
    results.set(f"{job}/result/{me.name}", json.dumps(report))


def _exchange(
    me, control, t, device: str, rounds: range, victim_stop: Callable | None = None
) -> dict:
    """Each writer sends every reader len(SIZES) buckets per round; readers check every byte."""
    peers = [p.name for p in t.roster.all if p.role != me.role]
    bufs = {
        (p, b): torch.empty(n, dtype=torch.uint8, device=device)
        for p in peers
        for b, n in enumerate(SIZES)
    }
    t.register(list(bufs.values()))
    moved, seconds, bad = 0, 0.0, []
    for k in rounds:
        if me.role == "writer":
            for (p, b), buf in bufs.items():
                buf.copy_(_payload(k, me.rank, int(p.split("-")[1]), b, SIZES[b]))
        else:
            for buf in bufs.values():
                buf.fill_(0xAB)
        t0 = time.perf_counter()
        handles = []
        # interleave peers, and let readers walk the writers in the other order: posting order
        # only has to agree per peer
        order = list(range(len(SIZES)))
        walk = peers if me.role == "writer" else list(reversed(peers))
        size = _group_size(k)
        if size > 1:
            # each peer's buckets in groups (send_many / recv_many), one peer after another;
            # a victim posts the same groups as its peers (as NCCL requires) until it stops
            many = t.send_many if me.role == "writer" else t.recv_many
            for p in walk:
                for a in range(0, len(order), size):
                    if victim_stop is not None and victim_stop(k, a):
                        return {}
                    items = [(bufs[(p, b)], _tag(k, b)) for b in order[a : a + size]]
                    handles += many(p, items)
        else:
            for b in order:
                for p in walk:
                    if victim_stop is not None and victim_stop(k, b):
                        return {}
                    op = t.send if me.role == "writer" else t.recv
                    handles.append(op(p, bufs[(p, b)], _tag(k, b)))
        t.wait(handles, timedelta(seconds=20))
        seconds += time.perf_counter() - t0
        moved += sum(h.nbytes for h in handles)
        if me.role == "reader":
            for (p, b), buf in bufs.items():
                want = _payload(k, int(p.split("-")[1]), me.rank, b, SIZES[b]).to(device)
                if not torch.equal(buf, want):
                    bad.append(f"round {k} {p} bucket {b}")
    return {"ok": not bad, "bad": bad, "bytes": moved, "seconds": seconds}


def _group_size(round_: int) -> int:
    """Buckets per posted group in round ``round_`` (the same on both sides of a link, as NCCL
    requires): single posts in the first, then groups of 4, then of 5."""
    return (1, 4, 5)[round_ % 3]


def _role_contract(me, control, t, results, job, device) -> dict:
    return _exchange(me, control, t, device, range(ROUNDS))


def _role_death(me, control, t, results, job, device) -> dict:
    if me.name != "reader-1":
        return _exchange(me, control, t, device, range(ROUNDS))

    def stop(k: int, b: int) -> bool:
        # round 1, half of the buckets posted (of one writer, where they go in groups): tell
        # the test process, wait to be killed
        if k == 1 and b >= len(SIZES) // 2:
            results.set(f"{job}/victim-ready", "1")
            time.sleep(CHILD_LIMIT_S)
        return False

    return _exchange(me, control, t, device, range(ROUNDS), stop)


def _role_failure(me, control, t, results, job, device) -> dict:
    if me.name != "reader-1":
        return _exchange(me, control, t, device, range(ROUNDS))

    def stop(k: int, b: int) -> bool:
        if k == 1 and b >= 2:
            control.fail("reader-1 simulated an engine crash: CUDA error 700")
            results.set(f"{job}/victim-failed", str(time.time()))
            # stay alive (sockets open) until everyone else reported
            others = [f"{job}/result/{n}" for n in ("writer-0", "writer-1", "reader-0")]
            deadline = time.monotonic() + 30
            while not results.check(others) and time.monotonic() < deadline:
                time.sleep(0.02)
            return True
        return False

    return _exchange(me, control, t, device, range(ROUNDS), stop)


_ROLES = {"contract": _role_contract, "death": _role_death, "failure": _role_failure}


# ---------------------------------------------------------------------------------------------
# in the test process
# ---------------------------------------------------------------------------------------------


def process_context() -> multiprocessing.context.BaseContext:
    """forkserver with torch and weightbus preloaded: each participant starts in milliseconds
    instead of importing torch again, and from a clean single-threaded process (unlike fork)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.transport_contract"])
    return ctx


class _Run(Spawned):
    """The store and the participant processes of one run; kills leftovers on exit."""

    def __init__(
        self,
        scenario: str,
        transport: str,
        devices: dict[str, str] | None,
        shape: tuple[int, int] = (NUM_WRITERS, NUM_READERS),
    ) -> None:
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.job = f"contract-{scenario}-{uuid.uuid4().hex[:8]}"
        ctx = process_context()
        self.procs: dict[str, multiprocessing.Process] = {}
        self.shape = shape
        for role, rank in _names(shape):
            name = f"{role}-{rank}"
            device = (devices or {}).get(name, "cpu")
            args = (scenario, transport, self.store.port, self.job, role, rank, device, shape)
            self.procs[name] = ctx.Process(target=_child, args=args, name=name, daemon=True)

    def result(self, name: str, timeout_s: float) -> dict:
        key = f"{self.job}/result/{name}"
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            proc = self.procs[name]
            if not proc.is_alive() and not self.store.check([key]):
                raise AssertionError(f"{name} exited with code {proc.exitcode} without reporting")
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):  # (it may just have exited)
                    os.kill(proc.pid, signal.SIGUSR1)  # its stacks, on stderr (faulthandler)
                    time.sleep(1.0)
                raise AssertionError(
                    f"{name} reported nothing within {timeout_s} s (its threads' stacks are "
                    "on stderr)"
                )
            time.sleep(0.02)
        return json.loads(self.store.get(key))

    def join(self, names, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        for n in names:
            self.procs[n].join(max(0.0, deadline - time.monotonic()))
        return {n: self.procs[n].exitcode for n in names}


def run_contract(
    transport: str,
    devices: dict[str, str] | None = None,
    timeout_s: float = 40,
    shape: tuple[int, int] = (NUM_WRITERS, NUM_READERS),
) -> dict:
    """Every link at once, bit exact, between ``shape`` (writers, readers). Returns each
    participant's report."""
    with _Run("contract", transport, devices, shape) as run:
        reports = {n: run.result(n, timeout_s) for n in run.procs}
        codes = run.join(run.procs, 10)
    for name, r in reports.items():
        assert "error" not in r, f"{name}: {r}"
        assert r["ok"], f"{name} received wrong bytes: {r['bad']}"
    per_link = sum(SIZES) * ROUNDS
    for name, r in reports.items():
        peers = shape[1] if name.startswith("writer") else shape[0]
        assert r["bytes"] == per_link * peers, (name, r["bytes"], per_link * peers)
    assert all(c == 0 for c in codes.values()), codes
    return reports


def run_peer_death(
    transport: str, devices: dict[str, str] | None = None, detect_s: float = DETECT_S
) -> dict:
    """SIGKILL reader-1 mid-transfer. The writers, whose sends to it can never finish, raise
    PeerFailure naming it within ``detect_s``; reader-0, which has nothing to do with reader-1,
    either raises the same or receives all its bytes bit exact (a transport whose links are
    independent lets it finish). Every survivor exits."""
    with _Run("death", transport, devices) as run:
        run.store.wait([f"{run.job}/victim-ready"], timedelta(seconds=40))
        time.sleep(0.2)  # let the writers block on the buckets reader-1 never posted
        killed_at = time.time()
        os.kill(run.procs["reader-1"].pid, signal.SIGKILL)
        survivors = ["writer-0", "writer-1", "reader-0"]
        reports = {n: run.result(n, 20) for n in survivors}
        codes = run.join(survivors, 10)
    for name, r in reports.items():
        if name == "reader-0" and r.get("ok") and not r.get("bad"):
            continue  # all its transfers were with the writers, and all arrived intact
        assert r.get("error") == "PeerFailure", f"{name}: {r}"
        assert "reader-1" in r["message"], f"{name} does not name reader-1: {r['message']}"
        assert r["at"] - killed_at < detect_s, f"{name} took {r['at'] - killed_at:.1f} s"
    assert codes == dict.fromkeys(survivors, 0), codes
    return {
        n: {**r, "detect_s": r["at"] - killed_at} if "at" in r else r for n, r in reports.items()
    }


def run_peer_failure(
    transport: str, devices: dict[str, str] | None = None, detect_s: float = DETECT_S
) -> dict:
    """reader-1 calls control.fail() mid-sync and stays alive; everyone else raises its text."""
    with _Run("failure", transport, devices) as run:
        survivors = ["writer-0", "writer-1", "reader-0"]
        reports = {n: run.result(n, 40) for n in survivors}
        failed_at = float(run.store.get(f"{run.job}/victim-failed"))
        codes = run.join(list(run.procs), 15)
    for name, r in reports.items():
        assert r.get("error") == "PeerFailure", f"{name}: {r}"
        assert "CUDA error 700" in r["message"] and "reader-1" in r["message"], r["message"]
        assert r["at"] - failed_at < detect_s, f"{name} took {r['at'] - failed_at:.1f} s"
    assert all(c == 0 for c in codes.values()), codes
    return {n: {**r, "detect_s": r["at"] - failed_at} for n, r in reports.items()}
