"""The nccl transport's own logic in CI, on CPU (``tests/nccl_on_cpu.py``: Gloo in place of
NCCL, host stand-ins for CUDA streams and events): the transport contract, a peer killed mid
transfer and a peer's reported failure. NCCL's behaviour itself is the GPU tests' part
(``tests/test_gpu.py``)."""

from __future__ import annotations

import pytest

from tests import transport_contract

NAME = "test-nccl-on-cpu"


@pytest.mark.timeout(120)
def test_contract_nccl_logic_on_cpu():
    reports = transport_contract.run_contract(NAME)
    assert set(reports) == {"writer-0", "writer-1", "reader-0", "reader-1"}


@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer_nccl_logic_on_cpu():
    reports = transport_contract.run_peer_death(NAME)
    assert max(r["detect_s"] for r in reports.values() if "detect_s" in r) < (
        transport_contract.DETECT_S
    )


@pytest.mark.timeout(120)
def test_peer_reported_failure_nccl_logic_on_cpu():
    reports = transport_contract.run_peer_failure(NAME)
    assert max(r["detect_s"] for r in reports.values()) < transport_contract.DETECT_S


def test_the_stand_in_is_never_chosen_automatically():
    from weightbus.transports.base import transport_class

    assert transport_class(NAME).priority < 0
