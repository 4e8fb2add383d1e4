"""Checkpoint and host-memory sources: safetensors shards into differently sharded readers.

Every receiving tensor is poisoned (NaN) first and compared bit for bit afterwards. CPU tests run
the real Writer/Reader over gloo in separate processes; ``gpu`` tests (skipped without CUDA)
stage pinned host memory to each GPU and pull over CUDA IPC.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import tempfile
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tests.procs import collect_reports
from weightbus import BoundLayout, Participant
from weightbus.layouts.families import model_spec
from weightbus.layouts.fused import engine_layout
from weightbus.plan import allocate, fill_from_canonical
from weightbus.sources import (
    HostCheckpoint,
    checkpoint_files,
    load_into,
    open_checkpoint,
    read_header,
    split_rows,
)
from weightbus.sources.checkpoint import _Entry
from weightbus.spec import TensorSpec

pytestmark = pytest.mark.timeout(120)

SHM = Path("/dev/shm")


def _canonical(model, version: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) * 100 + version)
        out[t.name] = torch.randn(t.shape, generator=g).to(torch.bfloat16)
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose bytes differ."""
    return [
        k
        for k in want
        if not torch.equal(got[k].detach().cpu().view(torch.uint8), want[k].cpu().view(torch.uint8))
    ]


@pytest.fixture
def shm_dir():
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir=SHM, prefix="weightbus-test-") as d:
        yield Path(d)


# ---------------------------------------------------------------------------------------------
# pure: headers, shards
# ---------------------------------------------------------------------------------------------


def test_split_rows_covers_every_byte_once_in_order():
    specs = [
        TensorSpec(name="emb", shape=(1000, 64), dtype="bfloat16"),
        TensorSpec(name="norm", shape=(64,), dtype="float32"),
        TensorSpec(name="scale", shape=(), dtype="float32"),
        TensorSpec(name="empty", shape=(0, 8), dtype="bfloat16"),
        TensorSpec(name="w", shape=(333, 7), dtype="float32"),
    ]
    entries, at = [], 0
    for s in specs:
        entries.append(_Entry(spec=s, file=0, begin=at))
        at += s.nbytes
    total = sum(s.nbytes for s in specs)
    for runs in (1, 2, 3, 7, 16):
        parts = split_rows(entries, runs)
        flat = [p for run in parts for p in run]
        # contiguous, in file order, no gaps, no overlaps
        assert [p.begin for p in flat] == [0] + [p.begin + p.nbytes for p in flat[:-1]]
        assert sum(p.nbytes for p in flat) == total
        sizes = [sum(p.nbytes for p in run) for run in parts]
        biggest_row = 64 * 2  # a cut moves at most half a row of the largest row size either way
        assert max(sizes) - min(sizes) <= 2 * biggest_row + 4 * 7, (runs, sizes)
        for p in flat:
            assert p.start < p.stop and p.spec.name != "empty"
            row = p.spec.nbytes // (p.spec.shape[0] if p.spec.shape else 1)
            assert p.nbytes == (p.stop - p.start) * row


def test_read_header_and_files(tmp_path):
    t = {"b": torch.ones(3, 2, dtype=torch.bfloat16), "a": torch.arange(5, dtype=torch.int64)}
    save_file(t, tmp_path / "x.safetensors")
    start, tensors = read_header(tmp_path / "x.safetensors")
    assert start % 8 == 0
    assert {s.name: (s.shape, s.dtype) for s, _ in tensors} == {
        "a": ((5,), "int64"),
        "b": ((3, 2), "bfloat16"),
    }
    assert checkpoint_files(tmp_path) == [tmp_path / "x.safetensors"]

    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match=r"'w'.*needs 32 bytes.*damaged"):
        read_header(bad)
    odd = tmp_path / "odd.safetensors"
    header = json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    odd.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="dtype C64"):
        read_header(odd)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_files(tmp_path / "missing.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        checkpoint_files(empty)


def test_dev_shm_files_are_mapped_in_place_others_copied(shm_dir, tmp_path):
    model = model_spec("tiny-llama")
    canon = _canonical(model)
    save_file(canon, shm_dir / "model.safetensors")
    save_file(canon, tmp_path / "model.safetensors")
    mapped = open_checkpoint(shm_dir, rank=1, world=2, pin=False)
    copied = open_checkpoint(tmp_path, rank=1, world=2, pin=False)
    assert mapped.in_place and not copied.in_place
    part = mapped.parts[0][-1]
    for ck in (mapped, copied):
        assert torch.equal(ck.view(part), canon[part.spec.name][part.start : part.stop])
    # write new bytes into the file: the mapped shard sees them, the copy does not
    start, tensors = read_header(shm_dir / "model.safetensors")
    begin = dict((s.name, b) for s, b in tensors)[part.spec.name]
    with open(shm_dir / "model.safetensors", "r+b") as f:
        f.seek(start + part.begin)
        f.write(b"\xc0\x7f" * (part.nbytes // 2))  # bfloat16 NaN, little-endian
    assert part.begin >= begin
    assert torch.isnan(mapped.view(part).float()).all()
    assert not torch.isnan(copied.view(part).float()).any()
    mapped.close()
    copied.close()


# ---------------------------------------------------------------------------------------------
# in one process: a checkpoint straight into an engine's live tensors
# ---------------------------------------------------------------------------------------------


def test_load_into_fused_tensor_parallel_from_sharded_files(tmp_path):
    """A checkpoint in several files (with an index) into vLLM-style fused tp=2 engines."""
    model = model_spec("tiny-llama")
    canon = _canonical(model)
    names = list(canon)
    weight_map = {}
    for i, chunk in enumerate((names[:7], names[7:15], names[15:])):
        fname = f"model-0000{i + 1}-of-00003.safetensors"
        save_file({n: canon[n] for n in chunk}, tmp_path / fname)
        weight_map.update({n: fname for n in chunk})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for rank in range(2):
        layout = engine_layout(
            model, Participant(role="reader", rank=rank), tp=2, tp_rank=rank, dtype="bfloat16"
        )
        tensors = allocate(layout)  # NaN
        ids = {k: t.data_ptr() for k, t in tensors.items()}
        moved = load_into(tmp_path, BoundLayout(layout=layout, tensors=tensors))
        want = allocate(layout)
        fill_from_canonical(layout, canon, want)
        assert _same(tensors, want) == []
        assert moved == layout.nbytes
        assert {k: t.data_ptr() for k, t in tensors.items()} == ids


def _tiny_hf(kind: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(cfg).to(torch.bfloat16)
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
    )
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_load_save_pretrained_into_running_engine_in_place(tmp_path, kind):
    """save_pretrained's directory into another instance's live parameters (MoE: the engine
    holds fused 3-D experts, the checkpoint one tensor per expert), bit for bit, in place."""
    pytest.importorskip("transformers")
    from weightbus.engines import hf

    trained = _tiny_hf(kind, seed=1)
    trained.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(checkpoint_files(tmp_path)) > 1
    engine = _tiny_hf(kind, seed=2)
    params = dict(engine.named_parameters())
    ids = {k: p.data_ptr() for k, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    bound = hf.bind(engine, "reader", 0)
    load_into(tmp_path, bound)
    assert {k: p.data_ptr() for k, p in engine.named_parameters()} == ids
    assert _same(dict(engine.state_dict()), dict(trained.state_dict())) == []
    tokens = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(engine(tokens).logits, trained(tokens).logits)


# ---------------------------------------------------------------------------------------------
# across processes, over gloo
# ---------------------------------------------------------------------------------------------


def _configs(port: int, job: str, n_w: int, n_r: int):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=n_w,
        num_readers=n_r,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=60),
        heartbeat_interval=timedelta(seconds=0.2),
        heartbeat_timeout=timedelta(seconds=5),
    )
    sync = SyncConfig(
        bucket_bytes=1 << 20,
        staging_buffers=2,
        direct_bytes=4096,
        sync_timeout=timedelta(seconds=30),
        step_timeout=timedelta(seconds=60),
        transport="gloo",
    )
    return control, sync


def _source(rank: int, port: int, ckpt_dir: str, spec: dict, q) -> None:
    """One source process: shard ``rank`` of the checkpoint, served in each job of ``spec``."""
    try:
        from weightbus.sources import HostSource, SourceConfig, open_checkpoint

        torch.set_num_threads(1)
        ckpt = open_checkpoint(
            ckpt_dir, rank=rank, world=spec["world"], chunks=spec["chunks"], pin=False
        )
        notes = [f"in_place={ckpt.in_place}"]
        for job, n_r, versions in spec["jobs"]:
            control, sync = _configs(port, job, spec["world"] * spec["chunks"], n_r)
            stage = spec["stage"][rank]
            source = HostSource(ckpt, control, sync, SourceConfig(stage=stage))
            source.connect()
            for v in versions:
                result = source.sync(v)
                notes.append(f"{job} v{v} {result.bytes}B stage={result.phases['stage'] > 0}")
            source.close()
        ckpt.close()
        q.put((f"source-{rank}", "ok", "; ".join(notes)))
    except BaseException as exc:
        q.put((f"source-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _reader(rank: int, port: int, ckpt_dir: str, spec: dict, q) -> None:
    """A vLLM-style fused engine rank; ``spec['readers'][name]`` says its job, rank and tp, and
    whether it keeps serving (stays connected, tensors untouched) after its first sync."""
    name = f"reader-{rank}"
    try:
        from safetensors.torch import load_file

        from weightbus import BoundLayout, Participant, Reader
        from weightbus.plan import allocate, fill_from_canonical, poison
        from weightbus.sources import checkpoint_files

        torch.set_num_threads(1)
        job, job_rank, tp, n_r, versions, serve = spec["readers"][name]
        model = model_spec(spec["model"])
        canon = {}
        for f in checkpoint_files(ckpt_dir):
            canon.update(load_file(f))
        layout = engine_layout(
            model,
            Participant(role="reader", rank=job_rank, name=name),
            tp=tp,
            tp_rank=job_rank % tp,
            dtype="bfloat16",
        )
        tensors = allocate(layout)
        want = allocate(layout)
        fill_from_canonical(layout, canon, want)
        control, sync = _configs(port, job, spec["world"] * spec["chunks"], n_r)
        reader = Reader(BoundLayout(layout=layout, tensors=tensors), control, sync)
        reader.connect()
        bad = []
        for v in versions:
            for t in tensors.values():
                poison(t)
            result = reader.wait()
            if result.version != v:
                bad.append(f"got version {result.version}, expected {v}")
            bad += [f"v{v} {k}" for k in _same(tensors, want)]
        if serve:
            # keep serving while the source loads a new replica in another job: the engine's
            # tensors must not change, and this reader must see no sync begin
            before = {k: t.clone() for k, t in tensors.items()}
            store = dist.TCPStore("127.0.0.1", port, is_master=False)
            store.wait(["test/replica-loaded"], timedelta(seconds=60))
            bad += [f"changed while serving: {k}" for k in _same(tensors, before)]
            if reader.version != versions[-1]:
                bad.append(f"version moved to {reader.version}")
        elif spec.get("signal") == name:
            dist.TCPStore("127.0.0.1", port, is_master=False).set("test/replica-loaded", "1")
        reader.close()
        status = "ok" if not bad else "wrong"
        q.put((name, status, f"versions {versions} mismatches {bad[:5]}"))
    except BaseException as exc:
        q.put((name, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _run(spec: dict, ckpt_dir: str, limit: float = 90.0) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_source, args=(r, store.port, ckpt_dir, spec, q))
        for r in range(spec["world"])
    ]
    procs += [
        ctx.Process(target=_reader, args=(int(n.split("-")[1]), store.port, ckpt_dir, spec, q))
        for n in spec["readers"]
    ]
    for p in procs:
        p.start()
    results = collect_reports(procs, q, len(procs), limit).got
    assert len(results) == len(procs), f"missing reports: {results}"
    return results


def _write_checkpoint(directory: Path, model_name: str) -> None:
    model = model_spec(model_name)
    save_file(_canonical(model), directory / "model.safetensors", metadata={"format": "pt"})


def test_sharded_sources_into_fused_tensor_parallel_readers(shm_dir):
    """2 source processes, each a shard of a /dev/shm checkpoint in 2 chunks (4 writers): one
    serves its mapped memory in place, the other stages it into a copy at every sync. Readers
    are a vLLM-style tp=2 engine, poisoned before each of 2 syncs."""
    _write_checkpoint(shm_dir, "tiny-llama")
    spec = {
        "model": "tiny-llama",
        "world": 2,
        "chunks": 2,
        "stage": [False, True],
        "jobs": [("fleet", 2, [1, 2])],
        "readers": {
            "reader-0": ("fleet", 0, 2, 2, [1, 2], False),
            "reader-1": ("fleet", 1, 2, 2, [1, 2], False),
        },
    }
    results = _run(spec, str(shm_dir))
    assert all(s == "ok" for s, _ in results.values()), results
    assert "in_place=True" in results["source-0"][1]
    assert "stage=False" in results["source-0"][1] and "stage=True" in results["source-1"][1]


def test_new_replica_loads_from_the_same_host_memory_while_others_serve(shm_dir):
    """A source serves the fleet (one replica), then, on the same host memory, a job of its own
    with only a new replica; the serving replica stays connected and untouched meanwhile."""
    _write_checkpoint(shm_dir, "tiny-llama")
    spec = {
        "model": "tiny-llama",
        "world": 1,
        "chunks": 1,
        "stage": [False],
        "jobs": [("fleet", 1, [1]), ("join", 1, [7])],
        "readers": {
            "reader-0": ("fleet", 0, 1, 1, [1], True),
            "reader-1": ("join", 0, 1, 1, [7], False),
        },
        "signal": "reader-1",
    }
    results = _run(spec, str(shm_dir))
    assert all(s == "ok" for s, _ in results.values()), results


# ---------------------------------------------------------------------------------------------
# GPU: pinned host memory staged to every GPU, pulled over CUDA IPC
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_gpu_dev_shm_registered_in_place_and_loaded(shm_dir):
    model = model_spec("tiny-llama")
    canon = _canonical(model)
    save_file(canon, shm_dir / "model.safetensors")
    ckpt = open_checkpoint(shm_dir, pin=True)
    assert ckpt.in_place and ckpt.pinned
    part = ckpt.parts[0][0]
    view = ckpt.view(part)  # keeps the mapping alive after close
    assert view.is_pinned()
    layout = engine_layout(model, Participant(role="reader", rank=0, device="cuda:0"))
    tensors = allocate(layout, device="cuda:0")
    load_into(ckpt, BoundLayout(layout=layout, tensors=tensors))
    want = allocate(layout)
    fill_from_canonical(layout, canon, want)
    assert _same(tensors, want) == []
    ckpt.close()
    assert not view.is_pinned()  # unregistered, still mapped


def _gpu_source(rank: int, port: int, ckpt_dir: str, world: int, chunks: int, q) -> None:
    try:
        from weightbus.sources import HostSource, SourceConfig, open_checkpoint

        torch.cuda.set_device(rank)
        ckpt = open_checkpoint(ckpt_dir, rank=rank, world=world, chunks=chunks, pin=True)
        control, sync = _configs(port, "gpu", world * chunks, world)
        sync = dataclasses.replace(sync, transport="auto")
        source = HostSource(ckpt, control, sync, SourceConfig(device=f"cuda:{rank}"))
        source.connect()
        for v in (1, 2):
            source.sync(v)
        transport = source.writers[0].transport.name
        source.close()
        ckpt.close()
        q.put((f"source-{rank}", "ok", transport))
    except BaseException as exc:
        q.put((f"source-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _gpu_reader(rank: int, port: int, ckpt_dir: str, world: int, chunks: int, q) -> None:
    try:
        from safetensors.torch import load_file

        from weightbus import BoundLayout, Participant, Reader
        from weightbus.plan import allocate, fill_from_canonical, poison

        torch.cuda.set_device(rank)
        model = model_spec("tiny-llama")
        canon = load_file(Path(ckpt_dir) / "model.safetensors")
        me = Participant(role="reader", rank=rank, device=f"cuda:{rank}")
        layout = engine_layout(model, me, dtype="bfloat16")
        tensors = allocate(layout, device=f"cuda:{rank}")
        want = allocate(layout)
        fill_from_canonical(layout, canon, want)
        control, sync = _configs(port, "gpu", world * chunks, world)
        sync = dataclasses.replace(sync, transport="auto")
        reader = Reader(BoundLayout(layout=layout, tensors=tensors), control, sync)
        reader.connect()
        bad = []
        for _ in range(2):
            for t in tensors.values():
                poison(t)
            torch.cuda.synchronize()
            reader.wait()
            bad += _same(tensors, want)
        reader.close()
        q.put((f"reader-{rank}", "ok" if not bad else "wrong", f"mismatches {bad[:5]}"))
    except BaseException as exc:
        q.put((f"reader-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(240)
def test_gpu_pinned_shards_staged_to_every_gpu_full_replicas(shm_dir):
    """One source per GPU (its shard of a /dev/shm checkpoint, page-locked in place, 2 chunks)
    and one full fused replica per GPU: every GPU ends with the whole model, bit for bit."""
    world = min(torch.cuda.device_count(), 4)
    _write_checkpoint(shm_dir, "tiny-llama")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=fn, args=(r, store.port, str(shm_dir), world, 2, q))
        for fn in (_gpu_source, _gpu_reader)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = collect_reports(procs, q, len(procs), 200, join_s=5).got
    assert len(results) == len(procs) and all(s == "ok" for s, _ in results.values()), results
    assert results["source-0"][1] == "cuda_ipc"


def test_host_checkpoint_from_tensors_shards_rows():
    model = model_spec("tiny-llama")
    canon = _canonical(model)
    got = {}
    for r in range(3):
        ck = HostCheckpoint.from_tensors(canon, rank=r, world=3, chunks=2, pin=False)
        for c in range(2):
            for p in ck.parts[c]:
                got.setdefault(p.spec.name, []).append((p.start, ck.view(p).clone()))
    for name, rows in got.items():
        rows.sort(key=lambda x: x[0])
        assert torch.equal(torch.cat([t for _, t in rows]), canon[name])
