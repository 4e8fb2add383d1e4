"""links: a transport for each writer->reader link, and one transport made of several.

Where the two ends of a link are decides which transport serves it best. :func:`link_class`
puts every writer->reader link of a plan in one class, from the participants' ``host``,
``device``, ``gpu`` (the GPU's UUID) and ``process`` (:class:`~weightbus.spec.Participant`):

| class | the two ends | automatic |
| --- | --- | --- |
| same_gpu | CUDA, one host, one GPU (equal UUIDs) | cuda_ipc |
| same_host | CUDA, one host, two GPUs | cuda_ipc |
| cross_host | CUDA, two hosts | nccl |
| cpu_same_process | CPU, threads of one process | gloo |
| cpu_same_host | CPU, one host, two processes | gloo |
| cpu_cross_host | CPU, two hosts | gloo |
| cpu_gpu | one end on the CPU, the other on a GPU | none: by name |

GPUs are told apart by UUID, not by device string: under different ``CUDA_VISIBLE_DEVICES``
two processes may both say ``cuda:0`` on different GPUs, or ``cuda:0`` and ``cuda:1`` on one.
Where a participant's UUID is unknown (""), host and device string decide, as before.

The automatic transport of a class is the highest-priority transport (priority >= 0) whose
flags carry it (:meth:`~weightbus.transports.base.Transport.carries`) and
that accepts the participants of those links (``unsupported``); with codecs on, only
transports whose writers send (not the pulling ``cuda_ipc`` and ``local``). The table above is
what the built-in transports give. ``rdma`` (``cross_host`` or ``cpu_gpu``) and ``local``
(``cpu_same_process``) are chosen only when asked for.

What to ask for (``SyncConfig.transport``, or ``$WEIGHTBUS_TRANSPORT`` when that is "auto"):

* ``"auto"``: every class automatic;
* a transport name (``"nccl"``): that transport for every link, as one transport for the job;
* a mapping from link class to transport name (``{"same_host": "nccl", "cross_host":
  "rdma"}``); classes it leaves out (or maps to ``"auto"``) stay automatic. As a string, the
  same reads ``"same_host=nccl,cross_host=rdma"`` (the form for the environment variable).

When every link gets the same transport and it accepts every participant, that transport
serves the whole job exactly as before. Otherwise :class:`LinksTransport` connects one
transport per name and group of participants its links connect (CUDA IPC on each host, NCCL
over the participants of its links), so each participant holds at most one of each name, and
sends every operation to the transport of its peer's link. The choice is logged once per job
as a table (link class, transport, number of links).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from weightbus.control.store import check_agreement
from weightbus.errors import PlanMismatch
from weightbus.spec import Participant
from weightbus.transports.base import (
    TRANSPORT_ENV,
    Handle,
    Program,
    Transport,
    available_transports,
    transport_class,
)

__all__ = [
    "LINK_CLASSES",
    "Link",
    "LinkChoice",
    "LinksTransport",
    "build_transport",
    "check_choice",
    "choose_links",
    "link_class",
]

logger = logging.getLogger(__name__)

LINK_CLASSES: dict[str, str] = {
    "same_gpu": "CUDA, one host, one GPU (equal UUIDs)",
    "same_host": "CUDA, one host, two GPUs",
    "cross_host": "CUDA, two hosts",
    "cpu_same_process": "CPU, threads of one process",
    "cpu_same_host": "CPU, one host, two processes",
    "cpu_cross_host": "CPU, two hosts",
    "cpu_gpu": "one end on the CPU, the other on a GPU",
}
"""Every link class, in the order tables list them, with what it means."""

AUTO = "auto"

_LOGGED: set[tuple[str, str]] = set()
_LOG_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------
# link classes
# ---------------------------------------------------------------------------------------------


def _kind(p: Participant) -> str:
    try:
        return torch.device(p.device).type
    except (RuntimeError, TypeError, ValueError):
        return p.device


def _gpu_index(p: Participant) -> int:
    d = torch.device(p.device)
    return d.index if d.index is not None else 0


def _same_gpu(a: Participant, b: Participant) -> bool:
    if a.gpu and b.gpu:
        return a.gpu == b.gpu
    # a UUID is unknown (a participant from an older weightbus, or CUDA unavailable where it
    # was built): the device string, as every process numbers its GPUs alike
    return _gpu_index(a) == _gpu_index(b)


def link_class(writer: Participant, reader: Participant) -> str:
    """The class of the link between ``writer`` and ``reader`` (a key of
    :data:`LINK_CLASSES`); a pure function of the two participants."""
    a, b = _kind(writer), _kind(reader)
    one_host = writer.host == reader.host
    if a == b == "cuda":
        if not one_host:
            return "cross_host"
        return "same_gpu" if _same_gpu(writer, reader) else "same_host"
    if a == b == "cpu":
        if not one_host:
            return "cpu_cross_host"
        if writer.process and writer.process == reader.process:
            return "cpu_same_process"
        return "cpu_same_host"
    return "cpu_gpu"


# ---------------------------------------------------------------------------------------------
# what was asked for
# ---------------------------------------------------------------------------------------------


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"{where}={name!r} must be a transport name (one of {available_transports()}) or 'auto'"
        )
    if name != AUTO and name not in available_transports():
        raise ValueError(
            f"{where}: unknown transport {name!r}; known: {available_transports()} (or "
            "'auto'); register a custom transport before naming it"
        )
    return name


def check_choice(value: object, what: str = "SyncConfig.transport") -> str | dict[str, str]:
    """``value`` as :func:`choose_links` takes it, checked: "auto", a transport name, or a
    dict of link class -> transport name (from a mapping, or a ``"class=name,..."`` string).
    Raises ``ValueError`` / ``TypeError`` naming the bad key or value and the fix."""
    example = "e.g. {'same_host': 'nccl', 'cross_host': 'rdma'}"
    if isinstance(value, str) and "=" in value:
        pairs = {}
        for part in value.split(","):
            key, eq, name = (x.strip() for x in part.partition("="))
            if not eq or not key or not name:
                raise ValueError(
                    f"{what}={value!r}: {part.strip()!r} is not 'link_class=transport'; write "
                    "e.g. 'same_host=nccl,cross_host=rdma'"
                )
            if key in pairs:
                raise ValueError(f"{what}={value!r} names link class {key!r} twice")
            pairs[key] = name
        value = pairs
    if isinstance(value, str):
        return _check_name(value, what)
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{what}={value!r} must be 'auto', a transport name for every link, or a mapping "
            f"from link class to transport name ({example})"
        )
    out: dict[str, str] = {}
    for key, name in value.items():
        if key not in LINK_CLASSES:
            raise ValueError(
                f"{what} has link class {key!r}; the classes are {list(LINK_CLASSES)} ({example})"
            )
        out[key] = _check_name(name, f"{what}[{key!r}]")
    return out


def _requested(transport: object) -> tuple[str | dict[str, str], str]:
    """What was asked for, and how: an explicit value, else ``$WEIGHTBUS_TRANSPORT``."""
    if transport is not None and transport != AUTO:
        return check_choice(transport, "transport"), "by name"
    env = os.environ.get(TRANSPORT_ENV)
    if env:
        return check_choice(env, f"${TRANSPORT_ENV}"), f"by ${TRANSPORT_ENV}"
    return AUTO, "automatically"


# ---------------------------------------------------------------------------------------------
# the choice
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Link:
    """One writer->reader link and the transport that serves it."""

    writer: str
    """The writer's name."""
    reader: str
    """The reader's name."""
    kind: str
    """Its class (a key of :data:`LINK_CLASSES`)."""
    transport: str
    """The transport's name."""

    @property
    def ends(self) -> tuple[str, str]:
        """(writer, reader)."""
        return self.writer, self.reader


@dataclass(frozen=True, slots=True)
class LinkChoice:
    """A transport for every link of a job: what :func:`choose_links` returns."""

    participants: tuple[Participant, ...]
    """Every participant, writers by rank then readers by rank (the global ranks)."""
    links: tuple[Link, ...]
    """Every link with its class and transport, in (writer, reader) order."""
    how: Mapping[str, str]
    """Per link class present: how its transport was chosen ("automatically", "by name",
    "by $WEIGHTBUS_TRANSPORT")."""
    single: str | None
    """The transport serving the whole job, when one does; None when links differ."""

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports the links use, sorted (the order they connect in)."""
        if not self.links and self.single is not None:
            return (self.single,)
        return tuple(sorted({link.transport for link in self.links}))

    def groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The transports to connect: per transport name, each set of participants its links
        join (connected through them), in global order; sorted. A participant is in at most
        one group per name: CUDA IPC on two hosts is two groups, each on its own host. The
        whole job is one group when one transport serves it."""
        if self.single is not None:
            return ((self.single, tuple(p.name for p in self.participants)),)
        order = {p.name: i for i, p in enumerate(self.participants)}
        out = []
        for name in self.transports:
            pairs = [x.ends for x in self.links if x.transport == name]
            for members in _components(pairs):
                out.append((name, tuple(sorted(members, key=order.__getitem__))))
        return tuple(sorted(out, key=lambda g: (g[0], order[g[1][0]])))

    def transport_of(self, writer: str, reader: str) -> str | None:
        """The transport of the link ``writer`` -> ``reader``; None when they are not linked."""
        for link in self.links:
            if link.writer == writer and link.reader == reader:
                return link.transport
        return self.single if not self.links else None

    def pulling(self) -> dict[str, str]:
        """Link class -> transport, for the classes whose transport pulls (``"*"`` for a job
        without links served by a pulling transport)."""
        if not self.links:
            pulls = self.single is not None and transport_class(self.single).pulls
            return {"*": self.single} if pulls else {}
        return {x.kind: x.transport for x in self.links if transport_class(x.transport).pulls}

    def table(self) -> str:
        """The choice as a small table: link class, transport, links, how chosen."""
        counts: dict[tuple[str, str], int] = {}
        for x in self.links:
            counts[(x.kind, x.transport)] = counts.get((x.kind, x.transport), 0) + 1
        rows = [("link class", "transport", "links", "chosen")]
        for kind in LINK_CLASSES:
            for (k, name), n in sorted(counts.items()):
                if k == kind:
                    rows.append((kind, name, str(n), self.how.get(kind, "")))
        if not self.links and self.single is not None:
            rows.append(("(none)", self.single, "0", self.how.get("", "")))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return "\n".join(
            "  "
            + "  ".join(
                cell.rjust(w) if i == 2 else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in rows
        )

    def digest(self) -> str:
        """A hash of the whole choice; equal on every process that chose alike."""
        text = "\n".join(
            [",".join(p.name for p in self.participants), str(self.single)]
            + [f"{x.writer}>{x.reader}:{x.kind}:{x.transport}" for x in self.links]
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def log(self, job: str = "") -> None:
        """Log the table at INFO, once per process for each job and choice."""
        table = self.table()
        with _LOG_LOCK:
            if (job, table) in _LOGGED:
                return
            _LOGGED.add((job, table))
        hosts = len({p.host for p in self.participants})
        logger.info(
            "weightbus: transports%s for %d links between %d participants on %d host%s "
            "(%s); override with SyncConfig.transport (a name, or per link class) or $%s:\n%s",
            f" of job {job!r}" if job else "",
            len(self.links),
            len(self.participants),
            hosts,
            "" if hosts == 1 else "s",
            f"one transport, {self.single}" if self.single else "one transport per link",
            TRANSPORT_ENV,
            table,
        )


def _job(
    participants: Any,
) -> tuple[list[Participant], list[tuple[Participant, Participant]] | None]:
    """(participants, links or None) from a plan, a roster or participants."""
    plan = participants if hasattr(participants, "participants") else None
    if plan is not None:
        participants = plan.participants
    if hasattr(participants, "all"):
        participants = participants.all
    people = list(participants)
    links = None
    buckets = getattr(plan, "buckets", None)
    if buckets is not None:
        writers = [w.participant for w in plan.writers]
        readers = [r.participant for r in plan.readers]
        pairs = sorted({(int(s), int(d)) for s, d in zip(buckets.src, buckets.dst, strict=True)})
        links = [(writers[s], readers[d]) for s, d in pairs]
    return people, links


def _components(pairs: Iterable[tuple[str, str]]) -> list[set[str]]:
    """The sets of names that ``pairs`` (links) connect, directly or through others."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[root(a)] = root(b)
    out: dict[str, set[str]] = {}
    for x in list(parent):
        out.setdefault(root(x), set()).add(x)
    return list(out.values())


def _show(pairs: Sequence[tuple[Participant, Participant]], most: int = 3) -> str:
    def one(p: Participant) -> str:
        return f"{p.name} on {p.device} of {p.host}"

    shown = "; ".join(f"{one(w)} -> {one(r)}" for w, r in pairs[:most])
    return shown + (f"; and {len(pairs) - most} more" if len(pairs) > most else "")


def _cannot(name: str, kind: str) -> str:
    return f"{name} does not carry {kind} links ({LINK_CLASSES[kind]})"


def _fits(
    people: Sequence[Participant],
    push_only: bool = False,
    pairs: Sequence[tuple[Participant, Participant]] = (),
) -> list[str]:
    """Transports that could serve the whole job alone (priority >= 0), ``pairs`` its links."""
    return [
        n
        for n in available_transports()
        if transport_class(n).priority >= 0
        and not (push_only and transport_class(n).pulls)
        and transport_class(n).unsupported(people) is None
        and all(transport_class(n).carries(link_class(w, r)) for w, r in pairs)
    ]


def _automatic(kind: str, pairs: list[tuple[Participant, Participant]], push_only: bool) -> str:
    """The highest-priority transport that carries ``kind`` and accepts the ends of those
    links (each set of them the links connect: on every host, for a one-host transport)."""
    by_name = {p.name: p for pair in pairs for p in pair}
    groups = [
        [by_name[n] for n in group] for group in _components((w.name, r.name) for w, r in pairs)
    ]
    tried = []
    for name in available_transports():
        cls = transport_class(name)
        if cls.priority < 0 or not cls.carries(kind):
            continue
        if push_only and cls.pulls:
            tried.append(f"{name} pulls (no writer encodes)")
            continue
        reason = next((r for g in groups if (r := cls.unsupported(g)) is not None), None)
        if reason is None:
            return name
        tried.append(reason)
    hint = (
        "; with codecs on (SyncConfig.fp8 / delta) only transports whose writers send qualify"
        if push_only
        else ""
    )
    raise ValueError(
        f"no transport can link this job: its {kind} links ({_show(pairs)}) need one, and "
        + (
            "; ".join(tried)
            if tried
            else f"none of {available_transports()} carries them automatically"
        )
        + f"{hint}. Name one for them: SyncConfig.transport={{{kind!r}: '<transport>'}} "
        f"(known: {available_transports()}; rdma moves CPU and CUDA memory on any hosts)"
    )


def choose_links(
    participants: Any,
    links: Iterable[tuple[Participant, Participant]] | None = None,
    transport: str | Mapping[str, str] | None = AUTO,
    *,
    push_only: bool = False,
) -> LinkChoice:
    """A transport for every writer->reader link of a job.

    ``participants``: a ``TransferPlan`` (its buckets say which links exist), a
    :class:`~weightbus.control.store.Roster` or participants (then ``links``, default every
    writer with every reader). ``transport``: what was asked for (see the module docstring);
    None or "auto" defers to ``$WEIGHTBUS_TRANSPORT``. ``push_only`` (codecs on): automatic
    choices skip transports that pull; one asked for by name is kept, and the caller refuses it.

    Pure: the same participants, links, request and installed transports give the same
    choice on every process. Raises ``ValueError`` naming the links no transport can serve.
    """
    people, plan_links = _job(participants)
    if not people:
        raise ValueError("select_transport needs the job's participants")
    people = sorted(people, key=lambda p: (p.role != "writer", p.rank))
    pairs = list(links) if links is not None else plan_links
    if pairs is None:
        writers = [p for p in people if p.role == "writer"]
        readers = [p for p in people if p.role == "reader"]
        pairs = [(w, r) for w in writers for r in readers]
    asked, how = _requested(transport)

    if isinstance(asked, str) and asked != AUTO:
        # one transport for every link: checked against the whole job, as always
        cls = transport_class(asked)
        reason = cls.unsupported(people)
        odd = [(w, r) for w, r in pairs if not cls.carries(link_class(w, r))]
        if reason is None and odd:
            reason = f"{_cannot(asked, link_class(*odd[0]))}: {_show(odd)}"
        if reason is not None:
            fits = _fits(people, pairs=pairs)
            kinds = sorted({link_class(w, r) for w, r in pairs}, key=list(LINK_CLASSES).index)
            instead = f"these fit: {fits}"
            if not fits and kinds:
                # none alone: one per link class, where this one serves some of them
                carried = [k for k in kinds if cls.carries(k)]
                e_g = (
                    f", e.g. SyncConfig.transport={{{carried[-1]!r}: {asked!r}}}" if carried else ""
                )
                instead = (
                    "no one transport serves every link: leave it automatic, or name one per "
                    f"link class ({', '.join(kinds)}){e_g}"
                )
            raise ValueError(f"transport {asked!r} was asked for but {reason}; {instead}")
        return LinkChoice(
            participants=tuple(people),
            links=tuple(Link(w.name, r.name, link_class(w, r), asked) for w, r in pairs),
            how={link_class(w, r): how for w, r in pairs} | ({"": how} if not pairs else {}),
            single=asked,
        )

    mapping = asked if isinstance(asked, dict) else {}
    if not pairs:
        # no links (a plan with nothing to move): one transport for the whole job, the
        # highest-priority one that accepts it
        fits = _fits(people, push_only)
        if not fits:
            reasons = "; ".join(
                transport_class(n).unsupported(people) or f"{n} pulls"
                for n in available_transports()
            )
            raise ValueError(f"no transport can link this job: {reasons}")
        return LinkChoice(
            participants=tuple(people), links=(), how={"": "automatically"}, single=fits[0]
        )

    by_kind: dict[str, list[tuple[Participant, Participant]]] = {}
    for w, r in pairs:
        by_kind.setdefault(link_class(w, r), []).append((w, r))
    chosen: dict[str, str] = {}
    hows: dict[str, str] = {}
    for kind in LINK_CLASSES:
        if kind not in by_kind:
            continue
        name = mapping.get(kind, AUTO)
        if name == AUTO:
            chosen[kind], hows[kind] = _automatic(kind, by_kind[kind], push_only), "automatically"
        else:
            chosen[kind], hows[kind] = name, how

    # each transport must carry its classes, and accept every participant its links join
    def refuse(name: str, kinds: list[str], reason: str) -> ValueError:
        ask = "was asked for" if any(hows[k] != "automatically" for k in kinds) else "was chosen"
        return ValueError(
            f"transport {name!r} {ask} for the {', '.join(kinds)} links "
            f"({_show([pair for k in kinds for pair in by_kind[k]])}) but {reason}: name "
            f"another for them, e.g. SyncConfig.transport={{{kinds[0]!r}: '<transport>'}} "
            f"(known: {available_transports()})"
        )

    for kind, name in chosen.items():
        if not transport_class(name).carries(kind):
            raise refuse(name, [kind], f"it does not carry them ({LINK_CLASSES[kind]})")
    links_out = tuple(
        Link(w.name, r.name, kind, chosen[kind]) for w, r in pairs for kind in [link_class(w, r)]
    )
    everyone = {p.name: p for p in people}
    for name in sorted(set(chosen.values())):
        ends = [x.ends for x in links_out if x.transport == name]
        for group in _components(ends):
            reason = transport_class(name).unsupported([everyone[n] for n in sorted(group)])
            if reason is not None:
                kinds = sorted(
                    {x.kind for x in links_out if x.transport == name and x.writer in group},
                    key=list(LINK_CLASSES).index,
                )
                raise refuse(name, kinds, reason)
    names = set(chosen.values())
    single = None
    if len(names) == 1:
        only = names.pop()
        # the whole job over it, as one transport, when it accepts every participant
        if transport_class(only).unsupported(people) is None:
            single = only
    return LinkChoice(participants=tuple(people), links=links_out, how=hows, single=single)


def build_transport(choice: LinkChoice, **config: Any) -> Transport:
    """The transport for ``choice``: the one transport itself, or a :class:`LinksTransport`.
    ``config`` goes to each transport's constructor."""
    if choice.single is not None:
        return transport_class(choice.single)(**config)
    return LinksTransport(choice, **config)


# ---------------------------------------------------------------------------------------------
# several transports in one job
# ---------------------------------------------------------------------------------------------


class _Members:
    """The job's control plane as one transport of a :class:`LinksTransport` sees it: the
    same store, failure reports and heartbeats, but only the participants its links join
    (its gathers, barriers and agreements wait for them alone), under topic names of its own."""

    def __init__(self, control: Any, roster: Any, prefix: str) -> None:
        self._control = control
        self._roster = roster
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        # participant, config, raise_if_failed, fail, has_closed, ...: the job's own
        return getattr(self._control, name)

    @property
    def roster(self) -> Any:
        return self._roster

    def participants(self, timeout: timedelta | None = None) -> Any:
        return self._roster

    def post(self, topic: str, value: Any) -> None:
        self._control.post(self._prefix + topic, value)

    def drop(self, topic: str) -> None:
        self._control.drop(self._prefix + topic)

    def gather(
        self,
        topic: str,
        role: str | None = None,
        names: Sequence[str] | None = None,
        timeout: timedelta | None = None,
        schema: Any = None,
    ) -> dict:
        if role is not None and role not in ("writer", "reader"):
            raise ValueError(f"role {role!r} is not 'writer' or 'reader'")
        if names is None:
            targets = self._roster.names(role)
        else:
            unknown = [n for n in names if n not in self._roster]
            if unknown:
                raise KeyError(
                    f"gather over participants {unknown} outside this transport's links "
                    f"({self._roster.names()})"
                )
            wanted = set(names)
            targets = [n for n in self._roster.names(role) if n in wanted]
        return self._control.gather(
            self._prefix + topic, names=targets, timeout=timeout, schema=schema
        )

    def barrier(
        self, topic: str, role: str | None = None, timeout: timedelta | None = None
    ) -> None:
        self.post(topic, b"")
        self.gather(topic, role=role, timeout=timeout)

    def agree(self, topic: str, digest: str, timeout: timedelta | None = None) -> str:
        key = f"agree/{topic}"
        self.post(key, digest.encode())
        check_agreement(topic, key, self.gather(key, timeout=timeout), repr)
        return digest

    def substore(self, kind: str) -> Any:
        return self._control.substore(self._prefix + kind)

    def sequence(self, kind: str) -> int:
        return self._control.sequence(self._prefix + kind)


class LinksTransport(Transport):
    """Several transports in one job, one per link (see the module docstring).

    Each transport connects over a group of participants its links join (NCCL builds its
    communicator over them, CUDA IPC shares its writers' tensors with its readers) through a
    view of the control plane limited to them, in the same order on every process; each sees
    its bucket ops with its own global ranks. ``send``, ``recv`` and ``pull`` go to the
    transport of the peer's link; :meth:`pulls_from` says which links pull; :meth:`wait` waits
    on handles of any of them under one deadline; ``abort`` and ``close`` reach them all.
    """

    name = "links"
    devices = frozenset({"cpu", "cuda"})
    cross_host = True
    priority = -1

    def __init__(self, choice: LinkChoice, **config: Any) -> None:
        super().__init__(config.get("timeout"))
        self.choice = choice
        """Which transport serves each link."""
        self._config = config
        self._subs: dict[str, Transport] = {}  # the transports this participant is in, by name
        self._via: dict[str, Transport] = {}  # peer name -> the transport of its link

    def __repr__(self) -> str:
        who = self.participant.name if self.participant else "?"
        return f"LinksTransport({who!r}, {'+'.join(self.choice.transports)}, {self._state})"

    @classmethod
    def unsupported(cls, participants: Iterable[Participant]) -> str | None:
        return None  # each transport was checked against its own links when chosen

    def _connect(self) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert control is not None and roster is not None and me is not None
        n = control.sequence("links")
        try:
            control.agree(f"links/{n}", self.choice.digest())
        except PlanMismatch as e:
            raise PlanMismatch(
                f"participants chose different transports for the links ({e}): pass the same "
                f"SyncConfig.transport and ${TRANSPORT_ENV} to every participant, with the "
                "same transports installed",
                e.groups,
            ) from None
        from weightbus.control.store import Roster

        for name, members in self.choice.groups():
            if me.name not in members:
                continue
            sub_roster = Roster.of(p for p in roster.all if p.name in members)
            sub = self._subs[name] = transport_class(name)(**self._config)
            # topics of its own: one group per name for each participant, several per job
            prefix = f"links/{n}/{name}/{members[0]}/"
            sub.connect(_Members(control, sub_roster, prefix), sub_roster)
        for link in self.choice.links:
            if me.name in (link.writer, link.reader):
                peer = link.reader if me.name == link.writer else link.writer
                self._via[peer] = self._subs[link.transport]
        logger.debug(
            "weightbus links: %s connected %s",
            me.name,
            ", ".join(f"{k} to {len(t.roster.all) - 1} peers" for k, t in self._subs.items()),
        )

    def _route(self, peer: Participant | str | int) -> tuple[Transport, Participant]:
        self._require_connected()
        target = self._peer(peer)
        sub = self._via.get(target.name)
        if sub is None:
            assert self.participant is not None
            if target.name == self.participant.name:
                raise ValueError(f"links: {target.name!r} to itself; copy locally instead")
            raise ValueError(
                f"links: {self.participant.name!r} and {target.name!r} have no link in this "
                "job's plan (no bucket moves between them)"
            )
        return sub, target

    def pulls_from(self, peer: Participant | str | int) -> bool:
        return self._route(peer)[0].pulls

    def landed(self, peer: Participant | str | int, tag: int) -> tuple:
        """A pulling link's events for bucket ``tag`` (see ``CudaIpcTransport.landed``)."""
        sub, target = self._route(peer)
        landed = getattr(sub, "landed", None)
        return landed(target, tag) if landed is not None else ()

    def expose(self, program: Program) -> None:
        self._require_connected()
        assert self.roster is not None
        everyone = self.roster.all
        for sub in self._subs.values():
            assert sub.roster is not None
            keep = [
                i
                for i, op in enumerate(program.ops)
                if self._via.get(everyone[op.peer_global].name) is sub
            ]
            # the transport numbers its own participants: global ranks among them
            ops = tuple(
                dataclasses.replace(
                    program.ops[i],
                    peer_global=sub.roster.global_rank(everyone[program.ops[i].peer_global].name),
                )
                for i in keep
            )
            direct = tuple(program.direct[i] for i in keep)
            sub.expose(Program(ops, program.tensors, direct, ready_order=program.ready_order))

    def sends_anywhere(self) -> bool:
        """Where every transport this participant sends through (its links' that do not
        pull) sends from any buffer: a writer whose links all go over NCCL or gloo sends a
        codec's frames where they lie, though other participants of the job pull."""
        self._require_connected()
        senders = [sub for sub in self._subs.values() if not sub.pulls]
        return bool(senders) and all(sub.sends_anywhere() for sub in senders)

    def _register(self, buffers: list[torch.Tensor]) -> None:
        for sub in self._subs.values():
            sub.register([] if sub.pulls else buffers)

    def begin(self) -> None:
        for sub in self._subs.values():
            sub.begin()

    def send(self, peer: Participant | str | int, buf: torch.Tensor, tag: int) -> Handle:
        sub, target = self._route(peer)
        return sub.send(target, buf, tag)

    def recv(self, peer: Participant | str | int, buf: torch.Tensor, tag: int) -> Handle:
        sub, target = self._route(peer)
        return sub.recv(target, buf, tag)

    def groups_with(self, peer: Participant | str | int) -> bool:
        sub, target = self._route(peer)
        return sub.groups_with(target)

    def send_many(
        self, peer: Participant | str | int, items: Sequence[tuple[torch.Tensor, int]]
    ) -> list[Handle]:
        sub, target = self._route(peer)
        return sub.send_many(target, items)

    def recv_many(
        self, peer: Participant | str | int, items: Sequence[tuple[torch.Tensor, int]]
    ) -> list[Handle]:
        sub, target = self._route(peer)
        return sub.recv_many(target, items)

    def done_event(self, handle: Handle) -> torch.cuda.Event | None:
        return self._route(handle.peer)[0].done_event(handle)

    def pull(self, peer: Participant | str | int, tag: int) -> Handle:
        sub, target = self._route(peer)
        return sub.pull(target, tag)

    # wait: Transport.wait, with a failure on any link aborting them all
    def _raise_if_lost(self) -> None:
        for sub in self._subs.values():
            sub._raise_if_lost()

    def _lost_by(self, handle: Handle) -> None:
        self._via[handle.peer.name]._lost_by(handle)

    def _settle(self, handle: Handle) -> None:
        self._via[handle.peer.name]._settle(handle)

    def _close(self) -> None:
        for sub in self._subs.values():
            sub.close()

    def _abort(self, reason: str) -> None:
        for sub in self._subs.values():
            sub.abort(reason)
