"""Engine adapter for a Hugging Face transformers ``PreTrainedModel``, on either side of a sync.

    bound = weightbus.engines.hf.bind(model, "reader", rank)

Canonical tensors are what ``model.save_pretrained`` writes, not what the model holds.
transformers 5 converts some weights on load: MoE models (Mixtral, Qwen2/3-MoE, DeepSeek, ...)
hold all experts of a layer fused in 3-D parameters (``mlp.experts.gate_up_proj`` of shape
``(experts, 2 * intermediate, hidden)``, ``mlp.experts.down_proj``) while their checkpoints keep
one 2-D tensor per expert and projection (``mlp.experts.3.up_proj.weight``), and some rename
keys (Mixtral's ``block_sparse_moe``). ``save_pretrained`` undoes that with
``revert_weight_conversion``. Ties are resolved the way ``save_pretrained`` resolves them
(``lm_head.weight`` tied to ``model.embed_tokens.weight`` is saved once, as the latter).

Rather than re-implement each model's conversion table, :func:`checkpoint_targets` runs
transformers' own revert on *index probes*: per tensor dim ``d`` every model tensor is replaced
by a zero-copy expanded tensor whose elements hold (tensor id, index along ``d``). The reverted
probes say, for every element of every checkpoint tensor, which model tensor and which element
it comes from. Each checkpoint tensor is then matched to boxes of model tensors (a checkpoint
tensor may also be the concatenation of several); an element map that is not a box map
(a transpose, an interleave, a RoPE permutation) raises :class:`LayoutError` naming both
tensors. A probe costs no memory unless the revert concatenates.

DTensor parameters (``tp_plan="auto"``) are probed at their global shape and then cut by the
region this rank holds (:mod:`weightbus.layouts.dtensor`), so a ``_StridedShard`` of a fused
``gate_up_proj`` lands half in each expert's ``gate_proj`` and half in its ``up_proj``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from weightbus.engines.module import participant_for
from weightbus.layouts.dtensor import add_tensor_pieces
from weightbus.layouts.module import BoundModule, tied_groups
from weightbus.spec import Box, LayoutBuilder, LayoutError, Participant, dtype_name

__all__ = ["CheckpointMap", "bind", "bind_pretrained", "checkpoint_targets"]

logger = logging.getLogger(__name__)

_ID_SHIFT = 40
_INDEX_MASK = (1 << _ID_SHIFT) - 1
# A checkpoint tensor cut into more boxes than this is a permutation or interleave (RoPE
# permutes, interleaved gate/up): exact as pieces, but one per row; refuse instead.
_MAX_BLOCKS = 1024

# One entry per model tensor: (checkpoint name, box of the checkpoint tensor, box of the model
# tensor at its global shape). The model box may have extra leading dims of extent 1.
Targets = dict[str, list[tuple[str, Box, Box]]]


class _Probe(torch.Tensor):
    """Keeps ``.contiguous()`` a no-op so expanded probes stay zero-copy through the revert."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def _require_pretrained(model) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "weightbus.engines.hf needs transformers: pip install 'weightbus[hf]'"
        ) from e
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"expected a transformers PreTrainedModel, got {type(model).__name__}; for a plain "
            "nn.Module use weightbus.engines.module.bind"
        )


def _live_tensors(model) -> dict[str, torch.Tensor]:
    live = dict(model.state_dict(keep_vars=True))
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        live.pop(key, None)
    for name, value in live.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{type(model).__name__}.state_dict() holds {name!r} as a {type(value).__name__}, "
                "not a tensor; weightbus.engines.hf binds models whose state dict is all tensors "
                "(quantized models are not supported): use weightbus.layouts.module.bind_module "
                f"with exclude=[{name!r}]"
            )
    return live


def _untie(model, live: dict[str, torch.Tensor]) -> dict[str, str]:
    """Tied name -> kept name, keeping the name ``save_pretrained`` keeps."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # Meta stand-ins: transformers then tells ties apart by parameter object, and never clones.
    stand_ins = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in live.items()}
    kept = set(remove_tied_weights_from_state_dict(stand_ins, model))
    aliases: dict[str, str] = {}
    for group in tied_groups(live):
        keep = [n for n in group if n in kept]
        if len(keep) != 1:
            raise LayoutError(
                f"{type(model).__name__}: {group} share one tensor but save_pretrained would keep "
                f"{keep or 'none of them'}; tie or untie them consistently (model.tie_weights())"
            )
        aliases.update({n: keep[0] for n in group if n != keep[0]})
    dropped = set(live) - kept - set(aliases)
    if dropped:
        raise LayoutError(
            f"{type(model).__name__}: save_pretrained drops {sorted(dropped)} as tied, but they "
            "share no storage with a kept tensor; call model.tie_weights() before binding"
        )
    return aliases


def _probe(shape: tuple[int, ...], ident: int, dim: int) -> torch.Tensor:
    base = ident << _ID_SHIFT
    if dim >= len(shape):
        return torch.tensor(base, dtype=torch.int64).expand(shape).as_subclass(_Probe)
    view = [1] * len(shape)
    view[dim] = shape[dim]
    index = torch.arange(shape[dim], dtype=torch.int64).add_(base).view(view)
    return index.expand(shape).as_subclass(_Probe)


def _reduce(t: torch.Tensor) -> torch.Tensor:
    """``t`` narrowed to one element along every dim where its stride is 0 (it is constant there).

    Keeps probe checks as small as the probes: a per-expert slice of an expanded probe reduces to
    one row or one column. Broadcasting restores the full shape wherever it is compared.
    """
    for j in range(t.ndim):
        if t.shape[j] > 1 and t.stride(j) == 0:
            t = t.narrow(j, 0, 1)
    return t


def _within(t: torch.Tensor, block: Box) -> torch.Tensor:
    """Box ``block`` of a reduced probe (its extent-1 dims stay whole)."""
    return t[
        tuple(
            slice(0, 1) if n == 1 else slice(a, b)
            for n, a, b in zip(t.shape, block.start, block.stop, strict=True)
        )
    ]


def _breaks(t: torch.Tensor, j: int) -> torch.Tensor:
    """Per step ``p -> p + 1`` along dim ``j``: True where ``t`` does not advance by one same
    step (0 or 1) at every position of the other dims."""
    n = t.shape[j]
    delta = t.diff(dim=j).movedim(j, 0).reshape(n - 1, -1)
    ref = delta[:, :1]
    return (delta != ref).any(dim=1) | ((ref[:, 0] != 0) & (ref[:, 0] != 1))


def _blocks(
    ckpt: str, shape: tuple[int, ...], ids: torch.Tensor, index: list[torch.Tensor]
) -> list[Box]:
    """Split checkpoint tensor ``ckpt`` into boxes each read from one model tensor box.

    A checkpoint tensor is one box of one model tensor, or (a fused checkpoint tensor whose
    parts the model holds apart) a concatenation along one dim of such boxes. ``ids`` and
    ``index`` are reduced probes (:func:`_reduce`).
    """
    cuts_by_dim = {}
    for j, n in enumerate(shape):
        if n <= 1:
            continue
        brk = torch.zeros(n - 1, dtype=torch.bool)
        if ids.shape[j] > 1:
            brk |= (ids.diff(dim=j).movedim(j, 0).reshape(n - 1, -1) != 0).any(dim=1)
        for t in index:
            if t.shape[j] > 1:
                brk |= _breaks(t, j)
        cuts = (torch.nonzero(brk).reshape(-1) + 1).tolist()
        if cuts:
            cuts_by_dim[j] = cuts
    if len(cuts_by_dim) > 1:
        raise LayoutError(
            f"checkpoint tensor {ckpt!r} {shape} is assembled from model tensors along several "
            f"dims {sorted(cuts_by_dim)}; weightbus pieces cannot express it"
        )
    if not cuts_by_dim:
        return [Box.whole(shape)]
    ((j, cuts),) = cuts_by_dim.items()
    if len(cuts) + 1 > _MAX_BLOCKS:
        raise LayoutError(
            f"checkpoint tensor {ckpt!r} {shape} is {len(cuts) + 1} separate boxes of model "
            f"tensors along dim {j} (more than {_MAX_BLOCKS}): the weight conversion permutes or "
            "interleaves it, so each row would be its own piece; sync the model's own names "
            "with weightbus.layouts.module.bind_module instead"
        )
    edges = [0, *cuts, shape[j]]
    blocks = []
    for a, b in zip(edges, edges[1:], strict=False):
        start, stop = [0] * len(shape), list(shape)
        start[j], stop[j] = a, b
        blocks.append(Box(tuple(start), tuple(stop)))
    return blocks


def _match_block(
    ckpt: str,
    block: Box,
    ids: torch.Tensor,
    index: list[torch.Tensor],
    sources: list[tuple[str, tuple[int, ...]]],
) -> tuple[str, Box]:
    """Box ``block`` of checkpoint tensor ``ckpt`` as ``(model key, box of the model tensor)``."""
    sub_ids = _within(ids, block)
    ident = int(sub_ids.reshape(-1)[0])
    if not 0 <= ident < len(sources) or not bool((sub_ids == ident).all()):
        raise LayoutError(
            f"checkpoint tensor {ckpt!r} {block} mixes model tensors in a way weightbus cannot map"
        )
    key, key_shape = sources[ident]
    n, m = len(key_shape), block.ndim
    start: list[int] = []
    claims: dict[int, int] = {}  # dim of the model tensor -> checkpoint dim it advances with
    for d in range(n):
        v = _within(index[d], block)
        c = int(v.reshape(-1)[0])
        expected = torch.full((), c, dtype=torch.int64)
        ok = True
        for j in range(m):
            if v.shape[j] <= 1:
                continue
            step = int(v.narrow(j, 1, 1).reshape(-1)[0]) - c
            if step == 1 and d not in claims:
                claims[d] = j
                view = [1] * m
                view[j] = v.shape[j]
                expected = expected + torch.arange(v.shape[j], dtype=torch.int64).view(view)
            elif step != 0:
                ok = False
                break
        if not ok or not bool((v == expected).all()):
            raise LayoutError(
                f"checkpoint tensor {ckpt!r} {block} is not a box of model tensor {key!r} "
                f"{key_shape}: dim {d} of {key!r} does not advance one-for-one along one dim of "
                f"{ckpt!r} (a transpose, interleave or permutation); weightbus pieces cannot "
                "express it"
            )
        start.append(c)
    claimed = {j: d for d, j in claims.items()}
    for j in range(m):
        if block.shape[j] > 1 and j not in claimed:
            raise LayoutError(
                f"checkpoint tensor {ckpt!r} {block} repeats elements of {key!r} along dim {j}; "
                "weightbus pieces cannot express it"
            )
    lead = n - m
    if lead < 0 or any(d - lead != j for d, j in claims.items()):
        raise LayoutError(
            f"checkpoint tensor {ckpt!r} {block} maps checkpoint dim -> dim of {key!r} "
            f"{key_shape} as {sorted(claimed.items())}; weightbus pieces need the checkpoint dims "
            "to be the trailing dims of the model tensor, in order"
        )
    extent = [block.shape[claims[d]] if d in claims else 1 for d in range(n)]
    source_box = Box.at(start, extent)
    assert Box.whole(key_shape).contains(source_box), (ckpt, key, source_box)
    return key, source_box


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMap:
    """How a model's tensors make up the tensors ``save_pretrained`` writes."""

    shapes: dict[str, tuple[int, ...]]
    """Checkpoint name -> shape, in the order ``save_pretrained`` produces them."""
    targets: Targets
    """Model state-dict key -> ``[(checkpoint name, checkpoint box, model box), ...]``; the model
    box is at the tensor's global shape and may have extra leading dims of extent 1."""
    aliases: dict[str, str]
    """Tied model key that ``save_pretrained`` leaves out -> the key it keeps."""


def checkpoint_targets(model, live: Mapping[str, torch.Tensor] | None = None) -> CheckpointMap:
    """Where each tensor ``save_pretrained`` writes comes from (module docstring).

    ``live`` is the model's state dict with live tensors (default: ``state_dict(keep_vars=True)``
    less ``_keys_to_ignore_on_save``). Raises :class:`LayoutError` when a checkpoint tensor is
    not made of boxes of model tensors.
    """
    from transformers.core_model_loading import revert_weight_conversion

    live = dict(live) if live is not None else _live_tensors(model)
    aliases = _untie(model, live)
    sources = [(k, tuple(v.shape)) for k, v in live.items() if k not in aliases]
    ndim = max([len(s) for _, s in sources] + [1])
    reverted: list[dict[str, torch.Tensor]] = []
    for d in range(ndim):
        probes = {k: _probe(s, i, d) for i, (k, s) in enumerate(sources)}
        try:
            out = revert_weight_conversion(model, probes)
        except Exception as e:
            raise LayoutError(
                f"{type(model).__name__}: transformers' revert_weight_conversion failed on index "
                f"probes ({type(e).__name__}: {e}); its weight conversion is not a rearrangement "
                "weightbus can follow (quantized?): use weightbus.layouts.module.bind_module"
            ) from e
        reverted.append({k: v.as_subclass(torch.Tensor) for k, v in out.items()})
    shapes: dict[str, tuple[int, ...]] = {}
    targets: Targets = {k: [] for k, _ in sources}
    for ckpt in reverted[0]:
        outs = [r[ckpt] for r in reverted]
        shape = tuple(outs[0].shape)
        if any(tuple(o.shape) != shape or o.dtype != torch.int64 for o in outs):
            raise LayoutError(
                f"checkpoint tensor {ckpt!r}: the weight conversion changes values or dtypes, "
                "not only their arrangement; weightbus cannot follow it"
            )
        shapes[ckpt] = shape
        if outs[0].numel() == 0:
            logger.warning("checkpoint tensor %r is empty: it has no pieces", ckpt)
            continue
        reduced = [_reduce(o) for o in outs]
        ids = min(reduced, key=lambda t: t.numel()) >> _ID_SHIFT
        index = [t & _INDEX_MASK for t in reduced]
        for block in _blocks(ckpt, shape, ids, index):
            key, kbox = _match_block(ckpt, block, ids, index, sources)
            targets[key].append((ckpt, block, kbox))
    unused = [k for k, t in targets.items() if not t]
    if unused:
        logger.warning(
            "%s: %d model tensors are not in the checkpoint and will not be synced: %s",
            type(model).__name__,
            len(unused),
            unused[:5],
        )
    return CheckpointMap(shapes=shapes, targets=targets, aliases=aliases)


def bind_pretrained(model, participant: Participant) -> BoundModule:
    """Bind a ``PreTrainedModel``'s live tensors under checkpoint names (module docstring)."""
    _require_pretrained(model)
    live = _live_tensors(model)
    cmap = checkpoint_targets(model, live)
    dtypes: dict[str, tuple[str, str]] = {}
    for key, entries in cmap.targets.items():
        dtype = dtype_name(live[key].dtype)
        for ckpt, _, _ in entries:
            first = dtypes.setdefault(ckpt, (dtype, key))
            if first[0] != dtype:
                raise LayoutError(
                    f"checkpoint tensor {ckpt!r} is assembled from {first[1]!r} ({first[0]}) and "
                    f"{key!r} ({dtype}); cast the model to one dtype"
                )
    builder = LayoutBuilder(participant)
    for ckpt, shape in cmap.shapes.items():
        if ckpt in dtypes:
            builder.add_tensor(ckpt, shape, dtypes[ckpt][0])
    tensors: dict[str, torch.Tensor] = {}
    for key, entries in cmap.targets.items():
        if entries:
            local = add_tensor_pieces(builder, key, live[key], entries)
            if local is not None:
                tensors[key] = local
    layout = builder.build()
    n_dtensor = sum(isinstance(live[k], DTensor) for k in tensors)
    logger.debug(
        "%s: %d checkpoint tensors from %d local tensors (%d DTensor), %d pieces, aliases %s",
        participant.name,
        len(layout.tensors),
        len(tensors),
        n_dtensor,
        len(layout.pieces),
        cmap.aliases,
    )
    return BoundModule(layout=layout, tensors=tensors, aliases=cmap.aliases)


def bind(
    model,
    role: str,
    rank: int,
    *,
    host: str | None = None,
    device: str | torch.device | None = None,
    name: str | None = None,
) -> BoundModule:
    """Bind a ``PreTrainedModel`` as ``role`` (``"writer"`` / ``"reader"``) ``rank``.

    Host defaults to this machine's hostname, device to the device of the first parameter.
    """
    _require_pretrained(model)
    participant = participant_for(model, role, rank, host=host, device=device, name=name)
    return bind_pretrained(model, participant)
