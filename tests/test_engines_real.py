"""Real engines on both sides: torch.distributed trainers -> transformers inference, end to end.

Trainers load a small Llama-style checkpoint (tied embeddings) in float32 and shard it with
FSDP2 (``fully_shard``), tensor parallelism (``parallelize_module``) or both on a 2-D mesh,
take AdamW steps and sync after each, cast to bfloat16 on the wire. Engines are transformers
models in bfloat16: tensor parallel as ``from_pretrained(tp_plan="auto")`` loads them (DTensor
shards), or on one device. Every engine tensor is poisoned (NaN) before each sync. After each
sync every engine checks, against a checkpoint trainer rank 0 writes from the trainer's own
weights cast to bfloat16:

* every local shard equals its region of that checkpoint, bit for bit;
* it received exactly the bytes it holds: the plan's statistics, its buckets' regions and its
  local shards agree, and the bytes on the wire exceed them only by the buckets' alignment;
* the tied head is still the embedding, and its logits and greedy generation on fixed prompts
  equal, bit for bit, those of the same engine loaded fresh from that checkpoint (for a
  single-device engine, those of the trainer's model cast to bfloat16).

Starting processes is the slow part on CPU, so each group of scenarios runs one job after the
other in the same processes (a module fixture) and each test checks one job. The CPU scenarios
run over gloo in CI (marker ``engines``); the GPU ones (markers ``gpu`` and ``engines``) need 4
CUDA GPUs and use the transport chosen automatically (CUDA IPC on one host):

    python -m pytest -q -m gpu tests/test_engines_real.py
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engines
pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads tp_plan='auto' models with it")

PROMPTS = [[1, 2, 3, 4, 5, 6], [40, 41, 42, 43, 44, 45], [7, 100, 7, 100, 7, 100]]
NEW_TOKENS = 6
STEPS = 2


def _scenario(name, trainer, trainer_devices, reader_devices, reader_tp):
    return {
        "name": name,
        "trainer": trainer,  # "fsdp", "tp" or "fsdp_tp" (FSDP2 over TP on a (dp, 2) mesh)
        "trainer_devices": list(trainer_devices),
        "reader_devices": list(reader_devices),
        "reader_tp": reader_tp,  # the readers are one tensor-parallel engine, else replicas
    }


CPU_SCENARIOS = [
    _scenario("fsdp-to-tp", "fsdp", ["cpu"] * 2, ["cpu"] * 2, True),
    _scenario("tp-to-single", "tp", ["cpu"] * 2, ["cpu"], False),
    _scenario("fsdp_tp-to-tp", "fsdp_tp", ["cpu"] * 4, ["cpu"] * 2, True),
]
GPU_SCENARIOS = [
    # the acceptance pairing: FSDP2 on GPUs 0-1 -> transformers tensor parallel on GPUs 2-3
    _scenario("gpu-fsdp-to-tp", "fsdp", ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"], True),
    _scenario("gpu-tp-to-single", "tp", ["cuda:0", "cuda:1"], ["cuda:2"], False),
    # 2-D trainer on all 4 GPUs, engine colocated on GPUs 0-1 (same-GPU copies)
    _scenario(
        "gpu-fsdp_tp-colocated",
        "fsdp_tp",
        [f"cuda:{i}" for i in range(4)],
        ["cuda:0", "cuda:1"],
        True,
    ),
]


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def _configs(port: int, sc: dict):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=len(sc["trainer_devices"]),
        num_readers=len(sc["reader_devices"]),
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=sc["name"],
        timeout=timedelta(seconds=90),
        heartbeat_interval=timedelta(seconds=0.5),
        heartbeat_timeout=timedelta(seconds=20),
    )
    sync = SyncConfig(
        cast={"float32": "bfloat16"},
        bucket_bytes=1 << 20,
        direct_bytes=16 << 10,
        sync_timeout=timedelta(seconds=90),
        connect_timeout=timedelta(seconds=90),
        step_timeout=timedelta(seconds=120),
    )
    return control, sync


def _init_group(port: int, prefix: str, rank: int, world: int, device: torch.device) -> None:
    import torch.distributed as dist

    store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _probe(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits on the fixed prompts, and the greedy continuation of each."""
    ids = torch.tensor(PROMPTS, device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
        out = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
    return logits, out[:, ids.shape[1] :].cpu().contiguous()


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _placements(model) -> list[str]:
    return sorted(
        {str(tuple(p.placements)) for p in model.parameters() if hasattr(p, "placements")}
    )


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _train(sc: dict, rank: int, port: int, out: Path) -> dict:
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from weightbus import Writer
    from weightbus.engines import hf
    from weightbus.engines.torch_dist import (
        full_state_dict,
        fully_shard_model,
        mixes_dtensors,
        tensor_parallel,
    )

    n = len(sc["trainer_devices"])
    device = torch.device(sc["trainer_devices"][rank])
    _init_group(port, f"{sc['name']}/trainer", rank, n, device)
    model = LlamaForCausalLM.from_pretrained(out / "init", dtype=torch.float32).to(device)
    if sc["trainer"] == "fsdp":
        fully_shard_model(model, init_device_mesh(device.type, (n,)))
    elif sc["trainer"] == "tp":
        tensor_parallel(model, init_device_mesh(device.type, (n,)))
    else:
        mesh = init_device_mesh(device.type, (n // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        fully_shard_model(model, mesh["dp"])
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("the trainer's embeddings came untied")
    # plain norms beside DTensor weights: torch's foreach kernels (CUDA's default) refuse them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=not mixes_dtensors(model))
    control, sync = _configs(port, sc)
    writer = Writer(hf.bind(model, "writer", rank), control, sync)
    plan = writer.connect()
    gen = torch.Generator().manual_seed(rank // 2 if sc["trainer"] == "fsdp_tp" else rank)
    for step in range(1, STEPS + 1):
        batch = torch.randint(0, 512, (4, 16), generator=gen).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the engines poison their tensors, then say they are ready for this version
        writer.control.gather(f"ready/{step}", role="reader")
        result = writer.sync(step)
        state = full_state_dict(model, torch.bfloat16)  # collective: every rank calls it
        if rank == 0:
            # built as an engine builds it (rotary frequencies stay float32)
            ref = AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)
            ref = ref.to(device).eval()
            ref.load_state_dict(state)
            ref.save_pretrained(out / f"ref-{step}")
            logits, tokens = _probe(ref)
            save_file({"logits": logits, "tokens": tokens}, str(out / f"probe-{step}.st"))
            writer.control.post(f"ref/{step}", {})
    writer.close()
    s = plan.stats
    return {
        "placements": _placements(model),
        "reader_bytes": list(s.reader_bytes),
        "writer_bytes": list(s.writer_bytes),
        "total": s.total_bytes,
        "links": [list(x) for x in s.link_bytes],
        "sent": result.bytes,
        # replicated tensors must stay equal on every rank (gradients reduced over TP)
        "norms": [float(v.float().sum()) for k, v in state.items() if "norm" in k],
        "transport": writer.transport.name,
    }


def _serve(sc: dict, rank: int, port: int, out: Path) -> dict:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from weightbus import Reader
    from weightbus.engines import hf
    from weightbus.engines.torch_dist import load_tensor_parallel
    from weightbus.plan import allocate, fill_from_canonical, poison

    tp = sc["reader_tp"]
    device = torch.device(sc["reader_devices"][rank])

    def load(path):
        if tp:
            return load_tensor_parallel(path, dtype=torch.bfloat16, device=device)
        return LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()

    if tp:
        _init_group(port, f"{sc['name']}/engine", rank, len(sc["reader_devices"]), device)
    model = load(out / "init")
    bound = hf.bind(model, "reader", rank)
    live = {k: id(t) for k, t in bound.tensors.items()}
    held = sum(t.numel() * t.element_size() for t in bound.tensors.values())
    control, sync = _configs(port, sc)
    reader = Reader(bound, control, sync)
    plan = reader.connect()
    bad: list = []
    # the bytes of the regions this reader's buckets carry; on the wire each region starts at an
    # aligned offset of its bucket, so a bucket exceeds them by less than that per region
    copies = [c for op in reader.ops for c in op.copies]
    payload = sum(c.nbytes for c in copies)
    if not plan.stats.reader_bytes[rank] == payload == held == bound.layout.nbytes:
        bad.append(("bytes", plan.stats.reader_bytes[rank], payload, held, bound.layout.nbytes))
    if not 0 <= reader.bytes_per_sync - held < plan.options.align * len(copies):
        bad.append(("wire bytes", reader.bytes_per_sync, held, len(copies)))
    logit_diff = []
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            for t in bound.tensors.values():
                poison(t)
        reader.control.post(f"ready/{step}", {})
        result = reader.wait()
        if result.version != step or result.bytes != reader.bytes_per_sync:
            bad.append(("result", step, result.version, result.bytes, reader.bytes_per_sync))
        reader.control.gather(f"ref/{step}", names=["writer-0"])
        want = allocate(bound.layout)
        fill_from_canonical(bound.layout, _load_dir(out / f"ref-{step}"), want)
        for key, t in bound.tensors.items():
            if not _bits_equal(t.cpu(), want[key]):
                bad.append(("bits", step, key))
        # the engine uses what it received
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            bad.append(("untied head", step))
        logits, tokens = _probe(model)
        trainer = load_file(str(out / f"probe-{step}.st"))
        if tp:
            # reduction order differs from one device: compare with the same engine, loaded fresh
            fresh_logits, fresh_tokens = _probe(load(out / f"ref-{step}"))
            if not _bits_equal(logits, fresh_logits) or not torch.equal(tokens, fresh_tokens):
                bad.append(("engine differs from a fresh load of the trainer's weights", step))
            logit_diff.append(float((logits - trainer["logits"]).abs().max()))
        elif not _bits_equal(logits, trainer["logits"]) or not torch.equal(
            tokens, trainer["tokens"]
        ):
            diff = float((logits - trainer["logits"]).abs().max())
            bad.append(("engine differs from the trainer", step, diff, tokens.tolist()))
    reader.close()
    if any(id(t) != live[k] for k, t in bound.tensors.items()):
        bad.append("engine tensors were replaced")
    return {
        "held": held,
        "whole": sum(t.nbytes for t in plan.tensors),
        "bad": bad[:8],
        "logit_diff": logit_diff,
        "placements": _placements(model),
    }


def _worker(role: str, rank: int, scenarios: list[dict], port: int, out: str, q) -> None:
    """Run this process's part of every scenario in turn; report each to ``q``."""
    name = f"{role}-{rank}"
    if all("cuda" not in d for sc in scenarios for d in sc["reader_devices"]):
        # transformers puts a tensor-parallel model on any accelerator it finds
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    for sc in scenarios:
        devices = sc["trainer_devices" if role == "writer" else "reader_devices"]
        if rank >= len(devices):
            continue
        try:
            run = _train if role == "writer" else _serve
            info = run(sc, rank, port, Path(out) / sc["name"])
            status = "ok" if not info.get("bad") else "wrong"
            q.put((sc["name"], name, status, info))
        except BaseException as exc:
            q.put((sc["name"], name, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
        finally:
            _leave_group()


def _run_all(tmp_path: Path, scenarios: list[dict], limit: float = 400.0) -> dict:
    """Run the scenarios in one pool of processes; ``{scenario: {participant: (status, info)}}``."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    init = LlamaForCausalLM(_config())
    for sc in scenarios:
        init.save_pretrained(tmp_path / sc["name"] / "init")  # float32, what both sides load
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    n_w = max(len(sc["trainer_devices"]) for sc in scenarios)
    n_r = max(len(sc["reader_devices"]) for sc in scenarios)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (scenarios, store.port, str(tmp_path), q)
    procs = [ctx.Process(target=_worker, args=("writer", r, *args)) for r in range(n_w)]
    procs += [ctx.Process(target=_worker, args=("reader", r, *args)) for r in range(n_r)]
    expected = sum(len(sc["trainer_devices"]) + len(sc["reader_devices"]) for sc in scenarios)
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    results: dict = {sc["name"]: {} for sc in scenarios}
    got = 0
    deadline = time.monotonic() + limit
    try:
        while got < expected and time.monotonic() < deadline:
            try:
                job, who, status, info = q.get(timeout=0.5)
                results[job][who] = (status, info)
                got += 1
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


def _outcome(results: dict, sc: dict) -> dict:
    """The scenario's reports, after checking every participant reported ok."""
    got = results[sc["name"]]
    want = {f"writer-{r}" for r in range(len(sc["trainer_devices"]))}
    want |= {f"reader-{r}" for r in range(len(sc["reader_devices"]))}
    assert set(got) == want, f"{sc['name']}: reports from {sorted(got)}, expected {sorted(want)}"
    for who, (status, info) in got.items():
        assert status == "ok", (sc["name"], who, status, info)
    return {who: info for who, (_, info) in got.items()}


def _check_shares(out: dict, readers: int) -> None:
    """Each reader receives exactly what it holds, and the plan's figures add up."""
    w0 = out["writer-0"]
    assert w0["total"] == sum(w0["reader_bytes"]) == sum(w0["writer_bytes"])
    for r in range(readers):
        info = out[f"reader-{r}"]
        assert w0["reader_bytes"][r] == info["held"], (r, w0["reader_bytes"], info)
        linked = sum(b for _, dst, b in w0["links"] if dst == r)
        assert linked == info["held"], (r, linked, info["held"])
    norms = {tuple(out[w]["norms"]) for w in out if w.startswith("writer")}
    assert len(norms) == 1, f"replicated norms differ between trainer ranks: {norms}"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    return _run_all(tmp_path_factory.mktemp("engines-cpu"), CPU_SCENARIOS)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    if _gpus() < 4:
        pytest.skip(f"needs 4 CUDA GPUs, found {_gpus()}")
    return _run_all(tmp_path_factory.mktemp("engines-gpu"), GPU_SCENARIOS)


def _tp_engines_hold_half(out: dict) -> None:
    for r in range(2):
        held, whole = out[f"reader-{r}"]["held"], out[f"reader-{r}"]["whole"]
        # half of every sharded tensor, and the norms whole
        assert whole / 2 <= held < 0.51 * whole, (held, whole)
    assert "(Shard(dim=1),)" in out["reader-0"]["placements"]  # row-parallel o_proj, down_proj


@pytest.mark.timeout(600)
def test_fsdp2_trainers_to_transformers_tensor_parallel_engines(cpu_runs):
    """The acceptance pairing: FSDP2 on 2 ranks -> transformers tp_plan="auto" on 2 ranks."""
    out = _outcome(cpu_runs, CPU_SCENARIOS[0])
    _check_shares(out, 2)
    assert out["writer-0"]["placements"] == ["(Shard(dim=0),)"]
    _tp_engines_hold_half(out)


@pytest.mark.timeout(600)
def test_tensor_parallel_trainers_to_one_device_engine(cpu_runs):
    """parallelize_module on 2 ranks (tied embeddings kept tied) -> one transformers engine."""
    out = _outcome(cpu_runs, CPU_SCENARIOS[1])
    _check_shares(out, 1)
    assert out["reader-0"]["held"] == out["reader-0"]["whole"]
    placements = out["writer-0"]["placements"]
    assert "(Shard(dim=0),)" in placements and "(Shard(dim=1),)" in placements, placements
    # each trainer rank sends the shards it holds
    assert all(b > 0 for b in out["writer-0"]["writer_bytes"])


@pytest.mark.timeout(600)
def test_fsdp2_over_tensor_parallel_2d_mesh_to_tensor_parallel_engines(cpu_runs):
    """FSDP2 x TP on a 2 x 2 mesh (_StridedShard placements) -> TP 2 engines."""
    out = _outcome(cpu_runs, CPU_SCENARIOS[2])
    _check_shares(out, 2)
    placements = " ".join(out["writer-0"]["placements"])
    assert "_StridedShard" in placements, placements
    _tp_engines_hold_half(out)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_fsdp2_on_gpus_0_1_to_transformers_tensor_parallel_on_gpus_2_3(gpu_runs):
    out = _outcome(gpu_runs, GPU_SCENARIOS[0])
    _check_shares(out, 2)
    _tp_engines_hold_half(out)
    assert out["writer-0"]["transport"] == "cuda_ipc", out["writer-0"]["transport"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_tensor_parallel_trainers_to_one_device_engine(gpu_runs):
    out = _outcome(gpu_runs, GPU_SCENARIOS[1])
    _check_shares(out, 1)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_2d_trainer_to_colocated_tensor_parallel_engine(gpu_runs):
    out = _outcome(gpu_runs, GPU_SCENARIOS[2])
    _check_shares(out, 2)
    _tp_engines_hold_half(out)


# ---------------------------------------------------------------------------------------------
# the helpers on simulated ranks (one process, a fake process group): fast, no transfer


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        from torch.distributed.tensor import debug

        for clear in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):
            getattr(debug, clear, lambda: None)()  # not every torch has both caches


def _pieces(bound) -> set[tuple[str, str, str]]:
    return {(p.tensor, str(p.box), str(p.local_box)) for p in bound.layout.iter_pieces()}


def test_tensor_parallel_shards_like_transformers_and_keeps_the_tie():
    """A trainer sharded by tensor_parallel holds, on every rank, the same regions transformers'
    own tensor parallelism gives an engine (so a TP trainer sends each engine rank only its
    twin's shards), with lm_head and embed_tokens still one parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from weightbus.engines import hf
    from weightbus.engines.torch_dist import tensor_parallel

    tp = pytest.importorskip("transformers.distributed.tensor_parallel")
    torch.manual_seed(0)
    base = LlamaForCausalLM(_config())
    if not hasattr(tp, "apply_tensor_parallelism") or not hasattr(base, "_expand_parallel_plan"):
        pytest.skip("this transformers has no apply_tensor_parallelism")
    for rank in range(2):
        with _fake_rank(rank, 2):
            mesh = init_device_mesh("cpu", (2,))
            trainer = copy.deepcopy(base)
            styles = tensor_parallel(trainer, mesh)
            assert trainer.lm_head.weight is trainer.model.embed_tokens.weight
            assert set(styles) >= {"lm_head", "model.embed_tokens", "model.layers.1.mlp.down_proj"}
            engine = copy.deepcopy(base)
            plan = engine._expand_parallel_plan(dict(engine.tp_plan))
            names = set(dict(engine.named_modules())) | set(dict(engine.named_parameters()))
            tp.apply_tensor_parallelism(engine, mesh, {k: v for k, v in plan.items() if k in names})
            engine.tie_weights()
            mine = hf.bind(trainer, "writer", rank)
            theirs = hf.bind(engine, "reader", rank)
            assert mine.aliases == theirs.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
            assert _pieces(mine) == _pieces(theirs)
            assert (
                mine.layout.nbytes
                == theirs.layout.nbytes
                < 0.51 * sum(t.nbytes for t in mine.layout.tensors)
            )


def test_tensor_parallel_refuses_what_it_cannot_express():
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from weightbus.engines.torch_dist import fully_shard_model, parallel_styles, tensor_parallel

    model = LlamaForCausalLM(_config())
    with pytest.raises(ValueError, match="'sequence_parallel' for model.layers.0.mlp.up_proj"):
        parallel_styles(model, {"model.layers.*.mlp.up_proj": "sequence_parallel"})
    with _fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        # a tied head sharded over other dims than its embedding cannot stay one tensor
        with pytest.raises(ValueError, match=r"lm_head.weight is tied to model.embed_tokens"):
            tensor_parallel(
                copy.deepcopy(model),
                mesh,
                {"model.embed_tokens": "embedding_rowwise", "lm_head": "rowwise"},
            )
        with pytest.raises(ValueError, match="1-D mesh"):
            tensor_parallel(model, init_device_mesh("cpu", (1, 2)))
    with pytest.raises(ValueError, match="blocks="):
        fully_shard_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh=None)


def test_a_tied_embedding_left_out_of_the_plan_is_sharded_like_its_head():
    """Plans of older transformers shard lm_head but not the embedding tied to it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from transformers import LlamaForCausalLM

    from weightbus.engines.torch_dist import tensor_parallel

    model = LlamaForCausalLM(_config())
    plan = {k: v for k, v in model.tp_plan.items() if k != "model.embed_tokens"}
    plan["lm_head"] = "colwise_rep"
    with _fake_rank(1, 2):
        styles = tensor_parallel(model, init_device_mesh("cpu", (2,)), plan)
        assert "model.embed_tokens" in styles
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert tuple(model.lm_head.weight.placements) == (Shard(0),)
        assert model.lm_head.weight.to_local().shape == (256, 64)
