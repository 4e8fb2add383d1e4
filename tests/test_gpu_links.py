"""GPU tests: one job on one host mixing CUDA IPC and NCCL, chosen per link.

Engine replicas: writer-0 on cuda:0; reader-0 colocated with it on cuda:0 (a same_gpu link:
CUDA IPC, chosen automatically); reader-1 and reader-2 on cuda:1 and cuda:2 (same_host links,
forced to NCCL with ``SyncConfig(transport={"same_host": "nccl"})``).

Colocated resharding: FSDP writers on cuda:0 and cuda:1, tensor-parallel readers on cuda:0 and
cuda:2, every reader reading from both writers. writer-0 and reader-0 share cuda:0 (CUDA IPC
between them) and are both in the NCCL links' group (writer-0 -> reader-1, writer-1 ->
reader-0), which NCCL joins pair by pair and never the two of cuda:0. Every link is mixed
(row-parallel routes strided on the writers): the NCCL ones pack them, the CUDA IPC one not.

FSDP to tensor parallel over NCCL alone, two processes on each of two GPUs: writers on cuda:0,
readers on cuda:1, every link carrying row-parallel routes strided on its writer (mixed links),
which the job packs into buckets (``SyncConfig.pack_mixed``) or, with it off, sends alone.

Every participant is a process of its own; the readers' tensors are poisoned (NaN) before
every sync and compared bit for bit.

Marked ``gpu``; skipped without 3 CUDA GPUs (the FSDP jobs over NCCL alone: 2). Run with
``python -m pytest -m gpu tests/test_gpu_links.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
import uuid
import zlib
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu

MODEL = "tiny-llama"
SYNCS = 3
# per job: writers' GPUs, readers' GPUs, readers' tensor-parallel size (1: replicas),
# SyncConfig fields beyond those every job sets
NCCL_ALONE = {"transport": "nccl"}
JOBS = {
    "replicas": ([0], [0, 1, 2], 1, {}),
    "colocated": ([0, 1], [0, 2], 2, {}),
    "mixed-packed": ([0, 0], [1, 1], 2, NCCL_ALONE),
    "mixed-alone": ([0, 0], [1, 1], 2, NCCL_ALONE | {"pack_mixed": False}),
}


def _canonical(model, version: int, device) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) + 7919 * version)
        out[t.name] = torch.randn(t.shape, generator=g).to(device=device, dtype=torch.bfloat16)
    return out


def _worker(role: str, rank: int, gpu: int, port: int, job: str, shape: str, q) -> None:
    name = f"{role}-{rank}"
    writer_gpus, reader_gpus, tp, extra = JOBS[shape]
    try:
        from weightbus import BoundLayout, ControlConfig, Participant, Reader, SyncConfig, Writer
        from weightbus.layouts.families import model_spec
        from weightbus.layouts.fsdp import fsdp_layout
        from weightbus.layouts.fused import engine_layout
        from weightbus.plan import allocate, fill_from_canonical, poison

        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        model = model_spec(MODEL)
        me = Participant(role=role, rank=rank, device=str(device))
        if role == "writer":
            shard = len(writer_gpus)
            layout = fsdp_layout(model, me, shard=shard, shard_rank=rank, dtype="bfloat16")
        else:
            layout = engine_layout(model, me, tp=tp, tp_rank=rank % tp, dtype="bfloat16")
        tensors = allocate(layout, device=device)
        control = ControlConfig(
            num_writers=len(writer_gpus),
            num_readers=len(reader_gpus),
            address=f"127.0.0.1:{port}",
            host_store=False,
            job=job,
            timeout=timedelta(seconds=120),
        )
        fields = dict(
            transport={"same_host": "nccl"},  # same_gpu stays automatic: cuda_ipc
            bucket_bytes=1 << 20,
            staging_buffers=2,
            direct_bytes=4096,
            sync_timeout=timedelta(seconds=120),
            step_timeout=timedelta(seconds=120),
            connect_timeout=timedelta(seconds=120),
        )
        sync = SyncConfig(**(fields | extra))
        bound = BoundLayout(layout=layout, tensors=tensors)
        side = Writer(bound, control, sync) if role == "writer" else Reader(bound, control, sync)
        plan = side.connect()
        t = side.transport
        report = {
            "kind": type(t).__name__,
            "subs": sorted(getattr(t, "_subs", {t.name: None})),
            "mixed_links": [list(x) for x in plan.stats.mixed_links],
            "pack_mixed": plan.options.pack_mixed,
            "packed_links": [list(x) for x in plan.stats.packed_links],
            "digest": plan.digest,
            "off": [],
            "bytes": [],
        }
        if role == "reader":
            index = side.plan_index
            report["want_bytes"] = int(plan.buckets.nbytes[plan.buckets.dst == index].sum())
        for v in range(1, SYNCS + 1):
            if role == "writer":
                fill_from_canonical(layout, _canonical(model, v, device), tensors)
                torch.cuda.synchronize()
                report["bytes"].append(side.sync(v).bytes)
                continue
            for x in {
                id(y): y for y in [*side.live.values(), *side.bound.tensors.values()]
            }.values():
                poison(x)
            torch.cuda.synchronize()
            result = side.wait()
            want = allocate(layout, device=device)
            fill_from_canonical(layout, _canonical(model, result.version, device), want)
            off = sum(
                int((side.live[k].view(torch.uint8) != want[k].view(torch.uint8)).sum())
                for k in want
            )
            report["off"].append((result.version, off))
            report["bytes"].append(result.bytes)
        side.close()
        q.put((name, "ok", report))
    except BaseException as exc:
        q.put((name, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(shape: str) -> dict:
    """Run job ``shape`` of :data:`JOBS`, a process per participant; each one's report."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"gpu-links-{shape}-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    writer_gpus, reader_gpus, _, _ = JOBS[shape]
    who = [("writer", r, g) for r, g in enumerate(writer_gpus)]
    who += [("reader", r, g) for r, g in enumerate(reader_gpus)]
    procs = [
        ctx.Process(target=_worker, args=(role, rank, gpu, store.port, job, shape, q), daemon=True)
        for role, rank, gpu in who
    ]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < len(procs):
            try:
                name, status, value = q.get(timeout=240)
            except queue.Empty:
                pytest.fail(f"participants reported nothing within 240 s; got {sorted(out)}")
            assert status == "ok", f"{name}: {value}"
            out[name] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in range(len(reader_gpus)):
        got = out[f"reader-{r}"]
        assert got["off"] == [(v, 0) for v in range(1, SYNCS + 1)], (r, got["off"])
        assert got["bytes"] == [got["want_bytes"]] * SYNCS, (r, got["bytes"])
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs")
@pytest.mark.timeout(300)
def test_one_job_mixing_cuda_ipc_and_nccl_bit_exact():
    out = _run("replicas")
    assert out["writer-0"]["kind"] == "LinksTransport"
    assert out["writer-0"]["subs"] == ["cuda_ipc", "nccl"]
    assert out["reader-0"]["subs"] == ["cuda_ipc"]
    assert out["reader-1"]["subs"] == out["reader-2"]["subs"] == ["nccl"]


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs")
@pytest.mark.timeout(300)
def test_colocated_resharding_over_cuda_ipc_and_nccl_bit_exact():
    """writer-0 and reader-0 share cuda:0 and are both in the NCCL group (which NCCL used to
    refuse): each pair of two GPUs gets a communicator, the pair of one GPU CUDA IPC."""
    out = _run("colocated")
    assert out["writer-0"]["subs"] == out["reader-0"]["subs"] == ["cuda_ipc", "nccl"]
    assert out["writer-1"]["subs"] == out["reader-1"]["subs"] == ["nccl"]
    # every link is mixed (row-parallel routes strided on the FSDP writers); the NCCL ones
    # pack, the CUDA IPC one (writer-0 -> reader-0, on cuda:0) keeps its large routes alone
    assert out["writer-0"]["mixed_links"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert {r["digest"] for r in out.values()} == {out["writer-0"]["digest"]}
    assert out["writer-0"]["packed_links"] == [[0, 1], [1, 0], [1, 1]]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape,packed", [("mixed-packed", True), ("mixed-alone", False)])
def test_fsdp_to_tensor_parallel_mixed_links_over_nccl_bit_exact(shape, packed):
    """Every link is mixed (row-parallel routes of at least direct_bytes strided on the FSDP
    writer); over NCCL the job packs them by default, with ``pack_mixed=False`` they travel
    alone; both bit exact, every participant on the same plan."""
    out = _run(shape)
    assert {r["kind"] for r in out.values()} == {"NcclTransport"}
    assert len({r["digest"] for r in out.values()}) == 1
    assert out["writer-0"]["mixed_links"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert {r["pack_mixed"] for r in out.values()} == {packed}
    assert out["writer-0"]["packed_links"] == (out["writer-0"]["mixed_links"] if packed else [])
