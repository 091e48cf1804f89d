"""TriForce's three levels emit the full target's law across several level-3 verifications.

Level 1 is a draft table model (its own cache) proposing ``GAMMA1`` = 2 tokens;
level 2 is the target over a cache that changes its distribution (the
retrieval cache's role: level 2's p differs from the full target's) emitting
``GAMMA2`` = 4 tokens by speculative decoding; level 3 is the full-cache target.
Runs generate ``NEW_TOKENS`` = 6 tokens at TriForce's sampling setting
(temperature 0.6, top-p 0.9). A level-3 verification emits at most
``GAMMA2 + 1`` tokens, so every run verifies at level 3 at least twice inside
the checked window, and the tokens after a level-3 rejection are checked too.
The models are the table models of ``table_models`` (real drivers, drafters
and verification; see that module for why).

Statistic. The exact target law of the window is computed from the table by
a forward recursion over the newest pair (no Monte Carlo). Over ``SAMPLES``
independently seeded runs, Pearson's chi-square goodness of fit is computed
for each position's marginal (tokens 1..6) and each pair of consecutive
tokens' joint law (5 pairs); the runs are independent, so each test is valid,
and the 11 p-values are combined by Bonferroni: min(1, 11 * smallest p). That
must exceed 0.01 for the real decoder and fall below 1e-4 for each mutant:
(a) TriForce's public code rule -- a level-3 rejection redrawn from p instead
of norm(max(p - q, 0)); (b) level 2 reporting level 1's q for the tokens it
kept from level 1 instead of its own p; (c) every draft accepted at both
levels. A fifth run, which must pass, gives level 2 its own quantised
weights (``draft_weights``: the target's table rounded to 16 levels per row,
as int4 rounds a group), so level 2's p differs from level 3's by the
quantisation as well as by the cache. A sixth, which must pass too, has
level 2 hand its tokens up as soon as it emits one it is less than 0.5 sure
of (``draft_confidence``), so level 3 verifies proposals of every length.
All share one seed list and one statistic.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from table_models import (FollowingHistoryCache, HistoryCache, TableModel, always_accept, chi_square_pvalue,
                          pair_laws, table_law)

from sparsedraft.engine.sampling import SamplingConfig
from sparsedraft.speculative import (AcceptanceRule, Drafter, ModelDrafter, Proposal, RetrievalDrafter,
                                     SpeculativeDrafter, speculative, standard_acceptance)

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLES = 5_000  # mutant (b), the weakest, still gives p ~ 4e-10 (1e-4 needed); the decoder ~0.5
NEW_TOKENS = 6
GAMMA1, GAMMA2 = 2, 4
PROMPT = torch.tensor([[2, 7, 1, 0, 6, 3, 5, 4]])
SAMPLING = SamplingConfig(temperature=0.6, top_p=0.9)
TARGET = TableModel(seed=0)
DRAFT = TableModel(seed=0, noise=1.0)  # correlated with the target: often, not always, accepted
LEVEL2_NOISE = 0.7  # how far level 2's p is from the full target's


def int4_rows(table: torch.Tensor) -> torch.Tensor:
    """Each row of logits rounded to 16 evenly spaced levels between its min and max (int4's group rounding)."""
    low, high = table.amin(-1, keepdim=True), table.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    return ((table - low) / scale).round().clamp(0, 15) * scale + low


QUANTISED = TableModel(seed=0)  # the target's tables, level 2's copy quantised
QUANTISED.base = int4_rows(TARGET.base)


class Level1KeepsQ(ModelDrafter):
    """Level 1 noting, for each token its verifier emits, the q that token was drawn from (None for
    the verifier's own correction or bonus token), since its verifier last reset ``origin``. Read by mutant (b)."""

    def propose(self, gamma: int) -> Proposal:
        self.last = super().propose(gamma)
        return self.last

    def commit(self, accepted: int, token: int, target=None) -> None:
        super().commit(accepted, token, target)
        self.origin += list(self.last.q[:accepted]) + [None]


class ReportsLevel1Q(SpeculativeDrafter):
    """Mutant (b): level 2 passes level 1's q upward for the tokens it kept from level 1."""

    def propose(self, gamma: int) -> Proposal:
        self.inner.origin = []
        own = super().propose(gamma)
        q = [mine if theirs is None else theirs for mine, theirs in zip(own.q, self.inner.origin)]
        return Proposal(own.tokens, torch.stack(q)) if q else own


class RedrawsFromP(SpeculativeDrafter):
    """Mutant (a): a level-3 rejection is replaced by a draw from p. Verification builds its residual
    from the q it is handed, so this level 2 hands level 3 q = 0 (max(p - 0, 0) = p) and its
    ``level3_acceptance`` keeps the acceptance probability min(1, p(x)/q(x)) with the true q(x)."""

    def propose(self, gamma: int) -> Proposal:
        own = super().propose(gamma)
        self.q_x = own.q[torch.arange(own.tokens.numel()), own.tokens]
        return Proposal(own.tokens, torch.zeros_like(own.q))

    def level3_acceptance(self, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        return standard_acceptance(p_x, self.q_x)


def hierarchy(variant: str) -> tuple[Drafter, AcceptanceRule]:
    """Levels 1 and 2 as one drafter, and the acceptance rule level 3 uses."""
    level1 = (Level1KeepsQ if variant == "level1-q-upward" else ModelDrafter)(DRAFT, HistoryCache())
    level2_type = {"level1-q-upward": ReportsLevel1Q, "redraw-from-p": RedrawsFromP}.get(variant, SpeculativeDrafter)
    rule = always_accept if variant == "always-accept" else standard_acceptance
    level2_model = QUANTISED if variant == "int4-level2" else TARGET
    level2 = level2_type(RetrievalDrafter(level2_model, FollowingHistoryCache(LEVEL2_NOISE, spec_slots=GAMMA2)),
                         level1, GAMMA1, rule)
    level2.confidence = 0.5 if variant == "level2-stops" else 0.0
    return level2, level2.level3_acceptance if variant == "redraw-from-p" else rule


def combined_pvalue(variant: str) -> tuple[float, Counter]:
    """Bonferroni-combined chi-square p-value of the marginals and consecutive pairs of tokens 1..6, and the
    lengths of the proposals level 3 verified (length -> rounds, over every run)."""
    lengths = Counter()
    marginals = [Counter() for _ in range(NEW_TOKENS)]
    pairs = [Counter() for _ in range(NEW_TOKENS - 1)]
    for seed in range(SAMPLES):
        drafter, rule = hierarchy(variant)
        sampling = SamplingConfig(SAMPLING.temperature, SAMPLING.top_p, seed=seed)
        out = speculative(TARGET, drafter, PROMPT, NEW_TOKENS, GAMMA2, sampling, acceptance=rule)
        assert out.stats.target_forwards >= 2, "the window must span several level-3 verifications"
        lengths.update({g: sum(n) for g, n in out.stats.levels[-1].rounds.items()})
        tokens = out.tokens[0].tolist()
        for t in range(NEW_TOKENS):
            marginals[t][(tokens[t],)] += 1
        for t in range(NEW_TOKENS - 1):
            pairs[t][(tokens[t], tokens[t + 1])] += 1
    laws = pair_laws(TARGET, PROMPT[0].tolist(), SAMPLING, NEW_TOKENS)
    pvalues = [chi_square_pvalue(marginals[t], table_law(laws[t].sum(0)), SAMPLES) for t in range(NEW_TOKENS)]
    pvalues += [chi_square_pvalue(pairs[t], table_law(laws[t + 1]), SAMPLES) for t in range(NEW_TOKENS - 1)]
    return min(1.0, len(pvalues) * min(pvalues)), lengths


@pytest.mark.parametrize("variant,lossless", [("triforce", True), ("int4-level2", True), ("level2-stops", True),
                                              ("redraw-from-p", False), ("level1-q-upward", False),
                                              ("always-accept", False)])
def test_three_levels_emit_target_law(variant, lossless):
    p, lengths = combined_pvalue(variant)
    assert p > 0.01 if lossless else p < 1e-4, p
    if variant == "level2-stops":  # without the stop each run's first proposal alone holds GAMMA2 tokens
        assert 0 < lengths[GAMMA2] < SAMPLES / 2, lengths
