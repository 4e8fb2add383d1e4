"""Leaks: 200 consecutive syncs leave memory, threads, file descriptors and store keys flat.

CPU (in the slow suite): one writer and two readers as threads of this process, over gloo,
with the default verification and apply mode. After a warm-up, the process's resident memory
(RSS) is sampled every 20 syncs. "Flat" means:

* RSS: the last samples exceed the first by less than ``RSS_SLACK`` (8 MiB, i.e. 46 KiB per
  sync over the 180 measured syncs). Anything a sync allocates and keeps is caught: a staging
  buffer is ``bucket_bytes`` (1 MiB here), a copy of a reader's weights 0.2 MB, so keeping one
  per sync grows RSS by 36 MiB or more. What RSS does without a leak is allocator noise:
  glibc and torch keep freed pages for reuse, and the Python heap grows in steps. Measured
  on the development machine: +0.1 to +0.4 MiB from sync 20 to 199, and over 2,000 syncs
  the same job reached its peak by sync 750 and stayed there (the test prints what it saw);
* keys in the control store: exactly equal at the end and after the warm-up (every per-sync
  topic is deleted once ``topic_window`` newer ones exist, and the warm-up runs past that);
* threads and open file descriptors: no more at the end than after the warm-up. They are
  counted for the whole process, where an earlier test's threads and sockets may still be
  winding down, so fewer is not a failure; a failure names the threads that appeared.

CUDA (marked gpu, skipped without a GPU): the same on one GPU, a writer and a reader process
pulling through CUDA IPC, with ``torch.cuda.memory_allocated`` flat to the byte on both.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.procs import collect_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SYNCS = 200
WARMUP = 20
EVERY = 20
RSS_SLACK = 8 << 20
WINDOW = 16  # topic_window: the store's per-sync keys stop growing within the warm-up


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled_keys(store) -> int:
    """The store's key count once the readers are idle: when the writer's sync returns they
    may still be finishing theirs, and a topic posted is in the store a moment before the
    stale one it replaces is deleted (a full-suite run once sampled 68 keys, one more than
    every other sample). The count twice in a row, 10 ms apart; the readers then wait for the
    next sync, which only the writer starts."""
    last = store.num_keys()
    for _ in range(100):
        time.sleep(0.01)
        now = store.num_keys()
        if now == last:
            return now
        last = now
    return last


def _configs(port: int, job: str, n_r: int, **sync):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=1,
        num_readers=n_r,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=30),
        heartbeat_interval=timedelta(seconds=0.5),
        heartbeat_timeout=timedelta(seconds=5),
        topic_window=WINDOW,
    )
    options = dict(
        cast={"float32": "bfloat16"},
        bucket_bytes=1 << 20,
        staging_buffers=2,
        direct_bytes=4096,
        sync_timeout=timedelta(seconds=30),
        step_timeout=timedelta(seconds=30),
    )
    options.update(sync)
    return control, SyncConfig(**options)


def _bounds(n_r: int, device: str = "cpu"):
    from weightbus import BoundLayout, Participant
    from weightbus.layouts.families import model_spec
    from weightbus.layouts.fsdp import fsdp_layout
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate

    model = model_spec("tiny-llama")
    w = fsdp_layout(model, Participant(role="writer", rank=0, device=device), shard=1, shard_rank=0)
    writer = BoundLayout(layout=w, tensors=allocate(w, device=device))
    readers = []
    for r in range(n_r):
        lay = engine_layout(
            model, Participant(role="reader", rank=r, device=device), tp=1, dtype="bfloat16"
        )
        readers.append(BoundLayout(layout=lay, tensors=allocate(lay, device=device)))
    return model, writer, readers


def test_200_syncs_leave_rss_threads_fds_and_store_keys_flat():
    from tests.test_faults_membership import canonical
    from weightbus import Reader, Writer
    from weightbus.plan import fill_from_canonical

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"leak-{uuid.uuid4().hex[:6]}"
    n_r = 2
    model, wbound, rbounds = _bounds(n_r)
    versions = [canonical(model, v % 3) for v in range(3)]  # three contents, in turn
    samples: list[tuple[int, int, int, int, int]] = []  # (sync, rss, threads, fds, keys)
    names: list[list[str]] = []  # the threads at each sample
    done = threading.Event()
    errors: list = []

    def reader(bound):
        try:
            control, config = _configs(store.port, job, n_r, transport="gloo")
            with Reader(bound, control, config) as r:
                for _ in range(SYNCS):
                    r.wait()
        except BaseException as exc:
            errors.append((bound.layout.name, exc, traceback.format_exc()))

    threads = [threading.Thread(target=reader, args=(b,), daemon=True) for b in rbounds]
    for t in threads:
        t.start()
    control, config = _configs(store.port, job, n_r, transport="gloo")
    t0 = time.monotonic()
    with Writer(wbound, control, config) as w:
        for v in range(1, SYNCS + 1):
            fill_from_canonical(wbound.layout, versions[v % 3], wbound.tensors)
            w.sync(v)
            # (the readers' threads end after the last sync: the last sample is one before)
            if v >= WARMUP and (v % EVERY == 0 and v < SYNCS or v == SYNCS - 1):
                keys = _settled_keys(store)
                samples.append((v, _rss(), threading.active_count(), _fds(), keys))
                names.append(sorted(t.name for t in threading.enumerate()))
        elapsed = time.monotonic() - t0
    done.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    print(f"\n{SYNCS} syncs in {elapsed:.1f} s; (sync, RSS MiB, threads, fds, store keys):")
    for v, rss, n_threads, fds, keys in samples:
        print(f"  {v:4d} {rss / 2**20:8.1f} {n_threads:4d} {fds:4d} {keys:5d}")
    first, last = samples[0], samples[-1]
    growth = max(s[1] for s in samples[-3:]) - first[1]
    assert growth < RSS_SLACK, f"RSS grew {growth / 2**20:.1f} MiB over {SYNCS - WARMUP} syncs"
    new = sorted(set(names[-1]) - set(names[0]))
    assert last[2] <= first[2], f"threads grew: {samples}; new threads {new}"
    assert last[3] <= first[3], f"open file descriptors grew: {samples}"
    assert last[4] == first[4], f"store keys changed: {samples}"
    assert elapsed < 60, elapsed


# ---------------------------------------------------------------------------------------------
# CUDA: a writer and a reader process on one GPU, CUDA IPC
# ---------------------------------------------------------------------------------------------


def _gpu_participant(
    role: str, port: int, job: str, q, device: str = "cuda:0", transport: str = "cuda_ipc"
) -> None:
    """One side of the GPU leak job (``device`` and ``transport`` can be changed to try the
    test's plumbing on CPU: "cpu" and "gloo", where the CUDA memory figure reads 0)."""
    try:
        from tests.test_faults_membership import canonical
        from weightbus import Reader, Writer
        from weightbus.plan import fill_from_canonical

        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(device))
        model, wbound, (rbound,) = _bounds(1, device=device)
        control, config = _configs(port, job, 1, transport=transport)
        versions = [{k: t.to(device) for k, t in canonical(model, v).items()} for v in range(3)]
        samples = []
        bound = wbound if role == "writer" else rbound
        with (Writer if role == "writer" else Reader)(bound, control, config) as s:
            for v in range(1, SYNCS + 1):
                if role == "writer":
                    fill_from_canonical(wbound.layout, versions[v % 3], wbound.tensors)
                    s.sync(v)
                else:
                    s.wait()
                if v >= WARMUP and v % EVERY == 0:
                    if cuda:
                        torch.cuda.synchronize(device)
                    allocated = torch.cuda.memory_allocated(device) if cuda else 0
                    samples.append((v, allocated, _rss()))
            done = (s.syncs, s.transport.name)
        q.put((role, "ok", {"samples": samples, "syncs": done[0], "transport": done[1]}))
    except BaseException as exc:
        q.put((role, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _run_gpu_leak_job(device: str = "cuda:0", transport: str = "cuda_ipc") -> dict:
    """A writer and a reader process on ``device``, 200 syncs; what each reported."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"leak-gpu-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {
        role: ctx.Process(
            target=_gpu_participant, args=(role, store.port, job, q, device, transport)
        )
        for role in ("writer", "reader")
    }
    for p in procs.values():
        p.start()
    results = collect_reports(procs.values(), q, 2, 240, join_s=10).got
    codes = {role: p.exitcode for role, p in procs.items()}
    for role in ("writer", "reader"):
        status, payload = results.get(role, ("missing", "it reported nothing"))
        assert status == "ok", f"{role}: {status}: {payload} (exit codes {codes})"
    return {role: payload for role, (_, payload) in results.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_200_syncs_on_a_gpu_leave_cuda_memory_flat():
    results = _run_gpu_leak_job()
    print("\n(sync, CUDA memory allocated, RSS MiB) per participant:")
    for role, r in results.items():
        assert r["transport"] == "cuda_ipc" and r["syncs"] == SYNCS, (role, r)
        samples = r["samples"]
        print(f"  {role}: " + ", ".join(f"({v}, {a}, {m / 2**20:.1f})" for v, a, m in samples))
        allocated = [a for _, a, _ in samples]
        assert allocated[-1] == allocated[0], (role, samples)  # to the byte
        growth = max(m for _, _, m in samples[-3:]) - samples[0][2]
        assert growth < RSS_SLACK, (role, f"RSS grew {growth / 2**20:.1f} MiB", samples)
