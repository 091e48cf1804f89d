"""A drafter that ends its proposal on its own confidence (``draft_confidence``).

Greedy output equals plain decoding with the stop on, for a feature head (two
caches) and a model drafter, and the stop really shortens proposals (fewer
drafts, rounds below gamma, some still full). In retrieval and TriForce the
proposer is the target over its retrieval cache, which stops on its own
probabilities. A batch in lockstep gives each row its plain output with the
stop on. Bad values and drafts without a model are refused before any
forward. The cost model takes such a run's own drafting and models its
tokens with two acceptance rates (sure tokens, and the token a round stopped
after). The sampling checks (the target's law with the stop on) are in
``test_feature_drafter.py`` and ``test_triforce_sampling.py``.
"""
from __future__ import annotations

import pytest
import torch
from feature_heads import perturbed_head

from sparsedraft import SparsedraftError, decode
from sparsedraft.analysis.costmodel import (confidence_alphas, expected_tokens_per_verify, predicted_speedup,
                                           round_lengths, stopped_tokens_per_verify)
from sparsedraft.engine.generate import generate
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative.drafters import sure

pytestmark = pytest.mark.usefixtures("one_thread")

NEW, GAMMA = 24, 5


@pytest.fixture(scope="module")
def race():
    """A tiny target whose head is sharpened (random weights give near-uniform laws, so no draft would be sure
    of anything), the feature head that starts as its top block, a prompt and the plain greedy tokens."""
    target = tiny_model("qwen3", seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)
    head = perturbed_head(target, noise=0.0)[0]
    prompt = torch.randint(0, target.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    return target, head, prompt, generate(target, prompt, NEW).tokens


def lengths(out) -> dict[int, int]:
    return {g: sum(n) for g, n in out.stats.levels[-1].rounds.items()}


@pytest.mark.parametrize("draft,method,extra", [
    ("head", "spec", {}),
    ("head", "budgetdraft", {"budget": 16, "chunk_size": 4}),
    ("truncated:1", "spec", {}),
])
def test_greedy_output_with_a_confidence_stop_equals_plain_decoding(race, draft, method, extra):
    target, head, prompt, ar = race
    source = head if draft == "head" else draft
    always = decode(target, prompt, method, NEW, draft=source, gamma=GAMMA, **extra)
    stopped = decode(target, prompt, method, NEW, draft=source, gamma=GAMMA, draft_confidence=0.3, **extra)
    assert torch.equal(always.tokens, ar) and torch.equal(stopped.tokens, ar)
    short = sum(n for g, n in lengths(stopped).items() if g < GAMMA)
    assert short >= 2 and lengths(stopped).get(GAMMA, 0) >= 1, lengths(stopped)  # stops, not only the last round
    assert stopped.stats.levels[-1].drafted < always.stats.levels[-1].drafted


@pytest.mark.parametrize("method,options", [
    ("retrieval", {"gamma": GAMMA, "budget": 16, "chunk_size": 4}),
    ("triforce", {"draft": "ngram", "gamma1": 2, "gamma2": GAMMA, "budget": 16, "chunk_size": 4}),
])
def test_the_level_that_proposes_to_the_target_stops_on_its_own_confidence(race, method, options):
    """In retrieval and TriForce the proposer is the target over its retrieval cache: its own probabilities."""
    target, _, prompt, ar = race
    always = decode(target, prompt, method, NEW, **options)
    stopped = decode(target, prompt, method, NEW, draft_confidence=0.5, **options)
    assert torch.equal(always.tokens, ar) and torch.equal(stopped.tokens, ar)
    short = sum(n for g, n in lengths(stopped).items() if g < GAMMA)
    assert short >= 2 and lengths(stopped).get(GAMMA, 0) >= 1, lengths(stopped)
    assert stopped.stats.levels[-1].drafted < always.stats.levels[-1].drafted


@pytest.mark.parametrize("method,options", [
    ("spec", {"gamma": GAMMA}),
    ("triforce", {"draft": "ngram", "gamma1": 2, "gamma2": GAMMA, "budget": 16, "chunk_size": 4}),
])
def test_a_batch_with_the_stop_gives_each_row_its_plain_output(race, method, options):
    target, head, prompt, ar = race
    if method == "spec":
        options = {**options, "draft": head}
    other = torch.randint(0, target.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    out = decode(target, [prompt[0], other], method, NEW, draft_confidence=0.3, **options)
    assert torch.equal(out.tokens[0][:NEW], ar[0])
    assert torch.equal(out.tokens[1][:NEW], generate(target, other[None], NEW).tokens[0])


def test_sure_reads_the_top_probability_at_temperature_one():
    logits = torch.tensor([0.6, 0.2, 0.2]).log() + 3.0  # any shift: softmax gives 0.6 back
    assert sure(logits, 0.0) and sure(logits, 0.55) and not sure(logits, 0.65)


@pytest.mark.parametrize("options,message", [
    ({"draft": "truncated:1", "draft_confidence": 1.0}, "in \\[0, 1\\)"),
    ({"draft": "truncated:1", "draft_confidence": -0.1}, "in \\[0, 1\\)"),
    ({"draft": "ngram", "draft_confidence": 0.5}, "has none"),
])
def test_bad_confidence_is_refused_before_any_forward(race, options, message):
    target, _, prompt, _ = race
    with pytest.raises(SparsedraftError, match=message):
        decode(target, prompt, "spec", NEW, **options)


def test_two_acceptance_rates_one_for_sure_tokens_one_for_the_token_a_round_stopped_after():
    # gamma 3: full rounds hold sure tokens only; a shorter round's last token is the unsure one
    rounds = {"3": [1, 0, 0, 2], "1": [3, 1], "2": [0, 2, 1]}
    sure, unsure = confidence_alphas(rounds, 3)
    assert sure == pytest.approx(9 / 10) and unsure == pytest.approx(2 / 7)
    want = (3 * expected_tokens_per_verify(0.9, 3) + 4 * (1 + 2 / 7) + 3 * (0.1 + 0.9 * (2 + 2 / 7))) / 10
    assert stopped_tokens_per_verify(rounds, 3) == pytest.approx(want)
    assert confidence_alphas({"3": [0, 0, 0, 4]}, 3) == (1.0, 0.0)  # no unsure token judged: 0 by convention


def test_a_stopped_runs_prediction_takes_its_drafting_and_models_its_tokens():
    rounds = {"target": {"3": [1, 2, 1, 4], "1": [10, 6], "0": [1]}}  # 8 rounds of 3 drafts, 16 of 1, 1 of none
    options = {"gamma": 3, "draft_confidence": 0.5}
    seconds = {"draft": 0.040, "verify": 1.0}
    got = predicted_speedup(options, seconds, {"target": 40}, {"target": 25}, rounds, 1.1, 30.0)
    per_round_ms = (40.0 + 1000.0 + 60.0) / 25  # drafting, verification and overhead per verification
    assert got == pytest.approx(30.0 / (per_round_ms / stopped_tokens_per_verify(rounds["target"], 3)))
    assert round_lengths(rounds["target"]) == {3: 8, 1: 16}
    without = predicted_speedup({"gamma": 3}, seconds, {"target": 40}, {"target": 25}, rounds, 1.1, 30.0)
    assert without != pytest.approx(got)  # a run without the stop keeps the one-rate model
