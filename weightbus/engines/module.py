"""Engine adapter for a plain ``nn.Module``, on either side of a sync.

    bound = weightbus.engines.module.bind(model, "writer", rank)

Every parameter and persistent buffer is one canonical tensor under its state-dict name
(see :mod:`weightbus.layouts.module`); DTensor parameters contribute this rank's shard.
"""

from __future__ import annotations

import socket

import torch
from torch import nn

from weightbus.layouts.module import BoundModule, bind_module
from weightbus.spec import Participant

__all__ = ["bind", "participant_for"]


def _first_device(model: nn.Module) -> str:
    for tensor in model.parameters():
        return str(tensor.device)
    for tensor in model.buffers():
        return str(tensor.device)
    return str(torch.device("cpu"))


def participant_for(
    model: nn.Module,
    role: str,
    rank: int,
    *,
    host: str | None = None,
    device: str | torch.device | None = None,
    name: str | None = None,
) -> Participant:
    """The :class:`Participant` for ``model``: host defaults to this machine's hostname, device
    to the device of the model's first parameter (first buffer, else ``cpu``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return Participant(
        role=role,
        rank=rank,
        name=name or "",
        host=host if host is not None else socket.gethostname(),
        device=str(device) if device is not None else _first_device(model),
    )


def bind(
    model: nn.Module,
    role: str,
    rank: int,
    *,
    host: str | None = None,
    device: str | torch.device | None = None,
    name: str | None = None,
) -> BoundModule:
    """Bind a plain module's live tensors as ``role`` (``"writer"`` / ``"reader"``) ``rank``."""
    return bind_module(
        model, participant_for(model, role, rank, host=host, device=device, name=name)
    )
