"""Layouts for a plain ``nn.Module`` or state dict: every tensor is one whole canonical tensor.

The canonical name is the state-dict name (with ``prefix`` stripped), and so is the local key;
the local tensor is the live tensor itself (a ``Parameter`` or buffer, contiguous or not). A
module contributes its parameters and persistent buffers, exactly what ``state_dict()`` and so
a checkpoint holds. DTensor values go through :mod:`weightbus.layouts.dtensor`.

Tied weights. Names whose tensors are the same object, or the same view of the same storage,
are one canonical tensor. Its name is the first of them in iteration order (``state_dict``
order for a module, which is registration order and so the same on every process of one model
class) that is not an output head (``lm_head.weight`` or ``*.lm_head.weight``); if all are
heads, the first. The others are recorded in :attr:`BoundModule.aliases`. For a Hugging Face
model this keeps ``model.embed_tokens.weight`` and drops ``lm_head.weight``, as
``save_pretrained`` does.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from weightbus.layouts.dtensor import add_tensor_pieces
from weightbus.spec import BoundLayout, Box, LayoutBuilder, Participant, dtype_name

__all__ = ["BoundModule", "bind_module", "is_output_head", "tied_groups"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BoundModule(BoundLayout):
    """A :class:`BoundLayout` that also says which names were folded into another by a tie."""

    aliases: dict[str, str] = field(default_factory=dict)
    """Tied name -> the canonical name it shares storage with (e.g. ``lm_head.weight`` ->
    ``model.embed_tokens.weight``). Aliases have no canonical tensor of their own."""


def is_output_head(name: str) -> bool:
    """``lm_head.weight`` or ``*.lm_head.weight``: the name a tie gives up."""
    return name == "lm_head.weight" or name.endswith(".lm_head.weight")


def _identity(t: torch.Tensor) -> tuple:
    """Equal for two tensors exactly when they are the same data seen the same way."""
    base = t
    extra: tuple = ()
    if isinstance(t, DTensor):
        base = t._local_tensor
        extra = (tuple(t.shape), repr(tuple(t.placements)), id(t.device_mesh))
    if base.device.type == "meta" or base.numel() == 0:
        # No storage to compare (meta) or nothing stored (every empty tensor may report the
        # same pointer): only the same object counts as a tie.
        return ("object", id(t))
    return (
        "view",
        str(base.device),
        base.untyped_storage().data_ptr(),
        base.storage_offset(),
        tuple(base.shape),
        base.stride(),
        base.dtype,
        extra,
    )


def tied_groups(named: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names that share one tensor, each group in iteration order; groups of one omitted."""
    groups: dict[tuple, list[str]] = {}
    for name, t in named.items():
        groups.setdefault(_identity(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _canonical_of(names: list[str]) -> str:
    return next((n for n in names if not is_output_head(n)), names[0])


def _named_tensors(obj: object) -> dict[str, object]:
    if isinstance(obj, nn.Module):
        return dict(obj.state_dict(keep_vars=True))
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(
        f"bind_module takes an nn.Module or a mapping of name -> tensor, got "
        f"{type(obj).__name__}; for a Hugging Face model use weightbus.engines.hf.bind"
    )


def _patterns(value: Iterable[str] | str | None, what: str) -> list[str] | None:
    if value is None:
        return None
    out = [value] if isinstance(value, str) else list(value)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{what} entries are names or glob patterns (str), got {p!r}")
    return out


def _select(names: list[str], patterns: list[str], what: str) -> set[str]:
    hit: set[str] = set()
    for p in patterns:
        matched = (
            fnmatch.filter(names, p) if any(c in p for c in "*?[") else [n for n in names if n == p]
        )
        if not matched:
            close = difflib.get_close_matches(p, names, n=3)
            hint = f"; close names: {close}" if close else f"; names look like {names[:3]}"
            raise KeyError(
                f"{what} entry {p!r} matches no tensor name (names are compared after prefix "
                f"stripping, globs allowed){hint}"
            )
        hit.update(matched)
    return hit


def bind_module(
    obj: nn.Module | Mapping[str, torch.Tensor],
    participant: Participant,
    *,
    prefix: str = "",
    include: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
) -> BoundModule:
    """A layout where every tensor of ``obj`` is one canonical tensor under its own name.

    ``prefix`` is removed from the start of every name that has it (``"module."`` for a DDP
    wrapper, ``"_orig_mod."`` for ``torch.compile``). ``include`` / ``exclude`` are names or
    glob patterns, matched after stripping; each must match at least one name. Tied names are
    folded into one canonical tensor (see the module docstring); ``aliases`` records them.
    """
    raw = _named_tensors(obj)
    named: dict[str, object] = {}
    origin: dict[str, str] = {}
    for name, value in raw.items():
        stripped = name.removeprefix(prefix) if prefix else name
        if stripped in named:
            raise ValueError(
                f"{participant.name}: {origin[stripped]!r} and {name!r} both become {stripped!r} "
                f"after stripping prefix {prefix!r}; pass a prefix only one of them has, or a "
                "mapping with unique names"
            )
        named[stripped] = value
        origin[stripped] = name
    names = list(named)
    inc = _patterns(include, "include")
    exc = _patterns(exclude, "exclude")
    keep = _select(names, inc, "include") if inc is not None else set(names)
    if exc is not None:
        keep -= _select(names, exc, "exclude")
    selected: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in keep:
            continue
        value = named[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{participant.name}: {origin[name]!r} is a {type(value).__name__} ({value!r:.60}), "
                f"not a tensor; leave it out with exclude=[{name!r}]"
            )
        selected[name] = value

    aliases: dict[str, str] = {}
    for group in tied_groups(selected):
        canonical = _canonical_of(group)
        for alias in group:
            if alias != canonical:
                aliases[alias] = canonical
    if aliases:
        logger.info(
            "%s: tied names synced once under their canonical name: %s",
            participant.name,
            ", ".join(f"{a} -> {c}" for a, c in aliases.items()),
        )

    builder = LayoutBuilder(participant)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in selected.items():
        if name in aliases:
            continue
        shape = tuple(value.shape)
        builder.add_tensor(name, shape, dtype_name(value.dtype))
        live = add_tensor_pieces(builder, name, value, [(name, Box.whole(shape), Box.whole(shape))])
        if live is not None:
            tensors[name] = live
    layout = builder.build()
    logger.debug(
        "%s: %d tensors, %d pieces, %d aliases",
        participant.name,
        len(layout.tensors),
        len(layout.pieces),
        len(aliases),
    )
    return BoundModule(layout=layout, tensors=tensors, aliases=aliases)
