"""Prometheus metrics, scraped over HTTP while a writer and a reader sync (threads of this
process, gloo, plain modules received in place)."""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from weightbus import metrics

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16))


def _pair(job: str, store: dist.TCPStore):
    from weightbus import ControlConfig, Reader, SyncConfig, Writer
    from weightbus.engines.module import bind

    cfg = ControlConfig(
        num_writers=1,
        num_readers=1,
        address=f"127.0.0.1:{store.port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=20),
        heartbeat_interval=timedelta(seconds=0.2),
        heartbeat_timeout=timedelta(seconds=5),
    )
    sync = SyncConfig(
        transport="gloo",
        direct_bytes=1024,
        sync_timeout=timedelta(seconds=20),
        step_timeout=timedelta(seconds=20),
    )
    writer = Writer(bind(_model(), "writer", 0), cfg, sync)
    reader = Reader(bind(_model(), "reader", 0), cfg, sync)
    return writer, reader


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one scrape."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(scrape: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in scrape, f"{key} not scraped; have {sorted(k for k in scrape if k[0] == name)}"
    return scrape[key]


def test_sync_counters_histograms_and_job_gauges_are_scraped():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"metrics-{uuid.uuid4().hex[:8]}"
    address = f"127.0.0.1:{store.port}"
    server = metrics.serve(0, host="127.0.0.1", store=address, job=job)
    writer, reader = _pair(job, store)
    pool = ThreadPoolExecutor(2)
    try:
        connects = [pool.submit(writer.connect), pool.submit(reader.connect)]
        for f in connects:
            f.result(30)
        for v in (1, 2, 3):
            w, r = pool.submit(writer.sync, v), pool.submit(reader.wait)
            w.result(30), r.result(30)
        s = _scrape(server.url)
        for who, role, nbytes in (
            ("writer-0", "writer", writer.bytes_per_sync),
            ("reader-0", "reader", reader.bytes_per_sync),
        ):
            labels = {"job": job, "participant": who, "role": role}
            assert _value(s, "weightbus_syncs_total", **labels) == 3
            assert _value(s, "weightbus_sync_bytes_total", **labels) == 3 * nbytes
            assert _value(s, "weightbus_bytes_per_sync", **labels) == nbytes
            assert _value(s, "weightbus_version", **labels) == 3
            assert _value(s, "weightbus_last_sync_gbps", **labels) > 0
            assert _value(s, "weightbus_sync_seconds_count", **labels) == 3
            assert _value(s, "weightbus_sync_seconds_sum", **labels) > 0
            assert _value(s, "weightbus_sync_seconds_bucket", **labels, le="+Inf") == 3
            for phase in ("pack", "transfer", "unpack", "control"):
                count = _value(s, "weightbus_sync_phase_seconds_count", **labels, phase=phase)
                assert count == 3
            assert _value(s, "weightbus_sync_failures_total", **labels) == 0
        assert _value(s, "weightbus_job_up", job=job) == 1
        assert _value(s, "weightbus_job_registered_participants", job=job) == 2
        assert _value(s, "weightbus_job_failed_participants", job=job) == 0
        assert (
            _value(
                s,
                "weightbus_job_participant_version",
                job=job,
                participant="reader-0",
                role="reader",
            )
            == 3
        )
        assert _value(s, "weightbus_job_version_lag", job=job, participant="reader-0") == 0

        # the writer announces version 4 while the reader is still busy: the reader lags by one
        w = pool.submit(writer.sync, 4)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = _scrape(server.url)
            if _value(s, "weightbus_job_version_lag", job=job, participant="reader-0") == 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the reader's version lag never read 1 while version 4 was announced")
        r = pool.submit(reader.wait)
        w.result(30), r.result(30)
        s = _scrape(server.url)
        assert _value(s, "weightbus_job_version_lag", job=job, participant="reader-0") == 0

        # a real failure: the engine moved a tensor it receives in place
        reader.bound.tensors["0.weight"].data = reader.bound.tensors["0.weight"].data.clone()
        w, r = pool.submit(writer.sync, 5), pool.submit(reader.wait)
        with pytest.raises(Exception, match="moved to new storage"):
            r.result(30)
        with pytest.raises(Exception, match="reader-0"):
            w.result(30)
        s = _scrape(server.url)
        for who, role in (("writer-0", "writer"), ("reader-0", "reader")):
            labels = {"job": job, "participant": who, "role": role}
            assert _value(s, "weightbus_sync_failures_total", **labels) == 1
            assert _value(s, "weightbus_syncs_total", **labels) == 4
        assert _value(s, "weightbus_job_failed_participants", job=job) == 1
    finally:
        writer.close()
        reader.close()
        pool.shutdown()
        server.close()

    # the store is gone: the exporter says so instead of failing the scrape
    del store
    server = metrics.serve(
        0, host="127.0.0.1", store=address, job=job, timeout=timedelta(seconds=1)
    )
    try:
        s = _scrape(server.url)
        assert _value(s, "weightbus_job_up", job=job) == 0
    finally:
        server.close()


def test_metrics_port_from_the_environment(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv(metrics.METRICS_PORT_ENV, str(port))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"env-{uuid.uuid4().hex[:8]}"
    writer, reader = _pair(job, store)
    pool = ThreadPoolExecutor(2)
    try:
        for f in [pool.submit(writer.connect), pool.submit(reader.connect)]:
            f.result(30)
        w, r = pool.submit(writer.sync, 1), pool.submit(reader.wait)
        w.result(30), r.result(30)
        s = _scrape(f"http://127.0.0.1:{port}/metrics")
        labels = {"job": job, "participant": "reader-0", "role": "reader"}
        assert _value(s, "weightbus_syncs_total", **labels) == 1
        assert _value(s, "weightbus_sync_bytes_total", **labels) == reader.bytes_per_sync
        with pytest.raises(RuntimeError, match="already served"):
            metrics.serve(0)
    finally:
        writer.close()
        reader.close()
        pool.shutdown()
        if metrics._server is not None:
            metrics._server.close()


def test_bad_ports_are_refused_clearly():
    with pytest.raises(ValueError, match="must be an int in 0..65535"):
        metrics.serve(70000)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{busy}"):
            metrics.serve(busy, host="127.0.0.1")
