"""``weightbus plan``: plan a transfer between two layouts of a model and print its statistics.

    weightbus plan --model llama-3-8b --writers fsdp:shard=8 --readers vllm:tp=4,dp=2
    weightbus plan --model path/to/config.json --writers megatron:tp=2,pp=2 --readers whole --json
    weightbus plan --simulate --preset kimi-k2          # predicted sync time on a cluster
    weightbus plan --simulate --model deepseek-v3 --writers fsdp:shard=8,ep=32 \
        --readers vllm:tp=8,dp=16,ep=on --cluster h200-8x400g --wire fp8

Layout descriptions: see :mod:`weightbus.layouts.describe`; the simulator's model and its
assumptions: :mod:`weightbus.plan.simulate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from weightbus.codecs.fp8 import Fp8Config
from weightbus.layouts import describe
from weightbus.layouts.families import PRESETS, model_spec
from weightbus.plan import simulate as sim
from weightbus.plan.codec_plan import CodecConfig
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
        "mixed_links": len(s.mixed_links),
        "pack_mixed": plan.options.pack_mixed,
    }


def print_report(r: dict, out=None) -> None:
    """Print :func:`report`'s statistics (to ``out``, default the current ``sys.stdout``)."""
    out = out if out is not None else sys.stdout
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
    if r["mixed_links"]:
        what = (
            "every route of them packed, as jobs over NCCL plan them"
            if r["pack_mixed"]
            else "jobs over NCCL pack every route of them: --pack-mixed shows that plan"
        )
        lines.insert(
            -1,
            f"  mixed links    {r['mixed_links']} of {r['links']} (a large route strided on one "
            f"side): {what}",
        )
    print("\n".join(lines), file=out)


# --simulate flags that replace a field of the cluster description: flag -> (field, type, scale)
_CLUSTER_FLAGS = {
    "gpus_per_node": ("gpus_per_node", int, 1),
    "nics_per_node": ("nics_per_node", int, 1),
    "nic_gbits": ("nic_gbits", float, 1),
    "nic_efficiency": ("nic_efficiency", float, 1),
    "nvlink_gbps": ("nvlink_gbps", float, 1),
    "pcie_gbps": ("pcie_gbps", float, 1),
    "copy_gbps": ("copy_gbps", float, 1),
    "message_us": ("message_s", float, 1e-6),
    "latency_us": ("latency_s", float, 1e-6),
    "flows_per_nic": ("max_flows_per_nic", int, 1),
    "ipc_gbps": ("ipc_gbps", float, 1),
    "ipc_control_ms": ("ipc_control_s", float, 1e-3),
}


def _add_simulate_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The --simulate flags, as a group of ``p``'s (returned)."""
    g = p.add_argument_group(
        "simulation (--simulate)",
        "Predict one sync of the plan on a cluster, per phase. Scenarios: "
        + ", ".join(sim.SCENARIOS)
        + "; clusters: "
        + ", ".join(sim.CLUSTERS)
        + ". Flags below override the scenario's or cluster's values.",
    )
    g.add_argument("--simulate", action="store_true", help="predict the sync time on a cluster")
    g.add_argument(
        "--preset",
        choices=sorted(sim.SCENARIOS),
        help="a scenario: model, both layouts, cluster and options (explicit flags win)",
    )
    g.add_argument("--cluster", choices=sorted(sim.CLUSTERS), help="cluster description")
    g.add_argument(
        "--transport",
        choices=sim.TRANSPORTS,
        help="staged: pushes through staging buffers (NCCL, gloo, RDMA); cuda_ipc: readers pull "
        "with the copy engines, one host (default: the scenario's, else staged)",
    )
    g.add_argument("--wire", choices=sim.WIRES, help="wire format: plan dtype, or fp8 blocks")
    g.add_argument("--placement", choices=sim.PLACEMENTS, help="where participants sit")
    g.add_argument("--writer-memory", choices=("gpu", "host"), help="where writers hold weights")
    g.add_argument("--no-fanout", action="store_true", help="send every copy across the network")
    g.add_argument("--relay-nvlink", action="store_true", help="relay same-node copies too")
    g.add_argument("--serial", action="store_true", help="phases do not overlap")
    g.add_argument("--chunk-mb", type=int, help="network schedule unit in MiB (default: bucket)")
    for flag, (field_name, kind, _) in _CLUSTER_FLAGS.items():
        g.add_argument(
            "--" + flag.replace("_", "-"), type=kind, help=f"override the cluster's {field_name}"
        )
    g.add_argument(
        "--measured",
        metavar="RESULTS_JSON",
        help="a bench results file (bench/results/*.json): print the measured time beside",
    )
    return g


def _simulation_only(group: argparse._ArgumentGroup, a: argparse.Namespace) -> list[str]:
    """The flags of the simulation ``group`` given in ``a`` (set to other than their
    defaults), --simulate itself left out."""
    return [
        action.option_strings[0]
        for action in group._group_actions
        if action.dest != "simulate" and getattr(a, action.dest) != action.default
    ]


def _simulation(a: argparse.Namespace) -> tuple[sim.Scenario | None, sim.Cluster, sim.SimOptions]:
    scenario = sim.SCENARIOS[a.preset] if a.preset else None
    cluster_name = a.cluster or (scenario.cluster if scenario else "h200-8x400g")
    cluster = sim.CLUSTERS[cluster_name]
    over = {
        f: kind(getattr(a, flag)) * scale
        for flag, (f, kind, scale) in _CLUSTER_FLAGS.items()
        if getattr(a, flag) is not None
    }
    if over:
        cluster = dataclasses.replace(cluster, name=cluster.name + "*", **over)
    options = scenario.options if scenario else sim.SimOptions()
    changes: dict = {}
    if a.transport:
        changes["transport"] = a.transport
    if a.wire:
        changes["wire"] = a.wire
    if a.placement:
        changes["placement"] = a.placement
    if a.writer_memory:
        changes["writer_memory"] = a.writer_memory
    if a.no_fanout:
        changes["fanout"] = False
    if a.relay_nvlink:
        changes["relay_nvlink"] = True
    if a.serial:
        changes["pipelined"] = False
    if a.chunk_mb is not None:
        changes["chunk_bytes"] = a.chunk_mb << 20
    return scenario, cluster, dataclasses.replace(options, **changes)


def _measured_line(path: str, bench_name: str | None, pred: sim.Prediction) -> str:
    with open(path) as f:
        results = json.load(f)
    # the entry of this scenario run over the simulated transport: cuda_ipc for cuda_ipc,
    # else a pushing transport (nccl first); the plain name is the bench's default transport
    ipc = pred.options.transport == "cuda_ipc"
    m = None
    if bench_name:
        names = (
            (bench_name, f"{bench_name}@cuda_ipc") if ipc else (f"{bench_name}@nccl", bench_name)
        )
        for name in names:
            m = sim.measured(results, name)
            if m is not None and (m.get("transport") == "cuda_ipc") == ipc:
                break
            m = None
    if m is None:
        return f"  measured       none for this scenario over {pred.options.transport} in {path}"
    err = sim.relative_error(pred.seconds, m["median_s"])
    return (
        f"  measured       {m['name']} over {m.get('transport', '?')}: "
        f"{m['median_s'] * 1e3:.2f} ms median ({m['min_s'] * 1e3:.2f}-"
        f"{m['max_s'] * 1e3:.2f}), {sim.gbps(m['bytes'], m['median_s']):.1f} GB/s; predicted "
        f"{pred.seconds * 1e3:.2f} ms, {sim.gbps(pred.stats['wire_bytes'], pred.seconds):.1f} "
        f"GB/s ({err:+.1%})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="weightbus plan",
        description="Plan a transfer between two layouts of a model and print its statistics "
        "(with --simulate, also its predicted sync time on a cluster).",
        epilog=describe.__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help=f"a config.json path or a preset: {', '.join(PRESETS)}")
    p.add_argument("--writers", help="trainer-side layout description")
    p.add_argument("--readers", help="inference-side layout description")
    p.add_argument("--writer-dtype", default=None, help="trainer dtype (default: the model's)")
    p.add_argument("--reader-dtype", default=None, help="inference dtype (default: the model's)")
    p.add_argument("--bucket-mb", type=int, default=None, help="bucket size in MiB (default 256)")
    p.add_argument(
        "--pack-mixed",
        action="store_true",
        help="pack every route of mixed links, as jobs over NCCL plan (PlanOptions.pack_mixed)",
    )
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    sim_flags = _add_simulate_args(p)
    a = p.parse_args(argv)
    ignored = [] if a.simulate else _simulation_only(sim_flags, a)
    if ignored:
        # they change only the prediction, which is made with --simulate alone
        verb = "applies" if len(ignored) == 1 else "apply"
        p.error(f"{', '.join(ignored)} only {verb} with --simulate: add --simulate")
    scenario = sim.SCENARIOS[a.preset] if a.preset else None
    model_name = a.model or (scenario.model if scenario else None)
    writers_desc = a.writers or (scenario.writers if scenario else None)
    readers_desc = a.readers or (scenario.readers if scenario else None)
    missing = [
        f"--{k}"
        for k, v in (("model", model_name), ("writers", writers_desc), ("readers", readers_desc))
        if v is None
    ]
    if missing:
        p.error(f"give {', '.join(missing)} (or --simulate --preset NAME)")
    assert model_name is not None and writers_desc is not None and readers_desc is not None
    bucket_mb = a.bucket_mb or (scenario.bucket_mb if scenario else 256)
    writer_dtype = a.writer_dtype or (scenario.writer_dtype if scenario else None)
    reader_dtype = a.reader_dtype or (scenario.reader_dtype if scenario else None)
    try:
        model = model_spec(model_name)
        t0 = time.perf_counter()
        writers = describe.build_layouts(model, writers_desc, "writer", dtype=writer_dtype)
        readers = describe.build_layouts(model, readers_desc, "reader", dtype=reader_dtype)
        build_s = time.perf_counter() - t0
        wd, rd = writer_dtype or model.dtype, reader_dtype or model.dtype
        cast = ((wd, rd),) if wd != rd else ()
        options = PlanOptions(bucket_bytes=bucket_mb << 20, cast=cast, pack_mixed=a.pack_mixed)
        simulation = _simulation(a) if a.simulate else None
        if simulation is not None and simulation[2].wire == "fp8":
            options = CodecConfig(fp8=Fp8Config()).plan_options(options)  # as a job plans
        plan = make_plan(writers, readers, options)
        prediction = None
        if simulation is not None:
            _, cluster, sim_options = simulation
            t1 = time.perf_counter()
            prediction = sim.simulate(plan, cluster, sim_options)
            sim_s = time.perf_counter() - t1
    except (ValueError, KeyError, LayoutError) as exc:
        print(f"weightbus plan: {exc}", file=sys.stderr)
        return 2
    r = report(plan)
    r["layout_seconds"] = build_s
    if prediction is not None:
        r["simulation"] = prediction.to_dict()
        r["simulation"]["simulate_seconds"] = sim_s
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    print_report(r)
    print(f"  layouts built  {build_s:.3f} s")
    if prediction is None:
        return 0
    if scenario is not None and scenario.about:
        print(f"scenario {a.preset}: {scenario.about}")
    print("\n".join(prediction.lines()))
    print(f"  simulated in   {sim_s:.3f} s")
    if a.measured:
        try:
            print(_measured_line(a.measured, scenario.bench if scenario else None, prediction))
        except (OSError, ValueError, KeyError) as exc:
            print(
                f"weightbus plan: cannot read measured figures from {a.measured!r}: {exc}",
                file=sys.stderr,
            )
            return 2
    print(
        f"simulate preset={a.preset or 'none'} writers={len(plan.writers)} "
        f"readers={len(plan.readers)} predicted_s={prediction.seconds:.3f}"
    )
    return 0
