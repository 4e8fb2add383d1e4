"""``weightbus bench plan``: build and plan a DeepSeek-V3-shaped model, 256 writers -> 128 readers.

Writers: FSDP2 x expert parallel, ``fsdp:shard=8,ep=32`` (dense tensors sharded over 8 ranks and
replicated over the 32 expert-parallel groups; 8 experts per group, each sharded over 8).
Readers: vLLM-style, ``vllm:tp=8,dp=16,ep=on`` (16 replicas of tensor parallel 8 for attention
and dense layers; the 256 routed experts spread 2 per rank over all 128 ranks).

The timed part is everything after the imports: the model description, all 384 layouts, and the
plan. It runs on one CPU core (the process pins itself to one). The last line is
``plan_scale writers=256 readers=128 tensors=<n> routes=<n> seconds=<s> rss_gb=<g>``.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time

WRITERS = "fsdp:shard=8,ep=32"
READERS = "vllm:tp=8,dp=16,ep=on"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightbus bench plan", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="deepseek-v3", help="preset or config.json (default deepseek-v3)"
    )
    p.add_argument("--writers", default=WRITERS, help=f"writer layout (default {WRITERS})")
    p.add_argument("--readers", default=READERS, help=f"reader layout (default {READERS})")
    p.add_argument("--repeat", type=int, default=3, help="runs; the best is reported (default 3)")
    a = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from weightbus.layouts.describe import build_layouts
    from weightbus.layouts.families import model_spec
    from weightbus.plan import make_plan
    from weightbus.plan.cli import print_report, report
    from weightbus.spec import LayoutError

    best = None
    for i in range(a.repeat):
        gc.collect()
        t0 = time.perf_counter()
        gc.disable()  # bulk construction of ~1M small objects; nothing here makes cycles
        try:
            model = model_spec(a.model)
            writers = build_layouts(model, a.writers, "writer")
            readers = build_layouts(model, a.readers, "reader")
            t1 = time.perf_counter()
            plan = make_plan(writers, readers)
        except (ValueError, KeyError, LayoutError) as exc:
            print(f"weightbus bench plan: {exc}", file=sys.stderr)
            return 2
        finally:
            gc.enable()
        t2 = time.perf_counter()
        print(
            f"run {i + 1}/{a.repeat}: model + {len(writers) + len(readers)} layouts {t1 - t0:.3f} s, "
            f"plan {t2 - t1:.3f} s, total {t2 - t0:.3f} s",
            flush=True,
        )
        if best is None or t2 - t0 < best[0]:
            best = (t2 - t0, plan)
        del model, writers, readers, plan
    seconds, plan = best
    print_report(report(plan))
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(
        f"plan_scale writers={len(plan.writers)} readers={len(plan.readers)} tensors={len(plan.tensors)} "
        f"routes={plan.stats.routes} seconds={seconds:.3f} rss_gb={rss_gb:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
