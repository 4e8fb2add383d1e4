"""GPU test: one job on one host mixing CUDA IPC and NCCL, chosen per link.

writer-0 on cuda:0; reader-0 colocated with it on cuda:0 (a same_gpu link: CUDA IPC, chosen
automatically); reader-1 and reader-2 on cuda:1 and cuda:2 (same_host links, forced to NCCL
with ``SyncConfig(transport={"same_host": "nccl"})``). Every participant is a process of its
own; the readers' tensors are poisoned (NaN) before every sync and compared bit for bit.

Marked ``gpu``; skipped without 3 CUDA GPUs. Run with ``python -m pytest -m gpu
tests/test_gpu_links.py``.
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
READERS = {"reader-0": 0, "reader-1": 1, "reader-2": 2}  # name -> GPU


def _canonical(model, version: int, device) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) + 7919 * version)
        out[t.name] = torch.randn(t.shape, generator=g).to(device=device, dtype=torch.bfloat16)
    return out


def _worker(role: str, rank: int, gpu: int, port: int, job: str, q) -> None:
    name = f"{role}-{rank}"
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
            layout = fsdp_layout(model, me, shard=1, shard_rank=0, dtype="bfloat16")
        else:
            layout = engine_layout(model, me, tp=1, dtype="bfloat16")
        tensors = allocate(layout, device=device)
        control = ControlConfig(
            num_writers=1,
            num_readers=len(READERS),
            address=f"127.0.0.1:{port}",
            host_store=False,
            job=job,
            timeout=timedelta(seconds=120),
        )
        sync = SyncConfig(
            transport={"same_host": "nccl"},  # same_gpu stays automatic: cuda_ipc
            bucket_bytes=1 << 20,
            staging_buffers=2,
            direct_bytes=4096,
            sync_timeout=timedelta(seconds=120),
            step_timeout=timedelta(seconds=120),
            connect_timeout=timedelta(seconds=120),
        )
        bound = BoundLayout(layout=layout, tensors=tensors)
        side = Writer(bound, control, sync) if role == "writer" else Reader(bound, control, sync)
        plan = side.connect()
        t = side.transport
        report = {
            "kind": type(t).__name__,
            "subs": sorted(getattr(t, "_subs", {t.name: None})),
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


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs")
@pytest.mark.timeout(300)
def test_one_job_mixing_cuda_ipc_and_nccl_bit_exact():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"gpu-links-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    who = [("writer", 0, 0)] + [("reader", int(n[-1]), g) for n, g in READERS.items()]
    procs = [
        ctx.Process(target=_worker, args=(role, rank, gpu, store.port, job, q), daemon=True)
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
    assert out["writer-0"]["kind"] == "LinksTransport"
    assert out["writer-0"]["subs"] == ["cuda_ipc", "nccl"]
    assert out["reader-0"]["subs"] == ["cuda_ipc"]
    assert out["reader-1"]["subs"] == out["reader-2"]["subs"] == ["nccl"]
    for name in READERS:
        got = out[name]
        assert got["off"] == [(v, 0) for v in range(1, SYNCS + 1)], (name, got["off"])
        assert got["bytes"] == [got["want_bytes"]] * SYNCS, (name, got["bytes"])
