"""The rdma transport (NIXL, UCX over TCP here): the shared contract in real processes on
loopback, and a full sync between two network namespaces standing in for two hosts.

Skipped when NIXL is not installed (``pip install -e ".[rdma]"``). The namespace test needs
root and iproute2; without them it skips and says so. To run it by hand::

    sudo python -m pytest -q -m netns tests/test_transport_rdma.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from weightbus.transports.rdma import UCX_TLS_ENV, RdmaConfig, nixl_available

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install -e '.[rdma]')"
)

# The contract's participants start from a forkserver, which copies this process's environment
# when it starts (after collection): force UCX onto TCP there, as on a machine without RDMA.
os.environ.setdefault(UCX_TLS_ENV, "tcp")

ROOT = Path(__file__).resolve().parent.parent


def _env_in_participants() -> str | None:
    from tests import transport_contract

    ctx = transport_contract.process_context()
    q = ctx.Queue()
    p = ctx.Process(target=_report_env, args=(q,))
    p.start()
    value = q.get(timeout=30)
    p.join(10)
    return value


def _report_env(q) -> None:
    q.put(os.environ.get(UCX_TLS_ENV))


@pytest.mark.timeout(120)
def test_contract_rdma():
    from tests import transport_contract

    assert _env_in_participants() == "tcp", "the participants would not use UCX's TCP transport"
    reports = transport_contract.run_contract("rdma")
    assert set(reports) == {"writer-0", "writer-1", "reader-0", "reader-1"}


@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer_rdma():
    from tests import transport_contract

    reports = transport_contract.run_peer_death("rdma")
    detected = [r["detect_s"] for r in reports.values() if "detect_s" in r]
    assert detected and max(detected) < transport_contract.DETECT_S


@pytest.mark.timeout(120)
def test_peer_reported_failure_rdma():
    from tests import transport_contract

    reports = transport_contract.run_peer_failure("rdma")
    assert max(r["detect_s"] for r in reports.values()) < transport_contract.DETECT_S


def test_config_checks_and_choice(monkeypatch):
    from weightbus.spec import Participant
    from weightbus.transports.base import select_transport, transport_class

    monkeypatch.setenv(UCX_TLS_ENV, "tcp")
    assert RdmaConfig().ucx_tls == "tcp"
    with pytest.raises(ValueError, match="ucx_tls=' ' must be a non-empty string"):
        RdmaConfig(ucx_tls=" ")
    people = [Participant(role="writer", rank=0), Participant(role="reader", rank=0, host="b")]
    assert transport_class("rdma").unsupported(people) is None
    # chosen by name only: the automatic choice on CPU stays gloo
    assert select_transport("auto", people).name == "gloo"
    assert select_transport("rdma", people).name == "rdma"


# ---------------------------------------------------------------------------------------------
# two network namespaces joined by a veth pair: a writer "host" and a reader "host"
# ---------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


class _Hosts:
    """Namespaces ``<tag>-w`` (10.X.Y.1) and ``<tag>-r`` (10.X.Y.2) over one veth pair."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = (f"wb{tag}w", f"wb{tag}r")
        self.dev = (f"wb{tag}a", f"wb{tag}b")
        octet = int(tag[:2], 16) % 200 + 20
        self.addr = (f"10.{octet}.{int(tag[2:4], 16)}.1", f"10.{octet}.{int(tag[2:4], 16)}.2")

    def __enter__(self) -> _Hosts:
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            self.__exit__()
            err = getattr(e, "stderr", "") or str(e)
            pytest.skip(f"cannot create network namespaces here: {err.strip()}")
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:
            _ip("netns", "del", ns, check=False)  # deletes the veth ends inside too

    def rx_bytes(self, side: int) -> int:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.ns[side],
                "cat",
                f"/sys/class/net/{self.dev[side]}/statistics/rx_bytes",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=20,
        )
        return int(out.stdout)

    def run(self, side: int, *args: str) -> subprocess.Popen:
        env = {
            **os.environ,
            UCX_TLS_ENV: "tcp",
            "WEIGHTBUS_RDMA_DEVICES": self.dev[side],
            "PYTHONPATH": str(ROOT),
        }
        return subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.ns[side],
                sys.executable,
                "-m",
                "tests.rdma_netns_worker",
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_sync_between_network_namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) to build the two hosts")
    with _Hosts() as hosts:
        store = f"{hosts.addr[0]}:29731"
        before = hosts.rx_bytes(1)
        writer = hosts.run(0, "writer", store)
        reader = hosts.run(1, "reader", store)
        try:
            w_out, w_err = writer.communicate(timeout=150)
            r_out, r_err = reader.communicate(timeout=30)
        finally:
            for p in (writer, reader):
                if p.poll() is None:
                    p.kill()
        assert writer.returncode == 0, w_err[-3000:]
        assert reader.returncode == 0, r_err[-3000:]
        w = json.loads(w_out.strip().splitlines()[-1])
        r = json.loads(r_out.strip().splitlines()[-1])
        received = hosts.rx_bytes(1) - before
    assert r["host"] != w["host"] and r["transport"] == w["transport"] == "rdma"
    assert r["bit_exact"] == [True] * r["syncs"] and r["syncs"] >= 3
    assert r["poisoned_nan"], "reader tensors were not poisoned before each sync"
    # every byte crossed the veth link into the reader's namespace
    assert received >= r["bytes_per_sync"] * r["syncs"], (received, r)
