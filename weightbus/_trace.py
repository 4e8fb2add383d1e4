"""Named ranges of the host's work in a profiled sync (``weightbus bench gpu`` with
``$WEIGHTBUS_PROFILE_DIR``): :func:`mark` records one in the profiler's trace, where
:func:`weightbus.bench.timeline.across` lists those before each side's first data, and costs
one call when no profiler runs."""

from __future__ import annotations

import contextlib

import torch

_enabled = torch._C._autograd._profiler_enabled


def mark(name: str) -> contextlib.AbstractContextManager:
    """A range named ``weightbus.<name>`` in the trace while a profiler records; else
    nothing (a range costs some 6 microseconds, too much for every bucket of every sync)."""
    if _enabled():
        return torch.profiler.record_function(f"weightbus.{name}")
    return contextlib.nullcontext()
