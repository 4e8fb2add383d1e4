"""Checkpoints in host memory: safetensors files, ``save_pretrained`` directories, pinned tensors.

A :class:`HostCheckpoint` holds canonical tensors (checkpoint names, shapes, dtypes) in host
memory, all of them or one *shard*: the checkpoint's bytes, in file order, cut into
``world x chunks`` runs of equal size at row boundaries (dim 0). Shard ``rank`` holds runs
``rank * chunks .. rank * chunks + chunks - 1``, so each shard is one contiguous byte range of
the files and each chunk a contiguous part of it (see :func:`split_rows`). A chunk is a list of
:class:`Part`\\ s (rows ``start:stop`` of one tensor), and its :meth:`HostCheckpoint.layout` is a
writer layout like any trainer's: the planner routes its rows into any reader layout, fused or
not, and a reader may need any subset of the checkpoint.

Where the bytes come from:

* :func:`open_checkpoint` reads safetensors files: one file, several, or a directory written by
  ``save_pretrained`` (``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``). Files on a RAM-backed file system (``/dev/shm``) are
  mapped and used in place, page-locked where they lie with ``cudaHostRegister`` when
  ``pin``, never copied; other files are read, only the shard's byte range, into a buffer
  (page-locked when ``pin``). The header is parsed here rather than through the safetensors
  package because its API returns tensor copies, and mapping in place needs byte offsets.
* :meth:`HostCheckpoint.from_tensors` copies tensors (a trainer's offloaded state dict) into
  one buffer; :meth:`HostCheckpoint.allocate` makes that buffer for the caller to fill.

:func:`load_into` writes a checkpoint straight into live tensors of this process (an engine's
parameters, bound as a reader layout) through the same plan, with no transport: cold starts
and tests. :class:`weightbus.sources.host.HostSource` serves a checkpoint to readers in other
processes and on other GPUs.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from weightbus.plan import PlanOptions, build_program, make_plan, pack, unpack
from weightbus.sources import _memory
from weightbus.spec import (
    BoundLayout,
    Box,
    Layout,
    LayoutBuilder,
    LayoutError,
    Participant,
    TensorSpec,
    itemsize,
    torch_dtype,
)

__all__ = [
    "HostCheckpoint",
    "Part",
    "checkpoint_files",
    "load_into",
    "open_checkpoint",
    "read_header",
    "split_rows",
]

logger = logging.getLogger(__name__)

MiB = 1 << 20
_ALIGN = 256  # byte alignment of tensors laid out by from_tensors / allocate
_MAX_HEADER = 100 * MiB

# safetensors dtype codes -> weightbus dtype names
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


# ---------------------------------------------------------------------------------------------
# safetensors files
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """One canonical tensor and where its bytes lie: ``begin`` in the data of file ``file``."""

    spec: TensorSpec
    file: int
    begin: int


def read_header(path: str | os.PathLike[str]) -> tuple[int, list[tuple[TensorSpec, int]]]:
    """A safetensors file's data offset and its tensors as ``(spec, byte offset in the data)``,
    sorted by offset."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"{str(path)!r} is not a safetensors file (header length {n}, file size {size})"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(path)!r}: the safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{str(path)!r}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - n
    out = []
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{str(path)!r}: tensor {name!r} has a malformed entry {info!r}"
            ) from None
        if code not in _ST_DTYPES:
            raise ValueError(
                f"{str(path)!r}: tensor {name!r} has dtype {code}, which weightbus does not move "
                f"(known: {', '.join(_ST_DTYPES)})"
            )
        spec = TensorSpec(name=name, shape=tuple(shape), dtype=_ST_DTYPES[code])
        if end - begin != spec.nbytes or begin < 0 or end > data:
            raise ValueError(
                f"{str(path)!r}: tensor {name!r} {spec.shape} {spec.dtype} needs {spec.nbytes} "
                f"bytes, its data_offsets are [{begin}, {end}) of {data}: the file is damaged"
            )
        if spec.nbytes and (8 + n + begin) % itemsize(spec.dtype):
            raise ValueError(
                f"{str(path)!r}: tensor {name!r} starts at byte {8 + n + begin}, not aligned to "
                f"its {spec.dtype} elements; save the file again with safetensors >= 0.3"
            )
        out.append((spec, int(begin)))
    out.sort(key=lambda x: x[1])
    for (a, ab), (b, bb) in zip(out, out[1:], strict=False):
        if ab + a.nbytes > bb:
            raise ValueError(f"{str(path)!r}: tensors {a.name!r} and {b.name!r} overlap")
    return 8 + n, out


def checkpoint_files(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The safetensors files of a checkpoint: a file, a list of files, or a directory (its
    ``model.safetensors.index.json`` when there is one, else every ``*.safetensors`` in it)."""
    if isinstance(path, (list, tuple)):
        files = [Path(p) for p in path]
    else:
        p = Path(path)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text()).get("weight_map", {})
                files = [p / f for f in sorted(set(weight_map.values()))]
            else:
                files = sorted(p.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{str(p)!r} holds no *.safetensors files: save the model with "
                    "save_pretrained(..., safe_serialization=True) or pass the files"
                )
        else:
            files = [p]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {str(f)!r} does not exist")
    return files


# ---------------------------------------------------------------------------------------------
# shards and chunks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """Rows ``start:stop`` (of dim 0) of canonical tensor ``spec``; its bytes are ``nbytes`` at
    ``begin`` in the data of file ``file`` (the whole tensor when it has no dims)."""

    spec: TensorSpec
    """The canonical tensor."""
    start: int
    """First row held."""
    stop: int
    """End row (exclusive)."""
    file: int
    """Index of the file (or host buffer) holding the bytes."""
    begin: int
    """Byte offset of row ``start`` in that file's data."""
    nbytes: int
    """Bytes of the rows."""

    @property
    def whole(self) -> bool:
        """Whether the part is the whole tensor."""
        return self.start == 0 and self.stop == (self.spec.shape[0] if self.spec.shape else 1)

    @property
    def key(self) -> str:
        """Local tensor key: the tensor's name, with ``@start:stop`` when it is a slice."""
        return self.spec.name if self.whole else f"{self.spec.name}@{self.start}:{self.stop}"

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the rows held."""
        s = self.spec.shape
        return (self.stop - self.start, *s[1:]) if s else ()

    @property
    def box(self) -> Box:
        """The region of the canonical tensor held."""
        s = self.spec.shape
        return Box((self.start,) + (0,) * (len(s) - 1), (self.stop, *s[1:])) if s else Box((), ())


def split_rows(entries: Sequence[_Entry], runs: int) -> list[tuple[Part, ...]]:
    """Cut the entries' bytes, in order, into ``runs`` contiguous runs of equal size, each cut
    at the row boundary nearest to it. Tensors without elements belong to no run."""
    if runs < 1:
        raise ValueError(f"runs={runs} must be at least 1")
    total = sum(e.spec.nbytes for e in entries)
    bounds = [total * i // runs for i in range(runs + 1)]
    out: list[list[Part]] = [[] for _ in range(runs)]
    pos = 0
    for e in entries:
        nb = e.spec.nbytes
        if nb == 0:
            continue
        rows = e.spec.shape[0] if e.spec.shape else 1
        row = nb // rows
        # run i holds rows [cut(bounds[i]), cut(bounds[i + 1])): one cut function for both
        # ends, so runs neither overlap nor leave gaps
        i = max(bisect.bisect_right(bounds, pos) - 1, 0)
        while i < runs and bounds[i] < pos + nb:
            lo, hi = _cut(bounds[i], pos, rows, row), _cut(bounds[i + 1], pos, rows, row)
            if lo < hi:
                out[i].append(
                    Part(
                        spec=e.spec,
                        start=lo,
                        stop=hi,
                        file=e.file,
                        begin=e.begin + lo * row,
                        nbytes=(hi - lo) * row,
                    )
                )
            i += 1
        pos += nb
    return [tuple(p) for p in out]


def _cut(bound: int, pos: int, rows: int, row: int) -> int:
    """The row boundary nearest to byte ``bound`` of a tensor starting at byte ``pos``."""
    return min(max((bound - pos + row // 2) // row, 0), rows)


# ---------------------------------------------------------------------------------------------
# the checkpoint in host memory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Memory:
    """Host bytes of one file's data from byte ``lo``: ``data[i]`` is data byte ``lo + i``."""

    data: torch.Tensor
    lo: int
    mapped: bool


class HostCheckpoint:
    """Canonical tensors, all of a checkpoint or one shard of it, in host memory.

    Build one with :func:`open_checkpoint`, :meth:`from_tensors` or :meth:`allocate`. It owns
    its memory (page-locked registrations included) until :meth:`close`.
    """

    def __init__(
        self,
        *,
        specs: Sequence[TensorSpec],
        parts: Sequence[Sequence[Part]],
        memory: Mapping[int, _Memory],
        rank: int,
        world: int,
        pinned: bool,
        sources: Sequence[str],
        registered: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        """Every canonical tensor of the checkpoint (held here or not), in file order."""
        self.rank, self.world, self.chunks = rank, world, len(parts)
        self.parts: tuple[tuple[Part, ...], ...] = tuple(tuple(c) for c in parts)
        """This shard's parts, per chunk."""
        self.pinned = pinned
        """Whether this shard's host memory is page-locked (fast host->device copies)."""
        self.sources = tuple(sources)
        """Where the bytes came from: file paths, or ``<host>`` for tensors given in memory."""
        self._memory = dict(memory)
        self._registered = list(registered)
        self._finalizer = weakref.finalize(self, _release, self._registered)
        for chunk in self.parts:
            for p in chunk:
                if p.file not in self._memory:
                    raise AssertionError(f"no memory for {p.key} in file {p.file}")

    # -- what it holds ----------------------------------------------------------------------

    @property
    def in_place(self) -> bool:
        """Whether every file this shard reads is mapped in place rather than copied."""
        return bool(self._memory) and all(m.mapped for m in self._memory.values())

    @property
    def nbytes(self) -> int:
        """Bytes of canonical data this shard holds."""
        return sum(p.nbytes for chunk in self.parts for p in chunk)

    def view(self, part: Part) -> torch.Tensor:
        """The host tensor holding ``part`` (its rows, shaped), a view of this shard's memory."""
        m = self._memory[part.file]
        raw = m.data[part.begin - m.lo : part.begin - m.lo + part.nbytes]
        return raw.view(torch_dtype(part.spec.dtype)).view(part.shape)

    def tensors(self, chunk: int | None = None) -> dict[str, torch.Tensor]:
        """Local tensors by key (see :attr:`Part.key`) of one chunk, or of the whole shard."""
        chunks = self.parts if chunk is None else (self.parts[chunk],)
        return {p.key: self.view(p) for c in chunks for p in c}

    def runs(self, chunk: int) -> list[tuple[int, int, int, torch.Tensor]]:
        """A chunk's bytes as contiguous host runs ``(file, lo, hi, bytes)``: what a staged
        source copies to its device, one copy per run."""
        out: list[list] = []
        for p in self.parts[chunk]:
            if out and out[-1][0] == p.file and out[-1][2] == p.begin:
                out[-1][2] = p.begin + p.nbytes
            else:
                out.append([p.file, p.begin, p.begin + p.nbytes])
        result = []
        for f, lo, hi in out:
            m = self._memory[f]
            result.append((f, lo, hi, m.data[lo - m.lo : hi - m.lo]))
        return result

    def layout(self, participant: Participant, chunk: int = 0) -> Layout:
        """The writer layout of one chunk: each part a local tensor (key :attr:`Part.key`)
        holding its rows of the canonical tensor."""
        b = LayoutBuilder(participant)
        for p in self.parts[chunk]:
            b.add_tensor(p.spec.name, p.spec.shape, p.spec.dtype)
            b.add_local(p.key, p.shape, p.spec.dtype)
            b.add_piece(p.spec.name, p.box, p.key, Box.whole(p.shape))
        return b.build()

    def bind(self, participant: Participant, chunk: int = 0) -> BoundLayout:
        """:meth:`layout` bound to this shard's host tensors (a writer serving host memory)."""
        return BoundLayout(layout=self.layout(participant, chunk), tensors=self.tensors(chunk))

    def close(self) -> None:
        """Release page-locked registrations and drop the memory. Safe to call twice."""
        self._finalizer()
        self._memory.clear()

    def __enter__(self) -> HostCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostCheckpoint(shard {self.rank}/{self.world}, {self.chunks} chunk(s), "
            f"{self.nbytes / 1e6:.1f} MB of {len(self.specs)} tensors, "
            f"{'mapped in place' if self.in_place else 'copied'}, "
            f"{'pinned' if self.pinned else 'pageable'})"
        )

    # -- from tensors -----------------------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        specs: Iterable[TensorSpec],
        *,
        rank: int = 0,
        world: int = 1,
        chunks: int = 1,
        pin: bool | None = None,
    ) -> HostCheckpoint:
        """Host memory for shard ``rank`` of tensors ``specs`` (in this order), uninitialised:
        fill each part's :meth:`view`. ``pin``: page-lock it (default: when CUDA is present)."""
        _check_shard(rank, world, chunks)
        pin = torch.cuda.is_available() if pin is None else pin
        entries, at = [], 0
        for s in specs:
            entries.append(_Entry(spec=s, file=0, begin=at))
            at += -(-s.nbytes // _ALIGN) * _ALIGN
        parts = _shard(entries, rank, world, chunks)
        lo, hi = _span(parts, 0)
        buf, registration = _memory.host_buffer(hi - lo, pin=pin)
        return cls(
            specs=[e.spec for e in entries],
            parts=parts,
            memory={0: _Memory(buf, lo, False)},
            rank=rank,
            world=world,
            pinned=pin,
            sources=["<host>"],
            registered=[registration] if registration else [],
        )

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        rank: int = 0,
        world: int = 1,
        chunks: int = 1,
        pin: bool | None = None,
    ) -> HostCheckpoint:
        """Shard ``rank`` of named tensors (any device), copied into host memory (page-locked
        when ``pin``; default: when CUDA is present). Only the shard's rows are copied."""
        specs = [
            TensorSpec(name=k, shape=tuple(t.shape), dtype=str(t.dtype)) for k, t in tensors.items()
        ]
        ckpt = cls.allocate(specs, rank=rank, world=world, chunks=chunks, pin=pin)
        for chunk in ckpt.parts:
            for p in chunk:
                src = tensors[p.spec.name]
                ckpt.view(p).copy_(src[p.start : p.stop] if src.dim() else src)
        return ckpt


def _shard(entries: Sequence[_Entry], rank: int, world: int, chunks: int) -> list[tuple[Part, ...]]:
    """The parts of shard ``rank``, per chunk: runs ``rank * chunks ...`` of the split."""
    runs = split_rows(entries, world * chunks)
    return runs[rank * chunks : (rank + 1) * chunks]


def _check_shard(rank: int, world: int, chunks: int) -> None:
    if world < 1 or chunks < 1:
        raise ValueError(f"world={world} and chunks={chunks} must be at least 1")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, {world}) for world={world}")


def _span(parts: Sequence[Sequence[Part]], file: int) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of ``file`` the parts cover, ``lo`` rounded down to keep
    the file's alignment (views of a buffer starting there stay aligned)."""
    ps = [p for chunk in parts for p in chunk if p.file == file]
    if not ps:
        return 0, 0
    lo = min(p.begin for p in ps)
    return lo - lo % _ALIGN, max(p.begin + p.nbytes for p in ps)


def _release(registered: list[tuple[int, torch.Tensor]]) -> None:
    # the tensors keep the mapped memory alive until it is unregistered
    while registered:
        address, _keep = registered.pop()
        _memory.unregister(address)


def open_checkpoint(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    rank: int = 0,
    world: int = 1,
    chunks: int = 1,
    pin: bool | None = None,
    map_in_place: bool | None = None,
    names: Iterable[str] | None = None,
) -> HostCheckpoint:
    """Shard ``rank`` of ``world`` (each cut in ``chunks``) of a safetensors checkpoint.

    ``path``: a file, a list of files, or a ``save_pretrained`` directory. ``pin``: page-lock
    the shard's memory for fast host->device copies (default: when CUDA is present).
    ``map_in_place``: map files instead of reading them (default: files on a RAM-backed file
    system such as ``/dev/shm``, which are then used, and page-locked, where they lie).
    ``names``: keep only these tensors (a reader's), ignoring the rest of the checkpoint.
    """
    _check_shard(rank, world, chunks)
    pin = torch.cuda.is_available() if pin is None else pin
    files = checkpoint_files(path)
    wanted = None if names is None else set(names)
    entries: list[_Entry] = []
    starts: list[int] = []
    seen: dict[str, Path] = {}
    for i, f in enumerate(files):
        start, tensors = read_header(f)
        starts.append(start)
        for spec, begin in tensors:
            if spec.name in seen:
                raise ValueError(
                    f"tensor {spec.name!r} is in both {str(seen[spec.name])!r} and {str(f)!r}"
                )
            seen[spec.name] = f
            if wanted is None or spec.name in wanted:
                entries.append(_Entry(spec=spec, file=i, begin=begin))
    if wanted is not None and wanted - set(seen):
        missing = sorted(wanted - set(seen))
        raise KeyError(
            f"checkpoint {[str(f) for f in files]} has no tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    parts = _shard(entries, rank, world, chunks)
    memory: dict[int, _Memory] = {}
    registered: list[tuple[int, torch.Tensor]] = []
    try:
        for i, f in enumerate(files):
            lo, hi = _span(parts, i)
            if hi <= lo:
                continue
            in_place = _memory.on_ram_fs(f) if map_in_place is None else map_in_place
            whole = _map(f, pin) if in_place else None
            if whole is not None:
                data = whole[starts[i] + lo : starts[i] + hi]
                if pin:
                    address, _ = _memory.register(data, f"checkpoint file {str(f)!r}")
                    registered.append((address, whole))
                memory[i] = _Memory(data, lo, True)
            else:
                buf, registration = _memory.host_buffer(hi - lo, pin=pin)
                if registration:
                    registered.append(registration)
                _read_into(f, starts[i] + lo, buf)
                memory[i] = _Memory(buf, lo, False)
    except BaseException:
        _release(registered)
        raise
    ckpt = HostCheckpoint(
        specs=[e.spec for e in entries],
        parts=parts,
        memory=memory,
        rank=rank,
        world=world,
        pinned=pin,
        sources=[str(f) for f in files],
        registered=registered,
    )
    logger.info("opened %r", ckpt)
    return ckpt


def _map(path: Path, pin: bool) -> torch.Tensor | None:
    """The whole file as a uint8 tensor over its pages, or None when it cannot be mapped.

    Memory to be page-locked is mapped shared: locking a private mapping for device writes
    would copy every page. Otherwise it is mapped private and read-only.
    """
    try:
        return torch.from_file(str(path), shared=pin, size=path.stat().st_size, dtype=torch.uint8)
    except (RuntimeError, OSError) as e:
        logger.warning("could not map %s in place (%s): reading it into a copy", path, e)
        return None


def _read_into(path: Path, offset: int, buf: torch.Tensor) -> None:
    view = memoryview(buf.numpy()).cast("B")
    with path.open("rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + 256 * MiB])
            if not n:
                raise ValueError(
                    f"{str(path)!r} ended after {offset + done} bytes, its header needs "
                    f"{offset + len(view)}: the file is truncated"
                )
            done += n


# ---------------------------------------------------------------------------------------------
# in-process load
# ---------------------------------------------------------------------------------------------


def load_into(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | HostCheckpoint,
    bound: BoundLayout,
    *,
    cast: Mapping[str, str] | None = None,
    bucket_bytes: int = 64 * MiB,
) -> int:
    """Write a checkpoint into live tensors of this process, in place, through the plan.

    ``bound`` is a reader layout with its live tensors: an engine's parameters bound with
    :func:`weightbus.engines.hf.bind`, a fused vLLM-style
    :func:`~weightbus.layouts.fused.engine_layout`, any layout. Every tensor the layout needs must be in the checkpoint (with its shape; a
    different dtype needs ``cast``); the rest of the checkpoint is not read. ``source`` is a
    path (files are mapped, not read whole) or a :class:`HostCheckpoint`. Returns the bytes
    written (canonical bytes). No transport and no other process: one bucket at a time, packed
    on the host and unpacked on the tensors' device.
    """
    if bound.layout.role != "reader":
        raise ValueError(
            f"load_into writes into a reader layout, got {bound.layout.role} {bound.layout.name!r}"
        )
    needed = {t.name for t in bound.layout.tensors}
    own = not isinstance(source, HostCheckpoint)
    ckpt = open_checkpoint(source, names=needed, pin=False, map_in_place=True) if own else source
    try:
        if (ckpt.rank, ckpt.world) != (0, 1):
            raise ValueError(
                f"load_into needs the whole checkpoint, got shard {ckpt.rank} of {ckpt.world}"
            )
        if ckpt.chunks != 1:
            raise ValueError(f"load_into takes a checkpoint of one chunk, got {ckpt.chunks}")
        writer = ckpt.layout(Participant(role="writer", rank=0, name="checkpoint"), 0)
        reader = dataclasses.replace(
            bound.layout,
            participant=dataclasses.replace(bound.layout.participant, rank=0),
            _memo={},
        )
        unread = [s.name for s in ckpt.specs if s.name not in needed]
        plan = make_plan(
            [writer],
            [reader],
            PlanOptions(
                bucket_bytes=bucket_bytes,
                cast=dict(cast or {}),
                ignore_unread=tuple(unread),
                direct_bytes=0,
            ),
        )
        sources = ckpt.tensors(0)
        w_ops = {op.bucket: op for op in build_program(plan, "writer", 0)}
        devices = {t.device for t in bound.tensors.values()}
        if len(devices) > 1:
            raise LayoutError(
                f"{bound.layout.name}: live tensors span devices {sorted(map(str, devices))}; "
                "bind the tensors of one device at a time"
            )
        device = devices.pop() if devices else torch.device("cpu")
        to_gpu = device.type == "cuda"
        largest = max((op.nbytes for op in w_ops.values()), default=0)
        host = torch.empty(largest, dtype=torch.uint8, pin_memory=to_gpu)
        staged = torch.empty(largest, dtype=torch.uint8, device=device) if to_gpu else host
        moved = 0
        for rop in build_program(plan, "reader", 0):
            wop = w_ops[rop.bucket]
            pack(wop, sources, host[: wop.nbytes])
            if to_gpu:
                staged[: wop.nbytes].copy_(host[: wop.nbytes])
            unpack(rop, bound.tensors, staged[: rop.nbytes])
            moved += sum(c.nbytes for c in rop.copies)
        if to_gpu:
            torch.cuda.synchronize(device)
        logger.info(
            "loaded %.1f MB from %s into %s",
            moved / 1e6,
            ", ".join(ckpt.sources),
            bound.layout.name,
        )
        return moved
    finally:
        if own:
            ckpt.close()
