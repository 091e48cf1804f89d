"""Every timed step beside its roofline: how far a decode, verification, draft step or prefill is from
what this machine could do.

A step's roofline time is max(bytes / bandwidth, FLOPs / peak) for each of its
parts (weight matmuls, attention), added (:meth:`~sparsedraft.engine.roofline.StepCost.ms`),
with the bytes and FLOPs of :mod:`sparsedraft.engine.roofline` and the read
bandwidth and matmul peak measured in the bench's own process
(:func:`sparsedraft.engine.machine.peak_gflops`). ``over_roofline`` = ms /
roofline_ms is then comparable across machines and dtypes where raw
milliseconds are not: 1.0 is the machine's limit, and a step far above it
points at a kernel, a layout or a busy machine rather than at the method.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..caches.kv_quant import INT4_GROUP as KV_INT4_GROUP
from ..engine.config import ModelConfig
from ..engine.quant import INT4_GROUP as WEIGHT_INT4_GROUP
from ..engine.roofline import StepCost, step_cost
from ..engine.runtime import DTYPES
from ..errors import require
from ..report import format_table
from ..speculative.stats import DRAFT, RETRIEVAL_LEVEL, TARGET, VERIFY, region


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


def _self_draft_cache(method: str, opts: Any) -> int | None:
    """Tokens of the cache the target drafts over when a draft level is the target itself, else None (a
    separate draft model or prompt lookup: its bytes are not the target's)."""
    if method in ("retrieval", "triforce"):
        return opts.budget
    if method == "spec" and getattr(opts, "draft", None) == "self":
        return opts.budget if opts.draft_cache == "budget" else opts.sink + opts.window
    return None


def draft_cost(cost: StepCost, cfg: ModelConfig, opts: Any, size: int) -> StepCost:
    """``cost`` with the bytes a quantised self-draft level reads (``draft_weights`` / ``draft_kv``), scales
    included: int8 and w8a8 weights one byte a value (their one scale per output row left out), int4 weights half a
    byte plus a scale and an offset (the dtype's) per group, int8 KV one byte plus an fp32 scale per head
    row, int4 KV half a byte plus an fp32 scale per group."""
    weights, kv = getattr(opts, "draft_weights", "same"), getattr(opts, "draft_kv", "same")
    per_weight = {"bf16": 2.0, "int8": 1.0, "w8a8": 1.0, "int4": 0.5 + 2 * size / WEIGHT_INT4_GROUP}.get(weights, size)
    per_kv = {"int8": 1.0 + 4 / cfg.head_dim, "int4": 0.5 + 4 / KV_INT4_GROUP}.get(kv, size)
    return replace(cost, weight_bytes=cost.weight_bytes * per_weight / size, kv_bytes=cost.kv_bytes * per_kv / size)


def method_steps(model_cfg: ModelConfig, dtype: str, method: str, opts: Any, context: int, row: Any,
                 read_bytes_per_s: float, peak_gflops: float) -> list[StepRow]:
    """A speculative run's steps from its median run's timed regions (:mod:`sparsedraft.speculative.stats`):
    the full target's verification (mean drafts per round + 1 tokens at the mean decode ``context``), the
    target's draft step over its own sparse cache where a level is the target itself, and TriForce's
    level-2 verification of level 1's drafts over the retrieval cache. Steps whose bytes are not the
    target's (a separate draft model, prompt lookup) are left out rather than guessed."""
    size = DTYPES[dtype].itemsize
    seconds, rounds, drafted = row.seconds, row.verifications, row.drafted
    rows = []
    if rounds.get(TARGET) and seconds.get(VERIFY):
        tokens = round(drafted[TARGET] / rounds[TARGET]) + 1
        rows.append(step_row(f"verify-{tokens}", dtype, 1000 * seconds[VERIFY] / rounds[TARGET],
                             step_cost(model_cfg, context, tokens, size), read_bytes_per_s, peak_gflops))
    sparse = _self_draft_cache(method, opts)
    if sparse is None:
        return rows
    sparse = min(sparse, context)
    if method == "triforce":
        level2 = rounds.get(RETRIEVAL_LEVEL)
        if level2 and seconds.get(region(RETRIEVAL_LEVEL, VERIFY)):
            tokens = round(drafted[RETRIEVAL_LEVEL] / level2) + 1
            rows.append(step_row(f"level2 verify-{tokens}", dtype,
                                 1000 * seconds[region(RETRIEVAL_LEVEL, VERIFY)] / level2,
                                 draft_cost(step_cost(model_cfg, sparse, tokens, size), model_cfg, opts, size),
                                 read_bytes_per_s, peak_gflops))
    elif drafted.get(TARGET) and seconds.get(DRAFT):
        rows.append(step_row("self draft", dtype, 1000 * seconds[DRAFT] / drafted[TARGET],
                             draft_cost(step_cost(model_cfg, sparse, 1, size), model_cfg, opts, size),
                             read_bytes_per_s, peak_gflops))
    return rows
