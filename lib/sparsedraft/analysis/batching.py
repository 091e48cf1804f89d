"""Why batching moves speculative speedups: the roofline of one step over a batch of long sequences.

A decode step over a batch of ``B`` sequences reads the weights once and every
sequence's KV cache: ``W + B * KV(context)`` bytes. As ``B`` grows the KV
share of those bytes grows (MagicDec's point: the KV cache becomes the
bottleneck, so a sparse-KV draft saves more), while a ``k``-token verification
does ``B * k`` tokens of work, whose attention is compute-bound beyond the
machine's ridge point (TriForce's Table 4: the verifier's cost climbs with
the batch). :func:`batch_roofline` tabulates both per step;
:func:`selfspec_ceiling` turns them into the speedup a self-speculating
sparse cache could reach at a given acceptance, and :func:`best_selfspec_ceiling`
the best of it over γ for a per-draft acceptance (:func:`per_draft_acceptance`
turns a run's accepted share into one).
"""

from __future__ import annotations

from typing import Iterable

import pandas as pd

from ..engine.config import ModelConfig
from ..engine.roofline import attention_flops, kv_bytes, weight_bytes, weight_flops
from ..errors import require


def attention_rows(cfg: ModelConfig, tokens: int, lanes: int = 1, key_rows: int = 0) -> int:
    """Query rows an attention kernel computes per KV head for a ``tokens``-token step: the group's
    ``group_size * tokens`` rows, rounded up to whole blocks of ``lanes``, except for steps of at most
    ``key_rows`` rows, which the kernel computes with keys as lanes and so pays only their own rows
    (this library's CPU kernel: ``kernels.lanes()`` and ``kernels.KEY_ROWS``)."""
    require(tokens >= 1 and lanes >= 1 and key_rows >= 0,
            f"tokens and lanes must be >= 1 and key_rows >= 0, got {tokens}, {lanes}, {key_rows}")
    rows = cfg.group_size * tokens
    return rows if rows <= key_rows else -(-rows // lanes) * lanes


def step_ms(cfg: ModelConfig, context: int, batch: int, tokens: int, dtype_bytes: int, bandwidth: float,
            peak_flops: float, lanes: int = 1, key_rows: int = 0) -> float:
    """Roofline milliseconds of one ``tokens``-token forward of ``batch`` sequences over ``context`` cached
    tokens each: the larger of reading weights once plus every cache, and the step's FLOPs at peak (the
    attention's counted over the rows a ``lanes``-wide kernel computes)."""
    read = weight_bytes(cfg, dtype_bytes) + batch * kv_bytes(cfg, context, dtype_bytes)
    attention = attention_flops(cfg, context) * attention_rows(cfg, tokens, lanes, key_rows) / cfg.group_size
    work = batch * (tokens * weight_flops(cfg) + attention)
    return 1000 * max(read / bandwidth, work / peak_flops)


def batch_roofline(cfg: ModelConfig, contexts: Iterable[int], batches: Iterable[int], tokens: int,
                   dtype_bytes: int, bandwidth: float, peak_flops: float, lanes: int = 1,
                   key_rows: int = 0) -> pd.DataFrame:
    """Per (context, batch): bytes of one decode step, the KV share of them, the roofline ms of a decode step
    and of a ``tokens``-token verification, and their ratio (what one verification costs in decode steps)."""
    require(tokens >= 1, f"tokens must be >= 1, got {tokens}")
    rows = []
    for context in contexts:
        for batch in batches:
            require(batch >= 1 and context >= 1, f"batch and context must be >= 1, got {batch}, {context}")
            w, kv = weight_bytes(cfg, dtype_bytes), batch * kv_bytes(cfg, context, dtype_bytes)
            decode = step_ms(cfg, context, batch, 1, dtype_bytes, bandwidth, peak_flops, lanes, key_rows)
            verify = step_ms(cfg, context, batch, tokens, dtype_bytes, bandwidth, peak_flops, lanes, key_rows)
            rows.append({"context": context, "batch": batch, "weight_gb": w / 1e9, "kv_gb": kv / 1e9,
                         "kv_share": kv / (w + kv), "decode_ms": decode, "verify_ms": verify, "tokens": tokens,
                         "verify_over_decode": verify / decode})
    return pd.DataFrame(rows)


def selfspec_ceiling(cfg: ModelConfig, context: int, batch: int, budget: int, gamma: int, accepted: float,
                     dtype_bytes: int, bandwidth: float, peak_flops: float, lanes: int = 1,
                     key_rows: int = 0) -> float:
    """Roofline speedup of the target drafting ``gamma`` tokens over a ``budget``-token cache and verifying
    them over its full cache, keeping ``accepted`` drafts per round on average, against plain decoding."""
    require(0 <= accepted <= gamma, f"accepted must be in [0, gamma={gamma}], got {accepted}")
    decode = step_ms(cfg, context, batch, 1, dtype_bytes, bandwidth, peak_flops, lanes, key_rows)
    draft = step_ms(cfg, budget, batch, 1, dtype_bytes, bandwidth, peak_flops, lanes, key_rows)
    verify = step_ms(cfg, context, batch, gamma + 1, dtype_bytes, bandwidth, peak_flops, lanes, key_rows)
    return (accepted + 1) * decode / (gamma * draft + verify)


def per_draft_acceptance(fraction: float, gamma: int) -> float:
    """The i.i.d. per-draft acceptance α whose expected accepted drafts per round, α + α² + ... + α^γ, equal
    ``fraction * gamma`` (``fraction``: the share of drafts a run accepted with ``gamma`` drafts per round).
    A round stops at its first rejection, so α is above the accepted share whenever 0 < fraction < 1."""
    require(0.0 <= fraction <= 1.0, f"fraction must lie in [0, 1], got {fraction}")
    require(gamma >= 1, f"gamma must be >= 1, got {gamma}")
    target = fraction * gamma
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the sum rises with α
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, gamma + 1)) < target else (lo, mid)
    return (lo + hi) / 2


def best_selfspec_ceiling(cfg: ModelConfig, context: int, batch: int, budget: int, alpha: float, dtype_bytes: int,
                          bandwidth: float, peak_flops: float, lanes: int = 1, max_gamma: int = 16,
                          key_rows: int = 0) -> tuple[float, int]:
    """The highest :func:`selfspec_ceiling` over γ = 1 .. ``max_gamma`` when each draft is accepted with
    probability ``alpha`` (a round keeps α + ... + α^γ drafts on average), and the γ that reaches it."""
    require(0.0 <= alpha <= 1.0, f"alpha must lie in [0, 1], got {alpha}")
    require(max_gamma >= 1, f"max_gamma must be >= 1, got {max_gamma}")
    return max((selfspec_ceiling(cfg, context, batch, budget, g, sum(alpha ** i for i in range(1, g + 1)),
                                 dtype_bytes, bandwidth, peak_flops, lanes, key_rows), g)
               for g in range(1, max_gamma + 1))
