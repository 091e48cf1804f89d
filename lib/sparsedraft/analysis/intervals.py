"""Confidence intervals of a mean over a handful of prompts (Student's t; numpy has no t quantile).

With 3-5 prompts per cell the normal 1.96 would understate the interval by a
factor of up to 2 (t = 4.30 at 2 degrees of freedom), so the quantile is the
t distribution's, found by bisection on its CDF, itself a Simpson integral of
the density -- accurate to well under 1e-6 for the degrees of freedom used here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import require


def _t_cdf(x: float, df: int) -> float:
    """P(T <= x) for x >= 0: 1/2 plus the density's integral over [0, x] (composite Simpson, 4,000 panels)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    grid = np.linspace(0.0, x, 4001)
    density = np.exp(log_norm - (df + 1) / 2 * np.log1p(grid ** 2 / df))
    h = x / 4000
    return 0.5 + h / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with ``df`` degrees of freedom."""
    require(0.5 <= p < 1 and df >= 1, f"need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of the ``level`` t interval of the mean; half-width NaN for a single value."""
    data = np.asarray(values, dtype=float)
    require(data.size >= 1, "mean_interval needs at least one value")
    if data.size == 1:
        return float(data[0]), float("nan")
    half = t_quantile(0.5 + level / 2, data.size - 1) * data.std(ddof=1) / math.sqrt(data.size)
    return float(data.mean()), float(half)
