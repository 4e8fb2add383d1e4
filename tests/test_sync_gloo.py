"""End to end over gloo: real processes, Writer.sync -> Reader.wait, checked bit for bit.

Writers hold FSDP2-style DTensors (``Shard(0)`` on a 2-rank CPU mesh, their own process group);
readers hold vLLM-style tensor-parallel engine tensors (fused qkv / gate_up, column and row
parallel, padded vocab). Reader tensors are poisoned before every sync.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.procs import collect_reports

STEPS = 20


def _canonical(model, version: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) * 1000 + version)
        out[t.name] = torch.randn(t.shape, generator=g).to(dtype)
    return out


def _configs(port: int, n_w: int, n_r: int):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=n_w,
        num_readers=n_r,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job="test",
        timeout=timedelta(seconds=60),
        heartbeat_interval=timedelta(seconds=0.2),
        heartbeat_timeout=timedelta(seconds=2),
    )
    sync = SyncConfig(
        cast={"float32": "bfloat16"},
        bucket_bytes=1 << 20,
        staging_buffers=2,
        direct_bytes=4096,  # big routes land in place in the readers' tensors
        sync_timeout=timedelta(seconds=30),
        step_timeout=timedelta(seconds=60),
        transport="gloo",
    )
    return control, sync


def _groups(side) -> str:
    """The session's posting groups as JSON: {"<me> <peer>": [[bucket, ...], ...]}."""
    import json

    out: dict[str, list] = {}
    names = [p.name for p in side.plan.participants]
    for group in side.posts:
        peer = names[group[0][0].peer_global]
        link = f"{side.name} {peer}" if side.role == "writer" else f"{peer} {side.name}"
        out.setdefault(link, []).append([op.bucket for op, _ in group])
    return json.dumps(out, separators=(",", ":"))


def _writer(rank: int, port: int, n_w: int, n_r: int, mode: str, q) -> None:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from weightbus import Participant, Writer
        from weightbus.layouts.dtensor import bind_dtensors
        from weightbus.layouts.families import model_spec
        from weightbus.plan import fill_from_canonical
        from weightbus.plan.program import BucketCopier

        torch.set_num_threads(1)
        in_place = []
        # the trainer's own process group, separate from weightbus' control plane
        store = dist.PrefixStore("trainer", dist.TCPStore("127.0.0.1", port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n_w)
        mesh = init_device_mesh("cpu", (n_w,))
        model = model_spec("tiny-llama")
        canon = _canonical(model, 0)
        skip = "model.norm.weight" if mode == "missing" else None
        named = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in canon.items() if n != skip}
        bound = bind_dtensors(named, Participant(role="writer", rank=rank))
        if mode == "kill_writer" and rank == 1:
            real_pack, calls = BucketCopier.pack, [0]

            def pack(self, op, tensors, buf):
                calls[0] += 1
                if writer.version == 2 and calls[0] > 1:
                    os._exit(17)  # dies in the middle of sync 3
                real_pack(self, op, tensors, buf)

            BucketCopier.pack = pack
        control, sync = _configs(port, n_w, n_r)
        writer = Writer(bound, control, sync)
        writer.connect()
        in_place.append(sum(d is not None for d in writer.direct))
        if mode == "poll":
            time.sleep(1.5)  # the readers poll meanwhile
        for v in range(1, STEPS + 1):
            fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
            writer.sync(v)
        groups = _groups(writer)
        writer.close()
        q.put((f"writer-{rank}", "ok", f"in place {in_place} groups {groups}"))
    except BaseException as exc:
        q.put((f"writer-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _reader(rank: int, port: int, n_w: int, n_r: int, mode: str, q) -> None:
    try:
        from weightbus import BoundLayout, Participant, Reader, SyncTimeout
        from weightbus.layouts.families import PRESETS, model_spec
        from weightbus.layouts.fused import engine_layout
        from weightbus.plan import allocate, fill_from_canonical, poison
        from weightbus.plan.program import BucketCopier

        torch.set_num_threads(1)
        config = dict(PRESETS["tiny-llama"])
        if mode == "shape":
            config["intermediate_size"] = 96
        model = model_spec(config)
        layout = engine_layout(
            model, Participant(role="reader", rank=rank), tp=n_r, tp_rank=rank, dtype="bfloat16"
        )
        tensors = allocate(layout)
        ids = {k: id(t) for k, t in tensors.items()}
        if mode == "kill_reader" and rank == 1:
            real_unpack = BucketCopier.unpack

            def unpack(self, op, t, buf):
                if reader.version == 2:
                    os._exit(17)  # dies in the middle of sync 3
                real_unpack(self, op, t, buf)

            BucketCopier.unpack = unpack
        control, sync = _configs(port, n_w, n_r)
        reader = Reader(BoundLayout(layout=layout, tensors=tensors), control, sync)
        reader.connect()
        seen, bad = [], []
        if mode == "poll":
            # no sync has begun yet: a short wait times out and leaves the reader usable
            try:
                reader.wait(timedelta(seconds=0.3))
                bad.append("wait returned before any sync")
            except SyncTimeout:
                pass
        for _ in range(STEPS):
            for t in tensors.values():
                poison(t)
            result = reader.wait()
            seen.append(result.version)
            want = allocate(layout)
            fill_from_canonical(layout, _canonical(model, result.version, torch.bfloat16), want)
            for k in want:
                a, b = tensors[k].view(torch.uint8), want[k].view(torch.uint8)
                if not torch.equal(a, b):
                    bad.append((result.version, k))
        n_in_place = sum(d is not None for d in reader.direct)
        groups = _groups(reader)
        reader.close()
        if n_in_place == 0:
            bad.append("no bucket was received in place")
        if any(id(t) != ids[k] for k, t in tensors.items()):
            bad.append("engine tensors were replaced")
        status = "ok" if not bad and seen == list(range(1, STEPS + 1)) else "wrong"
        q.put((f"reader-{rank}", status, f"versions {seen} mismatches {bad[:5]} groups {groups}"))
    except BaseException as exc:
        q.put((f"reader-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _run(mode: str, n_w: int = 2, n_r: int = 2, limit: float = 150.0) -> tuple[dict, float]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(r, store.port, n_w, n_r, mode, q)) for r in range(n_w)
    ]
    procs += [
        ctx.Process(target=_reader, args=(r, store.port, n_w, n_r, mode, q)) for r in range(n_r)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    started = time.monotonic() - t0
    reports = collect_reports(procs, q, len(procs), limit - started)
    # each report with its arrival, in seconds from before the processes started
    results = {
        name: (status, text, started + reports.arrived[name])
        for name, (status, text) in reports.got.items()
    }
    assert not reports.hung, f"processes left hanging: {reports.hung}; results {results}"
    return results, time.monotonic() - t0


@pytest.mark.timeout(200)
def test_fsdp_dtensor_writers_to_tensor_parallel_readers_20_syncs():
    results, _ = _run("ok")
    assert set(results) == {"writer-0", "writer-1", "reader-0", "reader-1"}, results
    for name, (status, text, _) in results.items():
        assert status == "ok", (name, text)
    # both ends of each link post the same groups (here every writer bucket is staged, so
    # each travels alone; tests/test_post_groups.py has a job with groups)
    import json

    links: dict[str, list] = {}
    for _, text, _ in results.values():
        for link, groups in json.loads(text.split(" groups ", 1)[1]).items():
            links.setdefault(link, []).append(groups)
    assert len(links) == 4, links
    for link, (a, b) in links.items():
        assert a == b, (link, a, b)


@pytest.mark.timeout(200)
def test_reader_polling_before_the_first_sync_stays_usable():
    results, _ = _run("poll")
    for name, (status, text, _) in results.items():
        assert status == "ok", (name, text)


@pytest.mark.timeout(200)
def test_reader_killed_mid_sync_makes_writers_raise_naming_it():
    results, elapsed = _run("kill_reader")
    assert "reader-1" not in results  # it died without a word
    for name in ("writer-0", "writer-1", "reader-0"):
        status, text, t = results[name]
        assert status in ("PeerFailure", "SyncTimeout"), (name, status, text)
        assert "reader-1" in text.splitlines()[0], (name, text)
    assert elapsed < 100


@pytest.mark.timeout(200)
def test_writer_killed_mid_sync_makes_readers_raise_naming_it():
    results, elapsed = _run("kill_writer")
    assert "writer-1" not in results
    for name in ("reader-0", "reader-1", "writer-0"):
        status, text, t = results[name]
        assert status in ("PeerFailure", "SyncTimeout"), (name, status, text)
        assert "writer-1" in text.splitlines()[0], (name, text)
    assert elapsed < 100


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "mode, message",
    [
        ("missing", "expects model.norm.weight (64,) bfloat16, but no writer holds it"),
        (
            "shape",
            "down_proj.weight: reader 'reader-0' has shape (64, 96), writer 'writer-0' has (64, 128)",
        ),
    ],
)
def test_layout_errors_raise_at_connect_on_both_sides(mode, message):
    results, _ = _run(mode)
    assert set(results) == {"writer-0", "writer-1", "reader-0", "reader-1"}, results
    for name, (status, text, _) in results.items():
        assert status == "LayoutError", (name, status, text)
        assert message in text, (name, text)
