"""weightbus inside Ray actors, on a local Ray cluster (CPU, one cluster for the module).

The example (a trainer actor group and two inference actor groups) runs end to end; the
helpers hand the store's address through Ray, name participants after their groups, surface an
actor's error at once, and name the calls still pending when a wait times out.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from weightbus.errors import SyncTimeout, WeightbusError  # noqa: E402
from weightbus.ray import (  # noqa: E402
    NOSET_CUDA_ENV,
    ActorGroup,
    GroupConfig,
    RayJob,
    get,
    start_store,
    store_address,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[1]
T = timedelta(seconds=60)


@pytest.fixture(scope="module")
def cluster():
    # workers import weightbus, this module and the example by name
    path = os.pathsep.join([str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        namespace=f"weightbus-test-{uuid.uuid4().hex[:8]}",
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


class Member:
    """A writer or reader of a plain ``Linear(features, 4)`` inside a Ray actor."""

    def __init__(self, ctx, features: int) -> None:
        from weightbus import Reader, SyncConfig, Writer
        from weightbus.engines.module import bind

        torch.set_num_threads(1)
        self.ctx = ctx
        self.model = torch.nn.Linear(features, 4)
        control = ctx.control_config(
            timeout=timedelta(seconds=30),
            heartbeat_interval=timedelta(seconds=0.2),
            heartbeat_timeout=timedelta(seconds=5),
        )
        sync = SyncConfig(
            transport="gloo",
            sync_timeout=timedelta(seconds=30),
            connect_timeout=timedelta(seconds=30),
            step_timeout=timedelta(seconds=30),
        )
        bound = bind(self.model, ctx.role, ctx.rank, name=ctx.name)
        self.session = (Writer if ctx.role == "writer" else Reader)(bound, control, sync)

    def info(self) -> dict:
        return {
            "name": self.session.name,
            "rank": self.ctx.rank,
            "device": str(self.ctx.device()),
            "found": store_address(self.ctx.job),
            "noset": os.environ.get(NOSET_CUDA_ENV),
        }

    def connect(self) -> str:
        return self.session.connect().digest

    @staticmethod
    def values(model: torch.nn.Module, version: int) -> None:
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def sync(self, version: int) -> int:
        self.values(self.model, version)
        return self.session.sync(version).version

    def receive(self) -> bool:
        from weightbus.plan import poison

        with torch.no_grad():
            for p in self.model.parameters():
                poison(p)
        version = self.session.wait().version
        want = torch.nn.Linear(self.model.in_features, 4)
        self.values(want, version)
        return all(
            torch.equal(a, b)
            for a, b in zip(self.model.parameters(), want.parameters(), strict=True)
        )

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def boom(self) -> None:
        raise ValueError("boom from inside the actor")

    def close(self) -> None:
        self.session.close()


def test_helpers_refuse_to_run_without_ray_initialised():
    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    with pytest.raises(WeightbusError, match=r"Ray is not initialized: call ray.init\(\)"):
        store_address("nothing")


def test_example_trainer_group_and_two_inference_groups(cluster, capsys):
    example = importlib.import_module("ray_actors") if str(ROOT / "examples") in sys.path else None
    if example is None:
        sys.path.insert(0, str(ROOT / "examples"))
        example = importlib.import_module("ray_actors")
    job = f"example-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    code = example.main(["--steps", "2", "--timeout", "120", "--job", job])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "connected 5 participants" in out
    lines = out.splitlines()
    for step in (1, 2):
        (row,) = [line for line in lines if line.strip().startswith(f"{step} |")]
        assert row.rstrip().endswith("yes | same"), row
    assert "ray example ok: steps=2 readers=3 bit_exact=True generation_match=True" in out
    print(f"example took {time.monotonic() - t0:.1f} s")


def test_actors_find_the_store_sync_and_report_errors(cluster):
    job_name = f"members-{uuid.uuid4().hex[:6]}"
    job = RayJob(num_writers=1, num_readers=2, job=job_name, timeout=T)
    try:
        cfg = dict(num_cpus=0.25, ready_timeout=T)
        writers = job.group(Member, GroupConfig(name="trainer", role="writer", **cfg), 16)
        readers = job.group(Member, GroupConfig(name="engine", role="reader", size=2, **cfg), 16)

        # misplaced groups are refused before any actor starts
        with pytest.raises(ValueError, match="already exists"):
            job.group(Member, GroupConfig(name="engine", role="reader", **cfg), 16)
        with pytest.raises(ValueError, match=r"overlaps group 'engine' \(ranks 0..1\)"):
            job.group(Member, GroupConfig(name="engine-b", role="reader", first_rank=1, **cfg), 16)
        with pytest.raises(ValueError, match="writer ranks 1..1, but the job has num_writers=1"):
            job.group(Member, GroupConfig(name="more", role="writer", first_rank=1, **cfg), 16)
        huge = GroupConfig(
            name="huge", role="writer", num_cpus=64, ready_timeout=timedelta(seconds=1)
        )
        with pytest.raises(SyncTimeout, match=r"could not reserve 1 bundles of \{'CPU': 64\}"):
            ActorGroup(Member, huge, job="other", address=job.address, num_writers=1, num_readers=1)

        # the store is found by job name, from the driver and from inside the actors
        assert store_address(job_name) == job.address
        with pytest.raises(WeightbusError, match="already runs"):
            start_store(job_name)
        with pytest.raises(KeyError, match="call weightbus.ray.start_store"):
            store_address("no-such-job")
        info = get(job.call("info"), timeout=T)
        assert list(info) == ["trainer-0", "engine-0", "engine-1"]
        assert [i["rank"] for i in info.values()] == [0, 0, 1]
        for name, i in info.items():
            assert i["name"] == name and i["device"] == "cpu"
            assert i["found"] == job.address and i["noset"] == "1"

        digests = get(job.call("connect"), timeout=T, what="connect")
        assert len(set(digests.values())) == 1
        for v in (1, 2):
            out = get(writers.call("sync", v) | readers.call("receive"), timeout=T)
            assert out == {"trainer-0": v, "engine-0": True, "engine-1": True}

        # an actor's error surfaces at once, with its own type, while others still run
        slow = readers.call("sleep", 1.5)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="boom from inside the actor"):
            get(writers.call("boom") | slow, timeout=T)
        assert time.monotonic() - t0 < 1.4
        # a wait that times out names the calls still pending
        with pytest.raises(
            SyncTimeout, match=r"nap: 2 of 2 did not finish .*engine-0, engine-1"
        ) as e:
            get(readers.call("sleep", 1.5), timeout=timedelta(seconds=0.2), what="nap")
        assert e.value.missing == ["engine-0", "engine-1"]
        get(job.call("close"), timeout=T, what="close")
    finally:
        job.shutdown()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"name": "a b"}, "without white space"),
        ({"role": "trainer"}, "is not one of"),
        ({"size": 0}, "size=0 must be an int >= 1"),
        ({"num_gpus": 2}, "a participant uses one device"),
        ({"strategy": "TIGHT"}, "not a Ray placement strategy"),
        ({"ready_timeout": 5}, "must be a positive datetime.timedelta"),
    ],
)
def test_group_config_checks(fields, match):
    base = {"name": "g", "role": "writer"}
    with pytest.raises(ValueError, match=match):
        GroupConfig(**(base | fields))
