"""Host memory for sources: pinned buffers, page-locking mapped files in place, NUMA placement."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["gpu_local_cpus", "host_buffer", "on_ram_fs", "register", "unregister"]

_RAM_FS = ("tmpfs", "ramfs", "hugetlbfs")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# cudaHostRegisterPortable: page-locked for every device's context, not only the current one
_REGISTER_PORTABLE = 1


def host_buffer(nbytes: int, *, pin: bool) -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None]:
    """A fresh uint8 host buffer and, when ``pin``, its page-locked registration (``(address,
    memory)`` for :func:`unregister`; None otherwise).

    Pinned buffers are registered pages of an ordinary allocation rather than torch's pinned
    allocator, which rounds every size up to a power of two (a 4.1 GB shard would lock 8 GB)
    and keeps freed blocks cached. The registered range is whole pages of this buffer's own
    allocation, so it never overlaps another registration.
    """
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8), None
    if not torch.cuda.is_available():
        raise ValueError("pin=True needs CUDA: page-locked memory only speeds up copies to a GPU")
    raw = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _PAGE
    pages = -(-max(nbytes, 1) // _PAGE) * _PAGE
    address, _ = register(raw[skip : skip + pages], f"a {nbytes}-byte host buffer")
    return raw[skip : skip + nbytes], (address, raw)


def register(t: torch.Tensor, what: str) -> tuple[int, int]:
    """Page-lock the host memory behind the uint8 tensor ``t`` in place (``cudaHostRegister``):
    host->device copies from it then run at pinned speed without copying it first. Returns the
    registered ``(address, size)`` for :func:`unregister`."""
    if not torch.cuda.is_available():
        raise ValueError(f"{what}: page-locking needs CUDA")
    start = t.data_ptr() - t.data_ptr() % _PAGE
    size = t.data_ptr() + t.numel() - start
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(start, size, _REGISTER_PORTABLE)
    if int(rc) != 0:
        raise RuntimeError(
            f"{what}: cudaHostRegister of {size} bytes failed ({int(rc)}: "
            f"{cudart.cudaGetErrorString(rc)}); the memory limit for locked pages (ulimit -l) "
            "may be too low, or pass pin=False to copy at pageable speed"
        )
    return start, size


def unregister(address: int) -> None:
    """Undo :func:`register` (errors are logged: this runs while tearing down)."""
    rc = torch.cuda.cudart().cudaHostUnregister(address)
    if int(rc) != 0:
        logger.warning("cudaHostUnregister(%#x) failed with CUDA error %d", address, int(rc))


def on_ram_fs(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies on a RAM-backed file system (``/dev/shm`` and other tmpfs), whose
    pages can be mapped and page-locked in place instead of read into a copy."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return real.startswith("/dev/shm/")
    return kind in _RAM_FS


def gpu_local_cpus(device: int) -> set[int] | None:
    """The CPUs on the NUMA node of GPU ``device`` (from sysfs), or None when unknown.

    A process that pins host memory while running there gets it on the GPU's own node, so
    host->device copies do not cross the socket interconnect.
    """
    try:
        props = torch.cuda.get_device_properties(device)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, AssertionError):
        return None
    path = Path("/sys/bus/pci/devices") / bus / "local_cpulist"
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    cpus: set[int] = set()
    for item in filter(None, text.split(",")):
        lo, _, hi = item.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None
