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


@_needs(4)
@pytest.mark.timeout(180)
def test_nccl_peer_death_is_seen_by_everyone():
    from tests.transport_contract import run_peer_death

    run_peer_death("nccl", devices=DEVICES, detect_s=10.0)


@_needs(2)
@pytest.mark.timeout(600)
def test_sync_between_gpus_bit_exact(tmp_path):
    """Writer/Reader over NCCL, reader tensors poisoned before the checked sync."""
    from weightbus.bench import gpu

    scenarios = ["S1"] + (["S4"] if torch.cuda.device_count() >= 4 else [])
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
        assert s["bit_exact"], s
    assert all(s["transport"] == "nccl" for s in by_name.values())
