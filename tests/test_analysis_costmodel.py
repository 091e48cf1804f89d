"""The cost model reproduces the hand-computed walkthroughs and its expectation matches simulation."""

import random

import pandas as pd
import pytest

from sparsedraft.analysis.costmodel import (WALKTHROUGH_COSTS, HierarchySetup, LevelCosts, acceptance_sweep,
                                            build_schedule, expected_tokens_per_verify, measured_level_costs,
                                            predict_ms_per_token, predict_two_level, speedup_vs_context,
                                            walkthrough_collapse_schedule, walkthrough_normal_schedule)
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.roofline import HARDWARE, MODELS


def test_normal_walkthrough_is_100_7_ms_for_8_tokens():
    s = walkthrough_normal_schedule()
    assert s.total_ms == pytest.approx(100.7, abs=1e-9)
    assert s.tokens == 8
    assert round(s.ms_per_token, 1) == 12.6
    assert round(s.speedup, 1) == 4.4
    table = s.table()
    assert table.level.value_counts().to_dict() == {1: 6, 2: 3, 3: 1}
    assert table.clock_ms.iloc[-1] == pytest.approx(100.7)
    assert table.held.max() == 7  # level 2 overshoots gamma2 = 6 by one


def test_collapse_walkthrough_is_about_50_ms_per_token():
    s = walkthrough_collapse_schedule()
    assert round(s.total_ms) == 145
    assert s.tokens == 3
    assert round(s.ms_per_token, -1) == 50  # 48.5 ms/token before the rebuild
    with_rebuild = walkthrough_collapse_schedule(rebuild_ms=10.0)
    assert with_rebuild.ms_per_token > 50
    assert with_rebuild.table().action.iloc[-1] == "rebuild"
    assert s.speedup < 1.2  # no better than vanilla in practice


def test_all_accepted_iteration_needs_only_two_rounds():
    s = build_schedule(WALKTHROUGH_COSTS, 2, 6, level2_accepted=(2, 2), level3_accepted=6)
    assert s.total_ms == pytest.approx(85.8)
    assert s.tokens == 7


@pytest.mark.parametrize("level2, level3, fragment", [
    ((2,), 3, "add rounds"),
    ((2, 2, 2), 6, "drop the extra"),
    ((3, 2), 6, "must lie in [0, gamma1=2]"),
    ((2, 2), 7, "level3_accepted=7"),
])
def test_build_schedule_rejects_inconsistent_outcomes(level2, level3, fragment):
    with pytest.raises(SparsedraftError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        build_schedule(WALKTHROUGH_COSTS, 2, 6, level2, level3)


def test_level_costs_validate():
    with pytest.raises(SparsedraftError, match="draft_ms"):
        LevelCosts(0.0, 14.0, 56.0)


def test_expected_tokens_per_verify_formula():
    assert expected_tokens_per_verify(0.0, 5) == 1.0
    assert expected_tokens_per_verify(1.0, 5) == 6.0
    assert expected_tokens_per_verify(0.5, 2) == pytest.approx(1.75)


def test_two_level_prediction():
    p = predict_two_level(draft_ms=1.0, target_ms=10.0, gamma=4, alpha=0.8)
    assert p.ms_per_token == pytest.approx(14.0 / ((1 - 0.8 ** 5) / 0.2))
    assert p.speedup == pytest.approx(10.0 / p.ms_per_token)


def test_three_level_prediction_with_perfect_acceptance_matches_schedule():
    p = predict_ms_per_token(WALKTHROUGH_COSTS, 2, 6, alpha1=1.0, alpha2=1.0)
    s = build_schedule(WALKTHROUGH_COSTS, 2, 6, (2, 2), 6)
    assert p.ms_per_iteration == pytest.approx(s.total_ms)
    assert p.tokens_per_iteration == pytest.approx(s.tokens)


def _simulate(alpha1, alpha2, gamma1, gamma2, iterations, rng):
    ms = tokens = 0.0
    for _ in range(iterations):
        rounds, held = [], 0
        while held < gamma2:
            k = 0
            while k < gamma1 and rng.random() < alpha1:
                k += 1
            rounds.append(k)
            held += k + 1
        a = 0
        while a < held and rng.random() < alpha2:
            a += 1
        s = build_schedule(WALKTHROUGH_COSTS, gamma1, gamma2, rounds, a)
        ms, tokens = ms + s.total_ms, tokens + s.tokens
    return ms / tokens


@pytest.mark.parametrize("alpha1, alpha2, gamma1, gamma2", [(0.7, 0.9, 2, 6), (0.4, 0.6, 3, 5)])
def test_three_level_expectation_matches_simulated_schedules(alpha1, alpha2, gamma1, gamma2):
    predicted = predict_ms_per_token(WALKTHROUGH_COSTS, gamma1, gamma2, alpha1, alpha2).ms_per_token
    simulated = _simulate(alpha1, alpha2, gamma1, gamma2, 3000, random.Random(0))
    assert simulated == pytest.approx(predicted, rel=0.03)


def _simulate_capped(alpha1, alpha2, gamma1, gamma2, iterations, rng, costs=WALKTHROUGH_COSTS):
    """The library's rule: a round holding h tokens drafts min(gamma1, gamma2 - h - 1); level 3 checks gamma2."""
    ms = tokens = 0.0
    for _ in range(iterations):
        held = 0
        while held < gamma2:
            drafts = min(gamma1, gamma2 - held - 1)
            k = 0
            while k < drafts and rng.random() < alpha1:
                k += 1
            ms += drafts * costs.draft_ms + costs.retrieval_ms
            held += k + 1
        assert held == gamma2
        a = 0
        while a < held and rng.random() < alpha2:
            a += 1
        ms, tokens = ms + costs.target_ms, tokens + a + 1
    return ms / tokens


@pytest.mark.parametrize("alpha1, alpha2, gamma1, gamma2", [(0.7, 0.9, 2, 6), (0.4, 0.6, 3, 5), (0.0, 0.8, 2, 6)])
def test_capped_rule_expectation_matches_simulation_and_differs_from_overshoot(alpha1, alpha2, gamma1, gamma2):
    capped = predict_ms_per_token(WALKTHROUGH_COSTS, gamma1, gamma2, alpha1, alpha2, overshoot=False)
    simulated = _simulate_capped(alpha1, alpha2, gamma1, gamma2, 3000, random.Random(1))
    assert simulated == pytest.approx(capped.ms_per_token, rel=0.03)
    assert capped.tokens_per_iteration == pytest.approx(expected_tokens_per_verify(alpha2, gamma2))
    overshoot_rule = predict_ms_per_token(WALKTHROUGH_COSTS, gamma1, gamma2, alpha1, alpha2)
    assert capped.ms_per_iteration < overshoot_rule.ms_per_iteration  # the last round drafts fewer tokens


def test_speedup_vs_context_rises_with_context():
    setup = HierarchySetup(alpha1=0.8, alpha2=0.9, alpha_tiny=0.5)
    frame = speedup_vs_context(MODELS["llama2-7b-128k"], MODELS["llama-68m"], HARDWARE["a100-80gb"],
                               [2048, 16384, 131072], setup)
    assert set(frame.method) == {"triforce", "retrieval self-spec", "tiny draft"}
    tri = frame[frame.method == "triforce"].sort_values("context")
    assert tri.speedup.is_monotonic_increasing
    short = frame[frame.context == 2048].iloc[0]
    assert short.retrieval_ms == short.target_ms  # the whole context fits the retrieval budget
    long = frame[frame.context == 131072].set_index("method").speedup
    assert long["triforce"] > long["retrieval self-spec"] > 1


def test_hierarchy_setup_validates():
    with pytest.raises(SparsedraftError, match="alpha2"):
        HierarchySetup(alpha1=0.5, alpha2=1.5, alpha_tiny=0.5)


def _inline_sweep(costs, gamma_pairs, alpha_points):
    """The comprehension notebook 04's cell 9 held before it called acceptance_sweep."""
    alphas = [i / (alpha_points - 1) for i in range(alpha_points)]
    return pd.DataFrame([
        {"alpha": a, "gammas": f"γ1={g1}, γ2={g2}", "gamma1": g1, "gamma2": g2,
         "speedup": predict_ms_per_token(costs, g1, g2, a, a).speedup}
        for g1, g2 in gamma_pairs for a in alphas])


@pytest.mark.parametrize("alpha_points", [101, 21])  # notebook 04's default and the quick profile's
def test_acceptance_sweep_is_notebook_04s_former_inline_table(alpha_points):
    pairs = [[1, 3], [2, 6], [4, 8], [2, 12]]  # notebook 04's gamma_pairs, with its costs (the walkthrough's)
    pd.testing.assert_frame_equal(acceptance_sweep(WALKTHROUGH_COSTS, pairs, alpha_points),
                                  _inline_sweep(WALKTHROUGH_COSTS, pairs, alpha_points), check_exact=True)


def test_acceptance_sweep_validates():
    with pytest.raises(SparsedraftError, match="alpha_points must be >= 2"):
        acceptance_sweep(WALKTHROUGH_COSTS, [[2, 6]], 1)
    with pytest.raises(SparsedraftError, match=r"pairs, got \[\[2, 6, 1\]\]"):
        acceptance_sweep(WALKTHROUGH_COSTS, [[2, 6, 1]], 11)


def test_a_runs_predicted_speedup_is_the_cost_model_over_its_own_parts():
    from sparsedraft.analysis.costmodel import predicted_speedup
    # Two levels: 10 verifications of gamma 4 (draft 2 ms per token, verify 30 ms, 1 ms of bookkeeping each)
    rounds = {"target": {"4": [2, 2, 2, 2, 2]}}  # kept 20, rejected 8: alpha 20 / 28
    two = predicted_speedup({"gamma": 4}, {"draft": 0.08, "verify": 0.3}, {"target": 40}, {"target": 10}, rounds,
                            0.39, 50.0)
    expected = predict_two_level(2.0, 30.0, 4, 20 / 28, overhead_ms=1.0)
    assert two == pytest.approx(50.0 / expected.ms_per_token)
    # Three levels: the same quantities measured_level_costs and predict_ms_per_token take in notebook 05
    seconds = {"level2_draft": 0.01, "level2_verify": 0.2, "draft": 0.21, "verify": 0.5}
    drafted, verifications = {"level2": 40, "target": 60}, {"level2": 20, "target": 10}
    tri_rounds = {"level2": {"2": [5, 5, 10]}, "target": {"6": [1, 1, 1, 1, 1, 1, 4]}}
    three = predicted_speedup({"gamma1": 2, "gamma2": 6}, seconds, drafted, verifications, tri_rounds, 0.75, 80.0)
    costs, overhead = measured_level_costs(seconds, drafted, verifications, 0.75)
    alpha1, alpha2 = 25 / 35, (sum(k for k in range(6)) + 6 * 4) / (sum(k for k in range(6)) + 6 * 4 + 6)
    assert three == pytest.approx(80.0 / predict_ms_per_token(costs, 2, 6, alpha1, alpha2, overhead_ms=overhead,
                                                              overshoot=False).ms_per_token)
    assert predicted_speedup({}, {}, {}, {}, {}, 0.0, 50.0) is None  # plain decoding: no drafts, no alpha
