"""Hugging Face models sharded with torch.distributed, on either side of a sync.

Trainer side: FSDP2, tensor parallel, or both on a 2-D mesh, then bind as usual::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    tensor_parallel(model, mesh["tp"])   # the model's own tensor-parallel plan
    fully_shard_model(model, mesh["dp"])  # FSDP2 over it
    bound = weightbus.engines.hf.bind(model, "writer", rank)

Inference side: transformers' own tensor parallelism (``tp_plan="auto"``), loaded from a local
checkpoint inside an initialised process group::

    model = load_tensor_parallel(path, dtype=torch.bfloat16, device=f"cuda:{gpu}")
    bound = weightbus.engines.hf.bind(model, "reader", rank)

Parameters of all of these are DTensors; :mod:`weightbus.layouts.dtensor` maps each rank's
local shard to its region of the checkpoint tensor, so every writer sends and every reader
receives only what it holds, in place in the live shards.

:func:`tensor_parallel` applies the same plan as transformers (``model.tp_plan``: the config's
``base_model_tp_plan`` plus the head's) with torch's ``ColwiseParallel`` / ``RowwiseParallel``,
so a trainer's shards land where transformers puts an engine's. It keeps tied embeddings tied:
``lm_head`` and ``embed_tokens`` stay one parameter (both ``Shard(0)`` over the vocabulary), so
the sync carries it once and both uses of it see the new weights.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import logging
import os
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = [
    "full_state_dict",
    "fully_shard_model",
    "load_tensor_parallel",
    "mixes_dtensors",
    "parallel_styles",
    "tensor_parallel",
]

logger = logging.getLogger(__name__)

# transformers' plan styles this module translates; others are refused by name
_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "embedding_rowwise",
)


def _hf_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan as transformers applies it: module pattern -> style."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    plan = {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (no tp_plan, _tp_plan or "
            "config.base_model_tp_plan); pass plan={module pattern: style}"
        )
    return plan


def _style(name: str, module: nn.Module, style: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    embedding = isinstance(module, nn.Embedding)
    if style == "colwise" and not embedding:
        return ColwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output") and not embedding:
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise" and not embedding:
        return RowwiseParallel()
    if style == "embedding_rowwise" or (style == "rowwise" and embedding):
        # token ids come in whole; each rank looks up its vocabulary rows, the sum is replicated
        return RowwiseParallel(input_layouts=Replicate())
    raise ValueError(
        f"tensor-parallel style {style!r} for {name} ({type(module).__name__}) is not supported "
        f"by weightbus.engines.torch_dist; supported: {list(_STYLES)} on Linear, "
        "'embedding_rowwise' / 'rowwise' on Embedding. Pass plan= with those styles, or load "
        "the model with transformers' own tp_plan='auto' (load_tensor_parallel)"
    )


def parallel_styles(model: nn.Module, plan: Mapping[str, str] | None = None) -> dict[str, object]:
    """``{module name: torch ParallelStyle}`` for every module ``plan`` (default: the model's
    own, as transformers applies it) names; ``*`` in a pattern matches a layer index."""
    plan = dict(plan) if plan is not None else _hf_plan(model)
    modules = dict(model.named_modules())
    out: dict[str, object] = {}
    for pattern, style in plan.items():
        hits = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            logger.warning("tensor-parallel plan entry %r matches no module", pattern)
        for name in hits:
            if name in out:
                raise ValueError(f"{name} is matched by more than one plan entry ({pattern!r})")
            out[name] = _style(name, modules[name], style)
    return out


def _ties(model: nn.Module) -> list[tuple[str, str, str]]:
    """(module, attribute, module whose parameter it shares) for every shared parameter."""
    seen: dict[int, str] = {}
    ties = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False):
            if id(p) in seen and seen[id(p)] != f"{mod_name}.{attr}":
                owner = seen[id(p)].rsplit(".", 1)[0]
                ties.append((mod_name, attr, owner))
            else:
                seen.setdefault(id(p), f"{mod_name}.{attr}")
    return ties


def _placement(t: torch.Tensor) -> str:
    return str(tuple(t.placements)) if isinstance(t, DTensor) else "whole"


def tensor_parallel(
    model: nn.Module, mesh, plan: Mapping[str, str] | None = None
) -> dict[str, object]:
    """Shard ``model`` in place over the 1-D ``mesh`` with ``parallelize_module``.

    ``plan`` maps module-name patterns to transformers' style names (default: the model's own
    plan, see the module docstring). Parameters tied before (``lm_head`` and ``embed_tokens``)
    are tied again after, as one DTensor; a tied embedding the plan leaves out is sharded over
    the vocabulary like its column-parallel head, and a tie whose two modules get different
    placements is refused. Returns the ``{module name: ParallelStyle}`` applied.

    Parameters the plan leaves out stay plain tensors, so on CUDA build the optimizer with
    ``foreach=False`` (see :func:`mixes_dtensors`).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh.ndim != 1:
        raise ValueError(
            f"tensor_parallel takes a 1-D mesh, got mesh of shape {tuple(mesh.shape)}; pass "
            "its tensor-parallel dim, e.g. mesh['tp']"
        )
    ties = _ties(model)
    styles = parallel_styles(model, plan)
    modules = dict(model.named_modules())
    for mod_name, _, owner in ties:
        # a tied embedding the plan leaves whole, under a head sharded over the vocabulary:
        # shard it the same way (as transformers does for tied models), so the tie can hold
        pair = [n for n in (mod_name, owner) if n not in styles]
        if len(pair) == 1 and isinstance(modules[pair[0]], nn.Embedding):
            other = owner if pair[0] == mod_name else mod_name
            if styles[other].__class__.__name__ == "ColwiseParallel":
                styles[pair[0]] = _style(pair[0], modules[pair[0]], "embedding_rowwise")
                logger.info("tensor_parallel: %s sharded like its tied %s", pair[0], other)
    parallelize_module(model, mesh, styles)
    modules = dict(model.named_modules())
    for mod_name, attr, owner in ties:
        kept = getattr(modules[owner], attr)
        mine = getattr(modules[mod_name], attr)
        if _placement(kept) != _placement(mine):
            raise ValueError(
                f"{mod_name}.{attr} is tied to {owner}.{attr}, but the plan shards them "
                f"differently ({_placement(mine)} vs {_placement(kept)}); give both the same "
                "placement (e.g. 'embedding_rowwise' and 'colwise_gather_output', both "
                "Shard(0)) or untie them"
            )
        # parallelize_module made a parameter per module; put the shared one back
        setattr(modules[mod_name], attr, kept)
    if ties:
        logger.info(
            "tensor_parallel: kept ties %s",
            ", ".join(f"{m}.{a} -> {o}.{a}" for m, a, o in ties),
        )
    return styles


def mixes_dtensors(model: nn.Module) -> bool:
    """Whether some of ``model``'s parameters are DTensors and others plain tensors (after
    :func:`tensor_parallel`, the parameters its plan leaves out, e.g. norms, stay plain).

    torch's multi-tensor ("foreach") optimizer kernels, the default on CUDA, refuse such a
    mix; build the optimizer with ``foreach=not mixes_dtensors(model)``."""
    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    return len(kinds) == 2


def fully_shard_model(model: nn.Module, mesh, blocks: tuple[str, ...] | None = None, **kwargs):
    """FSDP2 (``fully_shard``) over each block, then the root, on ``mesh``; returns ``model``.

    Blocks are the modules whose class name is in ``blocks`` (default: a transformers model's
    ``_no_split_modules``, its decoder layers). Tied parameters sit in the root's group, sharded
    once. On a TP-sharded model pass the data-parallel dim of the same mesh (``mesh['dp']``):
    parameters become 2-D DTensors. ``kwargs`` go to ``fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard

    names = set(blocks if blocks is not None else getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(model).__name__} names no blocks to shard (no _no_split_modules); pass "
            "blocks=('MyDecoderLayer',)"
        )
    hits = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not hits:
        raise ValueError(
            f"no module of {type(model).__name__} has a class named in {sorted(names)}; pass "
            "blocks= with the class names of its layers"
        )
    for m in hits:
        fully_shard(m, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment (processes it starts inherit it), and what
    was there before restored afterwards."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_tensor_parallel(path, *, dtype: torch.dtype, device=None, model_class=None, **kwargs):
    """A transformers model from local checkpoint ``path``, tensor parallel over this process
    group (``tp_plan="auto"``, one rank per process of the default group).

    The default process group must be initialised (gloo on CPU, NCCL on GPUs), one process per
    rank. ``device`` (``"cpu"``, ``"cuda:2"``; default: the current CUDA device if any, else the
    CPU) is where this rank's shards live: transformers picks the accelerator itself and the
    GPU from ``$LOCAL_RANK``, which is set to the device's index while loading. ``model_class``
    defaults to ``AutoModelForCausalLM``; ``kwargs`` go to ``from_pretrained``. transformers
    needs ``accelerate`` for this (the ``hf`` extra installs it).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "load_tensor_parallel needs the default process group: call "
            "torch.distributed.init_process_group('nccl' or 'gloo', ...) first, one process per "
            "tensor-parallel rank"
        )
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    has_cuda = torch.cuda.is_available()
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if has_cuda else torch.device("cpu")
    if dev.type == "cpu" and has_cuda:
        raise ValueError(
            "transformers places a tensor-parallel model on the accelerator it finds, so it "
            "cannot load one on the CPU while CUDA devices are visible; hide them "
            "(CUDA_VISIBLE_DEVICES='') in this process, or pass a cuda device"
        )
    local_rank = None
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)
        local_rank = str(index)
    world = dist.get_world_size()
    try:
        from transformers.distributed import DistributedConfig

        fields = inspect.signature(DistributedConfig).parameters
        new_api = "tp_plan" in fields and "tp_size" in fields
    except (ImportError, TypeError, ValueError):
        new_api = False
    if new_api:
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=world)
    else:  # older transformers: tensor parallel over the whole default group
        kwargs["tp_plan"] = "auto"
    with environment({} if local_rank is None else {"LOCAL_RANK": local_rank}):
        model = model_class.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    shards = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not shards:
        raise RuntimeError(
            f"{type(model).__name__} loaded from {path} with tp_plan='auto' has no DTensor "
            "parameters: this transformers did not shard it; shard a loaded model with "
            "tensor_parallel(model, mesh) instead"
        )
    logger.info(
        "loaded %s tensor parallel over %d ranks: %d of %d parameters sharded",
        type(model).__name__,
        world,
        len(shards),
        len(list(model.parameters())),
    )
    return model


def full_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every state-dict tensor whole, on the CPU, cast to ``dtype`` if given.

    Collective: every rank of every mesh the model's DTensors live on must call it. For checks
    and references, not for syncing (it gathers the whole model on every rank).
    """
    out = {}
    for name, value in model.state_dict().items():
        with torch.no_grad():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            whole = whole.detach().to("cpu")
            out[name] = whole.to(dtype) if dtype is not None else whole.clone()
    return out
