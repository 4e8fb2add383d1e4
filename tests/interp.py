"""Running a test module's ``test_interp_*`` tests in Triton's interpreter, from a normal run.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before triton is first imported,
so a parent test runs them in a child pytest; they skip themselves in the normal run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether this process runs Triton's interpreter (the child run)."""


def run_interpreted(module: str) -> None:
    """Run ``module``'s ``test_interp_*`` tests in a child pytest under TRITON_INTERPRET=1;
    fail with its output unless every one of them passed (none skipped)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    root = Path(module).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module, "-k", "interp_"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=280)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, out[-3000:]
