"""The feature drafter (EAGLE's one layer over the target's features) inside every driver.

Greedy output must equal plain greedy output token for token whatever the
head drafts, over each of its three caches, as TriForce's first level, and
through ``decode()`` from a saved folder; sampled output must keep the
target's law (chi-square, with and without the drafter stopping on its own
confidence, and an always-accept mutant that the same test catches). A drafter folder is refused against another target before any
forward. A batch of prompts gives each row its own plain output.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from feature_heads import perturbed_head, raced
from table_models import always_accept, chi_square_pvalue

from sparsedraft import SparsedraftError, decode
from sparsedraft.engine.generate import generate
from sparsedraft.engine.sampling import SamplingConfig
from sparsedraft.speculative import speculative, triforce
from sparsedraft.speculative.feature import FeatureHead, load_feature_head, save_feature_head
from sparsedraft.speculative.feature_drafter import FeatureDrafter
from sparsedraft.speculative.verify import standard_acceptance
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


def head_for(target, seed: int = 1, noise: float = 0.2) -> FeatureHead:
    return perturbed_head(target, seed=seed, noise=noise)[0]


@pytest.fixture(scope="module")
def pair():
    return raced(lambda target: head_for(target, noise=0.0), NEW)


@pytest.mark.parametrize("cache", ["full", "streaming", "budget"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_speculation_with_a_feature_drafter_equals_autoregressive(pair, cache, gamma):
    target, head, prompt, ar = pair
    drafter = FeatureDrafter.create(head, cache, prompt.shape[1] + NEW, gamma=gamma, sink=4, window=8, budget=16,
                                    chunk_size=4)
    out = speculative(target, drafter, prompt, NEW, gamma)
    assert torch.equal(out.tokens, ar)
    level = out.stats.levels[-1]
    assert 0 < level.accepted < level.drafted  # both outcomes happened: the test exercised rejections


def test_feature_drafter_as_triforce_level_one_equals_autoregressive(pair):
    target, head, prompt, ar = pair
    level1 = FeatureDrafter.create(head, "streaming", 0, gamma=2 + 5, sink=4, window=8)
    out = triforce(target, level1, prompt, NEW, gamma1=2, gamma2=5, budget=16, chunk_size=4)
    assert torch.equal(out.tokens, ar)
    assert out.stats.levels[0].drafted > 0


def test_a_feature_drafter_reads_the_verifiers_features_instead_of_its_own(pair):
    """After a verification the head's inputs up to the last accepted token are the target's true features:
    the same drafts as a head fed the target's features for the whole committed sequence."""
    target, head, prompt, _ = pair
    drafter = FeatureDrafter.create(head, "full", prompt.shape[1] + NEW, gamma=4)
    out = speculative(target, drafter, prompt, NEW, 4)
    committed = torch.cat((prompt, out.tokens), 1)[:, :drafter.known]
    from sparsedraft.engine.model import Capture
    capture = Capture(layers=set(), hidden=True)
    target(committed, capture=capture)
    torch.testing.assert_close(drafter.feats[:drafter.known], capture.features[0], rtol=1e-4, atol=1e-4)


def test_saved_drafter_decodes_through_decode_and_is_refused_by_another_target(pair, tmp_path):
    target, head, prompt, ar = pair
    folder = save_feature_head(head, tmp_path / "feature", target, {"recipe": "test"})
    for cache in ("full", "budget"):
        out = decode(target, prompt, "spec", NEW, draft=str(folder), draft_cache=cache, budget=16, chunk_size=4)
        assert torch.equal(out.tokens, ar)
    out = decode(target, prompt, "budgetdraft", NEW, draft=str(folder), budget=16, chunk_size=4)
    assert torch.equal(out.tokens, ar)
    out = decode(target, prompt, "triforce", NEW, draft=str(folder), budget=16, chunk_size=4, sink=4, window=8)
    assert torch.equal(out.tokens, ar)
    other = tiny_model("qwen3", seed=5)
    with pytest.raises(SparsedraftError, match="trained for target"):
        load_feature_head(folder, other)
    with pytest.raises(SparsedraftError, match="trained for target"):
        decode(other, prompt, "spec", NEW, draft=str(folder))


def test_a_prefill_without_features_is_refused_before_decoding(pair):
    import dataclasses
    from sparsedraft.engine.prefill_store import prefill_prompt
    target, head, prompt, ar = pair
    shared = prefill_prompt(target, prompt)
    drafter = FeatureDrafter.create(head, "full", prompt.shape[1] + NEW, gamma=3)
    assert torch.equal(speculative(target, drafter, prompt, NEW, 3, prefilled=shared).tokens, ar)
    bare = dataclasses.replace(shared, features=None)
    with pytest.raises(SparsedraftError, match="no prompt features"):
        speculative(target, drafter, prompt, NEW, 3, prefilled=bare)


# ---- sampling: the target's law, chi-square ---------------------------------------------------------------

VOCAB = 8
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 4]])
SAMPLES = 3_000  # full runs of a real head (~10-20 ms each on a busy 2-core CPU)


def sampling_pair(lookup: bool = False):
    shape = dict(vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = tiny_model("qwen2", 0, **shape)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # random weights give near-uniform laws; sharpen them
    if lookup:  # a head that reads prompt lookup's proposals, its lookup_fc and gate moved off zero
        return target, perturbed_head(target, noise=0.5, floor=0.5, lookup=True, gate=True)[0]
    return target, head_for(target, noise=0.5)


def exact_law(target, sampling: SamplingConfig, prompt: torch.Tensor = PROMPT) -> tuple[dict, dict]:
    """The target's law of the first token and of the first pair after ``prompt``."""
    from sparsedraft.engine.prefill import prefill
    from sparsedraft.engine.sampling import probabilities

    def law(tokens):
        return probabilities(prefill(target, target.new_cache(tokens.shape[1]), tokens)[0], sampling)
    first, one, two = law(prompt), {}, {}
    for a in range(VOCAB):
        one[(a,)] = float(first[a])
        second = law(torch.cat((prompt, torch.tensor([[a]])), 1))
        for b in range(VOCAB):
            two[(a, b)] = float(first[a] * second[b])
    return one, two


def pvalues(sampling: SamplingConfig, acceptance, samples: int = SAMPLES, gamma: int = 2, confidence: float = 0.0,
            lengths: Counter | None = None, lookup: bool = False) -> tuple[float, float]:
    """p-values of the first token's and the first pair's counts over ``samples`` seeded runs of ``gamma`` + 1
    tokens; ``confidence`` is the drafter's early stop, ``lengths`` (when given) counts the proposals'
    lengths of every run, and ``lookup`` drafts with a head that reads prompt lookup's proposals."""
    from sparsedraft.engine.prefill_store import prefill_prompt
    target, head = sampling_pair(lookup)
    law_one, law_two = exact_law(target, sampling)
    shared = prefill_prompt(target, PROMPT)
    one, two = Counter(), Counter()
    for seed in range(samples):
        cfg = SamplingConfig(sampling.temperature, sampling.top_p, seed=seed)
        drafter = FeatureDrafter.create(head, "full", PROMPT.shape[1] + gamma + 1, gamma=gamma)
        drafter.confidence = confidence
        out = speculative(target, drafter, PROMPT, gamma + 1, gamma, cfg, acceptance=acceptance, prefilled=shared)
        tokens = tuple(out.tokens[0, :2].tolist())
        one[tokens[:1]] += 1
        two[tokens] += 1
        if lengths is not None:
            lengths.update({g: sum(n) for g, n in out.stats.levels[-1].rounds.items()})
    return chi_square_pvalue(one, law_one, samples), chi_square_pvalue(two, law_two, samples)


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingConfig(temperature=0.6, top_p=0.9), id="t0.6-p0.9"),
    pytest.param(SamplingConfig(temperature=1.0), id="t1.0", marks=pytest.mark.slow)])
def test_sampling_with_a_feature_drafter_keeps_the_target_law(sampling):
    first, pair_p = pvalues(sampling, standard_acceptance)
    assert first > 0.01 and pair_p > 0.01, (first, pair_p)


def test_a_drafter_that_stops_on_its_own_confidence_keeps_the_target_law():
    lengths = Counter()
    first, pair_p = pvalues(SamplingConfig(temperature=1.0), standard_acceptance, gamma=3, confidence=0.2,
                            lengths=lengths)
    assert 0 < lengths[3] < SAMPLES / 2, lengths  # each run's first proposal drafts 3 unless it stopped early
    assert first > 0.01 and pair_p > 0.01, (first, pair_p)


def test_sampling_with_a_head_that_reads_prompt_lookup_keeps_the_target_law():
    first, pair_p = pvalues(SamplingConfig(temperature=0.6, top_p=0.9), standard_acceptance, lookup=True)
    assert first > 0.01 and pair_p > 0.01, (first, pair_p)


def test_the_same_check_catches_an_always_accept_rule():
    first, pair_p = pvalues(SamplingConfig(temperature=1.0), always_accept, samples=2_000)
    assert min(first, pair_p) < 0.01, (first, pair_p)


BATCH_METHODS = {  # each cache the head can draft over, and TriForce's level 1
    "spec-full": ("spec", {"gamma": 3}),
    "spec-streaming": ("spec", {"gamma": 3, "draft_cache": "streaming", "sink": 4, "window": 8}),
    "budgetdraft": ("budgetdraft", {"gamma": 3, "budget": 16, "chunk_size": 4}),
    "triforce": ("triforce", {"gamma1": 2, "gamma2": 4, "budget": 16, "chunk_size": 4, "sink": 4, "window": 8}),
}


@pytest.mark.parametrize("method", sorted(BATCH_METHODS))
def test_a_batch_with_a_feature_drafter_gives_each_row_its_plain_greedy_output(pair, method):
    """Rows of different lengths in lockstep: the verifications (which hand each row's head its features) are
    batched, the head's steps run per row, and every row's output is its own plain greedy output."""
    target, head, prompt, _ = pair
    rows = [prompt[0, :40].tolist(), prompt[0].tolist(), prompt[0, 5:].tolist()]
    name, options = BATCH_METHODS[method]
    result = decode(target, rows, name, NEW, draft=head, **options)
    for b, row in enumerate(rows):
        alone = generate(target, torch.tensor([row]), NEW).tokens
        assert torch.equal(result.tokens[b], alone[0]), (method, b)
    assert result.lockstep.mean_rows > 1  # the verifications were shared
    assert sum(lvl.accepted for lvl in result.levels) > 0  # the heads drafted from the batched features


def test_a_sampled_row_with_a_feature_drafter_equals_its_batch1_run(pair):
    target, head, prompt, _ = pair
    rows = [prompt[0, :40].tolist(), prompt[0].tolist()]
    result = decode(target, rows, "spec", NEW, draft=head, gamma=3, temperature=0.8, seed=3)
    for b, row in enumerate(rows):
        alone = decode(target, torch.tensor([row]), "spec", NEW, draft=head, gamma=3, temperature=0.8, seed=3 + b)
        assert torch.equal(result.tokens[b], alone.tokens[0]), b


def test_the_memory_estimate_counts_each_rows_head_cache(pair):
    from sparsedraft.speculative.batching import batch_bytes
    from sparsedraft.speculative.methods import method_options
    target, head, _, _ = pair
    for cache in ("full", "streaming"):
        opts = method_options("spec", draft=head, gamma=3, draft_cache=cache, sink=4, window=8)
        built = FeatureDrafter.create(head, cache, 100 + 8, gamma=3, sink=4, window=8).cache
        held = sum(t.numel() * t.element_size() for t in (*built.k, *built.v))
        parts = batch_bytes(target, head, [100, 100], 8, "spec", opts, prefilled=False)
        assert parts["draft caches"] == 2 * held, cache
        extra = sum(p.numel() * p.element_size() for p in head.parameters())
        assert parts["weights"] == extra + sum(p.numel() * p.element_size() for p in target.parameters())
