"""FP8 block quantization on the wire, DeepSeek-V3 style: e4m3 values, one scale per block.

A quantized 2-D weight ``W`` of shape ``(r, c)`` travels as two canonical tensors:

* ``W`` itself as ``float8_e4m3fn``, same name and shape;
* ``W_scale_inv`` (for ``...weight``: ``...weight_scale_inv``), ``float32`` of shape
  ``(ceil(r / 128), ceil(c / 128))``: the scale ``s`` of each 128 x 128 block, the factor that
  dequantizes it (``W ~= q * s``), as FP8 checkpoints and engines store it.

The formula, with every rounding spelled out (the reference in the tests follows it):

* ``amax`` = the largest ``|x|`` over the block (exact);
* ``s = fl32(max(amax, eps) / 448)``, a correctly rounded fp32 division (``eps`` rounded to
  fp32 first); with ``scale_format="ue8m0"``, ``s`` is then rounded *up* to a power of two;
* ``q = e4m3(clamp(fl32(x / s), -448, 448))``: the fp32 quotient, correctly rounded, clamped,
  then rounded to nearest-even e4m3.

A block at the tensor's edge is the part of it inside the tensor. A block with a NaN or an
infinity cannot be quantized; the writer raises, naming the tensor and the block.

Which tensors: 2-D floating-point tensors whose names match none of :attr:`Fp8Config.ignore`
(by default norms, embeddings, the output head, MoE routers and biases stay as they are).

Resharding. The scale tensors are canonical tensors of their own, planned like any other:

* A *reader* holds, for each local tensor of FP8 pieces (say ``qkv_proj``), a local scale
  tensor ``<key>_scale_inv`` laid out on the local tensor's own block grid, as engines keep it:
  local row ``x`` uses scale row ``(x + phase) // 128`` where ``phase`` is (canonical row -
  local row) mod 128, the same for every piece of that local tensor. For a shard that starts
  on a block boundary (the usual engine layout) the phase is 0 and the scale tensor has
  ``ceil(rows / 128)`` rows. A shard that cuts through a block (rows 100..300, say) gets every
  block it touches, whole: 3 scale rows for blocks 0, 1 and 2. Two pieces of a fused local
  tensor may not share a scale block (a fused component must start on a block boundary).
  :func:`quantized_layout` derives all of this from the reader's bf16 layout.
* A *writer* sends its pieces' FP8 bytes and the scales of the blocks whose first element
  (top-left corner) it holds, so each block's scale has one source (or one set of replicas).
  The writer keeps the scales of every block its pieces touch in a small grid per tensor,
  ``<tensor name>_scale_inv``.

Blocks cut by a writer's shard boundary (the design decision). FSDP cuts dim 0 into chunks
of ``ceil(rows / world)`` rows, rarely a multiple of 128, so a block is often split between
writers and no writer alone knows its ``amax``. The quantization itself is element-wise once
``s`` is known, so only ``amax`` needs agreeing on: every writer computes the partial ``amax``
of the blocks it touches, the writers all-reduce (MAX) the entries of the block rows and
columns that some writer boundary cuts (a deterministic list built at connect from all writer
layouts: :class:`WriterScales`), and then each writer quantizes its own elements with the
common ``s`` and sends them. This costs one small all-reduce per sync (about 1/8192 of the
bf16 bytes when every block is cut, nothing when shards are block-aligned), keeps the result
bit-identical to quantizing the whole tensor in one place, and needs no extra weight bytes.
The all-reduce runs through a callable the trainer supplies (:func:`all_reduce_max` wraps
``torch.distributed``), because the trainer already has a process group over its ranks.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightbus.spec import Box, Layout, LayoutBuilder, LayoutError, TensorSpec

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_IGNORE",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "Fp8Config",
    "QuantizePlan",
    "WriterScales",
    "all_reduce_max",
    "block_amax",
    "dequantize",
    "quantize",
    "quantize_blocks",
    "quantized_layout",
    "quantized_specs",
    "scale_name",
    "scale_shape",
    "scales_from_amax",
    "shared_blocks",
]

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
SCALE_DTYPE = "float32"
DEFAULT_IGNORE: tuple[str, ...] = (
    "*norm*",  # RMSNorm / LayerNorm weights (input_layernorm, q_a_layernorm, model.norm)
    "*embed*",  # token embeddings
    "*lm_head*",  # output head
    "*.gate.weight",  # MoE routers (DeepSeek, Qwen-MoE, Mixtral); not gate_proj
    "*router*",  # MoE routers named so (gpt-oss)
    "*bias",  # biases, e_score_correction_bias
)
_SOURCE_DTYPES = ("float32", "bfloat16", "float16")

AmaxReduce = Callable[[torch.Tensor], None]
"""Reduces a float32 tensor in place with MAX across all writers (an all-reduce)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8Config:
    """FP8 block quantization of weights on the wire; both sides of a job must use equal ones."""

    block: int = 128
    """Side of the square quantization block (DeepSeek-V3 and engines use 128)."""
    scale_format: str = "float32"
    """"float32": s = max(amax, eps) / 448; "ue8m0": s rounded up to a power of two (as
    DeepSeek-V3.1 checkpoints and Blackwell kernels want); stored as float32 either way."""
    eps: float = 1e-4
    """Lower bound on a block's amax, so that an all-zero block gets a usable scale."""
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    """fnmatch patterns of tensor names that stay in their own dtype."""
    ahead: int = 4
    """Buckets to each reader that hold only tensors staying in their own dtype (embeddings,
    the output head) and travel while the writers' amax pass runs, before its check for
    non-finite weights. A reader that receives in place holds them in staging buffers and
    copies them into its tensors only once the writer says its weights were finite (a failed
    sync leaves its tensors as they were): it has at least that many staging buffers and two
    more (to receive the next buckets into meanwhile), whatever
    ``SyncConfig.staging_buffers`` says. A transactional reader receives them into its copy
    at once (the engine's tensors change only at a commit). 0 sends nothing before the
    check."""
    bucket_bytes: int = 512 * 1024 * 1024
    """Smallest bucket of an FP8 job without deltas (``SyncConfig.bucket_bytes`` where that
    is larger); 0 keeps ``SyncConfig.bucket_bytes``. Every FP8 bucket is quantized into a
    writer's staging buffer and travels as one message, and each costs both hosts and GPUs
    a fixed share, so fewer larger buckets are faster. S6 (Llama-3-8B, 1 -> 1 over NCCL),
    buckets of 64, 256, 512 and 1024 MiB: 60.0, 32.0, 29.1-29.8 and 31.1 ms on 2 x H100;
    29.4 (256) and 27.7-27.9 ms (512) on 2 x H200. The price is staging memory: a writer's
    ``SyncConfig.staging_buffers`` buffers of this size, and an in-place reader's ``ahead`` + 2
    where that is more (2 GiB on a writer and a transactional reader, 3 GiB on an in-place
    reader, with the defaults). Across hosts it is unmeasured; the cluster simulator's network
    schedule, cut at the bucket size, packs Kimi-K2's plan less evenly with it (README)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if self.block < 16 or self.block > 256 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block} must be a power of two in [16, 256] (e.g. 128)")
        if self.scale_format not in ("float32", "ue8m0"):
            raise ValueError(f"scale_format={self.scale_format!r} must be 'float32' or 'ue8m0'")
        if not (math.isfinite(self.eps) and self.eps > 0 and np.float32(self.eps) > 0):
            raise ValueError(f"eps={self.eps} must be a positive number representable in fp32")
        for p in self.ignore:
            if not isinstance(p, str):
                raise TypeError(f"ignore entries are fnmatch patterns (str), got {p!r}")
        if (
            isinstance(self.ahead, bool)
            or not isinstance(self.ahead, int)
            or not 0 <= self.ahead <= 64
        ):
            raise ValueError(
                f"ahead={self.ahead!r} must be an int in [0, 64] (buckets per reader sent "
                "before the writers' check for non-finite weights)"
            )
        if (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or (self.bucket_bytes != 0 and self.bucket_bytes < 1 << 20)
        ):
            raise ValueError(
                f"bucket_bytes={self.bucket_bytes!r} must be 0 (SyncConfig.bucket_bytes) or an "
                "int of at least 1 MiB (FP8 buckets' smallest size; 512 MiB by default)"
            )

    def quantizes(self, spec: TensorSpec) -> bool:
        """Whether tensor ``spec`` travels as FP8 (2-D, floating point, not ignored)."""
        return (
            len(spec.shape) == 2
            and spec.dtype in _SOURCE_DTYPES
            and not spec.name.endswith(SCALE_SUFFIX)
            and _ignored(self.ignore).match(spec.name) is None
        )

    def key(self) -> str:
        """Everything both sides must agree on, as one string."""
        return (
            f"fp8/e4m3;block={self.block};scale={self.scale_format};"
            f"eps={float(np.float32(self.eps)).hex()};ignore={list(self.ignore)};"
            f"ahead={self.ahead};bucket={self.bucket_bytes}"
        )


@functools.lru_cache(maxsize=16)
def _ignored(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regular expression matching what any of the fnmatch ``patterns`` matches (case
    sensitive, as ``fnmatchcase``): a model of 70k tensors took 0.25 s per participant to
    test pattern by pattern, and FP8 tests every tensor several times at connect."""
    if not patterns:
        return re.compile(r"(?!)")  # matches nothing
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def scale_name(name: str) -> str:
    """``"x.weight"`` -> ``"x.weight_scale_inv"``."""
    return name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: int = 128) -> tuple[int, ...]:
    """Blocks per dim: ``(ceil(r / block), ceil(c / block))``."""
    return tuple(-(-int(n) // block) for n in shape)


def quantized_specs(specs: Iterable[TensorSpec], config: Fp8Config) -> tuple[TensorSpec, ...]:
    """The canonical tensors on the wire: each quantized weight as FP8 followed by its scales;
    the others unchanged."""
    specs = tuple(specs)
    names = {s.name for s in specs}
    out: list[TensorSpec] = []
    for s in specs:
        if not config.quantizes(s):
            out.append(s)
            continue
        sname = scale_name(s.name)
        if sname in names:
            raise ValueError(
                f"{s.name} already has a {sname} tensor beside it, so it looks quantized "
                f"already: add {s.name!r} to Fp8Config.ignore, or bind the unquantized model"
            )
        out.append(TensorSpec(name=s.name, shape=s.shape, dtype=FP8_DTYPE))
        out.append(
            TensorSpec(name=sname, shape=scale_shape(s.shape, config.block), dtype=SCALE_DTYPE)
        )
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# the math: amax per block, scales, quantize, dequantize (torch, or Triton on CUDA)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _load_triton():
    """The Triton kernels module, or None (logged once) where Triton is not importable."""
    try:
        from weightbus.codecs import _fp8_triton
    except ImportError as exc:
        logger.warning("FP8 quantization on GPU falls back to torch: triton is unusable (%s)", exc)
        return None
    return _fp8_triton


def _region_table(regions: list, block: int, device: torch.device):
    """A one-launch Triton table of fixed regions on a CUDA device, else None (torch)."""
    if torch.device(device).type != "cuda" or not regions:
        return None
    kernels = _load_triton()
    return None if kernels is None else kernels.RegionTable(regions, block, device)


def _triton_kernels(x: torch.Tensor, impl: str):
    """The Triton module when ``impl`` allows it and ``x`` is on a GPU, else None."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl={impl!r} must be 'auto', 'torch' or 'triton'")
    if impl == "torch" or x.device.type != "cuda":
        if impl == "triton":
            raise ValueError(f"impl='triton' needs a CUDA tensor, got one on {x.device}")
        return None
    kernels = _load_triton()
    if kernels is None and impl == "triton":
        raise ImportError("impl='triton' needs triton, which is not importable here")
    return kernels


def _as_2d(x: torch.Tensor, what: str) -> torch.Tensor:
    """A 2-D view of ``x`` (extra leading dims must have extent 1: a stacked expert)."""
    if x.dim() < 2 or any(n != 1 for n in x.shape[:-2]):
        raise ValueError(
            f"{what} must be 2-D (or have leading dims of extent 1), got {tuple(x.shape)}"
        )
    return x.reshape(x.shape[-2], x.shape[-1]) if x.dim() != 2 else x


def _grid(origin: Sequence[int], shape: Sequence[int], block: int) -> tuple[int, int, int, int]:
    """(row phase, col phase, block rows, block cols) of a region at canonical ``origin``."""
    pr, pc = int(origin[0]) % block, int(origin[1]) % block
    return pr, pc, -(-(pr + shape[0]) // block), -(-(pc + shape[1]) // block)


def _padded_blocks(x: torch.Tensor, origin: Sequence[int], block: int) -> torch.Tensor:
    """``x`` as fp32 in a zero-padded block grid, viewed as (block rows, block, block cols, block)."""
    h, w = x.shape
    pr, pc, nbr, nbc = _grid(origin, x.shape, block)
    pad = torch.zeros((nbr * block, nbc * block), dtype=torch.float32, device=x.device)
    pad[pr : pr + h, pc : pc + w] = x
    return pad.view(nbr, block, nbc, block)


@torch.no_grad()
def block_amax(
    x: torch.Tensor, *, origin: Sequence[int] = (0, 0), block: int = 128, impl: str = "auto"
) -> torch.Tensor:
    """Largest ``|x|`` per block (float32; NaN where a block holds a NaN).

    ``x`` is a 2-D region whose first element is at canonical ``origin``; the result covers the
    blocks it touches: ``[origin[0] // block, ceil((origin[0] + rows) / block))`` by the same
    for columns. A block the region only partly covers gets the amax of that part.
    """
    x = _as_2d(x, "block_amax input")
    tk = _triton_kernels(x, impl)
    if tk is not None:
        return tk.block_amax(x, origin, block)
    return _padded_blocks(x.abs(), origin, block).amax(dim=(1, 3))


@torch.no_grad()
def scales_from_amax(amax: torch.Tensor, config: Fp8Config) -> torch.Tensor:
    """``s = fl32(max(amax, eps) / 448)``, rounded up to a power of two for "ue8m0"."""
    a = torch.clamp_min(amax.float(), config.eps)
    # a full tensor divisor: CUDA turns division by a python scalar into a multiplication by
    # its reciprocal, which is not the correctly rounded quotient
    s = a / torch.full_like(a, FP8_MAX)
    if config.scale_format == "ue8m0":
        s = _round_up_pow2(s)
    return s


def _round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Positive fp32 values rounded up to the next power of two, on the bits (exact)."""
    bits = s.contiguous().view(torch.int32)
    up = (bits & 0x7F800000) + 0x800000
    return torch.where((bits & 0x7FFFFF) != 0, up, bits).view(torch.float32)


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    scales: torch.Tensor,
    *,
    origin: Sequence[int] = (0, 0),
    block: int = 128,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``e4m3(clamp(fl32(x / s)))`` of a 2-D region, with ``s`` its block's scale.

    ``scales`` covers the blocks the region touches (as :func:`block_amax` returns them);
    ``out`` (optional) is a float8_e4m3fn tensor of ``x``'s shape (any strides, or with
    leading dims of extent 1) that receives the result.
    """
    x = _as_2d(x, "quantize input")
    _, _, nbr, nbc = _grid(origin, x.shape, block)
    if tuple(scales.shape) != (nbr, nbc):
        raise ValueError(
            f"scales have shape {tuple(scales.shape)}, the region {tuple(x.shape)} at {tuple(origin)} "
            f"touches {nbr} x {nbc} blocks of {block}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    q = _as_2d(out, "quantize output")
    tk = _triton_kernels(x, impl)
    if tk is not None:
        tk.quantize(x, scales, origin, block, q)
        return out
    _quantize_torch(x, _expand(scales.float(), origin, x.shape, block), q)
    return out


def _quantize_torch(x: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> None:
    """The formula on torch, with ``s`` each element's scale."""
    v = x.float() / s
    q.copy_(v.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))


def _expand(scales: torch.Tensor, origin: Sequence[int], shape: Sequence[int], block: int):
    """Each element's block scale, for a region at ``origin`` (scales from its first block)."""
    r0, c0 = int(origin[0]), int(origin[1])
    dev = scales.device
    rows = torch.arange(r0, r0 + shape[0], device=dev).div_(block, rounding_mode="floor")
    cols = torch.arange(c0, c0 + shape[1], device=dev).div_(block, rounding_mode="floor")
    return scales[rows - r0 // block][:, cols - c0 // block]


@torch.no_grad()
def quantize_blocks(
    x: torch.Tensor, config: Fp8Config | None = None, *, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a whole 2-D tensor: ``(q, s)`` with ``s`` of shape ``scale_shape(x.shape)``.

    On CUDA one Triton kernel reads each block once (amax, scale and values together).
    """
    config = config or Fp8Config()
    x = _as_2d(x, "quantize_blocks input")
    tk = _triton_kernels(x, impl)
    if tk is not None:
        return tk.quantize_blocks(x, config)
    s = scales_from_amax(block_amax(x, block=config.block, impl="torch"), config)
    return quantize(x, s, block=config.block, impl="torch"), s


@torch.no_grad()
def dequantize(
    q: torch.Tensor, scales: torch.Tensor, *, origin: Sequence[int] = (0, 0), block: int = 128
) -> torch.Tensor:
    """``q * s`` in float32 for a 2-D region at canonical ``origin`` (or at the local block
    grid's phase: a reader's local scale tensor starts at block ``origin // block``)."""
    q = _as_2d(q, "dequantize input")
    return q.float() * _expand(scales.float(), origin, q.shape, block)


# ---------------------------------------------------------------------------------------------
# layouts: the wire layout of a reader or a writer from its layout of the unquantized weights
# ---------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _last2(box: Box) -> tuple[int, int, int, int]:
    return box.start[-2], box.stop[-2], box.start[-1], box.stop[-1]


def quantized_layout(layout: Layout, config: Fp8Config) -> Layout:
    """The layout a participant declares on the wire, from its layout of unquantized weights.

    Quantized tensors become FP8 (their local tensors too; a local tensor holding both
    quantized and unquantized tensors is an error), and scale tensors are added: for a reader
    the engine-style local scale tensors (see the module docstring), for a writer one small
    scale grid per tensor with pieces for the blocks whose corner it holds.
    """
    quantized = {t.name for t in layout.tensors if config.quantizes(t)}
    if not quantized:
        return layout
    who = f"{layout.role} {layout.name!r}"
    pieces = list(layout.iter_pieces())
    kinds: dict[str, dict[bool, str]] = {}
    for p in pieces:
        kinds.setdefault(p.key, {}).setdefault(p.tensor in quantized, p.tensor)
    for key, k in kinds.items():
        if len(k) == 2:
            raise LayoutError(
                f"{who}: local tensor {key!r} holds {k[True]} (quantized to FP8) and {k[False]} "
                "(kept as is): one local tensor has one dtype; add "
                f"{k[True]!r} to Fp8Config.ignore or keep the two in separate local tensors"
            )
    fp8_locals = {key for key, k in kinds.items() if True in k}
    local_keys = {lt.key for lt in layout.locals}

    b = LayoutBuilder(layout.participant)
    for s in quantized_specs(layout.tensors, config):
        b.add_tensor(s.name, s.shape, s.dtype)
    for lt in layout.locals:
        b.add_local(lt.key, lt.shape, FP8_DTYPE if lt.key in fp8_locals else lt.dtype)
    for p in pieces:
        b.add_piece(p.tensor, p.box, p.key, p.local_box)
    if layout.role == "reader":
        _add_reader_scales(b, layout, pieces, quantized, fp8_locals, local_keys, config.block)
    else:
        _add_writer_scales(b, layout, pieces, quantized, local_keys, config.block)
    return b.build()


def _scale_key_free(key: str, local_keys: set[str], who: str) -> None:
    if key in local_keys:
        raise LayoutError(
            f"{who}: local tensor {key!r} exists already, but FP8 needs that name for a scale "
            "tensor: rename the local tensor, or keep its weights unquantized (Fp8Config.ignore)"
        )


def _add_reader_scales(b, layout, pieces, quantized, fp8_locals, local_keys, block) -> None:
    who = f"reader {layout.name!r}"
    by_key: dict[str, list] = {}
    for p in pieces:
        if p.tensor in quantized:
            by_key.setdefault(p.key, []).append(p)
    locals_ = {lt.key: lt for lt in layout.locals}
    for key in (k for k in locals_ if k in fp8_locals):
        local = locals_[key]
        skey = key + SCALE_SUFFIX
        _scale_key_free(skey, local_keys, who)
        group = by_key[key]
        # canonical - local offset per piece, along the two block dims
        deltas = []
        for p in group:
            r0, _, c0, _ = _last2(p.box)
            l0, _, m0, _ = _last2(p.local_box)
            deltas.append((r0 - l0, c0 - m0))
        phases = {(dr % block, dc % block) for dr, dc in deltas}
        if len(phases) > 1:
            (a, b_), (c, d) = sorted(phases)[:2]
            raise LayoutError(
                f"{who}: the pieces of local tensor {key!r} sit at different offsets within the "
                f"{block}-element FP8 blocks (canonical - local = ({a}, {b_}) vs ({c}, {d}) mod "
                f"{block}), so one block grid of scales cannot serve them: align each tensor's "
                f"region to a multiple of {block} or keep these tensors unquantized"
            )
        pr, pc = phases.pop()
        lead = local.shape[:-2]
        sshape = (*lead, _cdiv(local.shape[-2] + pr, block), _cdiv(local.shape[-1] + pc, block))
        b.add_local(skey, sshape, SCALE_DTYPE)
        owner = np.full(sshape, -1, np.int64)
        codes: dict[tuple[str, int, int], int] = {}
        names: list[str] = []
        for p, (dr, dc) in zip(group, deltas, strict=True):
            kr, kc = dr // block, dc // block
            r0, r1, c0, c1 = _last2(p.box)
            # canonical blocks touched, and where they sit on the local scale grid
            cs = (r0 // block, c0 // block)
            ce = (_cdiv(r1, block), _cdiv(c1, block))
            ls = (cs[0] - kr, cs[1] - kc)
            le = (ce[0] - kr, ce[1] - kc)
            lead_start = p.local_box.start[: len(lead)]
            region = tuple(slice(a, a + 1) for a in lead_start) + (
                slice(ls[0], le[0]),
                slice(ls[1], le[1]),
            )
            code = codes.setdefault((p.tensor, kr, kc), len(codes))
            if code == len(names):
                names.append(p.tensor)
            seen = owner[region]
            clash = seen[(seen >= 0) & (seen != code)]
            if len(clash):
                other = names[int(clash[0])]
                cell = np.argwhere((seen >= 0) & (seen != code))[0][-2:] + np.array(ls)
                raise LayoutError(
                    f"{who}: local tensor {key!r} holds {other} and {p.tensor} in one "
                    f"{block} x {block} FP8 block (scale cell {tuple(int(v) for v in cell)} of "
                    f"{skey!r}): each tensor's region in a fused local tensor must start at a "
                    f"multiple of {block}; keep these tensors unquantized (Fp8Config.ignore) or "
                    "align them"
                )
            new = seen < 0
            if new.all():
                b.add_piece(
                    scale_name(p.tensor),
                    Box(cs, ce),
                    skey,
                    Box((*lead_start, *ls), (*[a + 1 for a in lead_start], *le)),
                )
            elif new.any():
                # the same tensor's pieces share blocks here: add only the cells not added yet,
                # as boxes of consecutive rows with the same runs of new columns
                for (i0, i1), (a, e) in _new_cell_boxes(new.reshape(new.shape[-2:])):
                    b.add_piece(
                        scale_name(p.tensor),
                        Box((cs[0] + i0, cs[1] + a), (cs[0] + i1, cs[1] + e)),
                        skey,
                        Box(
                            (*lead_start, ls[0] + i0, ls[1] + a),
                            (*[x + 1 for x in lead_start], ls[0] + i1, ls[1] + e),
                        ),
                    )
            owner[region] = np.where(new, code, seen)


def _new_cell_boxes(new: np.ndarray) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The True cells of a 2-D mask as boxes ((row start, row stop), (col start, col stop)):
    runs of True per row, merged over consecutive rows with the same runs."""
    rows: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    for i in range(new.shape[0]):
        cols = np.flatnonzero(new[i])
        runs = np.split(cols, np.flatnonzero(np.diff(cols) != 1) + 1) if len(cols) else []
        rows.append((i, tuple((int(r[0]), int(r[-1]) + 1) for r in runs)))
    boxes: list[tuple[tuple[int, int], tuple[int, int]]] = []
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j][1] == rows[i][1]:
            j += 1
        boxes.extend(((i, j), run) for run in rows[i][1])
        i = j
    return boxes


def writer_grids(
    layout: Layout, quantized: Iterable[str], block: int
) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Per quantized tensor a writer holds: (first block, end block) of the blocks its pieces
    touch, the extent of its scale grid ``<tensor>_scale_inv``."""
    quantized = set(quantized)
    out: dict[str, list[int]] = {}
    for p in layout.iter_pieces():
        if p.tensor not in quantized:
            continue
        r0, r1, c0, c1 = _last2(p.box)
        box = [r0 // block, c0 // block, _cdiv(r1, block), _cdiv(c1, block)]
        cur = out.setdefault(p.tensor, box)
        cur[0], cur[1] = min(cur[0], box[0]), min(cur[1], box[1])
        cur[2], cur[3] = max(cur[2], box[2]), max(cur[3], box[3])
    return {t: ((v[0], v[1]), (v[2], v[3])) for t, v in out.items()}


def _add_writer_scales(b, layout, pieces, quantized, local_keys, block) -> None:
    who = f"writer {layout.name!r}"
    grids = writer_grids(layout, quantized, block)
    for t, (start, stop) in grids.items():
        skey = scale_name(t)
        _scale_key_free(skey, local_keys, who)
        b.add_local(skey, (stop[0] - start[0], stop[1] - start[1]), SCALE_DTYPE)
    added: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    for p in pieces:
        if p.tensor not in quantized:
            continue
        r0, r1, c0, c1 = _last2(p.box)
        # blocks whose first element this piece holds: one owner (set of replicas) per block
        own = Box((_cdiv(r0, block), _cdiv(c0, block)), (_cdiv(r1, block), _cdiv(c1, block)))
        if own.empty or (p.tensor, own.start, own.stop) in added:
            continue
        added.add((p.tensor, own.start, own.stop))
        origin = grids[p.tensor][0]
        local = Box(
            (own.start[0] - origin[0], own.start[1] - origin[1]),
            (own.stop[0] - origin[0], own.stop[1] - origin[1]),
        )
        b.add_piece(scale_name(p.tensor), own, scale_name(p.tensor), local)


# ---------------------------------------------------------------------------------------------
# writer side: scale grids per sync, with the amax exchange for blocks cut between writers
# ---------------------------------------------------------------------------------------------


def shared_blocks(
    writers: Sequence[Layout], quantized: Iterable[str], block: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per quantized tensor, the block rows and block columns that some writer's piece boundary
    cuts through (not on a block boundary, not at the tensor's edge): the blocks whose amax
    writers must agree on. Empty when every writer piece is block-aligned."""
    quantized = set(quantized)
    rows: dict[str, set[int]] = {}
    cols: dict[str, set[int]] = {}
    for lay in writers:
        shapes = {t.name: t.shape for t in lay.tensors}
        for p in lay.iter_pieces():
            if p.tensor not in quantized:
                continue
            r0, r1, c0, c1 = _last2(p.box)
            n_r, n_c = shapes[p.tensor]
            for v, n, acc in ((r0, n_r, rows), (r1, n_r, rows), (c0, n_c, cols), (c1, n_c, cols)):
                if v % block and 0 < v < n:
                    acc.setdefault(p.tensor, set()).add(v // block)
    out = {}
    for t in sorted(rows.keys() | cols.keys()):
        out[t] = (
            np.array(sorted(rows.get(t, ())), np.int64),
            np.array(sorted(cols.get(t, ())), np.int64),
        )
    return out


def all_reduce_max(group=None) -> AmaxReduce:
    """An :data:`AmaxReduce` over a ``torch.distributed`` process group (default: the world)
    that contains every writer; with NCCL the tensor is on the GPU already."""
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    return reduce


class WriterScales:
    """One writer's FP8 scales: computed from its live weights at the start of every sync.

    Built at connect from the plan's writer layouts (the wire layouts, see
    :func:`quantized_layout`). :meth:`update` runs the amax pass over the writer's pieces,
    the all-reduce for blocks shared with other writers, and turns amaxes into scales;
    :meth:`quantize` then quantizes any region of a piece for packing.
    """

    def __init__(
        self,
        writers: Sequence[Layout],
        index: int,
        config: Fp8Config,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        layout = writers[index]
        self.name = layout.name
        names = {t.name for t in layout.tensors}
        self.quantized = {
            t.name for t in layout.tensors if t.dtype == FP8_DTYPE and scale_name(t.name) in names
        }
        block = config.block
        grids = writer_grids(layout, self.quantized, block)
        self.origin = {t: start for t, (start, _) in grids.items()}
        shapes = {t: (stop[0] - start[0], stop[1] - start[1]) for t, (start, stop) in grids.items()}
        self._offset: dict[str, int] = {}
        total = 0
        for t, (n, m) in shapes.items():
            self._offset[t] = total
            total += n * m
        # one buffer for every grid: one finiteness check, one scale conversion, one exchange
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.finite = torch.ones((), dtype=torch.bool, device=device)
        """Whether the last amax pass found every weight finite: a flag on the device, set
        in stream order (readers of buckets sent ahead learn it from the writer)."""
        # a deferred check of :attr:`finite` (see :meth:`update`): the tensors it is of
        self._deferred: Mapping[str, torch.Tensor] | None = None
        self.tensors: dict[str, torch.Tensor] = {
            scale_name(t): self.flat[self._offset[t] : self._offset[t] + n * m].view(n, m)
            for t, (n, m) in shapes.items()
        }
        """The scale grids by local key (``<tensor>_scale_inv``), packed like live tensors."""
        self._pieces = [
            (p.tensor, p.key, p.local_box.slices(), (p.box.start[-2], p.box.start[-1]))
            for p in layout.iter_pieces()
            if p.tensor in self.quantized
        ]
        self.shared = shared_blocks(writers, self.quantized, block)
        self.exchange_size, self._at, self._flat_at = self._exchange_index(writers, device)
        self._bound: Mapping[str, torch.Tensor] | None = None
        self._amax_regions: list = []
        self._amax_table = None

    def _exchange_index(self, writers, device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The exchange buffer's size (the same list of blocks on every writer: per tensor in
        name order, each cut block row whole, then each cut block column whole), and the
        entries that fall in this writer's grids: buffer positions and positions in
        :attr:`flat`."""
        block = self.config.block
        specs = {t.name: t for lay in writers for t in lay.tensors}
        pos = 0
        at, flat = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for t, (rows, cols) in self.shared.items():
            nbr, nbc = scale_shape(specs[t].shape, block)
            bi = np.concatenate([np.repeat(rows, nbc), np.tile(np.arange(nbr), len(cols))])
            bj = np.concatenate([np.tile(np.arange(nbc), len(rows)), np.repeat(cols, nbr)])
            if t in self.origin:
                n, m = self.tensors[scale_name(t)].shape
                o0, o1 = self.origin[t]
                li, lj = bi - o0, bj - o1
                mine = np.flatnonzero((li >= 0) & (li < n) & (lj >= 0) & (lj < m))
                at.append(pos + mine)
                flat.append(self._offset[t] + li[mine] * m + lj[mine])
            pos += len(bi)
        return (
            pos,
            torch.as_tensor(np.concatenate(at), device=device),
            torch.as_tensor(np.concatenate(flat), device=device),
        )

    def cut_example(self) -> str:
        """A tensor and a writer boundary that cuts a block, for messages."""
        t, (rows, cols) = next(iter(self.shared.items()))
        if len(rows):
            return f"{t} is cut inside block row {int(rows[0])}"
        return f"{t} is cut inside block column {int(cols[0])}"

    def _cells(self, tensor: str, origin: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The cells of ``tensor``'s scale grid for the blocks a region at canonical
        ``origin`` of ``shape`` (last two dims) touches."""
        block = self.config.block
        o0, o1 = self.origin[tensor]
        r, c = origin[0] // block - o0, origin[1] // block - o1
        nr = _cdiv(origin[0] + shape[-2], block) - origin[0] // block
        nc = _cdiv(origin[1] + shape[-1], block) - origin[1] // block
        return self.tensors[scale_name(tensor)][r : r + nr, c : c + nc]

    def bind(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fix the live tensors the amax pass reads: each piece's region and grid cells are
        found once, and on CUDA one kernel launch covers every piece, whenever
        :meth:`partial` is passed this same mapping (its tensors must stay in place)."""
        regions = []
        for t, key, index, origin in self._pieces:
            x = _as_2d(tensors[key][index], f"{t} piece")
            regions.append((x, origin, self._cells(t, origin, x.shape), 0, 0))
        self._amax_table = _region_table(regions, self.config.block, self.flat.device)
        self._amax_regions = regions
        self._bound = tensors

    def plan(self, items: Iterable[tuple[str, torch.Tensor, Sequence[int], int]]) -> QuantizePlan:
        """A :class:`QuantizePlan` for ``(tensor, region, origin, offset)`` items: the region
        (of a piece of ``tensor``, first element at canonical ``origin``) quantized into a
        byte buffer at ``offset``, row-major."""
        regions = []
        for t, region, origin, offset in items:
            x = _as_2d(region, f"{t} region")
            origin = (int(origin[0]), int(origin[1]))
            regions.append((x, origin, self._cells(t, origin, x.shape), int(offset), x.shape[1]))
        return QuantizePlan(regions, self.config.block, self.flat.device)

    @torch.no_grad()
    def partial(
        self, tensors: Mapping[str, torch.Tensor], *, defer_check: bool = False
    ) -> torch.Tensor | None:
        """Amax of the blocks this writer touches, into its grids; returns the exchange buffer
        (its entries for shared blocks, 0 where it holds none) or None when none is needed.
        Non-finite weights raise here, or with ``defer_check`` and no exchange, at
        :meth:`check`."""
        block = self.config.block
        self._deferred = None
        self.flat.zero_()
        if tensors is self._bound and self._amax_table is not None:
            self._amax_table.amax()
        elif tensors is self._bound:
            for x, origin, g, _, _ in self._amax_regions:
                torch.maximum(g, block_amax(x, origin=origin, block=block, impl="torch"), out=g)
        else:
            for t, key, index, origin in self._pieces:
                region = tensors[key][index]
                a = block_amax(region, origin=origin, block=block)
                g = self._cells(t, origin, region.shape)
                torch.maximum(g, a, out=g)
        self.finite = torch.isfinite(self.flat).all()
        if defer_check and self.exchange_size == 0:
            self._deferred = tensors  # checked by check(), once more work is queued
            return None
        if not bool(self.finite):
            self._raise_non_finite()
        if self.exchange_size == 0:
            return None
        buf = torch.zeros(self.exchange_size, dtype=torch.float32, device=self.flat.device)
        buf[self._at] = self.flat[self._flat_at]
        return buf

    def _raise_non_finite(self) -> None:
        block = self.config.block
        for t in sorted(self.origin):
            g = self.tensors[scale_name(t)]
            bad = torch.nonzero(~torch.isfinite(g))
            if len(bad):
                i, j = (int(v) for v in bad[0])
                o0, o1 = self.origin[t]
                raise ValueError(
                    f"writer {self.name!r}: {t} holds NaN or infinite values in FP8 block "
                    f"({i + o0}, {j + o1}) (rows {(i + o0) * block}.., cols {(j + o1) * block}..): "
                    "such weights cannot be quantized; check the training step, or keep "
                    f"{t!r} unquantized (Fp8Config.ignore)"
                )

    @torch.no_grad()
    def finish(self, exchanged: torch.Tensor | None) -> None:
        """Take the all-reduced amaxes back and turn every amax into a scale."""
        if exchanged is not None:
            self.flat[self._flat_at] = exchanged[self._at]
        self.flat.copy_(scales_from_amax(self.flat, self.config))

    def check(self) -> None:
        """Raise for non-finite weights, if :meth:`update` deferred that check (a no-op
        otherwise). Waits for the amax pass."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None and not bool(self.finite):
            # the scales no longer say which block (ue8m0 turns a NaN into -0): amax again,
            # which raises naming it
            self.partial(deferred)
            raise RuntimeError(
                f"writer {self.name!r}: the amax pass found NaN or infinite weights, a second "
                "pass none: were the weights modified during the sync? Sync only between "
                "optimizer steps"
            )

    def update(
        self,
        tensors: dict[str, torch.Tensor],
        reduce: AmaxReduce | None,
        *,
        defer_check: bool = False,
    ) -> None:
        """:meth:`partial`, the all-reduce, :meth:`finish`: the scales of this sync.

        With ``defer_check`` a writer that shares no block with another leaves the check
        for non-finite weights to :meth:`check`, and this returns without waiting for the
        amax pass: the caller queues its first pack behind it, then checks before the first
        send. Writers that exchange amaxes check before the all-reduce, so that a non-finite
        amax never reaches another writer's scales."""
        buf = self.partial(tensors, defer_check=defer_check)
        if buf is not None:
            if reduce is None:
                raise ValueError(
                    f"writer {self.name!r}: writer shards cut FP8 blocks ({self.cut_example()}), "
                    "so writers must agree on those blocks' amax: pass an amax reduce over the "
                    "trainer's ranks (weightbus.codecs.fp8.all_reduce_max(group)), or shard "
                    f"at multiples of {self.config.block}"
                )
            reduce(buf)
        self.finish(buf)

    def quantize(
        self,
        tensor: str,
        region: torch.Tensor,
        origin: Sequence[int],
        out: torch.Tensor,
    ) -> None:
        """Quantize ``region`` (of a piece of ``tensor``, first element at canonical
        ``origin``) into ``out`` with this sync's scales."""
        s = self._cells(tensor, origin, region.shape)
        quantize(region, s, origin=origin, block=self.config.block, out=out)


class QuantizePlan:
    """Fixed regions of a writer's pieces, quantized into fixed places of a byte buffer with
    the scales the grids hold at the time: built once per bucket at connect
    (:meth:`WriterScales.plan`), run at every pack. On CUDA one Triton launch covers every
    region; elsewhere torch, region by region, with each element's scale index precomputed.
    """

    def __init__(self, regions: list, block: int, device: torch.device) -> None:
        self.regions = regions
        """Per region: (2-D source, canonical origin, its scale cells, offset, row stride)."""
        self._table = _region_table(regions, block, device)
        self._torch = []
        if self._table is None:
            for x, origin, s, offset, _ in regions:
                rows = torch.arange(origin[0], origin[0] + x.shape[0], device=s.device)
                cols = torch.arange(origin[1], origin[1] + x.shape[1], device=s.device)
                rows = rows.div_(block, rounding_mode="floor") - origin[0] // block
                cols = cols.div_(block, rounding_mode="floor") - origin[1] // block
                self._torch.append((x, s, rows, cols, offset, x.shape[0] * x.shape[1]))

    def run(self, out: torch.Tensor) -> None:
        """Quantize every region into ``out`` (uint8, contiguous) at its offset."""
        if self._table is not None:
            self._table.quantize(out)
            return
        for x, s, rows, cols, offset, n in self._torch:
            q = out[offset : offset + n].view(torch.float8_e4m3fn).view(x.shape)
            _quantize_torch(x, s[rows][:, cols], q)
