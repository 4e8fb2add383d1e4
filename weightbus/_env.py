"""Settings read from environment variables (tuning knobs of the data plane)."""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """``$name`` as an integer, or ``default`` where it is unset or empty; a value that is not
    an integer is refused, naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r}: an integer (default {default}), or unset") from None
