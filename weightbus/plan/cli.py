"""``weightbus plan``: plan a transfer between two layouts of a model and print its statistics.

    weightbus plan --model llama-3-8b --writers fsdp:shard=8 --readers vllm:tp=4,dp=2
    weightbus plan --model path/to/config.json --writers megatron:tp=2,pp=2 --readers whole --json

Layout descriptions: see :mod:`weightbus.layouts.describe`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from weightbus.layouts import describe
from weightbus.layouts.families import PRESETS, model_spec
from weightbus.plan.planner import PlanOptions, TransferPlan, make_plan
from weightbus.spec import LayoutError


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f} GB"


def report(plan: TransferPlan) -> dict:
    """Plan statistics as a JSON-able dict."""
    s = plan.stats
    wb, rb = np.array(s.writer_bytes), np.array(s.reader_bytes)
    return {
        "digest": plan.digest,
        "writers": len(plan.writers),
        "readers": len(plan.readers),
        "tensors": len(plan.tensors),
        "total_bytes": s.total_bytes,
        "routes": s.routes,
        "buckets": s.buckets,
        "links": len(s.link_bytes),
        "writer_bytes": {"min": int(wb.min()), "mean": float(wb.mean()), "max": int(wb.max())},
        "reader_bytes": {"min": int(rb.min()), "mean": float(rb.mean()), "max": int(rb.max())},
        "writer_imbalance": s.writer_imbalance,
        "reader_imbalance": s.reader_imbalance,
        "largest_bucket": int(plan.buckets.nbytes.max()) if len(plan.buckets) else 0,
        "plan_seconds": s.seconds,
    }


def print_report(r: dict, out=sys.stdout) -> None:
    w, rd = r["writer_bytes"], r["reader_bytes"]
    lines = [
        f"plan {r['digest'][:16]}",
        f"  participants   {r['writers']} writers -> {r['readers']} readers, {r['tensors']} canonical tensors",
        f"  bytes          {_gb(r['total_bytes'])} in {r['routes']} routes, {r['buckets']} buckets "
        f"(largest {r['largest_bucket'] / 2**20:.1f} MiB), {r['links']} links",
        f"  per writer     min {_gb(w['min'])}  mean {_gb(w['mean'])}  max {_gb(w['max'])}  "
        f"(max/mean {r['writer_imbalance']:.3f})",
        f"  per reader     min {_gb(rd['min'])}  mean {_gb(rd['mean'])}  max {_gb(rd['max'])}  "
        f"(max/mean {r['reader_imbalance']:.3f})",
        f"  planned in     {r['plan_seconds']:.3f} s",
    ]
    print("\n".join(lines), file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="weightbus plan",
        description="Plan a transfer between two layouts of a model and print its statistics.",
        epilog=describe.__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help=f"a config.json path or a preset: {', '.join(PRESETS)}"
    )
    p.add_argument("--writers", required=True, help="trainer-side layout description")
    p.add_argument("--readers", required=True, help="inference-side layout description")
    p.add_argument("--writer-dtype", default=None, help="trainer dtype (default: the model's)")
    p.add_argument("--reader-dtype", default=None, help="inference dtype (default: the model's)")
    p.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB (default 256)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    a = p.parse_args(argv)
    try:
        model = model_spec(a.model)
        t0 = time.perf_counter()
        writers = describe.build_layouts(model, a.writers, "writer", dtype=a.writer_dtype)
        readers = describe.build_layouts(model, a.readers, "reader", dtype=a.reader_dtype)
        build_s = time.perf_counter() - t0
        cast = {}
        wd, rd = a.writer_dtype or model.dtype, a.reader_dtype or model.dtype
        if wd != rd:
            cast = {wd: rd}
        plan = make_plan(writers, readers, PlanOptions(bucket_bytes=a.bucket_mb << 20, cast=cast))
    except (ValueError, KeyError, LayoutError) as exc:
        print(f"weightbus plan: {exc}", file=sys.stderr)
        return 2
    r = report(plan)
    r["layout_seconds"] = build_s
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print_report(r)
        print(f"  layouts built  {build_s:.3f} s")
    return 0
