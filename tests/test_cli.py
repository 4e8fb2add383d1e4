"""The command line: `weightbus plan`, `weightbus bench plan` and `weightbus demo` as users run them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from weightbus.control import status


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightbus.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``weightbus ARGS`` in this process, for commands that stop before any work (bad
    flags, no GPUs) or only plan: what a subprocess would give, without its seconds of
    start (``weightbus bench plan`` pins its process to one core: run it with :func:`_run`)."""
    from weightbus.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def test_python_dash_m_weightbus_is_the_command():
    """``python -m weightbus`` runs the CLI (a checkout without the console script)."""
    got = subprocess.run(
        [sys.executable, "-m", "weightbus", "--help"], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr
    assert "usage: weightbus" in got.stdout and "demo" in got.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "weightbus", "nonsense"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "invalid choice: 'nonsense'" in bad.stderr


def test_plan_prints_statistics_and_json():
    out = _cli(
        "plan", "--model", "tiny-llama", "--writers", "fsdp:shard=3", "--readers", "vllm:tp=2,dp=2"
    )
    assert out.returncode == 0, out.stderr
    assert "3 writers -> 4 readers" in out.stdout and "max/mean" in out.stdout
    out = _cli(
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


def test_plan_reports_mixed_links_and_packs_them_when_asked(capfd):
    """FSDP 2 -> tensor parallel 2 of Llama-3-8B: every link carries a large row-parallel
    route strided on its writer (mixed); the report says so and how jobs over NCCL plan
    them, and --pack-mixed plans that: the same bytes in far fewer buckets."""
    from weightbus.plan.cli import main

    def plan(*args: str) -> str:
        capfd.readouterr()
        assert main(["--model", *args]) == 0
        return capfd.readouterr().out

    args = ("llama-3-8b", "--writers", "fsdp:shard=2", "--readers", "vllm:tp=2")
    text = plan(*args)
    assert "mixed links    4 of 4" in text and "--pack-mixed shows that plan" in text
    alone = json.loads(plan(*args, "--json"))
    packed = json.loads(plan(*args, "--json", "--pack-mixed"))
    assert alone["mixed_links"] == packed["mixed_links"] == 4
    assert (alone["pack_mixed"], packed["pack_mixed"]) == (False, True)
    assert packed["total_bytes"] == alone["total_bytes"]
    assert packed["buckets"] < alone["buckets"] // 4, (packed["buckets"], alone["buckets"])
    assert "mixed links" not in plan("tiny-llama", "--writers", "whole", "--readers", "vllm:tp=1")


def test_plan_reports_bad_input_clearly():
    out = _cli("plan", "--model", "tiny-llama", "--writers", "fsdp:shards=3", "--readers", "whole")
    assert out.returncode == 2
    assert "'shards=3' is not key=value with a key of ['ep', 'shard']" in out.stderr
    out = _cli(
        "plan", "--model", "llama-3-8b", "--writers", "fsdp:shard=2", "--readers", "vllm:tp=5"
    )
    assert out.returncode == 2
    assert "do not split evenly over tp=5" in out.stderr


def test_plan_refuses_simulation_flags_without_simulate():
    """A flag that only changes the prediction must not pass silently where no prediction is
    made: it names the flags and the fix."""
    base = ("plan", "--model", "tiny-llama", "--writers", "fsdp:shard=2", "--readers", "whole")
    out = _cli(*base, "--wire", "fp8", "--nic-gbits", "200")
    assert out.returncode == 2
    assert "--wire, --nic-gbits only apply with --simulate: add --simulate" in out.stderr
    out = _cli(*base, "--serial")
    assert out.returncode == 2 and "--serial only applies with --simulate" in out.stderr
    out = _cli(*base, "--simulate", "--wire", "fp8", "--nic-gbits", "200")
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

    out = _cli("bench", "gpu", "--fp8-ahead", "99")
    assert out.returncode == 2
    assert "--fp8-ahead" in out.stderr and "ahead=99 must be an int in [0, 64]" in out.stderr
    out = _cli("bench", "gpu", "--window-mb", "0")
    assert out.returncode == 2 and "window_bytes=0 must be >= 1" in out.stderr
    out = _cli("bench", "gpu", "--compare-ahead", "0")
    assert out.returncode == 2
    assert "--compare-ahead" in out.stderr and "compare_ahead=0 must be >= 1" in out.stderr
    assert gpu._scenario_codecs("S7", compare_ahead=3)["delta"].compare_ahead == 3
    out = _cli("bench", "gpu", "--windows-per-pass", "0")
    assert out.returncode == 2
    assert "--windows-per-pass" in out.stderr and "windows_per_pass=0 must be >= 1" in out.stderr
    assert gpu._scenario_codecs("S7", windows_per_pass=3)["delta"].windows_per_pass == 3
    assert gpu._scenario_codecs("S6", fp8_ahead=6)["fp8"].ahead == 6
    assert gpu._scenario_codecs("S6")["fp8"].ahead == 4  # Fp8Config's default
    out = _cli("bench", "gpu", "--fp8-bucket-mb", "-1")
    assert out.returncode == 2 and "--fp8-bucket-mb" in out.stderr
    assert "bucket_bytes=-1048576 must be 0 (SyncConfig.bucket_bytes) or" in out.stderr
    assert gpu._scenario_codecs("S6", fp8_bucket_mb=0)["fp8"].bucket_bytes == 0
    assert gpu._scenario_codecs("S6")["fp8"].bucket_bytes == 512 << 20


def test_bench_gpu_variants_are_parsed_and_checked_before_starting():
    """`--variant 'LABEL: ARGS'` runs the scenarios again with other flags and environment
    variables; every variant is checked (its flags, the codecs' rules) before the command
    looks for GPUs, naming the variant; flags of the whole run are refused in a variant."""
    import argparse

    from weightbus.bench import gpu

    def refused(*args: str) -> str:
        out = _cli("bench", "gpu", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        return out.stderr

    assert "write 'LABEL: ARGS'" in refused("--variant", "b512 --bucket-mb 512")
    err = refused("--variant", "x: --scenarios S1")
    assert "--variant 'x': --scenarios apply to the whole run" in err
    err = refused("--variant", "x: --fp8-ahead 99")
    assert "--variant 'x': --fp8-block / --fp8-ahead" in err and "ahead=99 must be" in err
    assert "unknown arguments ['--nope']" in refused("--variant", "x: --nope")
    err = refused("--variant", "old: PYTHONPATH=/tmp/old --pieces")
    assert "--variant 'old': PYTHONPATH does not reach" in err and "from inside it" in err
    assert "no flags and no NAME=VALUE" in refused("--variant", "x:")
    assert "labels must differ" in refused("--variant", "x: --iters 3", "--variant", "x: --iters 4")
    assert "unknown ['S9']" in refused("--scenarios", "S1,S9")
    assert "--rounds 0" in refused("--rounds", "0")
    # good ones pass the checks: the command gets as far as looking for GPUs
    if not torch.cuda.is_available():
        out = _cli("bench", "gpu", "--variant", "a8: WEIGHTBUS_AMAX_SMS=48 --fp8-ahead 8")
        assert out.returncode == 2 and "needs at least 2 CUDA GPUs" in out.stderr, out.stderr

    p = argparse.ArgumentParser()
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--fp8-ahead", type=int, default=None)
    for k in gpu._NOT_PER_VARIANT:
        p.add_argument(f"--{k}", default=None)
    base = p.parse_args([])
    v = gpu._parse_variant(p, base, "a8: WEIGHTBUS_AMAX_SMS=48 --fp8-ahead 8 X_Y=a=b")
    assert (v.label, v.env, v.args.fp8_ahead, v.args.bucket_mb) == (
        "a8",
        {"WEIGHTBUS_AMAX_SMS": "48", "X_Y": "a=b"},
        8,
        256,
    )
    assert base.fp8_ahead is None  # the command's own settings are untouched
    from weightbus.engines.torch_dist import environment

    with environment({"WEIGHTBUS_TEST_VARIANT": "1"}):
        assert os.environ["WEIGHTBUS_TEST_VARIANT"] == "1"
    assert "WEIGHTBUS_TEST_VARIANT" not in os.environ
    entry = {"name": "S6", "variant": "a8", "round": 2}
    assert gpu._display(entry) == "S6 [a8] (2)" and gpu._display({"name": "S1"}) == "S1"


def test_bench_gpu_runs_every_variant_and_compares_codecs_with_their_own_s1(tmp_path, monkeypatch):
    """The command's loop over rounds, variants and scenarios, with the GPU work replaced by
    a fake (times from the settings each job got): every job has a job number of its own,
    a variant's environment reaches its jobs only, and S6 is compared with the S1@nccl of
    its own variant and round."""
    from weightbus.bench import gpu

    jobs = []

    def fake_run_group(targets, timeout):
        fn, args = targets[0]
        if fn is gpu._ceiling_worker:
            keys = ("nccl_sendrecv", "ipc_pull", "d2d_copy", "h2d_pinned", "nccl_broadcast")
            return {("ceilings", 0): {k: [0.05] for k in keys}}
        a = args[3]
        amax = os.environ.get("WEIGHTBUS_AMAX_SMS")
        jobs.append((a.scenario, a.run, a.bucket_mb, amax))
        t = {"S1": 0.050, "S6": 0.030}[a.scenario] * (1 if a.bucket_mb == 256 else 0.9)
        writer = {"times": [t] * a.iters, "bytes": 16 << 30, "phases": {}, "transport": "nccl"}
        writer["sent"] = [(9 if a.scenario == "S6" else 16) << 30] * a.iters
        reader = {"times": [t] * a.iters, "bit_exact": True, "phases": {}}
        reader |= {"equal_to_quantization": True, "error_over_bound": 0.5}
        return {("writer-0", 0): writer, ("reader-0", 0): reader}

    monkeypatch.setattr(gpu, "_run_group", fake_run_group)
    monkeypatch.setattr(gpu, "_quantize_gbps", lambda iters: 1.0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(gpu, "_plot", lambda result, path: None)
    monkeypatch.delenv("WEIGHTBUS_AMAX_SMS", raising=False)
    args = ["--scenarios", "S6", "--iters", "2", "--out", str(tmp_path), "--rounds", "2"]
    args += ["--variant", "b512: --bucket-mb 512 WEIGHTBUS_AMAX_SMS=48", "--kind", "fake"]
    assert gpu.main(args) == 0
    assert "WEIGHTBUS_AMAX_SMS" not in os.environ
    assert [j[1] for j in jobs] == list(range(8))  # one job number each: no name reused
    assert [(s, b, e) for s, _, b, e in jobs] == 2 * [
        ("S1", 256, None), ("S6", 256, None), ("S1", 512, "48"), ("S6", 512, "48")
    ]  # fmt: skip
    result = json.loads((tmp_path / next(p.name for p in tmp_path.glob("*.json"))).read_text())
    got = [(s["name"], s.get("variant"), s["round"], s["median_s"]) for s in result["scenarios"]]
    assert got == [
        (name, var, rnd, round(t * (1 if var is None else 0.9), 5))
        for rnd in (1, 2)
        for var in (None, "b512")
        for name, t in (("S1@nccl", 0.05), ("S6", 0.03))
    ]
    # 27 / 45 ms: against the base's S1@nccl (50 ms) it would read 0.54
    assert [s["ratio"] for s in result["scenarios"] if s["name"] == "S6"] == [0.6] * 4
    assert result["scenarios"][2]["variant_args"] == "--bucket-mb 512 WEIGHTBUS_AMAX_SMS=48"
    assert result["rounds_summary"] == [
        {"name": name, "variant": var, "rounds_ms": [ms, ms], "median_ms": ms, "ratio": ratio}
        for var, k, s1 in ((None, 1, 1.07), ("b512", 0.9, 1.189))
        for name, ms, ratio in (("S1@nccl", round(50 * k, 2), s1), ("S6", round(30 * k, 2), 0.6))
    ]


def test_bench_rounds_summary_takes_the_median_of_each_settings_rounds():
    from weightbus.bench.gpu import rounds_summary

    def entry(name, variant, rnd, ms, ratio):
        return {
            "name": name,
            "variant": variant,
            "round": rnd,
            "median_s": ms / 1e3,
            "ratio": ratio,
        }

    runs = [
        entry("S7", None, 1, 28.1, 0.60),
        entry("S7", "p", 1, 21.9, 0.47),
        entry("S7", None, 2, 22.9, 0.49),
        entry("S7", "p", 2, 22.3, 0.48),
        entry("S7", None, 3, 24.5, 0.52),
        entry("S7", "p", 3, 22.5, 0.48),
    ]
    assert rounds_summary(runs) == [
        {"name": "S7", "variant": None, "rounds_ms": [28.1, 22.9, 24.5], "median_ms": 24.5,
         "ratio": 0.52},
        {"name": "S7", "variant": "p", "rounds_ms": [21.9, 22.3, 22.5], "median_ms": 22.3,
         "ratio": 0.48},
    ]  # fmt: skip
    # one round: nothing to summarize
    assert rounds_summary([{"name": "S7", "median_s": 0.02, "ratio": 0.4}]) == []


@pytest.mark.timeout(300)
def test_demo_with_deltas_moves_only_what_changed():
    """`weightbus demo --deltas` at an RL-like learning rate: the first sync is dense, the
    next ones carry a fraction of the bytes, and every one is bit exact."""
    got = _run(
        "demo", "--size", "tiny", "--steps", "3", "--trainers", "1", "--deltas", "--lr", "1e-6"
    )
    assert got.returncode == 0, got.stdout + got.stderr
    assert "sparse deltas" in got.stdout
    rows = [line.split("|") for line in got.stdout.splitlines() if line.strip()[:1].isdigit()]
    rows = [[c.strip() for c in r] for r in rows if len(r) == 7]
    assert [r[0] for r in rows] == ["1", "2", "3"], got.stdout
    share = [float(r[2].rstrip("%")) for r in rows]
    assert share[0] >= 99.9 and max(share[1:]) < 50, share
    assert all(r[5] == "yes" for r in rows), got.stdout
    bad = _run("demo", "--lr", "0")
    assert bad.returncode == 2 and "--lr 0.0: the learning rate must be positive" in bad.stderr


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


def test_bench_links_checks_its_flags_then_wants_two_gpus():
    out = _cli("bench", "links", "--jobs", "2x")
    assert out.returncode == 2 and "--jobs" in out.stderr and "integers" in out.stderr
    out = _cli("bench", "links", "--jobs", "0x4")
    assert out.returncode == 2 and "both at least 1" in out.stderr
    out = _cli("bench", "links", "--budgets", "-1")
    assert out.returncode == 2 and "0 (NCCL's choice) or more" in out.stderr
    import torch

    if torch.cuda.device_count() < 2:
        out = _cli("bench", "links")
        assert out.returncode == 2 and "needs 2 CUDA GPUs" in out.stderr
