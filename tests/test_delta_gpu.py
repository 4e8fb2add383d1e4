"""Sparse deltas on CUDA: the Triton kernels equal the torch path byte for byte, syncs are bit
exact across resharding, and a Writer/Reader pair over NCCL between two GPUs uses them.

The same kernels run on CPU in Triton's interpreter in ``tests/test_codec_delta.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import multiprocessing as mp
import socket
import sys
import traceback
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.procs import collect_reports
from tests.test_codec_delta import (
    TENSORS,
    aligned_routes_case,
    assert_exact,
    change,
    damaged_index_case,
    damaged_mask_case,
    kernels_equal_torch,
    readers,
    unchanged_sync_bytes,
    writers,
)
from weightbus.codecs.delta import (
    DeltaConfig,
    DeltaDecision,
    DeltaDecoder,
    DeltaEncoder,
    capacity,
)
from weightbus.plan import PlanOptions, allocate, fill_from_canonical, make_plan, poison
from weightbus.plan.codec_plan import CodecConfig, ReaderCodec, WriterCodec, run_sync
from weightbus.plan.program import BucketOp, Copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


@pytest.mark.parametrize("block", [2048, 128])
@pytest.mark.parametrize(
    "seed,window,shadow", [(0, 1500, "device"), (1, 4000, "host"), (2, 1 << 30, "device")]
)
def test_kernels_equal_the_torch_path(seed, window, shadow, block, monkeypatch):
    from weightbus.codecs import _delta_triton

    assert not _delta_triton.INTERPRETED
    monkeypatch.setattr(_delta_triton, "BLOCK", block)
    kernels_equal_torch(seed, "cuda", window, host_copy=False, shadow=shadow)


def test_aligned_routes_take_the_aligned_compare():
    """On the GPU a wrong alignment hint would load wrong bytes or fault."""
    aligned_routes_case("cuda")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_damaged_sparse_index_is_not_written_on_the_gpu(impl):
    """The torch path refuses the group before applying it (an index out of range would stop
    the device); the apply kernel skips the element and the reader's check names it."""
    damaged_index_case("cuda", impl)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_damaged_masked_frame_is_not_written_outside_its_route_on_the_gpu(impl):
    """The torch path refuses a masked frame whose bits disagree with its values before
    applying the group; the apply kernels write only the route's elements and the reader's
    check names it."""
    damaged_mask_case("cuda", impl)


def _start_on_cuda(codecs, bucket_bytes=2048, cast=None):
    ws, rs = writers(), readers()
    cast = {"float32": "bfloat16"} if cast is None else cast
    plan = make_plan(ws, rs, PlanOptions(bucket_bytes=bucket_bytes, direct_bytes=0, cast=cast))
    g = torch.Generator().manual_seed(0)
    canon = {
        t: torch.randn(shape, generator=g).to(getattr(torch, dt))
        for t, (shape, dt) in TENSORS.items()
    }
    live = [allocate(w, device="cuda") for w in ws]
    got = []
    for r in rs:
        t = allocate(r, device="cuda")
        if r.rank == 1:  # a transposed engine tensor: every region of it is strided
            a = torch.empty(44, 90, dtype=torch.bfloat16, device="cuda").t()
            poison(a)
            t["a"] = a
        got.append(t)
    wcs = [WriterCodec(plan, i, live[i], codecs) for i in range(len(ws))]
    rcs = [ReaderCodec(plan, i, got[i], codecs) for i in range(len(rs))]
    return plan, ws, rs, canon, live, got, wcs, rcs


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("shadow", ["device", "host"])
def test_resharding_syncs_are_bit_exact(shadow, kernels, monkeypatch):
    """2 writers -> 3 readers with other cuts, a cast, a transposed reader tensor: 30 syncs
    through the torch path or the kernels (the writers' casts make their buckets computed,
    into scratch)."""
    triton = kernels == "triton"
    monkeypatch.setenv("WEIGHTBUS_DELTA_TRITON", "1" if triton else "0")
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=4, shadow=shadow, window_bytes=3000))
    plan, ws, rs, canon, live, got, wcs, rcs = _start_on_cuda(codecs)
    from weightbus.codecs._delta_triton import TargetTable, WindowTable

    # the path under test is the one taken
    assert all(
        isinstance(lay.table, WindowTable) == triton for w in wcs for lay in w.encoder._layouts
    )
    assert all(isinstance(r.decoder._table, TargetTable) == triton for r in rcs)
    dense_bytes = plan.stats.total_bytes
    g = torch.Generator().manual_seed(1)
    for step in range(1, 31):
        absent = {1} if step == 12 else set()
        if step > 1:
            change(canon, g, 0.5 if step % 7 == 0 else 0.01)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, {k: v.cuda() for k, v in canon.items()}, t)
        moved = run_sync(plan, wcs, rcs, step, absent=absent)
        cpu = [{k: v.cpu() for k, v in t.items()} for t in got]
        # what the readers must hold: the writers' cast, made on the GPU (a float32 NaN's
        # payload becomes another bfloat16 NaN there than on the CPU)
        want = {k: v.cuda().to(torch.bfloat16).cpu() for k, v in canon.items()}
        try:
            assert_exact(rs, cpu, want, skip=absent)
        except AssertionError as exc:
            raise AssertionError(f"sync {step} (moved {moved} of {dense_bytes}): {exc}") from exc
        if step > 1 and step % 7 > 1 and step != 13:
            # (after a 50% step, windows that went dense are sent dense once more)
            # beyond the directories (and buckets' alignment) that every sync carries
            fixed = unchanged_sync_bytes(rcs)
            assert moved - fixed < 0.2 * dense_bytes, (step, moved, fixed, dense_bytes)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < 24 << 30,
    reason="needs 24 GiB of free GPU memory",
)
def test_a_route_of_more_than_2_31_elements_takes_8_byte_indices():
    n = (1 << 31) + 4099
    x = torch.zeros(n, dtype=torch.uint8, device="cuda")
    copy = Copy(
        key="x", index=(slice(0, n),), shape=(n,), offset=0, nbytes=n, dtype=torch.uint8,
        tensor="x",
    )  # fmt: skip
    op = BucketOp(bucket=0, peer=0, peer_global=1, wave=0, nbytes=n, copies=(copy,))
    views = (x,)
    enc = DeltaEncoder(
        [op], DeltaConfig(), fill=lambda op, out: None, views=lambda op: views, device="cuda"
    )
    target = torch.zeros(n, dtype=torch.uint8, device="cuda")
    dec = DeltaDecoder([op], {"x": target})
    buf = torch.empty(capacity(op), dtype=torch.uint8, device="cuda")
    for v, changed in ((1, None), (2, [5, (1 << 31) + 7, n - 1])):
        if changed:
            x[torch.tensor(changed, device="cuda")] = 9
        dense = frozenset({0}) if v == 1 else frozenset()
        enc.begin(
            DeltaDecision(version=v, dense=dense, base=(None if dense else 1,), checksum=False)
        )
        used = enc.encode(op, buf)
        enc.end()
        dec.decode(op, buf, version=v, held=None if v == 1 else 1)
    assert used < 4096  # three 8-byte indices and values
    assert torch.equal(target, x)


# ---------------------------------------------------------------------------------------------
# one writer GPU -> one reader GPU over NCCL, through the session API
# ---------------------------------------------------------------------------------------------

STEPS = 6


def _canon(model, version: int, device) -> dict[str, torch.Tensor]:
    """The canonical weights after ``version`` steps of about 1% changed elements (the same
    in every process)."""
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
        x = torch.randn(t.shape, generator=g).to(torch.bfloat16)
        for v in range(2, version + 1):
            gv = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) + 7919 * v)
            flat = x.view(-1)
            idx = torch.randperm(flat.numel(), generator=gv)[: max(1, flat.numel() // 100)]
            flat[idx] = torch.randn(len(idx), generator=gv).to(torch.bfloat16)
        out[t.name] = x.to(device)
    return out


def _hash(i: torch.Tensor, *keys: int) -> torch.Tensor:
    """32 well-mixed bits per element index ``i`` (int64, on any device) and ``keys``: the
    same on every GPU, with no generator state to keep in step between processes."""
    h = i & 0xFFFFFFFF
    for k in keys:
        h = (h ^ (k & 0xFFFFFFFF)) * 0x2C1B3C6D & 0xFFFFFFFF
        h = (h ^ (h >> 15)) * 0x297A2D39 & 0xFFFFFFFF
        h = h ^ (h >> 13)
    return h


def _step_large(
    model, canon: dict[str, torch.Tensor], version: int, device, percent: int = 1
) -> None:
    """Version ``version`` of the large case's canonical weights, in place: version 1 sets
    every element's bits, each later one changes about ``percent``% of them (any bf16 bits,
    NaN payloads and -0.0 included: the codec compares raw bits)."""
    for t in model.tensors:
        seed = zlib.crc32(t.name.encode())
        i = torch.arange(math.prod(t.shape), device=device)
        bits = (_hash(i, seed, version, 1) & 0xFFFF) - 32768
        x = bits.to(torch.int16).view(torch.bfloat16).view(t.shape)
        if version == 1:
            canon[t.name] = x
        else:
            changed = (_hash(i, seed, version, 2) % 100 < percent).view(t.shape)
            canon[t.name] = torch.where(changed, x, canon[t.name])


_ANNOUNCED_PERCENT = {2: 99, 3: 99, 4: 99}
"""The announce case: the percent of elements each version changes (1 where not listed)."""


def _participant(
    role: str, port: int, q, size: str, pieces: bool = False, announce: bool = False
) -> None:
    try:
        from weightbus import BoundLayout, ControlConfig, Participant, Reader, SyncConfig, Writer
        from weightbus.codecs import _delta_triton
        from weightbus.layouts.describe import build_layouts
        from weightbus.layouts.families import PRESETS, model_spec

        gpu = 0 if role == "writer" else 1
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        if size == "tiny":
            model = model_spec("tiny-llama", dtype="bfloat16")
            buckets = {"bucket_bytes": 1 << 20, "direct_bytes": 0}
            delta = DeltaConfig(checksum_every=3, pieces=pieces)
        else:
            # Llama-3-8B's shapes, 4 layers (2.2 GB): real sizes for the kernels, the
            # default buckets, and windows small enough for several passes per sync, so that
            # buffers are reused between passes while the GPU still works on them
            config = {**PRESETS["llama-3-8b"], "num_hidden_layers": 4, "vocab_size": 32000}
            model = model_spec(config, dtype="bfloat16")
            buckets = {}
            delta = DeltaConfig(
                checksum_every=3, window_bytes=256 << 20, pieces=pieces, announce=announce
            )
        layout = build_layouts(model, "whole" if role == "writer" else "vllm:tp=1", role)[0]
        me = Participant(role=role, rank=0, host=socket.gethostname(), device=str(device))
        layout = dataclasses.replace(layout, participant=me, _memo={})
        tensors = allocate(layout, device=device)
        control = ControlConfig(
            num_writers=1,
            num_readers=1,
            address=f"127.0.0.1:{port}",
            host_store=False,
            job="delta-gpu",
            timeout=timedelta(seconds=120),
        )
        sync = SyncConfig(
            **buckets,
            transport="nccl",
            delta=delta,
            sync_timeout=timedelta(seconds=60),
            step_timeout=timedelta(seconds=120),
        )
        bound = BoundLayout(layout=layout, tensors=tensors)
        side = Writer(bound, control, sync) if role == "writer" else Reader(bound, control, sync)
        side.connect()
        if role == "writer":
            tables = {type(lay.table) for lay in side.codec.encoder._layouts}
            used = tables == {_delta_triton.WindowTable}
        else:
            used = isinstance(side.codec.decoder._table, _delta_triton.TargetTable)
        said: list[bool] = []  # the writer: per sync, whether its begin announced pieces
        if role == "writer":
            real = side.codec.announce

            def told() -> bool:
                said.append(real())
                return said[-1]

            side.codec.announce = told
        sizes, bad = [], []
        canon: dict[str, torch.Tensor] = {}
        want = allocate(layout, device=device) if role == "reader" else None
        for v in range(1, STEPS + 1):
            if size == "tiny":
                canon = _canon(model, v, device)
            else:
                percent = _ANNOUNCED_PERCENT.get(v, 1) if announce else 1
                _step_large(model, canon, v, device, percent)
            if role == "writer":
                fill_from_canonical(layout, canon, tensors)
                torch.cuda.synchronize()
                sizes.append(side.sync(v).bytes)
                continue
            sizes.append(side.wait().bytes)
            fill_from_canonical(layout, canon, want)
            for k, t in want.items():
                if not torch.equal(tensors[k].view(torch.int16), t.view(torch.int16)):
                    bad.append((v, k))
        side.close()
        q.put((role, "ok" if used and not bad else "wrong", (used, sizes, bad[:5], said)))
    except BaseException as exc:
        q.put((role, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("shadow", ["device", "host", "device, pieces"])
def test_windows_sent_dense_on_a_guess_are_copied_after_a_sample(shadow, monkeypatch):
    """Where every writer route of a window is a live region (no cast), the window's shadow
    is brought up to date by copies (of contiguous bytes, or of a strided region), not a
    compare pass, when it is sent
    dense, after a compare of a sample of its tiles where that was on a guess (every route
    went dense last time). Syncs stay bit exact through dense, 50%, 50% (on a guess), 1%
    (still on a guess; the sample sees few changes) and 1% (sparse again), with the shadow on
    the GPU or in host memory (copied into a device window and back). With groups sent as
    pieces (from the live tensors), a window's copies are launched only once its sends
    were posted, and on a guess only the sample's tiles are brought up to date: the first
    1% sync then goes dense once more (copied whole) and the next is sparse."""
    import tests.test_codec_delta as cases
    from weightbus.codecs.delta import DeltaEncoder

    monkeypatch.setenv("WEIGHTBUS_DELTA_TRITON", "1")
    monkeypatch.setattr("weightbus.codecs.delta.PIECE_BYTES", 500)  # (small tensors here)
    bf16 = {t: (shape, "bfloat16") for t, (shape, _) in TENSORS.items()}
    for module in (cases, sys.modules[__name__]):  # the layouts' and the canonical tensors'
        monkeypatch.setattr(module, "TENSORS", bf16)
    copied = []
    order: list[tuple[str, int, int]] = []  # ("packed" or "copied", writer, window)
    real = DeltaEncoder._copy

    def spy(self, w, win):
        copied.append((w, win.guess))
        order.append(("copied", id(self), w))
        return real(self, w, win)

    monkeypatch.setattr(DeltaEncoder, "_copy", spy)
    pack_group = WriterCodec.pack_group

    def packed(self, op, buf):
        out = pack_group(self, op, buf)  # (its messages, which run_sync sends next)
        order.append(("packed", id(self.encoder), self.encoder._window_of[op.bucket]))
        return out

    monkeypatch.setattr(WriterCodec, "pack_group", packed)
    pieces = shadow.endswith("pieces")
    shadow = shadow.split(",")[0]
    # (no masked frames: at 50% changed every route then goes dense, as this test needs)
    codecs = CodecConfig(
        delta=DeltaConfig(
            checksum_every=0, window_bytes=3000, shadow=shadow, pieces=pieces, masks=False
        )
    )
    plan, ws, rs, canon, live, got, wcs, rcs = _start_on_cuda(codecs, cast={})
    layouts = [lay for w in wcs for lay in w.encoder._layouts]
    assert all(lay.copies is not None for lay in layouts)
    # the readers' column cuts: strided regions of the writers' tensors
    assert any(not src.is_contiguous() for lay in layouts for _, src in lay.copies)
    dense_bytes = plan.stats.total_bytes
    g = torch.Generator().manual_seed(5)
    moved, guessed = [], []
    stale = []  # per sync: windows whose shadow holds only their sample's tiles (pieces)
    for step, fraction in enumerate([0.0, 0.5, 0.5, 0.01, 0.01, 0.01], start=1):
        if fraction:
            change(canon, g, fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, {n: v.cuda() for n, v in canon.items()}, t)
        if step < (6 if pieces else 5):  # dense (or on a guess): every byte is written
            for t in got:
                for v in t.values():
                    poison(v)
        copied.clear()
        order.clear()
        moved.append(run_sync(plan, wcs, rcs, step))
        guessed.append(sum(guess for _, guess in copied))
        stale.append(sum(len(w.encoder._stale) for w in wcs))
        first: dict[tuple[str, int, int], int] = {}
        for i, key in enumerate(order):
            first.setdefault(key, i)
        pairs = [(i, first[("packed", *k[1:])]) for k, i in first.items() if k[0] == "copied"]
        assert bool(pairs) == bool(copied), order
        # as pieces a window's copies are launched once its sends are posted; sent from the
        # shadow, before
        assert all(p < c if pieces else c < p for c, p in pairs), (step, order)
        cpu = [{n: v.cpu() for n, v in t.items()} for t in got]
        try:
            assert_exact(rs, cpu, canon)
        except AssertionError as exc:
            raise AssertionError(f"sync {step} ({fraction:.0%} changed): {exc}") from exc
        if step == 1:
            assert copied and not any(guess for _, guess in copied), copied
    assert guessed[:2] == [0, 0] and guessed[2] > 0 and guessed[3] > 0, guessed
    assert moved[2] > 0.9 * dense_bytes and moved[3] > 0.9 * dense_bytes, (moved, dense_bytes)
    fixed = unchanged_sync_bytes(rcs)
    assert moved[5] - fixed < 0.2 * dense_bytes, (moved, fixed, dense_bytes)
    if pieces:
        # sent as pieces on a guess, a window's shadow is brought up to date only in its
        # sample's tiles; once the sample sees few changes, the window goes dense once more,
        # copied whole, and only then is compared (and sparse)
        assert stale[0] == stale[1] == 0 and stale[2] > 0 and stale[3] > 0, stale
        assert stale[4] == stale[5] == 0, stale
        assert moved[4] > 0.9 * dense_bytes, (moved, dense_bytes)
    else:
        assert stale == [0] * 6, stale
        assert moved[4] - fixed < 0.2 * dense_bytes, (moved, fixed, dense_bytes)


def _session_over_nccl(size: str, pieces: bool, announce: bool = False):
    """A writer on GPU 0 and a reader on GPU 1 (:func:`_participant`), both ok and bit exact
    after every sync, having moved the same bytes: the reader's bytes per sync, and per sync
    whether the writer's begin announced every group as pieces."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_participant, args=(r, store.port, q, size, pieces, announce))
        for r in ("writer", "reader")
    ]
    for p in procs:
        p.start()
    results = collect_reports(procs, q, 2, 240).got
    assert set(results) == {"writer", "reader"}, results
    assert all(status == "ok" for status, _ in results.values()), results
    _, sizes_w, _, said = results["writer"][1]
    _, sizes_r, _, _ = results["reader"][1]
    assert sizes_w == sizes_r
    return sizes_r, said


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "pieces"), [("tiny", False), ("large", False), ("large", True)])
def test_session_sync_over_nccl_uses_the_kernels(size, pieces, monkeypatch):
    monkeypatch.delenv("WEIGHTBUS_DELTA_TRITON", raising=False)  # the default: the kernels
    sizes_r, _ = _session_over_nccl(size, pieces)
    # the first sync is dense; then an index and a value per changed element
    assert max(sizes_r[1:]) < 0.1 * sizes_r[0], sizes_r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(300)
def test_syncs_announced_as_pieces_over_nccl_are_bit_exact(monkeypatch):
    """With ``DeltaConfig.announce``, over NCCL between two GPUs: a dense sync, three at 99%
    changed (the first compared and sent dense, then sent dense on a guess: announced, each group's pieces
    before its directories, the reader posting every receive at once), then 1% (still on a
    guess, announced; its sample sees few
    changes) and 1% again (its windows stale, sent dense once more: announced). Syncs 3 and
    6 carry checksums (``checksum_every=3``): their directories wait for the shadow's
    copies. Bit exact after each sync, the same bytes on both sides; a mismatch in the order
    of messages would fail it or hang until the timeout."""
    monkeypatch.delenv("WEIGHTBUS_DELTA_TRITON", raising=False)
    sizes_r, said = _session_over_nccl("large", True, True)
    assert said == [False, False, True, True, True, True], said
    assert min(sizes_r[1:]) > 0.9 * sizes_r[0], sizes_r  # every sync dense (or on a guess)


def _compiled(kernels) -> int:
    """Variants compiled so far of these Triton kernels (on any device)."""
    caches = [getattr(k, "device_caches", None) for k in kernels]
    if any(c is None for c in caches):
        pytest.skip("this Triton does not expose its kernels' caches")
    return sum(len(entry[0]) for c in caches for entry in c.values())


def test_kernels_are_compiled_at_connect(monkeypatch):
    """Every kernel variant a sync may need is compiled when the codecs are made: no sync,
    dense, sparse (by steps or a lane per element) or sent dense on a guess, compiles one."""
    from weightbus.codecs import _delta_triton as k

    monkeypatch.setenv("WEIGHTBUS_DELTA_TRITON", "1")
    monkeypatch.setattr(k, "BLOCK", 512)  # variants no other test compiles
    kernels = (k._compare_kernel, k._emit_kernel, k._apply_kernel)
    before = _compiled(kernels)
    codecs = CodecConfig(delta=DeltaConfig(checksum_every=0, window_bytes=3000))
    plan, ws, rs, canon, live, got, wcs, rcs = _start_on_cuda(codecs)
    assert all(isinstance(lay.table, k.WindowTable) for w in wcs for lay in w.encoder._layouts)
    at_connect = _compiled(kernels)
    assert at_connect > before
    g = torch.Generator().manual_seed(3)
    # dense, 1% (by steps), 50% (lanes, masked frames), 98% (windows go dense), 98% again
    # (sent dense on a guess, a sample counted), 1%
    for step, fraction in enumerate([0.0, 0.01, 0.5, 0.98, 0.98, 0.01], start=1):
        if fraction:
            change(canon, g, fraction)
        for lay, t in zip(ws, live, strict=True):
            fill_from_canonical(lay, {n: v.cuda() for n, v in canon.items()}, t)
        run_sync(plan, wcs, rcs, step)
        cpu = [{n: v.cpu() for n, v in t.items()} for t in got]
        assert_exact(rs, cpu, {n: v.cuda().to(torch.bfloat16).cpu() for n, v in canon.items()})
        assert _compiled(kernels) == at_connect, f"sync {step} compiled a kernel"
