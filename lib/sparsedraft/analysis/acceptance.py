"""Per-level acceptance rate from per-round records, and a test of whether acceptance comes in bursts.

The cost model (:mod:`.costmodel`) assumes each draft is accepted
independently with probability α. Under that assumption a round that drafts
g tokens keeps k of them with the truncated geometric law

    P(k) = α^k (1 − α)  for k < g,        P(g) = α^g,

so the pooled ratio accepted / drafted of such rounds has expectation
α(1 − α^g) / (g(1 − α)), below α for every α in (0, 1): a pooled rate that
"predicts worse" than α is what independence itself produces, not evidence of
bursts. Evidence needs the shape of the accepted-length histogram, which is
what :func:`burstiness_test` checks.

Input, for both functions: ``rounds[g][k]`` = number of rounds that drafted g
tokens and kept exactly k (``k = 0..g``), as :attr:`LevelStats.rounds
<sparsedraft.speculative.stats.LevelStats.rounds>` records it (keys may be
strings, as after a JSON round trip). Keeping g per round matters: a round
capped below γ (the last round before level 3 holds γ2 tokens, or the end of
generation) cannot keep more than it drafted, and treating its k = g as a
rejection biases α down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import require

Rounds = Mapping[int | str, Sequence[int]]
MIN_EXPECTED = 5.0  # cells expected to hold fewer rounds are pooled (the usual chi-square rule)


def _checked(rounds: Rounds) -> dict[int, list[int]]:
    """``rounds`` with int keys, validated: each row has g + 1 non-negative counts."""
    table = {}
    for key, row in rounds.items():
        g, counts = int(key), [int(c) for c in row]
        require(g >= 0 and len(counts) == g + 1 and all(c >= 0 for c in counts),
                f"rounds[{key!r}] must list g + 1 = {g + 1} non-negative counts (rounds keeping 0..g drafts), "
                f"got {list(row)}; pass LevelStats.rounds")
        table[g] = counts
    return table


def _sufficient(table: dict[int, list[int]]) -> tuple[int, int]:
    """(drafts kept, rounds ending in a rejection) over rounds that drafted at least one token."""
    kept = sum(k * c for row in table.values() for k, c in enumerate(row))
    rejected = sum(c for g, row in table.items() for k, c in enumerate(row) if k < g)
    return kept, rejected


def fit_alpha(rounds: Rounds) -> float:
    """Maximum-likelihood α under independent acceptance, honouring each round's draft length.

    The log-likelihood is K·log α + R·log(1 − α), with K the drafts kept and
    R the rounds that ended in a rejection (k < g), so α̂ = K / (K + R).
    Rounds that drafted nothing carry no information and are ignored.
    """
    kept, rejected = _sufficient(_checked(rounds))
    require(kept + rejected > 0, "no round drafted a token, so acceptance cannot be estimated; "
                                 "pass rounds with at least one draft")
    return kept / (kept + rejected)


def _cell_law(alpha: float, g: int) -> list[float]:
    """P(k) for k = 0..g under independent acceptance at rate ``alpha``."""
    return [alpha ** k * (1 - alpha) for k in range(g)] + [alpha ** g]


def _pooled_cells(observed: list[int], expected: list[float]) -> list[tuple[float, float]]:
    """(observed, expected) cells of one draft length, those expected below MIN_EXPECTED merged into one."""
    cells = [(o, e) for o, e in zip(observed, expected) if e >= MIN_EXPECTED]
    small = [(o, e) for o, e in zip(observed, expected) if e < MIN_EXPECTED]
    pooled = (sum(o for o, _ in small), sum(e for _, e in small))
    return cells + ([pooled] if pooled[1] > 0 else [])


@dataclass(frozen=True)
class BurstinessTest:
    """Pearson's chi-square of the accepted-length histogram against independent acceptance at α̂."""

    alpha: float  # maximum-likelihood acceptance rate (fit_alpha)
    statistic: float  # chi-square statistic over the pooled cells
    dof: int  # cells − draft lengths − 1 (each length's total is fixed, α is fitted); 0: nothing to test
    p_value: float  # nan when dof is 0
    extremes_observed: int  # rounds of >= 2 drafts that kept none or all of them
    extremes_expected: float  # the same count expected under independence at α̂
    threshold: float  # significance level the verdict uses
    bursty: bool  # p_value < threshold and extremes_observed > extremes_expected


def burstiness_test(rounds: Rounds, threshold: float = 0.01) -> BurstinessTest:
    """Whether acceptance comes in bursts, judged on the per-round accepted-length histograms.

    Bursty means rounds are more all-or-nothing than independent acceptance
    allows: among rounds of at least two drafts (with one draft every round
    is all or nothing), more keep none or all of their drafts than expected
    at the fitted α̂. The verdict needs both a misfit (chi-square p-value below
    ``threshold``; cells expected to hold fewer than 5 rounds are pooled
    within their draft length) and that direction; a misfit the other way
    (acceptance more even than independence) is not called bursty.
    """
    require(0.0 < threshold < 1.0, f"threshold must be a significance level in (0, 1), got {threshold}")
    table = _checked(rounds)
    alpha = fit_alpha(table)
    statistic, dof = 0.0, -1
    extremes_observed, extremes_expected = 0, 0.0
    for g, observed in table.items():
        expected = [sum(observed) * p for p in _cell_law(alpha, g)]
        cells = [(o, e) for o, e in _pooled_cells(observed, expected) if e > 0]
        statistic += sum((o - e) ** 2 / e for o, e in cells)
        dof += max(len(cells) - 1, 0)
        if g >= 2:
            extremes_observed += observed[0] + observed[g]
            extremes_expected += expected[0] + expected[g]
    dof = max(dof, 0)
    p_value = _chi_square_survival(statistic, dof) if dof > 0 else math.nan
    bursty = dof > 0 and p_value < threshold and extremes_observed > extremes_expected
    return BurstinessTest(alpha, statistic, dof, p_value, extremes_observed, extremes_expected, threshold, bursty)


def _chi_square_survival(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with ``dof`` degrees of freedom (regularised upper gamma)."""
    shape, x = (torch.tensor(v, dtype=torch.float64) for v in (dof / 2, statistic / 2))
    return float(torch.special.gammaincc(shape, x))
