"""Kernels on part of a GPU's SMs (CUDA green contexts), the others left to the transport.

A grid that fills the GPU holds back a kernel queued after it on another stream until its
own last blocks have started: an NCCL send queued behind the FP8 amax pass waits for most of
that pass. On a stream of a green context a grid uses only the context's SMs, so the
transport's kernels always find room on the others. Measured on an H200 (132 SMs): a read of
2 GiB takes the same time on 64 to 132 SMs (3.8 TB/s); a 64 MiB copy queued on another stream
behind it finished after 0.60 ms with all SMs taken, 0.20 ms with 96.
"""

from __future__ import annotations

import logging

import torch

from weightbus._env import env_int

__all__ = ["AMAX_SMS", "amax_sms", "partial_stream"]

logger = logging.getLogger(__name__)

AMAX_SMS = 112
"""SMs of the FP8 amax pass when sends run beside it (the rest of an H200's 132 are left to
them); ``$WEIGHTBUS_AMAX_SMS`` overrides it, 0 meaning the whole GPU. Measured with S6 on
2 x H200 (one run each, alternating): 112 gave 30.2 and 30.5 ms, 96 31.1, 120 32.3 and 32.1,
the whole GPU 31.5 (the code before buckets went ahead: 31.8 and 31.3). The amax pass itself
takes longer on fewer SMs (4.1 ms on 112, 4.2 on 96, against 3.3 on all 132)."""

_streams: dict[tuple[int, int, str], torch.cuda.Stream | None] = {}
_contexts: list[object] = []  # each green context outlives its stream


def amax_sms() -> int:
    """:data:`AMAX_SMS`, or ``$WEIGHTBUS_AMAX_SMS`` where set."""
    return env_int("WEIGHTBUS_AMAX_SMS", AMAX_SMS)


def partial_stream(device: torch.device, sms: int, use: str = "fp8") -> torch.cuda.Stream | None:
    """A stream whose kernels run on ``sms`` of ``device``'s SMs; None where that cannot be
    (not CUDA, ``sms`` 0 or at least the GPU's count, no green context support): the caller
    then runs on the whole GPU. One stream per device, count and ``use`` (work of different
    uses is not serialized on one stream)."""
    if device.type != "cuda" or sms <= 0:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if sms >= torch.cuda.get_device_properties(index).multi_processor_count:
        return None
    key = (index, sms, use)
    if key not in _streams:
        _streams[key] = _green_stream(index, sms)
    return _streams[key]


def _green_stream(index: int, sms: int) -> torch.cuda.Stream | None:
    try:
        from torch.cuda.green_contexts import GreenContext

        try:
            ctx = GreenContext.create(num_sms=sms, device_id=index)
        except TypeError:  # builds whose create takes positional arguments
            ctx = GreenContext.create(sms, index)
        if hasattr(ctx, "Stream"):
            stream = ctx.Stream()
        else:  # builds where the context's stream is current while the context is set
            ctx.set_context()
            try:
                stream = torch.cuda.current_stream()
            finally:
                ctx.pop_context()
    except Exception as exc:  # no support in this build or driver: the whole GPU then
        logger.info("weightbus: no green context of %d SMs on cuda:%d (%s)", sms, index, exc)
        return None
    _contexts.append(ctx)
    return stream
