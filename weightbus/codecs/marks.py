"""Change marks: the trainer says which elements of its weights changed since the last sync.

With sparse deltas the writer finds the changed elements by comparing every byte with the
bytes it sent last time: 16 GB of bf16 read twice, about 7 ms on an H200, however few
changed. A trainer that writes its weights in one place (a copy of its FP32 master weights
into the BF16 ones after each optimizer step, as Megatron-style optimizers do) can tell the
writer instead, at the cost of reading the old values it overwrites:

>>> marks = writer.change_marks          # SyncConfig(delta=DeltaConfig(change_marks=True))
>>> marks.copy_(param, master)          # param.copy_(master), marking what changed
>>> marks.mark(embedding[rows])         # or: these elements changed (written elsewhere)
>>> writer.sync(step)                   # reads the marks, then clears them

A mark is a bit per element of each live tensor's storage (bit ``e % 32`` of 32-bit word
``e // 32``: the storage's element ``e``). The writer's pass over a window then reads the
marks and the marked elements alone. An element marked but not changed is sent all the same
(still exact); an element changed but not marked is not sent, and its reader keeps the old
value until the next sync with a checksum (``DeltaConfig.checksum_every``), which compares
every byte, as do dense syncs: marks must cover every change. Marks are cleared at the end
of every sync, sent or failed (a failed sync is followed by a dense one).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from weightbus.errors import WeightbusError

logger = logging.getLogger(__name__)

__all__ = ["ChangeMarks"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def storage_span(x: torch.Tensor) -> tuple[int, int]:
    """The storage elements (of ``x``'s dtype) that view ``x`` may touch: [lo, hi)."""
    lo = int(x.storage_offset())
    if x.numel() == 0:
        return lo, lo
    return lo, lo + 1 + sum(int(n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True))


def _words_of(flags: torch.Tensor) -> torch.Tensor:
    """Bool ``flags`` (a multiple of 32) as int32 words: bit ``k`` of word ``w`` is flag
    ``32 w + k``."""
    shifts = torch.arange(32, dtype=torch.int64, device=flags.device)
    w = (flags.view(-1, 32).to(torch.int64) << shifts).sum(1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def flags_of(words: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bits ``lo`` to ``hi`` of int32 ``words`` as bools (bit ``e`` is bit ``e % 32`` of word
    ``e // 32``)."""
    w0 = lo // 32
    part = words[w0 : -(-hi // 32)].to(torch.int64)
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    flags = ((part.view(-1, 1) >> shifts) & 1).view(-1).bool()
    return flags[lo - 32 * w0 : hi - 32 * w0]


class ChangeMarks:
    """A bit per element of a writer's live tensors: set where the trainer changed it since
    the last sync (see the module docstring). ``tensors``: the writer's live tensors by key
    (each storage is marked once, whichever views of it the writer reads)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, name: str = "writer") -> None:
        self.name = name
        self._tensors = tensors
        self._bits: dict[int, torch.Tensor] = {}
        """Per storage (its data pointer): its marks, int32 words."""
        self._itemsize: dict[int, int] = {}
        self._keys: dict[int, str] = {}
        self.stale = False
        """Whether some storage was replaced since the last sync (its marks started over):
        the next sync compares every byte instead of reading the marks."""
        self._kernels: Any = None
        self.bind()

    def bind(self) -> None:
        """Find the live tensors' storages again (one replaced by the trainer gets marks of
        its own, and the next sync compares every byte)."""
        bits, sizes, keys = {}, {}, {}
        for key, t in self._tensors.items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in bits:
                continue
            isz = t.element_size()
            if ptr in self._bits and self._itemsize[ptr] == isz:
                bits[ptr] = self._bits[ptr]
            else:
                n = t.untyped_storage().nbytes() // isz
                bits[ptr] = torch.zeros(-(-n // 32), dtype=torch.int32, device=t.device)
                if self._bits:
                    self.stale = True
            sizes[ptr], keys[ptr] = isz, key
        self._bits, self._itemsize, self._keys = bits, sizes, keys

    def _words(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """The marks of the storage view ``x`` lies in (found again once if it moved)."""
        ptr = x.untyped_storage().data_ptr()
        if ptr not in self._bits:
            self.bind()
        if ptr not in self._bits:
            raise WeightbusError(
                f"{self.name}: {what}: a tensor of shape {tuple(x.shape)} ({x.dtype}) that is "
                "not a view of any of the writer's live tensors; mark views of the tensors "
                "the writer was bound to (BoundLayout.tensors)"
            )
        if x.element_size() != self._itemsize[ptr]:
            raise WeightbusError(
                f"{self.name}: {what}: a view of {self._keys[ptr]!r} as {x.dtype} "
                f"({x.element_size()} bytes an element), the tensor has "
                f"{self._itemsize[ptr]}; mark views in the tensor's own dtype"
            )
        return self._bits[ptr]

    def locate(self, x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """Where view ``x``'s marks are: its storage's words and ``x``'s first element among
        them; None where ``x`` is not a view of a live tensor in its own element size."""
        ptr = x.untyped_storage().data_ptr()
        if ptr not in self._bits or x.element_size() != self._itemsize[ptr]:
            return None
        return self._bits[ptr], int(x.storage_offset())

    @torch.no_grad()
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` (``dst`` a view of a live tensor), marking the elements whose
        bits changed; returns ``dst``. On CUDA, where ``dst`` is contiguous and its first
        element at a multiple of 32 in its storage, one kernel reads both and writes only
        the changed elements and their marks."""
        words = self._words(dst, "copy_")
        if src.shape != dst.shape:
            src = src.expand(dst.shape) if src.dim() <= dst.dim() else src.reshape(dst.shape)
        if src.dtype != dst.dtype or src.device != dst.device:
            src = src.to(device=dst.device, dtype=dst.dtype)
        if dst.numel() == 0:
            return dst
        kernels = self._kernels_for(dst)
        if (
            kernels is not None
            and dst.is_contiguous()
            and src.is_contiguous()
            and dst.storage_offset() % 32 == 0
        ):
            kernels.marked_copy(dst, src, words[dst.storage_offset() // 32 :])
            return dst
        as_int = _INT[dst.element_size()]
        changed = dst.view(as_int) != src.view(as_int)
        dst.copy_(src)
        self._set(dst, words, changed)
        return dst

    @torch.no_grad()
    def mark(self, x: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Mark every element of view ``x`` as changed, or those where bool ``where`` (of
        ``x``'s shape) is true: for weights the trainer writes by other means."""
        words = self._words(x, "mark")
        if where is not None and where.shape != x.shape:
            raise ValueError(
                f"{self.name}: mark: where has shape {tuple(where.shape)}, the view "
                f"{tuple(x.shape)}; pass a bool tensor of the view's shape"
            )
        self._set(x, words, where)

    def _set(self, x: torch.Tensor, words: torch.Tensor, where: torch.Tensor | None) -> None:
        lo, hi = storage_span(x)
        if hi <= lo:
            return
        w0, w1 = lo // 32, -(-hi // 32)
        flags = torch.zeros((w1 - w0) * 32, dtype=torch.bool, device=words.device)
        view = flags.as_strided(x.shape, x.stride(), lo - 32 * w0)
        if where is None:
            view.fill_(True)
        else:
            view.copy_(where)
        words[w0:w1].bitwise_or_(_words_of(flags))

    def clear(self) -> None:
        """Unmark every element (the writer does at the end of each sync)."""
        for words in self._bits.values():
            words.zero_()
        self.stale = False

    def count(self) -> int:
        """How many elements are marked (reads every mark: for checks, not per step)."""
        total = 0
        for words in self._bits.values():
            w = words.to(torch.int64) & 0xFFFFFFFF
            shifts = torch.arange(32, dtype=torch.int64, device=w.device)
            total += int(((w.view(-1, 1) >> shifts) & 1).sum())
        return total

    def _kernels_for(self, x: torch.Tensor):
        if x.device.type != "cuda":
            return None
        if self._kernels is None:
            from weightbus.codecs.delta import _load_triton

            self._kernels = _load_triton() or False
        return self._kernels or None
