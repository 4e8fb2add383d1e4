"""SGLang integration: receive each sync straight into SGLang's fused parameters.

SGLang runs a *custom weight loader* inside every tensor-parallel worker when
``update_weights_from_tensor`` is called with ``load_format`` naming it; the loader gets the
worker's live model. :func:`receive` is that loader. Start the engine with it allowed::

    engine = sglang.Engine(model_path=..., tp_size=4,
                           custom_weight_loader=["weightbus.engines.sglang.receive"])

and drive it from the trainer with :class:`SGLangWeightSync`. The tensors passed through
``update_weights_from_tensor`` carry control values only (the job's init info as JSON bytes
in a uint8 tensor, then one version number per sync); the weights move through weightbus'
transports into the parameters in place, and the call returns once the sync is committed.
``flush_cache=True`` on each sync drops KV caches computed with the old weights, and the
SGLang call's ``weight_version`` (where the installed SGLang has it) records the version.

Layouts: SGLang's layers (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding`` padded to 64, ``FusedMoE`` ``w13_weight`` /
``w2_weight``) are vLLM's design and names, so :func:`sglang_layout` is the fused engine
layout with SGLang's expert parallel: ``--ep-size`` divides tp, ``moe_tp = tp / ep``,
``ep_rank = tp_rank // moe_tp``, ``moe_tp_rank = tp_rank % moe_tp``, ``E / ep`` contiguous
experts per rank.

Not supported: SGLang engines with ``dp_size > 1`` (pass one engine per replica), SGLang
HTTP servers (the only route that reaches the workers' loader,
``/update_weights_from_tensor``, takes SGLang's pickled tensor serialization, which weightbus
does not send over a network), data-parallel attention (``--enable-dp-attention``), pipeline
parallel, expert-parallel load balancing, DeepSeek with SGLang's shared-experts fusion (the
shared experts become extra routed experts in ``w13_weight``; start SGLang with that fusion
disabled, ``--disable-shared-experts-fusion`` in the versions read; :func:`weightbus.engines.vllm.bind` otherwise
fails on the expert shapes), quantized models (see :mod:`weightbus.engines.vllm`,
"FP8"). :class:`SGLangHTTP` covers the JSON routes that remain useful with a server:
``/pause_generation``, ``/continue_generation``, ``/update_weight_version``.
"""

from __future__ import annotations

import inspect
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from weightbus._session import SyncConfig, SyncResult
from weightbus.control.store import ControlConfig
from weightbus.engines._concurrent import beside
from weightbus.engines.vllm import InitInfo, Receiver
from weightbus.errors import WeightbusError
from weightbus.layouts.families import ModelSpec, model_spec
from weightbus.layouts.fused import engine_layout
from weightbus.spec import BoundLayout, Layout, Participant
from weightbus.writer import Writer

__all__ = [
    "LOADER",
    "SGLangHTTP",
    "SGLangParallel",
    "SGLangWeightSync",
    "receive",
    "sglang_layout",
]

logger = logging.getLogger(__name__)

LOADER = "weightbus.engines.sglang.receive"
"""The ``load_format`` (and ``custom_weight_loader`` entry) that runs :func:`receive`."""

_INIT, _VERSION = "weightbus.init", "weightbus.version"


@dataclass(frozen=True, slots=True, kw_only=True)
class SGLangParallel:
    """Where one SGLang tensor-parallel worker sits."""

    tp: int = 1
    """``--tp-size``."""
    tp_rank: int = 0
    """This worker's tensor-parallel rank."""
    ep: int = 1
    """``--ep-size``: a divisor of tp; experts spread over ``ep`` groups of ``tp / ep`` ranks."""
    vocab_pad: int = 64
    """Vocabulary padding of the embedding and LM head (SGLang's 64)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r} must be an int >= 1")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp:
            raise ValueError(f"tp_rank={self.tp_rank!r} must be in [0, tp={self.tp})")
        if not isinstance(self.ep, int) or self.ep < 1 or self.tp % self.ep:
            raise ValueError(f"ep={self.ep!r} must be a positive divisor of tp={self.tp}")

    @property
    def worker_index(self) -> int:
        return self.tp_rank

    def moe(self) -> dict[str, int]:
        moe_tp = self.tp // self.ep
        return {
            "ep": self.ep,
            "ep_rank": self.tp_rank // moe_tp,
            "moe_tp": moe_tp,
            "moe_tp_rank": self.tp_rank % moe_tp,
        }

    def layout(
        self, model: ModelSpec, participant: Participant, *, dtype: str | None = None
    ) -> Layout:
        return sglang_layout(model, participant, self, dtype=dtype)

    def checks(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "tp_rank": self.tp_rank,
            "placement": "linear",
            "vocab_pad": self.vocab_pad,
            **self.moe(),
        }


def sglang_layout(
    model: ModelSpec,
    participant: Participant,
    parallel: SGLangParallel,
    *,
    dtype: str | None = None,
) -> Layout:
    """The layout of one SGLang worker (see the module docstring)."""
    moe: dict[str, int] = {}
    if model.num_experts:
        moe = parallel.moe()
        if model.num_experts % parallel.ep:
            raise ValueError(
                f"{model.num_experts} experts do not split evenly over ep={parallel.ep} "
                "(SGLang requires it): pick an ep that divides the expert count"
            )
    return engine_layout(
        model,
        participant,
        tp=parallel.tp,
        tp_rank=parallel.tp_rank,
        vocab_pad=parallel.vocab_pad,
        dtype=dtype,
        **moe,
    )


# ---------------------------------------------------------------------------------------------
# inside SGLang's workers
# ---------------------------------------------------------------------------------------------

_RECEIVERS: dict[int, Receiver] = {}


def _server_args() -> Any:
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except ImportError:  # older SGLang keeps a dict
        from sglang.srt.managers.schedule_batch import global_server_args_dict

        return type("ServerArgs", (), dict(global_server_args_dict))


def _parallel_here() -> SGLangParallel:
    from sglang.srt.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    args = _server_args()
    if getattr(args, "enable_dp_attention", False):
        raise NotImplementedError(
            "SGLang with --enable-dp-attention shards attention and MoE differently; "
            "weightbus supports tensor and expert parallel SGLang engines only"
        )
    if int(getattr(args, "pp_size", 1) or 1) != 1:
        raise NotImplementedError("weightbus does not support pipeline-parallel SGLang engines")
    return SGLangParallel(
        tp=int(get_tensor_model_parallel_world_size()),
        tp_rank=int(get_tensor_model_parallel_rank()),
        ep=int(getattr(args, "ep_size", 1) or 1),
    )


def _spec_of(model: nn.Module) -> ModelSpec:
    config = getattr(model, "config", None)
    if config is None:
        raise WeightbusError(
            f"{type(model).__name__} has no .config: weightbus needs the Hugging Face config "
            "of the served model"
        )
    return model_spec(config.to_dict() if hasattr(config, "to_dict") else dict(config))


def _named(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {name: tensor for name, tensor in named_tensors}
    unknown = sorted(set(out) - {_INIT, _VERSION})
    if unknown:
        raise WeightbusError(
            f"weightbus' SGLang loader got tensors {unknown}: it takes only {_INIT!r} and "
            f"{_VERSION!r} (weights travel through weightbus, not update_weights_from_tensor)"
        )
    return out


def receive(model: nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: join the job (``weightbus.init``) or receive one version
    (``weightbus.version``) into ``model``'s parameters in place."""
    values = _named(named_tensors)
    key = id(model)
    if _INIT in values:
        raw = values[_INIT].detach().to("cpu", torch.uint8).numpy().tobytes()
        info = InitInfo(**json.loads(raw.decode()))
        old = _RECEIVERS.pop(key, None)
        if old is not None:
            old.close()
        device = next(model.parameters()).device
        receiver = Receiver(model, _spec_of(model), _parallel_here(), device, engine="sglang")
        receiver.connect(info)
        _RECEIVERS[key] = receiver
    if _VERSION in values:
        receiver = _RECEIVERS.get(key)
        if receiver is None:
            raise WeightbusError(
                "weightbus' SGLang loader got a version before the job's init info: call "
                "SGLangWeightSync.connect first"
            )
        with torch.no_grad():
            receiver.receive(int(values[_VERSION].reshape(-1)[0].item()))
            receiver.finish()


# ---------------------------------------------------------------------------------------------
# the trainer side
# ---------------------------------------------------------------------------------------------


class SGLangHTTP:
    """SGLang's JSON routes around a weight update, for one server."""

    def __init__(self, url: str, *, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout.total_seconds()) as r:
                return json.loads(r.read().decode() or "{}")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise WeightbusError(
                f"SGLang server {self.url}: {path} answered {e.code}: {detail}"
            ) from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise WeightbusError(f"SGLang server {self.url}: {path} failed: {e}") from e

    def pause(self) -> None:
        self._post("/pause_generation", {})

    def resume(self) -> None:
        self._post("/continue_generation", {})

    def set_weight_version(self, version: str) -> None:
        self._post("/update_weight_version", {"new_version": version})


def _json_tensor(value: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


class SGLangWeightSync:
    """A trainer rank's side of syncing into in-process ``sglang.Engine`` objects.

    Every writer rank constructs one (``engines`` only on writer rank 0) and calls
    :meth:`connect` and :meth:`sync` together. ``control.num_readers`` must count every
    tensor-parallel worker of every engine.
    """

    def __init__(
        self,
        bound: BoundLayout,
        control: ControlConfig,
        sync: SyncConfig | None = None,
        *,
        engines: Sequence[Any] = (),
    ) -> None:
        self.sync_config = sync or SyncConfig()
        self.control = control
        self.writer = Writer(bound, control, self.sync_config)
        self.engines = list(engines)
        if self.engines and bound.layout.rank != 0:
            raise ValueError("only writer rank 0 drives the SGLang engines; pass engines=()")

    @staticmethod
    def _tp_size(engine: Any) -> int:
        args = getattr(engine, "server_args", None)
        if args is None:
            raise WeightbusError(f"{type(engine).__name__} has no server_args: pass sglang.Engine")
        if LOADER not in (getattr(args, "custom_weight_loader", None) or []):
            raise WeightbusError(
                f"this SGLang engine does not allow weightbus' loader: start it with "
                f"custom_weight_loader=[{LOADER!r}]"
            )
        if int(getattr(args, "dp_size", 1) or 1) != 1:
            raise NotImplementedError(
                "SGLang engines with dp_size > 1: their replicas' workers share tp ranks; start "
                "one engine per replica and pass them all"
            )
        return int(args.tp_size)

    def _call(self, engine: Any, tensors: list[tuple[str, torch.Tensor]], **extra: Any) -> None:
        method = engine.update_weights_from_tensor
        accepted = inspect.signature(method).parameters
        kwargs = {k: v for k, v in extra.items() if k in accepted}
        out = method(named_tensors=tensors, load_format=LOADER, **kwargs)
        if isinstance(out, tuple) and out and out[0] is False:
            raise WeightbusError(f"SGLang engine refused the update: {out[1:]}")

    def _both(self, calls: list, local) -> Any:
        return beside(calls, local)

    def connect(self) -> None:
        offsets, total = [], 0
        for engine in self.engines:
            offsets.append(total)
            total += self._tp_size(engine)
        if self.engines and total > self.control.num_readers:
            raise ValueError(
                f"the engines have {total} workers but control.num_readers="
                f"{self.control.num_readers}: count every tensor-parallel worker"
            )
        calls = []
        for engine, offset in zip(self.engines, offsets, strict=True):
            info = asdict(
                InitInfo.from_configs(self.control, self.sync_config, reader_rank_offset=offset)
            )
            tensors = [(_INIT, _json_tensor(info))]
            calls.append(lambda e=engine, t=tensors: self._call(e, t, flush_cache=False))
        self._both(calls, self.writer.connect)

    def sync(self, version: int) -> SyncResult:
        version = int(version)
        tensors = [(_VERSION, torch.tensor([version], dtype=torch.int64))]
        calls = [
            lambda e=engine: self._call(e, tensors, flush_cache=True, weight_version=str(version))
            for engine in self.engines
        ]
        return self._both(calls, lambda: self.writer.sync(version))

    def close(self) -> None:
        self.writer.close()
