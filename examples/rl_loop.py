"""A GRPO-style RL loop with weightbus between a real trainer and a real inference engine.

Each step: the inference engine (Hugging Face transformers, bfloat16) samples a group of
completions per prompt, a toy reward scores them (the share of completion tokens whose id is
below 64), the trainer (float32 master weights, FSDP2 or tensor parallel, AdamW) takes one
policy-gradient step on group-normalised advantages, weightbus syncs the new weights into the
engine in place (cast to bfloat16 on the wire), and the engine samples the next step's
completions with them. After each sync it checks that the engine holds the trainer's weights
cast to bfloat16 bit for bit, and compares the engine's greedy generation and logits on fixed
prompts with the trainer's model cast to bfloat16.

Run it on CPU (a tiny Llama-style model built from a config, nothing downloaded; about a
minute on 2 cores):

    pip install -e ".[hf]"
    python examples/rl_loop.py --mode colocated
    python examples/rl_loop.py --mode disaggregated

On GPUs (one process per GPU; NCCL inside each side, CUDA IPC between them):

    python examples/rl_loop.py --device cuda --mode colocated      # trainer and engine rank i on GPU i
    python examples/rl_loop.py --device cuda --mode disaggregated  # trainer on GPUs 0-1, engine on 2-3

Modes. ``colocated``: trainer rank i and engine rank i share device i and take turns (the
engine generates while the trainer waits for rollouts, the trainer trains while the engine
waits for the sync). ``disaggregated``: the trainer and the engine have devices of their own.
On CPU both put every process on the CPU, so only the GPU runs differ in placement. Both are
on-policy: each step's rollouts come from the version the previous step synced, which the
``rollouts from`` column shows.

Options: ``--trainers N`` (FSDP2 over N ranks by default; ``--trainer tp`` for tensor parallel,
``--trainer fsdp_tp`` for FSDP2 over tensor parallel 2 on a 2-D mesh), ``--engine-tp N`` (the
engine loaded with transformers' ``tp_plan="auto"`` over N ranks; 1: one device),
``--model PATH`` (a local Llama/Qwen2-style checkpoint instead of the tiny model), ``--steps``.

Checks: a tensor-parallel engine sums partial products in another order than one device, so
its logits may differ from the trainer's single-device ones in the last bits; the loop then
reports the largest difference instead of requiring equality (tests/test_engines_real.py
checks such an engine bit for bit against the same engine loaded fresh from the trainer's
weights). It exits non-zero if the weights are not bit exact, if a single-device engine's
logits or greedy tokens differ, or if a tensor-parallel engine's logits differ by more than
``--logit-tolerance`` times the largest logit. The checks gather the whole model on every
rank of both sides after each sync (small models only); the sync itself gathers nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

TARGET = 64  # the toy reward: share of completion tokens with an id below this
FIXED_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47]]
GREEDY_TOKENS = 8


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def _devices(args) -> tuple[list[str], list[str]]:
    """(trainer devices, engine devices) by mode."""
    if args.device == "cpu":
        return ["cpu"] * args.trainers, ["cpu"] * args.engine_tp
    trainer = [f"cuda:{i}" for i in range(args.trainers)]
    first = 0 if args.mode == "colocated" else args.trainers
    return trainer, [f"cuda:{first + i}" for i in range(args.engine_tp)]


def _configs(args):
    from weightbus import ControlConfig, SyncConfig

    wait = timedelta(seconds=args.timeout)
    control = ControlConfig(
        num_writers=args.trainers,
        num_readers=args.engine_tp,
        address=args.store,
        host_store=False,
        job="rl-loop",
        timeout=wait,
    )
    sync = SyncConfig(
        cast={"float32": "bfloat16"},
        sync_timeout=wait,
        connect_timeout=wait,
        step_timeout=wait,
    )
    return control, sync


def _init_group(args, side: str, rank: int, world: int, device) -> None:
    import torch
    import torch.distributed as dist

    if world == 1:
        return
    host, port = args.store.rsplit(":", 1)
    store = dist.PrefixStore(side, dist.TCPStore(host, int(port), is_master=False))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _digest(state) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _probe(model):
    """Logits on the fixed prompts (float32, CPU) and their greedy continuations."""
    import torch

    ids = torch.tensor(FIXED_PROMPTS, device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
        out = model.generate(
            ids,
            max_new_tokens=GREEDY_TOKENS,
            min_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
    return logits, out[:, ids.shape[1] :].tolist()


def _data_parallel(args, rank: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of trainer ``rank``."""
    if args.trainers == 1 or args.trainer == "tp":
        return 0, 1
    if args.trainer == "fsdp_tp":  # mesh (dp, tp=2): rank = dp_rank * 2 + tp_rank
        return rank // 2, args.trainers // 2
    return rank, args.trainers


def _prompts(args, step: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(TARGET, vocab, (args.prompts, args.prompt_len), generator=g)


# --------------------------------------------------------------------------------------------
# trainer


def _trainer(rank: int, args) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from weightbus import Writer
    from weightbus.engines import hf
    from weightbus.engines.torch_dist import (
        full_state_dict,
        fully_shard_model,
        mixes_dtensors,
        tensor_parallel,
    )

    torch.set_num_threads(1)
    n = args.trainers
    device = torch.device(_devices(args)[0][rank])
    _init_group(args, "trainer", rank, n, device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    if n > 1 and args.trainer == "fsdp":
        fully_shard_model(model, init_device_mesh(device.type, (n,)))
    elif n > 1 and args.trainer == "tp":
        tensor_parallel(model, init_device_mesh(device.type, (n,)))
    elif n > 1:
        mesh = init_device_mesh(device.type, (n // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        fully_shard_model(model, mesh["dp"])
    # plain norms beside DTensor weights (tensor parallel): torch's foreach kernels refuse them
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=not mixes_dtensors(model))
    control, sync = _configs(args)
    writer = Writer(hf.bind(model, "writer", rank), control, sync)
    plan = writer.connect()
    wait = timedelta(seconds=args.timeout)
    lead = rank == 0
    if lead:
        print(
            f"connected: {plan.stats.total_bytes / 1e6:.2f} MB per sync in "
            f"{plan.stats.buckets} buckets over {len(plan.stats.link_bytes)} links, transport "
            f"{writer.transport.name}\n",
            flush=True,
        )
        print(
            "step | rollouts from | reward | loss    | sync ms |    MB | engine at | weights "
            "| greedy | logits max|diff|",
            flush=True,
        )
    # data parallel over FSDP ranks: each takes its share of the prompt groups (tensor-parallel
    # ranks of one data-parallel rank take the same share)
    dp_rank, dp = _data_parallel(args, rank)
    first_reward = None
    ok = True
    for step in range(1, args.steps + 1):
        ro = writer.control.gather(f"rollouts/{step}", names=["reader-0"], timeout=wait)["reader-0"]
        tokens = torch.tensor(ro["tokens"], dtype=torch.long)  # (prompts * group, prompt + new)
        plen = ro["prompt_len"]
        done = tokens[:, plen:]
        reward = (done < TARGET).float().mean(dim=1)
        groups = reward.view(args.prompts, args.group)
        adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)
        share = args.prompts // dp * args.group
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        seq = tokens[mine].to(device)
        model.train()
        logits = model(input_ids=seq).logits[:, plen - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, seq[:, plen:, None]).squeeze(-1)
        loss = -(adv.reshape(-1)[mine].to(device)[:, None] * logp).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        result = writer.sync(step)
        # references for the engine's checks: the trainer's weights as bfloat16, run on one device
        state = full_state_dict(model, torch.bfloat16)  # collective
        mean = float(reward.mean())
        first_reward = mean if first_reward is None else first_reward
        if lead:
            ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
            ref = ref.to(device).eval()
            ref.load_state_dict(state)
            logits_ref, greedy = _probe(ref)
            del ref
            writer.control.post(
                f"reference/{step}",
                {
                    "digest": _digest(state),
                    "logits": logits_ref.numpy().tobytes(),
                    "shape": list(logits_ref.shape),
                    "greedy": greedy,
                },
            )
            check = writer.control.gather(f"check/{step}", names=["reader-0"], timeout=wait)
            c = check["reader-0"]
            ok &= c["ok"]
            weights = "exact" if c["weights"] else "DIFFER"
            greedy = "same" if c["greedy"] else "DIFFER"
            diff = "0 (exact)" if c["logit_diff"] == 0 else f"{c['logit_diff']:.3g}"
            if c["logit_diff"]:
                diff += f" ({c['logit_diff'] / c['logit_scale']:.2%} of max)"
            print(
                f"{step:>4} | v{ro['version']:<12} | {mean:6.3f} | {loss.item():+.4f} | "
                f"{result.seconds * 1e3:7.1f} | {plan.stats.total_bytes / 1e6:5.2f} | "
                f"v{c['version']:<8} | {weights:<7} | {greedy:<6} | {diff}",
                flush=True,
            )
    final = writer.control.gather(f"rollouts/{args.steps + 1}", names=["reader-0"], timeout=wait)
    final = final["reader-0"]
    writer.close()
    if lead:
        done = torch.tensor(final["tokens"])[:, final["prompt_len"] :]
        after = float((done < TARGET).float().mean())
        print(
            f"\nrollouts with v{final['version']}: reward {after:.3f} "
            f"(step 1 rollouts, v0: {first_reward:.3f})"
        )
        print(
            f"rl_loop {'ok' if ok else 'FAILED'}: mode={args.mode} device={args.device} "
            f"trainer={args.trainer}x{n} engine_tp={args.engine_tp} steps={args.steps} "
            f"reward {first_reward:.3f} -> {after:.3f}",
            flush=True,
        )
        if not ok:
            raise SystemExit(1)


# --------------------------------------------------------------------------------------------
# inference engine


def _engine(rank: int, args) -> None:
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # transformers' TP loads onto any GPU it sees
    import torch
    from transformers import AutoModelForCausalLM

    from weightbus import Reader
    from weightbus.engines import hf
    from weightbus.engines.torch_dist import full_state_dict, load_tensor_parallel

    torch.set_num_threads(1)
    tp = args.engine_tp
    device = torch.device(_devices(args)[1][rank])
    _init_group(args, "engine", rank, tp, device)
    if tp > 1:
        model = load_tensor_parallel(args.model, dtype=torch.bfloat16, device=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        model = model.to(device).eval()
    control, sync = _configs(args)
    reader = Reader(hf.bind(model, "reader", rank), control, sync)
    reader.connect()
    wait = timedelta(seconds=args.timeout)
    version = 0  # the checkpoint both sides loaded
    vocab = model.config.vocab_size
    for step in range(1, args.steps + 2):
        prompts = _prompts(args, step, vocab).to(device).repeat_interleave(args.group, dim=0)
        torch.manual_seed(1000 + step)  # every tensor-parallel rank draws the same samples
        with torch.no_grad():
            out = model.generate(
                prompts,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                attention_mask=torch.ones_like(prompts),
                pad_token_id=0,
            )
        if rank == 0:
            reader.control.post(
                f"rollouts/{step}",
                {"version": version, "tokens": out.tolist(), "prompt_len": args.prompt_len},
            )
        if step > args.steps:
            break
        result = reader.wait()
        version = result.version
        # checks: the weights are the trainer's, and the engine computes with them
        state = full_state_dict(model, torch.bfloat16)  # collective over the engine's ranks
        logits, greedy = _probe(model)
        if rank == 0:
            ref = reader.control.gather(f"reference/{step}", names=["writer-0"], timeout=wait)
            ref = ref["writer-0"]
            want = torch.frombuffer(bytearray(ref["logits"]), dtype=torch.float32)
            want = want.view(ref["shape"])
            diff = float((logits - want).abs().max())
            scale = float(want.abs().max())
            weights = _digest(state) == ref["digest"]
            same = greedy == ref["greedy"]
            # one device: the same computation as the trainer's reference, so exactly equal
            close = diff <= args.logit_tolerance * scale if tp > 1 else diff == 0 and same
            ok = weights and close
            reader.control.post(
                f"check/{step}",
                {
                    "version": version,
                    "weights": weights,
                    "greedy": same,
                    "logit_diff": diff,
                    "logit_scale": scale,
                    "ok": ok,
                },
            )
    reader.close()


# --------------------------------------------------------------------------------------------
# launcher


def _child(kind: str, rank: int, args) -> None:
    try:
        (_trainer if kind == "trainer" else _engine)(rank, args)
    except SystemExit:
        raise
    except BaseException:
        print(f"{kind}-{rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--trainers", type=int, default=2, help="trainer processes (default 2)")
    p.add_argument(
        "--trainer",
        choices=["fsdp", "tp", "fsdp_tp"],
        default="fsdp",
        help="how the trainer shards: FSDP2, tensor parallel, or FSDP2 x TP 2 (2-D)",
    )
    p.add_argument(
        "--engine-tp",
        type=int,
        default=2,
        help="engine tensor-parallel ranks (1: one device; default 2)",
    )
    p.add_argument("--model", default=None, help="local checkpoint (default: a tiny Llama)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument(
        "--logit-tolerance",
        type=float,
        default=0.02,
        help="largest logit difference a tensor-parallel engine may show, as a fraction of the "
        "largest logit (default 0.02)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait may take")
    args = p.parse_args(argv)
    if args.trainer == "fsdp_tp" and args.trainers % 2:
        p.error("--trainer fsdp_tp needs an even number of --trainers")
    dp = _data_parallel(args, 0)[1]
    if args.prompts % dp:
        p.error(f"--prompts {args.prompts} must divide evenly over {dp} data-parallel ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist

    if args.device == "cuda":
        need = max(args.trainers, args.engine_tp)
        if args.mode == "disaggregated":
            need = args.trainers + args.engine_tp
        if torch.cuda.device_count() < need:
            p.error(f"{args.mode} needs {need} GPUs, found {torch.cuda.device_count()}")
    tmp = tempfile.TemporaryDirectory(prefix="weightbus-rl-")
    if args.model is None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(_tiny_config()).save_pretrained(Path(tmp.name) / "init")
        args.model = str(Path(tmp.name) / "init")
    trainer_devices, engine_devices = _devices(args)
    print(
        f"rl_loop: {args.mode}, trainer {args.trainer} x {args.trainers} on {trainer_devices} "
        f"(float32, AdamW), engine transformers tp {args.engine_tp} on {engine_devices} "
        f"(bfloat16); {args.prompts} prompts x {args.group} samples x {args.new_tokens} tokens "
        "per step",
        flush=True,
    )
    port = _free_port()
    args.store = f"127.0.0.1:{port}"
    server = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.timeout),
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=("trainer", r, args), name=f"trainer-{r}")
        for r in range(args.trainers)
    ]
    procs += [
        ctx.Process(target=_child, args=("engine", r, args), name=f"engine-{r}")
        for r in range(args.engine_tp)
    ]
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout * (args.steps + 2)
    failed = ""
    while any(proc.is_alive() for proc in procs) and not failed:
        failed = next(
            (
                f"{q.name} exited with code {q.exitcode}"
                for q in procs
                if q.exitcode not in (None, 0)
            ),
            "",
        )
        if time.monotonic() > deadline:
            failed = "timed out"
        time.sleep(0.1)
    for proc in procs:
        proc.join(timeout=5 if failed else 60)
        if proc.is_alive():
            proc.kill()
            failed = failed or f"{proc.name} did not finish"
        elif proc.exitcode and not failed:
            failed = f"{proc.name} exited with code {proc.exitcode}"
    del server
    tmp.cleanup()
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    if failed:
        print(f"rl_loop FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
