"""S4 with real engines (``weightbus bench gpu --scenarios S4e``): an FSDP2 trainer on GPUs 0-1 ->
a transformers tensor-parallel engine on GPUs 2-3, a Llama-3-8B-shaped model (~16 GB bf16).

The trainer is a ``transformers`` Llama built on the meta device, sharded with FSDP2
(``fully_shard`` per decoder layer and at the root, :func:`~weightbus.engines.torch_dist.fully_shard_model`)
and materialised on its GPU; its parameters are bfloat16 (S4 moves bf16 bytes; fp32 masters
with a cast on the wire are covered by the engine tests). The engine is what
``from_pretrained(tp_plan="auto")`` loads on GPUs 2-3 from a local checkpoint (its parameters
are DTensor shards); the checkpoint is written sparse (header and a hole: zeros) because the
engine's first contents do not matter, so building it costs no disk time. Both sides are bound
with :func:`weightbus.engines.hf.bind` and sync with the ordinary Writer and Reader.

Checks, after the timed syncs, into engine tensors poisoned with NaN:
* every engine shard equals its region of the trainer's weights, bit for bit (both sides fill
  or recompute the same seeded values per tensor);
* each engine rank received exactly its own shards' bytes: the plan's statistics equal the
  bytes its live tensors hold;
* the engine's tensors are still the ones transformers created (no re-binding).
The ratio is the aggregate GB/s over two raw NCCL send/recv links measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import struct
import tempfile
import time
import traceback
from pathlib import Path

TRAINER_GPUS = (0, 1)
ENGINE_GPUS = (2, 3)
TARGET = 0.85


def _hf_config(preset: str):
    from transformers import AutoConfig

    from weightbus.layouts.families import PRESETS

    fields = dict(PRESETS[preset])
    model_type = fields.pop("model_type")
    fields.pop("torch_dtype", None)
    return AutoConfig.for_model(model_type, **fields)


def _write_sparse_checkpoint(path: Path, preset: str) -> int:
    """A loadable checkpoint of zeros: config.json, and one safetensors file whose data is a
    hole (no bytes written). Returns its bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _hf_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(path)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        n = t.numel() * 2
        header[name] = {
            "dtype": "BF16",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def _group(port: int, prefix: str, rank: int, world: int, gpu: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(gpu)
    store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
    dist.init_process_group(
        "nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", gpu)
    )


def _configs(a):
    """The job's control and sync configs, the same on every participant."""
    from weightbus.bench.gpu import bench_configs

    return bench_configs(
        a,
        f"bench-S4e-{a.tag}",
        len(TRAINER_GPUS),
        len(ENGINE_GPUS),
        connect_timeout=dt.timedelta(seconds=300),
    )


def _loop(side, role: str, a, before_last=None) -> tuple[list, object]:
    """Warm-up, timed and one final sync, each after a barrier; the timed syncs' seconds."""
    from weightbus.bench.gpu import profiled

    times, result = [], None
    total = a.warmup + a.iters + 1
    for i in range(total):
        if i == total - 1 and before_last is not None:
            before_last()
        with profiled(f"S4e-{role}-{side.bound.layout.rank}", i, a.warmup):
            side.control.post(f"bench-ready/{i}", {})  # after the profilers' start-up
            side.control.gather(f"bench-ready/{i}")
            result = side.sync(i + 1) if role == "writer" else side.wait()
        if a.warmup <= i < total - 1:
            times.append(result.seconds)
    return times, result


def _trainer(rank: int, a, q) -> None:
    try:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        from weightbus import Writer
        from weightbus.bench.gpu import _canonical
        from weightbus.engines import hf
        from weightbus.engines.torch_dist import fully_shard_model
        from weightbus.plan import fill_from_canonical

        gpu = TRAINER_GPUS[rank]
        _group(a.port, f"{a.tag}/trainer", rank, len(TRAINER_GPUS), gpu)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_hf_config(a.model), dtype=torch.bfloat16)
        fully_shard_model(model, init_device_mesh("cuda", (len(TRAINER_GPUS),)))
        model.to_empty(device=torch.device("cuda", gpu))
        bound = hf.bind(model, "writer", rank)
        canon = _canonical(bound.layout, torch.device("cuda", gpu))
        with torch.no_grad():
            fill_from_canonical(bound.layout, canon, bound.tensors)
        del canon
        torch.cuda.synchronize()
        control, sync = _configs(a)
        writer = Writer(bound, control, sync)
        plan = writer.connect()
        times, result = _loop(writer, "writer", a)
        placements = sorted(
            {str(tuple(p.placements)) for p in model.parameters() if hasattr(p, "placements")}
        )
        writer.close()
        q.put(
            (
                "trainer",
                rank,
                "ok",
                {
                    "times": times,
                    "bytes": plan.stats.total_bytes,
                    "transport": writer.transport.name if writer.transport else "?",
                    "phases": {k: round(v, 4) for k, v in result.phases.items()},
                    "placements": placements,
                },
            )
        )
    except BaseException as exc:
        q.put(("trainer", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _engine(rank: int, a, q) -> None:
    try:
        import torch

        from weightbus import Reader
        from weightbus.bench.gpu import _canonical
        from weightbus.engines import hf
        from weightbus.engines.torch_dist import load_tensor_parallel
        from weightbus.plan import allocate, fill_from_canonical, poison

        gpu = ENGINE_GPUS[rank]
        device = torch.device("cuda", gpu)
        _group(a.port, f"{a.tag}/engine", rank, len(ENGINE_GPUS), gpu)
        model = load_tensor_parallel(a.checkpoint, dtype=torch.bfloat16, device=device)
        bound = hf.bind(model, "reader", rank)
        live = {k: t.data_ptr() for k, t in bound.tensors.items()}
        held = sum(t.numel() * t.element_size() for t in bound.tensors.values())
        control, sync = _configs(a)
        reader = Reader(bound, control, sync)
        plan = reader.connect()

        def poison_all():
            with torch.no_grad():
                for t in bound.tensors.values():
                    poison(t)
            torch.cuda.synchronize()

        times, result = _loop(reader, "reader", a, before_last=poison_all)
        want = allocate(bound.layout, device=device)
        fill_from_canonical(bound.layout, _canonical(bound.layout, device), want)
        bad = [
            k
            for k, t in bound.tensors.items()
            if not torch.equal(t.view(torch.uint8), want[k].view(torch.uint8))
        ]
        moved = [k for k, t in bound.tensors.items() if t.data_ptr() != live[k]]
        placements = sorted(
            {str(tuple(p.placements)) for p in model.parameters() if hasattr(p, "placements")}
        )
        reader.close()
        q.put(
            (
                "engine",
                rank,
                "ok",
                {
                    "times": times,
                    "bit_exact": not bad and not moved,
                    "wrong": bad[:5],
                    "replaced": moved[:5],
                    "held": held,
                    "received": plan.stats.reader_bytes[rank],
                    "whole": sum(t.nbytes for t in plan.tensors),
                    "placements": placements,
                    "phases": {k: round(v, 4) for k, v in result.phases.items()},
                },
            )
        )
    except BaseException as exc:
        q.put(("engine", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(
    args: argparse.Namespace, *, port: int, gbps: dict | None = None, n_gpu: int | None = None
) -> dict | None:
    """Run S4e; the results-file entry, or None when this machine has fewer than 4 GPUs.
    ``args`` carries the GPU bench's options (model, iters, warmup, bucket_mb, transport);
    ``gbps`` the bench's ceilings (``nccl_two_links`` is the ceiling)."""
    import torch

    from weightbus.bench.gpu import _median, _run_group

    if (n_gpu or torch.cuda.device_count()) < 4:
        print("S4e: needs 4 GPUs: skipped", flush=True)
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("S4e: transformers is not installed: skipped", flush=True)
        return None
    scratch = Path(tempfile.mkdtemp(prefix="weightbus-s4e-"))
    checkpoint = scratch / "engine-init"
    t = time.perf_counter()
    nbytes = _write_sparse_checkpoint(checkpoint, args.model)
    print(
        f"S4e: FSDP2 trainer on GPUs {TRAINER_GPUS} -> transformers tensor parallel on GPUs "
        f"{ENGINE_GPUS}, {args.model} ({nbytes / 1e9:.2f} GB bf16); engine checkpoint "
        f"(sparse) in {time.perf_counter() - t:.1f} s ...",
        flush=True,
    )
    a = argparse.Namespace(
        model=args.model,
        iters=args.iters,
        warmup=args.warmup,
        bucket_mb=args.bucket_mb,
        transport=getattr(args, "transport", "auto"),
        port=port,
        checkpoint=str(checkpoint),
        tag=f"s4e-{time.time_ns()}",
        verify=getattr(args, "verify", "off"),
        apply=getattr(args, "apply", "in_place"),
    )
    try:
        res = _run_group(
            [(_trainer, (r, a)) for r in range(len(TRAINER_GPUS))]
            + [(_engine, (r, a)) for r in range(len(ENGINE_GPUS))],
            1200,
        )
    finally:
        (checkpoint / "model.safetensors").unlink(missing_ok=True)
    n_w, n_r = len(TRAINER_GPUS), len(ENGINE_GPUS)
    w_times = [max(res[("trainer", r)]["times"][i] for r in range(n_w)) for i in range(a.iters)]
    stats = _median(w_times)
    moved = res[("trainer", 0)]["bytes"]
    got = moved / stats["median_s"] / 1e9
    ceiling = (gbps or {}).get("nccl_two_links") or float("nan")
    engines = [res[("engine", r)] for r in range(n_r)]
    own = all(e["received"] == e["held"] for e in engines)
    exact = all(e["bit_exact"] for e in engines)
    entry = {
        "name": "S4e",
        "writers": "FSDP2 (fully_shard) transformers Llama, 2 GPUs, bfloat16 parameters",
        "readers": "transformers from_pretrained(tp_plan='auto'), tensor parallel 2",
        "bytes": moved,
        **{k: round(v, 5) for k, v in stats.items()},
        "gbps": round(got, 1),
        "ceiling_gbps": round(ceiling, 1),
        "ratio": round(got / ceiling, 3),
        "target": TARGET,
        "ratio_means": "aggregate GB/s over two raw send/recv links",
        "bit_exact": exact,
        "each_reader_received_exactly_its_shards": own,
        "reader_bytes": [e["received"] for e in engines],
        "reader_held_bytes": [e["held"] for e in engines],
        "transport": res[("trainer", 0)]["transport"],
        "trainer_placements": res[("trainer", 0)]["placements"],
        "engine_placements": engines[0]["placements"],
        "reader_median_s": [round(_median(e["times"])["median_s"], 5) for e in engines],
        "writer_phases_last": res[("trainer", 0)]["phases"],
        "reader_phases_last": engines[0]["phases"],
    }
    for e in engines:
        if e["wrong"] or e["replaced"]:
            print(f"S4e: wrong {e['wrong']} replaced {e['replaced']}", flush=True)
    print(
        f"  S4e: {moved / 1e9:.2f} GB median {stats['median_s'] * 1e3:.1f} ms "
        f"[{stats['min_s'] * 1e3:.1f}, {stats['max_s'] * 1e3:.1f}] -> {got:.1f} GB/s, ratio "
        f"{entry['ratio']:.3f} (target {TARGET}), bit exact {exact}, each reader got exactly "
        f"its shards {own} ({', '.join(str(e['received']) for e in engines)} bytes)",
        flush=True,
    )
    return entry


if __name__ == "__main__":  # python -m weightbus.bench.engines: S4e alone, with its ceiling
    import sys

    from weightbus.bench.gpu import main

    sys.exit(main(["--scenarios", "S4e", *sys.argv[1:]]))
