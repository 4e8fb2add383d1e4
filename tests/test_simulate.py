"""The cluster simulator: small plans against hand-computed times, the 4 x H200 figures against
the measured bench results, and `weightbus plan --simulate` as users run it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from weightbus.layouts.describe import build_layouts
from weightbus.layouts.families import model_spec
from weightbus.plan import PlanOptions, make_plan
from weightbus.plan import cli as plan_cli
from weightbus.plan.simulate import (
    CLUSTERS,
    SCENARIOS,
    Cluster,
    SimOptions,
    _contiguous,
    measured,
    relative_error,
    simulate,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "2026-11-21-4xh200.json"

# a one-layer Llama whose linear weights span whole and partial 128 x 128 blocks
SMALL = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# rates chosen so that the expected times are easy to write down
GBs = 1e9
FREE = dict(message_s=0.0, control_s=0.0, latency_s=0.0)


def _plan(writers: str, readers: str, config=SMALL, bucket_bytes: int = 1 << 20):
    m = model_spec(config)
    return make_plan(
        build_layouts(m, writers, "writer"),
        build_layouts(m, readers, "reader"),
        PlanOptions(bucket_bytes=bucket_bytes),
    )


def test_one_node_pipelined_and_serial_by_hand():
    plan = _plan("whole", "whole")
    total = plan.stats.total_bytes
    assert total == 2 * (2 * 512 * 256 + 256 * 256 * 2 + 128 * 256 * 2 + 3 * 512 * 256 + 3 * 256)
    cluster = Cluster(
        gpus_per_node=2, nics_per_node=0, nvlink_gbps=10, copy_gbps=1000, message_s=1e-3
    )
    pred = simulate(plan, cluster)
    p = pred.phases
    # every tensor is below direct_bytes: all staged, packed and unpacked once, contiguous
    assert pred.placement == "packed"
    assert p["nvlink"] == pytest.approx(total / (10 * GBs))
    assert p["pack"] == pytest.approx(total / (1000 * GBs))
    assert p["unpack"] == pytest.approx(total / (1000 * GBs))
    assert p["network"] == p["pcie"] == p["local"] == 0
    n_buckets = len(plan.buckets)
    largest = int(plan.buckets.nbytes.max())
    assert p["messages"] == pytest.approx(n_buckets * 1e-3)
    assert p["fill_drain"] == pytest.approx(2 * largest / (1000 * GBs))
    assert pred.seconds == pytest.approx(
        total / (10 * GBs) + 2 * largest / (1000 * GBs) + n_buckets * 1e-3 + 1e-3
    )
    serial = simulate(plan, cluster, SimOptions(pipelined=False))
    assert serial.seconds == pytest.approx(
        total / (10 * GBs) + 2 * total / (1000 * GBs) + n_buckets * 1e-3 + 1e-3
    )


def test_fp8_wire_bytes_by_hand():
    def fp8(rows: int, cols: int) -> int:  # 1 byte per element, a float32 per 128 x 128 block
        return rows * cols + 4 * -(-rows // 128) * -(-cols // 128)

    linear = fp8(256, 256) * 2 + fp8(128, 256) * 2 + fp8(512, 256) * 2 + fp8(256, 512)
    assert linear == 589968
    kept = 2 * (2 * 512 * 256 + 3 * 256)  # embeddings, lm_head and norms stay bfloat16
    cluster = Cluster(gpus_per_node=4, nics_per_node=0, **FREE)
    for writers in ("whole", "fsdp:shard=2", "fsdp:shard=3"):
        # shards of 2 cut k and v (128 rows) inside a block, shards of 3 cut blocks everywhere:
        # writers still quantize all of it (they agree on the cut blocks' amax), and the reader
        # gets each block's scale once
        pred = simulate(_plan(writers, "whole"), cluster, SimOptions(wire="fp8"))
        assert pred.stats["wire_bytes"] == pytest.approx(linear + kept, abs=1e-6), writers
        assert pred.stats["fp8_bytes"] == pytest.approx(linear, abs=1e-6)
        assert pred.stats["fp8_fraction"] == pytest.approx(589824 / (589824 + kept / 2))
    # the amax pass: the one writer reads its bf16 linear weights once (not once per reader),
    # at twice the copy rate
    pred = simulate(_plan("whole", "vllm:tp=1,dp=2"), cluster, SimOptions(wire="fp8"))
    assert pred.phases["amax"] == pytest.approx(2 * 589824 / (2 * cluster.copy_gbps * GBs))
    assert "amax" not in simulate(_plan("whole", "whole"), cluster).phases


@pytest.mark.parametrize(
    "model, writers, readers",
    [
        (SMALL, "fsdp:shard=3", "vllm:tp=2"),
        (SMALL, "fsdp:shard=2", "fsdp:shard=3"),  # reader shards cut blocks: whole blocks' scales
        (SMALL, "megatron:pp=1,fuse_qkv=on", "vllm:tp=1,dp=2"),
        ("llama-3-8b", "fsdp:shard=3", "vllm:tp=4"),
        ("llama-3-8b", "megatron:tp=2,pp=2", "vllm:tp=2,dp=2"),
        ("qwen3-30b-a3b", "fsdp:shard=3,ep=2", "vllm:tp=2,ep=on"),
    ],
)
def test_fp8_wire_bytes_are_the_codec_plans(model, writers, readers):
    """With ``wire="fp8"`` the simulator's bytes are those of the plan a job with the FP8
    codec makes from the writers' wire layouts and the readers' FP8 engine layouts (blocks cut
    by writer shards and by reader shards included), per reader."""
    from weightbus.codecs import Fp8Config, quantized_layout
    from weightbus.plan.codec_plan import CodecConfig, wire_layout

    m = model_spec(model)
    ws, rs = build_layouts(m, writers, "writer"), build_layouts(m, readers, "reader")
    codecs = CodecConfig(fp8=Fp8Config())
    options = codecs.plan_options(PlanOptions(bucket_bytes=64 << 20))
    real = make_plan(
        [wire_layout(w, codecs) for w in ws],
        [quantized_layout(r, codecs.fp8) for r in rs],
        options,
    )
    plan = make_plan(ws, rs, options)
    cluster = Cluster(gpus_per_node=8, nics_per_node=0, **FREE)
    pred = simulate(plan, cluster, SimOptions(wire="fp8"))
    assert pred.stats["wire_bytes"] == pytest.approx(real.stats.total_bytes, rel=1e-12)
    assert real.stats.total_bytes < plan.stats.total_bytes  # (FP8 did something)


def _two_nodes(**kw) -> Cluster:
    base = dict(
        gpus_per_node=2,
        nics_per_node=1,
        nic_gbits=8.0,
        nic_efficiency=1.0,  # 1 GB/s each way
        nvlink_gbps=10,
        pcie_gbps=100,
        copy_gbps=1e6,
        **FREE,
    )
    return Cluster(**{**base, **kw})


def test_network_fanout_and_incast_by_hand():
    # two trainer replicas on node 0 -> two whole-model readers on node 1, one 1 GB/s NIC each
    plan = _plan("whole:replicas=2", "whole:replicas=2", bucket_bytes=64 << 10)
    model = plan.stats.total_bytes // 2
    pred = simulate(plan, _two_nodes())
    s, p = pred.stats, pred.phases
    assert pred.placement == "nodes" and s["nodes"] == 2
    # each box crosses the network once, then one reader passes it to the other over NVLink
    assert s["network_bytes"] == model and s["forward_bytes"] == model
    assert s["fanout_saved_bytes"] == model
    assert p["network"] == pytest.approx(model / GBs)  # one NIC each side: waves add up exactly
    assert s["network_bound_s"] == pytest.approx(model / GBs)
    # the group's entry rotates: each reader GPU forwards about half the model
    assert model / 2 / (10 * GBs) <= p["nvlink"] <= 0.6 * model / (10 * GBs)

    no_fanout = simulate(plan, _two_nodes(), SimOptions(fanout=False))
    assert no_fanout.stats["network_bytes"] == 2 * model
    assert no_fanout.phases["network"] == pytest.approx(2 * model / GBs)
    assert no_fanout.phases["nvlink"] == 0

    # incast limit of one flow: every chunk is its own wave, each paying the latency
    one = simulate(plan, _two_nodes(max_flows_per_nic=1, latency_s=1e-3), SimOptions(fanout=False))
    assert one.stats["max_flows_into_nic"] == 1
    waves = one.stats["waves"]
    assert waves == one.stats["chunks"] > 4
    assert one.phases["network"] == pytest.approx(2 * model / GBs + waves * 1e-3)
    four = simulate(plan, _two_nodes(max_flows_per_nic=4), SimOptions(fanout=False))
    assert four.stats["max_flows_into_nic"] <= 4 and four.stats["waves"] < waves


def test_balanced_waves_spread_sources():
    # 4 trainer GPUs on 2 nodes -> 4 readers on 2 nodes, one NIC per GPU: the schedule must
    # come close to the busiest NIC's bound
    plan = _plan("fsdp:shard=4", "whole:replicas=4", bucket_bytes=64 << 10)
    pred = simulate(plan, _two_nodes(nics_per_node=2, max_flows_per_nic=2), SimOptions())
    s = pred.stats
    assert s["max_flows_into_nic"] <= 2
    assert s["network_bound_s"] <= pred.phases["network"] <= 1.25 * s["network_bound_s"]


def test_colocated_and_host_memory_paths():
    plan = _plan("whole", "whole")
    total = plan.stats.total_bytes
    pred = simulate(
        plan,
        Cluster(gpus_per_node=1, nics_per_node=0, copy_gbps=100, **FREE),
        SimOptions(placement="colocated"),
    )
    assert pred.stats["local_bytes"] == total
    assert pred.phases["local"] == pytest.approx(total / (100 * GBs))
    assert pred.phases["pack"] == pred.phases["unpack"] == pred.phases["nvlink"] == 0

    # two host-memory halves -> two GPUs of their node that each need everything: each box
    # crosses PCIe once and is relayed over NVLink
    plan = _plan("fsdp:shard=2", "whole:replicas=2", bucket_bytes=64 << 10)
    model = plan.stats.total_bytes // 2
    pred = simulate(
        plan, _two_nodes(nics_per_node=0), SimOptions(placement="colocated", writer_memory="host")
    )
    assert pred.stats["pcie_bytes"] == model and pred.stats["forward_bytes"] == model
    assert model / 2 <= pred.phases["pcie"] * 100 * GBs <= 0.6 * model


def test_contiguous_regions():
    shape = np.array([[8, 16]] * 4)
    start = np.array([[2, 0], [0, 4], [3, 5], [0, 0]])
    extent = np.array([[3, 16], [8, 4], [1, 1], [1, 16]])
    assert _contiguous(start, extent, shape).tolist() == [True, False, True, True]
    # a leading dim of extent 1 (one expert of a stacked tensor) keeps a row block contiguous
    assert _contiguous(np.array([[2, 0, 0]]), np.array([[1, 4, 16]]), np.array([[4, 8, 16]]))[0]


def test_bad_descriptions_say_what_to_fix():
    with pytest.raises(ValueError, match="gpu_nic has 3 entries for 8 GPUs"):
        Cluster(gpu_nic=(0, 1, 2))
    with pytest.raises(ValueError, match="nic_efficiency=1.5 must be in"):
        Cluster(nic_efficiency=1.5)
    with pytest.raises(ValueError, match="wire='int4' is not one of"):
        SimOptions(wire="int4")
    with pytest.raises(ValueError, match="has no NICs"):
        simulate(_plan("fsdp:shard=4", "whole"), Cluster(gpus_per_node=2, nics_per_node=0))


def _scenario_plan(name: str):
    sc = SCENARIOS[name]
    return _plan(sc.writers, sc.readers, config=sc.model, bucket_bytes=sc.bucket_mb << 20)


def test_h200_figures_come_from_the_bench_results():
    results = json.loads(RESULTS.read_text())
    c, ceilings = CLUSTERS["h200x4"], results["ceilings"]
    assert c.nvlink_gbps == ceilings["nccl_sendrecv_gbps"]
    assert c.copy_gbps == ceilings["d2d_copy_gbps"]
    assert c.pcie_gbps == ceilings["h2d_pinned_gbps"]
    # message_s is the one fitted value: S1@nccl's measured time less what the rest predicts
    s1 = measured(results, "S1@nccl")
    plan = _scenario_plan("S1")
    rest = simulate(plan, Cluster(**{**_fields(c), "message_s": 0.0}))
    messages = len(plan.buckets)
    fit = (s1["median_s"] - rest.seconds) / messages
    assert fit == pytest.approx(c.message_s, rel=0.02)
    assert simulate(plan, c).seconds == pytest.approx(s1["median_s"], rel=0.02)
    # S2@nccl was not used to fit anything: it is a prediction
    s2 = measured(results, "S2@nccl")
    pred = simulate(_scenario_plan("S2"), c)
    assert abs(relative_error(pred.seconds, s2["median_s"])) < 0.2
    assert measured(results, "S5") is None


def _fields(c: Cluster) -> dict:
    return {f: getattr(c, f) for f in Cluster.__dataclass_fields__}


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightbus.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_cli_kimi_k2_prediction():
    out = _run("plan", "--simulate", "--preset", "kimi-k2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "256 writers -> 128 readers" in out.stdout
    assert "8 x 400 Gb/s NICs" in out.stdout and "fp8" in out.stdout
    for phase in ("pack", "network", "nvlink", "unpack", "total"):
        assert re.search(rf"^\s+{phase}\s+[\d.]+ ms$", out.stdout, re.M), phase
    m = re.fullmatch(
        r"simulate preset=kimi-k2 writers=256 readers=128 predicted_s=([\d.]+)", lines[-1]
    )
    assert m, lines[-1]
    assert 0 < float(m.group(1)) <= 1.3
    simulated = re.search(r"simulated in\s+([\d.]+) s", out.stdout)
    assert simulated and float(simulated.group(1)) < 5


def test_cli_scenario_with_measured_figures_and_errors(capsys):
    args = ["--simulate", "--preset", "S2", "--measured", str(RESULTS)]
    assert plan_cli.main([*args, "--transport", "staged"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"measured\s+S2@nccl over nccl: 137\.\d+ ms median", out)
    assert out.strip().splitlines()[-1].startswith("simulate preset=S2 writers=1 readers=3")
    # the preset's default is the bench's: cuda_ipc, compared with the plain S2 entry
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"measured\s+S2 over cuda_ipc: 50\.\d+ ms median", out)
    assert "longest relay chain 2 hop(s)" in out
    assert (
        plan_cli.main(
            ["--simulate", "--preset", "S3", "--transport", "staged", "--measured", str(RESULTS)]
        )
        == 0
    )
    assert "none for this scenario over staged" in capsys.readouterr().out
    flags = ["--nvlink-gbps", "100", "--transport", "staged", "--json"]
    assert plan_cli.main(["--simulate", "--preset", "S4", *flags]) == 0
    sim = json.loads(capsys.readouterr().out)["simulation"]
    assert sim["cluster"]["nvlink_gbps"] == 100 and sim["phases"]["nvlink"] > 0
    assert plan_cli.main(["--simulate", "--preset", "S4", "--ipc-gbps", "100", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulation"]
    assert sim["options"]["transport"] == "cuda_ipc" and sim["phases"]["copies"] > 0.08
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(["--preset", "S1"])
    assert exc.value.code == 2 and "add --simulate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(["--simulate", "--model", "tiny-llama", "--writers", "whole"])
    assert exc.value.code == 2 and "give --readers" in capsys.readouterr().err


# ---- CUDA IPC -------------------------------------------------------------------------------

IPC = SimOptions(transport="cuda_ipc")


def _ipc_cluster(**kw) -> Cluster:
    base = dict(gpus_per_node=4, nics_per_node=0, ipc_gbps=10, copy_gbps=100, ipc_call_s=0.0)
    return Cluster(**{**base, "ipc_control_s": 1e-3, **kw})


def test_ipc_one_copy_local_copy_and_calls_by_hand():
    plan = _plan("whole", "whole")
    total = plan.stats.total_bytes
    pred = simulate(plan, _ipc_cluster(), IPC)
    assert pred.phases["copies"] == pytest.approx(total / (10 * GBs))
    assert pred.seconds == pytest.approx(total / (10 * GBs) + 1e-3)
    assert pred.stats["packed_bytes"] == pred.stats["unpacked_bytes"] == 0
    assert pred.stats["nvlink_bytes"] == total and pred.stats["copies"] == len(plan.routes)
    colocated = simulate(
        plan, _ipc_cluster(), SimOptions(transport="cuda_ipc", placement="colocated")
    )
    assert colocated.stats["local_bytes"] == total
    assert colocated.phases["copies"] == pytest.approx(total / (100 * GBs))
    # queueing the copies costs CPU; it overlaps the copies, and counts once it is slower
    slow_calls = simulate(plan, _ipc_cluster(ipc_call_s=1.0), IPC)
    assert slow_calls.seconds == pytest.approx(len(plan.routes) * 1.0 + 1e-3)


def test_ipc_rotation_keeps_two_by_two_disjoint():
    # two writer halves -> two whole readers, relays off: reader 0 takes writer 0 then 1,
    # reader 1 writer 1 then 0, so two disjoint copies run at full rate all along
    plan = _plan("fsdp:shard=2", "whole:replicas=2")
    model = plan.stats.total_bytes / 2
    pred = simulate(plan, _ipc_cluster(), SimOptions(transport="cuda_ipc", fanout=False))
    assert pred.phases["copies"] == pytest.approx(model / (10 * GBs), rel=1e-6)
    # one writer to two readers at once: its copies share it, 10 GB/s in all
    plan = _plan("whole", "whole:replicas=2")
    pred = simulate(plan, _ipc_cluster(), SimOptions(transport="cuda_ipc", fanout=False))
    assert pred.phases["copies"] == pytest.approx(2 * model / (10 * GBs), rel=1e-6)


def test_ipc_relay_chain_one_chunk_behind_per_hop():
    plan = _plan("whole", "whole:replicas=3")
    model = plan.stats.total_bytes / 3
    pred = simulate(plan, _ipc_cluster(), IPC)
    assert pred.stats["relay_hops"] == 2
    assert pred.stats["forward_bytes"] == pytest.approx(2 * model)
    # each hop runs at the full rate, starting one chunk (1/64 of the relayed bytes) later
    assert pred.phases["copies"] == pytest.approx((model + 2 * model / 64) / (10 * GBs), rel=1e-6)
    # without relays the writer's copy engines serve the three readers at once: 10 GB/s in all
    no_relay = simulate(plan, _ipc_cluster(), SimOptions(transport="cuda_ipc", fanout=False))
    assert no_relay.phases["copies"] == pytest.approx(3 * model / (10 * GBs), rel=1e-6)
    # the chain (lag included) scales with the copy rate
    slow = simulate(plan, _ipc_cluster(ipc_gbps=5), IPC)
    assert slow.phases["copies"] == pytest.approx(2 * pred.phases["copies"], rel=1e-6)


def test_ipc_refuses_what_it_cannot_do():
    plan = _plan("whole", "whole")
    with pytest.raises(ValueError, match="within one host.*transport='staged'"):
        simulate(
            plan, _two_nodes(gpus_per_node=1), SimOptions(transport="cuda_ipc", placement="nodes")
        )
    with pytest.raises(ValueError, match="wire='fp8' need transport='staged'"):
        simulate(plan, _ipc_cluster(), SimOptions(transport="cuda_ipc", wire="fp8"))
    with pytest.raises(ValueError, match="transport='rdma' is not one of"):
        SimOptions(transport="rdma")


def test_h200_cuda_ipc_predictions_against_the_bench_results():
    results = json.loads(RESULTS.read_text())
    c = CLUSTERS["h200x4"]
    assert c.ipc_gbps == results["ceilings"]["ipc_pull_gbps"]
    assert c.copy_gbps == results["ceilings"]["d2d_copy_gbps"]
    # ipc_control_s is the one value fitted for CUDA IPC: S1's measured time less its copies
    s1 = measured(results, "S1")
    assert s1["transport"] == "cuda_ipc"
    fit = s1["median_s"] - s1["bytes"] / (c.ipc_gbps * 1e9)
    assert fit == pytest.approx(c.ipc_control_s, rel=0.02)
    for name in ("S1", "S2", "S3", "S4"):
        sc = SCENARIOS[name]
        assert sc.options.transport == "cuda_ipc"
        m = measured(results, sc.bench)
        assert m["transport"] == "cuda_ipc", name
        pred = simulate(_scenario_plan(name), c, sc.options)
        assert abs(relative_error(pred.seconds, m["median_s"])) < 0.2, (name, pred.seconds)


def test_h200_s5_prediction_against_the_bench_results():
    # S5 runs over CUDA IPC with relay chains, which the simulator models only for GPU memory:
    # its host-memory prediction is the staged model's (PCIe, then NVLink fan-out)
    results = json.loads((ROOT / "bench" / "results" / "2026-11-21-4xh200-s5.json").read_text())
    m = measured(results, "S5")
    assert m["bit_exact"] and m["transport"] == "cuda_ipc"
    sc = SCENARIOS["S5"]
    pred = simulate(_scenario_plan("S5"), CLUSTERS["h200x4"], sc.options)
    assert abs(relative_error(pred.seconds, m["median_s"])) < 0.2, (pred.seconds, m["median_s"])


def test_h200_s6_prediction_against_the_bench_results(capsys):
    """FP8 over NCCL, planned as a job with FP8 plans it (routes cut to a quarter bucket), the
    amax pass before the FP8 bytes: within 20% of S6 as measured on 2 x H200, in FP8's
    bytes."""
    path = ROOT / "bench" / "results" / "2026-11-22-2xh200-fp8-in-place.json"
    m = measured(json.loads(path.read_text()), "S6")
    assert m["bit_exact"]
    assert plan_cli.main(["--simulate", "--preset", "S6", "--measured", str(path), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulation"]
    assert sim["options"]["wire"] == "fp8" and sim["phases"]["amax"] > 0.003
    assert sim["stats"]["wire_bytes"] == pytest.approx(m["bytes"], rel=0.001)
    assert abs(relative_error(sim["seconds"], m["median_s"])) < 0.2, sim["seconds"]
    assert plan_cli.main(["--simulate", "--preset", "S6", "--measured", str(path)]) == 0
    line = re.search(r"measured\s+S6 over nccl: ([\d.]+) ms median.*predicted ([\d.]+) ms, ([\d.]+) GB/s",
                     capsys.readouterr().out)  # fmt: skip
    assert line, "no measured line"
    # the GB/s on both sides are of the FP8 bytes, not of the plan's bfloat16 ones
    assert float(line.group(3)) == pytest.approx(m["bytes"] / float(line.group(2)) / 1e6, rel=0.01)


def test_h200_staged_model_unchanged():
    # the NCCL (staged) predictions as README's table has them, before CUDA IPC was modelled
    c = CLUSTERS["h200x4"]
    staged = SimOptions(transport="staged")
    for name, ms in (("S1", 50.15), ("S2", 148.43), ("S4", 29.86)):
        pred = simulate(_scenario_plan(name), c, staged)
        assert pred.seconds * 1e3 == pytest.approx(ms, abs=0.01), name
