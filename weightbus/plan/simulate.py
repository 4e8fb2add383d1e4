"""Cluster-scale simulation: a plan plus a cluster description in, predicted sync time out.

    weightbus plan --simulate --preset kimi-k2
    weightbus plan --simulate --preset S4 --measured bench/results/2026-11-21-4xh200.json
    weightbus plan --simulate --model deepseek-v3 --writers fsdp:shard=8,ep=32 \\
        --readers vllm:tp=8,dp=16,ep=on --cluster h200-8x400g --wire fp8

:func:`simulate` takes a :class:`~weightbus.plan.planner.TransferPlan` (from
:func:`~weightbus.plan.make_plan`), a :class:`Cluster` and :class:`SimOptions`, and returns a
:class:`Prediction`: seconds per phase and for the whole sync. It is a cost model, not a
packet simulator. It works on the plan's route and bucket columns with numpy; only the network
schedule is a Python loop, over chunks of flows aggregated per GPU pair (thousands, not
millions). A Kimi-K2-sized plan (1.2M routes) simulates in about a second.

The model, every assumption in one place (README "Simulating a cluster" repeats it):

Placement
    Writers take GPUs 0..W-1 in order, ``gpus_per_node`` per node. Readers follow on the same
    node when everything fits in one node ("packed", as the 4-GPU bench does), else from the
    first node after the writers' last ("nodes": trainer and inference jobs on separate nodes);
    "colocated" puts reader i on writer i's GPU. A writer in host memory (``writer_memory=
    "host"``) sits in the pinned host memory of its GPU slot's node and reaches GPUs over PCIe.
Routes
    Each route travels one path: same GPU (a device copy), same node (NVLink, or PCIe from
    host memory), or another node (the network: the source GPU's NIC to the destination GPU's
    NIC, by ``gpu_nic``).
Fan-out inside a host (``fanout=True``)
    Routes that cross the network (or PCIe from host memory) and carry the same canonical box
    to several readers of one node are sent once, to one of them (rotating over the group so
    the entries spread over the node's GPUs and NICs), and passed on over NVLink along a chain
    of the others. Each reader still unpacks its own copy. ``relay_nvlink=True`` does the same
    for same-node GPU sources (one copy leaves the writer, readers relay it). Neither is in
    the current Writer/Reader yet: they are the schedule the simulator proposes.
Wire bytes
    The plan's wire dtype (the readers' dtype) unless ``wire="fp8"``: then the tensors the FP8
    codec quantizes (``Fp8Config().quantizes``: 2-D weights, not norms, embeddings,
    ``lm_head``, routers or biases) travel as 1 byte per element, and each reader gets one
    float32 scale per 128 x 128 block its share of a tensor touches, as the codec sends them
    (:mod:`weightbus.codecs.fp8`). Writers quantize every such route, blocks cut between
    writers included (they agree on those blocks' amax by an all-reduce, not modelled: about
    1/8192 of the weights' bytes at most). The totals equal the bytes of the plan a job with
    FP8 makes (``tests/test_simulate.py`` checks it). The plan simulated is in the plan dtype
    (``weightbus plan --wire fp8`` makes it with the FP8 plan options,
    ``CodecConfig.plan_options``), so its buckets hold bf16 bytes and are more than the FP8
    plan's (more messages). Quantizing is a pack (a memory-bound
    pass). Before any FP8 byte leaves, each writer reads its quantized weights once (the amax
    pass: finite weights and the block scales), at twice the device copy rate (a read alone
    moves half the bytes of a copy), a phase of its own that nothing overlaps; the bf16
    buckets the codec sends beside it are not modelled.
Pack (writers) and unpack (readers)
    A route moves in place on a side (no staging, no copy) when it is alone in its bucket, its
    region of that side's local tensor is contiguous, and that side needs no dtype change;
    otherwise it is copied through a staging buffer: read + write bytes at ``copy_gbps`` (a
    same-GPU device copy, bytes copied per second), times ``strided_efficiency`` when the
    region is not contiguous. Writers in host memory pack at ``host_copy_gbps``.
Network
    NICs are full duplex at ``nic_gbits / 8 * nic_efficiency`` GB/s each way, and a NIC is not
    faster than the PCIe links of the GPUs behind it. Bytes are aggregated per (source GPU,
    destination GPU) flow and cut into chunks of ``chunk_bytes`` (a flow's last one shorter).
    Balanced waves: chunks are placed biggest first (ties round-robin over each destination's
    flows, sources rotated per destination), each into the first wave where both its source
    NIC and its destination NIC carry fewer than ``max_flows_per_nic`` chunks. That is the
    incast limit (never more concurrent flows into one NIC), kept on the sending side too. A
    wave lasts as long as its busiest NIC (ingress or egress) needs, plus ``latency_s``; the
    network phase is the sum of the waves. The bound, the busiest NIC's bytes over its rate,
    is reported beside it.
NVLink and PCIe
    Each GPU moves ``nvlink_gbps`` in and out at once over NVLink (NVSwitch all-to-all, so a
    GPU's own links are the limit, not the pair), and ``pcie_gbps`` from host memory.
Combining phases
    Pack, network, NVLink, PCIe, same-GPU copies and unpack overlap (the writers pipeline
    buckets through several staging buffers), so the sync takes the slowest of them, plus the
    pipeline's fill and drain (packing the largest staged bucket, unpacking one, forwarding
    one), plus posting: ``message_s`` per bucket message on the busiest participant (a
    participant posts and completes its messages one by one), plus ``control_s`` (begin, acks,
    commit), plus the FP8 amax pass. ``pipelined=False`` adds the phases instead.

CUDA IPC (``transport="cuda_ipc"``; everything above is the default ``"staged"`` model)
    Readers pull straight from the writers' GPU memory on one host (more nodes, host memory
    or ``wire="fp8"`` are refused): no staging, no packing, no per-bucket message. Every route
    is one copy-engine copy (contiguous or 2-D strided, both assumed at full rate); a route
    that casts runs a copy kernel instead, assumed at the same rate (not measured). Relays:
    buckets that a writer sends several readers with the same source regions in the same order
    (engine replicas) are pulled by the first of those readers from the writer and by each next
    one from the reader before it, where that cuts the writer's bytes out enough (the
    transport's rule, ``relay_pays``; not for tensor-parallel readers' replicated tensors;
    ``fanout=False`` turns relays off). A reader takes its sources (writers, upstream readers)
    one at a time, sorted writers first, starting at source ``i mod n`` for reader ``i``. A fluid
    simulation runs those per-reader sequences: between events, a same-GPU copy runs at
    ``copy_gbps`` (bytes copied per second) shared among that GPU's same-GPU copies, and a
    copy between GPUs at ``ipc_gbps / (copies out of its source GPU x copies into its
    destination GPU)``. That rule reproduces the patterns measured with raw copies on the
    bench host: one copy 392.7 GB/s, two disjoint pairs ~787 in all, one GPU to three ~395 in
    all, 2 x 2 crossing copies ~400 in all; a 3-hop chain measured ~380 per hop, where the rule
    says 392.7 (no cost for a GPU that receives and sends at once). A relayed copy starts once
    its upstream reader has done one chunk (1/64 of what that reader relays) and runs no faster
    than its upstream while one chunk behind. Queueing a copy costs the reader ``ipc_call_s``
    of CPU, overlapped with the copies (the slower of the two counts), and a sync adds
    ``ipc_control_s`` (begin, acknowledgements, commit). Left out: copies of different readers
    competing for one GPU's memory bandwidth beyond that rule, stream and event waits.

Machines (:data:`CLUSTERS`)
    ``h200x4``: the project's 4 x H200 bench host, one node, no network; NVLink, copy and PCIe
    rates are the ceilings measured in ``bench/results/2026-11-21-4xh200.json``. ``message_s``
    is the one value fitted for the staged model, from that file's S1@nccl; S2@nccl and
    S4@nccl are then predictions. ``ipc_gbps`` is that file's copy-engine peer copy ceiling
    (392.7); ``ipc_control_s`` (1.53 ms) is the one value fitted for CUDA IPC, from its S1
    (over cuda_ipc, the bench's default on one host); S2-S4 over cuda_ipc are predictions.
    ``ipc_call_s`` (5 us) is assumed ("a few microseconds" per memcpy call), not fitted. S5
    (host memory, ``bench/results/2026-11-21-4xh200-s5.json``) is predicted with the staged
    model, which is the only one for host memory: 108.5 ms against 133.1 ms measured over
    CUDA IPC relay chains (-18%); its PCIe rate is one GPU's alone (55.5 GB/s), while four
    GPUs copying at once measured ~45 GB/s each. S6 (FP8 over NCCL) is a prediction too:
    30.9 ms against 29.4 ms measured on 2 x H200
    (``bench/results/2026-11-22-2xh200-fp8-in-place.json``, +5%); its amax pass is predicted
    at 3.3 ms, as measured on the whole GPU (3.8-4.1 on the 112 SMs it runs on beside the
    sends, which the bf16 buckets sent ahead partly hide). ``h200-8x400g``: the same GPUs, 8
    per node, one 400 Gb/s RDMA NIC each; the NIC rate is the line rate times an assumed 90%
    efficiency (not measured here: the project's machines have no RDMA NIC).

What it leaves out: contention between phases for one GPU's memory bandwidth or SMs,
congestion and retransmits inside the network fabric (a non-blocking fabric is assumed),
NIC-to-NIC rail constraints, the trainer's own work before the sync (an FSDP trainer's shards
are assumed final in its memory), and the engine's work after it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightbus.codecs.fp8 import SCALE_DTYPE, Fp8Config
from weightbus.plan._boxes import group_starts, lexsort_rows, volume
from weightbus.plan.planner import TransferPlan, _local_shapes
from weightbus.spec import itemsize

__all__ = [
    "CLUSTERS",
    "Cluster",
    "Prediction",
    "SCENARIOS",
    "Scenario",
    "SimOptions",
    "gbps",
    "measured",
    "relative_error",
    "simulate",
]

GB = 1e9
MiB = 1 << 20
SCALE_BYTES = itemsize(SCALE_DTYPE)
"""One FP8 block scale (float32)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """The hardware a plan runs on: nodes of GPUs, their NICs and links, and fixed costs."""

    name: str = "custom"
    """A label for reports."""
    gpus_per_node: int = 8
    """GPUs per node (host)."""
    nics_per_node: int = 8
    """Network interfaces per node used for the transfer (0: a single node, no network)."""
    nic_gbits: float = 400.0
    """Line rate of one NIC, gigabits per second, each direction."""
    nic_efficiency: float = 0.9
    """Fraction of the line rate a long RDMA transfer achieves (headers, protocol)."""
    gpu_nic: tuple[int, ...] = ()
    """NIC index (0..nics_per_node-1) serving each local GPU; empty: GPU i uses NIC
    ``i * nics_per_node // gpus_per_node``."""
    nvlink_gbps: float = 370.6
    """GB/s one GPU moves to other GPUs of its node, each direction at once."""
    pcie_gbps: float = 55.5
    """GB/s between a GPU and host memory (pinned), and between a GPU and its NIC."""
    copy_gbps: float = 2129.7
    """Same-GPU device copy, bytes copied per second (a pack or unpack of contiguous bytes)."""
    strided_efficiency: float = 1.0
    """Fraction of ``copy_gbps`` a copy of a non-contiguous region achieves."""
    host_copy_gbps: float = 20.0
    """GB/s one process packs in host memory (writers in host memory only)."""
    message_s: float = 20e-6
    """Seconds one participant spends per bucket message: posting, stream and completion work."""
    latency_s: float = 10e-6
    """Seconds added per network wave (first byte across, completion notice)."""
    max_flows_per_nic: int = 4
    """Incast limit: most flows that may send into one NIC at once."""
    control_s: float = 1e-3
    """Seconds per sync on the control plane (begin, acknowledgements, commit)."""
    ipc_gbps: float = 392.7
    """CUDA IPC: GB/s of one copy-engine copy from one GPU to another of its node, alone."""
    ipc_call_s: float = 5e-6
    """CUDA IPC: CPU seconds a reader spends queueing one route's memcpy (overlaps the copies)."""
    ipc_control_s: float = 1e-3
    """CUDA IPC: seconds per sync on the control plane (begin, acknowledgements, commit)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "max_flows_per_nic"):
            if int(getattr(self, name)) < 1:
                raise ValueError(
                    f"Cluster {self.name!r}: {name}={getattr(self, name)} must be >= 1"
                )
        if self.nics_per_node < 0:
            raise ValueError(
                f"Cluster {self.name!r}: nics_per_node={self.nics_per_node} is negative"
            )
        for name in (
            "nic_gbits",
            "nvlink_gbps",
            "pcie_gbps",
            "copy_gbps",
            "host_copy_gbps",
            "ipc_gbps",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"Cluster {self.name!r}: {name}={getattr(self, name)} must be positive"
                )
        for name in ("nic_efficiency", "strided_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(
                    f"Cluster {self.name!r}: {name}={getattr(self, name)} must be in (0, 1]"
                )
        for name in ("message_s", "latency_s", "control_s", "ipc_call_s", "ipc_control_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Cluster {self.name!r}: {name}={getattr(self, name)} is negative")
        nic = tuple(int(x) for x in self.gpu_nic)
        if nic and len(nic) != self.gpus_per_node:
            raise ValueError(
                f"Cluster {self.name!r}: gpu_nic has {len(nic)} entries for {self.gpus_per_node} "
                "GPUs per node: give one NIC index per local GPU, or none"
            )
        if nic and not all(0 <= x < self.nics_per_node for x in nic):
            raise ValueError(
                f"Cluster {self.name!r}: gpu_nic {nic} names NICs outside 0..{self.nics_per_node - 1}"
            )
        object.__setattr__(self, "gpu_nic", nic)

    @property
    def nic_gbps(self) -> float:
        """GB/s one NIC carries each way."""
        return self.nic_gbits / 8 * self.nic_efficiency

    def nic_of_gpu(self) -> np.ndarray:
        """NIC index (within the node) of each local GPU."""
        if self.gpu_nic:
            return np.array(self.gpu_nic, np.int64)
        return (
            np.arange(self.gpus_per_node, dtype=np.int64)
            * max(self.nics_per_node, 1)
            // (self.gpus_per_node)
        )

    def describe(self) -> str:
        """One line naming every figure of the description."""
        net = (
            f"{self.nics_per_node} x {self.nic_gbits:g} Gb/s NICs ({self.nic_gbps:.1f} GB/s each "
            f"way at {self.nic_efficiency:.0%}), at most {self.max_flows_per_nic} flows into a NIC"
            if self.nics_per_node
            else "no network"
        )
        return (
            f"{self.name}: {self.gpus_per_node} GPUs per node, {net}; NVLink {self.nvlink_gbps:g} "
            f"GB/s per GPU, PCIe {self.pcie_gbps:g} GB/s, device copy {self.copy_gbps:g} GB/s; "
            f"{self.message_s * 1e6:g} us per message, {self.control_s * 1e3:g} ms control; "
            f"CUDA IPC peer copy {self.ipc_gbps:g} GB/s, {self.ipc_call_s * 1e6:g} us per copy "
            f"call, {self.ipc_control_s * 1e3:g} ms control"
        )


WIRES = ("plan", "fp8")
TRANSPORTS = ("staged", "cuda_ipc")
PLACEMENTS = ("auto", "packed", "nodes", "colocated")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimOptions:
    """How the plan is run on the cluster."""

    wire: str = "plan"
    """"plan": the plan's wire dtype; "fp8": the FP8 codec's block quantization (its default
    :class:`~weightbus.codecs.Fp8Config`)."""
    placement: str = "auto"
    """"auto", "packed", "nodes" or "colocated" (see the module docstring)."""
    writer_memory: str = "gpu"
    """Where writers hold the weights: "gpu", or "host" (pinned host memory)."""
    fanout: bool = True
    """Send a box needed by several readers of one node across the network once, then NVLink."""
    relay_nvlink: bool = False
    """Also relay same-node duplicates from GPU writers (one copy leaves the writer)."""
    pipelined: bool = True
    """Phases overlap (the slowest sets the time); False adds them up."""
    chunk_bytes: int | None = None
    """Network schedule unit; None: the plan's bucket size."""
    transport: str = "staged"
    """"staged": pushing transports through staging buffers (NCCL, gloo, RDMA); "cuda_ipc":
    readers pull with the copy engines, one host only (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.wire not in WIRES:
            raise ValueError(f"wire={self.wire!r} is not one of {WIRES}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not one of {PLACEMENTS}")
        if self.writer_memory not in ("gpu", "host"):
            raise ValueError(f"writer_memory={self.writer_memory!r} must be 'gpu' or 'host'")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")
        if self.chunk_bytes is not None and self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be positive (or None)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Predicted seconds per phase, the sync's total, and the byte counts behind them."""

    seconds: float
    """Predicted wall time of one sync."""
    phases: dict[str, float]
    """Seconds per phase: pack, network, nvlink, pcie, local, unpack, fill_drain, messages,
    control, and with ``wire="fp8"`` amax."""
    stats: dict[str, float]
    """Bytes and counts: wire_bytes, network_bytes, nvlink_bytes, ..., waves, network_bound_s."""
    cluster: Cluster
    """The cluster it was predicted for."""
    options: SimOptions
    """The options it was predicted with."""
    placement: str
    """The placement used ("packed", "nodes" or "colocated"; "auto" resolved)."""

    def lines(self) -> list[str]:
        """The report printed by ``weightbus plan --simulate``, one string per line."""
        s, p = self.stats, self.phases
        ms = lambda x: f"{x * 1e3:9.2f} ms"  # noqa: E731
        out = [
            f"simulation on {self.cluster.describe()}",
            f"  placement      {self.placement}: {int(s['writer_nodes'])} writer node(s), "
            f"{int(s['reader_nodes'])} reader node(s), {int(s['nodes'])} in all; "
            f"writers in {self.options.writer_memory} memory",
            f"  wire           {_gb(s['wire_bytes'])} ({self.options.wire}; plan dtype "
            f"{_gb(s['plan_bytes'])})"
            + (
                f", FP8 on {s['fp8_fraction']:.1%} of elements: {_gb(s['fp8_bytes'])} with "
                "their block scales"
                if self.options.wire == "fp8"
                else ""
            ),
            f"  paths          network {_gb(s['network_bytes'])}, NVLink {_gb(s['nvlink_bytes'])} "
            f"(fan-out {_gb(s['forward_bytes'])}), PCIe {_gb(s['pcie_bytes'])}, same GPU "
            f"{_gb(s['local_bytes'])}; fan-out saved {_gb(s['fanout_saved_bytes'])} of network/PCIe",
            f"  staged         pack {_gb(s['packed_bytes'])} on writers, unpack "
            f"{_gb(s['unpacked_bytes'])} on readers"
            if self.options.transport == "staged"
            else f"  cuda_ipc       no staging; {int(s['copies'])} copies ({_gb(s['cast_bytes'])} "
            f"cast by a kernel), {int(s['relayed_buckets'])} buckets pulled from an upstream "
            f"reader, longest relay chain {int(s['relay_hops'])} hop(s)",
        ]
        if s["network_bytes"]:
            out.append(
                f"  network        {int(s['flows'])} flows, {int(s['chunks'])} chunks in "
                f"{int(s['waves'])} waves; busiest NIC {_gb(s['max_nic_bytes'])} -> bound "
                f"{s['network_bound_s'] * 1e3:.2f} ms, schedule {p['network'] * 1e3:.2f} ms "
                f"(efficiency {s['network_bound_s'] / max(p['network'], 1e-12):.2f})"
            )
        out.append(
            "  phase prediction (pipelined: the slowest overlapping phase counts)"
            if self.options.transport == "staged"
            else "  phase prediction (copies and calls overlap: the slower counts, then control)"
        )
        for name in p:
            out.append(f"    {name:<12}{ms(p[name])}")
        out.append(f"    {'total':<12}{ms(self.seconds)}")
        return out

    def to_dict(self) -> dict:
        """Everything as plain JSON-able values."""
        return {
            "seconds": self.seconds,
            "phases": dict(self.phases),
            "stats": dict(self.stats),
            "placement": self.placement,
            "cluster": {f: getattr(self.cluster, f) for f in Cluster.__dataclass_fields__},
            "options": {f: getattr(self.options, f) for f in SimOptions.__dataclass_fields__},
        }


OVERLAPPED = ("pack", "network", "nvlink", "pcie", "local", "unpack")
PHASES = (*OVERLAPPED, "fill_drain", "messages", "control")


def _gb(x: float) -> str:
    return f"{x / GB:.3f} GB"


# ---------------------------------------------------------------------------------------------


def _fp8_wire(plan: TransferPlan, elems: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per route under ``wire="fp8"``: whether it travels quantized (the codec's own rule,
    :meth:`Fp8Config.quantizes <weightbus.codecs.Fp8Config.quantizes>` with the default
    ignore list), and the bytes of block scales it carries. The codec sends each reader the
    scale of every block its share of a tensor touches, once (blocks cut by writer shards
    too: writers agree on their amax); those bytes are spread over the reader's routes of the
    tensor by their elements, so that each reader's total is exact where its share of a
    tensor is one box."""
    r, config = plan.routes, Fp8Config()
    quantized = np.array([config.quantizes(t) for t in plan.tensors], bool)[r.tensor]
    scales = np.zeros(len(r))
    rows = np.flatnonzero(quantized)
    if not len(rows):
        return quantized, scales
    nd, block = r.start.shape[1], config.block
    key = r.dst[rows].astype(np.int64) * len(plan.tensors) + r.tensor[rows]
    shares, inv = np.unique(key, return_inverse=True)
    lo = np.full((len(shares), 2), np.iinfo(np.int64).max, np.int64)
    hi = np.zeros((len(shares), 2), np.int64)
    np.minimum.at(lo, inv, r.start[rows, nd - 2 :])
    np.maximum.at(hi, inv, r.stop[rows, nd - 2 :])
    cells = np.prod(-(-hi // block) - lo // block, axis=1)
    share_elems = np.bincount(inv, weights=elems[rows], minlength=len(shares))
    scales[rows] = SCALE_BYTES * cells[inv] * elems[rows] / share_elems[inv]
    return quantized, scales


def _fp8_source_bytes(r, quantized: np.ndarray, source_bytes: np.ndarray) -> np.ndarray:
    """Per route: the writer's bytes its amax pass reads for it, counting each of a writer's
    boxes once (a box sent to several readers is read once)."""
    out = np.zeros(len(r))
    rows = np.flatnonzero(quantized)
    if not len(rows):
        return out
    order = rows[lexsort_rows(r.src[rows], r.tensor[rows], r.start[rows], r.stop[rows])]
    firsts = group_starts([r.src[order], r.tensor[order], r.start[order], r.stop[order]])
    out[order[firsts]] = source_bytes[order[firsts]]
    return out


def _place(
    plan: TransferPlan, cluster: Cluster, options: SimOptions
) -> tuple[str, np.ndarray, np.ndarray]:
    """Global GPU slot of every writer and reader."""
    n_w, n_r, g = len(plan.writers), len(plan.readers), cluster.gpus_per_node
    how = options.placement
    if how == "auto":
        how = "packed" if n_w + n_r <= g else "nodes"
    wgpu = np.arange(n_w, dtype=np.int64)
    if how == "colocated":
        rgpu = np.arange(n_r, dtype=np.int64)
    elif how == "packed":
        rgpu = n_w + np.arange(n_r, dtype=np.int64)
    else:
        rgpu = -(-n_w // g) * g + np.arange(n_r, dtype=np.int64)
    if cluster.nics_per_node == 0:
        nodes = int(max(wgpu.max(initial=0), rgpu.max(initial=0))) // g + 1
        if nodes > 1:
            raise ValueError(
                f"{n_w} writers and {n_r} readers placed {how!r} need {nodes} nodes of {g} GPUs, "
                f"but cluster {cluster.name!r} has no NICs: give nics_per_node, or fewer participants"
            )
    return how, wgpu, rgpu


def _sum_by(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """``weights`` summed per ``index`` value, float64, length ``n`` (also when empty)."""
    return np.bincount(index, weights=weights, minlength=n).astype(np.float64)


def _contiguous(start: np.ndarray, extent: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Row-wise: is the region ``[start, start + extent)`` of a tensor of ``shape`` one run of
    memory (row-major)? True when every dim inside the outermost dim of extent > 1 is whole."""
    n, nd = extent.shape
    whole = extent == shape
    # inner_whole[:, d]: every dim after d is whole
    inner_whole = np.ones((n, nd), bool)
    for d in range(nd - 2, -1, -1):
        inner_whole[:, d] = inner_whole[:, d + 1] & whole[:, d + 1]
    outer = np.argmax(extent > 1, axis=1)
    single = ~np.any(extent > 1, axis=1)
    return single | inner_whole[np.arange(n), outer]


def _local_shape_rows(layouts, part: np.ndarray, key: np.ndarray, nd: int) -> np.ndarray:
    tables = [_local_shapes(lay, nd) for lay in layouts]
    base = np.cumsum([0] + [len(t) for t in tables])
    return np.concatenate(tables)[base[part] + key]


def simulate(plan: TransferPlan, cluster: Cluster, options: SimOptions | None = None) -> Prediction:
    """Predict one sync of ``plan`` on ``cluster``; see the module docstring for the model."""
    opts = options or SimOptions()
    r, b = plan.routes, plan.buckets
    n, nd = len(r), r.start.shape[1]
    g = cluster.gpus_per_node
    how, wgpu, rgpu = _place(plan, cluster, opts)
    if opts.transport == "cuda_ipc":
        return _simulate_ipc(plan, cluster, opts, how, wgpu, rgpu)
    host_src = opts.writer_memory == "host"

    src, dst = r.src.astype(np.int64), r.dst.astype(np.int64)
    sg, dg = wgpu[src], rgpu[dst]
    snode, dnode = sg // g, dg // g
    tensor = r.tensor.astype(np.int64)
    extent = r.stop - r.start
    elems = volume(r.start, r.stop)
    wire_item = np.array([itemsize(t.dtype) for t in plan.tensors], np.int64)[tensor]
    src_item = np.array([itemsize(d) for d in plan.src_dtypes], np.int64)[tensor]
    plan_bytes = r.nbytes.astype(np.float64)

    # -- wire bytes (FP8 block quantization of linear weights) --------------------------------
    wire = plan_bytes.copy()
    quantized = np.zeros(n, bool)
    if opts.wire == "fp8":
        quantized, scales = _fp8_wire(plan, elems)
        wire = np.where(quantized, elems + scales, plan_bytes)

    # -- paths ---------------------------------------------------------------------------------
    same_node = snode == dnode
    if host_src:
        path = np.where(same_node, PCIE, NETWORK)
    else:
        path = np.where(sg == dg, LOCAL, np.where(same_node, NVLINK, NETWORK))

    # -- fan-out: one copy per destination node crosses the network / PCIe, NVLink passes it on --
    sent = np.ones(n, bool)  # the writer sends this route
    fwd_out = np.zeros(n, bool)  # this route's reader passes its copy on to the next reader
    fwd_in = np.zeros(n, bool)  # this route's reader gets its copy from another reader
    relay = (path == NETWORK) | (path == PCIE)
    if opts.relay_nvlink:
        relay |= path == NVLINK
    if opts.fanout and relay.any():
        rows_ = np.flatnonzero(relay)
        order = rows_[
            lexsort_rows(dnode[rows_], tensor[rows_], r.start[rows_], r.stop[rows_], dst[rows_])
        ]
        firsts = group_starts([dnode[order], tensor[order], r.start[order], r.stop[order]])
        sizes = np.diff(np.append(firsts, len(order)))
        gid = np.repeat(np.arange(len(firsts)), sizes)
        pos = np.arange(len(order)) - firsts[gid]
        k = sizes[gid]
        chain = (pos - gid) % k  # rotate the entry over the group's readers
        multi = k > 1
        sent[order[multi & (chain > 0)]] = False
        fwd_in[order[multi & (chain > 0)]] = True
        fwd_out[order[multi & (chain < k - 1)]] = True
    saved = float(wire[~sent].sum())

    # -- pack and unpack: in place, contiguous staged, or strided staged ----------------------
    lone = b.count[r.bucket] == 1
    src_contig = _contiguous(
        r.src_local, extent, _local_shape_rows(plan.writers, src, r.src_key.astype(np.int64), nd)
    )
    dst_contig = _contiguous(
        r.dst_local, extent, _local_shape_rows(plan.readers, dst, r.dst_key.astype(np.int64), nd)
    )
    writer_inplace = lone & src_contig & (src_item == wire_item) & ~quantized
    reader_inplace = lone & dst_contig
    packed = sent & ~writer_inplace & (path != LOCAL)
    # a pack (a quantization, with FP8) reads the writer's elements and writes the wire bytes;
    # an unpack reads and writes the wire bytes
    pack_traffic = (elems * src_item + wire) / 2
    pack_rate = np.where(src_contig, 1.0, cluster.strided_efficiency) * (
        cluster.host_copy_gbps if host_src else cluster.copy_gbps
    )
    pack_s = np.where(packed, pack_traffic / (pack_rate * GB), 0.0)
    unpacked = ~reader_inplace & (path != LOCAL)
    unpack_rate = np.where(dst_contig, 1.0, cluster.strided_efficiency) * cluster.copy_gbps
    unpack_s = np.where(unpacked, wire / (unpack_rate * GB), 0.0)
    n_w, n_r = len(plan.writers), len(plan.readers)
    t_pack = float(_sum_by(src, pack_s, n_w).max(initial=0.0))
    t_unpack = float(_sum_by(dst, unpack_s, n_r).max(initial=0.0))

    # -- NVLink (same-node routes and fan-out forwards), PCIe, same GPU ------------------------
    n_gpu = int(max(wgpu.max(initial=0), rgpu.max(initial=0))) + 1
    nv = sent & (path == NVLINK)
    nv_out = _sum_by(sg[nv], wire[nv], n_gpu)
    nv_in = _sum_by(dg[nv], wire[nv], n_gpu)
    nv_out += _sum_by(dg[fwd_out], wire[fwd_out], n_gpu)
    nv_in += _sum_by(dg[fwd_in], wire[fwd_in], n_gpu)
    t_nvlink = float(np.maximum(nv_out, nv_in).max(initial=0.0)) / (cluster.nvlink_gbps * GB)
    pc = sent & (path == PCIE)
    pcie_in = _sum_by(dg[pc], wire[pc], n_gpu)
    t_pcie = float(pcie_in.max(initial=0.0)) / (cluster.pcie_gbps * GB)
    lo = sent & (path == LOCAL)
    local_traffic = (elems * src_item + wire) / 2  # a copy (and cast) from tensor to tensor
    t_local = float(_sum_by(dg[lo], local_traffic[lo], n_gpu).max(initial=0.0)) / (
        cluster.copy_gbps * GB
    )

    # -- network: balanced waves under the incast limit ----------------------------------------
    net = sent & (path == NETWORK)
    chunk = opts.chunk_bytes or plan.options.bucket_bytes
    t_net, net_stats = _network(sg[net], dg[net], wire[net], cluster, chunk)

    # -- messages, fill and drain, control ----------------------------------------------------
    bucket_sent = np.bincount(r.bucket, weights=sent, minlength=len(b)) > 0
    w_msgs = np.bincount(b.src[bucket_sent], minlength=n_w)
    fwd_buckets = np.unique(r.bucket[fwd_out])
    r_msgs = np.bincount(b.dst, minlength=n_r) + np.bincount(b.dst[fwd_buckets], minlength=n_r)
    t_msgs = float(max(w_msgs.max(initial=0), r_msgs.max(initial=0))) * cluster.message_s
    staged_w = np.bincount(r.bucket, weights=pack_s, minlength=len(b))
    staged_r = np.bincount(r.bucket, weights=unpack_s, minlength=len(b))
    fwd_b = np.bincount(r.bucket[fwd_out], weights=wire[fwd_out], minlength=len(b))
    t_fill = (
        float(staged_w.max(initial=0.0))
        + float(staged_r.max(initial=0.0))
        + float(fwd_b.max(initial=0.0)) / (cluster.nvlink_gbps * GB)
    )

    phases = {
        "pack": t_pack,
        "network": t_net,
        "nvlink": t_nvlink,
        "pcie": t_pcie,
        "local": t_local,
        "unpack": t_unpack,
        "fill_drain": t_fill if opts.pipelined else 0.0,
        "messages": t_msgs,
        "control": cluster.control_s,
    }
    if opts.wire == "fp8":
        # each writer reads its quantized weights once before FP8 bytes leave (the amax pass):
        # a read-only pass, at twice the copy rate's bytes copied (a copy reads and writes)
        read = _sum_by(src, _fp8_source_bytes(r, quantized, elems * src_item), n_w)
        rate = 2 * (cluster.host_copy_gbps if host_src else cluster.copy_gbps) * GB
        phases["amax"] = float(read.max(initial=0.0)) / rate
    overlapped = [phases[k] for k in OVERLAPPED]
    core = max(overlapped) if opts.pipelined else sum(overlapped)
    serial = ("fill_drain", "messages", "control", "amax")
    seconds = core + sum(phases.get(k, 0.0) for k in serial)

    nodes_w = np.unique(wgpu // g)
    nodes_r = np.unique(rgpu // g)
    elems_total = float(elems.sum())
    stats = {
        "plan_bytes": float(plan_bytes.sum()),
        "wire_bytes": float(wire.sum()),
        "fp8_fraction": float(elems[quantized].sum() / elems_total) if elems_total else 0.0,
        "fp8_bytes": float(wire[quantized].sum()),
        "network_bytes": float(wire[net].sum()),
        "nvlink_bytes": float(wire[nv].sum() + wire[fwd_in].sum()),
        "forward_bytes": float(wire[fwd_in].sum()),
        "pcie_bytes": float(wire[pc].sum()),
        "local_bytes": float(wire[lo].sum()),
        "fanout_saved_bytes": saved,
        "packed_bytes": float(wire[packed].sum()),
        "unpacked_bytes": float(wire[unpacked].sum()),
        "writer_messages_max": float(w_msgs.max(initial=0)),
        "reader_messages_max": float(r_msgs.max(initial=0)),
        "nodes": float(len(np.union1d(nodes_w, nodes_r))),
        "writer_nodes": float(len(nodes_w)),
        "reader_nodes": float(len(nodes_r)),
        **net_stats,
    }
    return Prediction(
        seconds=seconds,
        phases=phases,
        stats=stats,
        cluster=cluster,
        options=opts,
        placement=how,
    )


LOCAL, NVLINK, PCIE, NETWORK = 0, 1, 2, 3


def _simulate_ipc(
    plan: TransferPlan,
    cluster: Cluster,
    opts: SimOptions,
    how: str,
    wgpu: np.ndarray,
    rgpu: np.ndarray,
) -> Prediction:
    """The CUDA IPC model (module docstring, "CUDA IPC"): readers pull, one source at a time."""
    r, b = plan.routes, plan.buckets
    g = cluster.gpus_per_node
    if opts.writer_memory != "gpu" or opts.wire != "plan":
        raise ValueError(
            f"transport='cuda_ipc' copies GPU memory in the plan's dtype: writer_memory="
            f"{opts.writer_memory!r} and wire={opts.wire!r} need transport='staged'"
        )
    n_w, n_r = len(plan.writers), len(plan.readers)
    nodes = np.union1d(wgpu // g, rgpu // g)
    if len(nodes) > 1:
        raise ValueError(
            f"transport='cuda_ipc' works within one host, but {n_w} writers and {n_r} readers "
            f"placed {how!r} span {len(nodes)} nodes of {g} GPUs: use transport='staged'"
        )
    tensor = r.tensor.astype(np.int64)
    wire_item = np.array([itemsize(t.dtype) for t in plan.tensors], np.int64)[tensor]
    src_item = np.array([itemsize(d) for d in plan.src_dtypes], np.int64)[tensor]
    cast = src_item != wire_item

    # -- relays: identical buckets (same writer, same source regions, same order) chain over
    # the readers that take them, in reader order; each pulls from the one before
    upstream = np.full(len(b), -1, np.int64)  # bucket -> the upstream reader's bucket
    hops = np.zeros(len(b), np.int64)  # readers between the writer and this bucket's reader
    if opts.fanout:
        last: dict[tuple, int] = {}
        extent = r.stop - r.start
        order = np.lexsort((np.arange(len(b)), b.dst))
        for k in order.tolist():
            lo, hi = int(b.first[k]), int(b.first[k] + b.count[k])
            key = (
                int(b.src[k]),
                r.src_key[lo:hi].tobytes(),
                r.src_local[lo:hi].tobytes(),
                extent[lo:hi].tobytes(),
            )
            if key in last and int(b.dst[last[key]]) != int(b.dst[k]):
                upstream[k] = last[key]
                hops[k] = hops[last[key]] + 1
            last[key] = k
        # only where the chains cut a writer's bytes out enough (as the transport decides)
        from weightbus.transports.cuda_ipc import relay_pays

        ingress = np.bincount(b.dst, weights=b.nbytes, minlength=n_r)
        for w in range(n_w):
            mine = b.src == w
            direct = int(b.nbytes[mine].sum())
            with_relays = direct - int(b.nbytes[mine & (upstream >= 0)].sum())
            busiest = int(ingress[np.unique(b.dst[mine])].max()) if mine.any() else 0
            if not relay_pays(direct, with_relays, busiest):
                upstream[mine] = -1
                hops[mine] = 0
    # the source of each bucket: writer w -> w, upstream reader q -> n_w + q
    source = np.where(upstream >= 0, n_w + b.dst[np.maximum(upstream, 0)], b.src).astype(np.int64)
    src_gpu = np.concatenate([wgpu, rgpu])[source]
    nbytes = b.nbytes.astype(np.float64)

    # -- segments: per reader, its sources in rotated order (reader i starts at source i mod n)
    seg_reader: list[int] = []
    seg_source: list[int] = []
    seg_of_bucket = np.empty(len(b), np.int64)
    for q in range(n_r):
        mine = np.flatnonzero(b.dst == q)
        names = np.unique(source[mine])
        if len(names) == 0:
            continue
        k = q % len(names)
        names = np.concatenate([names[k:], names[:k]])
        at = {int(x): len(seg_reader) + i for i, x in enumerate(names.tolist())}
        for x in names.tolist():
            seg_reader.append(q)
            seg_source.append(int(x))
        seg_of_bucket[mine] = [at[int(x)] for x in source[mine].tolist()]
    n_seg = len(seg_reader)
    seg_bytes = _sum_by(seg_of_bucket, nbytes, n_seg)
    seg_sgpu = np.concatenate([wgpu, rgpu])[np.array(seg_source, np.int64)] if n_seg else wgpu[:0]
    seg_dgpu = rgpu[np.array(seg_reader, np.int64)] if n_seg else rgpu[:0]
    # a relayed segment tracks the upstream segments its buckets came from:
    # feed[s, u] = bytes of upstream segment u that segment s pulls again
    feed: dict[int, dict[int, float]] = {}
    lag = np.zeros(n_seg)  # one chunk of the upstream reader's relayed bytes
    relayed = np.flatnonzero(upstream >= 0)
    out_bytes = _sum_by(b.dst[upstream[relayed]], nbytes[relayed], n_r)
    for k in relayed.tolist():
        s_, u = int(seg_of_bucket[k]), int(seg_of_bucket[upstream[k]])
        feed.setdefault(s_, {})
        feed[s_][u] = feed[s_].get(u, 0.0) + float(nbytes[k])
    for s_ in feed:
        up_reader = seg_source[s_] - n_w
        lag[s_] = min(out_bytes[up_reader] / RELAY_CHUNKS, seg_bytes[s_])

    t_copies = float(_ipc_timeline(seg_reader, seg_sgpu, seg_dgpu, seg_bytes, feed, lag, cluster))

    copies = np.bincount(b.dst, weights=b.count, minlength=n_r)
    t_calls = float(copies.max(initial=0)) * cluster.ipc_call_s
    phases = {"copies": t_copies, "calls": t_calls, "control": cluster.ipc_control_s}
    seconds = max(t_copies, t_calls) + cluster.ipc_control_s

    r_src_gpu = src_gpu[r.bucket]
    r_dst_gpu = rgpu[r.dst.astype(np.int64)]
    local = r_src_gpu == r_dst_gpu
    rb = r.nbytes.astype(np.float64)
    from_reader = upstream[r.bucket] >= 0
    nodes_w, nodes_r = np.unique(wgpu // g), np.unique(rgpu // g)
    total = float(rb.sum())
    stats = {
        "plan_bytes": total,
        "wire_bytes": total,
        "fp8_fraction": 0.0,
        "fp8_bytes": 0.0,
        "network_bytes": 0.0,
        "nvlink_bytes": float(rb[~local].sum()),
        "forward_bytes": float(rb[from_reader].sum()),
        "pcie_bytes": 0.0,
        "local_bytes": float(rb[local].sum()),
        "fanout_saved_bytes": float(rb[from_reader].sum()),
        "packed_bytes": 0.0,
        "unpacked_bytes": 0.0,
        "copies": float(len(r)),
        "cast_bytes": float(rb[cast].sum()),
        "relayed_buckets": float(len(relayed)),
        "relay_hops": float(hops.max(initial=0)),
        "segments": float(n_seg),
        "reader_copies_max": float(copies.max(initial=0)),
        "nodes": float(len(nodes)),
        "writer_nodes": float(len(nodes_w)),
        "reader_nodes": float(len(nodes_r)),
    }
    return Prediction(
        seconds=seconds, phases=phases, stats=stats, cluster=cluster, options=opts, placement=how
    )


def _fed(
    feed: dict[int, dict[int, float]],
    i: int,
    done: np.ndarray,
    nbytes: np.ndarray,
    finished: np.ndarray,
) -> tuple[float, bool]:
    """Bytes of segment ``i`` its upstream has done (inf: not relayed), and whether the
    upstream is still at it."""
    if i not in feed:
        return math.inf, False
    got = sum(w * min(done[u] / nbytes[u], 1.0) for u, w in feed[i].items())
    return got, any(not finished[u] for u in feed[i])


RELAY_CHUNKS = 64
"""A relaying reader signals its downstream reader after each 1/64 of the bytes it relays (the
cuda_ipc transport's default)."""


def _ipc_timeline(
    seg_reader: list[int],
    sgpu: np.ndarray,
    dgpu: np.ndarray,
    nbytes: np.ndarray,
    feed: dict[int, dict[int, float]],
    lag: np.ndarray,
    cluster: Cluster,
) -> float:
    """Seconds until every reader's last copy ends: a fluid simulation over segments.

    Each reader runs its segments (one source each) in order. Between two events every active
    copy runs at a constant rate: a same-GPU copy at ``copy_gbps`` shared by the GPU's active
    same-GPU copies; a copy between GPUs at ``ipc_gbps / (copies out of its source GPU x
    copies into its destination GPU)``. A relayed segment starts once its upstream has done one
    chunk (``lag``) of what it relays, and runs no faster than that while it is one chunk behind.
    """
    n = len(seg_reader)
    if n == 0:
        return 0.0
    done = np.zeros(n)
    finished = nbytes <= 0
    # current segment per reader: the first of its segments not finished
    first: dict[int, int] = {}
    for i, q in enumerate(seg_reader):
        first.setdefault(q, i)
    current = dict(first)
    ends: dict[int, int] = {}
    for i, q in enumerate(seg_reader):
        ends[q] = i + 1
    t = 0.0
    eps = 1.0  # bytes
    for _ in range(100 * n + 1000):
        for q in list(current):
            i = current[q]
            while i < ends[q] and finished[i]:
                i += 1
            if i == ends[q]:
                del current[q]
            else:
                current[q] = i
        if not current:
            return t
        cur = np.array(sorted(current.values()), np.int64)

        active = []
        for i in cur.tolist():
            got, left = _fed(feed, i, done, nbytes, finished)
            if not left or got >= lag[i] - eps or got >= nbytes[i] - eps:
                active.append(i)
        act = np.array(active, np.int64)
        rate = np.zeros(n)
        if len(act):
            local = sgpu[act] == dgpu[act]
            n_gpu = int(max(sgpu.max(), dgpu.max())) + 1
            peer = act[~local]
            n_out = np.bincount(sgpu[peer], minlength=n_gpu)
            n_in = np.bincount(dgpu[peer], minlength=n_gpu)
            rate[peer] = cluster.ipc_gbps * GB / (n_out[sgpu[peer]] * n_in[dgpu[peer]])
            same = act[local]
            n_same = np.bincount(sgpu[same], minlength=n_gpu)
            rate[same] = cluster.copy_gbps * GB / n_same[sgpu[same]]
        # a relayed copy one chunk behind goes no faster than its upstream feeds it
        feed_rate = np.zeros(n)
        for i in active:
            if i in feed:
                got, left = _fed(feed, i, done, nbytes, finished)
                fr = sum(w * rate[u] / nbytes[u] for u, w in feed[i].items() if not finished[u])
                feed_rate[i] = fr
                if left and done[i] >= got - lag[i] - eps:
                    rate[i] = min(rate[i], fr)
        # next event: a copy ends, a waiting relay gets its first chunk, a relay catches up
        dt = math.inf
        for i in active:
            if rate[i] > 0:
                dt = min(dt, (nbytes[i] - done[i]) / rate[i])
            if i in feed:
                got, left = _fed(feed, i, done, nbytes, finished)
                gap = got - lag[i] - done[i]
                if left and gap > eps and rate[i] > feed_rate[i]:
                    dt = min(dt, gap / (rate[i] - feed_rate[i]))
        for i in set(cur.tolist()) - set(active):
            got, _ = _fed(feed, i, done, nbytes, finished)
            fr = sum(w * rate[u] / nbytes[u] for u, w in feed[i].items() if not finished[u])
            if fr > 0:
                dt = min(dt, (min(lag[i], nbytes[i]) - got) / fr)
        if not math.isfinite(dt):
            raise RuntimeError("cuda_ipc timeline: no copy can make progress (a relay cycle?)")
        dt = max(dt, 0.0)
        t += dt
        done[act] += rate[act] * dt
        finished |= done >= nbytes - eps
        done[finished] = nbytes[finished]
    raise RuntimeError("cuda_ipc timeline: too many events")


def _network(
    sg: np.ndarray, dg: np.ndarray, nbytes: np.ndarray, cluster: Cluster, chunk: int
) -> tuple[float, dict[str, float]]:
    """Seconds for the network phase under balanced waves, and its statistics."""
    stats = dict.fromkeys(
        ("flows", "chunks", "waves", "max_nic_bytes", "network_bound_s", "max_flows_into_nic"),
        0.0,
    )
    if len(sg) == 0:
        return 0.0, stats
    g, k = cluster.gpus_per_node, cluster.nics_per_node
    nic_of = cluster.nic_of_gpu()
    # a NIC is no faster than the PCIe links of the GPUs behind it
    gpus_on_nic = np.bincount(nic_of, minlength=k)
    rate = np.minimum(cluster.nic_gbps, cluster.pcie_gbps * np.maximum(gpus_on_nic, 1)) * GB

    n_gpu = int(max(sg.max(), dg.max())) + 1
    flow_key, inverse = np.unique(sg * n_gpu + dg, return_inverse=True)
    fbytes = _sum_by(inverse, nbytes, len(flow_key))
    fs, fd = flow_key // n_gpu, flow_key % n_gpu
    s_nic = (fs // g) * k + nic_of[fs % g]
    d_nic = (fd // g) * k + nic_of[fd % g]
    n_nic = int(max(s_nic.max(), d_nic.max())) + 1
    nic_rate = rate[np.arange(n_nic) % k]

    # chunks of ``chunk`` bytes (a flow's last one shorter); the waves are built from the
    # biggest chunks down, first fit
    pieces = np.maximum(np.ceil(fbytes / chunk), 1).astype(np.int64)
    flow = np.repeat(np.arange(len(fbytes)), pieces)
    j = np.arange(len(flow)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cbytes = np.minimum(fbytes[flow] - j * chunk, chunk)
    # ties (full chunks) go round-robin over each destination's flows, sources rotated by
    # destination, so that destinations do not all start with the same writer
    rot = (s_nic[flow] - d_nic[flow]) % n_nic
    order = np.lexsort((rot, d_nic[flow], j, -cbytes))
    wave = _first_fit(s_nic[flow][order], d_nic[flow][order], n_nic, cluster.max_flows_per_nic)
    wave_of = np.empty(len(flow), np.int64)
    wave_of[order] = wave
    n_waves = int(wave.max()) + 1
    cells = n_waves * n_nic
    ingress = _sum_by(wave_of * n_nic + d_nic[flow], cbytes, cells)
    egress = _sum_by(wave_of * n_nic + s_nic[flow], cbytes, cells)
    per_nic = np.maximum(ingress, egress).reshape(n_waves, n_nic) / nic_rate
    seconds = float(per_nic.max(axis=1).sum()) + n_waves * cluster.latency_s
    busiest = np.maximum(_sum_by(d_nic, fbytes, n_nic), _sum_by(s_nic, fbytes, n_nic))
    stats.update(
        flows=float(len(fbytes)),
        chunks=float(len(flow)),
        waves=float(n_waves),
        max_nic_bytes=float(busiest.max()),
        network_bound_s=float((busiest / nic_rate).max()),
        max_flows_into_nic=float(np.bincount(wave_of * n_nic + d_nic[flow]).max()),
    )
    return seconds, stats


def _first_fit(src: np.ndarray, dst: np.ndarray, n_nic: int, limit: int) -> np.ndarray:
    """Wave of each chunk, in the given order: the first wave in which both its source NIC and
    its destination NIC still carry fewer than ``limit`` chunks.

    One Python step per chunk (chunks are per GPU pair and ``chunk_bytes`` long: thousands
    for a trillion-parameter model), each probing a few waves.
    """
    out_n = np.zeros((n_nic, 64), np.int32)
    in_n = np.zeros((n_nic, 64), np.int32)
    first_out = np.zeros(n_nic, np.int64)  # no wave before this has room at the NIC
    first_in = np.zeros(n_nic, np.int64)
    wave = np.empty(len(src), np.int64)
    for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist(), strict=True)):
        w = max(first_out[s], first_in[d])
        while True:
            if w >= out_n.shape[1]:
                out_n = np.pad(out_n, ((0, 0), (0, out_n.shape[1])))
                in_n = np.pad(in_n, ((0, 0), (0, in_n.shape[1])))
            if out_n[s, w] < limit and in_n[d, w] < limit:
                break
            w += 1
        wave[i] = w
        out_n[s, w] += 1
        in_n[d, w] += 1
        while out_n[s, first_out[s]] >= limit:
            first_out[s] += 1
        while in_n[d, first_in[d]] >= limit:
            first_in[d] += 1
    return wave


# ---------------------------------------------------------------------------------------------
# machines and scenarios
# ---------------------------------------------------------------------------------------------

# The 4 x H200 host of the project's bench runs: NVLink NV18 all-to-all, no network. Figures
# from the ceilings of bench/results/2026-11-21-4xh200.json: NCCL send/recv 370.6 GB/s (two
# disjoint pairs at once 738.6, so a GPU's own links are the limit), same-GPU copy 2129.7,
# pinned host-to-device 55.5. ``message_s`` is fitted to that file's S1@nccl (the model is of
# the staged, pushing transports; the CUDA IPC pulls of S1-S4 are not modelled yet), the only
# fitted value: (50.14 ms median - 44.34 ms the rest predicts) / 241 messages = 24.1 us.
# CUDA IPC: one copy-engine peer copy 392.7 GB/s (ceiling ``ipc_pull_gbps``); the per-sync
# control cost is the one value fitted for it, to that file's S1 over cuda_ipc: 42.43 ms
# median - 40.90 ms of copies (16.06 GB at 392.7 GB/s) = 1.53 ms.
_H200: dict[str, Any] = dict(
    nvlink_gbps=370.6,
    copy_gbps=2129.7,
    pcie_gbps=55.5,
    message_s=24.1e-6,
    ipc_gbps=392.7,
    ipc_control_s=1.53e-3,
)

CLUSTERS: dict[str, Cluster] = {
    "h200x4": Cluster(name="h200x4", gpus_per_node=4, nics_per_node=0, **_H200),
    # the published RL setting: 8-GPU H200-class nodes, one 400 Gb/s NIC per GPU (RDMA)
    "h200-8x400g": Cluster(
        name="h200-8x400g", gpus_per_node=8, nics_per_node=8, nic_gbits=400.0, **_H200
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A named simulation: model, both layouts, cluster, options, and what was measured."""

    model: str
    """Model preset or config.json path."""
    writers: str
    """Trainer-side layout description (:mod:`weightbus.layouts.describe`)."""
    readers: str
    """Inference-side layout description."""
    cluster: str
    """Name in :data:`CLUSTERS`."""
    options: SimOptions = field(default_factory=SimOptions)
    """Wire format, placement, fan-out."""
    bucket_mb: int = 256
    """Bucket size in MiB (the bench runs use 256)."""
    writer_dtype: str | None = None
    """Trainer dtype; None: the model's."""
    reader_dtype: str | None = None
    """Inference dtype; None: the model's."""
    bench: str | None = None
    """Scenario name in bench/results/*.json holding its measured figures, if any."""
    about: str = ""
    """One line saying what the scenario is."""


SCENARIOS: dict[str, Scenario] = {
    "kimi-k2": Scenario(
        model="kimi-k2",
        writers="fsdp:shard=8,ep=32",
        readers="vllm:tp=8,dp=16,ep=on",
        cluster="h200-8x400g",
        options=SimOptions(wire="fp8", placement="nodes"),
        about="Kimi-K2 (1.03T parameters): 256 bf16 trainer GPUs (FSDP 8 x expert parallel 32) "
        "-> 128 FP8 inference GPUs (vLLM TP 8 x DP 16, expert parallel over all 128)",
    ),
    "S1": Scenario(
        model="llama-3-8b",
        writers="whole",
        readers="vllm:tp=1",
        cluster="h200x4",
        options=SimOptions(transport="cuda_ipc"),
        bench="S1",
        about="1 writer GPU -> 1 reader GPU, 16 GB bf16",
    ),
    "S2": Scenario(
        model="llama-3-8b",
        writers="whole",
        readers="vllm:tp=1,dp=3",
        cluster="h200x4",
        options=SimOptions(transport="cuda_ipc"),
        bench="S2",
        about="1 writer GPU -> 3 reader GPUs, each gets the full model",
    ),
    "S3": Scenario(
        model="llama-3-8b",
        writers="whole",
        readers="vllm:tp=1",
        cluster="h200x4",
        options=SimOptions(placement="colocated", transport="cuda_ipc"),
        bench="S3",
        about="colocated: writer and reader processes on one GPU",
    ),
    "S4": Scenario(
        model="llama-3-8b",
        writers="fsdp:shard=2",
        readers="vllm:tp=2",
        cluster="h200x4",
        options=SimOptions(transport="cuda_ipc"),
        bench="S4",
        about="FSDP2 on 2 GPUs -> tensor parallel 2 on 2 other GPUs",
    ),
    "S5": Scenario(
        model="llama-3-8b",
        writers="fsdp:shard=4",
        readers="vllm:tp=1,dp=4",
        cluster="h200x4",
        options=SimOptions(placement="colocated", writer_memory="host"),
        bench="S5",
        about="16 GB in pinned host memory split in 4 -> every one of 4 GPUs gets all",
    ),
    "S6": Scenario(
        model="llama-3-8b",
        writers="whole",
        readers="vllm:tp=1",
        cluster="h200x4",
        options=SimOptions(wire="fp8"),
        bench="S6",
        about="S1 with FP8 block quantization on the wire (over NCCL: codecs need a pushing "
        "transport)",
    ),
}


def measured(results: Mapping, scenario: str) -> dict | None:
    """The measured entry of ``scenario`` in a bench results dict, or None."""
    for s in results.get("scenarios", ()):
        if s.get("name") == scenario:
            return s
    return None


def relative_error(predicted_s: float, measured_s: float) -> float:
    """(predicted - measured) / measured."""
    if not measured_s > 0:
        raise ValueError(f"measured time {measured_s} must be positive")
    return (predicted_s - measured_s) / measured_s


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB per second (inf for a zero time)."""
    return nbytes / seconds / GB if seconds > 0 else math.inf
