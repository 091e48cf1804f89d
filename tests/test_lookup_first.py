"""Prompt lookup first, a draft model where it knows better (``draft_lookup``, :class:`LookupFirst`).

Greedy output equals plain decoding with a feature head (three caches, as
TriForce's level 1, in a batch) and with a model drafter (truncated
target, streaming cache), and both sources draft rounds in those runs.
The choice follows its rule: lookup where the context holds a continuation
and the model is not sure of another token, the model where it is or
where lookup finds nothing. Sampled output keeps the target's law (chi-square), and the
same check catches a mutant whose choice reads the model's random draw.
Bad values are refused before any forward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from feature_heads import perturbed_head
from table_models import chi_square_pvalue

from sparsedraft import SparsedraftError, decode
from sparsedraft.engine.generate import generate
from sparsedraft.engine.prefill_store import prefill_prompt
from sparsedraft.engine.sampling import SamplingConfig
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative import LookupFirst, NgramDrafter, speculative, triforce
from sparsedraft.speculative.lookup_first import TRUSTED_MATCH
from sparsedraft.speculative.drafters import ModelDrafter, Proposal, ngram_lookup
from sparsedraft.speculative.feature_drafter import FeatureDrafter
from sparsedraft.speculative.truncate import truncated_draft

pytestmark = pytest.mark.usefixtures("one_thread")

NEW, GAMMA = 32, 4


@pytest.fixture(scope="module")
def loop():
    """A tiny target with a sharpened head (so the draft is sometimes sure), a perturbed feature head, a prompt
    that repeats itself (so lookup finds continuations) and the plain greedy tokens."""
    target = tiny_model("qwen3", seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)
    head = perturbed_head(target, noise=0.1)[0]
    half = torch.randint(0, target.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat((half, half[:, :20]), 1)
    return target, head, prompt, generate(target, prompt, NEW).tokens


def both_drafted(drafter: LookupFirst) -> None:
    assert drafter.lookup_rounds > 0 and drafter.model_rounds > 0, (drafter.lookup_rounds, drafter.model_rounds)


@pytest.mark.parametrize("override", [0.5, 1.0])
@pytest.mark.parametrize("cache", ["full", "streaming", "budget"])
def test_greedy_output_with_lookup_first_and_a_feature_head_equals_plain_decoding(loop, cache, override):
    target, head, prompt, ar = loop
    model = FeatureDrafter.create(head, cache, prompt.shape[1] + NEW, gamma=GAMMA, sink=4, window=8, budget=16,
                                  chunk_size=4)
    drafter = LookupFirst(model, override)
    out = speculative(target, drafter, prompt, NEW, GAMMA)
    assert torch.equal(out.tokens, ar)
    both_drafted(drafter)


@pytest.mark.parametrize("override", [0.5, 1.0])
def test_greedy_output_with_lookup_first_and_a_model_drafter_equals_plain_decoding(loop, override):
    target, _, prompt, ar = loop
    drafter = LookupFirst(ModelDrafter(truncated_draft(target, 1), target.new_cache(prompt.shape[1] + NEW)),
                          override)
    out = speculative(target, drafter, prompt, NEW, GAMMA)
    assert torch.equal(out.tokens, ar)
    both_drafted(drafter)


def test_lookup_first_as_triforce_level_one_equals_plain_decoding(loop):
    target, head, prompt, ar = loop
    level1 = LookupFirst(FeatureDrafter.create(head, "streaming", 0, gamma=2 + 5, sink=4, window=8), 0.5)
    out = triforce(target, level1, prompt, NEW, gamma1=2, gamma2=5, budget=16, chunk_size=4)
    assert torch.equal(out.tokens, ar)
    both_drafted(level1)


METHODS_WITH_LOOKUP = [
    ("spec", {"gamma": GAMMA}),
    ("spec", {"gamma": GAMMA, "draft_confidence": 0.3}),
    ("budgetdraft", {"gamma": GAMMA, "budget": 16, "chunk_size": 4}),
    ("triforce", {"gamma1": 2, "gamma2": 4, "budget": 16, "chunk_size": 4, "sink": 4, "window": 8}),
]


@pytest.mark.parametrize("method,options,draft", [(m, o, d) for m, o in METHODS_WITH_LOOKUP
                                                  for d in ("head", "truncated:1")
                                                  if m != "budgetdraft" or d == "head"])  # budgetdraft: a head
def test_decode_takes_draft_lookup_for_every_method_with_a_draft_model(loop, method, options, draft):
    target, head, prompt, ar = loop
    out = decode(target, prompt, method, NEW, draft=head if draft == "head" else draft, draft_lookup=0.5, **options)
    assert torch.equal(out.tokens, ar)


def test_a_batch_with_lookup_first_gives_each_row_its_plain_output(loop):
    target, head, prompt, _ = loop
    rows = [prompt[0].tolist(), prompt[0, 6:].tolist()]
    result = decode(target, rows, "spec", NEW, draft=head, gamma=GAMMA, draft_lookup=0.5)
    for b, row in enumerate(rows):
        assert torch.equal(result.tokens[b], generate(target, torch.tensor([row]), NEW).tokens[0]), b


def test_the_model_takes_a_round_only_when_sure_of_another_token_or_lookup_has_none(loop):
    """Round by round against the rule: the model is asked (drafts its first token) where lookup found nothing, or
    below override 1 where lookup's match is shorter than TRUSTED_MATCH tokens; asked, it takes the round when its
    first draft is another token with a top-1 probability >= override; otherwise lookup's tokens go."""
    target, head, prompt, _ = loop
    for override in (0.3, 0.9, 1.0):
        drafter = LookupFirst(FeatureDrafter.create(head, "full", prompt.shape[1] + NEW, gamma=GAMMA), override)
        seen = Counter()
        propose, model_propose = drafter.propose, drafter.model.propose
        asked = []

        def counted(gamma: int) -> Proposal:
            asked.append(gamma)
            return model_propose(gamma)

        def checked(gamma: int) -> Proposal:
            expect, matched = ngram_lookup(drafter.lookup.history, gamma)
            asked.clear()
            out = propose(gamma)
            assert bool(asked) == (matched == 0 or (override < 1 and matched < TRUSTED_MATCH)), (override, matched)
            if out.top1 is None:  # lookup's round
                assert expect.numel() and torch.equal(out.tokens, expect)
                seen["lookup"] += 1
            else:
                first = float(out.top1[0])
                assert not expect.numel() or (first >= override and int(out.tokens[0]) != int(expect[0]))
                seen["model"] += 1
            seen["trusted" if matched >= TRUSTED_MATCH else f"matched {matched}"] += 1
            return out

        drafter.model.propose, drafter.propose = counted, checked
        speculative(target, drafter, prompt, NEW, GAMMA)
        assert seen["lookup"] == drafter.lookup_rounds and seen["model"] == drafter.model_rounds
        assert seen["lookup"] > 0 and seen["model"] > 0 and seen["trusted"] > 0, (override, seen)


@pytest.mark.parametrize("options,message", [
    ({"draft": "ngram", "draft_lookup": 0.5}, "prompt lookup itself"),
    ({"draft": "truncated:1", "draft_lookup": 1.5}, r"in \(0, 1\]"),
    ({"draft": "truncated:1", "draft_lookup": -0.2}, r"in \(0, 1\]"),
])
def test_bad_draft_lookup_is_refused_before_any_forward(loop, options, message):
    target, _, prompt, _ = loop
    with pytest.raises(SparsedraftError, match=message):
        decode(target, prompt, "spec", NEW, **options)


def test_lookup_first_refuses_a_drafter_without_a_model():
    with pytest.raises(SparsedraftError, match="a model of its own"):
        LookupFirst(NgramDrafter(8), 0.5)


# ---- sampling: the target's law, chi-square ---------------------------------------------------------------

VOCAB = 8
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 4, 1, 5]])  # "1 5" and "4 1" recur: lookup finds them
SAMPLES = 3_000


class ReadsTheDraw(LookupFirst):
    """Mutant: weighs the model's sampled first token instead of its top-1 token, so the model's rounds are those
    whose random draw differed from lookup's: its tokens no longer follow the q it reports."""

    def propose(self, gamma: int) -> Proposal:
        found = self.lookup.propose(gamma)
        first = self.model.propose(1)
        if found.tokens.numel() and int(first.tokens[0]) == int(found.tokens[0]):
            self.model.rewind(1)
            self.model.follow(found.tokens.tolist())
            self.proposed = found.tokens.numel()
            return found
        self.model.proposed = 1
        self.lookup.rewind(found.tokens.numel())
        self.lookup.follow(first.tokens.tolist())
        self.proposed = 1
        return first


def lookup_pvalues(kind: type, samples: int) -> tuple[float, float, Counter]:
    """p-values of the first token's and first pair's counts over ``samples`` seeded runs at temperature 1, and
    the rounds each source drafted."""
    from test_feature_drafter import exact_law, sampling_pair
    target, head = sampling_pair()
    sampling = SamplingConfig(temperature=1.0)
    law_one, law_two = exact_law(target, sampling, PROMPT)
    shared = prefill_prompt(target, PROMPT)
    one, two, sources = Counter(), Counter(), Counter()
    for seed in range(samples):
        drafter = kind(FeatureDrafter.create(head, "full", PROMPT.shape[1] + 3, gamma=2), 0.3)
        out = speculative(target, drafter, PROMPT, 3, 2, SamplingConfig(1.0, seed=seed), prefilled=shared)
        tokens = tuple(out.tokens[0, :2].tolist())
        one[tokens[:1]] += 1
        two[tokens] += 1
        sources.update(lookup=drafter.lookup_rounds, model=drafter.model_rounds)
    return chi_square_pvalue(one, law_one, samples), chi_square_pvalue(two, law_two, samples), sources


def test_sampling_with_lookup_first_keeps_the_target_law():
    first, pair_p, sources = lookup_pvalues(LookupFirst, SAMPLES)
    assert sources["lookup"] > SAMPLES / 10 and sources["model"] > SAMPLES / 10, sources
    assert first > 0.01 and pair_p > 0.01, (first, pair_p)


def test_the_same_check_catches_a_choice_that_reads_the_random_draw():
    first, pair_p, _ = lookup_pvalues(ReadsTheDraw, SAMPLES)
    assert min(first, pair_p) < 0.01, (first, pair_p)


# ---- the agreement bench's simulation of it --------------------------------------------------------------

def test_stopped_rounds_draft_no_more_than_a_short_or_empty_proposal():
    from sparsedraft.budgetdraft.feature_eval import stopped_rounds
    hits = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    # row 0 offers 2 tokens and keeps both; row 3 offers none (the target's token alone); row 4 offers 3
    assert stopped_rounds(hits, 3, lengths=torch.tensor([2, 3, 3, 0, 3])) == [(2, 2), (0, 0), (3, 3)]


def test_lookup_matches_score_what_prompt_lookup_proposes_at_each_entry():
    from sparsedraft.budgetdraft.feature_eval import lookup_matches
    tokens = torch.tensor([5, 6, 7, 5, 6, 9, 8])
    found = lookup_matches(tokens, torch.arange(0, 5), 2)
    matches, lengths, first = found.matches, found.lengths, found.first
    # entry 2: text 5 6 7 5, "5" occurred at 0, so lookup offers 6 7 against 6 9; entry 3: text 5 6 7 5 6, "5 6"
    # occurred at 0, so it offers 7 5 against 9 8; entry 4 ends in 9, which never occurred before
    assert lengths.tolist() == [0, 0, 2, 2, 0] and first.tolist() == [-1, -1, 6, 7, -1]
    assert found.matched.tolist() == [0, 0, 1, 2, 0]
    assert matches.tolist() == [[False, False], [False, False], [True, False], [False, False], [False, False]]


def test_the_simulated_rounds_are_the_rounds_decoding_runs(loop, tmp_path, monkeypatch):
    """bench.agreement's lookup-first rounds on the target's greedy continuation are the rounds a greedy
    speculative run with LookupFirst drafts and keeps, one by one, over the starts the simulation covers."""
    from sparsedraft.budgetdraft import feature_eval
    target, head, prompt, _ = loop
    gamma, override = 3, 0.5
    monkeypatch.setattr(feature_eval, "prompt_tokens", lambda tokenizer, context, split, variant: prompt[0])
    data = feature_eval.greedy_continuations(target, "tiny", None, tmp_path, 1, prompt.shape[1], NEW)
    report = feature_eval.continuation_report(head, data, gammas=(gamma,))
    simulated = report["lookup_first"][override]["gamma"][gamma]
    drafter = LookupFirst(FeatureDrafter.create(head, "full", prompt.shape[1] + NEW + 8, gamma=gamma), override)
    rounds, commit = [], drafter.commit

    def logged(accepted: int, token: int, target_state=None) -> None:
        rounds.append((drafter.proposed, accepted))
        commit(accepted, token, target_state)

    drafter.commit = logged
    speculative(target, drafter, prompt, NEW + 8, gamma)
    # Decoding's first round drafts the first new token, which the bench leaves out (its entries start one later:
    # the first draft it scores is of the second new token); from there the two run the same rounds.
    ran = rounds[1:1 + simulated["rounds"]]
    assert 0 < report["lookup_first"][override]["lookup_starts"] < 1  # both sources drafted
    assert sum(d for d, _ in ran) / len(ran) == pytest.approx(simulated["drafted_per_round"])
    assert sum(a for _, a in ran) / len(ran) == pytest.approx(simulated["accepted_per_round"])


def test_a_drafter_takes_its_top1_probabilities_only_when_something_reads_them(loop):
    """The softmax over the vocabulary behind Proposal.top1 is paid by a drafter that stops on its confidence or is
    weighed by LookupFirst, not by every draft step."""
    from sparsedraft.speculative.drafters import DraftContext
    from sparsedraft.speculative.drivers import prefill_target
    from sparsedraft.speculative.stats import Stopwatch
    target, head, prompt, _ = loop
    with torch.inference_mode():
        state = prefill_target(target, prompt, 8, False, None, True, ())
        for confidence, weighed in ((0.0, False), (0.2, False), (0.0, True)):
            drafter = FeatureDrafter.create(head, "full", prompt.shape[1] + 8, gamma=3)
            drafter.confidence = confidence
            if weighed:
                LookupFirst(drafter, 0.5)
            drafter.start(prompt[0], state, DraftContext(SamplingConfig(), None, Stopwatch()))
            out = drafter.propose(3)
            assert (out.top1 is None) == (not confidence and not weighed), (confidence, weighed)
            if out.top1 is not None:
                assert out.top1.shape == out.tokens.shape and bool(((out.top1 > 0) & (out.top1 <= 1)).all())
