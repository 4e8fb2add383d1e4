"""The command line: `weightbus plan`, `weightbus bench plan` and `weightbus demo` as users run them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightbus.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_plan_prints_statistics_and_json():
    out = _run(
        "plan", "--model", "tiny-llama", "--writers", "fsdp:shard=3", "--readers", "vllm:tp=2,dp=2"
    )
    assert out.returncode == 0, out.stderr
    assert "3 writers -> 4 readers" in out.stdout and "max/mean" in out.stdout
    out = _run(
        "plan",
        "--model",
        "tiny-llama",
        "--writers",
        "megatron:tp=2,pp=2",
        "--readers",
        "whole",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["writers"] == 4 and stats["readers"] == 1 and stats["routes"] > 0


def test_plan_reports_bad_input_clearly():
    out = _run("plan", "--model", "tiny-llama", "--writers", "fsdp:shards=3", "--readers", "whole")
    assert out.returncode == 2
    assert "'shards=3' is not key=value with a key of ['ep', 'shard']" in out.stderr
    out = _run(
        "plan", "--model", "llama-3-8b", "--writers", "fsdp:shard=2", "--readers", "vllm:tp=5"
    )
    assert out.returncode == 2
    assert "do not split evenly over tp=5" in out.stderr


def test_bench_plan_last_line():
    out = _run(
        "bench", "plan", "--model", "tiny-llama", "--readers", "vllm:tp=4,dp=32", "--repeat", "1"
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"plan_scale writers=256 readers=128 tensors=\d+ routes=\d+ seconds=\d+\.\d{3} rss_gb=\d+\.\d{2}",
        last,
    ), last


@pytest.mark.timeout(400)
def test_bench_plan_reports_bad_input_clearly():
    out = _run("bench", "plan", "--model", "tiny-llama", "--repeat", "1")
    assert out.returncode == 2
    assert "ep=128 but llama model has no experts: pass ep=1" in out.stderr


@pytest.mark.timeout(400)
def test_demo_runs_and_checks():
    out = _run("demo", "--size", "tiny", "--steps", "2", "--timeout", "120", timeout=360)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("demo ok: steps=2 bytes="), out.stdout
    assert out.stdout.strip().endswith("bit_exact=True generation_match=True")
