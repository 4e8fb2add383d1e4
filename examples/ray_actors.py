"""A trainer actor group and two inference actor groups on Ray, weights synced after each step.

Run it (a CPU is enough, nothing is downloaded; it starts a local Ray cluster):

    pip install -e ".[ray,hf]"
    python examples/ray_actors.py                    # CPU: gloo everywhere
    python examples/ray_actors.py --gpus             # one GPU per actor (5), NCCL
    python examples/ray_actors.py --address auto     # on a running Ray cluster

While it runs, ``weightbus status --store <the address it prints>`` shows the participants.

The groups, each started by ``weightbus.ray.RayJob.group`` in a placement group of its own:

* ``trainer``: 2 writer actors, FSDP2 over the group's own process group (built by
  ``ActorContext.init_process_group`` on the job's control store: no torchrun), a small
  Llama-style transformers model from a config, float32 master weights, AdamW;
* ``engine-hf``: 1 reader actor, a Hugging Face transformers replica in bfloat16 (reader rank 0);
* ``engine-tp``: 2 reader actors holding the parameters the way a vLLM engine with tensor
  parallel 2 holds them (fused ``qkv_proj`` / ``gate_up_proj``, vocabulary-parallel embedding),
  allocated from ``weightbus.layouts.fused.engine_layout`` (reader ranks 1 and 2). It is a
  stand-in for the storage of a vLLM engine: no vLLM runs here.

After each optimizer step the trainer syncs, casting float32 to bfloat16 on the wire, and the
example checks that every reader's tensors (poisoned before each sync) equal the trainer's
weights cast to bfloat16, bit for bit, region by region, and that engine-hf's greedy
generation equals the trainer's. It exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from datetime import timedelta

SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 2, 4, 2, 512),
    "small": (512, 1408, 6, 8, 4, 8192),
}
PROMPT = [1, 2, 3, 4, 5, 6]


def llama_dict(size: str) -> dict:
    """The model's config.json as a dict (what weightbus.layouts.families.model_spec reads)."""
    h, i, n, heads, kv, vocab = SIZES[size]
    return {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }


def llama_config(size: str):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in llama_dict(size).items() if k != "model_type"})


def sync_config(timeout: float):
    from weightbus import SyncConfig

    t = timedelta(seconds=timeout)
    return SyncConfig(
        cast={"float32": "bfloat16"},
        bucket_bytes=16 << 20,
        sync_timeout=t,
        connect_timeout=t,
        step_timeout=t,
    )


def region_digests(bound) -> dict[str, str]:
    """sha256 of every piece's region of a bound layout, keyed by canonical tensor and box."""
    import torch

    out = {}
    for p in bound.layout.iter_pieces():
        region = bound.tensors[p.key][p.local_box.slices()].reshape(p.box.shape).contiguous()
        out[f"{p.tensor}{p.box}"] = hashlib.sha256(
            region.view(torch.uint8).cpu().numpy().tobytes()
        ).hexdigest()
    return out


def region_keys(bound) -> dict[str, list]:
    """``{key: [canonical tensor, box start, box stop]}`` of every piece, keyed as
    :func:`region_digests` keys them."""
    return {
        f"{p.tensor}{p.box}": [p.tensor, list(p.box.start), list(p.box.stop)]
        for p in bound.layout.iter_pieces()
    }


def generate(model) -> list[int]:
    import torch

    ids = torch.tensor([PROMPT], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


class Trainer:
    """One FSDP2 rank of the trainer group; a weightbus writer."""

    def __init__(self, ctx, size: str, timeout: float) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM

        from weightbus import Writer
        from weightbus.engines.hf import bind

        torch.set_num_threads(1)
        self.ctx, self.size = ctx, size
        self.device = ctx.device()
        ctx.init_process_group()  # the trainer's own group, for FSDP2
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(llama_config(size)).to(self.device)
        mesh = init_device_mesh(self.device.type, (ctx.group_size,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        control = ctx.control_config(timeout=timedelta(seconds=timeout))
        bound = bind(self.model, ctx.role, ctx.rank, name=ctx.name)
        self.writer = Writer(bound, control, sync_config(timeout))
        self.reference = None

    def connect(self) -> str:
        return self.writer.connect().digest

    def step(self, step: int) -> dict:
        """One AdamW step on a toy objective (continue runs of token ids), then the sync."""
        import torch

        vocab = self.model.config.vocab_size
        g = torch.Generator().manual_seed(1000 + step)
        start = torch.randint(0, vocab, (8, 1), generator=g)
        batch = ((start + torch.arange(32)) % vocab).to(self.device)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        result = self.writer.sync(step)
        # the reference for the checks: every rank takes part in gathering the full weights
        self.reference = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to(torch.bfloat16)
            for k, v in self.model.state_dict().items()
        }
        return {"loss": loss.item(), "bytes": result.bytes, "seconds": result.seconds}

    def expected(self, regions: dict[str, list]) -> dict:
        """sha256 of each region the readers hold (``{key: [tensor, start, stop]}``) of the
        reference weights, and the reference's greedy generation."""
        import torch
        from transformers import LlamaForCausalLM

        from weightbus.spec import Box

        digests = {}
        for key, (tensor, start, stop) in regions.items():
            region = self.reference[tensor][Box(start, stop).slices()].contiguous()
            digests[key] = hashlib.sha256(
                region.view(torch.uint8).cpu().numpy().tobytes()
            ).hexdigest()
        ref = LlamaForCausalLM(llama_config(self.size)).to(torch.bfloat16).to(self.device).eval()
        ref.load_state_dict(self.reference)
        return {"digests": digests, "generation": generate(ref)}

    def close(self) -> None:
        import torch.distributed as dist

        self.writer.close()
        dist.destroy_process_group()


class HFEngine:
    """A transformers replica in bfloat16; a weightbus reader."""

    def __init__(self, ctx, size: str, timeout: float) -> None:
        import torch
        from transformers import LlamaForCausalLM

        from weightbus import Reader
        from weightbus.engines.hf import bind

        torch.set_num_threads(1)
        torch.manual_seed(100 + ctx.rank)  # other weights than the trainer's until the sync
        device = ctx.device()
        self.model = LlamaForCausalLM(llama_config(size)).to(torch.bfloat16).to(device).eval()
        control = ctx.control_config(timeout=timedelta(seconds=timeout))
        self.bound = bind(self.model, ctx.role, ctx.rank, name=ctx.name)
        self.reader = Reader(self.bound, control, sync_config(timeout))

    def connect(self) -> str:
        return self.reader.connect().digest

    def regions(self) -> dict[str, list]:
        return region_keys(self.bound)

    def receive(self) -> dict:
        import torch

        from weightbus.plan import poison

        with torch.no_grad():
            for t in self.bound.tensors.values():
                poison(t)
        result = self.reader.wait()
        return {
            "version": result.version,
            "digests": region_digests(self.bound),
            "generation": generate(self.model),
        }

    def close(self) -> None:
        self.reader.close()


class TPEngine:
    """One tensor-parallel rank of a vLLM-style engine's parameter storage; a weightbus reader."""

    def __init__(self, ctx, size: str, timeout: float) -> None:
        import socket

        import torch

        from weightbus import BoundLayout, Participant, Reader
        from weightbus.layouts.families import model_spec
        from weightbus.layouts.fused import engine_layout
        from weightbus.plan import allocate

        torch.set_num_threads(1)
        device = ctx.device()
        spec = model_spec(llama_dict(size))  # no transformers needed on this side
        me = Participant(
            role=ctx.role,
            rank=ctx.rank,
            name=ctx.name,
            host=socket.gethostname(),
            device=str(device),
        )
        layout = engine_layout(
            spec, me, tp=ctx.group_size, tp_rank=ctx.group_rank, dtype="bfloat16"
        )
        self.bound = BoundLayout(layout=layout, tensors=allocate(layout, device=device))
        control = ctx.control_config(timeout=timedelta(seconds=timeout))
        self.reader = Reader(self.bound, control, sync_config(timeout))

    def connect(self) -> str:
        return self.reader.connect().digest

    def regions(self) -> dict[str, list]:
        return region_keys(self.bound)

    def receive(self) -> dict:
        from weightbus.plan import poison

        for t in self.bound.tensors.values():
            poison(t)
        result = self.reader.wait()
        return {"version": result.version, "digests": region_digests(self.bound)}

    def close(self) -> None:
        self.reader.close()


def run(args) -> int:
    import ray

    from weightbus.ray import GroupConfig, RayJob, get

    started_ray = False
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
        started_ray = True
    timeout = timedelta(seconds=args.timeout)
    gpus = 1.0 if args.gpus else 0.0
    t0 = time.perf_counter()
    job = RayJob(num_writers=2, num_readers=3, job=args.job, timeout=timeout)
    print(
        f"control store of job {args.job!r} at {job.address} (weightbus status --store "
        f"{job.address})",
        flush=True,
    )
    all_exact = all_same = True
    try:
        common = dict(num_gpus=gpus, num_cpus=args.cpus_per_actor, ready_timeout=timeout)
        trainer = job.group(
            Trainer,
            GroupConfig(name="trainer", role="writer", size=2, **common),
            args.size,
            args.timeout,
        )
        engine_hf = job.group(
            HFEngine,
            GroupConfig(name="engine-hf", role="reader", size=1, first_rank=0, **common),
            args.size,
            args.timeout,
        )
        engine_tp = job.group(
            TPEngine,
            GroupConfig(name="engine-tp", role="reader", size=2, first_rank=1, **common),
            args.size,
            args.timeout,
        )
        digests = get(job.call("connect"), timeout=timeout, what="connect")
        assert len(set(digests.values())) == 1, digests
        print(f"connected {len(digests)} participants, plan {next(iter(digests.values()))[:12]}")
        regions = get(engine_hf.call("regions") | engine_tp.call("regions"), timeout=timeout)
        wanted = {k: v for per_actor in regions.values() for k, v in per_actor.items()}
        trainer0 = trainer.names[0]
        print(
            f"\n{'step':>4} | {'loss':>6} | {'MB sent':>8} | {'sync ms':>8} | bit exact | "
            "generation"
        )
        for step in range(1, args.steps + 1):
            out = get(
                trainer.call("step", step) | engine_hf.call("receive") | engine_tp.call("receive"),
                timeout=timeout,
                what=f"step {step}",
            )
            ref = get(
                {trainer0: trainer.actors[0].expected.remote(wanted)},
                timeout=timeout,
            )[trainer0]
            readers = {k: v for k, v in out.items() if not k.startswith("trainer")}
            exact = all(
                r["version"] == step
                and all(ref["digests"][key] == d for key, d in r["digests"].items())
                for r in readers.values()
            )
            same = out[engine_hf.names[0]]["generation"] == ref["generation"]
            sent = sum(out[n]["bytes"] for n in trainer.names)
            ms = max(out[n]["seconds"] for n in trainer.names) * 1e3
            print(
                f"{step:>4} | {out[trainer0]['loss']:>6.3f} | {sent / 1e6:>8.2f} | {ms:>8.1f} | "
                f"{'yes' if exact else 'NO':>9} | {'same' if same else 'DIFFERENT'}",
                flush=True,
            )
            all_exact &= exact
            all_same &= same
        get(job.call("close"), timeout=timeout, what="close")
    finally:
        job.shutdown()
        if started_ray:
            ray.shutdown()
    ok = all_exact and all_same
    print(
        f"\nray example {'ok' if ok else 'FAILED'}: steps={args.steps} readers=3 "
        f"bit_exact={all_exact} generation_match={all_same} wall={time.perf_counter() - t0:.1f}s"
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, one sync after each")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    p.add_argument("--gpus", action="store_true", help="one GPU per actor (5 GPUs)")
    p.add_argument("--cpus-per-actor", type=float, default=0.25, help="Ray CPUs per actor")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    p.add_argument("--job", default="ray-example", help="weightbus job name")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait may take")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
