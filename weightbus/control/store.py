"""The control plane: membership, topics, agreement, failures and heartbeats on a TCPStore.

Every participant (writer or reader) opens one :class:`ControlPlane` on a torch.distributed
``TCPStore`` of its own; the default process group is never touched, so trainer and engine jobs
keep theirs. One process hosts the store (by default writer rank 0); the others connect as
clients. All keys sit under ``weightbus/<job>/`` so several jobs can share one store.

Keys, relative to that prefix (``@<e>``: the key of membership epoch ``e``, absent in the
first epoch, 0)::

    auth                  sha256 of the shared-secret token (the token itself never travels)
    counts                "<num_writers>,<num_readers>" as the first participant saw them
    membership            "elastic" or "fixed" (ControlConfig.elastic) as the first one saw it
    host                  name of the participant hosting the store
    member/<role>/<rank>  msgpack: participant + a per-process nonce (claimed with compare_set)
    name/<name>           "<role>/<rank>" (claimed with compare_set)
    hb/<name>             heartbeat counter, incremented every heartbeat_interval
    faillog@<e>           names of failed participants, one per line, first failure first
    fail/<name>@<e>       msgpack: the failure text (for one found dead by its heartbeats,
                          written by the participant that found it)
    aborted@<e>           present once a sync or connect failed in epoch e
    closed/<name>         present once the participant called close()
    t/<name>/@<e>/<topic> one posted value: b"b" + raw bytes, or b"m" + msgpack
    status/<name>         msgpack: the participant's last sync, for ``weightbus status``
    sub/<kind>@<e>/<n>/.. prefixes handed to transports (gloo's rendezvous)
    epoch                 the current membership epoch (set once the first one formed)
    roster/<e>            msgpack: the members of epoch e > 0, from writer rank 0
    requests              "<name> <last epoch> <nonce>" per line: who asks into the next epoch
    changes               counter bumped by every request, close and failure
    ended                 why writer rank 0 could not go on (a writer left)

Membership (elastic, see :meth:`ControlPlane.form_epoch`) changes in epochs: everything a
sync posts lives under its epoch, so a new epoch starts clean.

Heartbeats are counters, not timestamps: an observer measures how long a counter has not moved
on its own monotonic clock, so clocks of different hosts never have to agree.

Lifetime rule: the hosting process must be the last to leave. When it exits, the store goes with
it and every other participant's next call raises :class:`PeerFailure` ("lost the control
store"). :meth:`ControlPlane.close` on the host therefore waits (bounded by the timeout) until
every other participant has closed, failed, or stopped sending heartbeats.

The token is a guard against wiring the wrong jobs together, not authentication against an
attacker: anyone who can reach the store's port can read and write its keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist

from weightbus.errors import (
    AccessDenied,
    MembershipError,
    PeerFailure,
    PlanMismatch,
    ProtocolError,
    SyncTimeout,
    WeightbusError,
)
from weightbus.spec import Layout, LayoutError, Participant

__all__ = [
    "DEFAULT_STORE_ADDR",
    "STORE_ADDR_ENV",
    "TOKEN_ENV",
    "ControlConfig",
    "ControlPlane",
    "DictOf",
    "ListOf",
    "Roster",
    "Row",
    "Schema",
    "check_message",
]

logger = logging.getLogger(__name__)

STORE_ADDR_ENV = "WEIGHTBUS_STORE_ADDR"
"""Environment variable holding the control store's ``host:port``."""

TOKEN_ENV = "WEIGHTBUS_TOKEN"
"""Environment variable holding the job's shared-secret token."""

DEFAULT_STORE_ADDR = "localhost:29700"
"""Store address when neither the config nor :data:`STORE_ADDR_ENV` gives one."""

_JOB_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_ERROR_CHARS = 8000
_MAX_DIGEST_BYTES = 256
_POLL_FIRST_S = 0.0001  # in-sync answers come within a millisecond or two; long waits back off
_POLL_LAST_S = 0.05
_POLLS_PER_S_X_S = 800  # store requests per second from all pollers, times seconds waited
_CLOSED_CHECK_S = 0.25
_REPORT_CHECK_S = 0.01


def _env_addr() -> str:
    return os.environ.get(STORE_ADDR_ENV) or DEFAULT_STORE_ADDR


def _env_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def _split_addr(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"control store address {address!r} is not 'host:port': pass e.g. "
            f"'10.0.0.1:29700' (config address or ${STORE_ADDR_ENV})"
        )
    return host.strip("[]"), int(port)


def _positive(name: str, value: object) -> float:
    if not isinstance(value, timedelta):
        raise ValueError(
            f"{name}={value!r} is not a datetime.timedelta: pass e.g. timedelta(seconds=30)"
        )
    seconds = value.total_seconds()
    if seconds <= 0:
        raise ValueError(f"{name}={value} is not positive: pass e.g. timedelta(seconds=30)")
    return seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlConfig:
    """How a participant reaches the control store and how long it waits there."""

    num_writers: int
    """Number of writer (trainer-side) participants in the job."""
    num_readers: int
    """Number of reader (inference-side) participants that start the job: the first connect
    waits for reader ranks ``0 .. num_readers - 1``. With :attr:`elastic` membership readers
    may later leave, and others join (up to :attr:`max_readers`)."""
    address: str = field(default_factory=_env_addr)
    """``host:port`` of the store; default ``$WEIGHTBUS_STORE_ADDR``, else ``localhost:29700``."""
    host_store: bool | None = None
    """Whether this process hosts the store; None: writer rank 0 hosts it."""
    job: str = "default"
    """Key namespace, so several jobs can share one store."""
    timeout: timedelta = timedelta(minutes=5)
    """Default bound on every wait (registration, gather, agree, the host's close)."""
    heartbeat_interval: timedelta = timedelta(seconds=1)
    """How often this participant bumps its heartbeat counter."""
    heartbeat_timeout: timedelta = timedelta(seconds=30)
    """A participant whose heartbeat has not moved for this long is reported dead."""
    token: str | None = field(default_factory=_env_token, repr=False)
    """Shared secret every participant of the job must present; default ``$WEIGHTBUS_TOKEN``."""
    topic_window: int = 256
    """Each participant keeps its last this-many posted topics in the store; older ones are deleted."""
    elastic: bool = True
    """Readers may join, leave and die while the job runs: writer rank 0 checks membership at
    the start of every sync (one small control message per sync) and, when it changed, every
    participant plans again for the new members before the sync. False: the members are the
    ones of the first connect and any failure ends the job. Equal on every participant."""
    max_readers: int | None = None
    """Most readers the job may have; reader ranks run ``0 .. max_readers - 1``. The first
    ``num_readers`` of them start the job, others join it while it runs. None: num_readers."""
    rejoin_timeout: timedelta = timedelta(seconds=30)
    """After a failed sync, how long the next one waits for each surviving reader to come
    back (its next ``wait``) before planning without it; it can join again later."""
    max_message_bytes: int = 64 << 20
    """Largest control message this participant posts or accepts (layouts, transport tables,
    sync messages); a larger one is refused with an error naming its sender."""

    def __post_init__(self) -> None:
        for name in ("num_writers", "num_readers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.max_readers is not None and (
            not isinstance(self.max_readers, int)
            or isinstance(self.max_readers, bool)
            or self.max_readers < self.num_readers
        ):
            raise ValueError(
                f"max_readers={self.max_readers!r} must be an int >= num_readers="
                f"{self.num_readers} (readers that may join later), or None"
            )
        if not isinstance(self.elastic, bool):
            raise ValueError(f"elastic={self.elastic!r} must be True or False")
        if not self.elastic and self.reader_slots != self.num_readers:
            raise ValueError(
                f"max_readers={self.max_readers} lets readers join later, but elastic=False "
                "fixes the members at connect: set elastic=True, or leave max_readers out"
            )
        _positive("rejoin_timeout", self.rejoin_timeout)
        if (
            not isinstance(self.max_message_bytes, int)
            or isinstance(self.max_message_bytes, bool)
            or self.max_message_bytes < 1 << 16
        ):
            raise ValueError(
                f"max_message_bytes={self.max_message_bytes!r} must be an int >= 65536 "
                "(layouts and transport tables of real models take megabytes)"
            )
        _split_addr(self.address)
        if not isinstance(self.job, str) or not _JOB_RE.match(self.job):
            raise ValueError(
                f"job={self.job!r} must be a non-empty name of letters, digits, '.', '_' or '-'"
            )
        _positive("timeout", self.timeout)
        interval = _positive("heartbeat_interval", self.heartbeat_interval)
        limit = _positive("heartbeat_timeout", self.heartbeat_timeout)
        if limit < 2 * interval:
            raise ValueError(
                f"heartbeat_timeout={self.heartbeat_timeout} is less than twice "
                f"heartbeat_interval={self.heartbeat_interval}: one late beat would read as a "
                "death; raise heartbeat_timeout or lower heartbeat_interval"
            )
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError("token must be a str or None")
        if not isinstance(self.topic_window, int) or self.topic_window < 8:
            raise ValueError(
                f"topic_window={self.topic_window!r} must be an int >= 8 (topics still being "
                "gathered would be deleted)"
            )

    @property
    def reader_slots(self) -> int:
        """Reader ranks the job may use: :attr:`max_readers`, else :attr:`num_readers`."""
        return self.max_readers if self.max_readers is not None else self.num_readers

    @property
    def host(self) -> str:
        """Host part of :attr:`address`."""
        return _split_addr(self.address)[0]

    @property
    def port(self) -> int:
        """Port part of :attr:`address`."""
        return _split_addr(self.address)[1]


@dataclass(frozen=True, slots=True)
class Roster:
    """Every participant of a job: writers, then readers, each sorted by rank.

    The global order (``all``) is the rank order transports use. ``writers, readers = roster``
    unpacks the two roles.
    """

    writers: tuple[Participant, ...]
    """Writers by rank."""
    readers: tuple[Participant, ...]
    """Readers by rank."""

    @classmethod
    def of(cls, participants: Iterable[Participant]) -> Roster:
        """A roster from participants in any order (e.g. ``TransferPlan.participants``)."""
        people = list(participants)
        by_role = {
            role: tuple(sorted((p for p in people if p.role == role), key=lambda p: p.rank))
            for role in ("writer", "reader")
        }
        return cls(writers=by_role["writer"], readers=by_role["reader"])

    def __iter__(self) -> Iterator[tuple[Participant, ...]]:
        yield self.writers
        yield self.readers

    @property
    def all(self) -> tuple[Participant, ...]:
        """Writers, then readers: the global rank order."""
        return self.writers + self.readers

    @property
    def size(self) -> int:
        """Number of participants."""
        return len(self.writers) + len(self.readers)

    def names(self, role: str | None = None) -> list[str]:
        """Names in global order, optionally of one role."""
        return [p.name for p in self.all if role is None or p.role == role]

    def __getitem__(self, name: str) -> Participant:
        for p in self.all:
            if p.name == name:
                return p
        raise KeyError(f"no participant named {name!r}; the job has {self.names()}")

    def __contains__(self, name: object) -> bool:
        return any(p.name == name for p in self.all)

    def global_rank(self, name: str) -> int:
        """Index in :attr:`all`: writers first by rank, then readers by rank."""
        for i, p in enumerate(self.all):
            if p.name == name:
                return i
        raise KeyError(f"no participant named {name!r}; the job has {self.names()}")


def _who(p: Participant) -> str:
    return f"{p.role} {p.name!r}"


def _rank(p: Participant) -> int:
    return p.rank


def _int(raw: bytes | int, what: str) -> int:
    """An integer the store holds (a counter or an epoch number)."""
    if isinstance(raw, int):
        return raw
    try:
        return int(raw)
    except ValueError:
        raise ProtocolError(f"store key {what!r} holds {raw[:40]!r}, not an integer") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _encode(value: bytes | bytearray | memoryview | dict) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b" + bytes(value)
    if isinstance(value, dict):
        return b"m" + msgpack.packb(value, use_bin_type=True)
    raise TypeError(
        f"post() takes bytes or a dict (sent as msgpack), got {type(value).__name__}; "
        "encode other values yourself (never pickle)"
    )


Schema = dict[str, Any]
"""A message's fields: name -> its kind. A kind is a type, a tuple of kinds (any of them;
``type(None)`` for optional), a nested :data:`Schema` (a dict with exactly those fields),
:class:`ListOf`, :class:`Row` or :class:`DictOf`."""


class ListOf:
    """Kind of a list whose items are all of kind ``item``, at most ``max_len`` of them."""

    __slots__ = ("item", "max_len")

    def __init__(self, item: Any, max_len: int | None = None) -> None:
        self.item = item
        """The kind of every item."""
        self.max_len = max_len
        """Most items allowed (None: any number)."""

    def __repr__(self) -> str:
        return f"ListOf({_kind_name(self.item)})"


class Row:
    """Kind of a list of fixed length whose i-th item is of kind ``items[i]``."""

    __slots__ = ("items",)

    def __init__(self, *items: Any) -> None:
        self.items = items
        """The kind of each position."""

    def __repr__(self) -> str:
        return f"Row({', '.join(_kind_name(k) for k in self.items)})"


class DictOf:
    """Kind of a dict with keys of kind ``key`` and values of kind ``value`` (free names)."""

    __slots__ = ("key", "max_len", "value")

    def __init__(self, key: Any, value: Any, max_len: int | None = None) -> None:
        self.key = key
        """The kind of every key."""
        self.value = value
        """The kind of every value."""
        self.max_len = max_len
        """Most entries allowed (None: any number)."""

    def __repr__(self) -> str:
        return f"DictOf({_kind_name(self.key)}, {_kind_name(self.value)})"


BEGIN: Schema = {"version": int, "pieces": bool}
"""``begin/<seq>``, from each writer: the version this sync carries, and whether every group
of deltas it sends travels as pieces, each with the next group's directories ahead (readers
may then post all their receives from it at once: ``DeltaConfig.announce``)."""
ACK: Schema = {"version": int, "ok": bool, "bytes": int}
"""``ack/<seq>``, from each reader: the version it now holds, and the bytes it received."""
COMMIT: Schema = {"version": int}
"""``commit/<seq>``, from writer rank 0: the version every reader acknowledged."""
HOLDS: Schema = {"holds": (int, type(None)), "checksum": bool}
"""``holds/<seq>``, from each reader with deltas: the version its tensors hold (None: not
one the writers sent), and whether it asks for checksums."""
MEMBERS: Schema = {"epoch": int}
"""``members/<seq>``, from writer rank 0 with elastic membership, at the start of each sync
but the first of an epoch: the epoch this sync runs in (one more than the current: the
members changed, everyone plans again first)."""
PARTICIPANT: Schema = {
    "role": str,
    "rank": int,
    "name": str,
    "host": str,
    "device": str,
    "gpu": str,
    "process": str,
}
"""A participant as the store holds it (:meth:`Participant.to_dict`). A peer running a
weightbus without ``gpu`` and ``process`` is refused with a :class:`ProtocolError` naming it."""
MEMBER: Schema = {"participant": PARTICIPANT, "nonce": str}
"""``member/<role>/<rank>``: who holds a rank, and the nonce of that process's registration."""
ROSTER: Schema = {"epoch": int, "members": ListOf(PARTICIPANT), "joined": ListOf(str)}
"""``roster/<epoch>``, from writer rank 0: every participant of an epoch after the first, and
those that joined in it."""
FAILURE: Schema = {"role": str, "rank": int, "error": str}
"""``fail/<name>``: the failure a participant reported."""


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_kind_name(k) for k in kind)
    if isinstance(kind, dict):
        return f"a message with fields {sorted(kind)}"
    if isinstance(kind, type):
        return kind.__name__
    return repr(kind)


def _mismatch(v: Any, kind: Any, path: str) -> str | None:
    """Why ``v`` is not of ``kind`` (``path`` names it in the message), or None when it is."""
    if isinstance(kind, tuple):
        whys = [_mismatch(v, k, path) for k in kind]
        if any(w is None for w in whys):
            return None
        nested = [w for w, k in zip(whys, kind, strict=True) if not isinstance(k, type)]
        if len(nested) == 1 and isinstance(v, (dict, list)):
            return nested[0]  # the one structured kind it could be: say what is wrong inside
        return f"{path}={v!r:.60}: the protocol wants {_kind_name(kind)}"
    if isinstance(kind, type):
        if kind in (int, bool):
            ok = type(v) is kind and (kind is bool or -(2**63) <= v < 2**63)
        else:
            ok = isinstance(v, kind)
        return None if ok else f"{path}={v!r:.60}: the protocol wants {kind.__name__}"
    if isinstance(kind, dict):
        if not isinstance(v, dict):
            return f"{path}={v!r:.60}: the protocol wants {_kind_name(kind)}"
        if set(v) != set(kind):
            return f"{path} with fields {sorted(map(str, v))}, the protocol has {sorted(kind)}"
        for name, k in kind.items():
            why = _mismatch(v[name], k, f"{path}.{name}")
            if why is not None:
                return why
        return None
    if isinstance(kind, ListOf):
        if not isinstance(v, list):
            return f"{path}={v!r:.60}: the protocol wants a list"
        if kind.max_len is not None and len(v) > kind.max_len:
            return f"{path} has {len(v)} items, the protocol allows {kind.max_len}"
        for i, item in enumerate(v):
            why = _mismatch(item, kind.item, f"{path}[{i}]")
            if why is not None:
                return why
        return None
    if isinstance(kind, Row):
        if not isinstance(v, list) or len(v) != len(kind.items):
            return f"{path}={v!r:.60}: the protocol wants a list of {len(kind.items)} items"
        for i, (item, k) in enumerate(zip(v, kind.items, strict=True)):
            why = _mismatch(item, k, f"{path}[{i}]")
            if why is not None:
                return why
        return None
    if isinstance(kind, DictOf):
        if not isinstance(v, dict):
            return f"{path}={v!r:.60}: the protocol wants a dict"
        if kind.max_len is not None and len(v) > kind.max_len:
            return f"{path} has {len(v)} entries, the protocol allows {kind.max_len}"
        for key, item in v.items():
            why = _mismatch(key, kind.key, f"{path} key") or _mismatch(
                item, kind.value, f"{path}[{key!r:.30}]"
            )
            if why is not None:
                return why
        return None
    raise TypeError(f"not a schema kind: {kind!r}")


def check_message(value: Any, schema: Schema, who: str, topic: str) -> dict:
    """``value`` if it is a dict with exactly ``schema``'s fields, of their kinds (nested
    messages and lists included), else raise :class:`ProtocolError` naming the participant,
    the topic and what is wrong. Messages come from other processes: nothing is used before
    it passes. ``bool`` is not taken for ``int``, and integers must fit in 64 bits."""
    if not isinstance(value, dict):
        raise ProtocolError(
            f"{who} posted {topic!r} as {type(value).__name__}, not a message with fields "
            f"{sorted(schema)}: is it running the same weightbus version?"
        )
    if set(value) != set(schema):
        raise ProtocolError(
            f"{who} posted {topic!r} with fields {sorted(map(str, value))}, the protocol has "
            f"{sorted(schema)}: is it running the same weightbus version?"
        )
    for name, kind in schema.items():
        why = _mismatch(value[name], kind, name)
        if why is not None:
            raise ProtocolError(f"{who} posted {topic!r} with {why}")
    return value


def _decode(data: bytes, limit: int | None = None) -> bytes | dict:
    """A store value as posted (raw bytes, or msgpack); :class:`ProtocolError` when it is
    longer than ``limit`` bytes or not what :func:`_encode` writes."""
    if limit is not None and len(data) > limit:
        raise ProtocolError(
            f"a control message of {len(data)} bytes is over the limit of {limit} bytes "
            "(ControlConfig.max_message_bytes): refused before decoding"
        )
    kind, body = data[:1], data[1:]
    if kind == b"b":
        return body
    if kind == b"m":
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
            raise ProtocolError(f"a control message is not valid msgpack: {e}") from None
    raise ProtocolError(
        f"a control message of unknown kind {kind!r}: is another program using the key?"
    )


def _record(data: bytes, schema: Schema, what: str) -> dict:
    """A msgpack record the store holds (not a posted topic), checked against ``schema``."""
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
        raise ProtocolError(f"{what} is not valid msgpack: {e}") from None
    return check_message(value, schema, "the store", what)


def _participant(record: dict, what: str) -> Participant:
    """A :class:`Participant` from a checked :data:`PARTICIPANT` record."""
    try:
        return Participant.from_dict(record)
    except (ValueError, TypeError, KeyError) as e:
        raise ProtocolError(f"{what} holds an invalid participant: {e}") from None


class _Backoff:
    """Sleeps for polling that grow with the time waited so far (0.1 ms to 50 ms), in
    proportion to the job's size: with every participant polling, the store sees about
    ``_POLLS_PER_S_X_S / waited`` requests per second whatever the size, and in a small job an
    answer is seen ~1% of the wait late. (A blocking ``store.wait`` with a timeout would leave
    the client's connection out of step.)"""

    def __init__(self, participants: int) -> None:
        self.start = time.monotonic()
        self.share = max(participants, 8) / _POLLS_PER_S_X_S

    def sleep(self, until: float) -> None:
        now = time.monotonic()
        delay = min(max((now - self.start) * self.share, _POLL_FIRST_S), _POLL_LAST_S)
        time.sleep(max(0.0, min(delay, until - now)))


def check_agreement(
    topic: str, key: str, got: Mapping[str, object], who: Callable[[str], str]
) -> None:
    """The digests everyone posted under ``key`` (``got``: name -> value) for an agreement on
    ``topic``: :class:`ProtocolError` for a value that is not a digest (naming ``who(name)``),
    :class:`PlanMismatch` naming who holds which when they differ."""
    groups: dict[str, list[str]] = {}
    for name, value in got.items():
        if not isinstance(value, bytes) or not 0 < len(value) <= _MAX_DIGEST_BYTES:
            raise ProtocolError(
                f"{who(name)} posted {key!r} as {value!r:.60}, not a digest "
                f"(1 to {_MAX_DIGEST_BYTES} bytes): is it running the same weightbus version?"
            )
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError(
                f"{who(name)} posted {key!r} as {value!r:.60}, not an ASCII "
                "digest: is it running the same weightbus version?"
            ) from None
        groups.setdefault(text, []).append(name)
    if len(groups) > 1:
        ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
        parts = [f"{d[:16]} held by {', '.join(names)}" for d, names in ranked]
        raise PlanMismatch(
            f"participants disagree on {topic!r}: " + "; ".join(parts) + ". Every "
            "participant must derive it from the same layouts with the same weightbus "
            "version and configuration",
            groups,
        )


class ControlPlane:
    """One participant's handle on the job's control store.

    >>> control = ControlPlane(Participant(role="writer", rank=0), ControlConfig(num_writers=1, num_readers=1))
    >>> control.connect()                       # register, start heartbeats
    >>> writers, readers = control.participants()
    >>> control.post(f"ack/{v}", {"ok": True}); control.gather(f"ack/{v}", role="reader")
    >>> control.close()

    Thread safety: calls may come from several threads (torch serialises the calls on the one
    store connection, which the heartbeat thread shares); none of them blocks on the store.
    """

    def __init__(self, participant: Participant, config: ControlConfig) -> None:
        if not isinstance(participant, Participant):
            raise TypeError(f"participant must be a Participant, got {type(participant).__name__}")
        if not isinstance(config, ControlConfig):
            raise TypeError(f"config must be a ControlConfig, got {type(config).__name__}")
        self.participant = participant
        """This participant."""
        self.config = config
        """Its control configuration."""
        self.hosting = (
            config.host_store
            if config.host_store is not None
            else (participant.role == "writer" and participant.rank == 0)
        )
        """Whether this process hosts the store (``host_store``, else writer rank 0)."""
        self._ns = f"weightbus/{config.job}/"
        self._store: dist.TCPStore | None = None
        self._address = config.address
        self._host_name = "the store host"
        self._roster: Roster | None = None
        self._lock = threading.RLock()
        self._connected = False
        self._closed = False
        self._failed: str | None = None
        self._posted: deque[str] = deque()
        self._posted_set: set[str] = set()
        self._layout_calls = 0
        self._substores: dict[str, int] = {}
        # heartbeat observation: name -> (last counter value, monotonic time it last moved)
        self._beats: dict[str, tuple[int, float]] = {}
        self._peers_closed: set[str] = set()
        self._next_peer_check = 0.0
        self._next_report_check = 0.0
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        # elastic membership: the epoch this participant's roster and topics belong to
        self._epoch = 0
        self._joined: tuple[str, ...] = ()
        self._nonce = ""
        self._joining = False
        self._changes_seen = -1
        self._consumed = 0  # writer rank 0: lines of the requests log an epoch has answered
        self.left: dict[str, str] = {}
        """Writer rank 0: the participants its last :meth:`form_epoch` left out, and why."""

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self._connected else "new"
        return f"ControlPlane({self.participant.name!r}, job={self.config.job!r}, {self.address}, {state})"

    # -- connection ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` of the store (with the real port when this process hosts on port 0)."""
        return self._address

    @property
    def store(self) -> dist.Store:
        """The raw store client (keys outside ``weightbus/<job>/`` are yours).

        The heartbeat thread shares it: never block on it (``wait``, ``get`` of a missing key),
        or this participant's heartbeats stop; use :meth:`substore` for blocking work.
        """
        if self._store is None:
            raise WeightbusError(f"{self!r} is not connected: call connect() first")
        return self._store

    def connect(self) -> ControlPlane:
        """Open (or host) the store, check the token, register, start heartbeats."""
        with self._lock:
            if self._connected:
                return self
            if self._closed:
                raise WeightbusError(f"{self!r} was closed; build a new ControlPlane")
            p, cfg = self.participant, self.config
            if "/" in p.name or not p.name.strip() or p.name != p.name.strip():
                raise MembershipError(
                    f"participant name {p.name!r} must be non-empty, without '/' or surrounding "
                    "spaces (it is part of store keys)"
                )
            limit = cfg.num_writers if p.role == "writer" else cfg.reader_slots
            if p.rank >= limit:
                field = (
                    "num_writers"
                    if p.role == "writer"
                    else "max_readers"
                    if cfg.max_readers is not None
                    else "num_readers"
                )
                raise MembershipError(
                    f"{_who(p)} has rank {p.rank} but the job has {field}={limit}: "
                    f"ranks run 0..{limit - 1}; fix the rank or the count"
                    + (" (max_readers lets more readers join later)" if p.role == "reader" else "")
                )
            self._store = self._open_store()
            try:
                self._register()
            except BaseException:
                self._store = None
                raise
            self._connected = True
            self._start_heartbeat()
        logger.info(
            "weightbus control: %s joined job %r at %s%s",
            _who(self.participant),
            cfg.job,
            self.address,
            " (hosting the store)" if self.hosting else "",
        )
        return self

    def _open_store(self) -> dist.TCPStore:
        host, port = _split_addr(self.config.address)
        timeout = self.config.timeout
        if self.hosting:
            try:
                store = dist.TCPStore(
                    host, port, is_master=True, wait_for_workers=False, timeout=timeout
                )
            except dist.DistError as e:
                raise WeightbusError(
                    f"{_who(self.participant)} could not host the control store on port {port}: "
                    f"{_first_line(e)}; pick a free port in the address (or ${STORE_ADDR_ENV}) or "
                    "let another process host it (host_store=False here)"
                ) from None
            self._address = f"{self.config.address.rpartition(':')[0]}:{store.port}"
            return store
        if port == 0:
            raise ValueError(
                f"address {self.config.address!r} has port 0, which only the hosting process can "
                "use (it picks a free port); pass the host's real port (ControlPlane.address there)"
            )
        try:
            return dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=timeout
            )
        except dist.DistError as e:
            raise SyncTimeout(
                f"{_who(self.participant)} could not reach the control store at "
                f"{self.config.address} within {timeout.total_seconds():.1f} s: {_first_line(e)}; "
                "start the hosting process (writer 0 by default) or fix the address"
            ) from None

    def _new_client(self) -> dist.Store:
        """A second connection to the store, for threads that must not queue behind others."""
        store = self.store
        if hasattr(store, "clone"):
            return self._call(store.clone)
        host, port = _split_addr(self._address)
        return dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=self.config.timeout
        )

    def _key(self, *parts: object) -> str:
        return self._ns + "/".join(str(p) for p in parts)

    def _tkey(self, name: str, topic: str) -> str:
        """Key of participant ``name``'s value of ``topic`` in the current epoch."""
        if self._epoch == 0:
            return self._key("t", name, topic)
        return self._key("t", name, f"@{self._epoch}", topic)

    def _ekey(self, *parts: object) -> str:
        """A key of the current epoch (failures); the first epoch's has no suffix."""
        key = self._key(*parts)
        return key if self._epoch == 0 else f"{key}@{self._epoch}"

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one store operation; a broken store becomes a PeerFailure naming its host."""
        try:
            return fn(*args)
        except dist.DistError as e:
            if self.hosting:
                raise
            text = (
                f"lost the control store at {self._address} (hosted by {self._host_name}): "
                f"{_first_line(e)}; the hosting process exited or crashed. It must be the last "
                "to leave (see ControlPlane.close)"
            )
            raise PeerFailure(text, [(self._host_name, text)]) from None

    def _register(self) -> None:
        p, cfg, store = self.participant, self.config, self._store
        assert store is not None
        salt = f"weightbus-token/{cfg.job}/".encode()
        mine = hashlib.sha256(salt + (cfg.token or "").encode()).hexdigest()
        theirs = self._call(store.compare_set, self._key("auth"), "", mine).decode()
        if not hmac.compare_digest(theirs, mine):
            raise AccessDenied(
                f"{_who(p)} was refused by the control store at {self._address} (job "
                f"{cfg.job!r}): its token does not match the job's; pass the same token "
                f"(ControlConfig.token or ${TOKEN_ENV}) to every participant"
            )
        counts = f"{cfg.num_writers},{cfg.num_readers}"
        seen = self._call(store.compare_set, self._key("counts"), "", counts).decode()
        if seen != counts:
            w, _, r = seen.partition(",")
            raise MembershipError(
                f"{_who(p)} was configured with num_writers={cfg.num_writers}, "
                f"num_readers={cfg.num_readers}, but job {cfg.job!r} at {self._address} has "
                f"num_writers={w}, num_readers={r} (from the first participant to connect); "
                "pass the same counts to every participant"
            )
        mode = "elastic" if cfg.elastic else "fixed"
        seen = self._call(store.compare_set, self._key("membership"), "", mode).decode()
        if seen != mode:
            raise MembershipError(
                f"{_who(p)} was configured with elastic={cfg.elastic}, but job {cfg.job!r} at "
                f"{self._address} has {seen} membership (from the first participant to "
                "connect); pass the same ControlConfig.elastic to every participant"
            )
        if self.hosting:
            self._call(store.set, self._key("host"), _who(p))
        elif self._call(store.check, [self._key("host")]):
            self._host_name = self._call(store.get, self._key("host")).decode(errors="replace")

        # Read before claiming the rank: the first epoch forms only once every starting rank
        # is claimed, so a rank claimed while no epoch exists yet belongs to the first one.
        running = bool(self._call(store.check, [self._key("epoch")]))
        nonce = f"{p.host}/{os.getpid()}/{uuid.uuid4().hex}"
        claim = msgpack.packb({"participant": p.to_dict(), "nonce": nonce}, use_bin_type=True)
        held = self._call(store.compare_set, self._key("member", p.role, p.rank), b"", claim)
        if held != claim:
            other = _participant(
                _record(held, MEMBER, f"member/{p.role}/{p.rank}")["participant"],
                f"member/{p.role}/{p.rank}",
            )
            raise MembershipError(
                f"{p.role} rank {p.rank} is already taken in job {cfg.job!r} by {other.name!r} "
                f"(host {other.host}, device {other.device}); this process ({p.name!r}, host "
                f"{p.host}) must use a free rank, or the job name must differ"
            )
        slot = f"{p.role}/{p.rank}"
        owner = self._call(store.compare_set, self._key("name", p.name), "", slot).decode(
            errors="replace"
        )
        if owner != slot:
            self._call(store.delete_key, self._key("member", p.role, p.rank))
            raise MembershipError(
                f"name {p.name!r} is already taken in job {cfg.job!r} by {owner.replace('/', ' rank ')}; "
                f"give {p.role} rank {p.rank} a unique name"
            )
        self._nonce = nonce
        starting = p.rank < (cfg.num_writers if p.role == "writer" else cfg.num_readers)
        self._joining = running or not starting
        if self._joining and (p.role == "writer" or not cfg.elastic):
            self._call(store.delete_key, self._key("name", p.name))
            self._call(store.delete_key, self._key("member", p.role, p.rank))
            raise MembershipError(
                f"{_who(p)} cannot join job {cfg.job!r}: it is already running, and "
                + (
                    "writers cannot join a running job (restart the job with every writer)"
                    if p.role == "writer"
                    else "its membership is fixed (ControlConfig.elastic=False)"
                )
            )
        self._call(store.add, self._key("hb", p.name), 1)

    def _start_heartbeat(self) -> None:
        # The heartbeat shares this participant's one connection (torch serialises calls on it)
        # rather than opening another: every new connection costs the store host a reverse DNS
        # lookup of the peer, which stalls 5 s where DNS is flaky. Nothing here blocks on it.
        client = self._store
        assert client is not None
        key = self._key("hb", self.participant.name)
        interval = self.config.heartbeat_interval.total_seconds()
        stop = self._hb_stop

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    client.add(key, 1)
                except Exception as e:  # the store is gone; the main thread will say so
                    logger.warning(
                        "weightbus control: heartbeat of %r stopped: %s",
                        self.participant.name,
                        _first_line(e),
                    )
                    return

        self._hb_thread = threading.Thread(
            target=beat, name=f"weightbus-heartbeat-{self.participant.name}", daemon=True
        )
        self._hb_thread.start()

    def _require(self) -> dist.TCPStore:
        if not self._connected or self._store is None:
            state = "closed" if self._closed else "not connected (call connect() first)"
            raise WeightbusError(f"control plane of {self.participant.name!r} is {state}")
        return self._store

    def _deadline(self, timeout: timedelta | None) -> tuple[float, float]:
        seconds = (
            _positive("timeout", timeout)
            if timeout is not None
            else self.config.timeout.total_seconds()
        )
        return time.monotonic() + seconds, seconds

    # -- membership ----------------------------------------------------------------------------

    def participants(self, timeout: timedelta | None = None) -> Roster:
        """Every participant, once all have registered; waits naming who is missing."""
        if self._roster is not None:
            return self._roster
        store = self._require()
        cfg = self.config
        if self._joining:
            raise WeightbusError(
                f"{_who(self.participant)} joined job {cfg.job!r} while it runs: it gets its "
                "roster from request_entry() and await_roster(), not participants()"
            )
        slots = [("writer", r) for r in range(cfg.num_writers)]
        slots += [("reader", r) for r in range(cfg.num_readers)]
        keys = [self._key("member", role, rank) for role, rank in slots]
        deadline, seconds = self._deadline(timeout)
        backoff = _Backoff(self.config.num_writers + self.config.num_readers)
        while not self._call(store.check, keys):
            self._raise_if_reported()
            if time.monotonic() >= deadline:
                missing = [
                    f"{role} rank {rank}"
                    for (role, rank), key in zip(slots, keys, strict=True)
                    if not self._call(store.check, [key])
                ]
                raise SyncTimeout(
                    f"{_who(self.participant)} waited {seconds:.1f} s for job {cfg.job!r} at "
                    f"{self._address}: {len(slots) - len(missing)} of {len(slots)} participants "
                    f"registered, missing {', '.join(missing)}; start them, or check they use the "
                    "same address, job name and counts",
                    missing,
                )
            backoff.sleep(deadline)
        members = [
            _participant(
                _record(v, MEMBER, f"member/{role}/{rank}")["participant"], f"member/{role}/{rank}"
            )
            for (role, rank), v in zip(slots, self._call(store.multi_get, keys), strict=True)
        ]
        roster = Roster(
            writers=tuple(members[: cfg.num_writers]), readers=tuple(members[cfg.num_writers :])
        )
        with self._lock:
            self._roster = roster
        # the job runs from now on: a reader registering later joins it (elastic membership)
        self._call(store.compare_set, self._key("epoch"), "", "0")
        logger.info(
            "weightbus control: job %r complete: writers %s, readers %s",
            cfg.job,
            roster.names("writer"),
            roster.names("reader"),
        )
        return roster

    @property
    def roster(self) -> Roster | None:
        """The roster once :meth:`participants` has returned, else None."""
        return self._roster

    # -- elastic membership ----------------------------------------------------------------------
    #
    # The job's members change in epochs. The first epoch holds every writer and the first
    # num_readers readers. Writer rank 0 coordinates: at the start of each sync it checks the
    # ``changes`` counter (bumped by every join request, close and failure) and, when the
    # members changed, tells the others (``members/<seq>``) and forms the next epoch: every
    # participant that wants to be in it files a request (``requests`` log); writer rank 0
    # waits for the requests of the current members (bounded), drops those that closed, died
    # or did not come back in time, admits the readers that asked to join, and publishes
    # ``roster/<epoch>`` and then ``epoch``. Everyone in it enters it: topics, failures and
    # transport rendezvous live under the new epoch, so nothing of an aborted sync leaks in.

    @property
    def epoch(self) -> int:
        """The membership epoch this participant's roster and topics belong to (0: the first)."""
        return self._epoch

    @property
    def joining(self) -> bool:
        """Whether this participant registered while the job ran (or with a rank beyond
        num_readers) and has not entered an epoch yet: it enters through
        :meth:`request_entry` and :meth:`await_roster`."""
        return self._joining and self._roster is None

    @property
    def joined(self) -> tuple[str, ...]:
        """Readers that joined in the current epoch (none in the first)."""
        return self._joined

    @property
    def coordinator(self) -> str:
        """Name of writer rank 0, which decides membership."""
        roster = self.participants()
        return roster.writers[0].name

    def request_entry(self, after: int) -> None:
        """Ask writer rank 0 to put this participant in the next epoch after ``after`` (the
        last epoch it was in; -1 for none). It is admitted at the start of the next sync."""
        store = self._require()
        line = f"{self.participant.name} {int(after)} {self._nonce}\n"
        self._call(store.append, self._key("requests"), line)
        self._call(store.add, self._key("changes"), 1)

    def await_roster(self, after: int, timeout: timedelta | None = None) -> Roster:
        """Wait until writer rank 0 publishes an epoch after ``after`` that holds this
        participant, and enter it. Epochs without it are passed over (its request stays)."""
        store = self._require()
        deadline, seconds = self._deadline(timeout)
        backoff = _Backoff(self.config.num_writers + self.config.reader_slots)
        seen = after
        next_slot_check = time.monotonic()
        me = self.participant.name
        while True:
            self._raise_if_ended()
            now = time.monotonic()
            if self._call(store.check, [self._key("epoch")]):
                epoch = _int(self._call(store.get, self._key("epoch")), "epoch")
                if epoch > seen and epoch > 0:
                    roster, joined = self._read_roster(epoch)
                    if me in roster:
                        self._enter(epoch, roster, joined)
                        return roster
                    # passed over (it asked too late, or came back too late): ask again
                    self.request_entry(after)
                    seen = epoch
            if now >= next_slot_check:
                next_slot_check = now + _CLOSED_CHECK_S
                self._raise_if_coordinator_gone(now)
                if not self._holds_slot():
                    raise MembershipError(
                        f"{_who(self.participant)} was dropped from job {self.config.job!r} as "
                        "dead (its heartbeat stopped for heartbeat_timeout) and its rank given "
                        f"up; connect a new {self.participant.role} (a new process)"
                    )
            if now >= deadline:
                raise SyncTimeout(
                    f"{_who(self.participant)} waited {seconds:.1f} s for writer rank 0 to "
                    f"admit it to job {self.config.job!r} (epoch after {max(seen, after)}); it "
                    "does so at the start of its next sync: is the trainer syncing?",
                    [self._coordinator_name()],
                )
            backoff.sleep(deadline)

    def membership_changed(self) -> bool:
        """Writer rank 0, at the start of a sync: whether the next sync needs a new epoch (a
        reader asked to join or come back, one closed or died, or the epoch failed). One store
        call when nothing happened."""
        store = self._require()
        n = _int(self._call(store.add, self._key("changes"), 0), "changes")
        if n == self._changes_seen:
            return False
        self._changes_seen = n
        if self.epoch_aborted():
            return True
        roster = self.participants()
        requests, _ = self._read_requests()
        if requests:
            return True
        now = time.monotonic()
        for p in roster.all:
            if p.name == self.participant.name:
                continue
            if self._call(store.check, [self._key("closed", p.name)]) or self._silent(p.name, now):
                return True
        return False

    def form_epoch(self, writers_timeout: timedelta, readers_timeout: timedelta) -> Roster:
        """Writer rank 0: form the next epoch and enter it.

        Waits for a request from every current member: writers up to ``writers_timeout``
        (a writer that does not come back ends the job: :class:`MembershipError`), readers up
        to ``readers_timeout`` (then they are left out and may join again later). Members that
        closed or whose heartbeat stopped are dropped at once, and their ranks freed. Readers
        that asked to join are admitted.
        """
        store = self._require()
        if self._call(store.check, [self._key("ended")]):
            text = self._call(store.get, self._key("ended")).decode(errors="replace")
            raise MembershipError(f"job {self.config.job!r} ended earlier: {text}")
        current = self.participants()
        nxt = self._epoch + 1
        me = self.participant.name
        start = time.monotonic()
        w_end = start + _positive("writers_timeout", writers_timeout)
        r_end = start + _positive("readers_timeout", readers_timeout)
        candidates: dict[str, tuple[Participant, str]] = {}
        for p in current.all:
            slot = self._slot(p.role, p.rank)
            if slot is not None and slot[0].name == p.name:
                candidates[p.name] = slot
            else:
                candidates[p.name] = (p, "")  # its rank was freed: it can only be gone
        ready: dict[str, Participant] = {me: self.participant}
        gone: dict[str, str] = {}
        backoff = _Backoff(self.config.num_writers + self.config.reader_slots)
        while True:
            now = time.monotonic()
            requests, read = self._read_requests()
            for name, (_, nonce) in requests.items():
                if name in candidates or name in gone:
                    continue
                slot = self._slot_of(name)
                if slot is not None and slot[1] == nonce:
                    candidates[name] = slot  # a reader asking to join
            pending: list[Participant] = []
            for name, (p, nonce) in candidates.items():
                if name in ready or name in gone:
                    continue
                if not nonce or self._call(store.check, [self._key("closed", name)]):
                    gone[name] = "closed"
                    continue
                req = requests.get(name)
                if req is not None and req[1] == nonce:
                    ready[name] = p
                elif self._silent(name, now):
                    gone[name] = "died (heartbeat stopped)"
                else:
                    pending.append(p)
            lost = [n for n, why in gone.items() if candidates[n][0].role == "writer"]
            late = [p.name for p in pending if p.role == "writer"]
            if lost or (late and now >= w_end):
                text = (
                    f"writer rank 0 {me!r} cannot form epoch {nxt} of job {self.config.job!r}: "
                    + "; ".join(
                        [f"writer {n!r} {gone[n]}" for n in lost]
                        + [
                            f"writer {n!r} did not come back within "
                            f"{writers_timeout.total_seconds():.1f} s"
                            for n in late
                        ]
                    )
                    + ". Writers cannot leave or be replaced: restart the training job"
                )
                self._end_job(text)
                raise MembershipError(text)
            if not pending:
                break
            if not late and now >= r_end:
                for p in pending:
                    gone[p.name] = (
                        f"did not come back within {readers_timeout.total_seconds():.1f} s "
                        "(left out; it may join again)"
                    )
                break
            backoff.sleep(w_end if late else r_end)
        writers = tuple(sorted((p for p in ready.values() if p.role == "writer"), key=_rank))
        readers = tuple(sorted((p for p in ready.values() if p.role == "reader"), key=_rank))
        joined = [p.name for p in readers if p.name not in current]
        for name, why in gone.items():
            p, nonce = candidates[name]
            if nonce and not why.startswith("did not"):
                self._release(p, nonce)  # its rank may be taken again
        record = {
            "epoch": nxt,
            "members": [p.to_dict() for p in writers + readers],
            "joined": joined,
        }
        self._call(store.set, self._key("roster", nxt), msgpack.packb(record, use_bin_type=True))
        self._call(store.set, self._key("epoch"), str(nxt))
        self._consumed = read  # a request answered by this epoch does not count again
        roster = Roster(writers=writers, readers=readers)
        self._enter(nxt, roster, tuple(joined))
        logger.info(
            "weightbus control: job %r epoch %d: readers %s%s%s",
            self.config.job,
            nxt,
            roster.names("reader"),
            f", joined {joined}" if joined else "",
            "".join(f", {n} {why}" for n, why in gone.items()),
        )
        self.left = dict(gone)
        return roster

    def exclude(self, names: Iterable[str]) -> Roster:
        """Leave ``names`` (readers refused while joining) out of this epoch's roster."""
        drop = set(names)
        roster = self.participants()
        if any(roster[n].role == "writer" for n in drop if n in roster):
            raise ValueError(f"writers cannot be left out of an epoch: {sorted(drop)}")
        kept = Roster(
            writers=roster.writers, readers=tuple(p for p in roster.readers if p.name not in drop)
        )
        with self._lock:
            self._roster = kept
            self._joined = tuple(n for n in self._joined if n not in drop)
        return kept

    def epoch_aborted(self) -> bool:
        """Whether a participant's sync or connect failed in the current epoch."""
        store = self._require()
        return bool(self._call(store.check, [self._ekey("aborted")]))

    def abort_epoch(self) -> None:
        """Mark the current epoch failed, so the next sync forms a new one. Never raises."""
        store = self._store
        if store is None or not self._connected:
            return
        try:
            store.set(self._ekey("aborted"), b"1")
            store.add(self._key("changes"), 1)
        except Exception as e:
            logger.debug("weightbus control: could not mark epoch %d failed: %s", self._epoch, e)

    def _enter(self, epoch: int, roster: Roster, joined: tuple[str, ...]) -> None:
        with self._lock:
            self._epoch = epoch
            self._roster = roster
            self._joined = tuple(joined)
            self._substores = {}
            self._layout_calls = 0
            self._failed = None
            self._peers_closed = set()
            self._next_report_check = 0.0

    def _read_roster(self, epoch: int) -> tuple[Roster, tuple[str, ...]]:
        store = self._require()
        what = f"roster/{epoch}"
        rec = _record(self._call(store.get, self._key("roster", epoch)), ROSTER, what)
        people = [_participant(d, what) for d in rec["members"]]
        roster = Roster.of(people)
        if not roster.writers or len(set(roster.names())) != roster.size:
            raise ProtocolError(f"{what} is malformed: {roster.names()}")
        return roster, tuple(rec["joined"])

    def _read_requests(self) -> tuple[dict[str, tuple[int, str]], int]:
        """The requests no epoch answered yet: name -> (last epoch it was in, nonce), the
        latest of each; and how many lines of the log were read."""
        store = self._require()
        key = self._key("requests")
        if not self._call(store.check, [key]):
            return {}, 0
        lines = self._call(store.get, key).decode(errors="replace").splitlines()
        out: dict[str, tuple[int, str]] = {}
        for line in lines[self._consumed :]:
            parts = line.split()
            if len(parts) != 3 or not parts[1].lstrip("-").isdigit():
                logger.warning("weightbus control: malformed join request %r ignored", line[:80])
                continue
            out[parts[0]] = (int(parts[1]), parts[2])
        return out, len(lines)

    def _slot(self, role: str, rank: int) -> tuple[Participant, str] | None:
        """Who holds rank ``rank`` of ``role`` and its nonce, or None when it is free."""
        store = self._require()
        key = self._key("member", role, rank)
        if not self._call(store.check, [key]):
            return None
        rec = _record(self._call(store.get, key), MEMBER, f"member/{role}/{rank}")
        return _participant(rec["participant"], f"member/{role}/{rank}"), rec["nonce"]

    def _slot_of(self, name: str) -> tuple[Participant, str] | None:
        store = self._require()
        key = self._key("name", name)
        if not self._call(store.check, [key]):
            return None
        role, _, rank = self._call(store.get, key).decode(errors="replace").partition("/")
        if role not in ("writer", "reader") or not rank.isdigit():
            return None
        slot = self._slot(role, int(rank))
        return slot if slot is not None and slot[0].name == name else None

    def _holds_slot(self) -> bool:
        slot = self._slot(self.participant.role, self.participant.rank)
        return slot is not None and slot[1] == self._nonce

    def _release(self, p: Participant, nonce: str) -> None:
        """Free the rank and name of a participant that left (only if still its own)."""
        store = self._require()
        slot = self._slot(p.role, p.rank)
        if slot is None or slot[1] != nonce:
            return
        for key in (
            self._key("member", p.role, p.rank),
            self._key("name", p.name),
            self._key("closed", p.name),
        ):
            self._call(store.delete_key, key)

    def _silent(self, name: str, now: float) -> bool:
        """Whether ``name``'s heartbeat has not moved for heartbeat_timeout, as seen here."""
        store = self._require()
        key = self._key("hb", name)
        if not self._call(store.check, [key]):
            return False
        count = _int(self._call(store.get, key), f"hb/{name}")
        with self._lock:
            seen = self._beats.get(name)
            if seen is None or seen[0] != count:
                self._beats[name] = (count, now)
                return False
            return now - seen[1] > self.config.heartbeat_timeout.total_seconds()

    def _end_job(self, text: str) -> None:
        store = self._store
        if store is None:
            return
        try:
            store.set(self._key("ended"), text[:_MAX_ERROR_CHARS].encode())
            store.add(self._key("changes"), 1)
        except Exception as e:
            logger.debug("weightbus control: could not record the end of the job: %s", e)

    def _raise_if_ended(self) -> None:
        store = self._require()
        if self._call(store.check, [self._key("ended")]):
            text = self._call(store.get, self._key("ended")).decode(errors="replace")
            name = self._coordinator_name()
            raise PeerFailure(f"writer {name!r} ended the job: {text}", [(name, text)])

    def _raise_if_coordinator_gone(self, now: float) -> None:
        """While waiting for writer rank 0 to form an epoch: :class:`PeerFailure` if it left
        or its heartbeat stopped (no one else can admit this participant)."""
        if self.participant.role == "writer" and self.participant.rank == 0:
            return
        name = self._coordinator_name()
        store = self._require()
        if self._call(store.check, [self._key("closed", name)]):
            text = f"writer {name!r} (writer rank 0) closed: the job ended"
            raise PeerFailure(text, [(name, text)])
        if self._silent(name, now):
            text = (
                f"writer {name!r} (writer rank 0, which admits participants) stopped sending "
                f"heartbeats for heartbeat_timeout {self.config.heartbeat_timeout}: its process "
                "died, hung or lost the network"
            )
            raise PeerFailure(text, [(name, text)])

    def _coordinator_name(self) -> str:
        slot = self._slot("writer", 0)
        return slot[0].name if slot is not None else "writer-0"

    # -- topics ----------------------------------------------------------------------------------

    def post(self, topic: str, value: bytes | dict) -> None:
        """Publish ``value`` (raw bytes, or a dict sent as msgpack) under ``topic`` for this participant.

        Topics are write-once per participant: put the version in the name (``f"ack/{v}"``).
        A topic stays in the store until this participant has posted ``topic_window`` newer
        ones (or calls :meth:`drop`), so every gatherer must have read it by then.
        """
        store = self._require()
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"topic must be a non-empty str, got {topic!r}")
        data = _encode(value)
        if len(data) > self.config.max_message_bytes:
            raise ValueError(
                f"{_who(self.participant)}: topic {topic!r} is {len(data)} bytes, over "
                f"ControlConfig.max_message_bytes={self.config.max_message_bytes}; the others "
                "would refuse it: raise max_message_bytes on every participant"
            )
        key = self._tkey(self.participant.name, topic)
        with self._lock:
            if key in self._posted_set:
                raise ValueError(
                    f"{_who(self.participant)} already posted topic {topic!r}; topics are "
                    "write-once: put the version in the name (e.g. f'ack/{version}')"
                )
            self._posted.append(key)
            self._posted_set.add(key)
            old = []
            while len(self._posted) > self.config.topic_window:
                old.append(self._posted.popleft())
                self._posted_set.discard(old[-1])
        self._call(store.set, key, data)
        for stale in old:
            self._call(store.delete_key, stale)

    def drop(self, topic: str) -> None:
        """Delete this participant's value of ``topic`` now (once everyone has gathered it)."""
        store = self._require()
        key = self._tkey(self.participant.name, topic)
        with self._lock:
            if key in self._posted_set:
                self._posted_set.discard(key)
                self._posted.remove(key)
        self._call(store.delete_key, key)

    def _targets(self, role: str | None, names: Sequence[str] | None) -> list[str]:
        roster = self.participants()
        if names is not None:
            if isinstance(names, str):
                raise TypeError(f"names must be a list of names, got the str {names!r}")
            unknown = [n for n in names if n not in roster]
            if unknown:
                raise KeyError(
                    f"gather over unknown participants {unknown}; the job has {roster.names()}"
                )
            wanted = set(names)
            return [
                n
                for n in roster.names()
                if n in wanted and (role is None or roster[n].role == role)
            ]
        if role is not None and role not in ("writer", "reader"):
            raise ValueError(f"role {role!r} is not 'writer' or 'reader'")
        return roster.names(role)

    def gather(
        self,
        topic: str,
        role: str | None = None,
        names: Sequence[str] | None = None,
        timeout: timedelta | None = None,
        schema: Schema | None = None,
    ) -> dict[str, bytes | dict]:
        """Wait until every participant (of ``role``, or in ``names``) has posted ``topic``.

        With ``schema``, every value must be a message with exactly those fields and types
        (:func:`check_message`), else :class:`ProtocolError` names who posted what.

        Returns ``{name: value}`` in global order. Raises :class:`PeerFailure` as soon as any
        participant reports a failure, stops sending heartbeats, or closes without posting,
        and :class:`SyncTimeout` naming who has not posted when ``timeout`` (default: the
        config's) passes.
        """
        store = self._require()
        targets = self._targets(role, names)
        keys = [self._tkey(n, topic) for n in targets]
        deadline, seconds = self._deadline(timeout)
        backoff = _Backoff(self.config.num_writers + self.config.num_readers)
        next_closed_check = time.monotonic() + _CLOSED_CHECK_S
        while not self._call(store.check, keys):
            try:
                self.raise_if_failed()
            except PeerFailure:
                # what was posted before the failure still counts (a participant that posted
                # its digest and then found a disagreement reports it at once: the others must
                # see the disagreement too, not only its report)
                if self._call(store.check, keys):
                    break
                raise
            now = time.monotonic()
            missing = None
            if now >= deadline or now >= next_closed_check:
                next_closed_check = now + _CLOSED_CHECK_S
                missing = [
                    n
                    for n, k in zip(targets, keys, strict=True)
                    if not self._call(store.check, [k])
                ]
                self._raise_if_closed(missing, topic)
            if now >= deadline:
                assert missing is not None
                raise SyncTimeout(
                    f"{_who(self.participant)} timed out after {seconds:.1f} s waiting for topic "
                    f"{topic!r} from {', '.join(_who(self._roster[n]) for n in missing)} "
                    f"({len(targets) - len(missing)} of {len(targets)} posted); their heartbeats "
                    "are fresh, so they are alive but slow or stuck: check their logs, or raise "
                    "the timeout",
                    missing,
                )
            backoff.sleep(deadline)
        values = self._call(store.multi_get, keys)
        out = {}
        for n, v in zip(targets, values, strict=True):
            try:
                out[n] = _decode(v, self.config.max_message_bytes)
            except ProtocolError as e:
                raise ProtocolError(f"{_who(self._roster[n])}, topic {topic!r}: {e}") from None
            if schema is not None:
                check_message(out[n], schema, _who(self._roster[n]), topic)
        return out

    def barrier(
        self, topic: str, role: str | None = None, timeout: timedelta | None = None
    ) -> None:
        """Post an empty value under ``topic`` and gather it from everyone (of ``role``)."""
        self.post(topic, b"")
        self.gather(topic, role=role, timeout=timeout)

    def exchange_layouts(
        self,
        my_layout: Layout,
        timeout: timedelta | None = None,
        *,
        refused: dict[str, Exception] | None = None,
    ) -> tuple[list[Layout], list[Layout]]:
        """Post this participant's layout, gather everyone's: (writers by rank, readers by rank).

        With ``refused`` (a dict to fill), the layout of a reader that joined in this epoch
        (:attr:`joined`) that cannot be read is left out and its error recorded there, rather
        than raised: one bad newcomer must not stop a running job.
        """
        if not isinstance(my_layout, Layout):
            raise TypeError(f"exchange_layouts takes a Layout, got {type(my_layout).__name__}")
        if my_layout.participant.to_dict() != self.participant.to_dict():
            raise ValueError(
                f"layout belongs to {my_layout.participant}, this control plane to "
                f"{self.participant}: build the layout with the same Participant"
            )
        with self._lock:
            topic = f"layout/{self._layout_calls}"
            self._layout_calls += 1
        self.post(topic, my_layout.to_msgpack())
        got = self.gather(topic, timeout=timeout)
        layouts = []
        roster = self.participants()
        for name, data in got.items():
            try:
                if not isinstance(data, bytes):
                    raise ProtocolError(
                        f"{_who(roster[name])} posted {topic!r} as {type(data).__name__}, not "
                        "a layout: is it running the same weightbus version?"
                    )
                layout = Layout.from_msgpack(data)
                if layout.participant.to_dict() != roster[name].to_dict():
                    raise WeightbusError(
                        f"participant {name!r} posted the layout of {layout.participant}: its "
                        "layout must be built with its own Participant"
                    )
            except (LayoutError, WeightbusError) as e:
                if refused is None or name not in self._joined:
                    raise
                refused[name] = e
                continue
            layouts.append(layout)
        writers = [lay for lay in layouts if lay.role == "writer"]
        readers = [lay for lay in layouts if lay.role == "reader"]
        return writers, readers

    def agree(self, topic: str, digest: str, timeout: timedelta | None = None) -> str:
        """Everyone posts ``digest`` under ``topic``; :class:`PlanMismatch` unless all are equal."""
        if not isinstance(digest, str) or not digest:
            raise ValueError(f"digest must be a non-empty str, got {digest!r}")
        key = f"agree/{topic}"
        self.post(key, digest.encode())
        got = self.gather(key, timeout=timeout)
        check_agreement(topic, key, got, lambda name: _who(self._roster[name]))
        return digest

    def substore(self, kind: str) -> dist.Store:
        """A store under a fresh prefix, on its own connection, for a transport's rendezvous.

        The n-th call with a given ``kind`` returns the same prefix on every participant, so
        participants must call it in the same order.
        """
        self._require()
        n = self.sequence(f"substore/{kind}")
        scope = kind if self._epoch == 0 else f"{kind}@{self._epoch}"
        return dist.PrefixStore(self._key("sub", scope, n), self._new_client())

    def sequence(self, kind: str) -> int:
        """0, 1, 2, ... on successive calls with the same ``kind``: a local counter that gives
        every participant the same number for its n-th collective of that kind."""
        with self._lock:
            n = self._substores.get(kind, 0)
            self._substores[kind] = n + 1
        return n

    # -- failures and heartbeats -----------------------------------------------------------------

    def fail(self, error_text: str) -> None:
        """Report this participant's failure; every other participant's waits raise it.

        Only the first report counts; later calls are ignored. Never raises.
        """
        with self._lock:
            if self._failed is not None:
                return
            self._failed = str(error_text)
        logger.error("weightbus control: %s failed: %s", _who(self.participant), error_text)
        self._record_failure(self.participant, self._failed)

    def _record_failure(
        self, who: Participant, text: str, *, unless_recorded: bool = False
    ) -> None:
        """Put ``who``'s failure in this epoch's log, after those reported before it, and mark
        the epoch aborted; with ``unless_recorded``, only if ``who`` has none there yet. Never
        raises."""
        store = self._store
        if store is None:
            return
        record = {"role": who.role, "rank": who.rank, "error": text[:_MAX_ERROR_CHARS]}
        key = self._ekey("fail", who.name)
        try:
            if unless_recorded and store.check([key]):
                return
            store.set(key, msgpack.packb(record))
            store.append(self._ekey("faillog"), who.name + "\n")
            store.set(self._ekey("aborted"), b"1")
            store.add(self._key("changes"), 1)
        except Exception as e:
            logger.warning("weightbus control: could not report the failure: %s", _first_line(e))

    def raise_if_failed(self, *, fresh: bool = False) -> None:
        """Raise :class:`PeerFailure` if any other participant reported a failure or went silent.

        Cheap enough for hot loops: it asks the store at most every 10 ms (``fresh=True``: now)
        and reads heartbeats at most every ``min(heartbeat_interval / 2, 0.25 s)``.
        """
        now = time.monotonic()
        if fresh or now >= self._next_report_check:
            self._next_report_check = now + _REPORT_CHECK_S
            self._raise_if_reported()
        if self._roster is not None and self._peer_check_due(now):
            self._check_heartbeats(now)

    def _peer_check_due(self, now: float) -> bool:
        with self._lock:
            if now < self._next_peer_check:
                return False
            step = min(self.config.heartbeat_interval.total_seconds() / 2, 0.25)
            self._next_peer_check = now + step
            return True

    def _raise_if_reported(self) -> None:
        store = self._require()
        log_key = self._ekey("faillog")
        if not self._call(store.check, [log_key]):
            return
        log = self._call(store.get, log_key).decode(errors="replace")
        names = list(dict.fromkeys(log.split()))
        names = [n for n in names if n != self.participant.name]
        if not names:
            return
        records = []
        for n, v in zip(
            names, self._call(store.multi_get, [self._ekey("fail", n) for n in names]), strict=True
        ):
            try:
                records.append(_record(v, FAILURE, f"the failure record of {n!r}"))
            except ProtocolError as e:
                records.append({"role": "participant", "rank": -1, "error": str(e)})
        failures = [(n, r["error"]) for n, r in zip(names, records, strict=True)]
        whos = [f"{r['role']} {n!r}" for n, r in zip(names, records, strict=True)]
        message = f"{whos[0]} failed: {failures[0][1]}"
        if len(failures) > 1:
            message += (
                " (then also "
                + "; ".join(f"{w}: {e}" for w, (_, e) in zip(whos[1:], failures[1:], strict=True))
                + ")"
            )
        raise PeerFailure(message, failures)

    def _check_heartbeats(self, now: float) -> None:
        roster = self._roster
        assert roster is not None
        store = self._require()
        names = [
            n for n in roster.names() if n != self.participant.name and n not in self._peers_closed
        ]
        if not names:
            return
        values = self._call(store.multi_get, [self._key("hb", n) for n in names])
        limit = self.config.heartbeat_timeout.total_seconds()
        stale: list[tuple[str, float]] = []
        with self._lock:
            for name, raw in zip(names, values, strict=True):
                count = int(raw)
                seen = self._beats.get(name)
                if seen is None or seen[0] != count:
                    self._beats[name] = (count, now)
                elif now - seen[1] > limit:
                    stale.append((name, now - seen[1]))
        if not stale:
            return
        dead = []
        for name, age in stale:
            if self._call(store.check, [self._key("closed", name)]):
                self._peers_closed.add(name)
            else:
                dead.append((name, age))
        if not dead:
            return
        failures = [
            (
                name,
                f"{_who(roster[name])} stopped sending heartbeats {age:.1f} s ago "
                f"(heartbeat_timeout {limit:.1f} s): its process died, hung or lost the network; "
                "check its log",
            )
            for name, age in dead
        ]
        # a dead process reports nothing itself: say it for it, before this participant's
        # caller aborts its transport. Otherwise the first failure the others hear of is what
        # that abort causes (a reader whose receive from this writer broke), not its cause
        for name, text in failures:
            said = f"{text} (seen by {_who(self.participant)})"
            self._record_failure(roster[name], said, unless_recorded=True)
        raise PeerFailure("; ".join(text for _, text in failures), failures)

    def publish_status(self, record: dict) -> None:
        """Replace this participant's ``status/<name>`` record (see
        :mod:`weightbus.control.status`). Status is advisory: this never raises."""
        store = self._store
        if store is None or not self._connected:
            return
        try:
            store.set(self._key("status", self.participant.name), msgpack.packb(record))
        except Exception as e:
            logger.debug(
                "weightbus control: status of %r not published: %s", self.participant.name, e
            )

    def has_closed(self, name: str) -> bool:
        """Whether participant ``name`` has left the job through :meth:`close`."""
        store = self._require()
        return bool(self._call(store.check, [self._key("closed", name)]))

    def _raise_if_closed(self, missing: list[str], topic: str) -> None:
        if not missing:
            return
        store = self._require()
        for name in missing:
            if self._call(store.check, [self._key("closed", name)]):
                text = (
                    f"{_who(self._roster[name])} closed its control plane without posting {topic!r}"
                )
                raise PeerFailure(text, [(name, text)])

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, timeout: timedelta | None = None) -> None:
        """Leave the job: stop heartbeats, mark this participant closed.

        On the hosting process, first wait (up to ``timeout``, default the config's) until every
        other participant has closed, reported a failure or stopped sending heartbeats, since
        the store dies with this process. Idempotent; never raises on a broken store.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        store = self._store
        if store is not None and self._connected:
            try:
                # a participant dropped as dead whose rank another process took since must
                # not mark that one closed
                if not self.config.elastic or self._holds_slot():
                    store.set(self._key("closed", self.participant.name), b"1")
                    store.add(self._key("changes"), 1)
                if self.hosting:
                    self._wait_for_others(store, timeout)
            except Exception as e:
                logger.warning(
                    "weightbus control: close of %r: %s", self.participant.name, _first_line(e)
                )
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=self.config.heartbeat_interval.total_seconds() + 5)
        self._connected = False
        self._store = None
        logger.info("weightbus control: %s left job %r", _who(self.participant), self.config.job)

    def _wait_for_others(self, store: dist.TCPStore, timeout: timedelta | None) -> None:
        cfg = self.config
        slots = [("writer", r) for r in range(cfg.num_writers)]
        slots += [("reader", r) for r in range(cfg.reader_slots)]
        names = []
        for role, rank in slots:
            try:
                slot = self._slot(role, rank)
            except ProtocolError as e:
                logger.warning("weightbus control: %s", e)
                continue
            if slot is not None:
                names.append(slot[0].name)
        names = [n for n in names if n != self.participant.name]
        deadline, seconds = self._deadline(timeout)
        limit = cfg.heartbeat_timeout.total_seconds()
        backoff = _Backoff(self.config.num_writers + self.config.reader_slots)
        last: dict[str, tuple[int, float]] = {}
        while names:
            now = time.monotonic()
            failed = set()
            if store.check([self._ekey("faillog")]):
                failed = set(store.get(self._ekey("faillog")).decode(errors="replace").split())
            remaining = []
            for n in names:
                if n in failed or store.check([self._key("closed", n)]):
                    continue
                count = int(store.get(self._key("hb", n)))
                seen = last.get(n)
                if seen is None or seen[0] != count:
                    last[n] = (count, now)
                elif now - seen[1] > limit:
                    continue
                remaining.append(n)
            names = remaining
            if not names:
                return
            if now >= deadline:
                logger.warning(
                    "weightbus control: %s hosts the store and is closing after %.1f s although "
                    "%s have not closed; their next store call will fail",
                    _who(self.participant),
                    seconds,
                    names,
                )
                return
            backoff.sleep(deadline)

    def __enter__(self) -> ControlPlane:
        return self.connect()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, PeerFailure):
            self.fail(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            self.close()
