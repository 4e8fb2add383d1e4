"""Reliability on GPUs: the fault tests of ``tests/test_faults_membership.py``,
``tests/test_transactional.py`` and ``tests/test_verify.py``, over NCCL and CUDA IPC.

Two writers (float32 FSDP row shards) on GPUs 0-1, two readers (whole bfloat16 engine replicas)
on GPUs 2-3, each a process of the ``spawn`` context; a model of 191 M parameters (383 MB per
writer and per reader) so a sync has dozens of buckets per link. Each test, over each transport:

* a reader SIGKILLed in the middle of a sync (it stops after posting half its receives or
  pulls, then the test process kills it): the writers raise within heartbeat_timeout + 5 s
  naming it; the other reader, transactional, still holds the previous version bit for bit;
  the next sync plans again without the dead reader (a new membership epoch: new NCCL
  communicators, new IPC handles) and is bit exact;
* a writer SIGKILLed in the middle of a sync: both readers raise naming it; the transactional
  one keeps the previous version bit for bit, the in-place one is flagged dirty; the next sync
  ends the job loudly on everyone (writers cannot be replaced), nobody hangs;
* a byte flipped in transit (NCCL: in a received buffer; CUDA IPC: after the pull, before the
  reader sums its tensors) fails the sync with ChecksumMismatch naming the tensor, the writer
  and the reader; everyone else hears of it; the next sync heals the in-place reader;
* a reader with another plan (bucket size), or another model, is refused at connect, naming
  both sides, before any transport is built;
* a reader joining while the writers sync is brought to the current version bit exact at the
  sync after it connects, while the other reader receives every version undisturbed.

Receiving tensors are poisoned (NaN) before every sync whose result is checked bit for bit.
Every process reports what it saw; assertions say what happened, and a hang names each
participant's last stage. ``pytest -s`` shows the figures of each test: syncs run, faults
injected and detected, bytes lost, detection latency.

Marked ``gpu`` and ``faults``; the GPU cases need 4 CUDA devices. With
``WEIGHTBUS_FAULTS_GPU_ON_CPU=1`` the same test functions run on CPU over gloo (writers push,
as over NCCL) and over a pulling test transport (as CUDA IPC), on a tiny model::

    WEIGHTBUS_FAULTS_GPU_ON_CPU=1 python -m pytest -s tests/test_faults_gpu.py
"""

from __future__ import annotations

import time

import pytest

from tests.faults_harness import (
    HEARTBEAT_TIMEOUT_S,
    SYNC_TIMEOUT_S,
    Ctx,
    Figures,
    Person,
    Run,
    no_error,
    setup_params,
)

pytestmark = [pytest.mark.gpu, pytest.mark.faults]

SETUPS = setup_params()
DETECT_S = HEARTBEAT_TIMEOUT_S + 5.0  # the bound on raising after a participant dies
FIGURES: list[Figures] = []


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if FIGURES:
        print("\nfault tests on GPUs (or their CPU stand-ins):")
        for f in FIGURES:
            print("  " + f.line())


def _show(reports: dict) -> str:
    """Every participant's log, one entry per line, for assertion messages."""
    lines = []
    for name, r in reports.items():
        lines.append(f"{name}:")
        for e in r.get("log", []):
            shown = {k: v for k, v in e.items() if k != "text"}
            text = e.get("text", "").splitlines()[0][:300] if e.get("text") else ""
            lines.append(f"    {shown}" + (f" -- {text}" if text else ""))
        extra = {k: v for k, v in r.items() if k != "log"}
        if extra:
            lines.append(f"    {extra}")
    return "\n".join(lines)


def _done(figures: Figures) -> None:
    FIGURES.append(figures)
    print("\n" + figures.line())


# ---------------------------------------------------------------------------------------------
# participants' bodies (run in their own processes)
# ---------------------------------------------------------------------------------------------

KILLED_IN = 2  # the version whose sync the victim dies in


def _writer(ctx: Ctx) -> dict:
    """Sync versions 1..steps (each as a log entry); a ``victim`` stops mid-sync in KILLED_IN.
    ``join_after``: writer rank 0 tells a joining reader to connect after that version, and
    every writer waits 1 s between later syncs (the training step)."""
    o = ctx.options
    w = ctx.writer()
    ctx.stage("connecting")
    w.connect()
    if o.get("victim"):
        ctx.stall_midway(w, KILLED_IN - 1)
    log = []
    for v in range(1, o["steps"] + 1):
        log.append(ctx.sync(w, v))
        join = o.get("join_after")
        if join is not None:
            if v == join and ctx.rank == 0:
                ctx.signal("join")
            time.sleep(0.2 if v < join else 1.0)
    ctx.stage("closing")
    w.close()
    return {"log": log}


def _arm_flip(r) -> dict:
    """Arm the reader's transport to flip a byte in the middle of one route of the next sync:
    a route of a staged bucket where there are some (pushing transports), else any."""
    pairs = list(zip(r.ops, r.direct, strict=True))
    staged = [op for op, d in pairs if d is None]
    pool = staged if staged and not r.transport.pulls else [op for op, _ in pairs]
    op = pool[len(pool) // 2]
    c = op.copies[len(op.copies) // 2]
    r.transport.arm(op, c)
    return {
        "tensor": c.tensor,
        "key": c.key,
        "writer": r.plan.writers[op.peer].name,
        "bucket": op.bucket,
        "staged": op in staged,
    }


def _reader(ctx: Ctx) -> dict:
    """Wait for syncs (each poisoned first and checked bit for bit, as a log entry) until it
    holds version ``last`` or has waited ``waits`` times. ``keep_engine_at``: versions held
    before a sync expected to fail, where the engine's tensors are not poisoned (a
    transactional reader must keep them). ``victim``: stop mid-sync in KILLED_IN.
    ``flip_after``: arm a flipped byte once this version is held. ``join``: connect only once
    writer rank 0 says so (the process and its tensors are ready before)."""
    o = ctx.options
    r = ctx.reader(o["apply"])
    if o.get("join"):
        ctx.stage("ready to join; waiting for the writers' word")
        ctx.wait_signal("join", 120)
    ctx.stage("connecting")
    t0 = time.monotonic()
    r.connect()
    connected_s = time.monotonic() - t0
    if o.get("victim"):
        ctx.stall_midway(r, KILLED_IN - 1)
    log, armed, transport = [], None, None
    for _ in range(o["waits"]):
        if r.version is not None and r.version >= o["last"]:
            break
        if o.get("flip_after") is not None and r.version == o["flip_after"] and armed is None:
            transport = r.transport
            armed = _arm_flip(r)
        keep = r.version is not None and r.version in o.get("keep_engine_at", ())
        log.append(ctx.wait(r, poison_engine=not keep))
    ctx.stage("closing")
    r.close()
    flipped = transport.flipped if transport is not None else []
    return {"log": log, "armed": armed, "flipped": flipped, "connect_s": connected_s}


def _connect_only(ctx: Ctx) -> dict:
    """Connect once; report how it was refused (or that it connected)."""
    s = ctx.writer() if ctx.role == "writer" else ctx.reader("in_place")
    ctx.stage("connecting")
    t0 = time.monotonic()
    try:
        s.connect()
    except Exception as exc:
        return {
            "refused": type(exc).__name__,
            "text": str(exc),
            "seconds": time.monotonic() - t0,
            "transport_built": s.transport is not None,
        }
    s.close()
    return {"connected": True, "seconds": time.monotonic() - t0}


def _job(setup, writer_opts: dict, reader_opts: list[dict], body_w=_writer, body_r=_reader):
    """Two writers on GPUs 0-1, readers on GPUs 2-3 with options each."""
    people = [
        Person(f"writer-{w}", "writer", w, setup.device_of("writer", w), body_w, options=o)
        for w, o in enumerate(writer_opts)
    ]
    people += [
        Person(f"reader-{r}", "reader", r, setup.device_of("reader", r), body_r, options=o)
        for r, o in enumerate(reader_opts)
    ]
    return people


# ---------------------------------------------------------------------------------------------
# 1. kill -9 a reader mid-sync
# ---------------------------------------------------------------------------------------------

KILL_STEPS = 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", setup_params(always=("gloo-cpu",)))
def test_reader_killed_mid_sync_is_named_and_the_next_sync_goes_on_without_it(setup):
    w = {"steps": KILL_STEPS}
    survivor = {
        "apply": "transactional",
        "last": KILL_STEPS,
        "waits": KILL_STEPS + 1,
        "keep_engine_at": [KILLED_IN - 1],
    }
    victim = {"apply": "in_place", "victim": True, "last": KILL_STEPS, "waits": KILL_STEPS}
    survivors = ["writer-0", "writer-1", "reader-0"]
    with Run(setup, "kill-reader", _job(setup, [w, w], [survivor, victim])) as run:
        stalled = run.wait_signal("victim-ready", 150)
        time.sleep(0.3)  # the others block on what the victim never posts
        killed_at = run.kill("reader-1")
        reports = run.reports(survivors, 150)
        codes = run.exits(survivors)
        seconds = run.elapsed()
    no_error(reports)
    shown = f"victim stalled with {stalled['what']}; logs:\n{_show(reports)}"
    fig = Figures("reader killed mid-sync", setup.id, syncs=KILL_STEPS, injected=1)
    fig.seconds = seconds

    # the writers: the sync the reader died in raised naming it, in time; the next ones planned
    # again without it (a new epoch, a new transport) and went through
    latencies = []
    for name in ("writer-0", "writer-1"):
        log = reports[name]["log"]
        assert [e["v"] for e in log] == list(range(1, KILL_STEPS + 1)), f"{name}: {shown}"
        assert log[0]["ok"], f"{name}: the first sync failed: {shown}"
        e = log[KILLED_IN - 1]
        assert not e["ok"], f"{name}: the sync reader-1 was killed in succeeded: {shown}"
        assert e["error"] in ("PeerFailure", "SyncTimeout"), f"{name}: {shown}"
        assert "reader-1" in e["text"], f"{name}'s error does not name reader-1: {e['text']}"
        latencies.append(e["at"] - killed_at)
        assert e["at"] - killed_at < DETECT_S, (
            f"{name} raised {e['at'] - killed_at:.1f} s after the kill (bound {DETECT_S} s): {shown}"
        )
        assert e["seconds"] < SYNC_TIMEOUT_S + 5, f"{name}: {shown}"
        after = log[KILLED_IN:]
        assert all(x["ok"] for x in after), f"{name}: a sync after the kill failed: {shown}"
        first = after[0]
        assert first["epoch"] >= 1 and first["readers"] == ["reader-0"], (
            f"{name}: the sync after the kill did not plan again without reader-1: {shown}"
        )
        assert first["plan_s"] > 0, f"{name}: no planning in the sync after the kill: {shown}"
        assert first["transport"] != log[0]["transport"], (
            f"{name}: the same transport object served the new epoch: {shown}"
        )
    fig.detected = 1
    fig.latency_s = max(latencies)

    # the survivor: kept version KILLED_IN - 1 bit for bit through the failed sync, then every
    # later version bit exact (its tensors poisoned before each)
    log = reports["reader-0"]["log"]
    assert [e["ok"] for e in log] == [True, False, True, True], f"reader-0: {shown}"
    assert [e["v"] for e in log] == [1, KILLED_IN - 1, 3, 4], f"reader-0: {shown}"
    failed = log[1]
    assert failed["held"] == KILLED_IN - 1 and not failed["dirty"], f"reader-0: {shown}"
    assert failed["off"] == 0, (
        f"reader-0 (transactional) no longer holds version {KILLED_IN - 1} after the failed "
        f"sync: {failed['off']} bytes differ: {shown}"
    )
    assert log[2]["plan_s"] > 0 and log[2]["epoch"] >= 1, f"reader-0 did not plan again: {shown}"
    fig.bytes_lost = sum(e["off"] for e in log)
    assert fig.bytes_lost == 0, f"bytes lost on reader-0: {shown}"
    fig.notes = f"reader-1 killed with {stalled['what']}"
    _done(fig)
    assert codes == dict.fromkeys(survivors, 0), f"exit codes {codes} (None: hung): {shown}"


# ---------------------------------------------------------------------------------------------
# 2. kill -9 a writer mid-sync
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", SETUPS)
def test_writer_killed_mid_sync_readers_raise_naming_it_and_keep_or_flag(setup):
    steps = 3  # 1 goes through, 2 is cut by the kill, 3 finds the job ended
    w0, victim = {"steps": steps}, {"steps": steps, "victim": True}
    transactional = {
        "apply": "transactional",
        "last": 99,
        "waits": steps,
        "keep_engine_at": [KILLED_IN - 1],
    }
    in_place = {"apply": "in_place", "last": 99, "waits": steps}
    survivors = ["writer-0", "reader-0", "reader-1"]
    with Run(setup, "kill-writer", _job(setup, [w0, victim], [transactional, in_place])) as run:
        stalled = run.wait_signal("victim-ready", 150)
        time.sleep(0.3)
        killed_at = run.kill("writer-1")
        reports = run.reports(survivors, 150)
        codes = run.exits(survivors)
        seconds = run.elapsed()
    no_error(reports)
    shown = f"victim stalled with {stalled['what']}; logs:\n{_show(reports)}"
    fig = Figures("writer killed mid-sync", setup.id, syncs=steps, injected=1, seconds=seconds)

    latencies = []
    for name in ("reader-0", "reader-1"):
        log = reports[name]["log"]
        assert len(log) == steps and log[0]["ok"] and log[0]["v"] == 1, f"{name}: {shown}"
        e = log[1]
        assert not e["ok"], f"{name}: the sync writer-1 was killed in succeeded: {shown}"
        assert e["error"] in ("PeerFailure", "SyncTimeout"), f"{name}: {shown}"
        assert "writer-1" in e["text"], f"{name}'s error does not name writer-1: {e['text']}"
        latencies.append(e["at"] - killed_at)
        assert e["at"] - killed_at < DETECT_S, (
            f"{name} raised {e['at'] - killed_at:.1f} s after the kill (bound {DETECT_S} s): {shown}"
        )
        assert e["held"] == KILLED_IN - 1, f"{name}: {shown}"
        if name == "reader-0":  # transactional: the previous version, bit for bit
            assert e["apply"] == "transactional" and not e["dirty"], f"{name}: {shown}"
            assert e["off"] == 0, (
                f"reader-0 (transactional) no longer holds version {KILLED_IN - 1}: "
                f"{e['off']} bytes differ: {shown}"
            )
            fig.bytes_lost += e["off"]
        else:  # in place: flagged
            assert e["apply"] == "in_place" and e["dirty"], f"{name} is not dirty: {shown}"
        fig.bytes_lost += log[0]["off"]
        # the next wait: the job ended (a writer cannot be replaced); loud, not a hang
        last = log[2]
        assert not last["ok"] and "writer-1" in last["text"], f"{name}: {shown}"
    fig.detected = 1
    fig.latency_s = max(latencies)
    log = reports["writer-0"]["log"]
    assert log[0]["ok"] and not log[1]["ok"], f"writer-0: {shown}"
    assert "writer-1" in log[1]["text"], f"writer-0's error does not name writer-1: {shown}"
    assert log[2]["error"] == "MembershipError" and "writer-1" in log[2]["text"], (
        f"writer-0's next sync did not end the job naming writer-1: {shown}"
    )
    assert fig.bytes_lost == 0, shown
    fig.notes = f"writer-1 killed once {stalled['what']}"
    _done(fig)
    assert codes == dict.fromkeys(survivors, 0), f"exit codes {codes} (None: hung): {shown}"


# ---------------------------------------------------------------------------------------------
# 3. a byte flipped in transit is caught by the checksum
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", SETUPS)
def test_flipped_byte_is_caught_naming_tensor_writer_and_reader(setup):
    steps = 3  # 1 clean, 2 with a byte flipped on reader-1, 3 clean again (heals it)
    sync = {"transport": setup.flip_transport, "verify": "checksum"}
    w = {"steps": steps, "sync": sync}
    r0 = {
        "apply": "transactional",
        "last": steps,
        "waits": steps,
        "keep_engine_at": [1],
        "sync": sync,
    }
    r1 = {"apply": "in_place", "last": steps, "waits": steps, "flip_after": 1, "sync": sync}
    names = ["writer-0", "writer-1", "reader-0", "reader-1"]
    with Run(setup, "flip", _job(setup, [w, w], [r0, r1])) as run:
        reports = run.reports(names, 200)
        codes = run.exits(names)
        seconds = run.elapsed()
    no_error(reports)
    shown = _show(reports)
    armed, flipped = reports["reader-1"]["armed"], reports["reader-1"]["flipped"]
    fig = Figures("flipped byte", setup.id, syncs=steps, injected=len(flipped), seconds=seconds)
    assert armed is not None and len(flipped) == 1, f"the byte was not flipped once: {shown}"
    tensor, writer = armed["tensor"], armed["writer"]

    log = reports["reader-1"]["log"]
    assert [e["ok"] for e in log] == [True, False, True], f"reader-1: {shown}"
    e = log[1]
    assert e["error"] == "ChecksumMismatch", f"reader-1 did not raise ChecksumMismatch: {shown}"
    for part in (tensor, f"writer {writer!r}", "reader 'reader-1'", "checksum mismatch"):
        assert part in e["text"], f"{part!r} not in reader-1's error: {e['text']}"
    assert e["dirty"], f"reader-1 (in place) is not dirty after the mismatch: {shown}"
    fig.detected = 1
    fig.latency_s = e["at"] - flipped[0]["at"]
    assert log[2]["v"] == 3 and log[2]["off"] == 0 and not log[2]["dirty"], (
        f"the sync after the mismatch did not heal reader-1 bit for bit: {shown}"
    )

    # everyone else hears of it, with the tensor named; the transactional reader keeps v1
    for name in ("writer-0", "writer-1", "reader-0"):
        e = reports[name]["log"][1]
        assert not e["ok"] and e["error"] == "PeerFailure", f"{name}: {shown}"
        assert "ChecksumMismatch" in e["text"] and tensor in e["text"], f"{name}: {e['text']}"
        assert all(x["ok"] for i, x in enumerate(reports[name]["log"]) if i != 1), (
            f"{name}: a clean sync failed: {shown}"
        )
    log = reports["reader-0"]["log"]
    assert log[1]["held"] == 1 and not log[1]["dirty"] and log[1]["off"] == 0, (
        f"reader-0 (transactional) lost version 1 when reader-1's sync failed: {shown}"
    )
    # (reader-0: every entry, its failed one included; reader-1: its syncs that went through)
    fig.bytes_lost = sum(x["off"] for x in log)
    fig.bytes_lost += sum(x["off"] for x in reports["reader-1"]["log"] if x["ok"])
    assert fig.bytes_lost == 0, shown
    fig.notes = f"flipped in {tensor} from {writer} ({'staged' if armed['staged'] else 'in place'})"
    _done(fig)
    assert codes == dict.fromkeys(names, 0), f"exit codes {codes} (None: hung): {shown}"


# ---------------------------------------------------------------------------------------------
# 4. another plan, another model: refused at connect
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", SETUPS)
def test_reader_with_another_plan_or_model_is_refused_at_connect(setup):
    """Two jobs at once, one writer and one reader each: in ``plan`` the reader buckets
    differently (its plan digest differs), in ``model`` it holds a model with another MLP
    width. Both sides of each are refused at connect, naming both, before a transport exists."""
    gpu = setup.device == "cuda"
    bucket = (16 << 20) if gpu else (1 << 20)
    width = 2048 if gpu else 96
    one = {"num_writers": 1, "num_readers": 1}
    people = [
        Person("writer-0", "writer", 0, setup.gpu(0), _connect_only, "plan", dict(one)),
        Person(
            "reader-0",
            "reader",
            0,
            setup.gpu(2),
            _connect_only,
            "plan",
            {**one, "sync": {"bucket_bytes": 2 * bucket}},
        ),
        Person("writer-0@model", "writer", 0, setup.gpu(1), _connect_only, "model", dict(one)),
        Person(
            "reader-0@model",
            "reader",
            0,
            setup.gpu(3),
            _connect_only,
            "model",
            {**one, "model": {"intermediate_size": width}},
        ),
    ]
    with Run(setup, "refuse", people) as run:
        reports = run.reports(list(run.procs), 200)
        codes = run.exits(list(run.procs))
        seconds = run.elapsed()
    no_error(reports)
    shown = _show(reports)
    for name in ("writer-0", "reader-0"):
        r = reports[name]
        assert r.get("refused") == "PlanMismatch", f"{name} was not refused: {shown}"
        for part in ("disagree on 'plan'", "held by writer-0", "held by reader-0"):
            assert part in r["text"], f"{part!r} not in {name}'s error: {r['text']}"
        assert not r["transport_built"], f"{name} built a transport before refusing: {shown}"
    for name in ("writer-0@model", "reader-0@model"):
        r = reports[name]
        assert r.get("refused") in ("LayoutError", "PeerFailure"), f"{name}: {shown}"
        for part in ("mlp", "reader 'reader-0' has shape", "writer 'writer-0' has", f"{width}"):
            assert part in r["text"], f"{part!r} not in {name}'s error: {r['text']}"
        assert not r["transport_built"], f"{name} built a transport before refusing: {shown}"
    latency = max(r["seconds"] for r in reports.values())
    assert latency < 60, f"refusing took {latency:.1f} s: {shown}"
    _done(
        Figures(
            "misfit refused at connect",
            setup.id,
            syncs=0,
            injected=2,
            detected=2,
            latency_s=latency,
            seconds=seconds,
            notes="latency: connect to refusal",
        )
    )
    assert codes == dict.fromkeys(run.procs, 0), f"exit codes {codes} (None: hung): {shown}"


# ---------------------------------------------------------------------------------------------
# 5. a reader joins while the writers sync
# ---------------------------------------------------------------------------------------------

JOIN_STEPS = 6
JOIN_AFTER = 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", SETUPS)
def test_reader_joining_while_syncs_run_gets_the_current_version_bit_exact(setup):
    elastic = {"num_readers": 1, "max_readers": 2}
    w = {**elastic, "steps": JOIN_STEPS, "join_after": JOIN_AFTER}
    r0 = {**elastic, "apply": "transactional", "last": JOIN_STEPS, "waits": JOIN_STEPS}
    r1 = {**elastic, "apply": "in_place", "last": JOIN_STEPS, "waits": JOIN_STEPS, "join": True}
    names = ["writer-0", "writer-1", "reader-0", "reader-1"]
    with Run(setup, "join", _job(setup, [w, w], [r0, r1])) as run:
        reports = run.reports(names, 200)
        codes = run.exits(names)
        seconds = run.elapsed()
    no_error(reports)
    shown = _show(reports)
    fig = Figures("reader joins mid-run", setup.id, syncs=JOIN_STEPS, seconds=seconds)

    # the reader that was there: every version, bit exact, none failed
    log = reports["reader-0"]["log"]
    assert [e["v"] for e in log] == list(range(1, JOIN_STEPS + 1)), f"reader-0: {shown}"
    assert all(e["ok"] for e in log), f"reader-0 was disturbed: {shown}"
    # the newcomer: from the first sync after it connected, every version, bit exact
    new = reports["reader-1"]["log"]
    assert new and all(e["ok"] for e in new), f"reader-1: {shown}"
    first = new[0]["v"]
    assert JOIN_AFTER < first <= JOIN_AFTER + 3, f"reader-1 joined at version {first}: {shown}"
    assert [e["v"] for e in new] == list(range(first, JOIN_STEPS + 1)), f"reader-1: {shown}"
    fig.bytes_lost = sum(e["off"] for e in log + new)
    assert fig.bytes_lost == 0, f"bytes lost: {shown}"
    # the writers planned again once, for the sync that took the newcomer
    for name in ("writer-0", "writer-1"):
        wlog = reports[name]["log"]
        assert all(e["ok"] for e in wlog), f"{name}: {shown}"
        joined = wlog[first - 1]
        assert joined["readers"] == ["reader-0", "reader-1"] and joined["epoch"] == 1, (
            f"{name}: the sync of version {first} did not take reader-1 in a new epoch: {shown}"
        )
        assert joined["plan_s"] > 0 and joined["transport"] != wlog[0]["transport"], (
            f"{name}: the sync that took reader-1 did not plan again: {shown}"
        )
    assert log[first - 1]["plan_s"] > 0, f"reader-0 did not plan again for the newcomer: {shown}"
    fig.notes = f"joined at version {first}, connect took {reports['reader-1']['connect_s']:.2f} s"
    _done(fig)
    assert codes == dict.fromkeys(names, 0), f"exit codes {codes} (None: hung): {shown}"
