"""S5: a model held in pinned host memory, split over the GPUs of one host; every GPU ends with
the whole model in its engine tensors (checkpoint-engine's job), beside checkpoint-engine.

    weightbus bench gpu --scenarios S5          # in the GPU bench, with its ceilings and file
    python -m weightbus.bench.s5 --chunks 4     # on its own: results/<date>-<kind>-s5.json

weightbus: one source process per GPU holds an equal share of the checkpoint (contiguous rows,
in file order) in page-locked host memory allocated on the GPU's NUMA node, and serves it as
``--chunks`` writers (:class:`weightbus.sources.HostSource`): each sync stages the share to its
GPU in chunks while the readers, one engine process per GPU (vLLM-style fused parameters, a
full replica each), pull and relay what has arrived (CUDA IPC). Timed: each source's
``HostSource.sync`` from the start of staging to the committed version (the slowest source per
sync), medians of ``--iters`` syncs after ``--warmup``, each after a barrier; then one more sync
into poisoned (NaN) engine tensors, checked bit for bit.

checkpoint-engine 0.4.2 (when ``checkpoint_engine`` imports): the same GPUs, one
``ParameterServer`` process per GPU holding a quarter of the tensors (whole tensors, as it
registers them), and one engine process per GPU receiving every bucket through its
``update_weights_from_ipc`` and copying each tensor into its own full set of tensors (the
cheapest engine-side load there is). Timed: ``ParameterServer.update`` on each rank (process
group made once, outside the timing), slowest rank per update; checked bit for bit after a
poisoned update. It needs ``pyzmq``, ``loguru`` and ``pydantic``; on a machine without network
access install them from wheels downloaded elsewhere
(``pip download checkpoint-engine==0.4.2 -d wheels`` then ``pip install --no-index
--find-links wheels checkpoint-engine``).

Per-GPU GB/s is the model's bytes over the sync time (every GPU receives the whole model), the
measure the design notes use for checkpoint-engine (33.8 GB/s on these GPUs). The ceiling is the
hardware's floor for this job, measured in the same run: every GPU's share crossing PCIe at once
(pinned host to device on all GPUs together), or each GPU taking in the rest of the model over
NVLink at the peer-copy rate, whichever is slower. The target is 3 x checkpoint-engine's
per-GPU GB/s measured in this run (the design notes' 33.8 when it could not run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import socket
import statistics
import sys
import time
import traceback
import zlib

from weightbus.bench import machine_kind, results_path, source_identity

CE_NOTED_GBPS = 33.8  # checkpoint-engine 0.4.2 per GPU on 4 x H200, from the design notes
READERS = "vllm:tp=1,dp={gpus}"


def _bind_numa(gpu: int) -> None:
    """Run this process on the CPUs of the GPU's NUMA node, so pinned memory lands there."""
    from weightbus.sources._memory import gpu_local_cpus

    cpus = gpu_local_cpus(gpu)
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass


def _canonical(spec, device):
    """Tensor ``spec``'s values: the same per-name seeds as ``weightbus bench gpu``."""
    import torch

    g = torch.Generator(device=device).manual_seed(zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=g, device=device, dtype=torch.float32).to(
        torch.bfloat16
    )


def _specs(model_name: str):
    from weightbus.layouts.families import model_spec
    from weightbus.spec import TensorSpec

    model = model_spec(model_name, dtype="bfloat16")
    return model, [TensorSpec(name=t.name, shape=t.shape, dtype=t.dtype) for t in model.tensors]


def _check(tensors: dict, layout, device) -> bool:
    """Whether every piece of ``layout`` holds exactly its canonical values."""
    import torch

    pieces = sorted(layout.iter_pieces(), key=lambda p: p.tensor)
    specs = {t.name: t for t in layout.tensors}
    name, full = None, None
    for p in pieces:
        if p.tensor != name:
            name, full = p.tensor, _canonical(specs[p.tensor], device)
        got = tensors[p.key][p.local_box.slices()]
        want = full[p.box.slices()].reshape(got.shape)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            return False
    return True


def _barrier(store, key: str, n: int, timeout_s: float = 600.0) -> None:
    store.add(key, 1)
    end = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < n:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {key!r}: fewer than {n} arrived in {timeout_s} s")
        time.sleep(0.0005)


# ---------------------------------------------------------------------------------------------
# weightbus
# ---------------------------------------------------------------------------------------------


def _configs(args):
    from weightbus.bench.gpu import bench_configs

    return bench_configs(
        args,
        f"bench-S5-{args.tag}",
        args.gpus * args.chunks,
        args.gpus,
        step_timeout=dt.timedelta(seconds=600),
    )


def _source_worker(rank: int, args, q) -> None:
    try:
        _bind_numa(rank)
        import torch
        import torch.distributed as dist

        from weightbus.bench.gpu import profiled
        from weightbus.sources import HostCheckpoint, HostSource, SourceConfig

        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        _, specs = _specs(args.model)
        ckpt = HostCheckpoint.allocate(
            specs, rank=rank, world=args.gpus, chunks=args.chunks, pin=True
        )
        name, full = None, None
        for chunk in ckpt.parts:
            for p in chunk:
                if p.spec.name != name:
                    name, full = p.spec.name, _canonical(p.spec, device)
                ckpt.view(p).copy_(full[p.start : p.stop] if p.spec.shape else full)
        del full
        torch.cuda.synchronize()
        store = dist.PrefixStore(
            f"s5-{args.tag}", dist.TCPStore("127.0.0.1", args.port, is_master=False)
        )
        # the PCIe floor: every GPU copying its whole share from pinned memory at once
        runs = [r[3] for c in range(args.chunks) for r in ckpt.runs(c)]
        dev = torch.empty(sum(r.numel() for r in runs), dtype=torch.uint8, device=device)
        h2d = []
        for i in range(args.warmup + args.iters):
            _barrier(store, f"h2d/{i}", args.gpus)
            t = time.perf_counter()
            at = 0
            for r in runs:
                dev[at : at + r.numel()].copy_(r, non_blocking=True)
                at += r.numel()
            torch.cuda.synchronize()
            if i >= args.warmup:
                h2d.append(time.perf_counter() - t)
        del dev
        control, sync = _configs(args)
        source = HostSource(ckpt, control, sync, SourceConfig(device=f"cuda:{rank}", name="host"))
        source.connect()
        times, result = [], None
        total = args.warmup + args.iters + 1
        for i in range(total):
            for w in source.writers:
                w.control.post(f"bench-ready/{i}", {})
            source.writers[0].control.gather(f"bench-ready/{i}")
            with profiled(f"S5-source-{rank}", i, args.warmup):
                result = source.sync(i + 1)
            if args.warmup <= i < total - 1:
                times.append(result.seconds)
        transport = source.writers[0].transport.name
        source.close()
        q.put(
            (
                "source",
                rank,
                "ok",
                {
                    "times": times,
                    "h2d": h2d,
                    "shard_bytes": ckpt.nbytes,
                    "phases": result.phases,
                    "transport": transport,
                },
            )
        )
        ckpt.close()
    except BaseException as exc:
        q.put(("source", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _reader_worker(rank: int, args, q) -> None:
    try:
        import torch

        from weightbus import BoundLayout, Participant, Reader
        from weightbus.bench.gpu import profiled
        from weightbus.layouts.describe import build_layouts
        from weightbus.plan import allocate, poison

        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        model, _ = _specs(args.model)
        layout = build_layouts(model, args.readers, "reader")[rank]
        me = Participant(role="reader", rank=rank, host=socket.gethostname(), device=str(device))
        layout = dataclasses.replace(layout, participant=me, _memo={})
        tensors = allocate(layout, device=device)
        control, sync = _configs(args)
        reader = Reader(BoundLayout(layout=layout, tensors=tensors), control, sync)
        reader.connect()
        times, result = [], None
        total = args.warmup + args.iters + 1
        for i in range(total):
            if i == total - 1:
                for t in tensors.values():
                    poison(t)
                torch.cuda.synchronize()
            reader.control.post(f"bench-ready/{i}", {})
            reader.control.gather(f"bench-ready/{i}")
            with profiled(f"S5-reader-{rank}", i, args.warmup):
                result = reader.wait()
            if args.warmup <= i < total - 1:
                times.append(result.seconds)
        exact = _check(tensors, layout, device)
        reader.close()
        q.put(("reader", rank, "ok", {"times": times, "bit_exact": exact, "phases": result.phases}))
    except BaseException as exc:
        q.put(("reader", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# ---------------------------------------------------------------------------------------------
# checkpoint-engine
# ---------------------------------------------------------------------------------------------


def _ce_share(specs, world: int) -> list[list]:
    """Whole tensors in order, cut into ``world`` contiguous runs of about equal bytes."""
    total = sum(s.nbytes for s in specs)
    out: list[list] = [[] for _ in range(world)]
    at = 0
    for s in specs:
        out[min((at + s.nbytes // 2) * world // max(total, 1), world - 1)].append(s)
        at += s.nbytes
    return out


def _ce_server(rank: int, args, q) -> None:
    try:
        _bind_numa(rank)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(args.gpus),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(args.ce_port),
        )
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        from checkpoint_engine.ps import ParameterServer

        device = torch.device("cuda", rank)
        _, specs = _specs(args.model)
        named = {s.name: _canonical(s, device).cpu() for s in _ce_share(specs, args.gpus)[rank]}
        ps = ParameterServer(
            rank=rank,
            world_size=args.gpus,
            auto_pg=False,
            master_addr="127.0.0.1",
            master_port=args.ce_port,
        )
        ps.register_checkpoint("s5", named_tensors=named)
        del named
        ps.init_process_group()
        ps.gather_metas("s5")
        uuid = getattr(ps, "_device_uuid", None) or (
            f"GPU-{torch.cuda.get_device_properties(rank).uuid!s}"
        )
        store = dist.PrefixStore(
            f"s5-ce-{args.tag}", dist.TCPStore("127.0.0.1", args.port, is_master=False)
        )
        times = []
        total = args.warmup + args.iters + 1
        for i in range(total):

            def request(socket_paths, i=i):
                # tell this GPU's engine process where to connect for this update
                store.set(f"path/{i}/{rank}", dict(socket_paths)[uuid])

            _barrier(store, f"ready/{i}", 2 * args.gpus)
            t = time.perf_counter()
            ps.update("s5", request)
            if args.warmup <= i < total - 1:
                times.append(time.perf_counter() - t)
        import checkpoint_engine

        q.put(("ce-server", rank, "ok", {"times": times, "version": checkpoint_engine.__version__}))
    except BaseException as exc:
        q.put(
            ("ce-server", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        )


def _ce_engine(rank: int, args, q) -> None:
    try:
        import torch
        import torch.distributed as dist
        import zmq
        from checkpoint_engine.worker import update_weights_from_ipc

        from weightbus.plan import poison

        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        _, specs = _specs(args.model)
        engine = {s.name: torch.empty(s.shape, dtype=torch.bfloat16, device=device) for s in specs}

        def run(weights) -> None:
            for name, t in weights:
                engine[name].copy_(t)

        store = dist.PrefixStore(
            f"s5-ce-{args.tag}", dist.TCPStore("127.0.0.1", args.port, is_master=False)
        )
        ctx = zmq.Context()
        total = args.warmup + args.iters + 1
        for i in range(total):
            if i == total - 1:
                for t in engine.values():
                    poison(t)
                torch.cuda.synchronize()
            _barrier(store, f"ready/{i}", 2 * args.gpus)
            store.wait([f"path/{i}/{rank}"], dt.timedelta(seconds=600))
            path = store.get(f"path/{i}/{rank}").decode()
            update_weights_from_ipc(ctx, path, rank, run=run)
        torch.cuda.synchronize()
        exact = all(
            torch.equal(engine[s.name].view(torch.uint8), _canonical(s, device).view(torch.uint8))
            for s in specs
        )
        q.put(("ce-engine", rank, "ok", {"bit_exact": exact}))
    except BaseException as exc:
        q.put(
            ("ce-engine", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        )


def _have_checkpoint_engine() -> str | None:
    """Why checkpoint-engine cannot run here, or None when it can."""
    try:
        import checkpoint_engine  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        return f"checkpoint_engine does not import ({e})"
    return None


# ---------------------------------------------------------------------------------------------
# the scenario
# ---------------------------------------------------------------------------------------------


def run(
    args: argparse.Namespace, *, port: int, gbps: dict | None = None, n_gpu: int | None = None
) -> dict | None:
    """Run S5 (and checkpoint-engine beside it when it imports); the results-file entry, or
    None when this machine has fewer than 2 GPUs. ``args`` carries the GPU bench's options
    (model, iters, warmup, bucket_mb, transport) and optionally ``s5_chunks``,
    ``s5_readers``, ``s5_peer``; ``gbps`` the bench's ceilings (``ipc_pull`` is used)."""
    import torch

    from weightbus.bench.gpu import _free_port, _median, _run_group

    gpus = min(n_gpu or torch.cuda.device_count(), 4)
    if gpus < 2:
        print("S5: needs at least 2 GPUs: skipped", flush=True)
        return None
    chunks = int(getattr(args, "s5_chunks", 4))
    readers = getattr(args, "s5_readers", None) or READERS.format(gpus=gpus)
    a = argparse.Namespace(
        model=args.model,
        iters=args.iters,
        warmup=args.warmup,
        bucket_mb=args.bucket_mb,
        transport=getattr(args, "transport", "auto"),
        gpus=gpus,
        chunks=chunks,
        readers=readers,
        port=port,
        ce_port=_free_port(),
        tag=f"{chunks}-{time.time_ns()}",  # keys of this run only, in a store shared by scenarios
        verify=getattr(args, "verify", "off"),
        apply=getattr(args, "apply", "in_place"),
    )
    _, specs = _specs(args.model)
    nbytes = sum(s.nbytes for s in specs)
    print(
        f"S5: {nbytes / 1e9:.2f} GB in pinned host memory over {gpus} GPUs, {chunks} chunk(s) "
        f"each -> {readers} ...",
        flush=True,
    )
    targets = [(_source_worker, (r, a)) for r in range(gpus)]
    targets += [(_reader_worker, (r, a)) for r in range(gpus)]
    res = _run_group(targets, 1800)
    iters = range(a.iters)
    times = [max(res[("source", r)]["times"][i] for r in range(gpus)) for i in iters]
    h2d = [
        max(res[("source", r)]["h2d"][i] for r in range(gpus))
        for i in range(len(res[("source", 0)]["h2d"]))
    ]
    shard = max(res[("source", r)]["shard_bytes"] for r in range(gpus))
    exact = all(res[("reader", r)]["bit_exact"] for r in range(gpus))
    stats = _median(times)
    got = nbytes / stats["median_s"] / 1e9
    pcie_s = statistics.median(h2d)
    floors = {"pcie_s": pcie_s, "h2d_all_gpus_per_gpu_gbps": shard / pcie_s / 1e9}
    ipc = (gbps or {}).get("ipc_pull")
    if ipc:
        floors["nvlink_s"] = (nbytes - shard) / (ipc * 1e9)
    floor_s = max(floors["pcie_s"], floors.get("nvlink_s", 0.0))
    ceiling = nbytes / floor_s / 1e9

    peer = None
    why = _have_checkpoint_engine() if getattr(args, "s5_peer", True) else "disabled"
    if why is None:
        print(f"S5 peer: checkpoint-engine on {gpus} GPUs ...", flush=True)
        try:
            ce = _run_group(
                [(_ce_server, (r, a)) for r in range(gpus)]
                + [(_ce_engine, (r, a)) for r in range(gpus)],
                1800,
            )
            ce_times = [max(ce[("ce-server", r)]["times"][i] for r in range(gpus)) for i in iters]
            ce_stats = _median(ce_times)
            peer = {
                "name": "checkpoint-engine",
                "version": ce[("ce-server", 0)]["version"],
                **{k: round(v, 5) for k, v in ce_stats.items()},
                "gbps": round(nbytes / ce_stats["median_s"] / 1e9, 1),
                "bit_exact": all(ce[("ce-engine", r)]["bit_exact"] for r in range(gpus)),
                "how": "ParameterServer.update, broadcast; engines copy each tensor in place",
            }
        except RuntimeError as e:
            why = f"checkpoint-engine failed: {str(e).splitlines()[0]}"
            print(f"S5 peer: {why}", flush=True)
    else:
        print(f"S5 peer: not run: {why}", flush=True)
    peer_gbps = peer["gbps"] if peer else CE_NOTED_GBPS
    target = 3 * peer_gbps / ceiling
    entry = {
        "name": "S5",
        "chunks": chunks,
        "writers": f"host memory, {gpus} sources x {chunks} chunks",
        "readers": readers,
        "bytes": nbytes,
        **{k: round(v, 5) for k, v in stats.items()},
        "gbps": round(got, 1),
        "gbps_means": "per GPU: the model's bytes over the sync time (every GPU gets all of it)",
        "ceiling_gbps": round(ceiling, 1),
        "ceiling_floors_s": {k: round(v, 5) for k, v in floors.items()},
        "ratio": round(got / ceiling, 3),
        "target": round(target, 3),
        "ratio_means": "per-GPU GB/s over the floor's (PCIe of all GPUs at once, or NVLink); "
        "target = 3 x checkpoint-engine's per-GPU GB/s over the same ceiling",
        "bit_exact": exact,
        "transport": res[("source", 0)]["transport"],
        "peer": peer,
        "peer_note": None if peer else f"{why}; target from the design notes' {CE_NOTED_GBPS}",
        "vs_peer": round(got / peer_gbps, 2),
        "reader_median_s": [
            round(statistics.median(res[("reader", r)]["times"]), 5) for r in range(gpus)
        ],
        "writer_phases_last": {k: round(v, 4) for k, v in res[("source", 0)]["phases"].items()},
        "reader_phases_last": {k: round(v, 4) for k, v in res[("reader", 0)]["phases"].items()},
    }
    print(
        f"  S5: {nbytes / 1e9:.2f} GB to each of {gpus} GPUs, median {stats['median_s'] * 1e3:.1f} "
        f"ms [{stats['min_s'] * 1e3:.1f}, {stats['max_s'] * 1e3:.1f}] -> {got:.1f} GB/s per GPU "
        f"(ceiling {ceiling:.1f}, ratio {got / ceiling:.3f}); checkpoint-engine "
        + (f"{peer['gbps']:.1f} GB/s per GPU" if peer else f"not run ({CE_NOTED_GBPS} noted)")
        + f" -> {got / peer_gbps:.2f}x (target 3x); bit exact {exact}",
        flush=True,
    )
    return entry


def _peer_copy_gbps(nbytes: int = 1 << 30) -> float:
    """Copy-engine GB/s from GPU 0 to GPU 1 (the NVLink floor's rate)."""
    import torch

    from weightbus.bench.gpu import _time_cuda

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    seconds = statistics.median(_time_cuda(lambda: dst.copy_(src, non_blocking=True), 5))
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    from weightbus.bench.gpu import add_sync_flags

    p = argparse.ArgumentParser(
        prog="python -m weightbus.bench.s5", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="llama-3-8b", help="model preset (default llama-3-8b)")
    p.add_argument("--chunks", type=int, default=4, help="writers per source GPU (default 4)")
    p.add_argument("--readers", default=None, help="reader layouts (default vllm:tp=1,dp=GPUS)")
    p.add_argument("--iters", type=int, default=5, help="timed syncs (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up syncs (default 2)")
    p.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB (default 256)")
    p.add_argument("--transport", default="auto", help="transport name or auto")
    p.add_argument("--no-peer", action="store_true", help="skip checkpoint-engine")
    add_sync_flags(p)
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument("--kind", default=None, help="machine kind for the file name")
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from weightbus.bench.gpu import _free_port, _plot

    n_gpu = torch.cuda.device_count()
    if n_gpu < 2:
        print("S5 needs at least 2 CUDA GPUs", file=sys.stderr)
        return 2
    port = _free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=900)
    )
    ipc = _peer_copy_gbps()
    args = argparse.Namespace(
        model=a.model,
        iters=a.iters,
        warmup=a.warmup,
        bucket_mb=a.bucket_mb,
        transport=a.transport,
        s5_chunks=a.chunks,
        s5_readers=a.readers,
        s5_peer=not a.no_peer,
        verify=a.verify,
        apply=a.apply,
    )
    entry = run(args, port=port, gbps={"ipc_pull": ipc}, n_gpu=n_gpu)
    del server
    name = torch.cuda.get_device_name(0)
    date = dt.date.today().isoformat()
    kind = a.kind or machine_kind(n_gpu, name)
    result = {
        "date": date,
        "machine": f"{n_gpu}x {name}",
        **source_identity(),
        "model": a.model,
        "bucket_mb": a.bucket_mb,
        "iters": a.iters,
        "verify": a.verify,
        "apply": a.apply,
        "ceilings": {"ipc_pull_gbps": round(ipc, 1)},
        "scenarios": [entry] if entry else [],
    }
    path = results_path(a.out, f"{date}-{kind}-s5")
    path.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, path.with_suffix(".png"))
    print(f"results: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
