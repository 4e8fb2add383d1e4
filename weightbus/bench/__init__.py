"""Benchmarks behind ``weightbus bench``: planner scale now, GPU scenarios with the GPU data plane."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

_MODEL = re.compile(r"^[A-Z]+\d+[A-Z]*\b")


def machine_kind(n_gpu: int, name: str) -> str:
    """The short name of a machine in results files' names: ``2xh100`` for two "NVIDIA H100
    80GB HBM3"; the first word of the device's name that starts as a GPU model does (letters
    then digits: H100, H200, A100 of "A100-SXM4-80GB", L40S), else its last word."""
    words = name.split()
    found = (m.group(0) for m in map(_MODEL.match, words) if m is not None)
    model = next(found, words[-1] if words else "gpu")
    return f"{n_gpu}x{model.lower()}"


def results_path(out: str | Path, stem: str) -> Path:
    """``out/<stem>.json``, or ``<stem>-2.json``, ``-3`` ... where an earlier run's results
    (or their plot) are there already: a second run on the same day and machine never
    overwrites the first. Makes ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = out / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        if not path.exists() and not path.with_suffix(".png").exists():
            return path
        n += 1


def _git(*args: str, env: dict | None = None) -> str | None:
    try:
        run = subprocess.run(["git", *args], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def source_identity() -> dict:
    """What a results file measured, for its ``commit``, ``tree`` and
    ``tree_differs_from_commit`` fields.

    ``commit``: ``$WEIGHTBUS_COMMIT`` when set, else git's ``HEAD`` here ("" without git).
    ``tree``: git's hash of the files as they are (what ``git add --all`` would commit:
    tracked files and those git does not ignore), so that a copy of the source whose git
    metadata is older than its files, files added since included, still names what ran:
    ``git log --format='%h %T' | grep <tree>`` finds the commit, where one has it.
    ``tree_differs_from_commit``: whether the tracked files differ from ``commit`` (None:
    git cannot tell, e.g. the commit is unknown here).
    """
    commit = os.environ.get("WEIGHTBUS_COMMIT", "")
    if not commit:
        head = _git("rev-parse", "HEAD")
        commit = head if head and len(head) == 40 else ""
    tree = None
    with tempfile.TemporaryDirectory() as tmp:
        # a scratch index: the checkout's own is left as it was
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if _git("read-tree", "HEAD", env=env) is not None and (
            _git("add", "--all", "--", ":/", env=env) is not None
        ):
            tree = _git("write-tree", env=env)
    differs = None
    if commit:
        try:
            diff = subprocess.run(
                ["git", "diff", "--quiet", commit, "--"], capture_output=True, timeout=60
            )
            differs = {0: False, 1: True}.get(diff.returncode)
        except (OSError, subprocess.SubprocessError):
            pass
    return {"commit": commit, "tree": tree or "", "tree_differs_from_commit": differs}
