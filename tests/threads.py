"""Running several participants of one test job as threads of the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def run_threads(bodies: dict[str, Callable[[], object]], limit: float = 90.0) -> dict:
    """Run each body in a thread; ``{name: result or the exception it raised}``. Fails the
    test naming the bodies still running after ``limit`` seconds."""
    out: dict = {}

    def go(name, body):
        try:
            out[name] = body()
        except BaseException as exc:
            out[name] = exc

    threads = [threading.Thread(target=go, args=kv, daemon=True) for kv in bodies.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [name for name in bodies if name not in out]
    assert not hung, f"participants left hanging: {hung}; others: {out}"
    return out
