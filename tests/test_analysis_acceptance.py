"""Acceptance fitted from per-round records: unbiased under independence and caps, bursts detected only when real."""

import json
import random

import pytest

from sparsedraft.analysis.acceptance import burstiness_test, fit_alpha
from sparsedraft.analysis.costmodel import expected_tokens_per_verify
from sparsedraft.errors import SparsedraftError
from sparsedraft.speculative.stats import LevelStats

GAMMA = 4
ROUNDS = 4000


def independent(alpha: float, drafts: int, rng: random.Random) -> int:
    """Drafts kept when each is accepted with probability alpha until the first rejection."""
    kept = 0
    while kept < drafts and rng.random() < alpha:
        kept += 1
    return kept


def simulate(alpha: float, seed: int, capped: bool, keep=independent) -> list[tuple[int, int]]:
    """(drafted, kept) per round; a capped round drafts a random 1..GAMMA tokens, as the last round before
    level 3 does."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(ROUNDS):
        drafts = rng.randint(1, GAMMA) if capped else GAMMA
        rounds.append((drafts, keep(alpha, drafts, rng)))
    return rounds


def recorded(rounds: list[tuple[int, int]]) -> LevelStats:
    level = LevelStats("level2")
    for drafted, kept in rounds:
        level.record(drafted, kept)
    return level


def all_or_nothing(alpha: float, drafts: int, rng: random.Random) -> int:
    return drafts if rng.random() < alpha else 0


def two_regimes(alpha: float, drafts: int, rng: random.Random) -> int:
    """Independent acceptance within a round, but each round draws a good (0.95) or poor (0.3) regime."""
    return independent(0.95 if rng.random() < alpha else 0.3, drafts, rng)


@pytest.mark.parametrize("alpha, seed", [(0.3, 0), (0.6, 1), (0.85, 2), (0.95, 3)])
def test_independent_capped_rounds_fit_alpha_and_are_not_bursty(alpha, seed):
    level = recorded(simulate(alpha, seed, capped=True))
    assert fit_alpha(level.rounds) == pytest.approx(alpha, abs=0.02)
    test = burstiness_test(level.rounds)
    assert test.dof >= 1 and test.p_value > test.threshold and not test.bursty


@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.9])
def test_pooled_ratio_falls_short_of_alpha_by_the_closed_form(alpha):
    level = recorded(simulate(alpha, 7, capped=False))
    pooled = (expected_tokens_per_verify(alpha, GAMMA) - 1) / GAMMA  # alpha (1 - alpha^g) / (g (1 - alpha))
    assert pooled == pytest.approx(alpha * (1 - alpha ** GAMMA) / (GAMMA * (1 - alpha)))
    assert level.acceptance_rate == pytest.approx(pooled, abs=0.02)
    assert fit_alpha(level.rounds) == pytest.approx(alpha, abs=0.02)
    assert alpha - pooled > 0.04  # the gap independence alone produces: no evidence of bursts
    assert not burstiness_test(level.rounds).bursty


@pytest.mark.parametrize("keep, capped", [(all_or_nothing, False), (all_or_nothing, True), (two_regimes, True)])
def test_bursty_rounds_are_flagged(keep, capped):
    test = burstiness_test(recorded(simulate(0.7, 11, capped, keep)).rounds)
    assert test.bursty and test.p_value < 1e-6
    assert test.extremes_observed > test.extremes_expected


def test_rounds_more_even_than_independence_misfit_without_being_bursty():
    test = burstiness_test(recorded([(GAMMA, 2)] * 500).rounds)  # every round keeps exactly half
    assert test.alpha == pytest.approx(2 / 3)
    assert test.p_value < 1e-6 and test.extremes_observed < test.extremes_expected and not test.bursty


@pytest.mark.parametrize("alpha, seed", [(0.6, 3), (0.8, 4)])
def test_ignoring_caps_biases_alpha_down(alpha, seed):
    rounds = simulate(alpha, seed, capped=True)
    as_if_uncapped = recorded([(GAMMA, kept) for _, kept in rounds])  # a capped full round looks like a rejection
    assert fit_alpha(as_if_uncapped.rounds) < alpha - 0.05
    assert fit_alpha(recorded(rounds).rounds) == pytest.approx(alpha, abs=0.02)


def test_rounds_survive_json_and_empty_drafts_carry_no_information():
    level = recorded(simulate(0.7, 5, capped=True))
    assert fit_alpha(json.loads(json.dumps(level.to_dict()))["rounds"]) == fit_alpha(level.rounds)
    level.record(0, 0)
    assert fit_alpha(level.rounds) == fit_alpha({g: c for g, c in level.rounds.items() if g > 0})


def test_bad_records_fail_with_the_fix():
    with pytest.raises(SparsedraftError, match="g \\+ 1 = 3"):
        fit_alpha({2: [1, 2]})
    with pytest.raises(SparsedraftError, match="no round drafted"):
        fit_alpha({0: [5]})
    with pytest.raises(SparsedraftError, match="threshold"):
        burstiness_test({2: [1, 2, 3]}, threshold=1.5)
