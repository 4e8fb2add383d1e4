"""local: readers copy straight out of the writers' tensors, between threads of one process.

The CPU counterpart of cuda_ipc's pull: no staging buffer and no packing on either side, one
``copy_`` per route from the writer's region into the reader's.

1. at :meth:`LocalTransport.expose` each writer leaves its program (bucket ops and live
   tensors) in a table of this process under a fresh random token and posts the token. Each
   reader finds every writer's program by its token and pairs each of its routes with the
   writer's region (views: nothing is copied at connect). The writer takes its program back
   out of the table once every reader has posted that it is done;
2. each sync, a reader's ``pull(writer, tag)`` copies bucket ``tag``'s routes on the calling
   thread, and its handle is done when the call returns; writers post nothing. A writer leaves
   its tensors alone until every reader has acknowledged the version (``Writer.sync``), so the
   copies read one version.

Only threads of one process qualify: every participant must have the same host and process
(``Participant.process``). It is never chosen automatically: a Participant built in one
process and used in another carries that other process's id, which the choice (a pure
function of the roster) cannot see, and would turn a job that works over gloo into one that
fails at connect. Ask for it: ``SyncConfig(transport="local")``, or for the links between
threads only, ``SyncConfig(transport={"cpu_same_process": "local"})``. A participant whose
Participant names another process is refused at connect.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import torch

from weightbus.errors import PlanMismatch, WeightbusError
from weightbus.spec import this_process
from weightbus.transports.base import Handle, Program, Transport, register_transport

__all__ = ["LocalTransport"]

logger = logging.getLogger(__name__)

TOKEN = {"token": str}
"""``local/<n>`` from each writer: where its program waits in this process's table."""
SIGNAL: dict = {}
"""``local/<n>/opened`` from each reader: it has paired its routes."""

_TABLE: dict[str, tuple[str, Program]] = {}  # token -> (writer name, its program)
_TABLE_LOCK = threading.Lock()

_Pair = tuple[torch.Tensor, torch.Tensor, "torch.dtype | None"]  # (dst, src, wire dtype)


@register_transport
class LocalTransport(Transport):
    """CPU tensors between threads of one process, pulled by the readers; never automatic."""

    name = "local"
    devices = frozenset({"cpu"})
    cross_host = False
    same_process = True
    same_gpu_zero_copy = False
    needs_staging = False
    pulls = True
    priority = -1  # by name only: see the module docstring

    def __init__(self, **fields: Any) -> None:
        super().__init__(fields.pop("timeout", None))
        if fields:
            raise TypeError(f"local: unknown options {sorted(fields)}")
        self._buckets: dict[tuple[int, int], tuple[int, list[_Pair]]] = {}
        self._token = ""

    @classmethod
    def unsupported(cls, participants) -> str | None:
        people = list(participants)
        reason = super().unsupported(people)
        if reason is not None:
            return reason
        places = sorted({f"{p.process or 'unknown'} on {p.host}" for p in people})
        if len(places) > 1 or any(not p.process for p in people):
            return f"local links threads of one process only, the job spans processes {places}"
        return None

    def _connect(self) -> None:
        me = self.participant
        assert me is not None
        here = this_process()
        if me.process != here:
            raise WeightbusError(
                f"local: {me.role} {me.name!r} says it runs in process {me.process!r}, but it "
                f"runs in {here!r}: build its Participant in the process that runs it, or "
                "choose another transport (gloo)"
            )

    # -- connect-time ---------------------------------------------------------------------------

    def expose(self, program: Program) -> None:
        self._require_connected()
        control, me = self.control, self.participant
        assert control is not None and me is not None
        topic = f"local/{control.sequence('local')}"
        if me.role == "writer":
            self._token = uuid.uuid4().hex
            with _TABLE_LOCK:
                _TABLE[self._token] = (me.name, program)
            try:
                control.post(topic, {"token": self._token})
                control.gather(topic + "/opened", role="reader", schema=SIGNAL)
            finally:
                self._forget()
        else:
            self._expose_reader(program, topic)
            control.post(topic + "/opened", {})

    def _expose_reader(self, program: Program, topic: str) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert control is not None and roster is not None and me is not None
        tokens = control.gather(topic, role="writer", schema=TOKEN)
        mine = roster.global_rank(me.name)
        wanted = {(op.peer_global, op.bucket): op for op in program.ops}
        for wname, message in tokens.items():
            with _TABLE_LOCK:
                entry = _TABLE.get(message["token"])
            if entry is None or entry[0] != wname:
                raise WeightbusError(
                    f"local: writer {wname!r} is not a thread of this process (its tensors are "
                    f"not here), though its Participant says process {roster[wname].process!r}: "
                    "build each Participant in the process that runs it, or choose transport "
                    "'gloo'"
                )
            theirs = entry[1]
            writer = roster.global_rank(wname)
            for wop in theirs.ops:
                if wop.peer_global != mine:
                    continue
                op = wanted.pop((writer, wop.bucket), None)
                if op is None or op.nbytes != wop.nbytes:
                    raise PlanMismatch(
                        f"local: writer {wname!r} has bucket {wop.bucket} ({wop.nbytes} bytes) "
                        f"for {me.name!r}, whose plan has "
                        + ("no such bucket" if op is None else f"{op.nbytes} bytes in it")
                        + ": the two sides planned differently"
                    )
                pairs = _pairs(op, wop, program, theirs, wname, me.name)
                self._buckets[(writer, op.bucket)] = (op.nbytes, pairs)
        if wanted:
            (peer, tag), op = next(iter(wanted.items()))
            raise PlanMismatch(
                f"local: {me.name!r} expects {len(wanted)} buckets no writer exposed, e.g. "
                f"bucket {tag} from {roster.all[peer].name!r} ({op.nbytes} bytes)"
            )
        logger.debug(
            "weightbus local: %s pulls %d buckets (%d routes)",
            me.name,
            len(self._buckets),
            sum(len(p) for _, p in self._buckets.values()),
        )

    # -- per sync -------------------------------------------------------------------------------

    def _pull(self, handle: Handle) -> None:
        assert self.roster is not None
        got = self._buckets.get((self.roster.global_rank(handle.peer.name), handle.tag))
        if got is None:
            raise WeightbusError(
                f"local: {handle.peer.name!r} exposed no bucket {handle.tag} for this reader"
            )
        handle.nbytes, pairs = got
        with torch.no_grad():
            for dst, src, wire in pairs:
                dst.copy_(src if wire is None else src.to(wire))
        self._completed(handle)

    def _forget(self) -> None:
        if self._token:
            with _TABLE_LOCK:
                _TABLE.pop(self._token, None)
            self._token = ""

    def _close(self) -> None:
        self._forget()
        self._buckets.clear()

    def _abort(self, reason: str) -> None:
        self._close()


def _pairs(op, wop, mine: Program, theirs: Program, writer: str, reader: str) -> list[_Pair]:
    """Each route of ``op`` (the reader's) with the writer's region of the same bytes."""
    by_offset = {c.offset: c for c in wop.copies}
    if len(by_offset) != len(op.copies):
        raise PlanMismatch(
            f"local: bucket {op.bucket} holds {len(wop.copies)} routes at {writer!r} and "
            f"{len(op.copies)} at {reader!r}: the two sides planned differently"
        )
    pairs: list[_Pair] = []
    for c in op.copies:
        w = by_offset.get(c.offset)
        if w is None or w.nbytes != c.nbytes:
            raise PlanMismatch(
                f"local: bucket {op.bucket}: {reader!r} expects a route at byte {c.offset} "
                f"({c.nbytes} bytes, {c.tensor}) that {writer!r} does not send"
            )
        src = theirs.tensors[w.key][w.index]
        dst = mine.tensors[c.key][c.index]
        if src.shape != dst.shape:
            if src.numel() != dst.numel():
                raise PlanMismatch(
                    f"local: {c.tensor}: {writer!r} region {tuple(src.shape)} and {reader!r} "
                    f"region {tuple(dst.shape)} differ in size"
                )
            src = src.view(dst.shape)  # the same box, up to leading 1-dims
        # the wire dtype matters only when it differs from both ends' dtypes
        wire = c.dtype if c.dtype not in (src.dtype, dst.dtype) else None
        pairs.append((dst, src, wire))
    return pairs
