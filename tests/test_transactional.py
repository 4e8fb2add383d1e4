"""Transactional and in-place readers (``SyncConfig.apply``) when a sync fails part way.

* a sync that fails mid-way (the link breaks after some buckets, or a flipped byte fails the
  checksum) leaves a transactional reader's engine tensors bit-identical to the previous
  version and its version unchanged; over a pulling transport too;
* the same failure leaves an in-place reader dirty (with deltas, it will be sent every byte);
  the next sync, by new participants on the same engine tensors, heals it bit for bit;
* a writer killed with SIGKILL mid-sync (a real process): both readers raise within
  ``heartbeat_timeout`` + 5 s naming it; the transactional one keeps the previous version,
  the in-place one is dirty;
* ``apply="auto"`` picks in place when memory is short.

Participants are threads of this process (the killed writer excepted); the test transports
come from ``tests/test_verify.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.test_verify import (
    MODEL,
    canonical,
    configs,
    expected,
    reader_bound,
    run_threads,
    same_bits,
    writer_body,
    writer_bound,
)

pytestmark = pytest.mark.faults


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s


def _failing_job(store, job: str, *, fault: str, applies: tuple[str, str], **sync):
    """1 writer, 2 readers (tensor parallel) with ``apply`` each; sync 1 goes through, sync 2
    fails on reader-0 (``fault``: "link" breaks after 3 buckets, or "flip" a byte). Returns
    the outcomes and, per reader, its bound layout and Reader."""
    from weightbus import Reader
    from weightbus.layouts.families import model_spec

    model = model_spec(MODEL)
    readers: dict = {}
    transport = sync.pop("transport", "test-gloo-flip")

    def reader(rank):
        def body():
            bound = reader_bound(model, rank, 2)
            control, config = configs(
                store.port, 1, 2, job, transport=transport, apply=applies[rank], **sync
            )
            reader = Reader(bound, control, config)
            readers[rank] = (bound, reader)
            reader.connect()
            try:
                reader.wait()
                if rank == 0 and fault == "link":
                    reader.transport.fail_after = 3
                elif rank == 0:
                    op = reader.ops[len(reader.ops) // 2]
                    reader.transport.arm(op.bucket, op.copies[0].offset)
                return reader.wait()
            finally:
                reader.close()

        return body

    bodies = {f"reader-{r}": reader(r) for r in range(2)}
    bodies["writer-0"] = writer_body(
        model, store.port, 0, 1, 2, job, [1, 2], transport=transport, **sync
    )
    return run_threads(bodies), readers, model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["link", "flip"])
@pytest.mark.parametrize("faulty", ["transactional", "in_place"])
def test_failed_sync_keeps_transactional_and_flags_in_place(store, fault, faulty):
    """reader-0 meets the fault; reader-1, the other mode, hears of it from the writer."""
    from weightbus import PeerFailure

    other = "in_place" if faulty == "transactional" else "transactional"
    out, readers, model = _failing_job(
        store, f"fail-{fault}-{faulty}", fault=fault, applies=(faulty, other)
    )
    assert isinstance(out["writer-0"], PeerFailure), out
    for rank in (0, 1):
        assert isinstance(out[f"reader-{rank}"], Exception), out
    for bound, reader in readers.values():
        assert reader.version == 1
        if reader.apply == "transactional":
            # the engine's tensors hold version 1, bit for bit
            assert not reader.dirty
            assert same_bits(reader.live, expected(bound, model, 1)) == []
            assert reader.live is bound.tensors and reader.bound.tensors is not bound.tensors
        else:
            assert reader.apply == "in_place" and reader.dirty
            assert reader.bound.tensors is bound.tensors
    if fault == "flip" and faulty == "in_place":
        # every byte of version 2 landed before the checksum failed it
        bound, _ = readers[0]
        assert same_bits(bound.tensors, expected(bound, model, 1)) != []


# a Llama of ~7 MB in bfloat16: with a codec on, routes under bucket_bytes (1 MiB here) share
# buckets, and each tensor-parallel reader of this model still takes several
SEVERAL_BUCKETS = {
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.timeout(60)
def test_in_place_reader_is_dirty_and_the_next_sync_heals_it(store):
    """Deltas on: sync 2 fails on reader-0 after bytes landed. Its codec then claims nothing
    (so no writer sends it a delta), it says it is dirty, and the same participants' next sync
    (a new membership epoch) sends it every byte, bit for bit."""
    from weightbus import Reader, Writer
    from weightbus.codecs import DeltaConfig
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    model = model_spec(SEVERAL_BUCKETS)
    # windows of one bucket: each bucket's directory travels alone, so one mid-sync can fail
    delta = DeltaConfig(window_bytes=1)
    state: dict = {}

    def reader(rank):
        def body():
            bound = reader_bound(model, rank, 2)
            control, config = configs(
                store.port, 1, 2, "heal", transport="test-gloo-flip", apply="in_place", delta=delta
            )
            with Reader(bound, control, config) as reader:
                reader.wait()
                if rank == 0:
                    assert len(reader.ops) >= 3, len(reader.ops)  # some land before the fault
                    op = reader.ops[len(reader.ops) // 2]  # its directory: decoding fails
                    reader.transport.arm(op.bucket, 0)
                try:
                    reader.wait()
                except Exception as exc:
                    state[rank] = (exc, reader.dirty, reader.codec.version)
                    state[f"mixed-{rank}"] = [
                        same_bits(bound.tensors, expected(bound, model, v)) != [] for v in (1, 2)
                    ]
                result = reader.wait()
                payload = sum(c.nbytes for op in reader.ops for c in op.copies)
                wrong = same_bits(bound.tensors, expected(bound, model, 2))
                return result, reader.dirty, wrong, payload

        return body

    def writer():
        bound = writer_bound(model, 0, 1)
        control, config = configs(store.port, 1, 2, "heal", transport="test-gloo-flip", delta=delta)
        with Writer(bound, control, config) as writer:
            out = []
            # version 3 holds the values of version 2: a delta against 2 would be empty
            for v, values in ((1, 1), (2, 2), (3, 2)):
                fill_from_canonical(bound.layout, canonical(model, values), bound.tensors)
                try:
                    out.append(writer.sync(v))
                except Exception as exc:
                    out.append(exc)
            return out

    out = run_threads({"reader-0": reader(0), "reader-1": reader(1), "writer": writer})
    for name, result in out.items():
        assert not isinstance(result, BaseException), (name, result)
    exc, dirty, held = state[0]
    assert dirty and held is None, state  # dirty, and its codec holds nothing usable
    assert state["mixed-0"] == [True, True]  # neither version 1 nor 2: some of 2 landed
    for rank in (0, 1):
        result, dirty, wrong, _ = out[f"reader-{rank}"]
        assert result.version == 3 and not dirty and wrong == [], (rank, result, wrong)
    assert isinstance(out["writer"][1], Exception)
    # the dirty reader was sent every byte of version 3, not an (empty) delta against 2
    result, _, _, payload = out["reader-0"]
    assert result.bytes >= payload, (result.bytes, payload)


@pytest.mark.timeout(60)
def test_transactional_reader_over_a_pulling_transport_keeps_its_version(store):
    out, readers, model = _failing_job(
        store,
        "pull",
        fault="flip",
        applies=("transactional", "transactional"),
        transport="test-local-pull",
    )
    for rank in (0, 1):
        bound, reader = readers[rank]
        assert isinstance(out[f"reader-{rank}"], Exception), out
        assert reader.version == 1 and not reader.dirty
        assert same_bits(bound.tensors, expected(bound, model, 1)) == []


@pytest.mark.timeout(60)
def test_transactional_commits_only_at_the_end_and_keeps_engine_tensors(store):
    """Between syncs the engine's tensors hold exactly the last committed version; they are
    never replaced (same storage), and the sync writes only the reader's copy."""
    from weightbus import Reader
    from weightbus.layouts.families import model_spec

    model = model_spec(MODEL)
    seen = []

    def reader():
        bound = reader_bound(model, 0, 1)
        ptrs = {k: t.data_ptr() for k, t in bound.tensors.items()}
        control, config = configs(store.port, 1, 1, "commit", apply="transactional")
        reader = Reader(bound, control, config)

        def on_version(result):
            seen.append(same_bits(bound.tensors, expected(bound, model, result.version)))

        reader.on_version = on_version
        with reader:
            for _ in range(3):
                reader.wait()
            moved = [k for k, t in bound.tensors.items() if t.data_ptr() != ptrs[k]]
            return reader.version, moved

    out = run_threads(
        {"reader": reader, "writer": writer_body(model, store.port, 0, 1, 1, "commit", [1, 2, 3])}
    )
    assert out["reader"] == (3, []), out
    assert seen == [[], [], []]


def test_auto_is_in_place_when_memory_is_short(monkeypatch):
    import weightbus.reader as reader_mod
    from weightbus import ControlConfig, Reader, SyncConfig
    from weightbus.layouts.families import model_spec

    bound = reader_bound(model_spec(MODEL), 0, 1)
    need = sum(t.numel() * t.element_size() for t in bound.tensors.values())
    reader = Reader(bound, ControlConfig(num_writers=1, num_readers=1), SyncConfig())
    assert reader_mod._free_memory(torch.device("cpu")) > 0
    monkeypatch.setattr(reader_mod, "_free_memory", lambda device: 2 * need - 1)
    assert reader._choose_apply() == "in_place"
    monkeypatch.setattr(reader_mod, "_free_memory", lambda device: 2 * need)
    assert reader._choose_apply() == "transactional"
    monkeypatch.setattr(reader_mod, "_free_memory", lambda device: 0)
    assert reader._choose_apply() == "in_place"
    with pytest.raises(ValueError, match="apply='copy' must be 'auto', 'transactional'"):
        SyncConfig(apply="copy")
    with pytest.raises(ValueError, match="verify='sha' must be 'checksum'"):
        SyncConfig(verify="sha")


# ---------------------------------------------------------------------------------------------
# a writer killed with SIGKILL mid-sync
# ---------------------------------------------------------------------------------------------


def _killed_writer(port: int) -> None:
    """Writer of 2 readers: sync 1 whole; in sync 2, once half its buckets went out, it notes
    the time in the store and kills itself with SIGKILL."""
    from weightbus import Writer
    from weightbus.layouts.families import model_spec
    from weightbus.plan import fill_from_canonical

    torch.set_num_threads(1)
    model = model_spec(MODEL)
    bound = writer_bound(model, 0, 1)
    control, config = configs(port, 1, 2, "sigkill")
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    writer = Writer(bound, control, config)
    writer.connect()
    fill_from_canonical(bound.layout, canonical(model, 1), bound.tensors)
    writer.sync(1)
    fill_from_canonical(bound.layout, canonical(model, 2), bound.tensors)

    def progress(done: int, total: int) -> None:
        if done >= total // 2:
            time.sleep(0.3)  # the buckets posted so far land
            store.set("test/killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    writer.sync(2, progress=progress)


@pytest.mark.timeout(90)
def test_writer_killed_mid_sync_readers_raise_naming_it_and_keep_or_flag(store):
    from weightbus import PeerFailure, Reader
    from weightbus.layouts.families import model_spec

    model = model_spec(MODEL)
    proc = mp.get_context("spawn").Process(target=_killed_writer, args=(store.port,))
    proc.start()
    readers: dict = {}

    def reader(rank, apply):
        def body():
            bound = reader_bound(model, rank, 2)
            control, config = configs(store.port, 1, 2, "sigkill", transport="gloo", apply=apply)
            reader = Reader(bound, control, config)
            readers[rank] = (bound, reader)
            with reader:
                reader.wait()
                try:
                    reader.wait()
                except Exception as exc:
                    return exc, time.time()
                return None, time.time()

        return body

    try:
        out = run_threads(
            {"transactional": reader(0, "transactional"), "in_place": reader(1, "in_place")},
            limit=60,
        )
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    killed_at = float(store.get("test/killed_at"))
    _, config = configs(store.port, 1, 2, "sigkill")
    limit = 2.0 + 5.0  # heartbeat_timeout (2 s in configs()) + 5 s
    for name, (err, at) in out.items():
        assert isinstance(err, PeerFailure), (name, err)
        assert "writer-0" in str(err).splitlines()[0], (name, err)
        assert at - killed_at < limit, (name, at - killed_at, err)
    bound, reader = readers[0]
    assert reader.version == 1 and not reader.dirty
    assert same_bits(reader.live, expected(bound, model, 1)) == []
    bound, reader = readers[1]
    assert reader.version == 1 and reader.dirty
    assert same_bits(bound.tensors, expected(bound, model, 1)) != []


_ODD_BITS = {
    # NaN payloads of both signs, signed zeros, an infinity, a subnormal
    torch.bfloat16: (torch.int16, [0x7F8E, -0x3F, -0x8000, 0x7F81, 0x7F80, 0x0001]),
    torch.float16: (torch.int16, [0x7C01, -0x1FD, -0x8000, 0x7E03, 0x7C00, 0x0001]),
    torch.float32: (torch.int32, [0x7F800001, -0x3FFFFD, -(2**31), 0x7FC00003, 1, 5]),
    torch.float8_e4m3fn: (torch.uint8, [0x7F, 0xFF, 0x80, 0x01, 0x7E, 0x08]),
    torch.int64: (torch.int64, [-1, 2**62, -(2**63), 0, 7, 3]),
}


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_a_commit_copies_every_bit_nan_payloads_and_signed_zeros_included(device):
    """The transactional commit copies the verified tensors into the engine's byte for byte:
    torch's multi-tensor copy of floating tensors on CUDA goes through float32, which would
    turn every NaN payload into one NaN; contiguous and strided tensors alike."""
    from weightbus.reader import copy_bits

    src, dst, want = [], [], []
    for dtype, (ints, values) in _ODD_BITS.items():
        raw = torch.tensor(values * 4, dtype=ints, device=device).reshape(4, len(values))
        for x in (raw, raw.t()[1:]):  # contiguous, and a strided view
            s = x.view(dtype)
            d = torch.full_like(x, 3).view(dtype)
            src.append(s)
            dst.append(d)
            want.append(s.view(ints).clone())
    copy_bits(dst, src)
    for d, w, s in zip(dst, want, src, strict=True):
        got = d.view(w.dtype)
        assert torch.equal(got, w), (s.dtype, got.tolist(), w.tolist())
