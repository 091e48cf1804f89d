"""What ``/proc/cpuinfo`` says about this CPU, read in one place.

The C++ kernels need it below everything else (their build key, and which
forced vector paths this CPU can run); the machine report, which names the
path the kernels took, sits above them and reads the same lines.
"""

from __future__ import annotations

from pathlib import Path


def read_cpuinfo() -> str:
    """``/proc/cpuinfo``, empty where it cannot be read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags (x86) or features (ARM) ``cpuinfo`` (this machine's by default) lists; empty where unknown."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            flags.update(line.split(":", 1)[1].split())
    return flags
