"""The command line: `weightbus plan`, `weightbus bench plan` and `weightbus demo` as users run them."""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import subprocess
import sys
import time

import pytest

from weightbus.control import status


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


def test_plan_refuses_simulation_flags_without_simulate():
    """A flag that only changes the prediction must not pass silently where no prediction is
    made: it names the flags and the fix."""
    base = ("plan", "--model", "tiny-llama", "--writers", "fsdp:shard=2", "--readers", "whole")
    out = _run(*base, "--wire", "fp8", "--nic-gbits", "200")
    assert out.returncode == 2
    assert "--wire, --nic-gbits only apply with --simulate: add --simulate" in out.stderr
    out = _run(*base, "--serial")
    assert out.returncode == 2 and "--serial only applies with --simulate" in out.stderr
    out = _run(*base, "--simulate", "--wire", "fp8", "--nic-gbits", "200")
    assert out.returncode == 0, out.stderr
    assert "simulate preset=none" in out.stdout


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


def test_bench_gpu_checks_codec_flags_before_starting():
    """Codec settings the codecs refuse stop `weightbus bench gpu` at once (before it looks
    for GPUs or starts a process), naming the flag and the rule; `--fp8-ahead` reaches S6's
    Fp8Config, as do `--fp8-bucket-mb`, and `--windows-per-pass` S7's DeltaConfig."""
    from weightbus.bench import gpu

    out = _run("bench", "gpu", "--fp8-ahead", "99")
    assert out.returncode == 2
    assert "--fp8-ahead" in out.stderr and "ahead=99 must be an int in [0, 64]" in out.stderr
    out = _run("bench", "gpu", "--window-mb", "0")
    assert out.returncode == 2 and "window_bytes=0 must be >= 1" in out.stderr
    out = _run("bench", "gpu", "--windows-per-pass", "0")
    assert out.returncode == 2
    assert "--windows-per-pass" in out.stderr and "windows_per_pass=0 must be >= 1" in out.stderr
    assert gpu._scenario_codecs("S7", windows_per_pass=3)["delta"].windows_per_pass == 3
    assert gpu._scenario_codecs("S6", fp8_ahead=6)["fp8"].ahead == 6
    assert gpu._scenario_codecs("S6")["fp8"].ahead == 4  # Fp8Config's default
    out = _run("bench", "gpu", "--fp8-bucket-mb", "-1")
    assert out.returncode == 2 and "--fp8-bucket-mb" in out.stderr
    assert "bucket_bytes=-1048576 must be 0 (SyncConfig.bucket_bytes) or" in out.stderr
    assert gpu._scenario_codecs("S6", fp8_bucket_mb=0)["fp8"].bucket_bytes == 0
    assert gpu._scenario_codecs("S6")["fp8"].bucket_bytes == 512 << 20


@pytest.mark.timeout(400)
def test_demo_runs_and_checks_and_status_watches_it():
    """The demo end to end; while it runs, `weightbus status` shows its participants and a
    finished sync, read from the demo's control store."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    demo = subprocess.Popen(
        [sys.executable, "-m", "weightbus.cli", "demo", "--size", "tiny", "--steps", "30"]
        + ["--timeout", "120", "--store-port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = None
    try:
        deadline = time.monotonic() + 300
        while demo.poll() is None and time.monotonic() < deadline:
            # the status command's own entry point, in process: a new interpreter per poll
            # would take seconds on a loaded machine, longer than the demo's syncs
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                rc = status.main(["--store", f"127.0.0.1:{port}", "--job", "demo", "--json"])
            if rc == 0:
                job = json.loads(text.getvalue())["jobs"][0]
                if job["registered"] == 3 and job["last_sync"]:
                    seen = job
                    break
            time.sleep(0.5)
        out, err = demo.communicate(timeout=360)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, out + err
    assert out.strip().splitlines()[-1].startswith("demo ok: steps=30 bytes="), out
    assert out.strip().endswith("bit_exact=True generation_match=True")
    assert seen is not None, (
        "weightbus status never showed the running demo's participants and a sync"
    )
    names = sorted(p["name"] for p in seen["participants"])
    assert names == ["reader-0", "writer-0", "writer-1"], names
    assert seen["last_sync"]["bytes"] > 0 and seen["committed"] >= 1, seen
