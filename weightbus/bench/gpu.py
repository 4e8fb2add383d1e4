"""``weightbus bench gpu``: syncs between GPUs of one host, beside the hardware's ceilings.

    weightbus bench gpu                       # every scenario the GPUs allow, Llama-3-8B shapes
    weightbus bench gpu --scenarios S1 --model tiny-llama --iters 3

Ceilings are measured in the same run (raw NCCL send/recv and broadcast of the same bytes,
copy-engine peer copy, same-GPU device copy, pinned host-to-device). Each scenario runs the
real Writer/Reader in one process per participant: 2 warm-up syncs, then ``--iters`` timed
syncs (median, min, max), each after a barrier; then one more sync into poisoned (NaN) reader
tensors, checked bit for bit. Results go to ``bench/results/<date>-<kind>.json`` with a plot.

Scenarios (names from the project's bench guide):
  S1  1 writer GPU -> 1 reader GPU (whole model; reader holds vLLM-style fused parameters)
  S2  1 writer GPU -> 3 reader GPUs, each gets the full model
  S4  FSDP2 on 2 GPUs -> tensor parallel 2 on 2 other GPUs
  S3  colocated: writer and reader processes on one GPU (CUDA IPC)
  S5  pinned host memory over the GPUs -> every GPU, beside checkpoint-engine (``s5.py``)
  S4e S4 between real engines: FSDP2 trainer -> transformers tensor parallel (``engines.py``)
  S6  S1 with FP8 block quantization on the wire (reader holds FP8 engine tensors and scales)
  S7  S1 with sparse deltas, ``--changed`` (default 1%) of the elements changed before each sync

``--scenarios S1@cuda_ipc,S1@nccl`` runs a scenario over a given transport; without ``@`` the
transport is chosen automatically (CUDA IPC between GPUs of one host). Codecs need a transport
whose writers encode (not CUDA IPC's pulls): S6 and S7 run over NCCL, and their ratio is their
time over S1's over NCCL in the same run (S1@nccl is run first when not asked for). S6 also
reports the Triton FP8 quantize throughput (GB/s of bf16 input), and checks the reader's bytes
against the quantization computed on the writer's GPU and the FP8 error bound.

``--variant 'b512: --bucket-mb 512 WEIGHTBUS_AMAX_SMS=96'`` runs the scenarios again with
other flags and environment variables, in the same run (S6 and S7 compared with the S1@nccl of
their own variant); ``--rounds N`` alternates the settings and the variants N times, and
ends with each setting's median over its rounds (:func:`rounds_summary`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import queue
import re
import shlex
import socket
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path

from weightbus.bench import machine_kind, results_path, source_identity

SCENARIOS = {
    # name: (writer description, reader description, GPUs, target, what the target compares)
    "S1": (
        "whole",
        "vllm:tp=1",
        2,
        1 / 1.10,
        "GB/s over the faster of raw NCCL send/recv and peer copy",
    ),
    "S2": ("whole", "vllm:tp=1,dp=3", 4, 1 / 1.15, "raw NCCL broadcast time over sync time"),
    "S4": ("fsdp:shard=2", "vllm:tp=2", 4, 0.85, "aggregate GB/s over two raw send/recv links"),
    "S3": ("whole", "vllm:tp=1", 1, 0.75, "GB/s over same-GPU device-to-device copy"),
    "S6": ("whole", "vllm:tp=1", 2, 0.6, "sync time over S1's over nccl (lower is better)"),
    "S7": ("whole", "vllm:tp=1", 2, 0.10, "sync time over S1's dense over nccl (lower is better)"),
}
COLOCATED = {"S3"}  # writer and reader processes on the same GPU
CODECS = {"S6", "S7"}  # run over nccl, compared with S1@nccl


CEILING_NOTES = {
    "nccl_sendrecv": "one message of the model's bytes, GPU 0 -> GPU 1, batched isend/irecv",
    "nccl_two_links": "GPU 0 -> 2 and GPU 1 -> 3 at once; bytes of both links over the time",
    "nccl_broadcast": "GPU 0 -> all, the model's bytes",
    "ipc_pull": "copy-engine peer copy GPU 0 -> GPU 1 within one process (the engine CUDA IPC pulls use)",
    "d2d_copy": "same-GPU copy, bytes copied per second",
    "h2d_pinned": "pinned host -> GPU 0, 4 GiB, scaled",
}


def _median(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


# ---------------------------------------------------------------------------------------------
# ceilings
# ---------------------------------------------------------------------------------------------


def _time_cuda(fn, iters: int, warmup: int = 2) -> list[float]:
    import torch

    out = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def _ceiling_worker(rank: int, world: int, port: int, nbytes: int, iters: int, q) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        store = dist.PrefixStore("ceilings", dist.TCPStore("127.0.0.1", port, is_master=False))
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank)
        )
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        res = {}

        def sendrecv(pairs):
            def run():
                ops = []
                for a, b in pairs:
                    if rank == a:
                        ops.append(dist.P2POp(dist.isend, buf, b))
                    elif rank == b:
                        ops.append(dist.P2POp(dist.irecv, buf, a))
                if ops:
                    for w in dist.batch_isend_irecv(ops):
                        w.wait()

            return run

        times = _time_cuda(sendrecv([(0, 1)]), iters)
        dist.barrier()
        res["nccl_sendrecv"] = times
        if world >= 4:
            dist.barrier()
            res["nccl_two_links"] = _time_cuda(sendrecv([(0, 2), (1, 3)]), iters)
            dist.barrier()
            res["nccl_broadcast"] = _time_cuda(lambda: dist.broadcast(buf, 0), iters)
        dist.barrier()
        if rank == 0:
            other = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
            res["ipc_pull"] = _time_cuda(lambda: other.copy_(buf, non_blocking=True), iters)
            del other
            half = nbytes // 2
            a, b = buf[:half], torch.empty(half, dtype=torch.uint8, device="cuda")
            res["d2d_copy"] = [
                t * 2 for t in _time_cuda(lambda: b.copy_(a), iters)
            ]  # per full size
            host = torch.empty(min(nbytes, 4 << 30), dtype=torch.uint8, pin_memory=True)
            dev = buf[: len(host)]
            res["h2d_pinned"] = [
                t * nbytes / len(host)
                for t in _time_cuda(lambda: dev.copy_(host, non_blocking=True), iters)
            ]
        dist.barrier()
        dist.destroy_process_group()
        q.put(("ceilings", rank, "ok", res))
    except BaseException as exc:
        q.put(("ceilings", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# ---------------------------------------------------------------------------------------------
# scenarios
# ---------------------------------------------------------------------------------------------


def _canonical(model, device) -> dict:
    import torch

    out = {}
    for t in model.tensors:
        g = torch.Generator(device=device).manual_seed(zlib.crc32(t.name.encode()))
        out[t.name] = torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(
            torch.bfloat16
        )
    return out


def _participant_worker(role: str, rank: int, gpu: int, args, q) -> None:
    import faulthandler

    faulthandler.enable()  # a crash in native code still leaves a Python stack in the log
    hang_dump = float(os.environ.get("WEIGHTBUS_HANG_DUMP_S", "0"))
    if hang_dump > 0:  # print every thread's stack if this process is still here by then
        faulthandler.dump_traceback_later(hang_dump, exit=False)
    try:
        import torch

        from weightbus import BoundLayout, Participant, Reader, Writer
        from weightbus._trace import take_marks
        from weightbus.layouts.describe import build_layouts
        from weightbus.layouts.families import model_spec
        from weightbus.plan import allocate, fill_from_canonical, poison

        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        wdesc, rdesc, *_ = SCENARIOS[args.scenario]
        transport = args.scenario_transport or args.transport
        codecs = _scenario_codecs(args.scenario, **_codec_flags(args))
        if codecs and not args.scenario_transport:
            transport = "nccl"
        model = model_spec(args.model, dtype="bfloat16")
        layout = build_layouts(model, wdesc if role == "writer" else rdesc, role)[rank]
        me = Participant(role=role, rank=rank, host=socket.gethostname(), device=str(device))
        layout = dataclasses.replace(layout, participant=me, _memo={})
        if role == "reader" and "fp8" in codecs:
            from weightbus.codecs import quantized_layout

            layout = quantized_layout(layout, codecs["fp8"])  # FP8 engine tensors and scales
        tensors = allocate(layout, device=device)
        canon = _canonical(model, device)
        if role == "writer":
            fill_from_canonical(layout, canon, tensors)
            if args.scenario != "S7":
                del canon
        torch.cuda.synchronize()
        extra = {} if args.direct_mb is None else {"direct_bytes": args.direct_mb << 20}
        control, sync = bench_configs(
            args,
            f"bench-{args.scenario}-{args.scenario_transport or 'auto'}-{args.run}",
            args.n_writers,
            args.n_readers,
            **extra,
            staging_buffers=args.staging,
            transport=transport,
            **codecs,
        )
        bound = BoundLayout(layout=layout, tensors=tensors)
        side = Writer(bound, control, sync) if role == "writer" else Reader(bound, control, sync)
        plan = side.connect()
        cp = side.control
        times, bit_exact, sent, extra = [], None, [], {}
        total = args.warmup + args.iters + 1
        for i in range(total):
            last = i == total - 1
            if args.scenario == "S7":
                if role == "reader" and last:
                    # the deltas so far must have left every byte right; then one dense sync
                    # into poisoned tensors
                    extra["exact_before_dense"] = _exact(layout, tensors, canon, device)
                    side.request_dense()
                # change a fraction of the elements before each sync (the reader replays the
                # changes to know what it must hold)
                _change(canon, i + 1, args.changed)
                if role == "writer":
                    fill_from_canonical(layout, canon, tensors)
                torch.cuda.synchronize()
            if role == "reader" and last:
                for t in tensors.values():
                    poison(t)
                torch.cuda.synchronize()
            # a profiled sync's profilers start before the barrier, so that their start-up
            # does not delay one participant's sync
            with profiled(f"{args.scenario}-{role}-{rank}", i, args.warmup):
                cp.post(f"bench-ready/{i}", {})
                cp.gather(f"bench-ready/{i}")
                if role == "writer":
                    result = side.sync(i + 1)
                else:
                    result = side.wait()
            steps = take_marks()  # (WEIGHTBUS_HOST_MARKS: this sync's host steps)
            if args.warmup <= i < total - 1:
                times.append(result.seconds)
                sent.append(result.bytes)
                if steps:
                    extra.setdefault("host_steps", []).append(steps)  # per timed sync
        if role == "reader" and "fp8" in codecs:
            extra.update(_fp8_check(layout, tensors, canon, codecs["fp8"]))
            bit_exact = extra["equal_to_quantization"] and extra["error_over_bound"] <= 1.0
        elif role == "reader":
            bit_exact = _exact(layout, tensors, canon, device)
            if "exact_before_dense" in extra:
                bit_exact = bit_exact and extra["exact_before_dense"]
        side.close()
        q.put(
            (
                f"{role}-{rank}",
                rank,
                "ok",
                {
                    "times": times,
                    "bit_exact": bit_exact,
                    "bytes": plan.stats.total_bytes,
                    "phases": result.phases,
                    "transport": side.transport.name if side.transport else "?",
                    "sent": sent,
                    **extra,
                },
            )
        )
    except BaseException as exc:
        q.put(
            (
                f"{role}-{rank}",
                rank,
                "error",
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
            )
        )


def host_steps_text(res: dict, times: list[float]) -> str:
    """With ``$WEIGHTBUS_HOST_MARKS`` set: the host steps (:func:`weightbus.bench.timeline.
    host_steps`) of the median timed sync and of the slowest (``times``: each timed sync's
    seconds), from every participant's results in ``res`` (keyed by (name, rank)); empty
    where some participant recorded none for some timed sync."""
    if not times or any(len(got.get("host_steps", ())) != len(times) for got in res.values()):
        return ""
    from weightbus.bench.timeline import host_steps

    order = sorted(range(len(times)), key=lambda i: times[i])
    out = []
    for what, i in (("median", order[len(order) // 2]), ("slowest", order[-1])):
        out.append(f"{what} timed sync ({times[i] * 1e3:.1f} ms):\n")
        out.append(host_steps({name: got["host_steps"][i] for (name, _), got in res.items()}))
    return "".join(out)


def profiled(name: str, i: int, warmup: int):
    """A profiler around sync ``i`` when ``$WEIGHTBUS_PROFILE_DIR`` is set and ``i`` is the first
    timed sync: writes ``<name>.txt`` there (the ops by CPU time and by CUDA time); otherwise a
    no-op; with ``$WEIGHTBUS_PROFILE_TRACE`` set also ``<name>.trace.json``, the timeline, and
    ``<name>.timeline.txt``, its summary (:mod:`weightbus.bench.timeline`), and
    with ``$WEIGHTBUS_PROFILE_STACK`` set the Python calls in it too (slower: every call is
    recorded). For finding where a scenario's time goes, not for its figures."""

    where = os.environ.get("WEIGHTBUS_PROFILE_DIR")
    if not where or i != warmup:
        return contextlib.nullcontext()
    return _Profile(Path(where) / f"{name}.txt")


class _Profile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        stack = bool(os.environ.get("WEIGHTBUS_PROFILE_STACK"))
        self.prof = torch.profiler.profile(activities=acts, with_stack=stack)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.synchronize()
        self.prof.__exit__(*exc)
        avg = self.prof.key_averages()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if os.environ.get("WEIGHTBUS_PROFILE_TRACE"):  # the timeline too, for chrome://tracing
            trace = self.path.with_suffix(".trace.json")
            self.prof.export_chrome_trace(str(trace))
            from weightbus.bench.timeline import write_summary

            write_summary(trace)  # <name>.timeline.txt: per stream, and the link's idle gaps
        with open(self.path, "w") as f:
            f.write(
                avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
            )
            f.write("\n")
            f.write(
                avg.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
            )
        return False


def _scenario_codecs(
    scenario: str,
    *,
    fp8_block: int = 128,
    fp8_ahead: int | None = None,
    fp8_bucket_mb: int | None = None,
    window_mb: int | None = None,
    windows_per_pass: int | None = None,
    compare_ahead: int | None = None,
    pieces: bool | None = None,
    announce: bool | None = None,
    masks: bool | None = None,
) -> dict:
    """SyncConfig codec fields of a scenario: S6 FP8 (``fp8_ahead`` buckets per reader sent
    ahead of the check, buckets of at least ``fp8_bucket_mb`` MiB, 0 meaning ``--bucket-mb``;
    defaults Fp8Config's), S7 deltas (checksums only on request; windows of ``window_mb``
    MiB, ``windows_per_pass`` of them compared at once, ``compare_ahead`` passes compared
    ahead, defaults DeltaConfig's; ``pieces``:
    groups of plain buckets as pieces, :attr:`DeltaConfig.pieces`, ``announce``,
    :attr:`DeltaConfig.announce`, and ``masks``, :attr:`DeltaConfig.masks`; None: their
    defaults)."""
    from weightbus.codecs import DeltaConfig, Fp8Config

    if scenario == "S6":
        ahead = {} if fp8_ahead is None else {"ahead": fp8_ahead}
        if fp8_bucket_mb is not None:
            ahead["bucket_bytes"] = fp8_bucket_mb << 20
        return {"fp8": Fp8Config(block=fp8_block, **ahead)}
    if scenario == "S7":
        window = {} if window_mb is None else {"window_bytes": window_mb << 20}
        if windows_per_pass is not None:
            window["windows_per_pass"] = windows_per_pass
        if compare_ahead is not None:
            window["compare_ahead"] = compare_ahead
        if pieces is not None:
            window["pieces"] = pieces
        if announce is not None:
            window["announce"] = announce
        if masks is not None:
            window["masks"] = masks
        return {"delta": DeltaConfig(checksum_every=0, **window)}
    return {}


def _codec_flags(a) -> dict:
    """The codec flags of ``weightbus bench gpu``'s arguments ``a``, as
    :func:`_scenario_codecs` takes them."""
    return {
        "fp8_block": a.fp8_block,
        "fp8_ahead": a.fp8_ahead,
        "fp8_bucket_mb": a.fp8_bucket_mb,
        "window_mb": a.window_mb,
        "windows_per_pass": a.windows_per_pass,
        "compare_ahead": a.compare_ahead,
        "pieces": a.pieces,
        "announce": a.announce,
        "masks": a.masks,
    }


def _fp8_fraction(model, block: int) -> float:
    """The quantized tensors' bytes on the wire (e4m3 values and fp32 scales) over their bf16
    bytes: what FP8 does to the tensors it applies to (the ignore list's stay bf16)."""
    from weightbus.codecs import Fp8Config
    from weightbus.codecs.fp8 import scale_shape

    config = Fp8Config(block=block)
    fp8 = bf16 = 0
    for t in model.tensors:
        if config.quantizes(t):
            n = math.prod(t.shape)
            fp8 += n + 4 * math.prod(scale_shape(t.shape, block))
            bf16 += 2 * n
    return fp8 / bf16 if bf16 else float("nan")


def _change(canon: dict, step: int, fraction: float) -> None:
    """Change about ``fraction`` of every tensor's elements (at least one, none at 0), the
    same on every process. An index drawn twice gets the same new value (computed from the
    old one), so the result does not depend on which write lands last."""
    import torch

    if not fraction:
        return
    for name, x in canon.items():
        flat = x.view(-1)
        n = max(1, int(fraction * flat.numel()))
        g = torch.Generator(device=x.device).manual_seed(zlib.crc32(name.encode()) + 7919 * step)
        idx = torch.randint(flat.numel(), (n,), generator=g, device=x.device)
        flat[idx] = (flat[idx].float() * -0.5 + 1e-3).to(flat.dtype)


def _exact(layout, tensors: dict, canon: dict, device) -> bool:
    """Whether the reader's tensors hold ``canon`` bit for bit."""
    import torch

    from weightbus.plan import allocate, fill_from_canonical

    want = allocate(layout, device=device)
    fill_from_canonical(layout, canon, want)
    return all(torch.equal(tensors[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def _fp8_check(layout, tensors: dict, canon: dict, cfg) -> dict:
    """S6's reader check: FP8 values and scales equal to quantizing the canonical tensors on
    this GPU (the kernel the codec tests hold to the reference), the rest bit exact, and the
    largest dequantization error over the FP8 bound (e4m3 rounding: ``|x| * (2**-4 + 2**-20)
    + s * 2**-10``; at most 1)."""
    import torch

    from weightbus.codecs.fp8 import quantize_blocks, scale_name

    quantized = {t.name for t in layout.tensors if t.dtype == "float8_e4m3fn"}
    ref = {n: quantize_blocks(canon[n], cfg) for n in quantized}
    scales = {scale_name(n): n for n in quantized}
    equal, worst = True, 0.0
    for p in layout.iter_pieces():
        have = tensors[p.key][p.local_box.slices()]
        if p.tensor in quantized:
            q, s = ref[p.tensor]
            box = p.box.slices()
            equal &= torch.equal(
                have.view(torch.uint8), q[box].reshape(have.shape).view(torch.uint8)
            )
            rows = torch.arange(p.box.start[-2], p.box.stop[-2], device=s.device) // cfg.block
            cols = torch.arange(p.box.start[-1], p.box.stop[-1], device=s.device) // cfg.block
            s_full = s[rows][:, cols]
            x = canon[p.tensor][box].float()
            err = (x - have.reshape(x.shape).float() * s_full).abs()
            bound = x.abs() * (2.0**-4 + 2.0**-20) + s_full * 2.0**-10
            worst = max(worst, float((err / bound).max()))
        elif p.tensor in scales:
            s = ref[scales[p.tensor]][1][p.box.slices()]
            equal &= torch.equal(have, s.reshape(have.shape))
        else:
            want = canon[p.tensor][p.box.slices()].reshape(have.shape)
            equal &= torch.equal(have.view(torch.uint8), want.view(torch.uint8))
    return {"equal_to_quantization": bool(equal), "error_over_bound": round(worst, 4)}


def _quantize_gbps(iters: int) -> float:
    """Triton FP8 block quantization of a 1 GiB bf16 tensor on GPU 0, GB/s of bf16 input."""
    import torch

    from weightbus.codecs.fp8 import Fp8Config, quantize_blocks

    x = torch.randn(16384, 32768, device="cuda:0").to(torch.bfloat16)
    cfg = Fp8Config()
    with torch.cuda.device(0):
        seconds = statistics.median(
            _time_cuda(lambda: quantize_blocks(x, cfg, impl="triton"), iters)
        )
    nbytes = x.numel() * x.element_size()
    x = None  # give GPU 0's memory back to the scenarios' processes
    torch.cuda.empty_cache()
    return nbytes / seconds / 1e9


def _run_group(targets: list[tuple], timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*a, q)) for fn, a in targets]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                name, rank, status, payload = q.get(timeout=1.0)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if status != "ok":
                raise RuntimeError(f"{name}/{rank} failed: {payload}")
            results[(name, rank)] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if len(results) < len(procs):
        raise RuntimeError(
            f"only {len(results)} of {len(procs)} processes reported within {timeout} s"
        )
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    sc = result["scenarios"]
    names = [_display(s) for s in sc]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(names))
    ax.bar(
        [i - 0.2 for i in x],
        [s["ceiling_gbps"] for s in sc],
        width=0.4,
        label="ceiling",
        color="#bbbbbb",
    )
    ax.bar(
        [i + 0.2 for i in x], [s["gbps"] for s in sc], width=0.4, label="weightbus", color="#3366cc"
    )
    for i, s in enumerate(sc):
        ax.text(i + 0.2, s["gbps"], f"{s['ratio']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("GB/s")
    ax.set_title(f"weightbus sync vs ceiling, {result['machine']} ({result['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_configs(args, job: str, writers: int, readers: int, **sync):
    """A bench job's control and sync configs, the same on every participant: ``args`` gives
    the port, bucket size, transport and the :func:`add_sync_flags`; ``sync`` adds or
    overrides SyncConfig fields."""
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=writers,
        num_readers=readers,
        address=f"127.0.0.1:{args.port}",
        host_store=False,
        job=job,
        timeout=dt.timedelta(seconds=300),
    )
    fields = dict(
        bucket_bytes=args.bucket_mb << 20,
        transport=args.transport,
        sync_timeout=dt.timedelta(seconds=120),
        verify=getattr(args, "verify", "off"),
        apply=getattr(args, "apply", "in_place"),
        step_timeout=dt.timedelta(seconds=300),
    )
    return control, SyncConfig(**(fields | sync))


def add_sync_flags(p: argparse.ArgumentParser) -> None:
    """The bench's ``--verify`` and ``--apply`` (SyncConfig fields every scenario uses)."""
    p.add_argument(
        "--verify",
        default="off",
        choices=["off", "checksum", "full"],
        help="SyncConfig.verify for every sync (default off: the figures are the data path's)",
    )
    p.add_argument(
        "--apply",
        default="in_place",
        choices=["in_place", "transactional", "auto"],
        help="SyncConfig.apply on the readers (default in_place)",
    )


@dataclasses.dataclass(frozen=True)
class _Variant:
    """Settings the scenarios run with: the command's (``label`` empty) or a ``--variant``'s."""

    label: str
    env: dict[str, str]
    args: argparse.Namespace
    text: str


_ENV_TOKEN = re.compile(r"^[A-Z][A-Z0-9_]*=")
_NOT_PER_VARIANT = ("scenarios", "model", "out", "kind", "variant", "rounds")


def _parse_variant(p: argparse.ArgumentParser, a: argparse.Namespace, text: str) -> _Variant:
    """``'LABEL: ARGS'`` -> a variant: ``NAME=VALUE`` words are environment variables (the
    participants' processes start with them), the others this command's flags, over ``a``."""
    label, sep, rest = text.partition(":")
    label = label.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
        p.error(
            f"--variant {text!r}: write 'LABEL: ARGS' with a label of letters, digits and "
            "'_.+-', e.g. 'b512: --bucket-mb 512'"
        )
    words = shlex.split(rest)
    env = dict(w.split("=", 1) for w in words if _ENV_TOKEN.match(w))
    flags = [w for w in words if not _ENV_TOKEN.match(w)]
    args, unknown = p.parse_known_args(flags, namespace=copy.copy(a))
    if unknown:
        p.error(f"--variant {label!r}: unknown arguments {unknown}")
    fixed = [k for k in _NOT_PER_VARIANT if getattr(args, k) != getattr(a, k)]
    if fixed:
        p.error(
            f"--variant {label!r}: {', '.join('--' + k for k in fixed)} apply to the whole run, "
            "not to one variant"
        )
    if not env and not flags:
        p.error(f"--variant {label!r}: no flags and no NAME=VALUE settings")
    if "PYTHONPATH" in env:
        # spawned processes take this process's sys.path, whatever their environment says
        p.error(
            f"--variant {label!r}: PYTHONPATH does not reach the participants' imports (they "
            "start with this process's sys.path); to time another tree, start the bench "
            "from inside it (cd TREE && python -m weightbus bench gpu ...)"
        )
    return _Variant(label, env, args, rest.strip())


def _check_settings(p: argparse.ArgumentParser, var: _Variant) -> None:
    """Refuse settings the codecs or the bench refuse, before any process starts."""
    where = f"--variant {var.label!r}: " if var.label else ""
    a = var.args
    if not 0.0 <= a.changed <= 1.0:
        p.error(f"{where}--changed {a.changed}: a fraction of the elements, in [0, 1]")
    for flags, scenario in (
        ("--fp8-block / --fp8-ahead / --fp8-bucket-mb", "S6"),
        ("--window-mb / --windows-per-pass / --compare-ahead", "S7"),
    ):
        try:
            _scenario_codecs(scenario, **_codec_flags(a))
        except ValueError as exc:
            p.error(f"{where}{flags}: {exc}")


def _display(entry: dict) -> str:
    """A results entry's name with its variant and round, for tables and plots."""
    name = entry["name"]
    if entry.get("variant"):
        name += f" [{entry['variant']}]"
    if entry.get("round"):
        name += f" ({entry['round']})"
    return name


def rounds_summary(scenarios: list[dict]) -> list[dict]:
    """Per scenario and variant run in several rounds (``--rounds``): each round's median
    sync in ms, their median, and the median of the rounds' ratios, in the order they first
    ran. Settings that move from round to round (S7 at 1% changed, bound by host work) are
    compared by these, not by one round."""
    rounds: dict[tuple[str, str | None], list[dict]] = {}
    for s in scenarios:
        if s.get("round"):
            rounds.setdefault((s["name"], s.get("variant")), []).append(s)
    out = []
    for (name, variant), runs in rounds.items():
        ms = [round(r["median_s"] * 1e3, 2) for r in runs]
        out.append(
            {
                "name": name,
                "variant": variant,
                "rounds_ms": ms,
                "median_ms": round(statistics.median(ms), 2),
                "ratio": round(statistics.median(r["ratio"] for r in runs), 3),
            }
        )
    return out


def _run_spec(
    spec: str,
    a: argparse.Namespace,
    run: int,
    *,
    model,
    port: int,
    gbps: dict,
    ceil: dict,
    n_gpu: int,
    medians: dict,
    tag: str = "",
) -> dict | None:
    """Run scenario ``spec`` ("S6", "S1@nccl") with the settings ``a`` (the command's, or a
    variant's) as the process's ``run``-th job; return its results entry (None: skipped).
    ``medians`` holds the median of each scenario run before it with the same settings (S6
    and S7 are compared with S1@nccl's); ``tag`` names the variant and round in the output."""
    sname, _, s_transport = spec.partition("@")
    if sname == "S5":  # host memory -> every GPU, beside checkpoint-engine: bench/s5.py
        from weightbus.bench import s5

        return s5.run(a, port=port, gbps=gbps, n_gpu=n_gpu)
    if sname == "S4e":  # S4 between real engines (FSDP2 -> transformers TP): engines.py
        from weightbus.bench import engines

        return engines.run(a, port=port, gbps=gbps, n_gpu=n_gpu)
    wdesc, rdesc, gpus, target, meaning = SCENARIOS[sname]
    if gpus > n_gpu:
        print(f"{spec}: needs {gpus} GPUs, this machine has {n_gpu}: skipped", flush=True)
        return None
    from weightbus.layouts.describe import build_layouts

    n_w = len(build_layouts(model, wdesc, "writer"))
    n_r = len(build_layouts(model, rdesc, "reader"))
    args = argparse.Namespace(
        **vars(a),
        scenario=sname,
        scenario_transport=s_transport or None,
        port=port,
        n_writers=n_w,
        n_readers=n_r,
        run=run,
    )
    print(f"{spec}{tag}: {n_w} writer(s) [{wdesc}] -> {n_r} reader(s) [{rdesc}] ...", flush=True)
    targets = [(_participant_worker, ("writer", r, r, args)) for r in range(n_w)]
    first_reader_gpu = 0 if sname in COLOCATED else n_w
    targets += [
        (_participant_worker, ("reader", r, first_reader_gpu + r, args)) for r in range(n_r)
    ]
    res = _run_group(targets, 1200)
    where = os.environ.get("WEIGHTBUS_PROFILE_DIR")
    if where and os.environ.get("WEIGHTBUS_PROFILE_TRACE"):
        from weightbus.bench.timeline import write_across

        write_across(where, sname)  # <scenario>.across.txt: each side's first messages
    w_times = [max(res[(f"writer-{r}", r)]["times"][i] for r in range(n_w)) for i in range(a.iters)]
    text = host_steps_text(res, w_times)
    if text:
        print(text, end="", flush=True)
    moved = res[("writer-0", 0)]["bytes"]
    exact = all(res[(f"reader-{r}", r)]["bit_exact"] for r in range(n_r))
    stats = _median(w_times)
    got = moved / stats["median_s"] / 1e9
    if sname == "S1":
        ceiling = max(gbps["nccl_sendrecv"], gbps["ipc_pull"])
        ratio = got / ceiling
    elif sname == "S3":
        ceiling = gbps["d2d_copy"]
        ratio = got / ceiling
    elif sname == "S2":
        ceiling = gbps["nccl_broadcast"] * n_r  # bytes delivered per second by a broadcast
        ratio = ceil["nccl_broadcast"] / stats["median_s"]
    elif sname in CODECS:
        # time relative to S1 over nccl (lower is better); GB/s are of bytes on the wire
        sent = res[("writer-0", 0)]["sent"]
        moved = int(statistics.median(sent)) if sent else moved
        got = moved / stats["median_s"] / 1e9
        ceiling = gbps["nccl_sendrecv"]
        base = medians.get("S1@nccl")
        ratio = stats["median_s"] / base if base else float("nan")
    else:
        ceiling = gbps["nccl_two_links"]
        ratio = got / ceiling
    entry = {
        "name": sname if not s_transport else f"{sname}@{s_transport}",
        "writers": wdesc,
        "readers": rdesc,
        "bytes": moved,
        **{k: round(v, 5) for k, v in stats.items()},
        "times_ms": [round(t * 1e3, 2) for t in w_times],
        "gbps": round(got, 1),
        "ceiling_gbps": round(ceiling, 1),
        "ratio": round(ratio, 3),
        "target": round(target, 3),
        "ratio_means": meaning,
        "bit_exact": exact,
        "transport": res[("writer-0", 0)]["transport"],
        "reader_median_s": [
            round(statistics.median(res[(f"reader-{r}", r)]["times"]), 5) for r in range(n_r)
        ],
        "writer_phases_last": {k: round(v, 4) for k, v in res[("writer-0", 0)]["phases"].items()},
        "reader_phases_last": {k: round(v, 4) for k, v in res[("reader-0", 0)]["phases"].items()},
    }
    medians[spec] = stats["median_s"]
    if spec == "S1@nccl":
        medians["S1@nccl bytes"] = moved
    if sname in CODECS:
        s1_bytes = medians.get("S1@nccl bytes")
        entry["s1_nccl_median_s"] = round(medians.get("S1@nccl", float("nan")), 5)
        entry["wire_fraction_of_s1"] = round(moved / s1_bytes, 4) if s1_bytes else None
    if sname == "S6":
        entry["fp8_tensors_wire_fraction"] = round(_fp8_fraction(model, a.fp8_block), 4)
        from weightbus.plan import PlanOptions
        from weightbus.plan.codec_plan import CodecConfig

        codecs = CodecConfig(**_scenario_codecs("S6", **_codec_flags(a)))
        assert codecs.fp8 is not None
        entry["fp8_ahead"] = codecs.fp8.ahead
        planned = codecs.plan_options(PlanOptions(bucket_bytes=a.bucket_mb << 20))
        entry["fp8_bucket_mb"] = planned.bucket_bytes >> 20  # as the job planned it
        r0 = res[("reader-0", 0)]
        entry["equal_to_quantization"] = r0["equal_to_quantization"]
        entry["error_over_fp8_bound"] = r0["error_over_bound"]
        entry["quantize_gbps"] = round(_quantize_gbps(a.iters), 1)
    if sname == "S7":
        entry["changed_fraction"] = a.changed
        delta = _scenario_codecs("S7", **_codec_flags(a))["delta"]
        entry["window_mb"] = delta.window_bytes >> 20
        entry["windows_per_pass"] = delta.windows_per_pass
        entry["compare_ahead"] = delta.compare_ahead
        entry["pieces"] = delta.pieces
        entry["announce"] = delta.announce
        entry["masks"] = delta.masks
        entry["exact_before_dense"] = res[("reader-0", 0)].get("exact_before_dense")
    print(
        f"  {sname}{tag}: {moved / 1e9:.2f} GB median {stats['median_s'] * 1e3:.1f} ms "
        f"[{stats['min_s'] * 1e3:.1f}, {stats['max_s'] * 1e3:.1f}] -> {got:.1f} GB/s, ratio {ratio:.3f} "
        f"(target {target:.3f}), bit exact {exact}",
        flush=True,
    )
    if sname == "S6" and entry.get("wire_fraction_of_s1"):
        print(
            f"  S6: on the wire, the FP8 tensors take {entry['fp8_tensors_wire_fraction']:.2%} "
            f"of their bf16 bytes, the whole model {entry['wire_fraction_of_s1']:.2%} (the "
            "ignore list's tensors stay bf16)",
            flush=True,
        )
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightbus bench gpu", description=__doc__.splitlines()[0])
    p.add_argument(
        "--scenarios",
        default="S1,S3,S4,S2",
        help="comma-separated, NAME or NAME@TRANSPORT (default S1,S3,S4,S2)",
    )
    p.add_argument(
        "--model", default="llama-3-8b", help="model preset (default llama-3-8b, ~16 GB bf16)"
    )
    p.add_argument("--iters", type=int, default=5, help="timed syncs per scenario (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up syncs (default 2)")
    p.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB (default 256)")
    p.add_argument(
        "--staging", type=int, default=4, help="staging buffers per participant (default 4)"
    )
    p.add_argument(
        "--direct-mb",
        type=int,
        default=None,
        help="routes this large move in place (default: SyncConfig's)",
    )
    p.add_argument("--transport", default="auto", help="transport name or auto")
    p.add_argument(
        "--changed",
        type=float,
        default=0.01,
        help="S7: fraction of the elements changed before each sync (default 0.01; 0: none)",
    )
    p.add_argument(
        "--fp8-block",
        type=int,
        default=128,
        help="S6: FP8 block side (default 128; small models need 32: fused parts start there)",
    )
    p.add_argument(
        "--fp8-ahead",
        type=int,
        default=None,
        help="S6: buckets per reader sent ahead of the writer's check (default: Fp8Config's; "
        "each takes a staging buffer of the reader)",
    )
    p.add_argument(
        "--fp8-bucket-mb",
        type=int,
        default=None,
        help="S6: smallest FP8 bucket in MiB (default: Fp8Config's, 512; 0: --bucket-mb)",
    )
    p.add_argument(
        "--window-mb",
        type=int,
        default=None,
        help="S7: the delta writer's window in MiB (default: DeltaConfig's)",
    )
    p.add_argument(
        "--windows-per-pass",
        type=int,
        default=None,
        help="S7: windows the delta writer compares at once (default: DeltaConfig's)",
    )
    p.add_argument(
        "--compare-ahead",
        type=int,
        default=None,
        help="S7: passes whose compare the delta writer may queue ahead of the one it waits "
        "for (default: DeltaConfig's)",
    )
    p.add_argument(
        "--pieces",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="S7: groups of plain buckets travel as pieces, from and into the live tensors, "
        "or not (default: DeltaConfig.pieces, on)",
    )
    p.add_argument(
        "--announce",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="S7: a writer whose every group travels as pieces says so at the sync's begin, "
        "and readers post every receive at once (default: DeltaConfig.announce, off)",
    )
    p.add_argument(
        "--masks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="S7: routes may travel as masked frames (a bit per element, then the changed "
        "values), or only sparse or dense (default: DeltaConfig.masks, on)",
    )
    add_sync_flags(p)
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument(
        "--kind", default=None, help="machine kind for the file name (default: from the GPUs)"
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'LABEL: ARGS'",
        help="run the scenarios again with these flags and environment variables, e.g. "
        "'b512: --bucket-mb 512' or 'amax48: WEIGHTBUS_AMAX_SMS=48 --fp8-ahead 8' (repeatable; "
        "S6 and S7 compare with the S1@nccl of their own variant)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the settings and every variant this many times, alternating (default 1)",
    )
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    variants = [_Variant("", {}, a, "")] + [_parse_variant(p, a, v) for v in a.variant]
    if len({v.label for v in variants}) != len(variants):
        p.error(f"--variant labels must differ: {[v.label for v in variants[1:]]}")
    for var in variants:
        _check_settings(p, var)
    specs = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    unknown = [s for s in specs if s.partition("@")[0] not in {*SCENARIOS, "S5", "S4e"}]
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; known: {', '.join([*SCENARIOS, 'S5', 'S4e'])}")
    coded = [i for i, s in enumerate(specs) if s.partition("@")[0] in CODECS]
    if coded and "S1@nccl" not in specs[: coded[0]]:
        specs.insert(coded[0], "S1@nccl")  # the baseline S6 and S7 are compared with
    import torch

    from weightbus.layouts.families import model_spec

    n_gpu = torch.cuda.device_count()
    if n_gpu < 2:
        print("weightbus bench gpu: needs at least 2 CUDA GPUs", file=sys.stderr)
        return 2
    import torch.distributed as dist

    port = _free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=600)
    )
    model = model_spec(a.model, dtype="bfloat16")
    nbytes = sum(t.numel for t in model.tensors) * 2
    name = torch.cuda.get_device_name(0)
    print(
        f"weightbus bench gpu: {n_gpu} x {name}, model {a.model} ({nbytes / 1e9:.2f} GB bf16)",
        flush=True,
    )

    world = min(n_gpu, 4)
    print(f"ceilings: {world} GPUs, {nbytes / 1e9:.2f} GB each ...", flush=True)
    c = _run_group(
        [(_ceiling_worker, (r, world, port, nbytes, a.iters)) for r in range(world)], 900
    )
    ceil = {}
    for k, v in c[("ceilings", 0)].items():
        ceil[k] = statistics.median(v)
    gbps = {k: nbytes / v / 1e9 for k, v in ceil.items()}
    gbps["nccl_two_links"] = (
        2 * nbytes / ceil["nccl_two_links"] / 1e9 if "nccl_two_links" in ceil else None
    )
    ceilings = {f"{k}_gbps": round(v, 1) for k, v in gbps.items() if v is not None}
    for k, v in ceilings.items():
        print(f"  {k:<24} {v:8.1f}", flush=True)

    from weightbus.engines.torch_dist import environment

    scenarios = []
    runs = 0
    for rnd in range(a.rounds):
        for var in variants:
            tag = "".join(
                (
                    f" [{var.label}]" if var.label else "",
                    f" (round {rnd + 1})" if a.rounds > 1 else "",
                )
            )
            medians: dict[str, float] = {}  # per variant and round: S6 / S7 compare with S1@nccl
            with environment(var.env):
                for spec in specs:
                    entry = _run_spec(
                        spec,
                        var.args,
                        runs,
                        model=model,
                        port=port,
                        gbps=gbps,
                        ceil=ceil,
                        n_gpu=n_gpu,
                        medians=medians,
                        tag=tag,
                    )
                    runs += 1
                    if entry is None:
                        continue
                    if var.label:
                        entry["variant"], entry["variant_args"] = var.label, var.text
                    if a.rounds > 1:
                        entry["round"] = rnd + 1
                    scenarios.append(entry)
    del server
    source = source_identity()
    if source["tree_differs_from_commit"]:
        print(
            f"weightbus bench gpu: the tracked files differ from commit "
            f"{source['commit'][:12]}: the results say so (tree_differs_from_commit, and the "
            f"files' own tree {source['tree'][:12]}); commit first, or set WEIGHTBUS_COMMIT",
            flush=True,
        )
    date = dt.date.today().isoformat()
    kind = a.kind or machine_kind(n_gpu, name)
    result = {
        "date": date,
        "machine": f"{n_gpu}x {name}",
        **source,
        "model": a.model,
        "bucket_mb": a.bucket_mb,
        "staging_buffers": a.staging,
        "direct_mb": a.direct_mb,
        "iters": a.iters,
        "verify": a.verify,
        "apply": a.apply,
        "ceilings": ceilings,
        "ceiling_notes": CEILING_NOTES,
        "scenarios": scenarios,
    }
    summary = rounds_summary(scenarios)
    if summary:
        result["rounds_summary"] = summary
    path = results_path(a.out, f"{date}-{kind}")
    path.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, path.with_suffix(".png"))
    print(f"results: {path}", flush=True)
    width = max([4, *(len(_display(s)) for s in scenarios)])
    print(
        f"{'name':<{width}} {'ms':>7} {'GB/s':>8} {'ceiling':>8} {'ratio':>7} {'target':>7} bit-exact"
    )
    for s in scenarios:
        print(
            f"{_display(s):<{width}} {s['median_s'] * 1e3:>7.2f} {s['gbps']:>8.1f} "
            f"{s['ceiling_gbps']:>8.1f} {s['ratio']:>7.3f} {s['target']:>7.3f} {s['bit_exact']}"
        )
    for r in summary:
        name = r["name"] + (f" [{r['variant']}]" if r["variant"] else "")
        print(
            f"{name}: rounds {', '.join(f'{m:.1f}' for m in r['rounds_ms'])} ms -> median "
            f"{r['median_ms']:.1f} ms, ratio {r['ratio']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
