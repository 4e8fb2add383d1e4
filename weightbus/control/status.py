"""Live state of a job, read from its control store: what ``weightbus status`` shows.

Every participant publishes one small record under ``status/<name>`` (msgpack) when its
connect finishes and after every sync it completes (:func:`publish`). Together with the keys
the control plane keeps anyway (membership, heartbeats, failures, closes, the writers'
``begin`` announcements), that is enough to say, from any machine that can reach the store:

* who has registered, with role, rank, host and device;
* each participant's state: ``joining`` (registered, connect not finished), ``ready``,
  ``syncing``, ``failed``, ``closed``, or ``silent`` (its heartbeat stopped moving);
* the version each one holds and how many syncs it completed;
* the last sync of each: bytes, seconds, GB/s and seconds per phase;
* the failures reported, first first.

An observer (:func:`read_status`) is a plain store client: it registers nothing and writes
nothing, so looking never disturbs a running job. Anyone who can reach the store's port can
read it (see :mod:`weightbus.control.store` on the token).

Record of ``status/<name>``, version 2 (:data:`STATUS`; checked when read, and a malformed
one shows as that participant's error rather than stopping the view)::

    {"v": 2, "role": str, "rank": int, "version": int | None, "syncs": int, "seq": int,
     "epoch": int, "bytes_per_sync": int, "plan": str, "transport": str, "heartbeat_s": float,
     "connected_at": float, "last": None | {"version": int, "bytes": int, "seconds": float,
     "phases": {phase: seconds}, "at": float}, "error": None | str}

``syncs`` counts the syncs completed since connect, ``seq`` those of the current membership
epoch ``epoch`` (sync topics are numbered per epoch; see :mod:`weightbus.control.store`).

``error`` is the participant's own account of its failure, including failures that came from
another participant (which only that other one writes to the failure log).

Times ``connected_at`` and ``at`` are the participant's wall clock (``time.time()``); "ago"
figures compare them with the observer's clock, so they are only as right as the two clocks
agree.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from weightbus.control.store import (
    FAILURE,
    MEMBER,
    ROSTER,
    DictOf,
    Schema,
    _decode,
    _participant,
    _record,
    _split_addr,
)
from weightbus.errors import ProtocolError, WeightbusError
from weightbus.spec import Participant

if TYPE_CHECKING:
    from weightbus._session import SyncResult, _Session

__all__ = [
    "STATUS",
    "STATUS_FORMAT",
    "JobStatus",
    "ParticipantStatus",
    "list_jobs",
    "publish",
    "read_status",
]

logger = logging.getLogger(__name__)

STATUS_FORMAT = 2
"""Version of the ``status/<name>`` record layout."""

LAST_SYNC: Schema = {
    "version": int,
    "bytes": int,
    "seconds": float,
    "phases": DictOf(str, float, max_len=32),
    "at": float,
}
"""A participant's last sync in its status record."""
STATUS: Schema = {
    "v": int,
    "role": str,
    "rank": int,
    "version": (int, type(None)),
    "syncs": int,
    "seq": int,
    "epoch": int,
    "bytes_per_sync": int,
    "plan": str,
    "transport": str,
    "heartbeat_s": float,
    "connected_at": float,
    "last": (type(None), LAST_SYNC),
    "error": (str, type(None)),
}
"""``status/<name>``: what each participant publishes about itself."""

_PREFIX = "weightbus/"
_MAX_ERROR_CHARS = 4000
_PHASES = ("plan", "pack", "transfer", "unpack", "control")
# per session: (wall clock at connect, its last sync's record)
_PUBLISHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def publish(
    session: _Session, result: SyncResult | None = None, *, error: str | None = None
) -> None:
    """Publish ``session``'s status record: at the end of connect, after each completed sync
    (``result``) and when it fails (``error``). Costs one store write; never raises."""
    connected_at, last = _PUBLISHED.get(session, (time.time(), None))
    if result is not None:
        last = {
            "version": result.version,
            "bytes": result.bytes,
            "seconds": result.seconds,
            "phases": dict(result.phases),
            "at": time.time(),
        }
    _PUBLISHED[session] = (connected_at, last)
    layout = session.bound.layout
    plan = session.plan
    record = {
        "v": STATUS_FORMAT,
        "role": layout.role,
        "rank": layout.rank,
        "version": session.version,
        "syncs": session.syncs,
        "seq": session._seq,
        "epoch": session.control.epoch,
        "bytes_per_sync": session.bytes_per_sync,
        "plan": plan.digest[:16] if plan is not None else "",
        "transport": session.transport.name if session.transport is not None else "",
        "heartbeat_s": float(session.control.config.heartbeat_interval.total_seconds()),
        "connected_at": connected_at,
        "last": last,
        "error": error[:_MAX_ERROR_CHARS] if error else None,
    }
    try:
        session.control.publish_status(record)
    except Exception as e:  # advisory: a status write never fails a sync
        logger.debug("status of %s not published: %s", session.name, e)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParticipantStatus:
    """One participant as the control store shows it."""

    name: str
    """Participant name (unique in the job)."""
    role: str
    """``"writer"`` or ``"reader"``."""
    rank: int
    """Rank within the role."""
    host: str
    """Host id the participant registered with."""
    device: str
    """Device the participant registered with (``cpu``, ``cuda:0``, ...)."""
    state: str
    """``joining``, ``ready``, ``syncing``, ``failed``, ``closed`` or ``silent``."""
    version: int | None = None
    """The last version this participant completed (for a reader: the one its tensors hold)."""
    syncs: int = 0
    """Syncs it completed since connect."""
    bytes_per_sync: int = 0
    """Bytes it sends (writer) or receives (reader) per sync."""
    transport: str = ""
    """Transport it uses."""
    plan: str = ""
    """First 16 hex digits of its plan digest (every participant's must be equal)."""
    heartbeats: int = 0
    """Its heartbeat counter when read."""
    last_sync: dict[str, Any] | None = None
    """Its last sync: version, bytes, seconds, gbps, phases (seconds each), at (wall clock)."""
    error: str | None = None
    """Its failure, if any: what it reported to the job, else its own account (a failure
    caused by another participant)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobStatus:
    """One job on a control store: membership, versions, last sync, failures."""

    job: str
    """Job name (the key namespace)."""
    address: str
    """``host:port`` of the control store that was read."""
    num_writers: int
    """Writers the job was configured with."""
    num_readers: int
    """Readers the job was configured with."""
    host: str = ""
    """Who hosts the store (a participant, or empty when a separate process does)."""
    participants: tuple[ParticipantStatus, ...] = ()
    """Registered participants: writers by rank, then readers by rank."""
    missing: tuple[str, ...] = ()
    """Slots not registered yet, as ``"<role> rank <n>"``."""
    committed: int | None = None
    """The version writer rank 0 last committed."""
    in_progress: int | None = None
    """A version the writers announced and have not finished, if any."""
    failures: tuple[tuple[str, str], ...] = ()
    """``(participant, error)`` as reported in the current epoch, first first."""
    epoch: int = 0
    """The current membership epoch (0: the first; each join, leave or failed sync that
    changed the readers starts another)."""
    read_at: float = field(default_factory=time.time)
    """Observer's wall clock when this was read."""

    @property
    def last_sync(self) -> dict[str, Any] | None:
        """The newest version every participant completed, summed over the job: ``version``,
        ``bytes`` (received by all readers), ``seconds`` (slowest writer), ``gbps``, ``at``."""
        done = [p for p in self.participants if p.last_sync is not None]
        if not done:
            return None
        version = max(p.last_sync["version"] for p in done)
        same = [p for p in done if p.last_sync["version"] == version]
        readers = [p for p in same if p.role == "reader"]
        writers = [p for p in same if p.role == "writer"] or same
        nbytes = sum(p.last_sync["bytes"] for p in readers)
        seconds = max(p.last_sync["seconds"] for p in writers)
        return {
            "version": version,
            "bytes": nbytes,
            "seconds": seconds,
            "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            "at": max(p.last_sync["at"] for p in same),
            "readers": len(readers),
        }

    def version_lag(self) -> dict[str, int]:
        """Per reader holding a version: how many versions it is behind the newest one the
        writers announced or finished (0 between syncs; 1 during one; more if it fell behind)."""
        newest = [p.version for p in self.participants if p.role == "writer" and p.version]
        if self.in_progress is not None:
            newest.append(self.in_progress)
        if not newest:
            return {}
        top = max(newest)
        return {
            p.name: max(top - p.version, 0)
            for p in self.participants
            if p.role == "reader" and p.version is not None
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: every field, plus ``last_sync`` and ``version_lag``."""
        return {
            "job": self.job,
            "address": self.address,
            "num_writers": self.num_writers,
            "num_readers": self.num_readers,
            "host": self.host,
            "epoch": self.epoch,
            "registered": len(self.participants),
            "missing": list(self.missing),
            "committed": self.committed,
            "in_progress": self.in_progress,
            "last_sync": self.last_sync,
            "version_lag": self.version_lag(),
            "failures": [list(f) for f in self.failures],
            "participants": [p.to_dict() for p in self.participants],
            "read_at": self.read_at,
        }

    def render(self) -> str:
        """Human-readable lines: header, last sync, one table row per participant, failures."""
        total = self.num_writers + self.num_readers
        lines = [
            f"job {self.job!r} at {self.address}: {_count(self.num_writers, 'writer')}, "
            f"{_count(self.num_readers, 'reader')}; {len(self.participants)} of {total} registered"
            + (f" (missing {', '.join(self.missing)})" if self.missing else "")
            + (f"; membership epoch {self.epoch}" if self.epoch else "")
            + (f"; store hosted by {self.host}" if self.host else "")
        ]
        state = (
            f"committed version {self.committed}"
            if self.committed is not None
            else ("no version committed yet")
        )
        if self.in_progress is not None:
            state += f"; sync of version {self.in_progress} in progress"
        lines.append(state)
        last = self.last_sync
        if last is not None:
            ago = max(self.read_at - last["at"], 0.0)
            lines.append(
                f"last sync: version {last['version']}, {last['bytes'] / 1e6:.1f} MB to "
                f"{_count(last['readers'], 'reader')} in {last['seconds'] * 1e3:.1f} ms "
                f"({last['gbps']:.2f} GB/s), {ago:.1f} s ago"
            )
        lines.append("")
        head = (
            f"{'participant':<16} {'role':<6} {'rank':>4} {'host':<14} {'device':<8} "
            f"{'state':<8} {'version':>7} {'syncs':>5} {'MB':>9} {'ms':>8} {'GB/s':>7}  phases ms"
        )
        lines.append(head)
        for p in self.participants:
            s = p.last_sync
            mb = f"{s['bytes'] / 1e6:.1f}" if s else "-"
            ms = f"{s['seconds'] * 1e3:.1f}" if s else "-"
            gbps = f"{s['gbps']:.2f}" if s else "-"
            phases = (
                " ".join(f"{k}={v * 1e3:.1f}" for k, v in s["phases"].items() if v > 0) if s else ""
            )
            version = "-" if p.version is None else str(p.version)
            lines.append(
                f"{p.name:<16} {p.role:<6} {p.rank:>4} {p.host[:14]:<14} {p.device:<8} "
                f"{p.state:<8} {version:>7} {p.syncs:>5} {mb:>9} {ms:>8} {gbps:>7}  {phases}"
            )
        lines.append("")
        if self.failures:
            lines.append("failures (first first):")
            lines.extend(f"  {name}: {text}" for name, text in self.failures)
        else:
            lines.append("failures: none")
        return "\n".join(lines)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _connect(address: str, timeout: timedelta) -> dist.TCPStore:
    host, port = _split_addr(address)
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    except dist.DistError as e:
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise WeightbusError(
            f"could not reach a control store at {address} within "
            f"{timeout.total_seconds():.1f} s: {first}; check the address (the job's "
            "ControlConfig.address or $WEIGHTBUS_STORE_ADDR) and that the job is running"
        ) from None


def list_jobs(store: dist.Store) -> list[str]:
    """Names of the jobs that have registered on ``store`` (needs ``Store.list_keys``)."""
    if not hasattr(store, "list_keys"):
        raise WeightbusError(
            "this torch's TCPStore cannot list keys: pass the job name (--job, ControlConfig.job)"
        )
    jobs = set()
    for key in store.list_keys():
        if key.startswith(_PREFIX) and key.endswith("/counts"):
            jobs.add(key[len(_PREFIX) : -len("/counts")])
    return sorted(jobs)


def _job_status(store: dist.Store, address: str, job: str, sample: float | None) -> JobStatus:
    ns = f"{_PREFIX}{job}/"

    def has(key: str) -> bool:
        return bool(store.check([ns + key]))

    def get(key: str) -> bytes:
        return store.get(ns + key)

    if not has("counts"):
        try:
            known = list_jobs(store)
        except WeightbusError:
            known = []
        raise KeyError(
            f"no weightbus job {job!r} on the control store at {address}"
            + (f"; it holds jobs {known}: pass one with --job" if known else "")
        )
    try:
        num_writers, num_readers = (int(x) for x in get("counts").decode().split(","))
    except ValueError:
        raise ProtocolError(f"job {job!r}: its counts key holds {get('counts')[:40]!r}") from None
    host = get("host").decode(errors="replace") if has("host") else ""
    epoch = int(get("epoch")) if has("epoch") else 0
    people: list[Participant] = []
    missing: list[str] = []
    if epoch > 0:
        # the members of the current epoch, as writer rank 0 published them
        rec = _record(get(f"roster/{epoch}"), ROSTER, f"roster/{epoch}")
        people = [_participant(d, f"roster/{epoch}") for d in rec["members"]]
    else:
        slots = [("writer", r) for r in range(num_writers)]
        slots += [("reader", r) for r in range(num_readers)]
        for role, rank in slots:
            key = f"member/{role}/{rank}"
            if has(key):
                people.append(_participant(_record(get(key), MEMBER, key)["participant"], key))
            else:
                missing.append(f"{role} rank {rank}")
    # readers that asked to join and are not in yet
    if has("requests"):
        known = {p.name for p in people}
        for line in get("requests").decode(errors="replace").splitlines():
            name = line.split(" ", 1)[0]
            if name in known or not name or not has(f"name/{name}"):
                continue
            slot = get(f"name/{name}").decode(errors="replace")
            if has(f"member/{slot}"):
                rec = _record(get(f"member/{slot}"), MEMBER, f"member/{slot}")
                people.append(_participant(rec["participant"], f"member/{slot}"))
                known.add(name)
    people.sort(key=lambda p: (p.role != "writer", p.rank))

    suffix = f"@{epoch}" if epoch > 0 else ""
    failures: list[tuple[str, str]] = []
    if has(f"faillog{suffix}"):
        for name in dict.fromkeys(get(f"faillog{suffix}").decode(errors="replace").split()):
            text = ""
            if has(f"fail/{name}{suffix}"):
                try:
                    text = _record(get(f"fail/{name}{suffix}"), FAILURE, f"fail/{name}")["error"]
                except ProtocolError as e:
                    text = str(e)
            failures.append((name, text))
    failed = dict(failures)

    def beats() -> dict[str, int]:
        keys = [f"hb/{p.name}" for p in people if has(f"hb/{p.name}")]
        values = store.multi_get([ns + k for k in keys]) if keys else []
        return {k[3:]: int(v) for k, v in zip(keys, values, strict=True)}

    records: dict[str, dict] = {}
    malformed: dict[str, str] = {}
    for p in people:
        if has(f"status/{p.name}"):
            try:
                records[p.name] = _record(get(f"status/{p.name}"), STATUS, f"status/{p.name}")
            except ProtocolError as e:
                malformed[p.name] = str(e)
    if sample is None:
        # one and a half of the slowest heartbeat interval, so a live counter moves
        intervals = [r.get("heartbeat_s", 1.0) for r in records.values()] or [1.0]
        sample = min(max(1.5 * max(intervals), 0.2), 5.0)
    first = beats()
    closed = {p.name for p in people if has(f"closed/{p.name}")}

    # a writer that announced sync number `syncs` (its begin/<seq> topic) and has not finished
    in_progress = None
    for p in people:
        rec = records.get(p.name)
        if p.role == "writer" and rec is not None and p.name not in failed.keys() | closed:
            scope = f"@{rec['epoch']}/" if rec["epoch"] > 0 else ""
            topic = f"t/{p.name}/{scope}begin/{rec['seq']}"
            if has(topic):
                try:
                    value = _decode(get(topic), 1 << 16)
                except ProtocolError:
                    continue
                if isinstance(value, dict) and "version" in value:
                    in_progress = max(in_progress or value["version"], value["version"])

    if sample > 0:
        time.sleep(sample)
    second = beats() if sample > 0 else first

    out = []
    committed = None
    for p in people:
        rec = records.get(p.name)
        error = failed.get(p.name) or (rec.get("error") if rec else None) or malformed.get(p.name)
        if error:
            state = "failed"
        elif p.name in closed:
            state = "closed"
        elif sample > 0 and second.get(p.name) == first.get(p.name):
            state = "silent"
        elif rec is None:
            state = "joining"
        elif in_progress is not None and (rec.get("version") or -1) < in_progress:
            state = "syncing"
        else:
            state = "ready"
        last = None
        if rec is not None and rec.get("last"):
            last = dict(rec["last"])
            last["gbps"] = last["bytes"] / last["seconds"] / 1e9 if last["seconds"] > 0 else 0.0
            last["phases"] = {k: last["phases"].get(k, 0.0) for k in _PHASES} | {
                k: v for k, v in last["phases"].items() if k not in _PHASES
            }
        if p.role == "writer" and p.rank == 0 and rec is not None:
            committed = rec.get("version")
        out.append(
            ParticipantStatus(
                name=p.name,
                role=p.role,
                rank=p.rank,
                host=p.host,
                device=p.device,
                state=state,
                version=rec.get("version") if rec else None,
                syncs=rec.get("syncs", 0) if rec else 0,
                bytes_per_sync=rec.get("bytes_per_sync", 0) if rec else 0,
                transport=rec.get("transport", "") if rec else "",
                plan=rec.get("plan", "") if rec else "",
                heartbeats=second.get(p.name, 0),
                last_sync=last,
                error=error,
            )
        )
    return JobStatus(
        job=job,
        address=address,
        num_writers=num_writers,
        num_readers=num_readers,
        host=host,
        participants=tuple(out),
        missing=tuple(missing),
        committed=committed,
        in_progress=in_progress,
        failures=tuple(failures),
        epoch=epoch,
    )


def read_status(
    address: str,
    job: str | None = None,
    *,
    sample: float | None = 0.0,
    timeout: timedelta = timedelta(seconds=10),
    store: dist.Store | None = None,
) -> list[JobStatus]:
    """Read the live state of ``job`` (None: every job on the store) at ``address``.

    ``sample`` > 0 reads the heartbeat counters twice, that many seconds apart, and marks a
    participant whose counter did not move ``silent`` (pick more than its heartbeat
    interval); None picks 1.5 heartbeat intervals as the participants published them; 0
    skips the check. ``store`` reuses an open client instead of connecting. Raises
    :class:`~weightbus.errors.WeightbusError` when the store cannot be reached and
    ``KeyError`` when the job is not on it.
    """
    if store is None:
        store = _connect(address, timeout)
    try:
        jobs = [job] if job is not None else list_jobs(store)
    except dist.DistError as e:
        raise WeightbusError(
            f"could not list the jobs on the control store at {address}: {e}"
        ) from None
    if not jobs:
        raise KeyError(f"no weightbus job has registered on the control store at {address} yet")
    try:
        return [_job_status(store, address, name, sample) for name in jobs]
    except dist.DistError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightbusError(
            f"lost the control store at {address} while reading it: {first}; the job has "
            "probably ended (its store host exited)"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """``weightbus status``: print the live state of the jobs on a control store."""
    import argparse
    import json
    import sys

    from weightbus.control.store import _env_addr

    p = argparse.ArgumentParser(
        prog="weightbus status",
        description="Live view of a weightbus job: participants, versions, last sync, failures.",
    )
    p.add_argument(
        "--store",
        default=_env_addr(),
        metavar="HOST:PORT",
        help="the job's control store (default $WEIGHTBUS_STORE_ADDR, else localhost:29700)",
    )
    p.add_argument("--job", default=None, help="job name (default: every job on the store)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument(
        "--sample",
        type=float,
        default=None,
        metavar="SECONDS",
        help="watch heartbeats this long to find silent participants (default 1.5 heartbeat "
        "intervals; 0 skips)",
    )
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to reach the store (default 10)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="instead of printing, serve the --job's gauges for Prometheus on PORT until Ctrl-C",
    )
    args = p.parse_args(argv)
    if args.sample is not None and args.sample < 0:
        p.error(f"--sample {args.sample} must be >= 0")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout} must be > 0")
    timeout = timedelta(seconds=args.timeout)
    try:
        _split_addr(args.store)
    except ValueError as e:
        p.error(str(e))
    if args.metrics_port is not None:
        from weightbus import metrics

        if args.job is None:
            p.error("--metrics-port serves one job: pass --job NAME")
        server = metrics.serve(args.metrics_port, store=args.store, job=args.job, timeout=timeout)
        print(f"serving job {args.job!r} of {args.store} at {server.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            server.close()
            return 0
    try:
        jobs = read_status(args.store, args.job, sample=args.sample, timeout=timeout)
    except (WeightbusError, KeyError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if args.json:
            print(json.dumps({"address": args.store, "error": text}))
        print(f"weightbus status: {text}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"address": args.store, "jobs": [j.to_dict() for j in jobs]}, indent=1))
    else:
        print("\n\n".join(j.render() for j in jobs))
    return 0
