"""Benchmarks behind ``weightbus bench``: planner scale now, GPU scenarios with the GPU data plane."""

from __future__ import annotations

import re

_MODEL = re.compile(r"^[A-Z]+\d+[A-Z]*\b")


def machine_kind(n_gpu: int, name: str) -> str:
    """The short name of a machine in results files' names: ``2xh100`` for two "NVIDIA H100
    80GB HBM3"; the first word of the device's name that starts as a GPU model does (letters
    then digits: H100, H200, A100 of "A100-SXM4-80GB", L40S), else its last word."""
    words = name.split()
    found = (m.group(0) for m in map(_MODEL.match, words) if m is not None)
    model = next(found, words[-1] if words else "gpu")
    return f"{n_gpu}x{model.lower()}"
