"""What each participant holds: tensors, boxes, pieces and layouts.

A *canonical tensor* is one logical parameter under its checkpoint name, with its global
shape and dtype. A *box* is a half-open region of it. A *piece* says "this box of canonical
tensor T lives at that box of my local tensor K". A *layout* is every piece one participant
(a writer on the trainer side, a reader on the inference side) holds.

Pieces are stored column-wise (:class:`PieceTable`) because a large model over hundreds of
participants has close to a million of them, and the planner works on whole columns at once.
Boxes in a table are right-aligned to ``ndim`` columns: a canonical box of fewer dims is padded
on the left with ``[0, 1)``, so a local tensor may carry extra leading dims of extent 1 (one
expert's 2-D weight inside a stacked 3-D ``w13``).

Everything here serialises to JSON or msgpack (never pickle) and has a stable digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

__all__ = [
    "BoundLayout",
    "Box",
    "LayoutError",
    "Layout",
    "LayoutBuilder",
    "LocalTensor",
    "Participant",
    "Piece",
    "PieceTable",
    "TensorSpec",
    "dtype_name",
    "gpu_uuid",
    "itemsize",
    "this_process",
    "torch_dtype",
]

ROLES = ("writer", "reader")


class LayoutError(ValueError):
    """A layout, or a disagreement between layouts, that no transfer can satisfy."""


# ---------------------------------------------------------------------------------------------
# dtypes travel as names ("bfloat16"), never as torch objects
# ---------------------------------------------------------------------------------------------

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    return _DTYPES[dtype_name(name)]


_ITEMSIZE: dict[str, int] = {}


def itemsize(name: str) -> int:
    """Bytes per element of a dtype given by name."""
    size = _ITEMSIZE.get(name)
    if size is None:
        size = _ITEMSIZE[name] = torch.empty((), dtype=torch_dtype(name)).element_size()
    return size


# ---------------------------------------------------------------------------------------------
# small value types
# ---------------------------------------------------------------------------------------------


def _shape(values: Iterable[int], what: str) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{what} {out} has a negative extent")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One canonical tensor: checkpoint name, global shape, dtype name."""

    name: str
    """Checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """dtype name (``bfloat16``, ``float32``, ...)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape(self.shape, f"tensor {self.name!r} shape"))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Box:
    """A region of a tensor: a half-open range ``[start[d], stop[d])`` per dim."""

    start: tuple[int, ...]
    """First index per dim (inclusive)."""
    stop: tuple[int, ...]
    """End index per dim (exclusive)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", tuple(int(v) for v in self.start))
        object.__setattr__(self, "stop", tuple(int(v) for v in self.stop))
        if len(self.start) != len(self.stop):
            raise ValueError(f"box start {self.start} and stop {self.stop} differ in length")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def at(cls, start: Sequence[int], shape: Sequence[int]) -> Box:
        """The box of ``shape`` whose first index is ``start``."""
        return cls(tuple(start), tuple(int(s) + int(n) for s, n in zip(start, shape, strict=True)))

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.start)

    @property
    def shape(self) -> tuple[int, ...]:
        """Extent per dim."""
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def numel(self) -> int:
        """Number of elements (0 when empty)."""
        n = 1
        for a, b in zip(self.start, self.stop, strict=True):
            n *= max(b - a, 0)
        return n

    @property
    def empty(self) -> bool:
        """Whether some dim has no extent."""
        return any(b <= a for a, b in zip(self.start, self.stop, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when they do not overlap."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start, strict=True))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True))
        if any(b <= a for a, b in zip(start, stop, strict=True)):
            return None
        return Box(start, stop)

    def contains(self, other: Box) -> bool:
        """Whether ``other`` lies entirely inside this box."""
        return all(
            a <= c and d <= b
            for a, b, c, d in zip(self.start, self.stop, other.start, other.stop, strict=True)
        )

    def slices(self) -> tuple[slice, ...]:
        """Slices that index this region of a tensor (``t[box.slices()]``)."""
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True)) + "]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Box ``box`` of canonical tensor ``tensor`` is box ``local_box`` of local tensor ``key``.

    ``local_box`` may have more dims than ``box``; the extra leading dims have extent 1.
    """

    tensor: str
    """Canonical tensor name."""
    box: Box
    """Region of the canonical tensor."""
    key: str
    """Local tensor key."""
    local_box: Box
    """Region of the local tensor holding it (may have extra leading dims of extent 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTensor:
    """A tensor as the participant stores it (an engine parameter, a trainer shard)."""

    key: str
    """Key of the local tensor (a parameter name, an engine's fused parameter)."""
    shape: tuple[int, ...]
    """Shape as the participant stores it."""
    dtype: str
    """dtype name."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape(self.shape, f"local tensor {self.key!r} shape"))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))


_PROCESS_LOCK = threading.Lock()
_PROCESS: list = [0, ""]  # [pid, id]: drawn again in a forked child


def _forked() -> None:
    # a fork may copy the lock held by another thread: the child starts afresh
    global _PROCESS_LOCK
    _PROCESS_LOCK = threading.Lock()
    _PROCESS[:] = [0, ""]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def this_process() -> str:
    """An id of the calling process, ``<pid>-<random>``: equal for every thread of the
    process, distinct from every other process (of any host, and after a fork)."""
    pid = os.getpid()
    with _PROCESS_LOCK:
        if _PROCESS[0] != pid:
            _PROCESS[:] = [pid, f"{pid}-{uuid.uuid4().hex[:12]}"]
        return _PROCESS[1]


def gpu_uuid(device: str | torch.device) -> str:
    """The UUID of CUDA device ``device`` as this process numbers its GPUs (after its
    ``CUDA_VISIBLE_DEVICES``), or "" for another device type, or where CUDA or that GPU is
    not available. Initializes CUDA in this process for a cuda device."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return ""  # not a device torch knows: no GPU identity
    if d.type != "cuda" or not torch.cuda.is_available():
        return ""
    index = d.index if d.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        return ""
    # a str in torch's stubs; some builds give a struct whose str() is its repr ("<...>")
    uuid_: Any = torch.cuda.get_device_properties(index).uuid
    text = str(uuid_)  # 8-4-4-4-12 hex, as nvidia-smi shows it after "GPU-"
    return text if not text.startswith("<") else bytes(uuid_.bytes).hex()


@dataclass(frozen=True, slots=True, kw_only=True)
class Participant:
    """Who a layout belongs to: role, rank within the role, name, host id, device, and the
    GPU and process identities that tell which participants share a GPU or a process.

    Build it in the process it describes (like ``host``, ``gpu`` and ``process`` default to
    this process's own): transports are chosen per link from these fields.
    """

    role: str
    """``"writer"`` (trainer side) or ``"reader"`` (inference side)."""
    rank: int
    """Rank within the role, ``0 .. num_<role>s - 1``."""
    name: str = ""
    """Unique name in the job; default ``<role>-<rank>``."""
    host: str = field(default_factory=socket.gethostname)
    """Host id: participants on one host can use same-host transports (default: this
    machine's host name, as host sources and engine adapters use)."""
    device: str = "cpu"
    """Device of the participant's tensors (``cpu``, ``cuda:0``)."""
    gpu: str | None = None
    """GPU identity: the UUID of ``device`` (``torch.cuda.get_device_properties(i).uuid``).
    Two processes may both say ``cuda:0`` on different GPUs, or ``cuda:0`` and ``cuda:1`` on
    one, when their ``CUDA_VISIBLE_DEVICES`` differ; the UUID tells. None (default): read in
    this process for a cuda device (:func:`gpu_uuid`). "" for CPU and where unknown (links
    then compare host and device string)."""
    process: str | None = None
    """Process identity (``<pid>-<random>``, :func:`this_process`): participants with the same
    host and process are threads of one process and may share memory directly (the
    ``local`` transport). None (default): this process. "" where unknown."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if int(self.rank) < 0:
            raise ValueError(f"{self.role} rank {self.rank} is negative")
        object.__setattr__(self, "rank", int(self.rank))
        if not self.name:
            object.__setattr__(self, "name", f"{self.role}-{self.rank}")
        if any(ch.isspace() for ch in self.name):
            raise ValueError(
                f"participant name {self.name!r} contains white space: use letters, digits, "
                "'-', '_', '.' (e.g. 'infer-1')"
            )
        if self.gpu is None:
            object.__setattr__(self, "gpu", gpu_uuid(self.device))
        if self.process is None:
            object.__setattr__(self, "process", this_process())
        for field_name in ("gpu", "process"):
            value = getattr(self, field_name)
            if not isinstance(value, str):
                raise TypeError(
                    f"participant {self.name!r}: {field_name}={value!r} must be a str "
                    "(or None: this process's own)"
                )

    def to_dict(self) -> dict:
        """A plain dict of the fields (JSON and msgpack ready)."""
        return {
            "role": self.role,
            "rank": self.rank,
            "name": self.name,
            "host": self.host,
            "device": self.device,
            "gpu": self.gpu,
            "process": self.process,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Participant:
        """The inverse of :meth:`to_dict`. A dict without ``gpu`` or ``process`` (written by
        an older weightbus) gives "" (unknown) for them, never this process's values; the
        control plane itself refuses peers that do not send them."""
        return cls(
            role=str(d["role"]),
            rank=int(d["rank"]),
            name=str(d["name"]),
            host=str(d["host"]),
            device=str(d["device"]),
            gpu=str(d.get("gpu", "")),
            process=str(d.get("process", "")),
        )


# ---------------------------------------------------------------------------------------------
# column-wise pieces
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PieceTable:
    """All pieces of one layout as columns; row ``i`` is one piece.

    ``tensor`` and ``key`` index the layout's ``tensors`` and ``locals``. ``start``/``stop``
    are the canonical box, ``local_start`` the box's first element in the local tensor, each
    of shape ``(n, ndim)`` right-aligned (see the module docstring).
    """

    tensor: np.ndarray
    """Per piece: index into the layout's ``tensors``."""
    key: np.ndarray
    """Per piece: index into the layout's ``locals``."""
    start: np.ndarray
    """Per piece: canonical box start, ``(n, ndim)``."""
    stop: np.ndarray
    """Per piece: canonical box stop, ``(n, ndim)``."""
    local_start: np.ndarray
    """Per piece: first element of the box in the local tensor, ``(n, ndim)``."""

    def __post_init__(self) -> None:
        n = len(self.tensor)
        for name in ("start", "stop", "local_start"):
            a = getattr(self, name)
            assert a.ndim == 2 and a.shape[0] == n, (name, a.shape, n)
            object.__setattr__(self, name, np.ascontiguousarray(a, dtype=np.int64))
        object.__setattr__(self, "tensor", np.ascontiguousarray(self.tensor, dtype=np.int32))
        object.__setattr__(self, "key", np.ascontiguousarray(self.key, dtype=np.int32))

    @property
    def ndim(self) -> int:
        """Number of box columns."""
        return int(self.start.shape[1])

    def __len__(self) -> int:
        return len(self.tensor)

    @classmethod
    def empty(cls, ndim: int = 1) -> PieceTable:
        """A table with no pieces."""
        z = np.zeros((0, ndim), np.int64)
        return cls(
            tensor=np.zeros(0, np.int32), key=np.zeros(0, np.int32), start=z, stop=z, local_start=z
        )

    def widened(self, ndim: int) -> PieceTable:
        """The same table with boxes padded on the left to ``ndim`` columns."""
        extra = ndim - self.ndim
        if extra <= 0:
            return self
        n = len(self)
        z, o = np.zeros((n, extra), np.int64), np.ones((n, extra), np.int64)
        return PieceTable(
            tensor=self.tensor,
            key=self.key,
            start=np.hstack([z, self.start]),
            stop=np.hstack([o, self.stop]),
            local_start=np.hstack([z, self.local_start]),
        )


def _pad_left(values: Sequence[int], ndim: int, fill: int) -> list[int]:
    return [fill] * (ndim - len(values)) + list(values)


def _as_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Layout:
    """All pieces one participant holds, plus who it is.

    Build one with :class:`LayoutBuilder` or a provider in :mod:`weightbus.layouts`.
    ``tensors`` are the canonical tensors the participant knows (with the shape and dtype it
    expects), ``locals`` its local tensors, ``pieces`` the mapping between them.
    """

    participant: Participant
    """Who holds these pieces."""
    tensors: tuple[TensorSpec, ...]
    """Canonical tensors this participant knows, with the shape and dtype it expects."""
    locals: tuple[LocalTensor, ...]
    """This participant's local tensors."""
    pieces: PieceTable
    """Every piece, as columns."""
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        """The participant's name."""
        return self.participant.name

    @property
    def role(self) -> str:
        """The participant's role."""
        return self.participant.role

    @property
    def rank(self) -> int:
        """The participant's rank within its role."""
        return self.participant.rank

    def tensor_spec(self, name: str) -> TensorSpec:
        """The canonical tensor ``name``; KeyError if this layout does not hold it."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.name} holds no canonical tensor {name!r}")

    def iter_pieces(self) -> Iterator[Piece]:
        """Pieces as objects, for people and small layouts (the planner reads the columns)."""
        p = self.pieces
        for i in range(len(p)):
            spec = self.tensors[p.tensor[i]]
            local = self.locals[p.key[i]]
            cd, ld = len(spec.shape), len(local.shape)
            start, stop = p.start[i], p.stop[i]
            lstart = p.local_start[i]
            extent = stop - start
            yield Piece(
                tensor=spec.name,
                box=Box(tuple(start[p.ndim - cd :]), tuple(stop[p.ndim - cd :])),
                key=local.key,
                local_box=Box(
                    tuple(lstart[p.ndim - ld :]), tuple((lstart + extent)[p.ndim - ld :])
                ),
            )

    @property
    def nbytes(self) -> int:
        """Bytes of canonical data this layout's pieces cover."""
        if not len(self.pieces):
            return 0
        numel = np.prod(self.pieces.stop - self.pieces.start, axis=1)
        sizes = np.array([itemsize(t.dtype) for t in self.tensors], np.int64)
        return int((numel * sizes[self.pieces.tensor]).sum())

    # -- serialisation -----------------------------------------------------------------------

    def to_dict(self, *, binary: bool = False) -> dict:
        """A plain dict; arrays as lists (JSON) or little-endian bytes (``binary``, msgpack)."""
        p = self.pieces
        arrays = {
            "tensor": p.tensor,
            "key": p.key,
            "start": p.start,
            "stop": p.stop,
            "local_start": p.local_start,
        }
        return {
            "format": "weightbus.layout/1",
            "participant": self.participant.to_dict(),
            "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
            "locals": [[t.key, list(t.shape), t.dtype] for t in self.locals],
            "n": len(p),
            "ndim": p.ndim,
            "pieces": {
                k: (_as_bytes(v) if binary else v.reshape(-1).tolist()) for k, v in arrays.items()
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        """The inverse of :meth:`to_dict` (either form).

        Input from another process is untrusted: anything malformed (wrong types, sizes or
        dtypes, piece indices out of range, boxes outside their tensors) raises
        :class:`LayoutError` saying what, before any of it is used.
        """
        try:
            return _layout_from_dict(cls, d)
        except LayoutError:
            raise
        except (
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            AssertionError,
            OverflowError,
        ) as e:
            p = d.get("participant") if isinstance(d, dict) else None
            who = p.get("name") if isinstance(p, dict) else None
            who = who if isinstance(who, str) else "?"
            raise LayoutError(
                f"malformed layout from {who!r}: {type(e).__name__}: {e}; layouts must come from "
                "Layout.to_dict / to_msgpack of the same weightbus version"
            ) from None

    def to_json(self) -> str:
        """Compact JSON of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Layout:
        """The inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def to_msgpack(self) -> bytes:
        """msgpack of the binary :meth:`to_dict` form: what the control plane exchanges."""
        return msgpack.packb(self.to_dict(binary=True), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> Layout:
        """The inverse of :meth:`to_msgpack` (no pickle); malformed input raises LayoutError."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise LayoutError(f"a msgpack layout is bytes, got {type(data).__name__}")
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.exceptions.ExtraData) as e:
            raise LayoutError(f"layout is not valid msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(d, dict):
            raise LayoutError(f"a layout is a map, got {type(d).__name__}")
        return cls.from_dict(d)

    @property
    def digest(self) -> str:
        """sha256 of the msgpack form: equal layouts have equal digests on every process."""
        if "digest" not in self._memo:
            self._memo["digest"] = hashlib.sha256(self.to_msgpack()).hexdigest()
        return self._memo["digest"]


_MAX_NDIM = 16
_MAX_PIECES = 1 << 28


def _layout_from_dict(cls, d: dict) -> Layout:
    if not isinstance(d, dict):
        raise LayoutError(f"a layout is a dict, got {type(d).__name__}")
    if d.get("format") != "weightbus.layout/1":
        raise LayoutError(f"not a weightbus layout (format {d.get('format')!r})")
    participant = Participant.from_dict(d["participant"])
    who = participant.name
    n, ndim = d["n"], d["ndim"]
    if not (type(n) is int and 0 <= n <= _MAX_PIECES and type(ndim) is int):
        raise LayoutError(f"{who}: piece count n={n!r} / ndim={ndim!r} must be integers")
    if not 1 <= ndim <= _MAX_NDIM:
        raise LayoutError(f"{who}: ndim={ndim} is outside 1..{_MAX_NDIM}")

    def entries(field: str, make):
        rows = d[field]
        if not isinstance(rows, list):
            raise LayoutError(f"{who}: {field} must be a list, got {type(rows).__name__}")
        out = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)):
                raise LayoutError(f"{who}: each of {field} is [name, shape, dtype], got {row!r}")
            if not (isinstance(row[1], list) and all(type(x) is int for x in row[1])):
                raise LayoutError(
                    f"{who}: {field} {row[0]!r} shape {row[1]!r} is not a list of ints"
                )
            if len(row[1]) > ndim:
                raise LayoutError(f"{who}: {field} {row[0]!r} has {len(row[1])} dims, ndim={ndim}")
            out.append(make(row[0], tuple(row[1]), row[2]))
        if len({t[0] for t in rows}) != len(rows):
            raise LayoutError(f"{who}: {field} names a tensor twice")
        return tuple(out)

    tensors = entries("tensors", lambda a, b, c: TensorSpec(name=a, shape=b, dtype=c))
    local_ts = entries("locals", lambda a, b, c: LocalTensor(key=a, shape=b, dtype=c))
    pieces = d["pieces"]
    names = ("tensor", "key", "start", "stop", "local_start")
    if not isinstance(pieces, dict) or sorted(pieces) != sorted(names):
        raise LayoutError(f"{who}: pieces must have exactly the columns {names}")
    cols = {}
    for k in names:
        v = pieces[k]
        dt = np.dtype("<i4") if k in ("tensor", "key") else np.dtype("<i8")
        want = n if k in ("tensor", "key") else n * ndim
        if isinstance(v, (bytes, bytearray)):
            if len(v) != want * dt.itemsize:
                raise LayoutError(
                    f"{who}: column {k} has {len(v)} bytes, {want * dt.itemsize} expected"
                )
            a = np.frombuffer(v, dtype=dt)
        elif isinstance(v, list) and len(v) == want and all(type(x) is int for x in v):
            a = np.asarray(v, dtype=dt)
        else:
            raise LayoutError(f"{who}: column {k} must be {want} integers")
        dims = (n,) if k in ("tensor", "key") else (n, ndim)
        cols[k] = a.astype(dt.newbyteorder("="), copy=False).reshape(dims)
    table = PieceTable(**cols)
    # every index and box within range: the planner and executors index with these
    if n:
        if table.tensor.min() < 0 or table.tensor.max() >= len(tensors):
            raise LayoutError(
                f"{who}: a piece names canonical tensor index outside 0..{len(tensors) - 1}"
            )
        if table.key.min() < 0 or table.key.max() >= len(local_ts):
            raise LayoutError(
                f"{who}: a piece names local tensor index outside 0..{len(local_ts) - 1}"
            )
        shape = np.array([_pad_left(t.shape, ndim, 1) for t in tensors], np.int64).reshape(-1, ndim)
        lshape = np.array([_pad_left(t.shape, ndim, 1) for t in local_ts], np.int64).reshape(
            -1, ndim
        )
        extent = table.stop - table.start
        bad = (
            (table.start < 0).any(axis=1)
            | (extent < 0).any(axis=1)
            | (table.stop > shape[table.tensor]).any(axis=1)
            | (table.local_start < 0).any(axis=1)
            | (table.local_start + extent > lshape[table.key]).any(axis=1)
        )
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LayoutError(
                f"{who}: piece {i} (of {tensors[table.tensor[i]].name!r} into "
                f"{local_ts[table.key[i]].key!r}) has box {table.start[i].tolist()}.."
                f"{table.stop[i].tolist()} at {table.local_start[i].tolist()}, outside the "
                "tensors' shapes"
            )
    return cls(participant=participant, tensors=tensors, locals=local_ts, pieces=table)


class LayoutBuilder:
    """Collects tensors, local tensors and pieces one at a time, then builds a :class:`Layout`.

    >>> b = LayoutBuilder(Participant(role="reader", rank=0))
    >>> b.add_tensor("w", (4, 8), "bfloat16")
    >>> b.add_local("w", (2, 8), "bfloat16")
    >>> b.add_piece("w", Box((2, 0), (4, 8)), "w", Box((0, 0), (2, 8)))
    >>> layout = b.build()
    """

    def __init__(self, participant: Participant) -> None:
        self.participant = participant
        """Who the layout being built belongs to."""
        self._tensors: dict[str, TensorSpec] = {}
        self._locals: dict[str, LocalTensor] = {}
        self._tensor_pos: dict[str, int] = {}
        self._local_pos: dict[str, int] = {}
        self._rows: list[tuple[int, int, Sequence[int], Sequence[int], Sequence[int]]] = []

    def add_tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype | str) -> None:
        """Declare canonical tensor ``name`` with its global shape and the dtype this
        participant expects (declaring it again with equal values is a no-op)."""
        spec = TensorSpec(name=name, shape=tuple(shape), dtype=dtype_name(dtype))
        old = self._tensors.setdefault(name, spec)
        self._tensor_pos.setdefault(name, len(self._tensor_pos))
        if old != spec:
            raise LayoutError(
                f"{self.participant.name}: canonical tensor {name!r} declared twice, as "
                f"{old.shape} {old.dtype} and {spec.shape} {spec.dtype}"
            )

    def add_local(self, key: str, shape: Sequence[int], dtype: torch.dtype | str) -> None:
        """Declare local tensor ``key`` as this participant stores it (declaring it again
        with equal values is a no-op)."""
        local = LocalTensor(key=key, shape=tuple(shape), dtype=dtype_name(dtype))
        old = self._locals.setdefault(key, local)
        self._local_pos.setdefault(key, len(self._local_pos))
        if old != local:
            raise LayoutError(
                f"{self.participant.name}: local tensor {key!r} declared twice, as "
                f"{old.shape} {old.dtype} and {local.shape} {local.dtype}"
            )

    def add_piece(self, tensor: str, box: Box, key: str, local_box: Box) -> None:
        """Declare that ``box`` of canonical ``tensor`` is ``local_box`` of local ``key``."""
        who = self.participant.name
        if tensor not in self._tensors:
            raise LayoutError(
                f"{who}: piece of {tensor!r} added before add_tensor({tensor!r}, ...)"
            )
        if key not in self._locals:
            raise LayoutError(f"{who}: piece in local {key!r} added before add_local({key!r}, ...)")
        spec, local = self._tensors[tensor], self._locals[key]
        if box.ndim != len(spec.shape):
            raise LayoutError(
                f"{who}: piece box {box} of {tensor!r} has {box.ndim} dims, the tensor "
                f"{len(spec.shape)} (shape {spec.shape})"
            )
        if local_box.ndim != len(local.shape):
            raise LayoutError(
                f"{who}: local box {local_box} in {key!r} has {local_box.ndim} dims, the local "
                f"tensor {len(local.shape)} (shape {local.shape})"
            )
        lead = local_box.ndim - box.ndim
        if (
            lead < 0
            or any(e != 1 for e in local_box.shape[:lead])
            or local_box.shape[lead:] != box.shape
        ):
            raise LayoutError(
                f"{who}: piece of {tensor!r} box {box} (shape {box.shape}) does not fit local box "
                f"{local_box} (shape {local_box.shape}) of {key!r}: the extents must match, with "
                "any extra leading local dims of extent 1"
            )
        self._rows.append(
            (self._tensor_pos[tensor], self._local_pos[key], box.start, box.stop, local_box.start)
        )

    def build(self) -> Layout:
        """The :class:`Layout` of everything declared so far."""
        tensors = tuple(self._tensors.values())
        locals_ = tuple(self._locals.values())
        ndim = max([len(t.shape) for t in locals_] + [len(t.shape) for t in tensors] + [1])
        n = len(self._rows)
        start = np.zeros((n, ndim), np.int64)
        stop = np.ones((n, ndim), np.int64)
        lstart = np.zeros((n, ndim), np.int64)
        tensor = np.zeros(n, np.int32)
        key = np.zeros(n, np.int32)
        for i, (t, k, a, b, la) in enumerate(self._rows):
            tensor[i], key[i] = t, k
            start[i] = _pad_left(a, ndim, 0)
            stop[i] = _pad_left(b, ndim, 1)
            lstart[i] = _pad_left(la, ndim, 0)
        return Layout(
            participant=self.participant,
            tensors=tensors,
            locals=locals_,
            pieces=PieceTable(tensor=tensor, key=key, start=start, stop=stop, local_start=lstart),
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BoundLayout:
    """A layout together with the live local tensors it describes (by local key).

    Writers read from these tensors; readers write into them in place, so the engine keeps its
    tensor objects. Providers in :mod:`weightbus.layouts` and adapters in
    :mod:`weightbus.engines` return one.
    """

    layout: Layout
    """What the participant holds."""
    tensors: dict[str, torch.Tensor]
    """The live local tensors, by local key."""

    def __post_init__(self) -> None:
        who = self.layout.name
        for local in self.layout.locals:
            t = self.tensors.get(local.key)
            if t is None:
                raise KeyError(f"{who}: layout names local tensor {local.key!r}, none was given")
            if tuple(t.shape) != local.shape or dtype_name(t.dtype) != local.dtype:
                raise LayoutError(
                    f"{who}: local tensor {local.key!r} is {tuple(t.shape)} {dtype_name(t.dtype)}, "
                    f"the layout says {local.shape} {local.dtype}"
                )
