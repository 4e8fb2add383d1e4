"""``weightbus.bench.timeline``: a profiled sync's trace summarized per stream, with the gaps
between transfer kernels and what ran beside them."""

from __future__ import annotations

import json

import pytest

from weightbus.bench.timeline import main, summarize, write_summary


def _kernel(name, stream, start_ms, dur_ms, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": 1_000_000 + start_ms * 1000,
        "dur": dur_ms * 1000,
        "args": {"stream": stream},
    }


@pytest.fixture
def trace(tmp_path):
    nccl = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    events = [
        _kernel("_compare_kernel", 14, 0.0, 1.0),
        _kernel(nccl, 18, 1.0, 3.0),
        _kernel("_compare_kernel", 14, 3.5, 1.0),  # holds the next message back
        _kernel(nccl, 18, 4.5, 3.0),
        _kernel("Memcpy DtoD (Device -> Device)", 14, 7.0, 0.5, cat="gpu_memcpy"),
        _kernel(nccl, 18, 7.6, 2.0),  # 0.1 ms after the last: not a gap
        _kernel("_emit_kernel", 7, 11.0, 1.0),  # after 1.4 ms with nothing on the GPU
        _kernel(nccl, 18, 12.0, 1.0),
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 1_000_000, "dur": 50},
    ]
    path = tmp_path / "S7-writer-0.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_the_summary_gives_streams_transfers_gaps_and_idle_stretches(trace):
    text = summarize(trace, gap_ms=0.2)
    assert "8 GPU events over 13.00 ms" in text
    assert "stream 14: 3, 2.50 ms, 0.00, 7.50, _compare_kernel (2.00 ms)" in text
    assert "stream 18: 4, 9.00 ms, 1.00, 13.00" in text
    assert "transfer kernels: 4, 9.00 ms of 13.00 (69%), first at 1.00" in text
    assert "gaps over 0.2 ms between transfer kernels: 2, 2.90 ms" in text
    lines = text.splitlines()
    gaps = lines[lines.index(next(x for x in lines if x.startswith("gaps over"))) + 1 :]
    assert gaps[0].split() == ["2.40", "ms", "at", "9.60:", "_emit_kernel"]
    assert gaps[1].split() == ["0.50", "ms", "at", "4.00:", "_compare_kernel"]
    assert "every stream idle over 0.2 ms: 1 times, 1.40 ms" in text
    # the other work, in order, with its stream (the transfers and the host's ops left out)
    at = lines.index("other work over 0.1 ms, in order (start ms, ms, stream): 4")
    assert [x.split() for x in lines[at + 1 : at + 5]] == [
        ["0.00", "1.00", "14", "_compare_kernel"],
        ["3.50", "1.00", "14", "_compare_kernel"],
        ["7.00", "0.50", "14", "Memcpy", "DtoD", "(Device", "->", "Device)"],
        ["11.00", "1.00", "7", "_emit_kernel"],
    ]
    capped = summarize(trace, most=1, work_ms=0.6).splitlines()
    at = capped.index("other work over 0.6 ms, in order (start ms, ms, stream): the first 1 of 3")
    assert capped[at + 1].split() == ["0.00", "1.00", "14", "_compare_kernel"]
    assert capped[at + 2].startswith("transfer kernels")


def test_the_summary_is_written_beside_the_trace_and_printed(trace, capsys):
    out = write_summary(trace)
    assert out.name == "S7-writer-0.timeline.txt"
    assert out.read_text() == summarize(trace)
    assert main([str(trace), "--gap-ms", "1"]) == 0
    assert "gaps over 1.0 ms between transfer kernels: 1, 2.40 ms" in capsys.readouterr().out


def test_a_trace_without_gpu_events_or_a_missing_file_says_so(tmp_path):
    empty = tmp_path / "x.trace.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert "no GPU events" in summarize(empty)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json")])


def test_traces_of_one_sync_are_lined_up_on_their_clock(tmp_path, capsys):
    """`across` puts each participant's first GPU event, first transfer and data stream (the
    stream with the most transfer time) on the traces' shared clock, from the earliest first
    GPU event; the bench writes it per scenario, the command prints it for two traces."""
    from weightbus.bench.timeline import across, write_across

    nccl = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    writer = [
        _kernel("Memcpy HtoD (Pinned -> Device)", 7, 0.0, 0.1, cat="gpu_memcpy"),
        _kernel(nccl, 18, 0.5, 0.1),  # directories
        _kernel(nccl, 26, 2.0, 10.0),
        _kernel(nccl, 26, 12.0, 10.0),
    ]
    reader = [
        _kernel(nccl, 17, -1.0, 1.6),  # posted before the writer began: waits for it
        _kernel(nccl, 25, 3.5, 18.5),  # its first data posted 1.5 ms after the writer's
    ]
    for name, events in (("S7-writer-0", writer), ("S7-reader-0", reader)):
        (tmp_path / f"{name}.trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "S1-writer-0.trace.json").write_text(json.dumps({"traceEvents": writer}))
    text = across(sorted(tmp_path.glob("S7-*.trace.json")))
    lines = text.splitlines()
    assert lines[0] == "2 traces on one clock, ms from the earliest first GPU event:"
    assert lines[1] == (
        "  S7-reader-0.trace.json: first GPU event 0.00, first transfer 0.00, data stream 25 "
        "from 4.50 to 23.00 (18.50 ms busy)"
    )
    assert lines[2] == (
        "  S7-writer-0.trace.json: first GPU event 1.00, first transfer 1.50, data stream 26 "
        "from 3.00 to 23.00 (20.00 ms busy)"
    )
    out = write_across(tmp_path, "S7")
    assert out is not None and out.name == "S7.across.txt" and out.read_text() == text
    assert write_across(tmp_path, "S1") is None  # one trace: nothing to line up
    pair = [str(tmp_path / "S7-writer-0.trace.json"), str(tmp_path / "S7-reader-0.trace.json")]
    assert main(pair) == 0
    printed = capsys.readouterr().out
    assert "S7-writer-0.trace.json: 4 GPU events" in printed and across(pair) in printed


def test_the_host_work_before_each_sides_first_data_is_listed(tmp_path):
    """Below each side, the ranges its host named (weightbus._trace.mark) and its CUDA calls
    that began before its data stream did, on the same clock; later ones are left out."""
    from weightbus.bench.timeline import across

    nccl = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"

    def host(name, cat, start_ms, dur_ms):
        return {**_kernel(name, 0, start_ms, dur_ms, cat=cat), "args": {}}

    writer = [
        host("weightbus.holds", "user_annotation", -0.5, 0.25),
        host("weightbus.unstaged", "user_annotation", 0.0, 1.5),
        host("cudaHostAlloc", "cuda_runtime", 0.2, 0.5),
        host("cudaHostAlloc", "cuda_runtime", 0.8, 0.25),
        host("cudaLaunchKernel", "cuda_runtime", 1.0, 0.01),
        host("aten::copy_", "cpu_op", 1.0, 1.0),  # not a named range
        _kernel(nccl, 26, 2.0, 10.0),
        host("weightbus.queued", "user_annotation", 3.0, 0.1),  # after the data began
        host("cudaHostAlloc", "cuda_runtime", 3.0, 9.0),
    ]
    reader = [_kernel(nccl, 25, 1.0, 12.0)]
    for name, events in (("S7-writer-0", writer), ("S7-reader-0", reader)):
        (tmp_path / f"{name}.trace.json").write_text(json.dumps({"traceEvents": events}))
    lines = across(sorted(tmp_path.glob("S7-*.trace.json")), most=1).splitlines()
    assert lines[1].startswith("  S7-reader-0.trace.json: first GPU event 0.00")
    assert lines[2].startswith("  S7-writer-0.trace.json: first GPU event 1.00")
    assert lines[3] == "    host ranges before it, start (ms): holds -1.50 (0.25), 1 more"
    assert lines[4] == (
        "    CUDA calls before it: cudaHostAlloc 2 x 0.75 ms, cudaLaunchKernel 1 x 0.01 ms"
    )
    assert len(lines) == 5
    again = across(sorted(tmp_path.glob("S7-*.trace.json"))).splitlines()
    assert again[3] == (
        "    host ranges before it, start (ms): holds -1.50 (0.25), unstaged -1.00 (1.50)"
    )


def test_host_steps_are_timed_without_a_profiler_and_lined_up(monkeypatch):
    """With ``$WEIGHTBUS_HOST_MARKS`` set, each named step of a sync is timed on the host's
    clock (no profiler), and ``host_steps`` lines up those of several participants."""
    from weightbus import _trace
    from weightbus.bench.timeline import host_steps

    monkeypatch.setattr(_trace, "_marks", [])
    with _trace.mark("holds"):
        pass
    for _ in range(2):
        with _trace.mark("send"):
            pass
    steps = _trace.take_marks()
    assert [s[0] for s in steps] == ["holds", "send", "send"]
    assert all(end >= start for _, start, end in steps) and _trace.take_marks() == []
    monkeypatch.setattr(_trace, "_marks", None)
    with _trace.mark("holds"):
        pass
    assert _trace.take_marks() == []  # not recording: nothing kept
    text = host_steps(
        {
            "writer-0": [
                ("holds", 10.0, 10.001),
                ("send", 10.002, 10.004),
                ("send", 10.005, 10.0055),
            ],
            "reader-0": [("begin", 9.9995, 10.0005)],
        }
    )
    lines = text.splitlines()
    assert lines[1].split() == ["writer-0", "holds", "1", "0.50", "1.50", "1.00"]
    assert lines[2].split() == ["writer-0", "send", "2", "2.50", "6.00", "2.50"]
    assert lines[3].split() == ["reader-0", "begin", "1", "0.00", "1.00", "1.00"]
    assert "WEIGHTBUS_HOST_MARKS" in host_steps({})


def test_the_bench_prints_the_steps_of_the_median_and_the_slowest_sync():
    """The bench picks, from every participant's steps per timed sync, the median sync's and
    the slowest's; nothing where a participant recorded none (no WEIGHTBUS_HOST_MARKS)."""
    from weightbus.bench.gpu import host_steps_text

    def steps(t):
        return [("send", t, t + 0.001)]

    res = {
        ("writer-0", 0): {"host_steps": [steps(1.0), steps(2.0), steps(3.0)]},
        ("reader-0", 0): {"host_steps": [steps(1.0), steps(2.0), steps(3.0)]},
    }
    text = host_steps_text(res, [0.050, 0.110, 0.049])
    assert text.startswith("median timed sync (50.0 ms):\n")
    assert "slowest timed sync (110.0 ms):\n" in text
    assert text.count("writer-0") == 2 and text.count("reader-0") == 2
    assert host_steps_text({("writer-0", 0): {}}, [0.05]) == ""
    assert host_steps_text(res, []) == ""


def test_results_files_are_named_by_the_gpu_model_not_its_memory():
    from weightbus.bench import machine_kind

    assert machine_kind(2, "NVIDIA H100 80GB HBM3") == "2xh100"
    assert machine_kind(4, "NVIDIA H200") == "4xh200"
    assert machine_kind(1, "NVIDIA A100-SXM4-80GB") == "1xa100"
    assert machine_kind(1, "NVIDIA GeForce RTX 4090") == "1x4090"
    assert machine_kind(8, "NVIDIA L40S") == "8xl40s"


def test_a_second_results_file_of_the_day_does_not_overwrite_the_first(tmp_path):
    from weightbus.bench import results_path

    first = results_path(tmp_path / "r", "2026-11-28-4xh200")
    assert first == tmp_path / "r" / "2026-11-28-4xh200.json"
    first.write_text("{}")
    second = results_path(tmp_path / "r", "2026-11-28-4xh200")
    assert second.name == "2026-11-28-4xh200-2.json"
    second.with_suffix(".png").write_bytes(b"")  # a plot alone holds its name too
    assert results_path(tmp_path / "r", "2026-11-28-4xh200").name == "2026-11-28-4xh200-3.json"


def _git(cwd, *args):
    import subprocess

    env = {
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": __import__("os").environ["PATH"],
    }  # fmt: skip
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_results_name_the_tree_that_ran_even_where_git_metadata_is_older(tmp_path, monkeypatch):
    """A copy of the source whose git metadata is one commit behind its files: the results
    name the commit git knows, say the files differ, and give the files' own tree, which is
    the tree of the commit that holds them."""
    from weightbus.bench import source_identity

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("one\n")
    (repo / "sub").mkdir()
    (repo / "sub" / "b.py").write_text("two\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "first")
    old = _git(repo, "rev-parse", "HEAD")
    monkeypatch.chdir(repo / "sub")  # from anywhere in the checkout
    monkeypatch.delenv("WEIGHTBUS_COMMIT", raising=False)
    same = source_identity()
    assert same == {
        "commit": old,
        "tree": _git(repo, "rev-parse", "HEAD^{tree}"),
        "tree_differs_from_commit": False,
    }
    (repo / "a.py").write_text("one, changed\n")
    (repo / "c.py").write_text("three\n")  # a file added since
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "second")
    new_tree = _git(repo, "rev-parse", "HEAD^{tree}")
    _git(repo, "reset", "-q", "--soft", old)  # the metadata falls behind the files
    _git(repo, "reset", "-q")
    got = source_identity()
    assert got == {"commit": old, "tree": new_tree, "tree_differs_from_commit": True}
    # the checkout's index untouched
    assert _git(repo, "status", "--porcelain").splitlines() == ["M a.py", "?? c.py"]
    monkeypatch.setenv("WEIGHTBUS_COMMIT", "f" * 40)  # unknown here: git cannot tell
    assert source_identity()["tree_differs_from_commit"] is None
    monkeypatch.chdir(tmp_path)  # no checkout at all
    monkeypatch.delenv("WEIGHTBUS_COMMIT")
    assert source_identity() == {"commit": "", "tree": "", "tree_differs_from_commit": None}
