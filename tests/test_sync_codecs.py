"""Codecs end to end over gloo: real processes, Writer.sync -> Reader.wait through FP8 and deltas.

* deltas: FSDP2-style DTensor writers (fp32, cast to bf16 on the wire) -> vLLM-style tensor
  parallel readers, 22 syncs with about 1% of the elements changed each (none in one of
  them: only the buckets' directories travel), checked bit for bit
  after every sync; the readers start poisoned, and one reader poisons its tensors mid-run and
  asks for a dense sync (what a reader that lost or missed a version does); several groups per
  link, some directories sent ahead, and each link's messages posted in the same order and
  sizes on both sides (NCCL matches by order, gloo by tags);
* FP8: the same FSDP writers, whose shards cut quantization blocks (so they agree on amaxes
  through their own all-reduce) -> one reader holding fused FP8 engine parameters and scales,
  equal to the reference quantization and within the FP8 error bound;
* a codec setting that differs between participants is refused at connect, naming both sides;
  codecs never travel over a pulling transport.

The two jobs run one after the other in the same processes (starting them is the slow part).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import re
import threading
import time
import traceback
import zlib
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.procs import collect_reports
from tests.threads import run_threads

STEPS = 22
DENSE_AT = 9  # reader-1 loses its weights before this sync and asks for every byte
UNCHANGED_AT = 4  # nothing changes before this sync: groups of directories alone
FP8_STEPS = 3
N_WRITERS = 2
# deltas: a model large enough that each writer sends each reader several groups (windows of
# one 1 MiB bucket), so that a group's directories go before the previous group's buckets
# where the writer has them without waiting for its device (every group in a dense sync,
# those analyzed in one pass in the others)
DELTA_MODEL = {
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DELTA_BUCKET = 1 << 20
DELTA_WINDOW = 1 << 20
# small FP8 blocks, so the tiny model has many; FSDP over 2 cuts k_proj and v_proj (32 rows)
# inside their first block row, and the fused qkv / gate_up components start on block edges
BLOCK = 32


def _canonical(model, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for t in model.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) * 1000 + version)
        out[t.name] = torch.randn(t.shape, generator=g)
    return out


def _step(canon: dict[str, torch.Tensor], version: int) -> None:
    """Change about 1% of every tensor's elements (none before sync ``UNCHANGED_AT``), the
    same way in every process."""
    fraction = 0.0 if version == UNCHANGED_AT else 0.01
    for name, x in canon.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * version)
        flat = x.view(-1)
        n = max(1, int(fraction * flat.numel())) if fraction else 0
        idx = torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] = torch.randn(n, generator=g)


def _record(transport, op: str) -> list[tuple[int, int]]:
    """Log (peer, bytes) of every ``op`` ("send" or "recv") the transport is asked to post, in
    order: NCCL matches a link's messages by their order alone (gloo by tags), so the test
    compares each link's sequence on both sides."""
    log: list[tuple[int, int]] = []
    post = getattr(transport, op)

    def recorded(peer, buf, tag):
        log.append((int(peer), buf.numel() * buf.element_size()))
        return post(peer, buf, tag)

    setattr(transport, op, recorded)
    return log


def _record_posts(transport, op: str) -> list[tuple[int, tuple[int, ...]]]:
    """Log (peer, bytes of each message) of every post of ``op`` ("send" or "recv"), singly
    or in groups (``send_many`` / ``recv_many``), in order: NCCL needs a link's messages
    posted in the same groups and order on both sides."""
    log: list[tuple[int, tuple[int, ...]]] = []
    post, many = getattr(transport, op), getattr(transport, f"{op}_many")

    def recorded(peer, buf, tag):
        log.append((int(peer), (buf.numel() * buf.element_size(),)))
        return post(peer, buf, tag)

    def recorded_many(peer, items):
        log.append((int(peer), tuple(b.numel() * b.element_size() for b, _ in items)))
        return many(peer, items)

    setattr(transport, op, recorded)
    setattr(transport, f"{op}_many", recorded_many)
    return log


def _delta_config():
    from weightbus.codecs import DeltaConfig

    return DeltaConfig(checksum_every=5, window_bytes=DELTA_WINDOW)


def _configs(
    port: int, job: str, n_r: int, n_w: int = N_WRITERS, bucket_bytes: int = 1 << 20, **sync_fields
):
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(
        num_writers=n_w,
        num_readers=n_r,
        address=f"127.0.0.1:{port}",
        host_store=False,
        job=job,
        timeout=timedelta(seconds=60),
        heartbeat_interval=timedelta(seconds=0.2),
        heartbeat_timeout=timedelta(seconds=2),
    )
    sync = SyncConfig(
        cast={"float32": "bfloat16"},
        bucket_bytes=bucket_bytes,
        staging_buffers=2,
        direct_bytes=4096,
        sync_timeout=timedelta(seconds=30),
        step_timeout=timedelta(seconds=60),
        transport="gloo",
        **sync_fields,
    )
    return control, sync


def _writer(rank: int, port: int, q) -> None:
    """A trainer rank: the delta job with 2 readers, then the FP8 job with 1."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from weightbus import Participant, Writer
        from weightbus.codecs import Fp8Config
        from weightbus.codecs.fp8 import all_reduce_max
        from weightbus.layouts.dtensor import bind_dtensors
        from weightbus.layouts.families import model_spec
        from weightbus.plan import fill_from_canonical

        torch.set_num_threads(1)
        # the trainer's own process group: its DTensor mesh and the writers' FP8 amax exchange
        store = dist.PrefixStore("trainer", dist.TCPStore("127.0.0.1", port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=N_WRITERS)
        mesh = init_device_mesh("cpu", (N_WRITERS,))
        model = model_spec(DELTA_MODEL)
        me = Participant(role="writer", rank=rank)

        def bind(canon):
            return bind_dtensors(
                {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in canon.items()}, me
            )

        canon = _canonical(model, 0)
        bound = bind(canon)
        control, sync = _configs(port, "delta", 2, delta=_delta_config(), bucket_bytes=DELTA_BUCKET)
        writer = Writer(bound, control, sync)
        writer.connect()
        if rank == 1:
            # gloo sends the frames from where the encoder wrote them; this writer copies
            # them into its staging buffer first, as over transports that register memory
            writer.codec.send_from_stores(False)
        posted = _record(writer.transport, "send")
        sent = []
        for v in range(1, STEPS + 1):
            _step(canon, v)
            fill_from_canonical(bound.layout, canon, bound.tensors)
            sent.append(writer.sync(v).bytes)
        writer.close()
        q.put(("delta", f"writer-{rank}", "ok", (sent, posted)))

        model = model_spec("tiny-llama")
        bound = bind(_canonical(model, 0))
        control, sync = _configs(port, "fp8", 1, fp8=Fp8Config(bucket_bytes=0, block=BLOCK))
        writer = Writer(bound, control, sync, amax_reduce=all_reduce_max())
        writer.connect()
        shared = writer.codec.scales.exchange_size
        for v in range(1, FP8_STEPS + 1):
            fill_from_canonical(bound.layout, _canonical(model, v), bound.tensors)
            writer.sync(v)
        writer.close()
        dist.destroy_process_group()
        q.put(("fp8", f"writer-{rank}", "ok", shared))
    except BaseException as exc:
        q.put(("?", f"writer-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _reader(rank: int, port: int, q) -> None:
    """An inference rank: reader of the delta job, then (rank 0) of the FP8 job."""
    try:
        torch.set_num_threads(1)
        _delta_reader(rank, port, q)
        if rank == 0:
            _fp8_reader(rank, port, q)
    except BaseException as exc:
        q.put(("?", f"reader-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _delta_reader(rank: int, port: int, q) -> None:
    """Checks every sync bit for bit, and how many bytes travelled."""
    from weightbus import BoundLayout, Participant, Reader
    from weightbus.codecs.delta import directory_bytes
    from weightbus.layouts.families import model_spec
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate, fill_from_canonical, poison

    model = model_spec(DELTA_MODEL)
    layout = engine_layout(
        model, Participant(role="reader", rank=rank), tp=2, tp_rank=rank, dtype="bfloat16"
    )
    tensors = allocate(layout)  # poisoned
    control, sync = _configs(port, "delta", 2, delta=_delta_config(), bucket_bytes=DELTA_BUCKET)
    reader = Reader(BoundLayout(layout=layout, tensors=tensors), control, sync)
    reader.connect()
    posted = _record(reader.transport, "recv")
    payload = sum(c.nbytes for op in reader.ops for c in op.copies)
    groups = reader.codec.group_starts()
    directories = sum(directory_bytes(op) for op in reader.ops)
    canon = _canonical(model, 0)
    bad, got = [], []
    for v in range(1, STEPS + 1):
        _step(canon, v)
        if v == DENSE_AT and rank == 1:
            for t in tensors.values():
                poison(t)
            reader.request_dense()
        result = reader.wait()
        got.append(result.bytes)
        want = allocate(layout)
        fill_from_canonical(layout, {n: x.to(torch.bfloat16) for n, x in canon.items()}, want)
        for k in want:
            if not torch.equal(tensors[k].view(torch.uint8), want[k].view(torch.uint8)):
                bad.append((result.version, k))
    reader.close()
    q.put(
        (
            "delta",
            f"reader-{rank}",
            "ok" if not bad else "wrong",
            (got, payload, bad[:5], len(groups), directories, posted),
        )
    )


def _fp8_reader(rank: int, port: int, q) -> None:
    """Fused FP8 engine tensors and scales, poisoned before each sync, compared with the
    reference quantization (the formula, in numpy) and the FP8 error bound."""
    from tests.test_codec_fp8 import reference_quantize
    from weightbus import BoundLayout, Participant, Reader
    from weightbus.codecs import Fp8Config, quantized_layout
    from weightbus.codecs.fp8 import scale_name
    from weightbus.layouts.families import model_spec
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate, poison

    cfg = Fp8Config(bucket_bytes=0, block=BLOCK)
    model = model_spec("tiny-llama")
    layout = engine_layout(model, Participant(role="reader", rank=rank), dtype="bfloat16")
    wire = quantized_layout(layout, cfg)
    tensors = allocate(wire)
    control, sync = _configs(port, "fp8", 1, fp8=cfg)
    reader = Reader(BoundLayout(layout=wire, tensors=tensors), control, sync)
    reader.connect()
    quantized = {t.name for t in model.tensors if cfg.quantizes(t)}
    bad, worst = [], 0.0
    for v in range(1, FP8_STEPS + 1):
        for t in tensors.values():
            poison(t)
        result = reader.wait()
        canon = _canonical(model, v)
        ref = {n: reference_quantize(canon[n], block=BLOCK) for n in quantized}
        for p in wire.iter_pieces():
            have = tensors[p.key][p.local_box.slices()]
            base = p.tensor.removesuffix("_scale_inv")
            if p.tensor in quantized:
                q_ref, s_ref = ref[p.tensor]
                exp = q_ref[p.box.slices()].reshape(have.shape)
                got = have.float().double().numpy()
                if not (
                    np.array_equal(got, exp) and np.array_equal(np.signbit(got), np.signbit(exp))
                ):
                    bad.append((v, p.tensor, "fp8 values"))
                # dequantized, within the bound of e4m3's rounding (see test_codec_fp8)
                rows = np.arange(p.box.start[0], p.box.stop[0]) // BLOCK
                cols = np.arange(p.box.start[1], p.box.stop[1]) // BLOCK
                s = s_ref[np.ix_(rows, cols)].astype(np.float64)
                x = canon[p.tensor][p.box.slices()].double().numpy()
                bound = np.abs(x) * (2.0**-4 + 2.0**-20) + s * 2.0**-10
                worst = max(worst, float((np.abs(x - got * s) / bound).max()))
            elif p.tensor == scale_name(base) and base in quantized:
                exp = ref[base][1][p.box.slices()]
                if not np.array_equal(have.numpy(), exp.reshape(have.shape)):
                    bad.append((v, p.tensor, "scales"))
            else:
                exp = canon[p.tensor][p.box.slices()].to(torch.bfloat16).reshape(have.shape)
                if not torch.equal(have.view(torch.int16), exp.view(torch.int16)):
                    bad.append((v, p.tensor, "bf16 values"))
        if result.bytes != reader.bytes_per_sync:
            bad.append(f"v{v}: {result.bytes} bytes, the plan says {reader.bytes_per_sync}")
    reader.close()
    if not 0.25 < worst <= 1.0:
        bad.append(f"largest error / FP8 bound {worst:.3f}, expected in (0.25, 1]")
    q.put(("fp8", f"reader-{rank}", "ok" if not bad else "wrong", (sorted(quantized), bad[:5])))


@pytest.fixture(scope="module")
def jobs() -> dict:
    """Both jobs, run once by the same processes: {(job, participant): (status, payload)}."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(r, store.port, q)) for r in range(N_WRITERS)]
    procs += [ctx.Process(target=_reader, args=(r, store.port, q)) for r in range(2)]
    for p in procs:
        p.start()
    expected = 2 * N_WRITERS + 3  # delta: every process; fp8: the writers and reader-0
    reports = collect_reports(procs, q, expected, 150)
    assert not reports.hung, f"processes left hanging: {reports.hung}; results {reports.got}"
    return reports.got


def _job(jobs: dict, job: str, names: list[str]) -> dict:
    failed = {k: v for k, v in jobs.items() if v[0] != "ok"}
    assert not failed, failed
    got = {name: payload for (j, name), (_, payload) in jobs.items() if j == job}
    assert set(got) == set(names), jobs
    return got


@pytest.mark.timeout(200)
def test_deltas_bit_exact_over_22_syncs_with_resharding_and_a_dense_request(jobs):
    got = _job(jobs, "delta", ["writer-0", "writer-1", "reader-0", "reader-1"])
    got0, payload0, _, groups0, dirs0, posted0 = got["reader-0"]
    got1, payload1, _, groups1, dirs1, posted1 = got["reader-1"]
    assert groups0 >= 2 * N_WRITERS and groups1 >= 2 * N_WRITERS  # several from each writer
    # the first sync is dense; then about 3% of the bytes travel (an index and a value per
    # changed element), except in the sync reader-1 asked to be dense: the others stay sparse
    assert got0[0] >= payload0 and got1[0] >= payload1, (got0, got1)
    assert max(got0[1:]) < 0.2 * payload0, got0
    # nothing changed: the directories alone travelled (no group sent its frames' message)
    assert got0[UNCHANGED_AT - 1] == dirs0 and got1[UNCHANGED_AT - 1] == dirs1, (got0, got1)
    assert max(got1[1 : DENSE_AT - 1] + got1[DENSE_AT:]) < 0.2 * payload1, got1
    assert got1[DENSE_AT - 1] >= payload1, got1
    (sent0, by0), (sent1, by1) = got["writer-0"], got["writer-1"]
    sent = [a + b for a, b in zip(sent0, sent1, strict=True)]
    assert sent == [a + b for a, b in zip(got0, got1, strict=True)]
    # every link's messages posted in the same order and sizes on both sides, as NCCL needs
    # (global ranks: the writers, then the readers)
    for w, by in enumerate((by0, by1)):
        for r, posted in enumerate((posted0, posted1)):
            sends = [n for peer, n in by if peer == N_WRITERS + r]
            recvs = [n for peer, n in posted if peer == w]
            assert sends and sends == recvs, (w, r)


@pytest.mark.timeout(200)
def test_fp8_with_writer_shards_cutting_blocks_matches_the_reference(jobs):
    got = _job(jobs, "fp8", ["writer-0", "writer-1", "reader-0"])
    assert got["writer-0"] > 0 and got["writer-1"] > 0  # amaxes were exchanged
    quantized, _ = got["reader-0"]
    assert "model.layers.0.self_attn.k_proj.weight" in quantized
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in quantized)


# ---------------------------------------------------------------------------------------------
# connect-time refusals (participants as threads of this process)
# ---------------------------------------------------------------------------------------------


def _tiny_layout(role: str):
    from weightbus import BoundLayout, LayoutBuilder, Participant
    from weightbus.spec import Box

    b = LayoutBuilder(Participant(role=role, rank=0))
    b.add_tensor("a.weight", (64, 64), "bfloat16")
    b.add_local("a.weight", (64, 64), "bfloat16")
    b.add_piece("a.weight", Box.whole((64, 64)), "a.weight", Box.whole((64, 64)))
    return BoundLayout(layout=b.build(), tensors={"a.weight": torch.zeros(64, 64).bfloat16()})


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "writer_codecs, reader_codecs, words",
    [
        (
            {"fp8": 16},
            {},
            ["writer-0 with FP8 and no deltas", "reader-0 with no FP8 and no deltas"],
        ),
        (
            {},
            {"delta": True},
            ["writer-0 with no FP8 and no deltas", "reader-0 with no FP8 and deltas"],
        ),
        ({"fp8": 16}, {"fp8": 32}, ["the same codecs with other settings"]),
        (
            {"delta": 1 << 20},
            {"delta": True},
            ["the same codecs with other settings", "DeltaConfig.window_bytes"],
        ),
    ],
)
def test_codec_mismatch_is_refused_at_connect_naming_both_sides(
    writer_codecs, reader_codecs, words
):
    from weightbus import BoundLayout, PlanMismatch, Reader, Writer
    from weightbus.codecs import DeltaConfig, Fp8Config
    from weightbus.codecs.fp8 import quantized_layout
    from weightbus.plan import allocate

    def codecs(spec):
        out = {}
        if "fp8" in spec:
            out["fp8"] = Fp8Config(bucket_bytes=0, block=spec["fp8"])
        if spec.get("delta") is True:
            out["delta"] = DeltaConfig()
        elif spec.get("delta"):
            out["delta"] = DeltaConfig(window_bytes=spec["delta"])
        return out

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors: dict[str, BaseException] = {}

    def run(role, spec):
        try:
            control, sync = _configs(store.port, "refusal", 1, 1, **codecs(spec))
            bound = _tiny_layout(role)
            if role == "reader" and "fp8" in spec:
                wire = quantized_layout(bound.layout, sync.fp8)
                bound = BoundLayout(layout=wire, tensors=allocate(wire))
            side = (Writer if role == "writer" else Reader)(bound, control, sync)
            side.connect()
            side.close()
        except BaseException as exc:
            errors[role] = exc

    threads = [
        threading.Thread(target=run, args=("writer", writer_codecs)),
        threading.Thread(target=run, args=("reader", reader_codecs)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert set(errors) == {"writer", "reader"}, errors
    for role, exc in errors.items():
        assert isinstance(exc, PlanMismatch), (role, exc)
        text = str(exc)
        assert "disagree on the codecs" in text and "SyncConfig.fp8" in text, text
        for w in words:
            assert w in text, (role, text)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("rooms", "announce"),
    [("both", False), ("none", False), ("both", True), ("none", True), ("writer", True)],
)
def test_dense_groups_travel_as_pieces_in_place_bit_exact(monkeypatch, rooms, announce):
    """Writers whose weights are the wire's (bf16: no cast) send each group of plain
    buckets as its pieces, from their tensors, and readers receive each large route's piece
    straight into theirs (tensor parallel, fused qkv), the small ones staged: dense syncs,
    a sync where every route changed, then ones sent dense on a guess, and sparse ones
    between, bit exact after each (readers poisoned before every sync that is all pieces).
    The writers stage small pieces in rooms of their own, without a staging buffer, and so
    do the readers (``rooms`` both), or in a staging buffer (none, or the readers': writer).
    The messages of a group on each link are posted in the same groups and sizes on both
    sides, as NCCL needs. With ``announce`` (``DeltaConfig.announce``), a writer with rooms
    whose every window goes dense for sure says so at the sync's begin and sends each
    group's pieces before its directories; readers with rooms post every receive of its
    groups at once, before reading any directory; without, each group's pieces into a
    staging buffer, its directories read when it is applied."""
    from weightbus import BoundLayout, Participant, Reader, Writer
    from weightbus.codecs import DeltaConfig
    from weightbus.codecs.delta import DeltaDecoder, DeltaEncoder
    from weightbus.layouts.families import model_spec
    from weightbus.layouts.fsdp import fsdp_layout
    from weightbus.layouts.fused import engine_layout
    from weightbus.plan import allocate, fill_from_canonical, poison

    monkeypatch.setattr("weightbus.codecs.delta.PIECE_BYTES", 40 << 10)
    if rooms == "none":
        monkeypatch.setattr("weightbus.codecs.delta.PIECES_AREA_BYTES", 0)
    elif rooms == "writer":  # readers without rooms: their pieces staged
        monkeypatch.setattr(DeltaDecoder, "room", lambda self, ops, raw: None)
        monkeypatch.setattr(DeltaDecoder, "announced_room", lambda self, ops: None)
    model = model_spec(DELTA_MODEL)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    n_w = n_r = 2
    # (version, fraction of the elements changed, whether every group travels as pieces)
    plan = [(1, 0.0, True), (2, 0.01, False), (3, 0.98, True), (4, 0.98, True), (5, 0.01, True)]
    plan.append((6, 0.01, False))  # (5's sample counted few changes: compared again)
    canon = _canonical(model, 0)
    versions = {}
    for v, fraction, _ in plan:
        g = torch.Generator().manual_seed(v)
        for x in canon.values():
            flat = x.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: int(fraction * flat.numel())]
            flat[idx] = torch.randn(idx.numel(), generator=g)
        versions[v] = {n: x.to(torch.bfloat16) for n, x in canon.items()}
    landed: list[tuple[str, int]] = []  # (reader, pieces) per group that came as pieces
    roomed: list[bool] = []  # per group that came as pieces: staged in its room?
    real = DeltaDecoder.pieces

    def pieces(self, ops, buf):
        out = real(self, ops, buf)
        if out is not None:
            landed.append((self.name, len(out)))
            roomed.append(self._read[ops[0].bucket].room is not None)
        return out

    monkeypatch.setattr(DeltaDecoder, "pieces", pieces)
    real_announced = DeltaDecoder.announced_pieces

    def announced_pieces(self, ops, buf, *, in_room):  # (posted before the directories)
        out = real_announced(self, ops, buf, in_room=in_room)
        landed.append((self.name, len(out)))
        roomed.append(in_room)
        return out

    monkeypatch.setattr(DeltaDecoder, "announced_pieces", announced_pieces)
    unstaged: list[bool] = []  # per group a writer sent as pieces: without a staging buffer?
    real_unstaged = DeltaEncoder.unstaged

    def spy(self, op):
        out = real_unstaged(self, op)
        if (
            op.bucket
            in self._open.get(self._window_of[op.bucket], SimpleNamespace(pieces=())).pieces
        ):
            unstaged.append(out)
        return out

    monkeypatch.setattr(DeltaEncoder, "unstaged", spy)
    said: list[tuple[int, bool]] = []  # (writer's rank, announced) per writer and sync
    real_announce = DeltaEncoder.announce

    def announced(self):
        out = real_announce(self)
        said.append((self.name, out))
        return out

    monkeypatch.setattr(DeltaEncoder, "announce", announced)
    went: list[tuple[str, int]] = []  # per writer and sync: groups whose pieces went before
    real_begin = DeltaEncoder.begin  # its begin (announced: each reader's first, before the
    # readers' word on what they hold was read)

    def begin(self, decision, *, announced=False):
        went.append((self.name, len(self._early)))
        return real_begin(self, decision, announced=announced)

    monkeypatch.setattr(DeltaEncoder, "begin", begin)
    eager: list[str] = []  # per writer whose groups a reader posted at once: the reader
    real_post = Reader._post_announced

    def post_announced(self, first, heads, posted, phases):
        out = real_post(self, first, heads, posted, phases)
        if out:
            eager.append(self.name)
        return out

    monkeypatch.setattr(Reader, "_post_announced", post_announced)
    delta = DeltaConfig(checksum_every=0, window_bytes=DELTA_WINDOW, pieces=True, announce=announce)
    sync = {"delta": delta}
    ready = threading.Barrier(n_w + n_r)

    def writer(rank):
        def body():
            me = Participant(role="writer", rank=rank)
            layout = fsdp_layout(model, me, shard=n_w, shard_rank=rank, dtype="bfloat16")
            bound = BoundLayout(layout=layout, tensors=allocate(layout))
            control, config = _configs(
                store.port, "pieces", n_r, n_w, bucket_bytes=DELTA_BUCKET, **sync
            )
            with Writer(bound, control, config) as w:
                posted = _record_posts(w.transport, "send")
                out, results = [], []
                for v, _, _ in plan:
                    fill_from_canonical(layout, versions[v], bound.tensors)
                    ready.wait(30)  # (readers poison first)
                    results.append(w.sync(v))
                    out.append(results[-1].bytes)
                return out, posted, results

        return body

    def reader(rank):
        def body():
            me = Participant(role="reader", rank=rank)
            layout = engine_layout(model, me, tp=n_r, tp_rank=rank, dtype="bfloat16")
            tensors = allocate(layout)
            control, config = _configs(
                store.port, "pieces", n_r, n_w, bucket_bytes=DELTA_BUCKET, **sync
            )
            r = Reader(BoundLayout(layout=layout, tensors=tensors), control, config)
            r.connect()
            posted = _record_posts(r.transport, "recv")
            wrong, counts, results = [], [], []
            try:
                for v, _, whole in plan:
                    if whole:  # every byte travels: a missed one fails
                        for t in tensors.values():
                            poison(t)
                    before = len(landed)
                    if v == 5:  # every bucket checksummed: directories that wait for copies
                        r.request_checksum()
                    ready.wait(30)
                    results.append(r.wait())
                    counts.append(len(landed) - before)
                    want = allocate(layout)
                    fill_from_canonical(layout, versions[v], want)
                    wrong += [(v, k) for k in want if not torch.equal(
                        tensors[k].view(torch.uint8), want[k].view(torch.uint8))]  # fmt: skip
                in_place = np.concatenate([x[2] for x in r.codec.decoder._landing.values()])
                return wrong, counts, in_place, posted, len(r.codec.group_starts()), results
            finally:
                r.close()

        return body

    bodies = {f"writer-{w}": writer(w) for w in range(n_w)}
    bodies |= {f"reader-{r}": reader(r) for r in range(n_r)}
    out = run_threads(bodies, limit=80)
    for name, result in out.items():
        assert not isinstance(result, BaseException), (name, result)
    for r in range(n_r):
        wrong, counts, in_place, posted, groups, _ = out[f"reader-{r}"]
        assert not wrong, wrong
        # every group as pieces where the sync is all pieces (the counts race with the other
        # reader's thread, so only each reader's own sum is exact)
        mine = [n for name, n in landed if name == f"reader-{r}"]
        assert len(mine) == groups * sum(whole for _, _, whole in plan), (r, len(mine), groups)
        assert in_place.any() and not in_place.all(), in_place  # in place, and staged
        for w in range(n_w):
            sends = [n for peer, n in out[f"writer-{w}"][1] if peer == n_w + r]
            recvs = [n for peer, n in posted if peer == w]
            assert sends and sends == recvs, (w, r)
            assert any(len(n) > 1 for n in sends)  # (pieces posted together)
    assert unstaged and set(unstaged) == {rooms != "none"}, unstaged
    assert roomed and set(roomed) == {rooms == "both"}, roomed  # the readers'
    # announced: the syncs after one where every route changed (4: 98% again, 5: 1%, still
    # sent dense on a guess); 6 is compared again. Readers with rooms posted every receive
    # of each writer's groups at once in those syncs, in the order the writers sent them
    by_writer: dict[str, list[bool]] = {}
    for name, told in said:
        by_writer.setdefault(name, []).append(told)
    told = announce and rooms != "none"  # (a writer without rooms does not announce)
    want = [False, False, False, told, told, False]
    assert len(by_writer) == n_w and all(v == want for v in by_writer.values()), by_writer
    early_by_writer: dict[str, list[int]] = {}
    for name, n in went:
        early_by_writer.setdefault(name, []).append(n)
    want_early = [n_r if w else 0 for w in want]
    assert all(v == want_early for v in early_by_writer.values()), early_by_writer
    eager_per_reader = collections.Counter(eager)
    expected = {f"reader-{r}": 2 * n_w for r in range(n_r)} if told and rooms == "both" else {}
    assert eager_per_reader == expected, (eager_per_reader, expected)
    for name, result in out.items():  # each phase counted once: together within the sync
        for res in result[-1]:
            timed = sum(s for phase, s in res.phases.items() if phase != "plan")
            assert timed <= res.seconds + 1e-3, (name, res.phases, res.seconds)
    sent = [a + b for a, b in zip(out["writer-0"][0], out["writer-1"][0], strict=True)]
    dense = sent[0]
    assert sent[1] < 0.2 * dense and sent[5] < 0.2 * dense, sent  # the sparse ones
    assert all(abs(sent[i] - dense) < 0.01 * dense for i in (2, 3, 4)), sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])  # ue8m0 turns a NaN scale to -0
def test_fp8_non_finite_weights_fail_before_any_byte_moves(scale_format):
    """A NaN in a quantized weight fails the writer's sync naming the tensor and its block,
    before any byte is sent (the check waits until the first bucket is packed): the reader,
    which receives in place, raises naming the writer and still holds the previous version
    bit for bit."""
    from weightbus import BoundLayout, PeerFailure, Reader, Writer
    from weightbus.codecs import Fp8Config
    from weightbus.codecs.fp8 import quantized_layout
    from weightbus.plan import allocate

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fp8 = Fp8Config(bucket_bytes=0, block=16, scale_format=scale_format)
    errors: dict[str, BaseException] = {}
    held: dict[str, dict[str, torch.Tensor]] = {}

    def writer():
        try:
            control, sync = _configs(store.port, "nonfinite", 1, 1, fp8=fp8)
            bound = _tiny_layout("writer")
            bound.tensors["a.weight"].copy_(torch.randn(64, 64))
            side = Writer(bound, control, sync)
            side.connect()
            side.sync(1)
            bound.tensors["a.weight"][37, 50] = float("nan")
            try:
                side.sync(2)
            finally:
                side.close()
        except BaseException as exc:
            errors["writer"] = exc

    def reader():
        try:
            control, sync = _configs(store.port, "nonfinite", 1, 1, fp8=fp8, apply="in_place")
            wire = quantized_layout(_tiny_layout("reader").layout, fp8)
            tensors = allocate(wire)
            side = Reader(BoundLayout(layout=wire, tensors=tensors), control, sync)
            side.connect()
            try:
                side.wait()
                held["v1"] = {k: t.clone() for k, t in tensors.items()}
                side.wait()
            finally:
                held["after"] = tensors
                side.close()
        except BaseException as exc:
            errors["reader"] = exc

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert not any(t.is_alive() for t in threads), errors
    assert isinstance(errors.get("writer"), ValueError), errors
    assert re.search(
        r"writer 'writer-0': a.weight holds NaN or infinite values in FP8 block \(2, 3\)",
        str(errors["writer"]),
    ), errors["writer"]
    assert isinstance(errors.get("reader"), PeerFailure), errors
    assert "writer-0" in str(errors["reader"]) and "NaN" in str(errors["reader"]), errors
    assert set(held["v1"]) == {"a.weight", "a.weight_scale_inv"}, held["v1"].keys()
    for k, before in held["v1"].items():
        after = held["after"][k]
        assert torch.equal(after.view(torch.uint8), before.view(torch.uint8)), k


AHEAD_TENSORS = {"a.weight": (128, 64), "embed.weight": (4096, 256), "lm_head.weight": (4096, 256)}


def _ahead_layout(role: str, rank: int, n_writers: int, fp8=None):
    """``a.weight`` (quantized) and two 2 MiB tensors that stay bf16 (their 1 MiB buckets
    go ahead of the FP8 check); a writer holds its share of rows of each, the reader all."""
    from weightbus import BoundLayout, LayoutBuilder, Participant
    from weightbus.codecs.fp8 import quantized_layout
    from weightbus.plan import allocate
    from weightbus.spec import Box

    b = LayoutBuilder(Participant(role=role, rank=rank))
    for name, (n, m) in AHEAD_TENSORS.items():
        b.add_tensor(name, (n, m), "bfloat16")
        rows = n // n_writers if role == "writer" else n
        lo = rank * rows if role == "writer" else 0
        b.add_local(name, (rows, m), "bfloat16")
        b.add_piece(name, Box((lo, 0), (lo + rows, m)), name, Box.whole((rows, m)))
    layout = b.build()
    if role == "reader":
        layout = quantized_layout(layout, fp8)
    return BoundLayout(layout=layout, tensors=allocate(layout))


def _ahead_values(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {k: torch.randn(shape, generator=g).bfloat16() for k, shape in AHEAD_TENSORS.items()}


def _record_tags(transport, op: str) -> list[tuple[int, int]]:
    """Log (peer, tag) of every ``op`` the transport is asked to post, in order (singly or
    in groups: ``send_many`` / ``recv_many``)."""
    log: list[tuple[int, int]] = []
    post, many = getattr(transport, op), getattr(transport, f"{op}_many")

    def recorded(peer, buf, tag):
        log.append((int(peer), int(tag)))
        return post(peer, buf, tag)

    def recorded_many(peer, items):
        log.extend((int(peer), int(tag)) for _, tag in items)
        return many(peer, items)

    setattr(transport, op, recorded)
    setattr(transport, f"{op}_many", recorded_many)
    return log


def test_fp8_buckets_sent_ahead_are_the_first_ones_without_fp8_content_per_reader():
    from weightbus import SyncConfig
    from weightbus._session import _numbered
    from weightbus.codecs import DeltaConfig, Fp8Config
    from weightbus.plan import build_program, make_plan
    from weightbus.plan.codec_plan import CodecConfig, sent_ahead, wire_layout

    for bad in (-1, 65, True, 2.0):
        with pytest.raises(ValueError, match=r"ahead=.* must be an int in \[0, 64\]"):
            Fp8Config(ahead=bad)
    assert Fp8Config(ahead=2).key() != Fp8Config().key()  # agreed at connect
    for n_writers in (1, 2):
        for ahead in (0, 2, 4, 64):
            fp8 = Fp8Config(bucket_bytes=0, block=16, ahead=ahead)
            codecs = CodecConfig(fp8=fp8)
            writers = [
                wire_layout(_ahead_layout("writer", r, n_writers).layout, codecs)
                for r in range(n_writers)
            ]
            readers = _numbered([_ahead_layout("reader", 0, n_writers, fp8).layout])
            sync = SyncConfig(fp8=fp8, bucket_bytes=1 << 20, direct_bytes=4096)
            plan = make_plan(writers, readers, sync.plan_options())
            got = sent_ahead(plan, codecs)
            plain = [
                op.bucket
                for op in build_program(plan, "reader", 0)
                if all(c.tensor in ("embed.weight", "lm_head.weight") for c in op.copies)
            ]
            assert len(plain) >= 4, plain  # 2 x 2 MiB in buckets of 1 MiB
            assert sorted(got) == plain[:ahead], (n_writers, ahead, got, plain)
            both = CodecConfig(fp8=fp8, delta=DeltaConfig())
            assert sent_ahead(plan, both) == frozenset()  # deltas send groups, not these


def test_fp8_buckets_are_at_least_fp8_bucket_bytes():
    """An FP8 job without deltas plans buckets of at least ``Fp8Config.bucket_bytes`` (each is
    one staged message; fewer larger ones are faster), routes cut to a quarter of that; a
    larger ``SyncConfig.bucket_bytes`` wins, 0 keeps it, deltas keep it; the value is part of
    what both sides agree on, and a bad one is refused naming the fix."""
    from weightbus import SyncConfig
    from weightbus.codecs import DeltaConfig, Fp8Config
    from weightbus.layouts.describe import build_layouts
    from weightbus.layouts.families import model_spec
    from weightbus.plan import make_plan
    from weightbus.plan.codec_plan import wire_layout

    mib = 1 << 20
    opts = SyncConfig(bucket_bytes=64 * mib, fp8=Fp8Config()).plan_options()
    assert (opts.bucket_bytes, opts.route_bytes, opts.direct_bytes) == (
        512 * mib,
        128 * mib,
        512 * mib,
    )
    opts = SyncConfig(bucket_bytes=1024 * mib, fp8=Fp8Config()).plan_options()
    assert opts.bucket_bytes == 1024 * mib
    opts = SyncConfig(bucket_bytes=64 * mib, fp8=Fp8Config(bucket_bytes=0)).plan_options()
    assert (opts.bucket_bytes, opts.route_bytes) == (64 * mib, 16 * mib)
    both = SyncConfig(bucket_bytes=64 * mib, fp8=Fp8Config(), delta=DeltaConfig())
    assert both.plan_options().bucket_bytes == 64 * mib
    assert Fp8Config(bucket_bytes=0).key() != Fp8Config().key()  # agreed at connect
    for bad in (-1, 1000, True, 2.0):
        with pytest.raises(ValueError, match=r"bucket_bytes=.* must be 0 \(SyncConfig"):
            Fp8Config(bucket_bytes=bad)
    # Llama-3-8B, 1 -> 1: 23 buckets (the S6 runs' plan) instead of 181 at the default 64 MiB
    sync = SyncConfig(fp8=Fp8Config())
    model = model_spec("llama-3-8b", dtype="bfloat16")
    ws = [wire_layout(w, sync.codecs()) for w in build_layouts(model, "whole", "writer")]
    rs = [wire_layout(r, sync.codecs()) for r in build_layouts(model, "vllm:tp=1", "reader")]
    assert len(make_plan(ws, rs, sync.plan_options()).buckets) == 23
    small = SyncConfig(fp8=Fp8Config(bucket_bytes=0))
    assert len(make_plan(ws, rs, small.plan_options()).buckets) == 181


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n_writers", [1, 2])
def test_fp8_buckets_sent_ahead_of_the_check_wait_for_it(n_writers, caplog):
    """With FP8, the buckets that need no amax (here of ``embed`` and ``lm_head``) travel
    before the writers' check for non-finite weights, and the reader copies them into its
    tensors only after each writer's word that its weights were finite (written on its
    device after the amax pass). Each link carries them
    first, then the word, then the others, in the same order on both sides; the reader,
    configured with 2 staging buffers, takes 4 to hold them and 2 more, into which it posts
    the next receives before the word comes (each writer holds its word back until it saw
    them posted: a reader without spare buffers would wait for the word). A first sync lands bit exact
    (FP8 values and scales equal to quantizing the whole tensors). With one writer, a NaN
    in the second sync fails it after the buckets ahead were sent, and the in-place reader
    still holds the first version bit for bit."""
    from weightbus import PeerFailure, Reader, WeightbusError, Writer
    from weightbus.codecs import Fp8Config
    from weightbus.codecs.fp8 import quantize_blocks
    from weightbus.plan.codec_plan import checked_tag

    caplog.set_level(logging.INFO, logger="weightbus._session")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fp8 = Fp8Config(bucket_bytes=0, block=16)
    job = f"ahead{n_writers}"
    errors: dict[str, BaseException] = {}
    logs: dict[str, list] = {}
    held: dict[str, dict[str, torch.Tensor]] = {}
    facts: dict[str, object] = {}

    def writer(rank: int):
        name = f"writer-{rank}"
        try:
            control, sync = _configs(store.port, job, 1, n_writers, fp8=fp8)
            bound = _ahead_layout("writer", rank, n_writers)
            side = Writer(bound, control, sync)
            side.connect()
            facts[name] = (side.ahead, len(side.plan.buckets), len(side.ops))
            facts[f"{name} staging"] = len(side._staging)
            logs[name] = _record_tags(side.transport, "send")
            send_passed = side._send_passed

            def hold_word(*args):
                # the first sync's word waits until the reader posted the buckets ahead, the
                # writers' words and two receives more (bounded: a reader that cannot post
                # them before the word never will)
                if f"{name} saw" not in facts:
                    want = 4 + n_writers + 2  # 4 buckets ahead, a word per writer
                    t_end = time.monotonic() + 10
                    while len(logs.get("reader", ())) < want and time.monotonic() < t_end:
                        time.sleep(0.01)
                    facts[f"{name} saw"] = len(logs.get("reader", ()))
                return send_passed(*args)

            side._send_passed = hold_word
            for version in (1, 2):
                for k, v in _ahead_values(version).items():
                    rows = v.shape[0] // n_writers
                    bound.tensors[k].copy_(v[rank * rows : (rank + 1) * rows])
                if version == 2 and n_writers == 1:
                    bound.tensors["a.weight"][37, 50] = float("nan")
                    logs["before 2"] = list(logs[name])
                try:
                    side.sync(version)
                except BaseException:
                    side.close()
                    raise
            side.close()
        except BaseException as exc:
            errors[name] = exc

    def reader():
        try:
            control, sync = _configs(store.port, job, 1, n_writers, fp8=fp8, apply="in_place")
            bound = _ahead_layout("reader", 0, n_writers, fp8)
            side = Reader(bound, control, sync)
            side.connect()
            staged = sum(d is None for d in side.direct)
            facts["reader"] = (side.ahead, len(side._staging), staged)
            logs["reader"] = _record_tags(side.transport, "recv")
            try:
                side.wait()
                held["v1"] = {k: t.clone() for k, t in bound.tensors.items()}
                side.wait()
            finally:
                held["after"] = bound.tensors
                side.close()
        except BaseException as exc:
            errors["reader"] = exc

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(n_writers)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=80)
    assert not any(t.is_alive() for t in threads), errors
    ahead, staging, staged = facts["reader"]
    # the connect line says how much staging each side took
    said = [r.getMessage() for r in caplog.records if "reader-0 connected" in r.getMessage()]
    assert len(said) == 1 and f"staging {staging} x " in said[0], said
    # 4 + 2 buffers, or one per staged bucket where it has fewer (here 5 buckets: a.weight's
    # last one lands in place)
    assert len(ahead) == 4 and staging == min(6, staged) and staged >= 5, facts
    # every writer's word waited for the reader's receives of the next buckets, not longer
    assert all(facts[f"writer-{r} saw"] >= 4 + n_writers + 2 for r in range(n_writers)), facts
    assert set().union(*(facts[f"writer-{r}"][0] for r in range(n_writers))) == ahead, facts
    # a writer keeps its configured buffers: it packs the buckets ahead that fit before the
    # amax pass, the others as sends free them (one writer: 4 buckets ahead, 2 buffers)
    assert all(facts[f"writer-{r} staging"] <= 2 for r in range(n_writers)), facts
    n_buckets = facts["writer-0"][1]
    word = checked_tag(n_buckets)

    # sync 1, bit exact
    v1 = _ahead_values(1)
    for k in ("embed.weight", "lm_head.weight"):
        assert torch.equal(held["v1"][k].view(torch.int16), v1[k].view(torch.int16)), k
    q, s = quantize_blocks(v1["a.weight"], fp8, impl="torch")
    assert torch.equal(held["v1"]["a.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(held["v1"]["a.weight_scale_inv"], s)

    # each link: the buckets ahead, the word, the rest; the reader posts in the same order
    for r in range(n_writers):
        sent = [tag for _, tag in logs[f"writer-{r}"]]
        got = [tag for peer, tag in logs["reader"] if peer == r]
        mine, _, n_ops = facts[f"writer-{r}"]
        per_sync = sent[: n_ops + 1]  # its buckets and the word
        assert set(per_sync[: len(mine)]) == mine and per_sync[len(mine)] == word, (r, sent)
        assert sorted(per_sync[len(mine) + 1 :]) == sorted(set(per_sync) - mine - {word}), sent
        assert got[: len(sent)] == sent[: len(got)], (r, sent, got)

    if n_writers == 2:
        assert not errors, errors
        v2 = _ahead_values(2)
        for k in ("embed.weight", "lm_head.weight"):
            assert torch.equal(held["after"][k].view(torch.int16), v2[k].view(torch.int16)), k
        return
    # sync 2 failed at the check, after its buckets ahead went out: nothing of it landed
    assert isinstance(errors.get("writer-0"), ValueError), errors
    assert "a.weight holds NaN" in str(errors["writer-0"]), errors
    # the reader learns it from the writer's word (-1) or from the writer's failure
    reader_error = errors.get("reader")
    assert isinstance(reader_error, PeerFailure | WeightbusError), errors
    assert "NaN" in str(reader_error), reader_error
    second = [tag for _, tag in logs["writer-0"][len(logs["before 2"]) :]]
    assert second[: len(ahead)] and set(second[: len(ahead)]) == ahead, second
    assert second[len(ahead) :] == [word], second  # the word, and nothing more
    for k, before in held["v1"].items():
        assert torch.equal(held["after"][k].view(torch.uint8), before.view(torch.uint8)), k


@pytest.mark.timeout(90)
def test_a_transactional_fp8_reader_takes_the_buckets_sent_ahead_in_place():
    """A transactional reader receives into its own copy of the engine's tensors, which the
    engine never reads before a commit: the buckets sent ahead of the writer's check land
    there at once (in place, their regions being contiguous), it takes no staging buffers to
    hold them (2 here, as configured, not 4 + 2), and it reads the writer's word before it
    acknowledges. A first sync lands bit exact; a NaN in the second fails it on both sides
    and the engine's tensors still hold the first version bit for bit."""
    from weightbus import PeerFailure, Reader, WeightbusError, Writer
    from weightbus.codecs import Fp8Config
    from weightbus.codecs.fp8 import quantize_blocks
    from weightbus.plan.codec_plan import checked_tag
    from weightbus.plan.program import direct_view

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fp8 = Fp8Config(bucket_bytes=0, block=16)
    errors: dict[str, BaseException] = {}
    facts: dict[str, object] = {}
    held: dict[str, dict[str, torch.Tensor]] = {}
    logs: dict[str, list] = {}

    def writer():
        try:
            control, sync = _configs(store.port, "ahead-tx", 1, 1, fp8=fp8)
            bound = _ahead_layout("writer", 0, 1)
            side = Writer(bound, control, sync)
            side.connect()
            logs["writer"] = _record_tags(side.transport, "send")
            facts["buckets"] = len(side.plan.buckets)
            try:
                for version in (1, 2):
                    for k, v in _ahead_values(version).items():
                        bound.tensors[k].copy_(v)
                    if version == 2:
                        bound.tensors["a.weight"][37, 50] = float("nan")
                    side.sync(version)
            finally:
                side.close()
        except BaseException as exc:
            errors["writer"] = exc

    def reader():
        try:
            control, sync = _configs(store.port, "ahead-tx", 1, 1, fp8=fp8, apply="transactional")
            bound = _ahead_layout("reader", 0, 1, fp8)
            side = Reader(bound, control, sync)
            side.connect()
            ahead = [i for i, op in enumerate(side.ops) if op.bucket in side.ahead]
            facts["reader"] = (side.apply, len(ahead), len(side._staging))
            # in place wherever a bucket is contiguous in the copy (one here holds pieces of
            # two tensors, so it is staged, and applied without waiting for the word)
            facts["in place"] = [side.direct[i] is not None for i in ahead]
            facts["contiguous"] = [
                direct_view(side.ops[i], side.bound.tensors) is not None for i in ahead
            ]
            logs["reader"] = _record_tags(side.transport, "recv")
            try:
                side.wait()
                held["v1"] = {k: t.clone() for k, t in side.live.items()}
                side.wait()
            finally:
                held["after"] = side.live
                facts["dirty"] = side.dirty
                side.close()
        except BaseException as exc:
            errors["reader"] = exc

    run_threads({"writer": writer, "reader": reader}, limit=80)  # (they keep their errors)
    assert facts["reader"] == ("transactional", 4, 2), facts
    assert facts["in place"] == facts["contiguous"] and sum(facts["in place"]) == 3, facts
    v1 = _ahead_values(1)
    for k in ("embed.weight", "lm_head.weight"):
        assert torch.equal(held["v1"][k].view(torch.int16), v1[k].view(torch.int16)), k
    q, s = quantize_blocks(v1["a.weight"], fp8, impl="torch")
    assert torch.equal(held["v1"]["a.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(held["v1"]["a.weight_scale_inv"], s)
    # the reader posted what the writer sent, in its order: the buckets ahead, the word, ...
    word = checked_tag(facts["buckets"])
    sent, got = [t for _, t in logs["writer"]], [t for _, t in logs["reader"]]
    assert word in sent and got[: len(sent)] == sent[: len(got)], (sent, got)
    # sync 2: the writer's check failed after its buckets ahead went out (into the reader's
    # copy); the engine's tensors are untouched
    assert "a.weight holds NaN" in str(errors.get("writer")), errors
    assert isinstance(errors.get("reader"), PeerFailure | WeightbusError), errors
    assert "NaN" in str(errors["reader"]), errors
    assert facts["dirty"] is False, facts
    for k, before in held["v1"].items():
        assert torch.equal(held["after"][k].view(torch.uint8), before.view(torch.uint8)), k


def test_codecs_refuse_pulling_transports_and_auto_skips_them(monkeypatch):
    from weightbus._session import _choose_transport
    from weightbus.codecs import DeltaConfig, Fp8Config
    from weightbus.plan.codec_plan import CodecConfig
    from weightbus.spec import Participant
    from weightbus.transports import base

    class Pulling(base.Transport):
        name = "test-pulling"
        devices = frozenset({"cpu"})
        cross_host = True
        pulls = True
        priority = 100  # above gloo: the automatic choice without codecs

    monkeypatch.setitem(base._REGISTRY, Pulling.name, Pulling)
    monkeypatch.delenv(base.TRANSPORT_ENV, raising=False)
    people = (Participant(role="writer", rank=0), Participant(role="reader", rank=0))
    plan = SimpleNamespace(participants=people)
    plain, fp8 = CodecConfig(), CodecConfig(fp8=Fp8Config())
    assert _choose_transport("auto", plan, plain).transports == ("test-pulling",)
    assert _choose_transport("auto", plan, fp8).transports == ("gloo",)
    delta = CodecConfig(delta=DeltaConfig())
    with pytest.raises(
        ValueError,
        match=r"bf16\+delta need a transport whose writers encode.*"
        r"'test-pulling' pulls.*use transport 'nccl' or 'gloo'",
    ):
        _choose_transport("test-pulling", plan, delta)
    monkeypatch.setenv(base.TRANSPORT_ENV, "test-pulling")
    with pytest.raises(ValueError, match="pulls straight from the writers' tensors"):
        _choose_transport("auto", plan, fp8)


def test_staging_that_does_not_fit_names_its_size_and_the_fix(monkeypatch):
    """Staging buffers that do not fit raise, at connect, an error naming the participant,
    the buffers' count and size and the settings that make them smaller (FP8's own bucket
    size among them where FP8 is on)."""
    from weightbus import WeightbusError
    from weightbus import _session as session
    from weightbus.codecs import DeltaConfig, Fp8Config
    from weightbus.plan.codec_plan import CodecConfig

    real = torch.empty

    def empty(*args, **kwargs):
        if args and args[0] > 1 << 20:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(session.torch, "empty", empty)
    cpu = torch.device("cpu")
    assert [b.numel() for b in session._staging_buffers("w", 2, 1024, cpu, CodecConfig())] == [
        1024,
        1024,
    ]
    with pytest.raises(WeightbusError) as err:
        session._staging_buffers("writer-0", 6, 512 << 20, cpu, CodecConfig(fp8=Fp8Config()))
    msg = str(err.value)
    assert "writer-0: 6 staging buffers of 512.0 MiB (3.00 GiB) do not fit" in msg
    assert "SyncConfig.staging_buffers or bucket_bytes, Fp8Config.bucket_bytes" in msg
    assert "at least 512 MiB" in msg and isinstance(err.value.__cause__, torch.OutOfMemoryError)
    with pytest.raises(WeightbusError, match=r"bucket_bytes, on every participant"):
        session._staging_buffers("reader-0", 2, 64 << 20, cpu, CodecConfig())
    # deltas stage a window's group to one peer whole: the window's size is the fix there
    with pytest.raises(WeightbusError) as err:
        session._staging_buffers(
            "reader-0", 2, 2 << 30, cpu, CodecConfig(delta=DeltaConfig(window_bytes=2 << 30))
        )
    msg = str(err.value)
    assert "reader-0: 2 staging buffers of 2048.0 MiB (4.00 GiB) do not fit" in msg
    assert "or DeltaConfig.window_bytes (2048 MiB: a window's buckets to one peer" in msg


def test_fp8_reader_must_bind_fp8_tensors():
    from weightbus import ControlConfig, LayoutError, Reader, SyncConfig
    from weightbus.codecs import Fp8Config

    sync = SyncConfig(fp8=Fp8Config())
    reader = Reader(_tiny_layout("reader"), ControlConfig(num_writers=1, num_readers=1), sync)
    with pytest.raises(LayoutError, match=r"reader 'reader-0': FP8 is on.*a.weight as bfloat16"):
        reader._wire_layout(sync.codecs())
    with pytest.raises(TypeError, match="fp8=.*must be a weightbus.codecs.Fp8Config"):
        SyncConfig(fp8={"block": 128})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(600)
def test_fp8_and_delta_syncs_over_nccl_between_gpus(tmp_path):
    """S6 and S7 of ``weightbus bench gpu`` on a small model: Writer/Reader over NCCL with FP8
    (equal to the quantization on the GPU, within the bound) and with deltas (bit exact after
    the sparse syncs, and after a dense one into poisoned tensors), also when nothing
    changed between syncs; and the same scenarios as a ``--variant``."""
    import json

    from weightbus.bench import gpu

    args = ["--scenarios", "S6,S7", "--model", "tiny-llama", "--iters", "2", "--warmup", "1"]
    args += ["--bucket-mb", "1", "--fp8-bucket-mb", "0", "--fp8-block", "32"]
    args += ["--out", str(tmp_path), "--kind", "test"]
    # and again as a variant (other buckets, an environment variable), each in one job of its
    # own in this process, compared with its own S1@nccl
    args += ["--variant", "b2: --bucket-mb 2 WEIGHTBUS_AMAX_SMS=0"]
    assert gpu.main(args) == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    by_name = {s["name"]: s for s in result["scenarios"] if "variant" not in s}
    assert set(by_name) == {"S1@nccl", "S6", "S7"}
    varied = {s["name"]: s for s in result["scenarios"] if s.get("variant") == "b2"}
    assert set(varied) == {"S1@nccl", "S6", "S7"} and len(result["scenarios"]) == 6
    assert varied["S6"]["s1_nccl_median_s"] == varied["S1@nccl"]["median_s"]
    assert varied["S6"]["fp8_bucket_mb"] == 2 and by_name["S6"]["fp8_bucket_mb"] == 1
    for s in [*by_name.values(), *varied.values()]:
        assert s["bit_exact"] and s["transport"] == "nccl", s
    assert by_name["S6"]["equal_to_quantization"] and by_name["S6"]["error_over_fp8_bound"] <= 1
    # a tiny model's bf16 embeddings weigh much (llama-3-8b: FP8 bytes ~0.57 of bf16)
    assert by_name["S6"]["wire_fraction_of_s1"] < 0.8 and by_name["S6"]["quantize_gbps"] > 0
    assert by_name["S7"]["exact_before_dense"] and by_name["S7"]["wire_fraction_of_s1"] < 0.5
    # syncs where nothing changed: groups of directories alone, no frames' message over NCCL
    args = ["--scenarios", "S7", "--changed", "0", "--model", "tiny-llama", "--iters", "2"]
    args += ["--warmup", "1", "--bucket-mb", "1", "--out", str(tmp_path / "unchanged")]
    assert gpu.main([*args, "--kind", "test"]) == 0
    result = json.loads(next((tmp_path / "unchanged").glob("*.json")).read_text())
    s7 = next(s for s in result["scenarios"] if s["name"] == "S7")
    assert s7["bit_exact"] and s7["exact_before_dense"] and s7["wire_fraction_of_s1"] < 0.01, s7
