"""Named ranges of the host's work in a sync: :func:`mark` records one in the profiler's trace
while a profiler runs (``weightbus bench gpu`` with ``$WEIGHTBUS_PROFILE_DIR``, where
:func:`weightbus.bench.timeline.across` lists those before each side's first data), else,
with ``$WEIGHTBUS_HOST_MARKS`` set, on the host's monotonic clock (:func:`take_marks`: a
sync's steps as they ran without a profiler's cost), else nothing, for one call's cost."""

from __future__ import annotations

import contextlib
import os
import time

import torch

_enabled = torch._C._autograd._profiler_enabled
_marks: list[tuple[str, float, float]] | None = (
    [] if os.environ.get("WEIGHTBUS_HOST_MARKS") else None
)


class _Stamp:
    """A range timed on ``time.perf_counter`` (one clock for every process of a host)."""

    __slots__ = ("name", "start")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        assert _marks is not None
        _marks.append((self.name, self.start, time.perf_counter()))


def mark(name: str) -> contextlib.AbstractContextManager:
    """A range named ``weightbus.<name>`` in the trace while a profiler records, or ``name``
    among :func:`take_marks` with ``$WEIGHTBUS_HOST_MARKS`` set; else nothing (a profiler's
    range costs some 6 microseconds, too much for every bucket of every sync)."""
    if _enabled():
        return torch.profiler.record_function(f"weightbus.{name}")
    if _marks is not None:
        return _Stamp(name)
    return contextlib.nullcontext()


def take_marks() -> list[tuple[str, float, float]]:
    """The ranges :func:`mark` timed since the last call (name, start, end: seconds on
    ``time.perf_counter``), oldest first; empty without ``$WEIGHTBUS_HOST_MARKS``."""
    if _marks is None:
        return []
    out = list(_marks)
    _marks.clear()
    return out
