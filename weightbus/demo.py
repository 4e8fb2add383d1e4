"""`weightbus demo`: a real trainer and a real inference engine, weights synced after each step.

Run it with ``weightbus demo`` (``--help`` for options). No GPU and no download needed.

It starts trainer processes (FSDP2 over gloo when there are several) and inference processes
(Hugging Face transformers, bfloat16) on this machine, builds a small Llama-style model from a
config, runs a few real AdamW steps on a toy objective, syncs after each step, and checks two
things per step: every inference weight equals the trainer's (cast to bfloat16) bit for bit,
and the inference model's greedy generation on fixed prompts equals the trainer's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

MODEL_SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 2, 4, 2, 512),
    "small": (512, 1408, 6, 8, 4, 8192),
    "base": (1024, 2816, 8, 16, 4, 16384),
}
PROMPTS = [[1, 2, 3, 4, 5, 6], [40, 41, 42, 43], [7, 100, 7, 100, 7]]
NEW_TOKENS = 12


def _llama_config(size: str):
    from transformers import LlamaConfig

    h, i, n, heads, kv, vocab = MODEL_SIZES[size]
    return LlamaConfig(
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def _digest(state: dict) -> str:
    """One sha256 over every tensor's bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _generate(model) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def _batch(vocab: int, step: int, device):
    """Toy objective: continue runs of consecutive token ids."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (8, 1), generator=g)
    return ((start + torch.arange(48)) % vocab).to(device)


def _write(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _bar(done: int, total: int, width: int = 28) -> str:
    full = int(width * done / max(total, 1))
    return "[" + "#" * full + "." * (width - full) + "]"


def _control(args):
    from weightbus.control.store import ControlConfig

    return ControlConfig(
        num_writers=args.trainers,
        num_readers=args.replicas,
        address=args.store,
        host_store=False,
        job="demo",
        timeout=timedelta(seconds=args.timeout),
    )


def _sync_config(args):
    from weightbus import DeltaConfig, SyncConfig

    return SyncConfig(
        cast={"float32": "bfloat16"},
        delta=DeltaConfig() if args.deltas else None,
        bucket_bytes=args.bucket_mb << 20,
        transport=args.transport,
        sync_timeout=timedelta(seconds=args.timeout),
        connect_timeout=timedelta(seconds=args.timeout),
        step_timeout=timedelta(seconds=args.timeout),
    )


def _trainer(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from weightbus import Writer
    from weightbus.engines.hf import bind

    torch.set_num_threads(1)
    out = Path(args.out) / f"writer-{rank}.jsonl"
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    if args.trainers > 1:
        host, port = args.store.rsplit(":", 1)
        store = dist.PrefixStore("trainer-pg", dist.TCPStore(host, int(port), is_master=False))
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=args.trainers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(args.size)).to(device)
    if args.trainers > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (args.trainers,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    writer = Writer(bind(model, "writer", rank), _control(args), _sync_config(args))
    plan = writer.connect()
    if rank == 0:
        s = plan.stats
        print(
            f"connect: planned in {writer.plan_seconds * 1e3:.0f} ms: {s.total_bytes / 1e6:.1f} MB per sync, "
            f"{s.routes} routes in {s.buckets} buckets over {len(s.link_bytes)} links "
            f"(writer max/mean {s.writer_imbalance:.2f}); transport {writer.transport.name}",
            flush=True,
        )
    vocab = model.config.vocab_size
    for step in range(1, args.steps + 1):
        model.train()
        batch = _batch(vocab, step, device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tty = rank == 0 and sys.stdout.isatty()

        def progress(done: int, total: int, step=step, tty=tty) -> None:
            if tty:
                print(
                    f"\rstep {step}: sync {_bar(done, total)} {done / 1e6:7.1f} MB",
                    end="",
                    flush=True,
                )

        # an RL loop syncs once the engine has finished its rollouts; wait for that here, so
        # the time below is the sync's own
        writer.control.gather(
            f"demo-ready/{step}", role="reader", timeout=timedelta(seconds=args.timeout)
        )
        result = writer.sync(step, progress=progress)
        if rank == 0:
            print(
                f"\rstep {step}: loss {loss.item():.3f}  sync v{step} {_bar(1, 1)} "
                f"{result.bytes / 1e6:.1f} MB from this trainer in {result.seconds * 1e3:.0f} ms",
                flush=True,
            )
        # reference for the checks: the full weights as bfloat16, and their greedy generation
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to(torch.bfloat16)
            for k, v in model.state_dict().items()
        }
        record = {
            "step": step,
            "version": step,
            "dense": plan.stats.total_bytes,
            "bytes": result.bytes,
            "seconds": result.seconds,
            "loss": loss.item(),
        }
        if rank == 0:
            ref = LlamaForCausalLM(_llama_config(args.size)).to(torch.bfloat16).to(device).eval()
            ref.load_state_dict(full)
            record.update(digest=_digest(ref.state_dict()), generation=_generate(ref))
            del ref
        _write(out, record)
    writer.close()
    if args.trainers > 1:
        dist.destroy_process_group()


def _inference(rank: int, args) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from weightbus import Reader
    from weightbus.engines.hf import bind

    torch.set_num_threads(1)
    out = Path(args.out) / f"reader-{rank}.jsonl"
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{args.trainers + rank}")
    torch.manual_seed(100 + rank)  # starts from other weights than the trainer's
    model = LlamaForCausalLM(_llama_config(args.size)).to(torch.bfloat16).to(device).eval()
    reader = Reader(bind(model, "reader", rank), _control(args), _sync_config(args))
    reader.connect()
    for step in range(1, args.steps + 1):
        reader.control.post(f"demo-ready/{step}", {})
        result = reader.wait()
        _write(
            out,
            {
                "version": result.version,
                "bytes": result.bytes,
                "seconds": result.seconds,
                "digest": _digest(model.state_dict()),
                "generation": _generate(model),
            },
        )
    reader.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(kind: str, rank: int, args) -> None:
    try:
        (_trainer if kind == "writer" else _inference)(rank, args)
    except BaseException as exc:
        print(f"{kind}-{rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(args) -> int:
    import torch
    import torch.distributed as dist

    if args.device == "auto":
        need = args.trainers + args.replicas
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.device = "cuda" if have >= need else "cpu"
        if 0 < have < need:
            print(f"({have} GPUs for {need} processes, one GPU each is needed: running on CPU)")
    h, i, n, heads, kv, vocab = MODEL_SIZES[args.size]
    params = vocab * h + n * (2 * h * h + 2 * h * (h // heads) * kv + 3 * h * i + 2 * h) + h
    print(
        f"weightbus demo: Llama-style model, {params / 1e6:.1f}M parameters ({n} layers, hidden {h}, "
        f"GQA {heads}/{kv} heads, tied embeddings)\n"
        f"  trainer: {args.trainers} process(es){' with FSDP2' if args.trainers > 1 else ''}, float32 "
        f"master weights, AdamW at lr {args.lr:g}\n"
        f"  inference: {args.replicas} Hugging Face transformers replica(s), bfloat16 (cast on the wire"
        f"{'; sparse deltas: after the first sync only the changed elements travel' if args.deltas else ''})\n"
        f"  device: {args.device}; {args.steps} steps, sync after each",
        flush=True,
    )
    port = args.store_port or _free_port()
    args.store = f"127.0.0.1:{port}"
    # this process hosts the control store; the participants connect to it
    server = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.timeout),
    )
    print(
        f"  control store: {args.store}, job 'demo' (watch it: weightbus status --store "
        f"{args.store} --job demo)",
        flush=True,
    )
    tmp = tempfile.TemporaryDirectory(prefix="weightbus-demo-")
    args.out = tmp.name
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=("writer", r, args), name=f"writer-{r}")
        for r in range(args.trainers)
    ]
    procs += [
        ctx.Process(target=_child, args=("reader", r, args), name=f"reader-{r}")
        for r in range(args.replicas)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout + 120
    failed = None
    while any(p.is_alive() for p in procs):
        for p in procs:
            if p.exitcode not in (None, 0) and failed is None:
                failed = f"{p.name} exited with code {p.exitcode}"
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in procs:
        p.join(timeout=30 if failed is None else 5)
        if p.is_alive():
            p.kill()
            failed = failed or f"{p.name} did not finish within the timeout"
        elif p.exitcode != 0 and failed is None:
            failed = f"{p.name} exited with code {p.exitcode}"
    del server
    if failed:
        print(f"demo FAILED: {failed}", flush=True)
        return 1

    out = Path(tmp.name)
    writers = [_read(out / f"writer-{r}.jsonl") for r in range(args.trainers)]
    readers = [_read(out / f"reader-{r}.jsonl") for r in range(args.replicas)]
    ref = {rec["version"]: rec for rec in writers[0]}
    print(
        f"\n{'sync':>4} | {'MB moved':>9} | {'of dense':>8} | {'time ms':>8} | {'GB/s':>6} | "
        "bit exact | generation"
    )
    total_bytes = 0
    all_exact = all_gen = True
    for step in range(1, args.steps + 1):
        recs = [rr for reader in readers for rr in reader if rr["version"] == step]
        moved = sum(rr["bytes"] for rr in recs)
        seconds = max(w[step - 1]["seconds"] for w in writers)
        exact = len(recs) == args.replicas and all(
            rr["digest"] == ref[step]["digest"] for rr in recs
        )
        gen = len(recs) == args.replicas and all(
            rr["generation"] == ref[step]["generation"] for rr in recs
        )
        all_exact &= exact
        all_gen &= gen
        total_bytes += moved
        dense = writers[0][step - 1]["dense"]
        print(
            f"{step:>4} | {moved / 1e6:>9.1f} | {moved / dense:>8.1%} | {seconds * 1e3:>8.1f} | "
            f"{moved / seconds / 1e9:>6.2f} | {'yes' if exact else 'NO':>9} | "
            f"{'same' if gen else 'DIFFERENT'}"
        )
    last = ref[args.steps]["generation"][0]
    print(f"\ngreedy continuation of {PROMPTS[0]} after step {args.steps}: {last}")
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    tmp.cleanup()
    ok = all_exact and all_gen
    print(
        f"demo {'ok' if ok else 'FAILED'}: steps={args.steps} bytes={total_bytes} bit_exact={all_exact} generation_match={all_gen}"
    )
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--steps", type=int, default=4, help="optimizer steps, one sync after each (default 4)"
    )
    p.add_argument(
        "--size", choices=sorted(MODEL_SIZES), default="small", help="model size (default small)"
    )
    p.add_argument(
        "--trainers",
        type=int,
        default=2,
        help="trainer processes; >1 shards with FSDP2 (default 2)",
    )
    p.add_argument("--replicas", type=int, default=1, help="inference replicas (default 1)")
    p.add_argument(
        "--device", choices=["auto", "cpu"], default="auto", help="where the models live"
    )
    p.add_argument("--transport", default="auto", help="transport name or auto")
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="the trainer's AdamW learning rate (default 3e-3, where nearly every bfloat16 "
        "element changes each step; RL fine-tuning runs near 1e-6, where few do)",
    )
    p.add_argument(
        "--deltas",
        action="store_true",
        help="sparse deltas on the wire: after the first sync only the elements that changed "
        "travel (as indices and values), bit exact",
    )
    p.add_argument("--bucket-mb", type=int, default=16, help="bucket size in MiB (default 16)")
    p.add_argument(
        "--store-port",
        type=int,
        default=0,
        help="port of the control store on 127.0.0.1, for `weightbus status` (default: a free one)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds any wait may take (default 300)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightbus demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if not args.lr > 0:
        p.error(f"--lr {args.lr}: the learning rate must be positive (e.g. 1e-6)")
    if not 0 <= args.store_port <= 65535:
        p.error(f"--store-port {args.store_port} must be a port number, 1-65535 (0: a free one)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
