"""GPU tests: the transport contract over NCCL, and Writer/Reader syncs between GPUs.

Marked ``gpu``; skipped without enough CUDA devices. Run on a machine with 4 GPUs with
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu


def _needs(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


DEVICES = {"writer-0": "cuda:0", "writer-1": "cuda:1", "reader-0": "cuda:2", "reader-1": "cuda:3"}


@_needs(4)
@pytest.mark.timeout(180)
def test_nccl_transport_contract():
    from tests.transport_contract import run_contract

    run_contract("nccl", devices=DEVICES, timeout_s=120)


@_needs(2)
@pytest.mark.timeout(180)
def test_nccl_transport_contract_one_link():
    """One writer and one reader: single posts and NCCL groups (send_many / recv_many), bit
    exact."""
    from tests.transport_contract import run_contract

    run_contract(
        "nccl", devices={"writer-0": "cuda:0", "reader-0": "cuda:1"}, timeout_s=120, shape=(1, 1)
    )


@_needs(2)
@pytest.mark.timeout(180)
def test_nccl_transport_contract_processes_sharing_gpus():
    """Both writers on cuda:0, both readers on cuda:1: every link joins two GPUs, so NCCL
    serves the job (a group per link); bit exact."""
    from tests.transport_contract import run_contract

    shared = {
        "writer-0": "cuda:0",
        "writer-1": "cuda:0",
        "reader-0": "cuda:1",
        "reader-1": "cuda:1",
    }
    run_contract("nccl", devices=shared, timeout_s=120)


@_needs(4)
@pytest.mark.timeout(180)
def test_nccl_peer_death_is_seen_by_everyone():
    from tests.transport_contract import run_peer_death

    run_peer_death("nccl", devices=DEVICES, detect_s=10.0)


def _bench(tmp_path, scenarios: list[str]) -> dict:
    """Run ``weightbus bench gpu`` on a small model; the scenarios' entries by name."""
    from weightbus.bench import gpu

    rc = gpu.main(
        [
            "--scenarios",
            ",".join(scenarios),
            "--model",
            "tiny-llama",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--bucket-mb",
            "1",
            "--out",
            str(tmp_path),
            "--kind",
            "test",
        ]
    )
    assert rc == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    by_name = {s["name"]: s for s in result["scenarios"]}
    assert set(by_name) == set(scenarios)
    for s in result["scenarios"]:
        assert s["bit_exact"], s  # reader tensors were poisoned (NaN) before the checked sync
    return by_name


@_needs(2)
@pytest.mark.timeout(600)
def test_sync_between_gpus_bit_exact_nccl(tmp_path):
    """Writer/Reader over NCCL (packed buckets and in-place routes)."""
    four = torch.cuda.device_count() >= 4
    got = _bench(tmp_path, ["S1@nccl"] + (["S4@nccl", "S2@nccl"] if four else []))
    assert all(s["transport"] == "nccl" for s in got.values())


@_needs(2)
@pytest.mark.timeout(600)
def test_sync_between_gpus_bit_exact_cuda_ipc(tmp_path):
    """Writer/Reader over CUDA IPC, chosen automatically: GPU to GPU, colocated on one GPU,
    and strided regions (FSDP rows -> tensor-parallel columns) pulled from two writers."""
    four = torch.cuda.device_count() >= 4
    got = _bench(tmp_path, ["S1", "S3"] + (["S4", "S2"] if four else []))
    assert all(s["transport"] == "cuda_ipc" for s in got.values())


@_needs(2)
@pytest.mark.timeout(600)
def test_cuda_ipc_buckets_as_cuda_graphs_bit_exact(tmp_path, monkeypatch):
    """Every bucket's memcpys captured once as a CUDA graph and replayed each sync: plain and
    strided 2-D regions (FSDP rows -> tensor-parallel columns) stay bit exact."""
    monkeypatch.setenv("WEIGHTBUS_IPC_GRAPH_MEMCPYS", "1")  # the bench's processes inherit it
    four = torch.cuda.device_count() >= 4
    got = _bench(tmp_path, ["S1"] + (["S4"] if four else []))
    assert all(s["transport"] == "cuda_ipc" for s in got.values())
