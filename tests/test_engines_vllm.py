"""The vLLM integration: binding engine parameters, the backend lifecycle, the trainer driver.

Without vLLM: :func:`~weightbus.engines.vllm.bind` on stand-in engine models, the MLA refresh,
and an end-to-end run over gloo in which stand-in vLLM servers (the RLHF HTTP routes served by
this file, calling weightbus' backend class) receive syncs driven by
:class:`~weightbus.engines.vllm.VLLMWeightSync`, checked bit for bit against the engine-loader
reference. With vLLM installed: plugin registration, and (2 GPUs) a real ``vllm.LLM``. Run::

    python -m pytest -q tests/test_engines_vllm.py                 # CPU part; vLLM part skips
    python -m pytest -q -m "engines" tests/test_engines_vllm.py    # with vLLM and 2 GPUs
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import threading
import time
import traceback
import zlib
from dataclasses import asdict
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.engine_reference import DATA, EngineRank, engine_rank_params
from weightbus.engines import vllm as wv
from weightbus.layouts.families import model_spec
from weightbus.plan import allocate, fill_from_canonical
from weightbus.spec import LayoutError, Participant

LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 4,
}
STEPS = 3


def _canonical(spec, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for t in spec.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) * 100 + version)
        out[t.name] = torch.randn(t.shape, generator=g)
    return out


def _fake_engine(layout, attrs: dict | None = None) -> nn.Module:
    """An nn.Module whose parameters are the layout's local tensors (poisoned), nested by name
    as vLLM nests them; ``attrs`` sets attributes on submodules (``{module name: {...}}``)."""
    root = nn.Module()
    for local in layout.locals:
        *path, leaf = local.key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        data = torch.full(local.shape, float("nan"), dtype=getattr(torch, local.dtype))
        module.register_parameter(leaf, nn.Parameter(data, requires_grad=False))
    for name, values in (attrs or {}).items():
        for k, v in values.items():
            setattr(root.get_submodule(name), k, v)
    return root


def _llama_layout(tp: int = 2, tp_rank: int = 0):
    spec = model_spec(LLAMA)
    who = Participant(role="reader", rank=0)
    return spec, wv.vllm_layout(spec, who, wv.VLLMParallel(tp=tp, tp_rank=tp_rank))


# -- bind ---------------------------------------------------------------------------------------


def test_bind_ties_every_parameter_in_place() -> None:
    spec, layout = _llama_layout()
    model = _fake_engine(layout)
    bound = wv.bind(model, layout)
    params = dict(model.named_parameters())
    assert set(bound.tensors) == {x.key for x in layout.locals}
    for key, tensor in bound.tensors.items():
        assert tensor.data_ptr() == params[key].data_ptr()


def test_bind_refuses_missing_extra_and_misshaped_parameters() -> None:
    spec, layout = _llama_layout()
    model = _fake_engine(layout)
    extra = _fake_engine(layout)
    extra.model.add_module("adapter", nn.Linear(2, 2))
    with pytest.raises(LayoutError, match=r"2 engine parameters are in no weightbus piece"):
        wv.bind(extra, layout)
    wv.bind(extra, layout, ignore=["model.adapter.weight", "model.adapter.bias"])

    _, other = _llama_layout(tp=4)
    with pytest.raises(
        LayoutError,
        match=r"embed_tokens.weight' is \(64, 32\) bfloat16, the layout says \(32, 32\)",
    ):
        wv.bind(model, other)

    wrapped = nn.Module()
    wrapped.add_module("language_model", model)
    with pytest.raises(LayoutError, match="no parameter 'model.embed_tokens.weight'.*prefix="):
        wv.bind(wrapped, layout)
    wv.bind(wrapped, layout, prefix="language_model.")


def test_bind_checks_the_engine_layers_own_sharding() -> None:
    spec, layout = _llama_layout(tp=4, tp_rank=1)
    parallel = wv.VLLMParallel(tp=4, tp_rank=1)
    qkv = "model.layers.0.self_attn.qkv_proj"
    good = {qkv: {"tp_size": 4, "tp_rank": 1, "num_kv_head_replicas": 2, "num_kv_heads": 1}}
    wv.bind(_fake_engine(layout, good), layout, spec=spec, parallel=parallel.checks())
    bad = {qkv: {"tp_size": 4, "tp_rank": 1, "num_kv_head_replicas": 1}}
    with pytest.raises(LayoutError, match="num_kv_head_replicas=1, the weightbus layout assumed 2"):
        wv.bind(_fake_engine(layout, bad), layout, spec=spec, parallel=parallel.checks())
    embed = {"model.embed_tokens": {"tp_size": 4, "padding_size": 128}}
    with pytest.raises(LayoutError, match="padding_size=128, the weightbus layout assumed 64"):
        wv.bind(_fake_engine(layout, embed), layout, spec=spec, parallel=parallel.checks())


def test_bind_checks_the_expert_map() -> None:
    config = {
        **LLAMA,
        "model_type": "qwen3_moe",
        "num_attention_heads": 4,
        "num_experts": 8,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
    }
    spec = model_spec(config)
    parallel = wv.VLLMParallel(tp=2, tp_rank=1, enable_expert_parallel=True)
    layout = wv.vllm_layout(spec, Participant(role="reader", rank=0), parallel)
    experts = "model.layers.0.mlp.experts"
    right = [-1, -1, -1, -1, 0, 1, 2, 3]
    fine = {experts: {"expert_map": torch.tensor(right), "local_num_experts": 4}}
    wv.bind(_fake_engine(layout, fine), layout, spec=spec, parallel=parallel.checks())
    swapped = {experts: {"expert_map": torch.tensor(right[4:] + right[:4])}}
    with pytest.raises(LayoutError, match="expert_map="):
        wv.bind(_fake_engine(layout, swapped), layout, spec=spec, parallel=parallel.checks())


def test_bind_refuses_quantized_models_naming_the_gap() -> None:
    _, layout = _llama_layout()
    model = _fake_engine(layout)

    class Fp8LinearMethod:
        pass

    model.get_submodule("model.layers.0.self_attn.qkv_proj").quant_method = Fp8LinearMethod()
    with pytest.raises(NotImplementedError, match="qkv_proj.*Fp8LinearMethod.*FP8 codec"):
        wv.bind(model, layout)


# -- MLA ------------------------------------------------------------------------------------


def test_refresh_derived_recomputes_mla_tensors_in_place() -> None:
    heads, nope, v, kv_lora = 2, 4, 3, 5
    holder = nn.Module()
    holder.kv_b_proj = nn.Linear(kv_lora, heads * (nope + v), bias=False)

    def derive(weight):  # vLLM's process_weights_after_loading for MLA, restated
        w = weight.T.view(kv_lora, heads, nope + v)
        uk, uv = w.split([nope, v], dim=-1)
        return uv.transpose(0, 1).contiguous(), uk.permute(1, 2, 0).contiguous()

    holder.W_UV, holder.W_UK_T = derive(holder.kv_b_proj.weight.detach())
    ptrs = holder.W_UV.data_ptr(), holder.W_UK_T.data_ptr()
    with torch.no_grad():
        holder.kv_b_proj.weight.copy_(torch.randn_like(holder.kv_b_proj.weight))
        root = nn.Module()
        root.add_module("attn", holder)
        assert wv.refresh_derived(root) == 1
    want_uv, want_uk_t = derive(holder.kv_b_proj.weight.detach())
    assert torch.equal(holder.W_UV, want_uv) and torch.equal(holder.W_UK_T, want_uk_t)
    assert (holder.W_UV.data_ptr(), holder.W_UK_T.data_ptr()) == ptrs


# -- init info, registration -----------------------------------------------------------------


def test_init_info_carries_the_writers_sync_settings_as_json() -> None:
    from weightbus import ControlConfig, SyncConfig

    control = ControlConfig(num_writers=2, num_readers=3, address="10.0.0.1:29700", job="rl")
    sync = SyncConfig(cast={"float32": "bfloat16"}, bucket_bytes=8 << 20, transport="nccl")
    info = wv.InitInfo.from_configs(control, sync, reader_rank_offset=2)
    again = wv.InitInfo(**json.loads(json.dumps(asdict(info))))
    c2, s2 = again.configs()
    assert (c2.address, c2.num_writers, c2.num_readers, c2.job) == ("10.0.0.1:29700", 2, 3, "rl")
    assert s2.plan_options().key() == sync.plan_options().key()
    assert s2.transport == "nccl" and s2.sync_timeout == sync.sync_timeout
    with pytest.raises(ValueError, match="reader_rank_offset=3 must be in"):
        wv.InitInfo.from_configs(control, sync, reader_rank_offset=3)


def test_register_without_vllm_does_nothing() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        wv.register()  # no vLLM: a debug log, no error
    else:
        pytest.skip("vLLM is installed: see test_plugin_registers_the_backend_with_vllm")


# -- end to end over gloo, through the HTTP routes -------------------------------------------


class _Backend(wv._Backend):
    """weightbus' backend class as vLLM would create it, with the spec and parallel ranks
    given instead of read from vLLM's config."""

    def __init__(self, model, parallel):
        super().__init__(None, None, "cpu", model)
        self.parallel = parallel

    def _make_receiver(self):
        return wv.Receiver(self.model, model_spec(LLAMA), self.parallel, "cpu")


def _server(tp: int, q, port_q) -> None:
    """A stand-in vLLM server of ``tp`` workers (threads) serving the RLHF routes."""
    try:
        torch.set_num_threads(1)
        spec = model_spec(LLAMA)
        workers = []
        for r in range(tp):
            parallel = wv.VLLMParallel(tp=tp, tp_rank=r)
            layout = wv.vllm_layout(spec, Participant(role="reader", rank=0), parallel)
            workers.append((_Backend(_fake_engine(layout), parallel), parallel))
        calls, bad, done = [], [], threading.Event()

        def each(fn):  # like collective_rpc: every worker at once, wait for all
            errors = []

            def run(w):
                try:
                    fn(w)
                except BaseException as e:  # noqa: BLE001
                    errors.append(f"{type(e).__name__}: {e}")

            threads = [threading.Thread(target=run, args=(w,)) for w in workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise RuntimeError("; ".join(errors))

        def check(version: int) -> None:
            canon = _canonical(spec, version)
            for backend, parallel in workers:
                rank = EngineRank(tp=tp, tp_rank=parallel.tp_rank)
                want, masks = engine_rank_params(LLAMA, canon, rank, torch.bfloat16)
                for key, tensor in backend.receiver.reader.bound.tensors.items():
                    data = masks[key] == DATA
                    a = tensor.view(torch.int16)[data]
                    b = want[key].view(torch.int16)[data]
                    if not torch.equal(a, b):
                        bad.append((version, parallel.tp_rank, key))

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                calls.append(self.path)
                self._reply(200, {"world_size": tp})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                path = self.path.split("?")[0]
                calls.append(self.path)
                try:
                    if path == "/init_weight_transfer_engine":
                        each(
                            lambda w: w[0].init_transfer_engine(
                                w[0].parse_init_info(body["init_info"])
                            )
                        )
                    elif path == "/start_weight_update":
                        for backend, _ in workers:
                            backend.start_weight_update()
                            for t in backend.receiver.reader.bound.tensors.values():
                                t.fill_(float("nan"))  # every sync must write everything
                    elif path == "/update_weights":
                        each(lambda w: w[0].update_weights(body["update_info"]))
                    elif path == "/finish_weight_update":
                        each(lambda w: w[0].finish_weight_update())
                        check(int(body["weight_version"]))
                        if int(body["weight_version"]) == STEPS:
                            done.set()
                    elif path not in ("/pause", "/resume"):
                        return self._reply(404, {"detail": "no route"})
                except Exception as e:  # noqa: BLE001
                    return self._reply(500, {"detail": f"{type(e).__name__}: {e}"})
                self._reply(200, {})

        http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        port_q.put(http.server_address[1])
        if not done.wait(120):
            bad.append("the trainer never finished")
        for backend, _ in workers:
            backend.shutdown()
        http.shutdown()
        expected = ["/get_world_size?include_dp=true", "/init_weight_transfer_engine"]
        expected += [
            p
            for _ in range(STEPS)
            for p in (
                "/pause?mode=wait",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/resume",
            )
        ]
        if calls != expected:
            bad.append(f"routes called {calls}")
        q.put((f"server-tp{tp}", "ok" if not bad else "wrong", str(bad[:5])))
    except BaseException as exc:
        q.put((f"server-tp{tp}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def _trainer(rank: int, port: int, urls: list[str], q) -> None:
    try:
        from weightbus import BoundLayout, ControlConfig, SyncConfig
        from weightbus.layouts.fsdp import fsdp_layout

        torch.set_num_threads(1)
        spec = model_spec(LLAMA)
        layout = fsdp_layout(
            spec, Participant(role="writer", rank=rank), shard=2, shard_rank=rank, dtype="float32"
        )
        tensors = allocate(layout, poisoned=False)
        control = ControlConfig(
            num_writers=2,
            num_readers=3,
            address=f"127.0.0.1:{port}",
            host_store=False,
            job="vllm-test",
            timeout=timedelta(seconds=60),
        )
        sync = SyncConfig(
            cast={"float32": "bfloat16"},
            bucket_bytes=1 << 20,
            direct_bytes=4096,
            transport="gloo",
            sync_timeout=timedelta(seconds=60),
        )
        driver = wv.VLLMWeightSync(
            BoundLayout(layout=layout, tensors=tensors), control, sync, servers=urls
        )
        driver.connect()
        for version in range(1, STEPS + 1):
            fill_from_canonical(layout, _canonical(spec, version), tensors)
            result = driver.sync(version)
            assert result.version == version
        driver.close()
        q.put((f"trainer-{rank}", "ok", ""))
    except BaseException as exc:
        q.put((f"trainer-{rank}", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


@pytest.mark.timeout(200)
def test_http_driver_syncs_stand_in_vllm_servers_bit_exact() -> None:
    """Two stand-in servers (tp 2 and tp 1: three readers) fed by two FSDP writers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q, port_q = ctx.Queue(), ctx.Queue()
    servers = [ctx.Process(target=_server, args=(tp, q, port_q)) for tp in (2, 1)]
    for p in servers:
        p.start()
    procs = list(servers)
    try:
        ports = [port_q.get(timeout=60) for _ in servers]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        trainers = [
            ctx.Process(target=_trainer, args=(r, store.port, urls if r == 0 else [], q))
            for r in range(2)
        ]
        for p in trainers:
            p.start()
        procs += trainers
        results: dict = {}
        deadline = time.monotonic() + 150
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                name, status, text = q.get(timeout=0.5)
                results[name] = (status, text)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert set(results) == {"server-tp2", "server-tp1", "trainer-0", "trainer-1"}, results
    for name, (status, text) in results.items():
        assert status == "ok", (name, text)


# -- with vLLM --------------------------------------------------------------------------------


def test_plugin_registers_the_backend_with_vllm() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the CPU CI cannot install it)")
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        pytest.skip("this vLLM has no weight-transfer API; use the worker extension")
    wv.register()
    wv.register()  # idempotent, as vLLM loads plugins in every process
    assert wv.BACKEND in WeightTransferEngineFactory._registry
    cls = WeightTransferEngineFactory._registry[wv.BACKEND]()
    assert issubclass(cls, WeightTransferEngine)
    assert not getattr(cls, "__abstractmethods__", None)


@pytest.mark.engines
@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_real_vllm_llm_receives_in_place(tmp_path, monkeypatch) -> None:
    """A tiny Llama served by ``vllm.LLM`` on GPU 0 with the weightbus backend; the writer on
    GPU 1 (NCCL). After each sync the engine's parameters equal the reference loader's."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
    transformers = pytest.importorskip("transformers")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the engine on one, the writer on the other)")
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )

    from weightbus import BoundLayout, ControlConfig, SyncConfig
    from weightbus.layouts.fsdp import fsdp_layout

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's lambda, test only
    config = dict(LLAMA)
    model_type = config.pop("model_type")
    hf = transformers.AutoConfig.for_model(model_type, torch_dtype="bfloat16", **config)
    transformers.AutoModelForCausalLM.from_config(hf).to(torch.bfloat16).save_pretrained(tmp_path)
    llm = vllm.LLM(
        model=str(tmp_path),
        tokenizer=None,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        weight_transfer_config=vllm.config.WeightTransferConfig(backend=wv.BACKEND),
    )

    class Client:  # VLLMServer's calls on an in-process LLM
        def world_size(self, include_dp=True):
            return 1

        def init(self, info):
            llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

        def pause(self, mode="wait"):
            pass

        def resume(self):
            pass

        def start(self):
            llm.start_weight_update()

        def update(self, info):
            llm.update_weights(WeightTransferUpdateRequest(update_info=info))

        def finish(self, version=None):
            llm.finish_weight_update()

    spec = model_spec(LLAMA)
    layout = fsdp_layout(
        spec, Participant(role="writer", rank=0, device="cuda:1"), shard=1, shard_rank=0
    )
    tensors = {k: v.to("cuda:1") for k, v in allocate(layout, poisoned=False).items()}
    control = ControlConfig(num_writers=1, num_readers=1, address="127.0.0.1:29781")
    driver = wv.VLLMWeightSync(
        BoundLayout(layout=layout, tensors=tensors),
        control,
        SyncConfig(transport="nccl"),
        servers=[Client()],
    )
    driver.connect()
    for version in (1, 2):
        canon = {k: v.to(torch.bfloat16) for k, v in _canonical(spec, version).items()}
        fill_from_canonical(layout, canon, tensors)
        driver.sync(version)
        got = llm.apply_model(lambda m: {k: p.detach().cpu() for k, p in m.named_parameters()})[0]
        want, masks = engine_rank_params(LLAMA, canon, EngineRank(), torch.bfloat16)
        for key, tensor in want.items():
            data = masks[key] == DATA
            assert torch.equal(got[key][data], tensor[data]), (version, key)
    driver.close()
