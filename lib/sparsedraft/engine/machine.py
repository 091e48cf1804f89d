"""What this machine computes with, said at run time, so every figure names the path that made it.

The same bench runs different code on different CPUs: the C++ kernels are
built with ``-march=native`` (AVX2+FMA on one machine, AVX-512 on another),
torch dispatches its own kernels by the CPU's capability, and bf16 has
hardware dot products only from AVX512-BF16 on (AMX tiles beyond). Without
them torch still computes in bf16, but slowly: on an AVX2-only 2-core
machine a bf16 GEMM of a prefill chunk's shape ran at 4.5 GFLOP/s against
34 for fp32, so a bf16 prefill takes several times an fp32 one. A speed
figure is only comparable with its path beside it, and a bf16 run on such a
CPU should be a choice, not a default.

:func:`report` gathers the path: the best instruction set the CPU reports
(:func:`best_isa` over ``/proc/cpuinfo`` flags), what the kernels were built
for (:func:`sparsedraft.engine.kernels.path`), torch's own
``torch.backends.cpu.get_cpu_capability()``, whether bf16 is native, and the
load average (other jobs on two cores slow a 2-thread step by whole scheduler
quanta). :func:`peak_gflops` measures the compute peak per dtype, the other
half of every roofline beside the read bandwidth.

:func:`provenance` (commit, uncommitted changes, date) and
:func:`machine_record` (CPU, cores, threads, read bandwidth, load) are what a
record says about where its figures came from: a bench's results record
(:mod:`sparsedraft.bench.record`) and a trained drafter's record alike.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from ..errors import require
from .cpuinfo import cpu_flags, read_cpuinfo
from .roofline import measure_matmul_flops, measure_read_bandwidth
from .runtime import DTYPES

# (flags that must all be present, name), best last: the widest path the CPU offers.
ISA_LADDER = (({"avx2"}, "AVX2"), ({"avx2", "fma"}, "AVX2+FMA"), ({"avx512f"}, "AVX-512"),
              ({"avx512_bf16"}, "AVX512-BF16"), ({"amx_tile", "amx_bf16"}, "AMX"))
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags, and aarch64's "bf16" feature
PEAK_SECONDS = 1.0  # per dtype: long enough for a stable median, short beside any bench


def best_isa(flags: Iterable[str]) -> str:
    """The best of AVX2 / AVX2+FMA / AVX-512 / AVX512-BF16 / AMX in ``flags``, else the machine's name."""
    flags = set(flags)
    best = [name for needed, name in ISA_LADDER if needed <= flags]
    return best[-1] if best else platform.machine() or "unknown"


def native_bf16(flags: Iterable[str]) -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16, AMX-BF16 or ARM's BF16 extension)."""
    return any(flag in set(flags) for flag in NATIVE_BF16)


@dataclass(frozen=True)
class MachineReport:
    """The path a bench ran on; ``str()`` is the line it prints, ``to_dict()`` its JSON ``isa``."""

    cpu: str  # best instruction set the CPU reports (best_isa)
    kernels: str  # what the C++ kernels were built for, or why the torch path runs (kernels.path)
    torch: str  # torch.backends.cpu.get_cpu_capability(): the kernels torch dispatches to
    bf16_native: bool  # False: bf16 matmuls run without hardware support (slow; see the module docstring)
    threads: int  # torch's intra-op threads
    cores: int | None
    load_1min: float | None  # other jobs on these cores slow every figure

    def __str__(self) -> str:
        load = "" if self.load_1min is None else f", load {self.load_1min:.1f}"
        bf16 = "native" if self.bf16_native else "no hardware support (slow)"
        return (f"CPU {self.cpu}; kernels {self.kernels}; torch {self.torch}; bf16 {bf16}; "
                f"{self.threads} threads on {self.cores} cores{load}")

    @property
    def busy(self) -> bool:
        """More runnable work than cores: threads wait for each other at every parallel region."""
        return self.load_1min is not None and self.cores is not None and self.load_1min > self.cores

    def to_dict(self) -> dict:
        return asdict(self)


def report(device: torch.device | str = "cpu") -> MachineReport:
    """The path of a run on ``device``; builds the C++ kernels if they are not built yet (CPU only)."""
    from . import kernels
    flags = cpu_flags()
    on_cpu = torch.device(device).type == "cpu"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return MachineReport(best_isa(flags), kernels.path() if on_cpu else f"not used on {torch.device(device).type}",
                         torch.backends.cpu.get_cpu_capability(), native_bf16(flags), torch.get_num_threads(),
                         os.cpu_count(), load)


def warn_slow(machine: MachineReport, dtypes: Iterable[torch.dtype], device: torch.device) -> None:
    """One warning per cause that makes this run's figures slow for reasons outside the code timed."""
    if device.type == "cpu" and torch.bfloat16 in set(dtypes) and not machine.bf16_native:
        warnings.warn(f"bf16 on this CPU ({machine.cpu}, no bf16 instructions): torch's bf16 GEMMs (prefill "
                      "chunks, steps of more than 16 rows) run several times slower than fp32 here, while "
                      "smaller steps widen bf16 to fp32 in the C++ kernels; time fp32, or read the bf16 figures "
                      "as this machine's, not bf16's", RuntimeWarning, stacklevel=2)
    if device.type == "cpu" and machine.busy and machine.threads > 1:
        warnings.warn(f"load average {machine.load_1min:.1f} on {machine.cores} cores: with {machine.threads} "
                      "threads each parallel region waits for a descheduled thread, which can multiply step "
                      "times; set OMP_NUM_THREADS=1 or time on an idle machine", RuntimeWarning, stacklevel=2)


def peak_gflops(dtypes: Iterable[str], device: torch.device | str = "cpu",
                seconds: float = PEAK_SECONDS) -> dict[str, float]:
    """GFLOP/s of a dense matmul per dtype name (``fp32``, ``bf16``, ...: :data:`~sparsedraft.engine.runtime.DTYPES`),
    each measured for about ``seconds`` (:func:`~sparsedraft.engine.roofline.measure_matmul_flops`, sized to the
    machine).

    A half-precision dtype's peak is never below fp32's: its products are exact in fp32, so a CPU without bf16
    instructions (AVX2) can multiply bf16 operands at fp32's rate after widening them, as the C++ kernels do,
    however slowly torch's own bf16 GEMM runs there. Taking that GEMM alone as the peak made a bf16 roofline
    several times too lenient (an 8-row bf16 linear measured at 0.25x "its roofline" on AVX2)."""
    for name in dtypes:
        require(name in DTYPES, f"dtype {name!r} is not one of {tuple(DTYPES)}")
    measured: dict[str, float] = {}

    def gflops(name: str) -> float:
        if name not in measured:
            measured[name] = measure_matmul_flops(device, DTYPES[name], seconds=seconds) / 1e9
        return measured[name]

    return {name: gflops(name) if DTYPES[name].itemsize >= 4 else max(gflops(name), gflops("fp32"))
            for name in dict.fromkeys(dtypes)}


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(root: Path | None = None) -> dict[str, Any]:
    """Commit, dirty flag and UTC date of a measurement made from the checkout at ``root`` (this file's)."""
    root = root or Path(__file__).resolve().parent
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": _git(root, "rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def machine_record(read_gb_s: float | None = None, measure: bool = True) -> dict[str, Any]:
    """The machine a figure was measured on, as a results record stores it; the read bandwidth is measured here
    when not given (``measure=False``: left None, for a caller whose figures carry their own)."""
    if (read_gb_s is None or read_gb_s != read_gb_s) and measure:  # absent or NaN
        read_gb_s = measure_read_bandwidth("cpu") / 1e9
    cpu = next((line.split(":", 1)[1].strip() for line in read_cpuinfo().splitlines() if line.startswith("model name")),
               platform.processor())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # other jobs on the cores slow every figure
    return {"isa": best_isa(cpu_flags()), "cpu": cpu, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "read_gb_s": None if read_gb_s is None or read_gb_s != read_gb_s else round(read_gb_s, 2),
            "load_1min": None if load is None else round(load, 2)}
