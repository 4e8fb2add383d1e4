"""Verification of every sync (``SyncConfig.verify``), over gloo, participants as threads.

* the sums: equal to a plain Python definition for every dtype, shape and stride, whichever
  way they are computed; a flipped byte and two swapped words change them;
* a byte flipped in transit by a test transport (a staged bucket, a bucket received in place,
  a delta bucket, an FP8 bucket) fails the sync with ``ChecksumMismatch`` naming the tensor,
  the writer, the reader and both sums, on the reader, and reaches the writers; with
  ``verify="off"`` the same flip goes through unnoticed (so the test can fail);
* a reader whose unpack writes a wrong element is caught too (the reader sums its tensors);
* ``verify="full"`` names the first element that differs, and its values;
* a pulling transport (readers copy from the writers' tensors, as CUDA IPC does) is verified;
* participants with different verify levels are refused at connect, naming both sides.
"""

from __future__ import annotations

import random
import zlib
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.threads import run_threads
from weightbus.transports.base import Handle, Transport, register_transport
from weightbus.transports.gloo import GlooTransport

pytestmark = pytest.mark.faults

MODEL = "tiny-llama"


# ---------------------------------------------------------------------------------------------
# test transports
# ---------------------------------------------------------------------------------------------


@register_transport
class FlipGloo(GlooTransport):
    """gloo that flips one byte of one received bucket once armed (``arm(bucket, byte)``)."""

    name = "test-gloo-flip"
    priority = -1  # never chosen automatically

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed: tuple[int, int] | None = None
        self.flipped: list[tuple[int, int]] = []
        self.fail_after: int | None = None  # recvs to let through before failing the next

    def arm(self, bucket: int, byte: int) -> None:
        self.armed = (bucket, byte)

    def _completed(self, handle: Handle, error: BaseException | None = None) -> None:
        if error is None and handle.op == "recv":
            if self.fail_after is not None:
                if self.fail_after == 0:
                    error = ConnectionResetError("test transport: the link broke mid-sync")
                self.fail_after -= 1
            flat = handle.native[1]
            if (
                self.armed is not None
                and handle.tag == self.armed[0]
                and self.armed[1] < flat.numel()
            ):
                byte = self.armed[1]
                flat[byte] = flat[byte] ^ 0xFF
                self.flipped.append(self.armed)
                self.armed = None
        super()._completed(handle, error)


@register_transport
class LocalPull(Transport):
    """A pulling transport for threads of one process: a reader copies each bucket's routes
    straight from the writer's tensors into its own (what CUDA IPC does between GPUs)."""

    name = "test-local-pull"
    devices = frozenset({"cpu"})
    cross_host = True
    needs_staging = False
    pulls = True
    priority = -1
    exposed: dict[tuple[str, str], object] = {}  # (job, participant) -> Program

    def __init__(self, **_) -> None:
        super().__init__()
        self.armed: tuple[int, int] | None = None

    def arm(self, bucket: int, byte: int) -> None:
        self.armed = (bucket, byte)

    def _connect(self) -> None:
        pass

    def expose(self, program) -> None:
        super().expose(program)
        job = self.control.config.job
        self.exposed[(job, self.participant.name)] = program
        self.control.barrier(f"test-local-pull/{self.control.sequence('test-local-pull')}")

    def _pull(self, handle: Handle) -> None:
        job = self.control.config.job
        theirs = self.exposed[(job, handle.peer.name)]
        mine = self.exposed[(job, self.participant.name)]
        wop = next(op for op in theirs.ops if op.bucket == handle.tag)
        rop = next(op for op in mine.ops if op.bucket == handle.tag)
        with torch.no_grad():
            for i, (wc, rc) in enumerate(zip(wop.copies, rop.copies, strict=True)):
                src = theirs.tensors[wc.key][wc.index].to(wc.dtype)
                dst = mine.tensors[rc.key][rc.index]
                dst.copy_(src)
                if i == 0 and self.armed is not None and self.armed[0] == handle.tag:
                    raw = dst.view(torch.uint8)
                    first = (0,) * raw.dim()
                    raw[first] = raw[first] ^ 0xFF
                    self.armed = None
        self._completed(handle)

    def _close(self) -> None:
        pass

    def _abort(self, reason: str) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# a job of threads
# ---------------------------------------------------------------------------------------------


def canonical(model, version: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) * 1000 + version)
        out[t.name] = torch.randn(t.shape, generator=g).to(dtype)
    return out


def configs(port: int, n_w: int, n_r: int, job: str, **sync):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=n_w,
        num_readers=n_r,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=20),
        heartbeat_interval=timedelta(seconds=0.2),
        heartbeat_timeout=timedelta(seconds=2),
    )
    options = dict(
        cast={"float32": "bfloat16"},
        bucket_bytes=1 << 20,
        staging_buffers=2,
        direct_bytes=4096,  # big routes land in place in the readers' tensors
        sync_timeout=timedelta(seconds=15),
        step_timeout=timedelta(seconds=20),
        transport="gloo",
    )
    options.update(sync)
    return control, SyncConfig(**options)


def writer_bound(model, rank: int, n_w: int, dtype: str = "float32"):
    from weightbus import BoundLayout, Participant
    from weightbus.layouts.fsdp import fsdp_layout
    from weightbus.plan import allocate

    layout = fsdp_layout(
        model, Participant(role="writer", rank=rank), shard=n_w, shard_rank=rank, dtype=dtype
    )
    return BoundLayout(layout=layout, tensors=allocate(layout))


def reader_bound(model, rank: int, n_r: int, fp8=None):
    from weightbus import BoundLayout, Participant
    from weightbus.codecs import quantized_layout
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate

    layout = engine_layout(
        model, Participant(role="reader", rank=rank), tp=n_r, tp_rank=rank, dtype="bfloat16"
    )
    if fp8 is not None:
        layout = quantized_layout(layout, fp8)
    return BoundLayout(layout=layout, tensors=allocate(layout))


def expected(bound, model, version: int) -> dict[str, torch.Tensor]:
    from weightbus.plan import allocate, fill_from_canonical

    want = allocate(bound.layout)
    fill_from_canonical(bound.layout, canonical(model, version, torch.bfloat16), want)
    return want


def same_bits(tensors: dict, want: dict) -> list[str]:
    """Keys whose bytes differ."""
    return [
        k for k in want if not torch.equal(tensors[k].view(torch.uint8), want[k].view(torch.uint8))
    ]


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s


def writer_body(model, port, rank, n_w, n_r, job, versions, amax_reduce=None, **sync):
    def body():
        from weightbus import Writer
        from weightbus.plan import fill_from_canonical

        bound = writer_bound(model, rank, n_w)
        control, config = configs(port, n_w, n_r, job, **sync)
        with Writer(bound, control, config, amax_reduce=amax_reduce) as writer:
            results = []
            for v in versions:
                fill_from_canonical(bound.layout, canonical(model, v), bound.tensors)
                results.append(writer.sync(v))
            return results

    return body


# ---------------------------------------------------------------------------------------------
# the sums
# ---------------------------------------------------------------------------------------------


def _plain_sums(x: torch.Tensor) -> tuple[int, int]:
    """The definition, in Python integers: words of the element width, row-major."""
    from weightbus.verify import PRIME, _words

    words = _words(x).contiguous().reshape(-1).tolist()
    return sum(words), sum((i + 1) * w for i, w in enumerate(words)) % PRIME


def test_sums_match_their_definition_for_any_dtype_shape_and_stride():
    from weightbus.verify import route_sums

    rng = random.Random(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64]
    dtypes += [torch.int64, torch.bool, torch.float8_e4m3fn, torch.int8]
    cache: dict = {}
    for _ in range(120):
        dtype = rng.choice(dtypes)
        nd = rng.choice([0, 1, 2, 3])
        shape = tuple(rng.randint(1, 5000 if nd <= 1 else 40) for _ in range(nd))
        base = torch.randint(-1000, 1000, shape).float() * 1.37
        t = (base > 0) if dtype == torch.bool else (base / 100).to(dtype)
        x = t[tuple(slice(rng.randrange(n), None) for n in shape)] if nd else t
        if x.dim() >= 2 and rng.random() < 0.3:
            x = x.transpose(0, 1)
        want = _plain_sums(x)
        # one reduction each (as on GPUs) or a block at a time (CPU): the same numbers
        for blocked in (True, False):
            got = tuple(route_sums([x], blocked=blocked, cache=cache)[0].tolist())
            assert got == want, (dtype, shape, tuple(x.shape), x.stride(), blocked)
    # several routes at once, and extreme words (no overflow)
    xs = [torch.full((300, 700), -1, dtype=torch.int32), torch.full((5000,), 2**31 - 1)]
    xs.append(torch.full((3, 2, 9), -(2**31), dtype=torch.int32))
    got = route_sums(xs)
    assert [tuple(r) for r in got.tolist()] == [_plain_sums(x) for x in xs]


def test_sums_of_many_buckets_at_once_equal_each_buckets_and_name_a_short_one():
    from types import SimpleNamespace

    from weightbus.errors import WeightbusError
    from weightbus.verify import Verifier, route_sums

    buckets = [[torch.randn(30, 7), torch.randn(5).bfloat16()], [torch.randn(3, 4).t()]]
    ops = [SimpleNamespace(bucket=b + 10, copies=[None] * len(g)) for b, g in enumerate(buckets)]
    v = Verifier("full")
    v.begin()
    v.add_all(ops, buckets)
    got = v.collect()
    for op, group in zip(ops, buckets, strict=True):
        assert np.array_equal(got[op.bucket], route_sums(group).numpy())
        assert len(v.bytes_of(op.bucket)) == len(group)
    with pytest.raises(WeightbusError, match=r"bucket 11: 0 views for 1 routes"):
        v.add_all(ops, [buckets[0], []])


def test_queued_buckets_are_summed_in_runs_at_flush_and_collect(monkeypatch):
    """``queue`` sums buckets a run at a time (a run once they hold RUN_BYTES, the rest at
    ``flush`` or ``collect``), each equal to its own sums; a buffer reused after ``flush``
    does not change the sums taken before."""
    from types import SimpleNamespace

    import weightbus.verify
    from weightbus.verify import Verifier, route_sums

    monkeypatch.setattr(weightbus.verify, "RUN_BYTES", 100)
    launches, add_all = [], Verifier.add_all

    def spy(self, ops, views, after=()):
        launches.append([op.bucket for op in ops])
        return add_all(self, ops, views, after)

    monkeypatch.setattr(Verifier, "add_all", spy)
    buf = torch.arange(40, dtype=torch.int16)
    groups = [[buf[:20]], [buf[20:].view(4, 5)], [torch.randn(30)], [torch.randn(3, 4).t()]]
    want = [route_sums(g).numpy() for g in groups]
    ops = [SimpleNamespace(bucket=b, nbytes=40 if b < 2 else 120, copies=[None]) for b in range(4)]
    v = Verifier("checksum")
    v.begin()
    v.queue(ops[0], groups[0])
    v.queue(ops[1], groups[1])
    assert launches == []  # 80 bytes queued, below a run
    v.flush(reuse=True)
    assert launches == [[0, 1]]
    buf.fill_(7)  # the buffer written again: its sums were taken
    v.queue(ops[2], groups[2])  # 120 bytes: a run of its own at once
    assert launches == [[0, 1], [2]]
    v.queue(ops[3], lambda: groups[3])
    got = v.collect()
    assert launches == [[0, 1], [2], [3]]
    for b in range(4):
        assert np.array_equal(got[b], want[b]), b


def test_sums_change_with_a_flipped_byte_and_swapped_words():
    from weightbus.verify import route_sums

    x = torch.randn(64, 256).bfloat16()
    base = route_sums([x])
    rng = random.Random(1)
    for _ in range(50):
        y = x.clone()
        raw = y.view(torch.uint8).view(-1)
        i = rng.randrange(raw.numel())
        raw[i] ^= 1 << rng.randrange(8)
        assert not torch.equal(route_sums([y])[0], base[0])
        y = x.clone().view(-1)
        i, j = rng.sample(range(y.numel()), 2)
        if y[i].view(torch.int16) == y[j].view(torch.int16):
            continue
        y[i], y[j] = y[j].clone(), y[i].clone()
        got = route_sums([y.view(64, 256)])[0]
        assert got[0] == base[0, 0] and got[1] != base[0, 1]  # s1 same, s2 not


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------


def _arm(reader, where: str, sync: dict, seen: dict) -> None:
    """Pick a route of a bucket ``where`` ("staged", "direct", or "none": pick but flip
    nothing), note it in ``seen``, and arm the reader's transport to flip a byte in its middle."""
    from weightbus.plan.codec_plan import rest_tag

    staged = [op for op, d in zip(reader.ops, reader.direct, strict=True) if d is None]
    direct = [op for op, d in zip(reader.ops, reader.direct, strict=True) if d is not None]
    if reader.transport.pulls:
        direct = staged = list(reader.ops)
    pool = [(op, op.copies[0]) for op in (direct if where == "direct" else staged)]
    if "fp8" in sync:  # a route of quantized weights
        pool = [(op, c) for op, _ in pool for c in op.copies if c.dtype == torch.float8_e4m3fn]
    op, c = pool[0]
    seen["route"] = (op, c)
    if where == "none":
        return
    if "delta" in sync:
        # the rest of a delta bucket, after its directory: route 0 travels first, dense
        # (every element changes between versions here)
        reader.transport.arm(rest_tag(op, len(reader.plan.buckets)), c.nbytes // 2)
    else:
        reader.transport.arm(op.bucket, c.offset + c.nbytes // 2)


def _flip_job(store, *, where: str, verify: str = "checksum", **sync):
    """2 writers, 2 readers; reader-0 has one byte of one bucket flipped in sync 2 (``where``:
    "staged" or "direct" bucket). Returns (outcomes, what reader-0 saw)."""
    from weightbus import Reader
    from weightbus.layouts.families import model_spec

    model = model_spec(MODEL)
    n_w = n_r = 2
    job = f"flip-{where}-{verify}"
    seen: dict = {}
    transport = sync.pop("transport", "test-gloo-flip")

    def reader(rank):
        def body():
            bound = reader_bound(model, rank, n_r, fp8=sync.get("fp8"))
            control, config = configs(
                store.port, n_w, n_r, job, verify=verify, transport=transport, **sync
            )
            reader = Reader(bound, control, config)
            reader.connect()
            try:
                reader.wait()
                if rank == 0:
                    _arm(reader, where, sync, seen)
                result = reader.wait()
                if rank == 0:
                    seen["wrong"] = same_bits(reader.live, expected(bound, model, 2))
                return result
            finally:
                seen.setdefault(f"dirty-{rank}", reader.dirty)
                reader.close()

        return body

    bodies = {f"reader-{r}": reader(r) for r in range(n_r)}
    for w in range(n_w):
        bodies[f"writer-{w}"] = writer_body(
            model,
            store.port,
            w,
            n_w,
            n_r,
            job,
            [1, 2],
            verify=verify,
            transport=transport,
            **sync,
        )
    return run_threads(bodies), seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["staged", "direct"])
def test_flipped_byte_fails_the_sync_naming_tensor_writer_and_reader(store, where):
    from weightbus import PeerFailure
    from weightbus.errors import ChecksumMismatch

    out, seen = _flip_job(store, where=where)
    op, c = seen["route"]
    err = out["reader-0"]
    assert isinstance(err, ChecksumMismatch), err
    text = str(err)
    writer = f"writer-{op.peer}"
    for part in (
        c.tensor,
        f"writer {writer!r}",
        "reader 'reader-0'",
        str(err.expected),
        str(err.got),
    ):
        assert part in text, (part, text)
    assert err.tensor == c.tensor and err.writer == writer and err.bucket == op.bucket
    assert err.expected != err.got
    # every other participant hears of it, with the tensor named
    for name in ("writer-0", "writer-1", "reader-1"):
        assert isinstance(out[name], PeerFailure), (name, out[name])
        assert "ChecksumMismatch" in str(out[name]) and c.tensor in str(out[name]), out[name]


@pytest.mark.timeout(60)
def test_flipped_byte_goes_unnoticed_with_verify_off(store):
    out, seen = _flip_job(store, where="staged", verify="off")
    for name, result in out.items():
        assert not isinstance(result, BaseException), (name, result)
    op, c = seen["route"]
    assert seen["wrong"] == [c.key]  # the corruption landed, and nothing said so


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["delta", "fp8"])
def test_flipped_byte_is_caught_through_the_codecs(store, codec):
    from weightbus.codecs import DeltaConfig, Fp8Config
    from weightbus.errors import ChecksumMismatch

    # (deltas check sums of their own only every 20 syncs; FP8 blocks of 16 rows fit the FSDP
    # shards of the tiny model, so the writers need no amax exchange)
    sync = (
        {"delta": DeltaConfig()}
        if codec == "delta"
        else {"fp8": Fp8Config(bucket_bytes=0, block=16)}
    )
    out, seen = _flip_job(store, where="staged", **sync)
    err = out["reader-0"]
    assert isinstance(err, ChecksumMismatch), err
    assert seen["route"][1].tensor in str(err)


@pytest.mark.timeout(60)
def test_a_wrong_unpack_is_caught_by_the_reader_summing_its_tensors(store, monkeypatch):
    """The bytes arrive intact but one element lands wrong in the engine's tensors."""
    import threading

    from weightbus.errors import ChecksumMismatch
    from weightbus.plan.program import BucketCopier

    real, hit, once = BucketCopier.unpack, [], threading.Lock()

    def unpack(self, op, tensors, buf):
        real(self, op, tensors, buf)
        for c in op.copies:
            # one element in one reader (both readers' threads unpack at once)
            if c.key.endswith("o_proj.weight") and once.acquire(blocking=False):
                tensors[c.key][c.index][0, 3] += 1  # e.g. a scatter off by one element
                hit.append(c.tensor)

    monkeypatch.setattr(BucketCopier, "unpack", unpack)
    out, _ = _flip_job(store, where="none", transport="gloo", direct_bytes=1 << 30)
    errors = [e for e in out.values() if isinstance(e, ChecksumMismatch)]
    assert len(errors) == 1 and hit and hit[0] in str(errors[0]), out


@pytest.mark.timeout(60)
def test_full_compare_names_the_first_element_that_differs(store):
    from weightbus.errors import ChecksumMismatch

    out, seen = _flip_job(store, where="direct", verify="full")
    op, c = seen["route"]
    err = out["reader-0"]
    assert isinstance(err, ChecksumMismatch), err
    # the flip hit byte nbytes // 2 of the route: element nbytes // 4 of its bf16 words
    assert f"differs first at element {c.nbytes // 4} of the route" in str(err), err
    assert c.tensor in str(err) and "the writer sent" in str(err)


@pytest.mark.timeout(60)
def test_full_compare_passes_and_drops_its_bytes_from_the_store(store):
    out, _ = _flip_job(store, where="none", verify="full")
    for name, result in out.items():
        assert not isinstance(result, BaseException), (name, result)


@pytest.mark.timeout(60)
def test_pulling_transport_is_verified(store):
    """Readers copy straight from the writers' tensors (as over CUDA IPC): nothing is packed,
    both sides sum their tensors; a byte changed by the copy is caught."""
    from weightbus.errors import ChecksumMismatch

    out, seen = _flip_job(store, where="direct", transport="test-local-pull")
    err = out["reader-0"]
    assert isinstance(err, ChecksumMismatch), err
    assert seen["route"][1].tensor in str(err)
    out, seen = _flip_job(store, where="none", transport="test-local-pull")
    for name, result in out.items():
        assert not isinstance(result, BaseException), (name, result)
    assert seen["wrong"] == []


@pytest.mark.timeout(60)
def test_different_verify_levels_are_refused_at_connect(store):
    from weightbus import PlanMismatch, Reader, Writer
    from weightbus.layouts.families import model_spec

    model = model_spec(MODEL)

    def side(role, level):
        def body():
            bound = writer_bound(model, 0, 1) if role == "writer" else reader_bound(model, 0, 1)
            control, config = configs(store.port, 1, 1, "levels", verify=level)
            (Writer if role == "writer" else Reader)(bound, control, config).connect()

        return body

    out = run_threads({"writer": side("writer", "checksum"), "reader": side("reader", "off")})
    for name, err in out.items():
        assert isinstance(err, PlanMismatch), (name, err)
        assert "disagree on SyncConfig.verify" in str(err)
        assert "'checksum' held by writer-0" in str(err) and "'off' held by reader-0" in str(err)


@pytest.mark.timeout(60)
def test_a_different_plan_is_refused_at_connect_naming_both_sides(store):
    """Other plan options (here the bucket size) on one side: the plan digests differ.
    (Layouts of different models are refused at connect by tests/test_sync_gloo.py.)"""
    from weightbus import PlanMismatch, Reader, Writer
    from weightbus.layouts.families import model_spec

    model = model_spec(MODEL)

    def side(role, bucket_bytes):
        def body():
            bound = writer_bound(model, 0, 1) if role == "writer" else reader_bound(model, 0, 1)
            control, config = configs(store.port, 1, 1, "plans", bucket_bytes=bucket_bytes)
            (Writer if role == "writer" else Reader)(bound, control, config).connect()

        return body

    out = run_threads({"writer": side("writer", 1 << 20), "reader": side("reader", 2 << 20)})
    for name, err in out.items():
        assert isinstance(err, PlanMismatch), (name, err)
        assert "disagree on 'plan'" in str(err), err
        assert "held by writer-0" in str(err) and "held by reader-0" in str(err), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sums_on_cuda_equal_those_on_cpu():
    """One reduction per route on the GPU, blocks on the CPU: the same numbers."""
    from weightbus.verify import route_sums

    rng = random.Random(2)
    views_cpu, views_gpu = [], []
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float64):
        for _ in range(6):
            shape = (rng.randint(1, 300), rng.randint(1, 3000))
            t = (torch.randn(shape) * 3).to(dtype)
            cols = slice(rng.randrange(shape[1]), None)
            views_cpu.append(t[:, cols])
            views_gpu.append(t.cuda()[:, cols])
    big = torch.randn(4096, 8192).bfloat16()
    views_cpu.append(big)
    views_gpu.append(big.cuda())
    assert torch.equal(route_sums(views_gpu).cpu(), route_sums(views_cpu))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verifier_kernel_on_cuda_equals_the_cpu_sums():
    """The Triton kernel (one launch per bucket) gives the definition's numbers, for every word
    width, strided, 3-D and flat routes, aligned or not, and falls back on other strides."""
    from types import SimpleNamespace

    from weightbus.verify import Verifier, route_sums

    rng = random.Random(5)
    views = []
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float64, torch.int16):
        for _ in range(4):
            shape = (rng.randint(1, 300), rng.randint(1, 3000))
            t = (torch.randn(shape) * 3000).to(dtype)
            views.append(t[:, rng.randrange(shape[1]) :])
    views += [
        torch.randn(4, 5, 6)[:, 1:4, :].bfloat16(),  # leading dims that do not collapse
        torch.randn(4, 5, 6).bfloat16()[:, 1:4, :],
        torch.randn(1024, 4096).bfloat16(),  # aligned: 16-byte loads
        torch.randn(1500, 700).bfloat16()[3:, 5:],  # several row groups per program
        torch.randn(333).bfloat16(),
        torch.full((40, 300), -32768, dtype=torch.int16),
        torch.tensor(3.0).bfloat16(),
    ]
    strided = [torch.randn(30, 20).bfloat16().t(), torch.randn(50, 64).bfloat16()]
    for bucket, group in enumerate([views, strided]):
        op = SimpleNamespace(bucket=bucket, copies=[None] * len(group))
        v = Verifier("checksum")
        on_gpu = [x.cuda() for x in group]
        for _ in range(2):  # the second sync reuses the cached table
            v.begin()
            v.add(op, on_gpu)
            got = v.collect()[bucket]
            assert np.array_equal(got, route_sums(group).numpy()), bucket
        (table,) = v._gpu._tables.values()
        assert (table is None) == (bucket == 1)  # the transposed route: torch sums its bucket
    # both buckets at once (as a writer sums the tensors readers pull): one table when every
    # bucket fits the kernel, each bucket apart when one does not, the same numbers
    halves = [views[: len(views) // 2], views[len(views) // 2 :]]
    for buckets in (halves, [views, strided]):
        ops = [SimpleNamespace(bucket=b, copies=[None] * len(g)) for b, g in enumerate(buckets)]
        v = Verifier("checksum")
        v.begin()
        v.add_all(ops, [[x.cuda() for x in g] for g in buckets])
        got = v.collect()
        for b, group in enumerate(buckets):
            assert np.array_equal(got[b], route_sums(group).numpy()), b


def test_a_reader_sums_its_pulled_buckets_in_runs_in_order():
    from types import SimpleNamespace

    from weightbus.verify import runs

    ops = [SimpleNamespace(bucket=b, nbytes=n) for b, n in enumerate([5, 3, 9, 1, 1, 1, 20, 2])]
    cut = runs(ops, 8)
    assert [[op.bucket for op in r] for r in cut] == [[0, 1], [2], [3, 4, 5, 6], [7]]
    assert runs([], 8) == []
    assert [len(r) for r in runs(ops, 1)] == [1] * len(ops)
