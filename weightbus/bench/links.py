"""``weightbus bench links``: what an NCCL link costs, by its channels; needs 2 CUDA GPUs.

    weightbus bench links                          # both parts, results under bench/results
    weightbus bench links --channels 0,16,4 --jobs ""

Part 1, two-rank communicators (a process on GPU 0 sending, one on GPU 1 receiving), for each
``--channels`` value (``maxCTAs``; 0: NCCL's own choice): the GPU memory each end holds per
communicator (``--links`` of them, after a 1-byte and a 1 GiB transfer on each), and the
send/recv rate of one of them alone and of all of them at once (a share of 1 GiB each).

Part 2, weightbus jobs over the nccl transport (a small model; writers on GPU 0 and readers,
engine replicas, on GPU 1, so that every writer links every reader): per participant, its GPU
memory (``nvidia-smi``) and connect time, with each ``--budgets`` value as
``$WEIGHTBUS_NCCL_CHANNELS`` (0: NCCL's own choice per link) and each ``--at-once`` value as
``$WEIGHTBUS_NCCL_CONNECT_AT_ONCE`` (links whose communicators a participant makes at once;
``auto``: unset, the default). Processes sharing a GPU take turns
on it, so the jobs' sync times say nothing of a link's speed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import traceback
import uuid

from weightbus.bench import machine_kind, results_path, source_identity
from weightbus.bench.gpu import _free_port, _run_group, bench_configs
from weightbus.transports.nccl import CONNECT_AT_ONCE

BIG = 1 << 30
"""Bytes of the transfers timed in part 1."""


def _used_mib(device) -> float:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


def _raw_end(rank: int, port: int, channels: list[int], links: int, q) -> None:
    """One end of part 1: rank 0 sends on GPU 0, rank 1 receives on GPU 1."""
    try:
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        timeout = dt.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
        buf = torch.empty(BIG, dtype=torch.uint8, device=device)
        one = torch.zeros(1, dtype=torch.uint8, device=device)

        def move(pg, t):
            return pg.send([t], 1, 0) if rank == 0 else pg.recv([t], 0, 0)

        def timed(tag: str, run) -> float:
            best = float("inf")
            for i in range(5):
                store.set(f"{tag}/{i}/{rank}", "1")  # both ends start together
                store.wait([f"{tag}/{i}/{1 - rank}"])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            return BIG / best / 1e9

        # NCCL's first communicator in a process also allocates what every later one shares:
        # one made and used first keeps that out of the first value's figures
        first = dist.ProcessGroupNCCL(
            dist.PrefixStore("first", store), rank, 2, dist.ProcessGroupNCCL.Options()
        )
        move(first, one).wait()
        move(first, buf).wait()
        torch.cuda.synchronize()
        first.shutdown()

        def measure(n: int) -> dict:
            torch.cuda.synchronize()
            base = _used_mib(device)
            pgs = []
            for i in range(links):
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                if n:
                    options.config.max_ctas = n
                prefix = dist.PrefixStore(f"c{n}/{i}", store)
                pgs.append(dist.ProcessGroupNCCL(prefix, rank, 2, options))
            for pg in pgs:
                move(pg, one).wait()
            torch.cuda.synchronize()
            warm = (_used_mib(device) - base) / links
            for pg in pgs:
                move(pg, buf).wait()
            torch.cuda.synchronize()
            after = (_used_mib(device) - base) / links
            share = BIG // links
            streams = [torch.cuda.Stream(device) for _ in pgs]

            def together() -> None:
                works = []
                for i, (pg, s) in enumerate(zip(pgs, streams, strict=True)):
                    with torch.cuda.stream(s):
                        works.append(move(pg, buf[i * share : (i + 1) * share]))
                for w in works:
                    w.wait()

            row = {
                "channels": n or "nccl",
                "mib_per_link_after_1_byte": round(warm, 1),
                "mib_per_link_after_1_gib": round(after, 1),
                "one_link_gbps": round(timed(f"one{n}", lambda: move(pgs[0], buf).wait()), 1),
                "all_links_gbps": round(timed(f"all{n}", together), 1),
            }
            for pg in pgs:
                pg.shutdown()
            return row

        q.put(("end", rank, "ok", [measure(n) for n in channels]))
    except BaseException as exc:
        q.put(("end", rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def raw_links(channels: list[int], links: int) -> list[dict]:
    """Part 1: per channels value, both ends' memory per communicator and the rates."""
    port = _free_port()
    got = _run_group([(_raw_end, (r, port, channels, links)) for r in (0, 1)], 900)
    rows = []
    for send, recv in zip(got[("end", 0)], got[("end", 1)], strict=True):
        rows.append(
            {
                "channels": send["channels"],
                "links": links,
                "sender_mib_per_link": send["mib_per_link_after_1_gib"],
                "receiver_mib_per_link": recv["mib_per_link_after_1_gib"],
                "sender_mib_per_link_after_1_byte": send["mib_per_link_after_1_byte"],
                "receiver_mib_per_link_after_1_byte": recv["mib_per_link_after_1_byte"],
                "one_link_gbps": send["one_link_gbps"],
                "all_links_gbps": send["all_links_gbps"],
            }
        )
    return rows


def _participant(role, rank, gpu, port, job, shape, budget, at_once, model_name, q) -> None:
    """One participant of part 2: connect, three syncs, report its GPU memory."""
    try:
        os.environ["WEIGHTBUS_NCCL_CHANNELS"] = str(budget)
        if at_once:  # else the default, from the participants on its GPU
            os.environ["WEIGHTBUS_NCCL_CONNECT_AT_ONCE"] = str(at_once)
        else:
            os.environ.pop("WEIGHTBUS_NCCL_CONNECT_AT_ONCE", None)
        import torch

        from weightbus import BoundLayout, Participant, Reader, Writer
        from weightbus.layouts.families import model_spec
        from weightbus.layouts.fsdp import fsdp_layout
        from weightbus.layouts.fused import engine_layout
        from weightbus.plan import allocate

        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        writers, readers = shape
        model = model_spec(model_name)
        me = Participant(role=role, rank=rank, device=str(device))
        if role == "writer":
            layout = fsdp_layout(model, me, shard=writers, shard_rank=rank, dtype="bfloat16")
        else:
            layout = engine_layout(model, me, tp=1, dtype="bfloat16")
        tensors = allocate(layout, device=device)
        ends = argparse.Namespace(port=port, bucket_mb=1, transport="nccl")
        control, sync = bench_configs(
            ends,
            job,
            writers,
            readers,
            staging_buffers=2,
            connect_timeout=dt.timedelta(seconds=300),
        )
        bound = BoundLayout(layout=layout, tensors=tensors)
        side = Writer(bound, control, sync) if role == "writer" else Reader(bound, control, sync)
        t0 = time.monotonic()
        side.connect()
        connect_s = time.monotonic() - t0
        for v in range(1, 4):  # every link moves bytes (whatever they hold): channels connect
            if isinstance(side, Writer):
                side.sync(v)
            else:
                side.wait()
        torch.cuda.synchronize()
        mib = _gpu_mib_by_pid().get(os.getpid(), 0)  # its links connected, all of them
        side.close()
        q.put((role, rank, "ok", {"gpu_mib": mib, "connect_s": round(connect_s, 2)}))
    except BaseException as exc:
        q.put((role, rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _gpu_mib_by_pid() -> dict[int, int]:
    smi = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = [line.split(",") for line in smi.stdout.strip().splitlines() if line.strip()]
    return {int(pid): int(mib) for pid, mib in rows}


def job_links(shape: tuple[int, int], budget: int, at_once: int, model: str) -> dict:
    """Part 2: one job of ``shape`` (writers, readers) under ``budget``, each participant
    making ``at_once`` links at once (0: the default); per role the largest GPU memory and connect time of its
    participants."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = f"bench-links-{uuid.uuid4().hex[:6]}"
    who = [("writer", r, 0) for r in range(shape[0])] + [("reader", r, 1) for r in range(shape[1])]
    got = _run_group(
        [
            (_participant, (role, r, gpu, store.port, job, shape, budget, at_once, model))
            for role, r, gpu in who
        ],
        600,
    )
    row: dict = {
        "writers": shape[0],
        "readers": shape[1],
        "budget": budget or "nccl",
        "at_once": at_once or "auto",
    }
    for role in ("writer", "reader"):
        mine = [v for (r, _), v in got.items() if r == role]
        row[f"{role}_gpu_mib_max"] = max(v["gpu_mib"] for v in mine)
        row[f"{role}_connect_s_max"] = max(v["connect_s"] for v in mine)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightbus bench links", description=__doc__.splitlines()[0])
    p.add_argument(
        "--channels", default="0,32,16,8,4,2", help="part 1: maxCTAs values (0: NCCL's choice)"
    )
    p.add_argument("--links", type=int, default=4, help="part 1: communicators (default 4)")
    p.add_argument(
        "--jobs", default="1x1,1x4,1x16,8x8", help="part 2: WRITERSxREADERS jobs ('': none)"
    )
    p.add_argument(
        "--budgets", default="32,0", help="part 2: $WEIGHTBUS_NCCL_CHANNELS values (0: NCCL's)"
    )
    p.add_argument(
        "--at-once",
        default="auto",
        help="part 2: $WEIGHTBUS_NCCL_CONNECT_AT_ONCE values (auto: unset, the default: "
        f"{CONNECT_AT_ONCE} over the participants on a GPU)",
    )
    p.add_argument("--model", default="tiny-llama", help="part 2: model preset")
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument("--kind", default=None, help="machine kind for the file name")
    a = p.parse_args(argv)
    try:
        channels = [int(x) for x in a.channels.split(",") if x.strip()]
        budgets = [int(x) for x in a.budgets.split(",") if x.strip()]
        at_once = [0 if x.strip() == "auto" else int(x) for x in a.at_once.split(",") if x.strip()]
        jobs = [[int(n) for n in s.split("x")] for s in a.jobs.split(",") if s.strip()]
    except ValueError as exc:
        p.error(
            f"--channels, --budgets, --at-once and --jobs take integers (jobs as 4x8; --at-once "
            f"also auto): {exc}"
        )
    if any(len(j) != 2 or min(j) < 1 for j in jobs):
        p.error(f"--jobs {a.jobs!r}: each WRITERSxREADERS, both at least 1 (e.g. 1x4,8x8)")
    if any(n < 0 for n in channels + budgets):
        p.error(f"--channels {a.channels!r} / --budgets {a.budgets!r}: 0 (NCCL's choice) or more")
    if not at_once or min(at_once) < 0:
        p.error(f"--at-once {a.at_once!r}: one or more values, each auto or at least 1")
    import torch

    if torch.cuda.device_count() < 2:
        print("weightbus bench links: needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    result: dict = {
        "date": dt.date.today().isoformat(),
        "machine": f"{torch.cuda.device_count()}x {name}",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "raw": [],
        "jobs": [],
    }
    if channels:
        print(f"part 1: {a.links} two-rank communicators, GPU 0 -> GPU 1", flush=True)
        for row in raw_links(channels, a.links):
            result["raw"].append(row)
            print(
                f"  channels {row['channels']!s:>4}: {row['sender_mib_per_link']:7.1f} MiB a "
                f"link on the sender, {row['receiver_mib_per_link']:7.1f} on the receiver; one "
                f"link {row['one_link_gbps']:6.1f} GB/s, {a.links} at once "
                f"{row['all_links_gbps']:6.1f}",
                flush=True,
            )
    if jobs:
        print("part 2: jobs over nccl, writers on GPU 0, readers on GPU 1", flush=True)
    for w, r in jobs:
        shape = (w, r)
        for budget, n in ((b, n) for b in budgets for n in at_once):
            row = job_links(shape, budget, n, a.model)
            result["jobs"].append(row)
            print(
                f"  {shape[0]} x {shape[1]}, budget {row['budget']!s:>4}, {row['at_once']} at once: writer "
                f"{row['writer_gpu_mib_max']} MiB, reader {row['reader_gpu_mib_max']} MiB; "
                f"connect {row['writer_connect_s_max']:.1f} / {row['reader_connect_s_max']:.1f} s",
                flush=True,
            )
    kind = a.kind or machine_kind(torch.cuda.device_count(), name)
    result.update(source_identity())
    out = results_path(a.out, f"{result['date']}-{kind}-nccl-links-cost")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
