"""The control plane: membership, topics, agreement, failures, heartbeats, cleanup.

Participants run as threads of this process, each with its own store connection, except where
a real process has to die.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import TCPStore

from tests.transport_contract import process_context
from weightbus.control.store import (
    DEFAULT_STORE_ADDR,
    STORE_ADDR_ENV,
    TOKEN_ENV,
    ControlConfig,
    ControlPlane,
    Roster,
)
from weightbus.errors import (
    AccessDenied,
    MembershipError,
    PeerFailure,
    PlanMismatch,
    SyncTimeout,
    WeightbusError,
)
from weightbus.spec import Box, LayoutBuilder, Participant

pytestmark = pytest.mark.timeout(60)

FAST = {
    "timeout": timedelta(seconds=10),
    "heartbeat_interval": timedelta(milliseconds=100),
    "heartbeat_timeout": timedelta(seconds=1),
}


def _config(n_w: int, n_r: int, address: str, **kw) -> ControlConfig:
    return ControlConfig(num_writers=n_w, num_readers=n_r, address=address, **{**FAST, **kw})


def _people(n_w: int, n_r: int) -> list[Participant]:
    return [Participant(role="writer", rank=r) for r in range(n_w)] + [
        Participant(role="reader", rank=r) for r in range(n_r)
    ]


def _job(n_w: int, n_r: int, **kw) -> list[ControlPlane]:
    """Control planes for a job whose store writer-0 hosts (on a free port); writer-0 connected."""
    job = kw.pop("job", f"t{uuid.uuid4().hex[:8]}")
    people = _people(n_w, n_r)
    host = ControlPlane(people[0], _config(n_w, n_r, "127.0.0.1:0", job=job, **kw)).connect()
    return [host] + [
        ControlPlane(p, _config(n_w, n_r, host.address, job=job, **kw)) for p in people[1:]
    ]


def _run(planes: list[ControlPlane], body, timeout_s: float = 30) -> dict:
    """Run ``body(control)`` for every participant on its own thread; name -> result or error."""
    out: dict = {}

    def one(c: ControlPlane) -> None:
        try:
            c.connect()
            out[c.participant.name] = body(c)
        except Exception as e:
            out[c.participant.name] = e
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in planes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a participant thread hung"
    return out


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def test_config_checks_say_what_and_how(monkeypatch):
    monkeypatch.delenv(STORE_ADDR_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert ControlConfig(num_writers=1, num_readers=1).address == DEFAULT_STORE_ADDR
    monkeypatch.setenv(STORE_ADDR_ENV, "10.1.2.3:4567")
    monkeypatch.setenv(TOKEN_ENV, "hunter2")
    cfg = ControlConfig(num_writers=1, num_readers=1)
    assert (cfg.host, cfg.port, cfg.token) == ("10.1.2.3", 4567, "hunter2")
    assert "hunter2" not in repr(cfg)
    assert ControlConfig(num_writers=1, num_readers=1, address="[::1]:80").host == "::1"
    bad = [
        ({"address": "nohost"}, "not 'host:port'"),
        ({"address": "h:99999"}, "not 'host:port'"),
        ({"num_writers": 0}, "num_writers=0"),
        ({"job": "a/b"}, "job='a/b'"),
        ({"timeout": 5}, "timedelta"),
        ({"timeout": timedelta(0)}, "not positive"),
        ({"heartbeat_timeout": timedelta(seconds=1)}, "twice"),
        ({"topic_window": 2}, "topic_window=2"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            ControlConfig(**{"num_writers": 1, "num_readers": 1, **kw})


# ---------------------------------------------------------------------------------------------
# membership
# ---------------------------------------------------------------------------------------------


def test_register_and_participants_sorted_with_an_existing_default_group():
    # trainer and engine jobs have their own default groups; the control plane must not care
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        planes = _job(2, 2)
        planes.reverse()  # register in the "wrong" order
        out = _run(planes, lambda c: c.participants())
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
    rosters = set(out.values())
    assert len(rosters) == 1
    roster = rosters.pop()
    assert isinstance(roster, Roster)
    writers, readers = roster
    assert [p.name for p in writers] == ["writer-0", "writer-1"]
    assert [p.name for p in readers] == ["reader-0", "reader-1"]
    assert roster.global_rank("reader-0") == 2 and roster["writer-1"].rank == 1
    assert planes[-1].address != "127.0.0.1:0" and planes[-1].hosting


def test_duplicate_rank_or_name_and_bad_counts_are_refused():
    host, w1, r0 = _job(2, 1)
    try:
        w1.connect()
        r0.connect()
        addr, job = host.address, host.config.job
        again = ControlPlane(
            Participant(role="writer", rank=1, name="w1-copy"), _config(2, 1, addr, job=job)
        )
        with pytest.raises(
            MembershipError, match=r"writer rank 1 is already taken .* by 'writer-1'"
        ):
            again.connect()
        thief = ControlPlane(
            Participant(role="reader", rank=0, name="writer-0"), _config(2, 2, addr, job=job)
        )
        with pytest.raises(MembershipError, match=r"num_readers=2.*num_readers=1"):
            thief.connect()
        thief = ControlPlane(
            Participant(role="writer", rank=0, name="reader-0"),
            _config(3, 1, addr, job=job, host_store=False),
        )
        with pytest.raises(MembershipError, match="num_writers=3"):
            thief.connect()
        far = ControlPlane(Participant(role="reader", rank=4), _config(2, 1, addr, job=job))
        with pytest.raises(MembershipError, match=r"rank 4 .* ranks run 0..0"):
            far.connect()
        # the same name under a free slot, in a job with room for it
        big = _job(1, 2)
        try:
            big[1].connect()
            clash = ControlPlane(
                Participant(role="reader", rank=1, name="reader-0"),
                _config(1, 2, big[0].address, job=big[0].config.job),
            )
            with pytest.raises(
                MembershipError, match=r"name 'reader-0' is already taken .* by reader rank 0"
            ):
                clash.connect()
        finally:
            big[1].close()
            big[0].close(timeout=timedelta(seconds=1))
    finally:
        w1.close()
        r0.close()
        host.close()


def test_wrong_token_is_refused_without_revealing_it():
    host = ControlPlane(
        Participant(role="writer", rank=0), _config(1, 1, "127.0.0.1:0", token="s3cret-A")
    ).connect()
    try:
        intruder = ControlPlane(
            Participant(role="reader", rank=0), _config(1, 1, host.address, token="wrong-B")
        )
        with pytest.raises(AccessDenied) as info:
            intruder.connect()
        text = str(info.value)
        assert "reader 'reader-0'" in text and "token does not match" in text
        assert "s3cret-A" not in text and "wrong-B" not in text
        guest = ControlPlane(
            Participant(role="reader", rank=0), _config(1, 1, host.address, token="s3cret-A")
        )
        guest.connect()
        assert guest.participants().size == 2
        guest.close()
    finally:
        host.close()


def test_missing_participant_named_on_timeout():
    host, _, _ = _job(1, 2)
    try:
        with pytest.raises(SyncTimeout) as info:
            host.participants(timeout=timedelta(milliseconds=300))
        assert info.value.missing == ["reader rank 0", "reader rank 1"]
        assert "1 of 3 participants registered" in str(info.value)
    finally:
        host.close(timeout=timedelta(milliseconds=100))


# ---------------------------------------------------------------------------------------------
# topics
# ---------------------------------------------------------------------------------------------


def test_post_and_gather_bytes_and_dicts_by_role_and_name():
    def body(c: ControlPlane):
        me = c.participant
        c.post("hello/1", {"rank": me.rank, "role": me.role, "blob": b"\x00\x01"})
        c.post("raw/1", bytes([me.rank, 255]))
        everyone = c.gather("hello/1")
        readers = c.gather("raw/1", role="reader")
        some = c.gather("raw/1", names=["writer-1", "reader-0"])
        with pytest.raises(ValueError, match="write-once"):
            c.post("hello/1", b"")
        with pytest.raises(TypeError, match="never pickle"):
            c.post("x", [1, 2])
        with pytest.raises(KeyError, match="nobody"):
            c.gather("raw/1", names=["nobody"])
        c.barrier("done")
        return everyone, readers, some

    out = _run(_job(2, 2), body)
    for name, got in out.items():
        assert not isinstance(got, Exception), (name, got)
        everyone, readers, some = got
        assert list(everyone) == ["writer-0", "writer-1", "reader-0", "reader-1"]
        assert everyone["reader-1"] == {"rank": 1, "role": "reader", "blob": b"\x00\x01"}
        assert readers == {"reader-0": bytes([0, 255]), "reader-1": bytes([1, 255])}
        assert some == {"writer-1": bytes([1, 255]), "reader-0": bytes([0, 255])}


def test_gather_times_out_naming_who_has_not_posted():
    def body(c: ControlPlane):
        if c.participant.name != "reader-1":
            c.post("ack/7", b"ok")
        try:
            c.gather("ack/7", timeout=timedelta(milliseconds=400))
        except SyncTimeout as e:
            return e
        finally:
            c.barrier("end")  # nobody closes while the others still wait

    out = _run(_job(1, 2), body)
    for name, err in out.items():
        assert isinstance(err, SyncTimeout), (name, err)
        assert err.missing == ["reader-1"]
        assert "topic 'ack/7' from reader 'reader-1' (2 of 3 posted)" in str(err)


def test_closing_without_posting_is_a_peer_failure():
    def body(c: ControlPlane):
        c.participants()
        if c.participant.name == "reader-0":
            return None
        with pytest.raises(
            PeerFailure, match="reader 'reader-0' closed its control plane without posting 'ack/1'"
        ):
            c.gather("ack/1", role="reader")
        return "ok"

    out = _run(_job(1, 1), body)
    assert out["writer-0"] == "ok", out


def test_topic_cleanup_keeps_the_store_bounded():
    host, reader = _job(1, 1, topic_window=8)
    try:
        reader.connect()
        raw = host.store
        prefix = f"weightbus/{host.config.job}/t/reader-0/"
        for v in range(40):
            reader.post(f"ack/{v}", b"x")
        keys_after_40 = raw.num_keys()
        assert [raw.check([prefix + f"ack/{v}"]) for v in (31, 32, 39)] == [False, True, True]
        for v in range(40, 400):
            reader.post(f"ack/{v}", b"x")
        assert raw.num_keys() == keys_after_40
        assert host.gather("ack/399", role="reader") == {"reader-0": b"x"}
        reader.drop("ack/399")
        assert not raw.check([prefix + "ack/399"])
        reader.post("ack/399", b"again")  # dropped topics may be posted anew
        reader.post("ack/0", b"again")  # and so may topics that left the window
    finally:
        reader.close()
        host.close()


# ---------------------------------------------------------------------------------------------
# agreement and layouts
# ---------------------------------------------------------------------------------------------


def _layout(p: Participant):
    b = LayoutBuilder(p)
    b.add_tensor("w", (4, 8), "bfloat16")
    half = p.rank * 2
    b.add_local("w", (2, 8), "bfloat16")
    b.add_piece("w", Box((half, 0), (half + 2, 8)), "w", Box((0, 0), (2, 8)))
    return b.build()


def test_exchange_layouts_round_trip():
    def body(c: ControlPlane):
        mine = _layout(c.participant)
        writers, readers = c.exchange_layouts(mine)
        again = c.exchange_layouts(mine)  # a second exchange uses fresh topics
        assert [x.digest for x in again[0]] == [x.digest for x in writers]
        return [x.digest for x in writers], [x.digest for x in readers], [x.name for x in readers]

    planes = _job(2, 2)
    expected_w = [_layout(p).digest for p in _people(2, 2)[:2]]
    expected_r = [_layout(p).digest for p in _people(2, 2)[2:]]
    out = _run(planes, body)
    for name, got in out.items():
        assert got == (expected_w, expected_r, ["reader-0", "reader-1"]), (name, got)
    with pytest.raises(ValueError, match="same Participant"):
        ControlPlane(Participant(role="writer", rank=0), _config(1, 1, "h:1")).exchange_layouts(
            _layout(Participant(role="writer", rank=1))
        )


def test_agree_names_who_holds_which_digest():
    def body(c: ControlPlane):
        assert c.agree("layouts", "same") == "same"
        odd = c.participant.name in ("reader-1", "writer-1")
        with pytest.raises(PlanMismatch) as info:
            c.agree("plan", "b" * 64 if odd else "a" * 64)
        return info.value

    out = _run(_job(2, 2), body)
    for name, err in out.items():
        assert isinstance(err, PlanMismatch), (name, err)
        assert err.groups == {
            "a" * 64: ["writer-0", "reader-0"],
            "b" * 64: ["writer-1", "reader-1"],
        }
        text = str(err)
        assert "disagree on 'plan'" in text
        assert (
            f"{'a' * 16} held by writer-0, reader-0; {'b' * 16} held by writer-1, reader-1" in text
        )


# ---------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------


def test_fail_reaches_every_other_participant():
    def body(c: ControlPlane):
        c.participants()
        if c.participant.name == "reader-1":
            c.fail("CUDA out of memory while unpacking bucket 12")
            c.fail("a second report is ignored")
            c.raise_if_failed()  # its own failure is not a peer's
            return "reported"
        with pytest.raises(PeerFailure) as info:
            c.gather("never", timeout=timedelta(seconds=10))
        return info.value

    t0 = time.monotonic()
    out = _run(_job(2, 2), body)
    assert time.monotonic() - t0 < 5
    assert out.pop("reader-1") == "reported"
    for name, err in out.items():
        assert isinstance(err, PeerFailure), (name, err)
        assert str(err) == "reader 'reader-1' failed: CUDA out of memory while unpacking bucket 12"
        assert err.failures == [("reader-1", "CUDA out of memory while unpacking bucket 12")]


def test_context_manager_reports_an_exception():
    host, reader = _job(1, 1)
    with pytest.raises(RuntimeError):
        with reader:
            reader.participants()
            raise RuntimeError("engine crashed")
    with pytest.raises(PeerFailure, match="reader 'reader-0' failed: RuntimeError: engine crashed"):
        host.raise_if_failed()
    host.close()


def test_host_close_waits_for_the_others_then_they_lose_the_store():
    host, reader = _job(1, 1)
    reader.connect()
    reader.participants()
    closer = threading.Timer(0.5, reader.close)
    closer.start()
    t0 = time.monotonic()
    host.close()
    assert time.monotonic() - t0 >= 0.4, "the host left before the reader closed"
    closer.join()

    host, reader = _job(1, 1)
    reader.connect()
    reader.participants()
    host.close(timeout=timedelta(milliseconds=200))  # gives up on the reader, with a warning
    with pytest.raises(
        PeerFailure, match=r"lost the control store at .* \(hosted by writer 'writer-0'\)"
    ):
        reader.gather("anything", timeout=timedelta(seconds=2))
    reader.close()


def _child_reader(address: str, job: str, writers: int = 1) -> None:
    p = Participant(role="reader", rank=1)
    ControlPlane(p, _config(writers, 2, address, host_store=False, job=job)).connect()
    time.sleep(60)


@contextlib.contextmanager
def _reader_to_kill(writers: int):
    """A store, and reader-1 of a job of ``writers`` writers and 2 readers in a process of its
    own (to be killed); yields (address, job, process)."""
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    address, job = f"127.0.0.1:{store.port}", f"kill-{uuid.uuid4().hex[:8]}"
    child = process_context().Process(
        target=_child_reader, args=(address, job, writers), daemon=True
    )
    child.start()
    try:
        yield address, job, child
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)


@pytest.mark.timeout(30)
def test_killed_process_detected_by_heartbeat_naming_it():
    killed = threading.Event()
    killed_at: list[float] = []
    with _reader_to_kill(1) as (address, job, child):
        planes = [
            ControlPlane(p, _config(1, 2, address, host_store=False, job=job))
            for p in _people(1, 1)
        ]

        def body(c: ControlPlane):
            c.participants(timeout=timedelta(seconds=20))
            if c.participant.name == "writer-0":
                os.kill(child.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
                killed.set()
            killed.wait(10)
            c.post("ack/1", b"ok")
            with pytest.raises(PeerFailure) as info:
                c.gather("ack/1", timeout=timedelta(seconds=20))
            return info.value, time.monotonic() - killed_at[0]

        out = _run(planes, body)
    for name, got in out.items():
        assert not isinstance(got, Exception), (name, got)
        err, seconds = got
        assert "reader 'reader-1' stopped sending heartbeats" in str(err), str(err)
        assert err.failures[0][0] == "reader-1"
        assert seconds < 4, f"{name} took {seconds:.1f} s (heartbeat_timeout 1 s)"


@pytest.mark.timeout(30)
def test_a_death_seen_by_heartbeat_is_what_the_others_hear_of_first():
    """A killed process reports nothing itself. The participant whose heartbeat check finds it
    dead says so for it in the store before its caller acts on it (aborting a transport),
    so a participant that hears of failures through the store names the dead one first, not
    the failure that abort then causes elsewhere (seen in a CI run: a writer's sync named the
    reader whose receive broke when the other writer aborted, not the reader that died)."""
    watcher, bystander, listener = _people(2, 1)  # writer-0, writer-1, reader-0
    detected, secondary = threading.Event(), threading.Event()
    with _reader_to_kill(2) as (address, job, child):
        slow = {"heartbeat_timeout": timedelta(seconds=60)}
        planes = [
            ControlPlane(watcher, _config(2, 2, address, host_store=False, job=job)),
            # these two hear of failures from the store only, never from heartbeats
            ControlPlane(bystander, _config(2, 2, address, host_store=False, job=job, **slow)),
            ControlPlane(listener, _config(2, 2, address, host_store=False, job=job, **slow)),
        ]

        def body(c: ControlPlane):
            c.participants(timeout=timedelta(seconds=20))
            name = c.participant.name
            if name == "writer-0":
                os.kill(child.pid, signal.SIGKILL)
                with pytest.raises(PeerFailure) as info:
                    c.gather("never", timeout=timedelta(seconds=20))
                detected.set()
                return info.value
            assert detected.wait(20)
            if name == "writer-1":  # what the watcher's abort would cause
                c.fail("gloo: writer 'writer-1' lost send to reader 'reader-0': connection closed")
                secondary.set()
                return None
            assert secondary.wait(20)
            with pytest.raises(PeerFailure) as info:
                c.raise_if_failed(fresh=True)
            return info.value

        out = _run(planes, body)
    for name, got in out.items():
        assert not isinstance(got, Exception) or isinstance(got, PeerFailure), (name, got)
    watched, heard = out["writer-0"], out["reader-0"]
    assert watched.failures[0][0] == "reader-1", str(watched)
    assert [n for n, _ in heard.failures] == ["reader-1", "writer-1"], str(heard)
    assert str(heard).startswith("reader 'reader-1' failed: reader 'reader-1' stopped sending")
    assert "(seen by writer 'writer-0')" in heard.failures[0][1]


def test_calls_before_connect_are_refused():
    c = ControlPlane(Participant(role="writer", rank=0), _config(1, 1, "127.0.0.1:1"))
    with pytest.raises(WeightbusError, match="not connected"):
        c.post("x", b"")
    with pytest.raises(ValueError, match="port 0"):
        ControlPlane(Participant(role="reader", rank=0), _config(1, 1, "127.0.0.1:0")).connect()
    c.fail("nothing to report to")  # never raises
    c.close()
    with pytest.raises(WeightbusError, match="closed"):
        c.connect()


def test_a_gather_returns_what_was_posted_before_a_failure_was_reported():
    """A participant that posted and then reported a failure (it found a disagreement in what
    everyone posted) does not hide the values from a gather already waiting for them: it gets
    them, and so sees the disagreement itself, not only the report."""
    looked, failed = threading.Event(), threading.Event()

    def body(c: ControlPlane):
        c.post("digest/1", c.participant.name.encode())
        if c.participant.name == "reader-0":
            c.gather("digest/1")
            assert looked.wait(10)
            c.fail("reader-0: the digests disagree")
            failed.set()
            return None
        real = c._call

        def call(fn, *args, **kw):
            topic = "digest/1" in str(args)
            if getattr(fn, "__name__", "") == "check" and topic and not looked.is_set():
                # the writer's first look finds a value missing; the reader then posts it,
                # finds the disagreement and reports it before the writer looks again
                looked.set()
                assert failed.wait(10)
                return False
            return real(fn, *args, **kw)

        c._call = call
        return c.gather("digest/1")

    out = _run(_job(1, 1), body)
    assert out["writer-0"] == {"writer-0": b"writer-0", "reader-0": b"reader-0"}, out
