"""The SGLang integration: layouts with SGLang's expert parallel, the custom loader, the driver.

Without SGLang: a stand-in ``sglang.Engine`` (its ``update_weights_from_tensor`` runs the custom
loader on every tensor-parallel worker, as SGLang does) receives syncs from
:class:`~weightbus.engines.sglang.SGLangWeightSync` over gloo, checked bit for bit against the
engine-loader reference. With SGLang installed: the loader resolves through SGLang's own
``dynamic_import``, and (2 GPUs) a real ``sglang.Engine``. Run::

    python -m pytest -q tests/test_engines_sglang.py                 # CPU part; SGLang part skips
    python -m pytest -q -m "engines" tests/test_engines_sglang.py    # with SGLang and 2 GPUs
"""

from __future__ import annotations

import threading
import zlib
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.engine_reference import DATA, EngineRank, engine_rank_params
from weightbus.engines import sglang as ws
from weightbus.errors import WeightbusError
from weightbus.layouts.families import model_spec
from weightbus.plan import allocate, fill_from_canonical
from weightbus.spec import Participant

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "mlp_only_layers": [1],
}


def _canonical(spec, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for t in spec.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) * 100 + version)
        out[t.name] = torch.randn(t.shape, generator=g)
    return out


def test_parallel_settings_follow_sglang() -> None:
    p = ws.SGLangParallel(tp=8, tp_rank=5, ep=2)
    assert p.moe() == {"ep": 2, "ep_rank": 1, "moe_tp": 4, "moe_tp_rank": 1}
    with pytest.raises(ValueError, match="ep=3 must be a positive divisor of tp=8"):
        ws.SGLangParallel(tp=8, tp_rank=0, ep=3)
    spec = model_spec({**QWEN3_MOE, "num_experts": 6})
    with pytest.raises(ValueError, match="6 experts do not split evenly over ep=4"):
        ws.sglang_layout(spec, Participant(role="reader", rank=0), ws.SGLangParallel(tp=4, ep=4))


def test_loader_refuses_weights_and_versions_before_init() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(WeightbusError, match="takes only 'weightbus.init' and 'weightbus.version'"):
        ws.receive(model, [("model.embed_tokens.weight", torch.zeros(2))])
    with pytest.raises(WeightbusError, match="a version before the job's init info"):
        ws.receive(model, [("weightbus.version", torch.tensor([1]))])


class _Engine:
    """A stand-in ``sglang.Engine``: ``update_weights_from_tensor`` runs the named custom loader
    on every tensor-parallel worker at once and returns when all are done."""

    def __init__(self, tp: int, ep: int, local: threading.local) -> None:
        self.server_args = SimpleNamespace(
            tp_size=tp, dp_size=1, ep_size=ep, custom_weight_loader=[ws.LOADER]
        )
        spec = model_spec(QWEN3_MOE)
        self.workers = []
        for r in range(tp):
            parallel = ws.SGLangParallel(tp=tp, tp_rank=r, ep=ep)
            layout = ws.sglang_layout(spec, Participant(role="reader", rank=0), parallel)
            model = nn.Module()
            for local_tensor in layout.locals:
                *path, leaf = local_tensor.key.split(".")
                module = model
                for part in path:
                    if not hasattr(module, part):
                        module.add_module(part, nn.Module())
                    module = getattr(module, part)
                data = torch.full(local_tensor.shape, float("nan"), dtype=torch.bfloat16)
                module.register_parameter(leaf, nn.Parameter(data, requires_grad=False))
            model.config = dict(QWEN3_MOE)
            self.workers.append((model, parallel))
        self.local = local
        self.versions: list[str] = []

    def update_weights_from_tensor(
        self, named_tensors, load_format=None, flush_cache=True, weight_version=None
    ):
        assert load_format in self.server_args.custom_weight_loader
        errors = []

        def run(model, parallel):
            self.local.parallel = parallel
            try:
                if dict(named_tensors).get("weightbus.version") is not None:
                    for p in model.parameters():
                        p.data.fill_(float("nan"))  # every sync must write everything
                ws.receive(model, list(named_tensors))
            except BaseException as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=run, args=w) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            return False, "; ".join(errors)
        if weight_version is not None:
            self.versions.append(weight_version)
        return True, "Success"


@pytest.mark.timeout(120)
def test_driver_syncs_a_stand_in_sglang_engine_bit_exact(monkeypatch) -> None:
    from weightbus import BoundLayout, ControlConfig, SyncConfig
    from weightbus.layouts.fsdp import fsdp_layout

    local = threading.local()
    monkeypatch.setattr(ws, "_parallel_here", lambda: local.parallel)
    engine = _Engine(tp=2, ep=2, local=local)
    spec = model_spec(QWEN3_MOE)
    layout = fsdp_layout(
        spec, Participant(role="writer", rank=0), shard=1, shard_rank=0, dtype="float32"
    )
    tensors = allocate(layout, poisoned=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    control = ControlConfig(
        num_writers=1,
        num_readers=2,
        address=f"127.0.0.1:{store.port}",
        host_store=False,
        job="sglang-test",
        timeout=timedelta(seconds=60),
    )
    sync = SyncConfig(
        cast={"float32": "bfloat16"},
        bucket_bytes=1 << 20,
        transport="gloo",
        sync_timeout=timedelta(seconds=60),
    )
    driver = ws.SGLangWeightSync(
        BoundLayout(layout=layout, tensors=tensors), control, sync, engines=[engine]
    )
    try:
        driver.connect()
        for version in (1, 2):
            canon = _canonical(spec, version)
            fill_from_canonical(layout, canon, tensors)
            assert driver.sync(version).version == version
            for model, parallel in engine.workers:
                rank = EngineRank(engine="sglang", tp=2, tp_rank=parallel.tp_rank, ep=2)
                want, masks = engine_rank_params(QWEN3_MOE, canon, rank, torch.bfloat16)
                params = dict(model.named_parameters())
                assert set(params) == set(want)
                for key, tensor in want.items():
                    data = masks[key] == DATA
                    got = params[key].data.view(torch.int16)[data]
                    assert torch.equal(got, tensor.view(torch.int16)[data]), (version, key)
        assert engine.versions == ["1", "2"]
    finally:
        for model, _ in engine.workers:
            receiver = ws._RECEIVERS.pop(id(model), None)
            if receiver is not None:
                receiver.close()
        driver.close()


# -- with SGLang ------------------------------------------------------------------------------


def test_sglang_resolves_the_loader() -> None:
    pytest.importorskip("sglang", reason="SGLang is not installed (the CPU CI cannot install it)")
    try:
        from sglang.srt.utils import dynamic_import
    except ImportError:
        pytest.skip("this SGLang has no dynamic_import; custom weight loaders are unsupported")
    assert dynamic_import(ws.LOADER) is ws.receive


@pytest.mark.engines
@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_real_sglang_engine_receives_in_place(tmp_path) -> None:
    """A tiny Qwen3-MoE served by ``sglang.Engine`` on GPU 0; the writer on GPU 1 (NCCL). The
    engine's embedding, read back through SGLang, equals what the writer sent."""
    sglang = pytest.importorskip("sglang", reason="SGLang is not installed")
    transformers = pytest.importorskip("transformers")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the engine on one, the writer on the other)")
    from weightbus import BoundLayout, ControlConfig, SyncConfig
    from weightbus.layouts.fsdp import fsdp_layout

    config = dict(QWEN3_MOE)
    model_type = config.pop("model_type")
    hf = transformers.AutoConfig.for_model(model_type, torch_dtype="bfloat16", **config)
    transformers.AutoModelForCausalLM.from_config(hf).to(torch.bfloat16).save_pretrained(tmp_path)
    engine = sglang.Engine(
        model_path=str(tmp_path),
        skip_tokenizer_init=True,
        base_gpu_id=0,
        mem_fraction_static=0.2,
        custom_weight_loader=[ws.LOADER],
    )
    spec = model_spec(QWEN3_MOE)
    layout = fsdp_layout(
        spec, Participant(role="writer", rank=0, device="cuda:1"), shard=1, shard_rank=0
    )
    tensors = {k: v.to("cuda:1") for k, v in allocate(layout, poisoned=False).items()}
    control = ControlConfig(num_writers=1, num_readers=1, address="127.0.0.1:29782")
    driver = ws.SGLangWeightSync(
        BoundLayout(layout=layout, tensors=tensors),
        control,
        SyncConfig(transport="nccl"),
        engines=[engine],
    )
    try:
        driver.connect()
        for version in (1, 2):
            canon = {k: v.to(torch.bfloat16) for k, v in _canonical(spec, version).items()}
            fill_from_canonical(layout, canon, tensors)
            driver.sync(version)
            # SGLang's own read-back: the embedding rows, as the engine holds them
            want = canon["model.embed_tokens.weight"].flatten()
            got = engine.get_weights_by_name("model.embed_tokens.weight", want.numel())
            got = torch.as_tensor(got).flatten().to(torch.bfloat16)
            assert got.numel() > 0 and torch.equal(got, want[: got.numel()]), version
    finally:
        driver.close()
        engine.shutdown()
