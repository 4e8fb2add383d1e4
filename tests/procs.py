"""Collecting what spawned participant processes report, for the tests that run a job in
several processes: each process puts one report on a queue, a tuple whose last two fields are
a status and a payload, the fields before them naming it."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Reports:
    """What :func:`collect_reports` gathered."""

    got: dict = field(default_factory=dict)
    """Per report's name (its one leading field, or a tuple of several): (status, payload)."""
    arrived: dict = field(default_factory=dict)
    """Per name: seconds from the start of collecting until the report arrived."""
    hung: list = field(default_factory=list)
    """The processes still alive after the joins (killed)."""


def collect_reports(
    procs: Iterable, q, expected: int, limit: float, *, join_s: float | None = None
) -> Reports:
    """Read ``expected`` reports from ``q`` until all arrived, ``limit`` seconds passed or
    every process in ``procs`` (started already) exited; then join each process (until the
    deadline, at least 1 s, or ``join_s`` seconds) and kill the ones still alive. A report
    that never came is missing from the result: callers assert on what they expect."""
    procs = list(procs)
    out = Reports()
    t0 = time.monotonic()
    deadline = t0 + limit
    try:
        while len(out.got) < expected and time.monotonic() < deadline:
            try:
                *name, status, payload = q.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            key = name[0] if len(name) == 1 else tuple(name)
            out.got[key] = (status, payload)
            out.arrived[key] = time.monotonic() - t0
        for p in procs:
            p.join(timeout=join_s if join_s is not None else max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                out.hung.append(p)
                p.kill()
    return out


class Spawned:
    """Participant processes (``self.procs``: name -> a process not started yet) as a
    context: started on entry; on exit, the ones still alive are killed and all joined."""

    procs: dict

    def __enter__(self):
        for p in self.procs.values():
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(10)
