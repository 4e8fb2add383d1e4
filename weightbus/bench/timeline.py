"""A profiled sync's GPU timeline in a few lines: what each stream ran, and where the link sat
idle between messages.

``weightbus bench gpu`` writes ``<name>.trace.json`` (a Chrome trace from the PyTorch
profiler) when ``$WEIGHTBUS_PROFILE_TRACE`` is set; :func:`summarize` reads one and
:func:`write_summary` writes ``<name>.timeline.txt`` beside it, small enough to read in a
terminal, so that a run on a remote machine need not carry the trace back:

- per GPU stream: its kernels and copies, their time, and when the first began and the last
  ended (milliseconds from the first GPU event);
- the other kernels and copies longer than ``work_ms``, in order, each with its start,
  length and stream (passes that run one after another, and what waited between them);
- the transfer kernels (NCCL's, by name) in order, with the gap before each one longer than
  ``gap_ms``, and what ran on the other streams during that gap (a compare pass that held
  the next message back shows there);
- the transfer kernels' time against the span from the first GPU event to the last;
- the stretches longer than ``gap_ms`` in which no stream ran anything (the GPU waited for
  its host).

Given the traces of several participants of one sync (one host, so one clock),
:func:`across` lines them up: per trace, when its first GPU event and its first transfer
kernel began, and when its data stream (the stream with the most transfer time) began and
ended, in milliseconds from the earliest first GPU event among them. A side whose data
stream starts late posted its first message late (a reader reading directories, a writer
analyzing its first window). Below each, what its host did before that stream began: the
ranges the writer and reader name (``weightbus.<step>``, :func:`weightbus._trace.mark`) with
their start and length, and its CUDA calls by name. ``weightbus bench gpu`` writes
``<scenario>.across.txt`` so.

Without a profiler, :func:`host_steps` lines up those named steps as
``$WEIGHTBUS_HOST_MARKS`` timed them (what ``weightbus bench gpu`` prints for the median
timed sync and the slowest).

Usage: ``python -m weightbus.bench.timeline TRACE.json [TRACE.json ...] [--gap-ms 0.2]``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

__all__ = ["across", "host_steps", "summarize", "write_across", "write_summary"]

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_TRANSFER = "nccl"
_MARK = "weightbus."  # the host ranges weightbus._trace.mark records
_CALLS = ("cuda_runtime", "cuda_driver")


def _events(trace: dict) -> list[dict]:
    """The trace's complete GPU events, oldest first."""
    out = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in _GPU_CATEGORIES and "dur" in e
    ]
    return sorted(out, key=lambda e: float(e["ts"]))


def _by_stream(events: Sequence[dict]) -> dict[object, list[dict]]:
    """``events`` per stream, each stream's in their order."""
    out: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        out[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    return out


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def summarize(
    path: str | Path, *, gap_ms: float = 0.2, most: int = 40, work_ms: float = 0.1
) -> str:
    """The timeline of the trace at ``path`` as text (see the module docstring); ``most``
    caps the gaps listed (the longest are kept) and the other work listed (the earliest
    are kept), which is the kernels and copies but the transfer kernels that took more
    than ``work_ms``."""
    trace = json.loads(Path(path).read_text())
    events = _events(trace)
    if not events:
        return f"{path}: no GPU events (was the trace taken with CUDA activity?)\n"
    t0 = float(events[0]["ts"])
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)

    def ms(us: float) -> float:
        return (us - t0) / 1000.0

    lines = [f"{Path(path).name}: {len(events)} GPU events over {ms(end):.2f} ms"]
    streams = _by_stream(events)
    lines.append("per stream: events, busy ms, first start, last end, most time in")
    for stream, evs in sorted(streams.items(), key=lambda kv: float(kv[1][0]["ts"])):
        busy = sum(float(e["dur"]) for e in evs) / 1000.0
        by_name: dict[str, float] = defaultdict(float)
        for e in evs:
            by_name[e["name"]] += float(e["dur"])
        top = max(by_name, key=lambda n: by_name[n])
        last = max(float(e["ts"]) + float(e["dur"]) for e in evs)
        lines.append(
            f"  stream {stream}: {len(evs)}, {busy:.2f} ms, {ms(float(evs[0]['ts'])):.2f}, "
            f"{ms(last):.2f}, {_short(top)} ({by_name[top] / 1000.0:.2f} ms)"
        )
    idle, stretches, busy_to = 0.0, 0, float(events[0]["ts"])
    for e in events:
        start = float(e["ts"])
        if (start - busy_to) / 1000.0 > gap_ms:
            idle += (start - busy_to) / 1000.0
            stretches += 1
        busy_to = max(busy_to, start + float(e["dur"]))
    lines.append(f"every stream idle over {gap_ms} ms: {stretches} times, {idle:.2f} ms")
    # the other work in order: passes that run one after another show here, each with the
    # stream it ran on and what waited between them
    work = [
        e for e in events if _TRANSFER not in e["name"].lower() and float(e["dur"]) > work_ms * 1000
    ]
    shown = f"the first {most} of {len(work)}" if len(work) > most else f"{len(work)}"
    lines.append(f"other work over {work_ms} ms, in order (start ms, ms, stream): {shown}")
    for e in work[:most]:
        stream = e.get("args", {}).get("stream", e.get("tid"))
        lines.append(
            f"  {ms(float(e['ts'])):8.2f} {float(e['dur']) / 1000.0:6.2f}  {stream}  "
            f"{_short(e['name'])}"
        )
    transfers = [e for e in events if _TRANSFER in e["name"].lower()]
    if not transfers:
        lines.append("no transfer kernels")
        return "\n".join(lines) + "\n"
    moving = sum(float(e["dur"]) for e in transfers) / 1000.0
    share = 100.0 * moving / max(ms(end), 1e-9)
    lines.append(
        f"transfer kernels: {len(transfers)}, {moving:.2f} ms of {ms(end):.2f} ({share:.0f}%), "
        f"first at {ms(float(transfers[0]['ts'])):.2f}"
    )
    gaps = []
    for prev, nxt in zip(transfers, transfers[1:], strict=False):
        a = float(prev["ts"]) + float(prev["dur"])
        b = float(nxt["ts"])
        if (b - a) / 1000.0 > gap_ms:
            beside = sorted(
                {
                    _short(e["name"], 32)
                    for e in events
                    if e not in (prev, nxt)
                    and _TRANSFER not in e["name"].lower()
                    and float(e["ts"]) < b
                    and float(e["ts"]) + float(e["dur"]) > a
                }
            )
            gaps.append(((b - a) / 1000.0, ms(a), beside))
    idle = sum(g for g, _, _ in gaps)
    lines.append(f"gaps over {gap_ms} ms between transfer kernels: {len(gaps)}, {idle:.2f} ms")
    for g, at, beside in sorted(gaps, reverse=True)[:most]:
        lines.append(f"  {g:6.2f} ms at {at:8.2f}: {', '.join(beside) if beside else 'nothing'}")
    return "\n".join(lines) + "\n"


def write_summary(trace: str | Path, **kwargs) -> Path:
    """Write :func:`summarize`'s text beside ``trace`` as ``<name>.timeline.txt``."""
    trace = Path(trace)
    stem = trace.name.removesuffix(".json").removesuffix(".trace")
    out = trace.with_name(f"{stem}.timeline.txt")
    out.write_text(summarize(trace, **kwargs))
    return out


def _host(trace: dict, t0: float, until: float, most: int) -> list[str]:
    """The host's named ranges and CUDA calls that began before ``until`` (the trace's
    clock, microseconds), in milliseconds from ``t0``: at most ``most`` ranges, oldest first."""
    host = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and "dur" in e and float(e["ts"]) < until
    ]
    marks = sorted(
        (e for e in host if e.get("cat") == "user_annotation" and e["name"].startswith(_MARK)),
        key=lambda e: float(e["ts"]),
    )
    lines = []
    if marks:
        shown = [
            f"{e['name'][len(_MARK) :]} {(float(e['ts']) - t0) / 1000.0:.2f} "
            f"({float(e['dur']) / 1000.0:.2f})"
            for e in marks[:most]
        ]
        more = f", {len(marks) - most} more" if len(marks) > most else ""
        lines.append(f"    host ranges before it, start (ms): {', '.join(shown)}{more}")
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in host:
        if e.get("cat") in _CALLS:
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += float(e["dur"])
    if calls:
        top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]
        text = ", ".join(f"{name} {int(n)} x {us / 1000.0:.2f} ms" for name, (n, us) in top)
        lines.append(f"    CUDA calls before it: {text}")
    return lines


def across(paths: Sequence[str | Path], *, most: int = 30) -> str:
    """The traces at ``paths`` (participants of one sync on one host) lined up on their
    common clock: see the module docstring; ``most``: named host ranges listed per trace."""
    rows, traces = [], []
    for path in paths:
        trace = json.loads(Path(path).read_text())
        events = _events(trace)
        transfers = [e for e in events if _TRANSFER in e["name"].lower()]
        by_stream = _by_stream(transfers)
        data = None
        if by_stream:
            stream, evs = max(by_stream.items(), key=lambda kv: sum(float(e["dur"]) for e in kv[1]))
            data = (
                stream,
                float(evs[0]["ts"]),
                max(float(e["ts"]) + float(e["dur"]) for e in evs),
                sum(float(e["dur"]) for e in evs),
            )
        first = float(events[0]["ts"]) if events else None
        rows.append(
            (Path(path).name, first, float(transfers[0]["ts"]) if transfers else None, data)
        )
        traces.append(trace)
    firsts = [r[1] for r in rows if r[1] is not None]
    if not firsts:
        return f"{len(rows)} traces: no GPU events\n"
    t0 = min(firsts)
    lines = [f"{len(rows)} traces on one clock, ms from the earliest first GPU event:"]
    for (name, first, transfer, data), trace in zip(rows, traces, strict=True):
        if first is None:
            lines.append(f"  {name}: no GPU events")
            continue
        text = f"  {name}: first GPU event {(first - t0) / 1000.0:.2f}"
        if transfer is not None:
            text += f", first transfer {(transfer - t0) / 1000.0:.2f}"
        if data is not None:
            stream, start, end, busy = data
            text += (
                f", data stream {stream} from {(start - t0) / 1000.0:.2f} to "
                f"{(end - t0) / 1000.0:.2f} ({busy / 1000.0:.2f} ms busy)"
            )
        lines.append(text)
        if data is not None:
            lines += _host(trace, t0, data[1], most)
    return "\n".join(lines) + "\n"


def host_steps(marks: dict[str, Sequence[tuple[str, float, float]]]) -> str:
    """The host steps of one sync per participant (``marks``: name -> (step, start, end) in
    seconds on one clock, as :func:`weightbus._trace.take_marks` gives them, with
    ``$WEIGHTBUS_HOST_MARKS`` set), lined up without a profiler: per participant and step,
    how many times it ran, when the first began and the last ended, and its time in all, in
    milliseconds from the earliest step of them all."""
    starts = [start for steps in marks.values() for _, start, _ in steps]
    if not starts:
        return "no host steps recorded (set WEIGHTBUS_HOST_MARKS=1)\n"
    t0 = min(starts)
    lines = ["host steps of one sync, ms from the earliest: times, first start, last end, total"]
    for who, steps in marks.items():
        rows: dict[str, list[float]] = {}
        for name, start, end in steps:
            row = rows.setdefault(name, [0, start, end, 0.0])
            row[0] += 1
            row[1], row[2] = min(row[1], start), max(row[2], end)
            row[3] += end - start
        for name, (n, first, last, total) in sorted(rows.items(), key=lambda kv: kv[1][1]):
            lines.append(
                f"  {who:10s} {name:18s} {int(n):4d} {(first - t0) * 1e3:8.2f} "
                f"{(last - t0) * 1e3:8.2f} {total * 1e3:8.2f}"
            )
    return "\n".join(lines) + "\n"


def write_across(directory: str | Path, scenario: str) -> Path | None:
    """Write :func:`across` of ``directory``'s ``<scenario>-*.trace.json`` (two or more) as
    ``<scenario>.across.txt``; None when there are fewer."""
    directory = Path(directory)
    paths = sorted(directory.glob(f"{scenario}-*.trace.json"))
    if len(paths) < 2:
        return None
    out = directory / f"{scenario}.across.txt"
    out.write_text(across(paths))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightbus.bench.timeline", description=__doc__)
    p.add_argument(
        "trace",
        nargs="+",
        help="Chrome traces (.json) from the PyTorch profiler; with two or "
        "more, also their first messages lined up (one host's traces)",
    )
    p.add_argument("--gap-ms", type=float, default=0.2, help="gaps listed above this (ms)")
    p.add_argument(
        "--most", type=int, default=40, help="at most this many gaps, and other work, listed"
    )
    p.add_argument(
        "--work-ms", type=float, default=0.1, help="other work (not transfers) listed above this"
    )
    a = p.parse_args(argv)
    for trace in a.trace:
        if not Path(trace).is_file():
            p.error(f"{trace}: no such file")
    for trace in a.trace:
        print(summarize(trace, gap_ms=a.gap_ms, most=a.most, work_ms=a.work_ms), end="")
    if len(a.trace) > 1:
        print(across(a.trace), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
