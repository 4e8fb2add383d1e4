"""The nccl transport's own logic in CI, on CPU (``tests/nccl_on_cpu.py``: Gloo in place of
NCCL, host stand-ins for CUDA streams and events): the transport contract, a peer killed mid
transfer and a peer's reported failure. NCCL's behaviour itself is the GPU tests' part
(``tests/test_gpu.py``)."""

from __future__ import annotations

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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["plain", "delta"])
def test_writer_and_readers_over_the_nccl_logic_are_bit_exact(nccl_stand_ins, codec):
    """One writer, two engine replicas, a few syncs over the nccl transport's logic: in-place
    buckets posted as groups (both ends agreeing at connect), or, with a delta codec, every
    bucket alone; each reader's poisoned tensors bit exact after each sync."""
    from tests.test_transport_links import MODEL, _canonical, _reader_syncs, _writer
    from tests.threads import run_threads
    from weightbus import DeltaConfig, Writer
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    model = model_spec(MODEL)
    n_w, n_r, syncs = 1, 2, 3
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"nccl-cpu-{uuid.uuid4().hex[:6]}"
    extra = {"delta": DeltaConfig(checksum_every=2)} if codec == "delta" else {}

    def configs():
        from tests.test_faults_membership import configs

        return configs(
            store.port, n_w, n_r, job, transport=NAME, sync_timeout=timedelta(seconds=15), **extra
        )

    def writer():
        # (in the readers' dtype: buckets go in place on both ends, where groups form)
        bound = _writer(model, 0, n_w, dtype="bfloat16")
        with Writer(bound, *configs()) as w:
            for v in range(1, syncs + 1):
                fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
                w.sync(v)
            return type(w.transport).__name__

    readers = {f"reader-{r}": _reader_syncs(model, r, None, configs, syncs) for r in range(n_r)}
    out = run_threads({"writer-0": writer, **readers})
    for name, got in out.items():
        assert not isinstance(got, BaseException), (name, got)
    assert out["writer-0"] == "NcclOnCpu"
    assert out["reader-0"] == out["reader-1"] == [0] * syncs
    if codec == "plain":
        assert nccl_stand_ins.groups > 0  # the in-place buckets went in groups
    else:
        assert nccl_stand_ins.groups == 0  # a codec's side posts every bucket alone


@pytest.mark.timeout(120)
def test_ends_that_would_post_differently_fail_at_connect(nccl_stand_ins, monkeypatch):
    """One reader with $WEIGHTBUS_NCCL_GROUPS=0, the others grouping: a group and a single
    operation go through different NCCL communicators and would wait for each other for good;
    every participant raises at connect instead, naming who posts how and the fix."""
    import threading

    from tests.test_transport_links import MODEL, _reader_syncs, _writer
    from tests.threads import run_threads
    from weightbus import Writer
    from weightbus.errors import PlanMismatch
    from weightbus.layouts.families import model_spec
    from weightbus.transports import nccl

    singly = threading.local()  # the threads that run as if $WEIGHTBUS_NCCL_GROUPS=0
    real = nccl.env_int
    monkeypatch.setattr(
        nccl,
        "env_int",
        lambda name, default: 0 if getattr(singly, "on", False) else real(name, default),
    )
    model = model_spec(MODEL)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"nccl-cpu-{uuid.uuid4().hex[:6]}"

    def configs():
        from tests.test_faults_membership import configs

        return configs(store.port, 1, 2, job, transport=NAME, sync_timeout=timedelta(seconds=15))

    def writer():
        with Writer(_writer(model, 0, 1, dtype="bfloat16"), *configs()):
            return "connected"

    def alone(body):
        def go():
            singly.on = True
            return body()

        return go

    out = run_threads(
        {
            "writer-0": writer,
            "reader-0": _reader_syncs(model, 0, None, configs, 1),
            "reader-1": alone(_reader_syncs(model, 1, None, configs, 1)),
        }
    )
    for name, got in out.items():
        assert isinstance(got, PlanMismatch), (name, got)
        assert "WEIGHTBUS_NCCL_GROUPS" in str(got) and "reader-1" in str(got), (name, got)
    assert nccl_stand_ins.groups == 0  # nothing was posted
