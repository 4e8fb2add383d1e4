"""Prometheus metrics of syncs, served on a port you opt into.

Nothing is collected or served unless asked: call :func:`serve` in a participant's process,
or set ``$WEIGHTBUS_METRICS_PORT`` before its ``connect()``. ``prometheus_client`` is imported
only then (``pip install 'weightbus[metrics]'``).

Per process (labels `job`, `participant`, `role`; `phase` on phase seconds):

| name | type | meaning |
| --- | --- | --- |
| `weightbus_syncs_total` | counter | syncs completed |
| `weightbus_sync_bytes_total` | counter | bytes sent (writer) or received (reader) |
| `weightbus_sync_failures_total` | counter | failures of this participant (connect or sync) |
| `weightbus_sync_seconds` | histogram | wall time of one sync |
| `weightbus_sync_phase_seconds` | histogram | seconds per phase of one sync |
| `weightbus_version` | gauge | last version completed |
| `weightbus_bytes_per_sync` | gauge | bytes moved per sync, fixed at connect |
| `weightbus_last_sync_gbps` | gauge | GB/s of the last sync |

Per job, when :func:`serve` is given the control store's address. They are read from the store
at each scrape, so one exporter can watch a whole job from anywhere (`weightbus status --store
HOST:PORT --metrics-port N` runs one):

| name | labels | meaning |
| --- | --- | --- |
| `weightbus_job_up` | job | 1 if the store answered this scrape |
| `weightbus_job_registered_participants` | job | participants registered |
| `weightbus_job_failed_participants` | job | participants that reported a failure |
| `weightbus_job_participant_version` | job, participant, role | version each one holds |
| `weightbus_job_version_lag` | job, participant | per reader: versions behind the newest announced |
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightbus._session import SyncResult, _Session

__all__ = ["METRICS_PORT_ENV", "MetricsServer", "registry", "serve"]

logger = logging.getLogger(__name__)

METRICS_PORT_ENV = "WEIGHTBUS_METRICS_PORT"
"""Environment variable: serve metrics on this port from the first participant that connects
in the process (no code change needed)."""

_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

_lock = threading.Lock()
_env_lock = threading.Lock()
_metrics: _Metrics | None = None
_server: MetricsServer | None = None


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "weightbus metrics need prometheus_client: pip install 'weightbus[metrics]'"
        ) from e
    return prometheus_client


class _Metrics:
    """The instruments of this process, on a registry of their own."""

    def __init__(self) -> None:
        pc = _prometheus()
        self.registry = pc.CollectorRegistry(auto_describe=True)
        labels = ("job", "participant", "role")
        r = self.registry
        self.syncs = pc.Counter("weightbus_syncs", "Syncs completed", labels, registry=r)
        self.bytes = pc.Counter(
            "weightbus_sync_bytes",
            "Bytes sent (writer) or received (reader) by completed syncs",
            labels,
            registry=r,
        )
        self.failures = pc.Counter(
            "weightbus_sync_failures",
            "Failures of this participant, in connect or in a sync",
            labels,
            registry=r,
        )
        self.seconds = pc.Histogram(
            "weightbus_sync_seconds",
            "Wall time of one sync on this participant",
            labels,
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.phase_seconds = pc.Histogram(
            "weightbus_sync_phase_seconds",
            "Seconds per phase of one sync (plan, pack, transfer, unpack, control)",
            (*labels, "phase"),
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.version = pc.Gauge(
            "weightbus_version", "Last version this participant completed", labels, registry=r
        )
        self.bytes_per_sync = pc.Gauge(
            "weightbus_bytes_per_sync",
            "Bytes this participant moves per sync, fixed at connect",
            labels,
            registry=r,
        )
        self.gbps = pc.Gauge(
            "weightbus_last_sync_gbps", "GB/s of this participant's last sync", labels, registry=r
        )


def _labels(session: _Session) -> tuple[str, str, str]:
    return (session.control.config.job, session.name, session.bound.layout.role)


def registry() -> Any:
    """This process's ``prometheus_client.CollectorRegistry`` (created, and collection
    switched on, at the first call), to expose through a server of your own instead of
    :func:`serve`."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _Metrics()
        return _metrics.registry


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsServer:
    """A running metrics endpoint; ``url`` answers Prometheus scrapes."""

    host: str
    """Address it listens on."""
    port: int
    """Port it listens on (the real one when asked for port 0)."""
    _httpd: Any
    _thread: Any
    _collector: Any = None

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` (``localhost`` when listening on every address)."""
        host = "localhost" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (collection goes on; :func:`serve` may start a new server)."""
        global _server
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        with _lock:
            if self._collector is not None and _metrics is not None:
                _metrics.registry.unregister(self._collector)
            if _server is self:
                _server = None


class _JobCollector:
    """Reads a job's status from its control store at each scrape."""

    def __init__(self, address: str, job: str, timeout: timedelta) -> None:
        self.address, self.job, self.timeout = address, job, timeout
        self._store = None
        self._lock = threading.Lock()

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from weightbus.control import status

        up = GaugeMetricFamily(
            "weightbus_job_up", "1 if the control store answered", labels=["job"]
        )
        with self._lock:
            try:
                if self._store is None:
                    self._store = status._connect(self.address, self.timeout)
                (job,) = status.read_status(self.address, self.job, sample=0, store=self._store)
            except Exception as e:
                self._store = None  # reconnect at the next scrape
                logger.warning(
                    "weightbus metrics: could not read job %r at %s: %s", self.job, self.address, e
                )
                up.add_metric([self.job], 0)
                yield up
                return
        up.add_metric([self.job], 1)
        yield up
        registered = GaugeMetricFamily(
            "weightbus_job_registered_participants", "Participants registered", labels=["job"]
        )
        registered.add_metric([self.job], len(job.participants))
        yield registered
        failed = GaugeMetricFamily(
            "weightbus_job_failed_participants",
            "Participants that reported a failure",
            labels=["job"],
        )
        failed.add_metric([self.job], len(job.failures))
        yield failed
        version = GaugeMetricFamily(
            "weightbus_job_participant_version",
            "Version each participant holds",
            labels=["job", "participant", "role"],
        )
        for p in job.participants:
            if p.version is not None:
                version.add_metric([self.job, p.name, p.role], p.version)
        yield version
        lag = GaugeMetricFamily(
            "weightbus_job_version_lag",
            "Per reader: versions behind the newest one the writers announced or finished",
            labels=["job", "participant"],
        )
        for name, behind in job.version_lag().items():
            lag.add_metric([self.job, name], behind)
        yield lag


def serve(
    port: int,
    *,
    host: str = "0.0.0.0",
    store: str | None = None,
    job: str = "default",
    timeout: timedelta = timedelta(seconds=5),
) -> MetricsServer:
    """Serve this process's metrics over HTTP on ``port`` (0: any free port) and switch
    collection on. One server per process; a second call raises.

    ``store`` (``host:port`` of a control store) adds the ``weightbus_job_*`` gauges of
    ``job``, read from the store at each scrape with ``timeout`` per store connection.
    """
    global _server
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an int in 0..65535 (0 picks a free one)")
    pc = _prometheus()
    reg = registry()
    with _lock:
        if _server is not None:
            raise RuntimeError(
                f"weightbus metrics are already served at {_server.url} in this process; "
                "close() that server first, or scrape it"
            )
        collector = _JobCollector(store, job, timeout) if store is not None else None
        try:
            httpd, thread = pc.start_http_server(port, addr=host, registry=reg)
        except OSError as e:
            raise OSError(
                f"weightbus metrics cannot listen on {host}:{port}: {e}; pick a free port "
                f"(${METRICS_PORT_ENV} or serve(port=...)), or 0 for any"
            ) from None
        if collector is not None:
            reg.register(collector)
        _server = MetricsServer(
            host=host, port=httpd.server_port, _httpd=httpd, _thread=thread, _collector=collector
        )
    logger.info("weightbus metrics served at %s", _server.url)
    return _server


# -- hooks the writer and reader call (no-ops unless metrics are on) ---------------------------


def on_connect(session: _Session) -> None:
    """After a participant connected: serve on ``$WEIGHTBUS_METRICS_PORT`` if set and not
    already serving, and record its bytes per sync."""
    port = os.environ.get(METRICS_PORT_ENV)
    if port:
        with _env_lock:  # participants of one process may connect at once: one server
            if _server is None:
                try:
                    serve(int(port))
                except Exception as e:  # metrics never fail a connect
                    logger.warning(
                        "weightbus metrics: $%s=%r not served: %s", METRICS_PORT_ENV, port, e
                    )
    m = _metrics
    if m is None:
        return
    labels = _labels(session)
    m.bytes_per_sync.labels(*labels).set(session.bytes_per_sync)
    # counters exist from connect on, at 0, so rates and alerts see them before the first event
    for counter in (m.syncs, m.bytes, m.failures):
        counter.labels(*labels)


def on_sync(session: _Session, result: SyncResult) -> None:
    """After a completed sync: count it, its bytes, its seconds and phases."""
    m = _metrics
    if m is None:
        return
    labels = _labels(session)
    m.syncs.labels(*labels).inc()
    m.bytes.labels(*labels).inc(result.bytes)
    m.seconds.labels(*labels).observe(result.seconds)
    for phase, seconds in result.phases.items():
        m.phase_seconds.labels(*labels, phase).observe(seconds)
    m.version.labels(*labels).set(result.version)
    m.gbps.labels(*labels).set(result.gbps)


def on_failure(session: _Session) -> None:
    """After this participant failed (in connect or in a sync)."""
    m = _metrics
    if m is None:
        return
    m.failures.labels(*_labels(session)).inc()
