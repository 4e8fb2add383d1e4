"""Run an engine's side of a collective step on threads while the trainer's side runs here."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any


def beside(calls: Sequence[Callable[[], Any]], local: Callable[[], Any]) -> Any:
    """Run every ``calls`` on threads while ``local()`` runs here; return ``local()``'s value.

    Both sides of a connect or sync are collective (the trainer's Writer and the engine's
    workers, reached over HTTP or RPC), so neither may wait for the other to finish first. The
    first error from either side is raised; threads still blocked on their side are not waited
    for then.
    """
    if not calls:
        return local()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(calls))
    futures = [pool.submit(c) for c in calls]
    try:
        out = local()
        for f in futures:
            f.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return out
