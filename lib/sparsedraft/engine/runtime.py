"""Where and in what precision a run happens: dtype names and device resolution shared by the CLI,
the benchmarks and the notebooks, so ``--dtype bf16 --device auto`` means the same everywhere."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import sys
from typing import Iterator

import torch

from ..errors import SparsedraftError, require

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The :data:`DTYPES` name of ``dtype`` (what reports print and the per-dtype peaks are keyed by)."""
    names = [name for name, value in DTYPES.items() if value == dtype]
    require(bool(names), f"dtype {dtype} is not one of {tuple(DTYPES)} ({', '.join(map(str, DTYPES.values()))})")
    return names[0]


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; a CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise SparsedraftError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from exc
    require(device.type != "cuda" or torch.cuda.is_available(),
            f"device {name!r} requested but CUDA is not available here; use --device cpu or auto")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timed region ends when its work does (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A device as a report names it: the GPU's model for CUDA, else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (10^9 bytes; ``ru_maxrss`` is KiB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _mallopt_threshold(nbytes: int) -> bool:
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))


@contextlib.contextmanager
def mapped_blocks(nbytes: int = 1 << 20, after: int = 32 << 20) -> Iterator[bool]:
    """Inside: every block of ``nbytes`` or more is its own mapping, returned to the OS when freed; after:
    the threshold stays at ``after`` (glibc's own ceiling), fixed. Why: once a block below 32 MB has been
    freed, glibc serves later blocks of that size from its heap, where a long loop of step-sized tensors
    fragments it. Drafter training's sampling grew ~90 MB/s there once its teacher windows had been computed
    in the same process (past 24 GB on a 2-core AMX machine, 2026-12-05) and stayed at 4.1 GB with the
    threshold at 1 MB. Yields whether the C library took it (False where it is not glibc)."""
    taken = _mallopt_threshold(nbytes)
    try:
        yield taken
    finally:
        if taken:
            _mallopt_threshold(after)
