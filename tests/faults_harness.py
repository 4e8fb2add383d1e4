"""Fault tests in real processes, on GPUs or on CPU: the machinery ``tests/test_faults_gpu.py`` uses.

A test describes its participants (:class:`Person`: role, rank, device, body); :class:`Run`
hosts the control store in the test process, starts each participant in a process of the
``spawn`` context, and collects what each body returned. Bodies run in the children with a
:class:`Ctx`: the job's configuration for the setup, bound layouts on the right device, the
values of each version, poisoning and bit-exact checks, signals to and from the test process,
and hooks that stall a victim in the middle of a sync so the test process can SIGKILL it there.

Setups (:data:`SETUPS`, a pytest parameter): the GPU ones, ``nccl`` and ``cuda_ipc``, put writer
ranks 0-1 on GPUs 0-1 and reader ranks 0-1 on GPUs 2-3 and need four CUDA devices. Two CPU
stand-ins run the same test functions over gloo (writers push, as over NCCL) and over
``faults-shm-pull`` (readers pull from the writers' tensors, as over CUDA IPC, here through
files mapped by every process); they run only when ``$WEIGHTBUS_FAULTS_GPU_ON_CPU`` is set, to
prove the tests themselves on a machine without GPUs.

Values are exact in bfloat16 and float32 and computed with integer arithmetic, so every
process, on any device, derives the same bytes; every element changes from one version to the
next. Receiving tensors are poisoned (NaN) before each sync whose result is checked.

Test transports (registered on import, chosen by name only): ``faults-gloo-flip`` and
``faults-nccl-flip`` flip one byte of a received buffer once armed; ``faults-cuda_ipc-flip``
and ``faults-shm-pull`` flip one byte of a region after the sync's last pull is queued and
before the reader sums its tensors.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from tests.procs import Spawned
from weightbus.control.store import ListOf, Row, Schema
from weightbus.transports.base import Handle, Transport, register_transport
from weightbus.transports.cuda_ipc import CudaIpcTransport, _bucket_rows
from weightbus.transports.gloo import GlooTransport
from weightbus.transports.nccl import NcclTransport

CPU_ENV = "WEIGHTBUS_FAULTS_GPU_ON_CPU"
"""Set to 1 to run the GPU fault tests' functions on CPU (gloo and a pulling test transport)."""

GPUS = 4
HEARTBEAT_TIMEOUT_S = 3.0
SYNC_TIMEOUT_S = 30.0
CHILD_LIMIT_S = 150.0  # a participant process exits on its own after this
VICTIM_WAIT_S = 60.0  # a stalled victim waits this long to be killed, then exits (code 7)
SHM_PULL = "faults-shm-pull"

GPU_MODEL = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""191 M parameters: 383 MB of float32 shards per writer, a 383 MB bfloat16 replica per
reader, so a sync has dozens of buckets per link to be caught in the middle of."""


# ---------------------------------------------------------------------------------------------
# setups
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Where a fault test runs: the transport, its fault-injecting twin, the device kind."""

    id: str
    transport: str
    flip_transport: str
    device: str  # "cuda" or "cpu"
    pulls: bool  # readers copy from the writers' tensors (CUDA IPC and its CPU stand-in)

    def gpu(self, index: int) -> str:
        """The device of GPU ``index`` in this setup ("cpu" on CPU)."""
        return f"cuda:{index}" if self.device == "cuda" else "cpu"

    def device_of(self, role: str, rank: int) -> str:
        """Writer ranks on GPUs 0-1, reader ranks on GPUs 2-3."""
        return self.gpu(rank if role == "writer" else 2 + rank)


NCCL = Setup("nccl", "nccl", "faults-nccl-flip", "cuda", pulls=False)
CUDA_IPC = Setup("cuda_ipc", "cuda_ipc", "faults-cuda_ipc-flip", "cuda", pulls=True)
GLOO_CPU = Setup("gloo-cpu", "gloo", "faults-gloo-flip", "cpu", pulls=False)
SHM_PULL_CPU = Setup("shm_pull-cpu", SHM_PULL, SHM_PULL, "cpu", pulls=True)


def setup_params(always: tuple[str, ...] = ()) -> list:
    """The ``setup`` parameter: the GPU setups (skipped without four CUDA devices) and their
    CPU stand-ins (skipped unless ``$WEIGHTBUS_FAULTS_GPU_ON_CPU`` is set, but for those whose
    id is in ``always``: they run in every CPU suite, so that a change which breaks what the
    GPU case relies on, such as the victim's stall hook, shows without GPUs)."""
    have = torch.cuda.device_count()
    on_gpu = pytest.mark.skipif(have < GPUS, reason=f"needs {GPUS} CUDA GPUs, found {have}")
    on_cpu = pytest.mark.skipif(
        not os.environ.get(CPU_ENV),
        reason=f"the CPU stand-ins run only with {CPU_ENV}=1 (to prove the GPU tests on CPU)",
    )
    return [
        pytest.param(NCCL, id=NCCL.id, marks=on_gpu),
        pytest.param(CUDA_IPC, id=CUDA_IPC.id, marks=on_gpu),
        *(
            pytest.param(s, id=s.id, marks=() if s.id in always else on_cpu)
            for s in (GLOO_CPU, SHM_PULL_CPU)
        ),
    ]


# ---------------------------------------------------------------------------------------------
# values, poisoning, bit-exact checks
# ---------------------------------------------------------------------------------------------

_P = 2**31 - 1


def values(model, version: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Version ``version`` of every canonical tensor: multiples of 1/16 in [-8, 8), exact in
    bfloat16 and float32, from integer arithmetic (the same bytes on every device); each
    element differs between any two consecutive versions."""
    out = {}
    for t in model.tensors:
        n = math.prod(t.shape)
        seed = zlib.crc32(t.name.encode()) % 100_003
        x = torch.arange(n, dtype=torch.int64, device=device)
        h = (x * 40_503 + seed * 7_919 + version * 69_069) % _P
        out[t.name] = (((h & 0xFF) - 128).to(torch.float32) / 16).to(dtype).reshape(t.shape)
    return out


def expected(layout, model, version: int, device: str) -> dict[str, torch.Tensor]:
    """What a reader's tensors hold once it has ``version`` (padding stays NaN, as allocated)."""
    from weightbus.plan import allocate, fill_from_canonical

    want = allocate(layout, device=device)
    fill_from_canonical(layout, values(model, version, device, torch.bfloat16), want)
    return want


def bytes_off(tensors: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> int:
    """How many bytes of ``tensors`` differ from ``want``."""
    return sum(
        int((tensors[k].reshape(-1).view(torch.uint8) != w.reshape(-1).view(torch.uint8)).sum())
        for k, w in want.items()
    )


def poison_all(tensors: dict[str, torch.Tensor]) -> None:
    from weightbus.plan import poison

    with torch.no_grad():
        for t in tensors.values():
            poison(t)


# ---------------------------------------------------------------------------------------------
# test transports: a byte flipped in transit (pushed) or after the pull (pulled)
# ---------------------------------------------------------------------------------------------


def _flip_byte(raw: torch.Tensor, at: tuple[int, ...]) -> None:
    """XOR the byte ``raw[at]`` with 0xFF, and return once it is done (on a GPU: on a stream of
    its own, waited for, so work queued after this call sees the flipped byte)."""
    cell = raw[at]
    if raw.is_cuda:
        with torch.cuda.device(raw.device):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                cell.bitwise_xor_(0xFF)
            stream.synchronize()
    else:
        cell.bitwise_xor_(0xFF)


class _PushFlip:
    """Mixin for pushing transports: once armed, flip one byte of the received buffer of one
    bucket after it landed and before the reader sees the receive done."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed: tuple[int, int] | None = None  # (bucket, byte in the received buffer)
        self.flipped: list[dict] = []

    def arm(self, op, copy) -> None:
        """Flip the middle byte of route ``copy`` of bucket ``op`` in the next sync."""
        self.armed = (op.bucket, copy.offset + copy.nbytes // 2)

    def _completed(self, handle: Handle, error: BaseException | None = None) -> None:
        armed = self.armed
        if error is None and armed is not None and handle.op == "recv" and handle.tag == armed[0]:
            native = handle.native
            if native is not None:
                # gloo keeps (work, bytes), nccl (work, event, flat buffer): the buffer is last
                raw = native[-1].reshape(-1).view(torch.uint8)
                if armed[1] < raw.numel():
                    _flip_byte(raw, (armed[1],))
                    self.armed = None
                    self.flipped.append({"bucket": armed[0], "byte": armed[1], "at": time.time()})
        super()._completed(handle, error)


class _PullFlip:
    """Mixin for pulling transports: once armed, flip one byte of one route's region in this
    reader's tensors after the sync's last pull is queued (on a GPU, on the current stream,
    which then waits for every copy) and before the reader sums its tensors."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = None  # (writer's global rank, bucket, Copy)
        self.flipped: list[dict] = []
        self._exposed = None
        self._pulls = 0
        self._after_flip = None  # (writer, bucket, CUDA event recorded after the flip)

    def arm(self, op, copy) -> None:
        """Flip the middle byte of route ``copy`` of bucket ``op`` in the next sync."""
        self.armed = (op.peer_global, op.bucket, copy)

    def expose(self, program) -> None:
        self._exposed = program
        super().expose(program)

    def _pull(self, handle: Handle) -> None:
        super()._pull(handle)
        program = self._exposed
        if program is None or self.participant.role != "reader":
            return
        self._pulls += 1
        pulls_from = getattr(self, "pulls_from", lambda peer: True)  # per link, where known
        if self._pulls < sum(bool(pulls_from(op.peer_global)) for op in program.ops):
            return
        self._pulls = 0  # every bucket of this sync is queued
        if self.armed is None:
            return
        writer, bucket, c = self.armed
        self.armed = None
        with torch.no_grad():
            raw = program.tensors[c.key][c.index].view(torch.uint8)
            at = tuple(n // 2 for n in raw.shape)
            if raw.is_cuda:
                with torch.cuda.device(raw.device):
                    # the current stream waits for every copy of the sync by now
                    raw[at].bitwise_xor_(0xFF)
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(raw.device))
                self._after_flip = (writer, bucket, event)
            else:
                raw[at].bitwise_xor_(0xFF)
        self.flipped.append({"bucket": bucket, "tensor": c.tensor, "at": time.time()})


@register_transport
class FlipGloo(_PushFlip, GlooTransport):
    """gloo that flips one received byte once armed (CPU)."""

    name = "faults-gloo-flip"
    priority = -1  # never chosen automatically


@register_transport
class FlipNccl(_PushFlip, NcclTransport):
    """NCCL that flips one received byte once armed."""

    name = "faults-nccl-flip"
    priority = -1


@register_transport
class FlipCudaIpc(_PullFlip, CudaIpcTransport):
    """CUDA IPC that flips one pulled byte once armed."""

    name = "faults-cuda_ipc-flip"
    priority = -1

    def landed(self, peer, tag: int):
        """The reader sums a pulled bucket once these events fire: for the bucket with the
        flipped byte, also once the flip is done (so the sums see it, as they would see a
        byte the copy itself got wrong)."""
        base = getattr(super(), "landed", None)
        events = tuple(base(peer, tag)) if base is not None else ()
        flip = self._after_flip
        if flip is not None and flip[:2] == (self.roster.global_rank(self._peer(peer).name), tag):
            self._after_flip = None
            events = (*events, flip[2])
        return events


_SHM_FILES: dict[int, tuple[str, int]] = {}  # storage address -> (file, elements) of shm tensors

SHM_TABLE: Schema = {
    "tensors": ListOf(Row(str, int, int, ListOf(int), ListOf(int), str)),
    "buckets": ListOf(Row(int, int, int, ListOf(Row(int, ListOf(Row(int, int)), int, int)))),
}
"""``faults-shm-pull/<n>`` from each writer: its tensors as [file, elements, storage offset,
shape, stride, dtype], and its buckets as ``cuda_ipc`` tables describe them."""


def shm_tensor(directory: str, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor backed by a file that other processes can map (``faults-shm-pull``)."""
    n = max(1, math.prod(shape))
    path = os.path.join(directory, f"{name}-{uuid.uuid4().hex[:8]}")
    t = torch.from_file(path, shared=True, size=n, dtype=dtype)
    _SHM_FILES[t.untyped_storage().data_ptr()] = (path, n)
    return t[: math.prod(shape)].view(shape)


class _ShmPullBase(Transport):
    """CPU stand-in for CUDA IPC between processes of one host: writers' tensors live in
    mapped files (:func:`shm_tensor`); at expose each writer posts where each bucket's routes
    lie, and each reader maps them; a reader's pull copies (and casts) each route from the
    writer's tensor into its own."""

    devices = frozenset({"cpu"})
    cross_host = False
    needs_staging = False
    pulls = True
    priority = -1

    def __init__(self, **fields) -> None:
        super().__init__(fields.pop("timeout", None))
        self._routes: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _connect(self) -> None:
        pass

    def expose(self, program) -> None:
        super().expose(program)
        control, me, roster = self.control, self.participant, self.roster
        topic = f"{SHM_PULL}/{control.sequence(SHM_PULL)}"
        if me.role == "writer":
            keys, buckets = _bucket_rows(program.ops)
            rows = []
            for key in keys:
                t = program.tensors[key]
                path, n = _SHM_FILES[t.untyped_storage().data_ptr()]
                dtype = str(t.dtype).removeprefix("torch.")
                rows.append([path, n, t.storage_offset(), list(t.shape), list(t.stride()), dtype])
            control.post(topic, {"tensors": rows, "buckets": buckets})
            control.gather(topic + "/opened", role="reader")
            return
        from weightbus.spec import torch_dtype

        tables = control.gather(topic, role="writer", schema=SHM_TABLE)
        mine = roster.global_rank(me.name)
        ops = {(op.peer_global, op.bucket): op for op in program.ops}
        for wname, table in tables.items():
            writer = roster.global_rank(wname)
            bases = [
                torch.from_file(path, shared=True, size=n, dtype=torch_dtype(dtype)).as_strided(
                    shape, stride, offset
                )
                for path, n, offset, shape, stride, dtype in table["tensors"]
            ]
            for peer, tag, _nbytes, copies in table["buckets"]:
                if peer != mine:
                    continue
                op = ops.pop((writer, tag))
                by_offset = {c.offset: c for c in op.copies}
                pairs = []
                for tid, box, offset, _n in copies:
                    c = by_offset[offset]
                    dst = program.tensors[c.key][c.index]
                    src = bases[tid][tuple(slice(a, b) for a, b in box)]
                    # a view, never a copy: the writer's later versions must show through
                    pairs.append((dst, src if src.shape == dst.shape else src.view(dst.shape)))
                self._routes[(writer, tag)] = pairs
        assert not ops, f"{me.name}: no writer shared buckets {sorted(ops)}"
        control.post(topic + "/opened", {})

    def _pull(self, handle: Handle) -> None:
        writer = self.roster.global_rank(handle.peer.name)
        with torch.no_grad():
            for dst, src in self._routes[(writer, handle.tag)]:
                dst.copy_(src.to(dst.dtype))
        self._completed(handle)

    def _close(self) -> None:
        self._routes.clear()

    def _abort(self, reason: str) -> None:
        self._routes.clear()


@register_transport
class ShmPull(_PullFlip, _ShmPullBase):
    """The CPU pulling transport; flips a byte after the sync's last pull once armed."""

    name = SHM_PULL


# ---------------------------------------------------------------------------------------------
# inside a participant process
# ---------------------------------------------------------------------------------------------


class Ctx:
    """What a participant's body works with (in its own process)."""

    def __init__(self, info: dict) -> None:
        self.info = info
        self.setup = Setup(**info["setup"])
        self.name: str = info["name"]
        self.role: str = info["role"]
        self.rank: int = info["rank"]
        self.device: str = info["device"]
        self.options: dict = info["options"]
        self.job = f"{info['tag']}-{info['job']}"
        self._tag = info["tag"]
        self._transports: list = []  # every transport object seen, kept so ids stay unique
        self.store = TCPStore(
            "127.0.0.1",
            info["port"],
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=30),
        )
        self._model = None

    # -- talking to the test process --------------------------------------------------------------

    def stage(self, text: str) -> None:
        """Note what this participant is doing now (shown when a test fails or hangs)."""
        self.store.set(f"{self._tag}/stage/{self.name}", f"{time.time():.3f} {text}")

    def signal(self, key: str, value: dict | None = None) -> None:
        """Set ``key`` for the test process and the other participants."""
        self.store.set(f"{self._tag}/signal/{key}", json.dumps(value or {}))

    def wait_signal(self, key: str, timeout_s: float) -> dict:
        """Wait for ``key`` (set by the test process or another participant)."""
        full = f"{self._tag}/signal/{key}"
        deadline = time.monotonic() + timeout_s
        while not self.store.check([full]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no signal {key!r} within {timeout_s} s")
            time.sleep(0.02)
        return json.loads(self.store.get(full))

    # -- the job ------------------------------------------------------------------------------------

    def model(self):
        if self._model is None:
            from weightbus.layouts.families import PRESETS, model_spec

            base = GPU_MODEL if self.setup.device == "cuda" else PRESETS["tiny-llama"]
            self._model = model_spec({**base, **self.options.get("model", {})})
        return self._model

    def control_config(self):
        from weightbus import ControlConfig

        return ControlConfig(
            num_writers=self.options.get("num_writers", 2),
            num_readers=self.options.get("num_readers", 2),
            max_readers=self.options.get("max_readers"),
            address=f"127.0.0.1:{self.info['port']}",
            host_store=False,
            job=self.job,
            timeout=timedelta(seconds=60),
            heartbeat_interval=timedelta(seconds=0.25),
            heartbeat_timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S),
            rejoin_timeout=timedelta(seconds=15),
        )

    def sync_config(self, **overrides):
        from weightbus import SyncConfig

        gpu = self.setup.device == "cuda"
        options = dict(
            cast={"float32": "bfloat16"},
            bucket_bytes=(16 << 20) if gpu else (1 << 20),
            staging_buffers=4 if gpu else 2,
            direct_bytes=(4 << 20) if gpu else 4096,  # big routes land in place
            sync_timeout=timedelta(seconds=SYNC_TIMEOUT_S),
            step_timeout=timedelta(seconds=60),
            connect_timeout=timedelta(seconds=60),
            transport=self.setup.transport,
            verify="checksum",
        )
        options.update(self.options.get("sync", {}))
        options.update(overrides)
        return SyncConfig(**options)

    def writer(self, **sync):
        """A Writer (not connected) holding this rank's float32 FSDP row shard."""
        from weightbus import BoundLayout, Participant, Writer
        from weightbus.layouts.fsdp import fsdp_layout
        from weightbus.plan import allocate

        n_w = self.options.get("num_writers", 2)
        me = Participant(role="writer", rank=self.rank, device=self.device)
        layout = fsdp_layout(self.model(), me, shard=n_w, shard_rank=self.rank, dtype="float32")
        if self.setup.transport == SHM_PULL:
            tensors = {}
            for lt in layout.locals:
                t = shm_tensor(self.info["dir"], f"{self.name}-{lt.key}", lt.shape, torch.float32)
                t.fill_(float("nan"))
                tensors[lt.key] = t
        else:
            tensors = allocate(layout, device=self.device)
        return Writer(
            BoundLayout(layout=layout, tensors=tensors),
            self.control_config(),
            self.sync_config(**sync),
        )

    def reader(self, apply: str, **sync):
        """A Reader (not connected): a whole bfloat16 engine replica with fused parameters."""
        from weightbus import BoundLayout, Participant, Reader
        from weightbus.layouts.fused import engine_layout
        from weightbus.plan import allocate

        me = Participant(role="reader", rank=self.rank, device=self.device)
        layout = engine_layout(self.model(), me, tp=1, dtype="bfloat16")
        bound = BoundLayout(layout=layout, tensors=allocate(layout, device=self.device))
        return Reader(bound, self.control_config(), self.sync_config(apply=apply, **sync))

    def fill(self, writer, version: int) -> None:
        from weightbus.plan import fill_from_canonical

        canonical = values(self.model(), version, self.device, torch.float32)
        fill_from_canonical(writer.bound.layout, canonical, writer.bound.tensors)

    def off(self, tensors: dict, layout, version: int | None) -> int:
        """Bytes of ``tensors`` that differ from ``version`` (-1: no version to compare with)."""
        if version is None:
            return -1
        return bytes_off(tensors, expected(layout, self.model(), version, self.device))

    def poison(self, reader, engine: bool = True) -> None:
        """Poison what the next sync writes (a transactional reader's copy), and with
        ``engine`` the engine's tensors too."""
        poison_all(reader.bound.tensors)
        if engine and reader.live is not reader.bound.tensors:
            poison_all(reader.live)
        if self.setup.device == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one sync, logged -----------------------------------------------------------------------------

    def sync(self, writer, version: int) -> dict:
        """``writer.sync(version)`` after filling the version in, as a log entry."""
        self.fill(writer, version)
        self.stage(f"syncing version {version}")
        t0 = time.monotonic()
        try:
            result = writer.sync(version)
        except Exception as exc:
            return _failed(exc, version, t0, epoch=writer.control.epoch)
        return {
            "v": version,
            "ok": True,
            "seconds": time.monotonic() - t0,
            "epoch": writer.control.epoch,
            "plan_s": result.phases.get("plan", 0.0),
            "readers": [lay.name for lay in writer.plan.readers],
            "transport": self._transport_tag(writer.transport),
            "bytes": result.bytes,
        }

    def wait(self, reader, poison_engine: bool = True) -> dict:
        """Poison, ``reader.wait()``, and compare what the engine's tensors hold with the version
        received (or, on failure, with the version held before), as a log entry."""
        held = reader.version
        layout = reader.bound.layout
        self.poison(reader, engine=poison_engine)
        self.stage(f"waiting for the sync after version {held}")
        t0 = time.monotonic()
        try:
            result = reader.wait()
        except Exception as exc:
            entry = _failed(exc, held, t0, epoch=reader.control.epoch)
            entry.update(
                held=reader.version,
                dirty=reader.dirty,
                apply=reader.apply,
                off=self.off(reader.live, layout, reader.version),
            )
            return entry
        return {
            "v": result.version,
            "ok": True,
            "seconds": time.monotonic() - t0,
            "epoch": reader.control.epoch,
            "plan_s": result.phases.get("plan", 0.0),
            "dirty": reader.dirty,
            "apply": reader.apply,
            "off": self.off(reader.live, layout, result.version),
            "transport": self._transport_tag(reader.transport),
        }

    def _transport_tag(self, transport) -> str:
        """``name#n``: the n-th transport object this participant used (a new membership
        epoch builds a new one)."""
        for i, seen in enumerate(self._transports):
            if seen is transport:
                return f"{transport.name}#{i}"
        self._transports.append(transport)
        return f"{transport.name}#{len(self._transports) - 1}"

    # -- a victim ------------------------------------------------------------------------------------

    def stall_midway(self, session, after_version: int) -> None:
        """In the sync after ``after_version``, stop in the middle: once half of this
        participant's bucket operations are posted (a writer over a pulling transport, which
        posts none: once its sums are computed and before it posts them, while the readers pull
        from its tensors), tell the test process (signal ``victim-ready``) and wait to be killed."""
        import weightbus.writer as writer_module

        def stall(what: str) -> None:
            self.stage(f"stalled in the sync after version {after_version}: {what}")
            self.signal("victim-ready", {"what": what, "at": time.time()})
            time.sleep(VICTIM_WAIT_S)
            os._exit(7)  # never killed: the test says so

        def armed() -> bool:
            return session.version == after_version

        if session.role == "writer" and self.setup.pulls:
            real_post_writer = writer_module.post_writer

            def post_writer(*args, **kwargs):
                if armed():
                    stall("its sums are computed but not posted; the readers pull from it")
                return real_post_writer(*args, **kwargs)

            writer_module.post_writer = post_writer
            return
        # every post goes through _post_many: one operation alone, or a group (send_many)
        real_post_many = Transport._post_many
        posted = [0]

        def _post_many(transport, op, peer, items):
            handles = real_post_many(transport, op, peer, items)
            if transport is session.transport and armed():
                posted[0] += len(handles)
                if posted[0] >= max(1, len(session.ops) // 2):
                    stall(f"{posted[0]} of its {len(session.ops)} bucket operations posted")
            return handles

        Transport._post_many = _post_many


def _failed(exc: BaseException, version, t0: float, **extra) -> dict:
    return {
        "v": version,
        "ok": False,
        "error": type(exc).__name__,
        "text": str(exc),
        "at": time.time(),
        "seconds": time.monotonic() - t0,
        **extra,
    }


def _watchdog(parent: int, limit_s: float) -> None:
    start = time.monotonic()
    while True:
        time.sleep(0.2)
        if os.getppid() != parent or time.monotonic() - start > limit_s:
            os._exit(3)


def _child(body: Callable[[Ctx], dict], info: dict) -> None:
    """A participant process: run ``body``, report what it returned (or raised) as JSON."""
    threading.Thread(target=_watchdog, args=(info["parent"], CHILD_LIMIT_S), daemon=True).start()
    faulthandler.dump_traceback_later(CHILD_LIMIT_S - 10, exit=False)  # where a hang is
    logging.basicConfig(
        level=logging.WARNING, format=f"[{info['name']}] %(levelname)s %(name)s: %(message)s"
    )
    ctx = Ctx(info)
    report: dict = {}
    try:
        if ctx.setup.device == "cuda":
            torch.cuda.set_device(torch.device(ctx.device))
        else:
            torch.set_num_threads(1)
        ctx.stage("started")
        report = dict(body(ctx) or {})
    except BaseException as exc:
        report = {
            "error": type(exc).__name__,
            "text": str(exc),
            "traceback": traceback.format_exc(),
        }
    ctx.stage("reported")
    ctx.store.set(f"{info['tag']}/result/{info['name']}", json.dumps(report, default=repr))


# ---------------------------------------------------------------------------------------------
# in the test process
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Person:
    """One participant process of a run."""

    name: str
    role: str
    rank: int
    device: str
    body: Callable[[Ctx], dict]
    job: str = "job"
    """Jobs of one run share the store; participants of a job share a control plane."""
    options: dict = field(default_factory=dict)
    """num_writers, num_readers, max_readers, model (config changes), sync (SyncConfig fields)."""


class Run(Spawned):
    """The store and the participant processes of one test; kills leftovers on exit.

    >>> with Run(setup, "kill-reader", people) as run:
    ...     run.wait_signal("victim-ready", 90); run.kill("reader-1")
    ...     reports = run.reports(["writer-0", ...], 60)
    """

    def __init__(self, setup: Setup, scenario: str, people: list[Person]) -> None:
        self.setup = setup
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.tag = f"{scenario}-{uuid.uuid4().hex[:6]}"
        self.dir = tempfile.mkdtemp(prefix="weightbus-faults-")
        self.people = {p.name: p for p in people}
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.process.BaseProcess] = {}
        for p in people:
            info = {
                "setup": asdict(setup),
                "name": p.name,
                "role": p.role,
                "rank": p.rank,
                "device": p.device,
                "job": p.job,
                "options": p.options,
                "port": self.store.port,
                "tag": self.tag,
                "dir": self.dir,
                "parent": os.getpid(),
            }
            self.procs[p.name] = ctx.Process(
                target=_child, args=(p.body, info), name=p.name, daemon=True
            )
        self.started = 0.0

    def __enter__(self) -> Run:
        self.started = time.monotonic()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        shutil.rmtree(self.dir, ignore_errors=True)

    def stages(self) -> str:
        """Each participant's last noted stage, for failure messages."""
        now = time.time()
        lines = []
        for name, proc in self.procs.items():
            key = f"{self.tag}/stage/{name}"
            stage = self.store.get(key).decode() if self.store.check([key]) else "0 not started"
            at, _, text = stage.partition(" ")
            lines.append(
                f"{name} (pid {proc.pid}, exit code {proc.exitcode}): {text} "
                f"({now - float(at):.1f} s ago)"
            )
        return "\n  ".join(["participants:", *lines])

    def _dead_without_report(self, names) -> list[str]:
        return [
            n
            for n in names
            if self.procs[n].exitcode is not None
            and not self.store.check([f"{self.tag}/result/{n}"])
        ]

    def wait_signal(self, key: str, timeout_s: float) -> dict:
        """Wait for a participant to set ``key``; fail naming who died or hangs."""
        full = f"{self.tag}/signal/{key}"
        deadline = time.monotonic() + timeout_s
        while not self.store.check([full]):
            dead = self._dead_without_report(self.procs)
            assert not dead, f"{dead} exited before signal {key!r}; {self.stages()}"
            reported = [n for n in self.procs if self.store.check([f"{self.tag}/result/{n}"])]
            assert len(reported) < len(self.procs), (
                f"every participant finished before signal {key!r}: {self.reports(reported, 1)}"
            )
            assert time.monotonic() < deadline, (
                f"no signal {key!r} within {timeout_s} s; {self.stages()}"
            )
            time.sleep(0.02)
        return json.loads(self.store.get(full))

    def signal(self, key: str, value: dict | None = None) -> None:
        self.store.set(f"{self.tag}/signal/{key}", json.dumps(value or {}))

    def kill(self, name: str) -> float:
        """SIGKILL participant ``name``; returns the time (``time.time()``) of the kill."""
        proc = self.procs[name]
        assert proc.is_alive(), f"{name} exited (code {proc.exitcode}) before the kill"
        os.kill(proc.pid, signal.SIGKILL)
        at = time.time()
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL, f"{name} exit code {proc.exitcode} after SIGKILL"
        return at

    def reports(self, names, timeout_s: float) -> dict[str, dict]:
        """What each of ``names`` reported; fails naming those that died or hang."""
        deadline = time.monotonic() + timeout_s
        out: dict[str, dict] = {}
        for name in names:
            key = f"{self.tag}/result/{name}"
            while not self.store.check([key]):
                assert name not in self._dead_without_report([name]), (
                    f"{name} exited with code {self.procs[name].exitcode} without reporting "
                    f"(killed, or crashed in native code: see its stderr); {self.stages()}"
                )
                assert time.monotonic() < deadline, (
                    f"{name} reported nothing within {timeout_s} s (hung?); reported so far: "
                    f"{out}; {self.stages()}"
                )
                time.sleep(0.05)
            out[name] = json.loads(self.store.get(key))
        return out

    def exits(self, names, timeout_s: float = 20.0) -> dict[str, int | None]:
        """Exit codes of ``names`` once they exit (None: still running after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        for n in names:
            self.procs[n].join(max(0.0, deadline - time.monotonic()))
        return {n: self.procs[n].exitcode for n in names}

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def no_error(reports: dict[str, dict]) -> None:
    """Fail naming every participant whose body raised, with its traceback."""
    bad = {n: r for n, r in reports.items() if "error" in r and "log" not in r}
    assert not bad, "participants raised:\n" + "\n".join(
        f"--- {n}: {r['error']}: {r['text']}\n{r.get('traceback', '')}" for n, r in bad.items()
    )


@dataclass
class Figures:
    """What one fault test measured (printed; ``pytest -s`` shows it)."""

    scenario: str
    setup: str
    syncs: int = 0
    injected: int = 0
    detected: int = 0
    bytes_lost: int = 0
    latency_s: float | None = None
    seconds: float = 0.0
    notes: str = ""

    def line(self) -> str:
        lat = "n/a" if self.latency_s is None else f"{self.latency_s:.2f} s"
        return (
            f"{self.scenario} [{self.setup}]: {self.syncs} syncs run, {self.injected} faults "
            f"injected, {self.detected} detected, {self.bytes_lost} bytes lost, detection "
            f"latency {lat}; {self.seconds:.1f} s" + (f" ({self.notes})" if self.notes else "")
        )
