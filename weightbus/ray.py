"""Writers and readers inside Ray actors: no torchrun, no hand-passed addresses.

RL frameworks (verl, OpenRLHF, SkyRL, NeMo-RL) place trainers and inference engines as Ray
actors. This module gives such a job its three missing pieces:

* **the control store, as an actor.** :func:`start_store` hosts the job's TCPStore in a small
  named actor; any actor of the cluster finds its address with :func:`store_address` (by job
  name, through Ray), so nothing has to be passed around by hand. The store outlives every
  participant, as the control plane requires of its host.
* **GPUs from placement groups.** :class:`ActorGroup` reserves one bundle per actor (``PACK``
  by default) and starts one actor per bundle. :func:`local_device` turns the GPU Ray assigned
  into this process's ``cuda:<index>``. Groups start their actors with
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: Ray then leaves every GPU of the node
  visible, so each participant names its real GPU and two actors of one node never both
  claim ``cuda:0`` (CUDA IPC between two GPUs needs the writer's GPU visible to the reader,
  and a peer that does not know a GPU's UUID tells GPUs apart by index).
* **a process group without torchrun.** :meth:`ActorContext.init_process_group` (or
  :func:`init_process_group`) builds an actor group's own ``torch.distributed`` default group
  (FSDP2 for a trainer, tensor parallel for an engine) over the same store, under a prefix of
  its own, with ranks from the group: no ``MASTER_ADDR``, ``RANK`` or ``WORLD_SIZE``.

A driver::

    import ray
    from weightbus.ray import GroupConfig, RayJob, get

    ray.init()
    job = RayJob(num_writers=2, num_readers=2, job="rl")
    trainer = job.group(Trainer, GroupConfig(name="trainer", role="writer", size=2, num_gpus=1))
    engine = job.group(Engine, GroupConfig(name="engine", role="reader", size=2, num_gpus=1))
    get(job.call("connect"))                       # every participant connects at once
    for step in range(steps):
        get(trainer.call("step_and_sync", step) | engine.call("receive"))
    get(job.call("close"))
    job.shutdown()

An actor class takes an :class:`ActorContext` as its constructor's first argument::

    class Trainer:
        def __init__(self, ctx: ActorContext):
            ctx.init_process_group()                            # the trainer's FSDP group
            device = ctx.device()
            model = build_and_shard(device)
            bound = weightbus.engines.module.bind(model, ctx.role, ctx.rank, name=ctx.name)
            self.writer = weightbus.Writer(bound, ctx.control_config(), weightbus.SyncConfig())

``examples/ray_actors.py`` runs a trainer group and two inference groups this way. Ray is
imported only when these functions run (``pip install 'weightbus[ray]'``). Ray itself pickles
actor arguments and results; weightbus only hands it names, ranks and addresses, and weights
never travel through Ray.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from weightbus.control.store import _JOB_RE, ControlConfig, _split_addr
from weightbus.errors import SyncTimeout, WeightbusError
from weightbus.spec import ROLES

__all__ = [
    "NOSET_CUDA_ENV",
    "ActorContext",
    "ActorGroup",
    "GroupConfig",
    "RayJob",
    "get",
    "init_process_group",
    "local_device",
    "start_store",
    "store_address",
]

logger = logging.getLogger(__name__)

NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Ray's variable that keeps it from narrowing ``CUDA_VISIBLE_DEVICES`` to an actor's GPUs."""

STORE_ACTOR_PREFIX = "weightbus-store-"
"""Ray actor name of a job's control store: this prefix plus the job name."""

_DEFAULT_TIMEOUT = timedelta(minutes=5)
_warned_visible = False


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("weightbus.ray needs Ray: pip install 'weightbus[ray]'") from e
    if not ray.is_initialized():
        raise WeightbusError(
            "Ray is not initialized: call ray.init() (or connect to a cluster) first"
        )
    return ray


def _seconds(name: str, value: timedelta) -> float:
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ValueError(f"{name}={value!r} must be a positive datetime.timedelta")
    return value.total_seconds()


# -- the control store as an actor -------------------------------------------------------------


class _StoreHost:
    """Body of the store actor: hosts a TCPStore for as long as the actor lives."""

    def __init__(self, port: int, timeout_s: float) -> None:
        import ray
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            ip, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        host = f"[{ip}]" if ":" in ip else ip
        self._address = f"{host}:{self._store.port}"

    def address(self) -> str:
        return self._address


def start_store(
    job: str = "default", *, port: int = 0, timeout: timedelta = _DEFAULT_TIMEOUT
) -> Any:
    """Start ``job``'s control store in a Ray actor named ``weightbus-store-<job>`` on this
    node (0 CPUs); return the actor handle. Kill it (``ray.kill``) only after every
    participant closed. ``port`` 0 picks a free one; ``timeout`` bounds the actor's start and
    the store's own waits."""
    ray = _ray()
    seconds = _seconds("timeout", timeout)
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(
            f"job={job!r} must be a non-empty name of letters, digits, '.', '_' or '-'"
        )
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = STORE_ACTOR_PREFIX + job
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        raise WeightbusError(
            f"a weightbus control store for job {job!r} already runs in this Ray namespace "
            f"(actor {name!r}); use another job name or ray.kill() the old store"
        )
    here = ray.get_runtime_context().get_node_id()
    actor = (
        ray.remote(_StoreHost)
        .options(
            name=name,
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True),
        )
        .remote(port, seconds)
    )
    address = get({name: actor.address.remote()}, timeout=timeout, what="start the store")[name]
    logger.info("weightbus: control store of job %r at %s (Ray actor %r)", job, address, name)
    return actor


def store_address(job: str = "default", *, timeout: timedelta = timedelta(seconds=60)) -> str:
    """``host:port`` of ``job``'s control store, looked up through Ray by the store actor's
    name: works in the driver and in any actor of the same Ray namespace."""
    ray = _ray()
    name = STORE_ACTOR_PREFIX + job
    try:
        actor = ray.get_actor(name)
    except ValueError:
        raise KeyError(
            f"no weightbus control store for job {job!r} in this Ray namespace (actor {name!r}): "
            "call weightbus.ray.start_store(job) in the driver first, or use the job's name"
        ) from None
    return get({name: actor.address.remote()}, timeout=timeout, what="ask the store")[name]


# -- devices and process groups ----------------------------------------------------------------


def local_device() -> torch.device:
    """The device Ray gave this actor, as a device of this process: ``cuda:<index>`` (and made
    current) when it holds one GPU, else ``cpu``.

    The index is the GPU's position among the process's visible devices. Under Ray's default,
    every actor sees only its own GPU as ``cuda:0``; start actors with
    ``runtime_env={"env_vars": {NOSET_CUDA_ENV: "1"}}`` (as :class:`ActorGroup` does) so that
    participants of one node name different devices.
    """
    global _warned_visible
    ray = _ray()
    ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids:
        return torch.device("cpu")
    if len(ids) > 1:
        raise ValueError(
            f"this actor holds GPUs {ids}, a weightbus participant uses one device: give each "
            "actor num_gpus=1 (or a fraction of one GPU to colocate)"
        )
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if visible:
        if ids[0] not in visible:
            raise WeightbusError(
                f"Ray assigned GPU {ids[0]} but CUDA_VISIBLE_DEVICES={','.join(visible)} hides it"
            )
        index = visible.index(ids[0])
        if len(visible) == 1 and not os.environ.get(NOSET_CUDA_ENV) and not _warned_visible:
            _warned_visible = True
            logger.warning(
                "weightbus: this actor sees only its own GPU, as cuda:0, like every other actor "
                "of its node; start actors with runtime_env env var %s=1 so that participants "
                "name their real GPUs (NCCL refuses two participants on one device)",
                NOSET_CUDA_ENV,
            )
    else:
        index = int(ids[0])
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_process_group(
    address: str,
    group: str,
    rank: int,
    world_size: int,
    *,
    backend: str | None = None,
    timeout: timedelta = _DEFAULT_TIMEOUT,
) -> None:
    """Initialise this process's default ``torch.distributed`` group for an actor group, over
    the control store at ``address`` under the prefix ``ray-pg/<group>/`` (no torchrun).

    ``backend`` defaults to ``nccl`` when Ray gave this actor a GPU, else ``gloo``. Every
    actor of the group calls it with its own ``rank``. Each actor group (trainer, each engine)
    gets a group of its own; weightbus' transports never use it.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise WeightbusError(
            f"{group} rank {rank}: torch.distributed is already initialised in this process; "
            "call init_process_group once per actor"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} of group {group!r}")
    host, port = _split_addr(address)
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and _ray().get_gpu_ids() else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"ray-pg/{group}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


# -- actor groups ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorContext:
    """What an actor of an :class:`ActorGroup` needs to join the job; its constructor's first
    argument."""

    job: str
    """Job name (the control store's key namespace)."""
    address: str
    """``host:port`` of the job's control store."""
    num_writers: int
    """Writers in the job, over all groups."""
    num_readers: int
    """Readers in the job, over all groups."""
    group: str
    """Name of this actor's group."""
    role: str
    """``"writer"`` or ``"reader"``."""
    rank: int
    """This actor's weightbus rank within its role (unique over all groups of the role)."""
    group_rank: int
    """This actor's index in its group (its rank in the group's process group)."""
    group_size: int
    """Actors in the group."""

    @property
    def name(self) -> str:
        """Participant name: ``<group>-<group_rank>``, e.g. ``engine-a-1``."""
        return f"{self.group}-{self.group_rank}"

    def control_config(self, **overrides: Any) -> ControlConfig:
        """The participant's :class:`~weightbus.ControlConfig`: this job, this store, not
        hosting it; ``overrides`` set other fields (timeouts, heartbeats, token)."""
        fields = {
            "num_writers": self.num_writers,
            "num_readers": self.num_readers,
            "address": self.address,
            "host_store": False,
            "job": self.job,
        }
        fields.update(overrides)
        return ControlConfig(**fields)

    def device(self) -> torch.device:
        """This actor's device (:func:`local_device`)."""
        return local_device()

    def init_process_group(
        self, backend: str | None = None, *, timeout: timedelta = _DEFAULT_TIMEOUT
    ) -> None:
        """The group's own ``torch.distributed`` default group (:func:`init_process_group`)."""
        init_process_group(
            self.address,
            f"{self.job}/{self.group}",
            self.group_rank,
            self.group_size,
            backend=backend,
            timeout=timeout,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupConfig:
    """One group of actors of one role: a trainer, or one inference engine (its TP ranks)."""

    name: str
    """Group name; participants are named ``<name>-<i>``."""
    role: str
    """``"writer"`` (trainer side) or ``"reader"`` (inference side)."""
    size: int = 1
    """Actors in the group."""
    first_rank: int = 0
    """Weightbus rank of the group's first actor within its role; groups of a role must not
    overlap."""
    num_gpus: float = 0.0
    """GPUs per actor (0: CPU; a fraction colocates actors of several groups on one GPU)."""
    num_cpus: float = 1.0
    """CPUs per actor."""
    strategy: str = "PACK"
    """Placement group strategy (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``)."""
    placement_group: Any = None
    """An existing placement group to start the actors in (bundle ``bundle_offset + i`` for
    actor ``i``), e.g. the trainer's, to colocate; None creates one bundle per actor."""
    bundle_offset: int = 0
    """First bundle of ``placement_group`` this group uses."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables of the actors (e.g. ``WEIGHTBUS_TOKEN``)."""
    ready_timeout: timedelta = _DEFAULT_TIMEOUT
    """Bound on reserving the placement group and starting the actors."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"group name {self.name!r} must be non-empty, without white space")
        if "/" in self.name:
            raise ValueError(f"group name {self.name!r} must not contain '/'")
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        for name in ("size", "first_rank", "bundle_offset"):
            value = getattr(self, name)
            low = 1 if name == "size" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError(
                f"num_gpus={self.num_gpus}, num_cpus={self.num_cpus} must not be negative"
            )
        if self.num_gpus > 1:
            raise ValueError(
                f"num_gpus={self.num_gpus}: a participant uses one device; use one actor per "
                "GPU (size=N, num_gpus=1)"
            )
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"strategy={self.strategy!r} is not a Ray placement strategy: PACK, SPREAD, "
                "STRICT_PACK or STRICT_SPREAD"
            )
        _seconds("ready_timeout", self.ready_timeout)
        object.__setattr__(self, "env", dict(self.env))


class ActorGroup:
    """Actors of one :class:`GroupConfig`, started in a placement group; build one with
    :meth:`RayJob.group`."""

    def __init__(
        self,
        actor_class: type,
        config: GroupConfig,
        *,
        job: str,
        address: str,
        num_writers: int,
        num_readers: int,
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        """The group's configuration."""
        limit = num_writers if config.role == "writer" else num_readers
        if config.first_rank + config.size > limit:
            raise ValueError(
                f"group {config.name!r} would hold {config.role} ranks "
                f"{config.first_rank}..{config.first_rank + config.size - 1}, but the job has "
                f"num_{config.role}s={limit}: raise the count or lower first_rank / size"
            )
        self.contexts = [
            ActorContext(
                job=job,
                address=address,
                num_writers=num_writers,
                num_readers=num_readers,
                group=config.name,
                role=config.role,
                rank=config.first_rank + i,
                group_rank=i,
                group_size=config.size,
            )
            for i in range(config.size)
        ]
        """Each actor's :class:`ActorContext`, in group order."""
        bundle = {"CPU": config.num_cpus}
        if config.num_gpus:
            bundle["GPU"] = config.num_gpus
        self.placement_group = config.placement_group
        """The placement group the actors run in."""
        self._owns_pg = False
        if self.placement_group is None:
            self.placement_group = placement_group(
                [dict(bundle) for _ in range(config.size)], strategy=config.strategy
            )
            self._owns_pg = True
        ready = self.placement_group.ready()
        try:
            get(
                {f"placement group of {config.name!r}": ready},
                timeout=config.ready_timeout,
                what=f"reserve {config.size} x {bundle}",
            )
        except SyncTimeout as e:
            self._remove_pg()
            raise SyncTimeout(
                f"Ray could not reserve {config.size} bundles of {bundle} for group "
                f"{config.name!r} within {config.ready_timeout}: the cluster has "
                f"{ray.available_resources()} available; add nodes, or lower num_cpus / "
                "num_gpus / size"
            ) from e
        env = {**config.env, NOSET_CUDA_ENV: "1"}
        remote_class = ray.remote(actor_class)
        self.actors = []
        """Ray actor handles, in group order."""
        for i, ctx in enumerate(self.contexts):
            options = {
                "num_cpus": config.num_cpus,
                "num_gpus": config.num_gpus,
                "name": f"weightbus-{job}-{ctx.name}",
                "max_restarts": 0,
                "runtime_env": {"env_vars": env},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group,
                    placement_group_bundle_index=config.bundle_offset + i,
                ),
            }
            self.actors.append(
                remote_class.options(**options).remote(ctx, *args, **dict(kwargs or {}))
            )

    @property
    def names(self) -> list[str]:
        """Participant names of the actors, in group order."""
        return [ctx.name for ctx in self.contexts]

    def call(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call ``method`` on every actor at once; ``{participant name: ObjectRef}`` for
        :func:`get`. Merge several groups' calls with ``|`` to wait for them together."""
        return {
            ctx.name: getattr(actor, method).remote(*args, **kwargs)
            for ctx, actor in zip(self.contexts, self.actors, strict=True)
        }

    def run(
        self, method: str, *args: Any, timeout: timedelta = _DEFAULT_TIMEOUT, **kwargs: Any
    ) -> dict[str, Any]:
        """:meth:`call` and :func:`get` in one: ``{participant name: result}``."""
        return get(self.call(method, *args, **kwargs), timeout=timeout, what=method)

    def kill(self) -> None:
        """Kill the actors and remove the placement group this group created."""
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        self._remove_pg()

    def _remove_pg(self) -> None:
        if self._owns_pg and self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


class RayJob:
    """One weightbus job on a Ray cluster: its control store actor and its actor groups.

    ``RayJob(num_writers=2, num_readers=3, job="rl")`` starts the store
    (:func:`start_store`); :meth:`group` starts actor groups in it; :meth:`shutdown` kills
    them and then the store.
    """

    def __init__(
        self,
        *,
        num_writers: int,
        num_readers: int,
        job: str = "default",
        store_port: int = 0,
        timeout: timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        ControlConfig(num_writers=num_writers, num_readers=num_readers, job=job)  # checks
        self.num_writers = num_writers
        """Writers in the job."""
        self.num_readers = num_readers
        """Readers in the job."""
        self.job = job
        """Job name."""
        self.store = start_store(job, port=store_port, timeout=timeout)
        """Handle of the store actor (None after :meth:`shutdown`)."""
        self.address = get(
            {"store": self.store.address.remote()}, timeout=timeout, what="ask the store"
        )["store"]
        """``host:port`` of the job's control store."""
        self.groups: list[ActorGroup] = []
        """Actor groups started so far."""

    def group(
        self, actor_class: type, config: GroupConfig, *args: Any, **kwargs: Any
    ) -> ActorGroup:
        """Start ``config.size`` actors of ``actor_class``, each constructed as
        ``actor_class(ctx, *args, **kwargs)`` with its :class:`ActorContext`."""
        if not isinstance(config, GroupConfig):
            raise TypeError(f"config must be a GroupConfig, got {type(config).__name__}")
        mine = range(config.first_rank, config.first_rank + config.size)
        for g in self.groups:
            theirs = range(g.config.first_rank, g.config.first_rank + g.config.size)
            if g.config.name == config.name:
                raise ValueError(f"a group named {config.name!r} already exists in this job")
            if g.config.role == config.role and set(mine) & set(theirs):
                raise ValueError(
                    f"group {config.name!r} ({config.role} ranks {mine.start}..{mine.stop - 1}) "
                    f"overlaps group {g.config.name!r} (ranks {theirs.start}..{theirs.stop - 1}): "
                    f"set first_rank={theirs.stop} or more"
                )
        group = ActorGroup(
            actor_class,
            config,
            job=self.job,
            address=self.address,
            num_writers=self.num_writers,
            num_readers=self.num_readers,
            args=args,
            kwargs=kwargs,
        )
        self.groups.append(group)
        return group

    def call(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call ``method`` on every actor of every group at once (e.g. ``"connect"``, which
        every participant must enter together); ``{participant name: ObjectRef}``."""
        calls: dict[str, Any] = {}
        for g in self.groups:
            calls |= g.call(method, *args, **kwargs)
        return calls

    def shutdown(self) -> None:
        """Kill every group, then the store. Call it after the participants closed."""
        ray = _ray()
        for g in self.groups:
            g.kill()
        self.groups = []
        if self.store is not None:
            ray.kill(self.store, no_restart=True)
            self.store = None


def get(
    calls: Mapping[str, Any], *, timeout: timedelta = _DEFAULT_TIMEOUT, what: str | None = None
) -> dict[str, Any]:
    """Wait for ``{name: ObjectRef}`` calls and return ``{name: result}``.

    Fails fast: the first call that raised is re-raised at once (Ray wraps it in a
    ``RayTaskError`` that is also an instance of the original error class), without waiting
    for the others. When ``timeout`` passes, :class:`~weightbus.errors.SyncTimeout` names the
    calls still pending.
    """
    ray = _ray()
    seconds = _seconds("timeout", timeout)
    if not isinstance(calls, Mapping):
        raise TypeError(
            f"get takes {{name: ObjectRef}} (ActorGroup.call / RayJob.call), got "
            f"{type(calls).__name__}"
        )
    names = {ref: name for name, ref in calls.items()}
    pending = list(calls.values())
    deadline = time.monotonic() + seconds
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(names[r] for r in pending)
            raise SyncTimeout(
                f"{what or 'calls'}: {len(missing)} of {len(calls)} did not finish within "
                f"{timeout}: {', '.join(missing)}; check those actors' logs (ray logs), or raise "
                "the timeout",
                missing,
            )
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            ray.get(ref)  # raises the actor's error now
    return {name: ray.get(ref) for name, ref in calls.items()}
