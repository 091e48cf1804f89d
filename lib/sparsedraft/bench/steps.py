"""Every timed step beside its roofline: how far a decode, verification, draft step or prefill is from
what this machine could do.

A step's roofline time is max(bytes / bandwidth, FLOPs / peak) for each of its
parts (weight matmuls, attention), added (:meth:`~sparsedraft.roofline.StepCost.ms`),
with the bytes and FLOPs of :mod:`sparsedraft.roofline` and the read
bandwidth and matmul peak measured in the bench's own process
(:func:`sparsedraft.machine.peak_gflops`). ``over_roofline`` = ms /
roofline_ms is then comparable across machines and dtypes where raw
milliseconds are not: 1.0 is the machine's limit, and a step far above it
points at a kernel, a layout or a busy machine rather than at the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import require
from ..report import format_table
from ..roofline import StepCost


@dataclass(frozen=True)
class StepRow:
    step: str  # what was timed: decode, verify-7, level2 draft, prefill, ...
    dtype: str  # weights and KV dtype: the peak it is judged by
    context: int  # cached tokens the step attends to (the prompt length for a prefill)
    tokens: int  # query tokens per forward (a prefill: the whole prompt)
    ms: float  # measured milliseconds (a prefill: all its chunks)
    roofline_ms: float  # max(bytes / bandwidth, FLOPs / peak) per part, parts added, all forwards added
    over_roofline: float  # ms / roofline_ms (1.0: at this machine's limit)
    bound: str  # "memory" or "compute": which side of the roofline the larger part of roofline_ms is on
    gb: float  # bytes read, GB (10^9)
    gflop: float


def step_row(step: str, dtype: str, ms: float, costs: StepCost | Sequence[StepCost], read_bytes_per_s: float,
             peak_gflops: float) -> StepRow:
    """``ms`` beside the roofline of ``costs`` (one forward, or a prefill's chunks) at the measured
    ``read_bytes_per_s`` and ``peak_gflops`` of ``dtype``."""
    costs = [costs] if isinstance(costs, StepCost) else list(costs)
    require(len(costs) >= 1 and ms > 0, f"a step row needs a cost and ms > 0, got {len(costs)} costs and {ms} ms")
    peak = peak_gflops * 1e9
    roofline = sum(c.ms(read_bytes_per_s, peak) for c in costs)
    n_bytes = sum(c.weight_bytes + c.kv_bytes for c in costs)
    flops = sum(c.weight_flops + c.attention_flops for c in costs)
    bound = "compute" if flops / peak > n_bytes / read_bytes_per_s else "memory"
    context = costs[0].context if len(costs) == 1 else sum(c.tokens for c in costs)  # a prefill: its prompt
    return StepRow(step, dtype, context, sum(c.tokens for c in costs), ms, roofline, ms / roofline, bound,
                   n_bytes / 1e9, flops / 1e9)


def steps_table(rows: Sequence[StepRow]) -> str:
    """The human table of a bench's step rows."""
    cells = [[r.step, r.dtype, f"{r.context}", f"{r.tokens}", f"{r.ms:.2f}", f"{r.roofline_ms:.2f}",
              f"{r.over_roofline:.2f}x", r.bound] for r in rows]
    return format_table(["step", "dtype", "context", "tokens", "ms", "roofline ms", "ms / roofline", "bound"], cells)
