"""Sampling losslessness: every speculative decoder emits the target's exact distribution.

The default cases drive the table models of ``table_models`` (real drivers,
drafters and verification; the exact target law is read from the same
table). Real tiny transformers with the real streaming and retrieval caches
are checked the same way in the slow tests at the end, and a bf16 pair whose
verification runs the kernels' bf16 attention (AMX tiles or AVX512-BF16 dot
products where this machine has them, and the vector code).

A chi-square goodness-of-fit test (cells with expected count < 5 pooled)
must give p > 0.01 for the first token and for the first two tokens, at
temperature 1.0 and at 0.6 with top_p 0.9; the same test with an
always-accept rule injected into verification must fail.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch
from table_models import (VOCAB, FollowingHistoryCache, HistoryCache, TableModel, always_accept, chi_square_pvalue,
                          pair_laws, table_law)

from sparsedraft.engine.sampling import SamplingConfig, probabilities
from sparsedraft.speculative import (AcceptanceRule, Drafter, ModelDrafter, NgramDrafter, RetrievalDrafter,
                                     SpeculativeDrafter, speculative, standard_acceptance)

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLES = 20_000
REAL_SAMPLES = 10_000  # full speculative runs with real caches (~5 ms each): half, for the 15-minute suite
NEW_TOKENS = 3  # two drafts in the first round: both kept, then a bonus, is a path to the first two tokens
GAMMA = 2
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 4]])  # "1 4" recurs, so prompt lookup proposes
CONFIGS = {"t1.0": SamplingConfig(temperature=1.0), "t0.6-p0.9": SamplingConfig(temperature=0.6, top_p=0.9)}


def exact_prefix_law(model: TableModel, sampling: SamplingConfig) -> tuple[dict, dict]:
    """Target probabilities of the first token and of the first two tokens."""
    first, second = pair_laws(model, PROMPT[0].tolist(), sampling, 2)
    return table_law(first.sum(0)), table_law(second)


TARGET = TableModel(seed=0)
DRAFT = TableModel(seed=0, noise=1.0)  # correlated with the target: often, not always, accepted
DECODERS = ["model", "ngram", "retrieval", "triforce"]


def table_drafter(name: str, acceptance: AcceptanceRule) -> Drafter:
    if name == "model":
        return ModelDrafter(DRAFT, HistoryCache())
    if name == "ngram":
        return NgramDrafter(VOCAB, max_ngram=2)
    if name == "retrieval":  # the target over a cache that changes its distribution, resynced from the full cache
        return RetrievalDrafter(TARGET, FollowingHistoryCache(noise=0.6, spec_slots=GAMMA))
    if name == "triforce":  # level 2 = target over a following cache, verifying level-1 drafts
        level2 = FollowingHistoryCache(noise=0.7, spec_slots=GAMMA)
        return SpeculativeDrafter(RetrievalDrafter(TARGET, level2), ModelDrafter(DRAFT, HistoryCache()), 2, acceptance)
    raise AssertionError(name)


def sample_prefixes(make_drafter: Callable[[], Drafter], target, sampling: SamplingConfig,
                    acceptance: AcceptanceRule, samples: int = SAMPLES) -> tuple[Counter, Counter]:
    """First token and first two tokens of ``samples`` independently seeded runs."""
    one, two = Counter(), Counter()
    for seed in range(samples):
        cfg = SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k, seed)
        out = speculative(target, make_drafter(), PROMPT, NEW_TOKENS, GAMMA, cfg, acceptance=acceptance)
        tokens = tuple(out.tokens[0, :2].tolist())
        one[tokens[:1]] += 1
        two[tokens] += 1
    return one, two


def pvalues(decoder: str, config: str, acceptance: AcceptanceRule) -> tuple[float, float]:
    sampling = CONFIGS[config]
    law_one, law_two = exact_prefix_law(TARGET, sampling)
    one, two = sample_prefixes(lambda: table_drafter(decoder, acceptance), TARGET, sampling, acceptance)
    return chi_square_pvalue(one, law_one, SAMPLES), chi_square_pvalue(two, law_two, SAMPLES)



# Each case is 20,000 decoder runs (10-25 s on a busy 2-core CPU). The default suite runs every
# decoder at TriForce's setting (temperature 0.6, top-p 0.9); temperature 1.0 is marked slow.
CASES = [pytest.param(d, "t0.6-p0.9", id=f"{d}-t0.6-p0.9") for d in DECODERS] + \
        [pytest.param(d, "t1.0", id=f"{d}-t1.0", marks=pytest.mark.slow) for d in DECODERS]


@pytest.mark.parametrize("decoder,config", CASES)
def test_sampling_matches_target_law(decoder, config):
    first, pair = pvalues(decoder, config, standard_acceptance)
    assert first > 0.01 and pair > 0.01, (first, pair)


@pytest.mark.parametrize("decoder", ["model", pytest.param("triforce", marks=pytest.mark.slow)])
def test_broken_acceptance_rule_is_detected(decoder):
    first, pair = pvalues(decoder, "t1.0", always_accept)
    assert min(first, pair) < 0.01, (first, pair)


# ---- the same check with real tiny transformers and the real caches (slow) ---------------------

def real_models():
    """A 1-layer target with an 8-token vocabulary and a peaked head, and a perturbed copy as draft."""
    from sparsedraft.engine.tiny import tiny_model
    shape = dict(vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target, draft = tiny_model("qwen2", 0, **shape), tiny_model("qwen2", 0, **shape)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # random weights give near-uniform laws; sharpen them
        gen = torch.Generator().manual_seed(1)
        for p_target, p_draft in zip(target.parameters(), draft.parameters()):
            p_draft.copy_(p_target + 0.3 * p_target.std() * torch.randn(p_target.shape, generator=gen))
    return target, draft


def exact_real_law(target, sampling: SamplingConfig) -> tuple[dict, dict]:
    from sparsedraft.engine.prefill import prefill
    def law(tokens: torch.Tensor) -> torch.Tensor:
        return probabilities(prefill(target, target.new_cache(tokens.shape[1]), tokens)[0], sampling)
    first, one, two = law(PROMPT), {}, {}
    for a in range(VOCAB):
        one[(a,)] = float(first[a])
        second = law(torch.cat((PROMPT, torch.tensor([[a]])), 1))
        for b in range(VOCAB):
            two[(a, b)] = float(first[a] * second[b])
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["retrieval", "triforce"])
def test_sampling_matches_target_law_with_real_caches(decoder):
    from sparsedraft.engine.prefill_store import prefill_prompt
    from sparsedraft.speculative import retrieval, triforce
    target, draft = real_models()
    sampling = CONFIGS["t0.6-p0.9"]
    law_one, law_two = exact_real_law(target, sampling)
    # One target prefill shared by every run (each run copies it: the path every bench takes, tested equal to
    # a fresh prefill in test_prefilled.py); REAL_SAMPLES runs keep the chi-square's 1% false-alarm rate.
    shared = prefill_prompt(target, PROMPT)
    one, two = Counter(), Counter()
    for seed in range(REAL_SAMPLES):
        cfg = SamplingConfig(sampling.temperature, sampling.top_p, seed=seed)
        if decoder == "retrieval":
            out = retrieval(target, PROMPT, NEW_TOKENS, cfg, gamma=GAMMA, budget=4, chunk_size=2, prefilled=shared)
        else:
            out = triforce(target, draft, PROMPT, NEW_TOKENS, cfg, gamma1=2, gamma2=GAMMA, budget=4, chunk_size=2,
                           sink=2, window=4, prefilled=shared)
        tokens = tuple(out.tokens[0, :2].tolist())
        one[tokens[:1]] += 1
        two[tokens] += 1
    first, pair = chi_square_pvalue(one, law_one, REAL_SAMPLES), chi_square_pvalue(two, law_two, REAL_SAMPLES)
    assert first > 0.01 and pair > 0.01, (first, pair)


@pytest.mark.slow
def test_sampling_matches_target_law_with_a_restricted_draft_head():
    """A draft whose head scores 4 of the 8 tokens (q = 0 on the others, which keep target mass): the
    residual distribution must return exactly that mass."""
    from sparsedraft.engine.prefill_store import prefill_prompt
    from sparsedraft.speculative.vocab import restrict_head
    target, draft = real_models()
    draft = restrict_head(draft, torch.tensor([0, 2, 5, 7]))
    sampling = CONFIGS["t1.0"]
    law_one, law_two = exact_real_law(target, sampling)
    assert sum(law_one[(t,)] for t in (1, 3, 4, 6)) > 0.1  # the tokens the draft cannot propose matter here
    shared = prefill_prompt(target, PROMPT)
    one, two = Counter(), Counter()
    for seed in range(REAL_SAMPLES):
        cfg = SamplingConfig(sampling.temperature, sampling.top_p, seed=seed)
        out = speculative(target, ModelDrafter(draft, draft.new_cache(PROMPT.shape[1] + NEW_TOKENS + GAMMA)), PROMPT,
                          NEW_TOKENS, GAMMA, cfg, prefilled=shared)
        tokens = tuple(out.tokens[0, :2].tolist())
        one[tokens[:1]] += 1
        two[tokens] += 1
    first, pair = chi_square_pvalue(one, law_one, REAL_SAMPLES), chi_square_pvalue(two, law_two, REAL_SAMPLES)
    assert first > 0.01 and pair > 0.01, (first, pair)


# ---- the same check in bf16, through the kernels' bf16 attention (slow) ------------------------

def bf16_models():
    """``real_models`` in bf16 with head_dim 32, the shape the bf16 attention kernels take (their AMX-tile or
    AVX512-BF16 dot-product path where the CPU and build have one, else the widening vector code)."""
    from sparsedraft.engine.tiny import tiny_model
    shape = dict(vocab_size=VOCAB, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    target, draft = tiny_model("qwen2", 0, **shape), tiny_model("qwen2", 0, **shape)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
        gen = torch.Generator().manual_seed(1)
        for p_target, p_draft in zip(target.parameters(), draft.parameters()):
            p_draft.copy_(p_target + 0.3 * p_target.std() * torch.randn(p_target.shape, generator=gen))
    return target.to(torch.bfloat16), draft.to(torch.bfloat16)


def exact_step_law(target, shared, sampling: SamplingConfig) -> tuple[dict, dict]:
    """The target's law of the first two tokens as plain decoding computes it: the prefill's last logits,
    then one one-token step per first token over a copy of the prefilled cache (a verification's rows are
    held to those steps' bits by test_exact_rows.py)."""
    first, one, two = probabilities(shared.logits[0].float(), sampling), {}, {}
    for a in range(VOCAB):
        one[(a,)] = float(first[a])
        cache = target.new_cache(PROMPT.shape[1] + 1)
        shared.seed(cache)
        with torch.inference_mode():
            second = probabilities(target(torch.tensor([[a]]), cache=cache)[0, -1].float(), sampling)
        for b in range(VOCAB):
            two[(a, b)] = float(first[a] * second[b])
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["standard", "always-accept"])
@pytest.mark.parametrize("tiles", [True, False])
def test_sampling_matches_target_law_in_bf16(tiles, rule):
    """Two-level speculation with a bf16 target and draft, verification through the bf16 kernels (tiles or
    dot products on, where this machine's build has them, and off): the target's law at T = 0.6, top-p 0.9,
    and an always-accept rule on the same path caught."""
    from sparsedraft.engine import kernels
    from sparsedraft.engine.prefill_store import prefill_prompt
    assert kernels.step_fits(torch.zeros(1, 1, 64, dtype=torch.bfloat16)), "the bf16 kernels must run here"
    if tiles and not (kernels.on_tiles() or kernels.on_dots()):
        pytest.skip(f"no AMX tiles or AVX512-BF16 dot products in this build: {kernels.path()}")
    target, draft = bf16_models()
    before = kernels.use_tiles(tiles)
    try:
        sampling = CONFIGS["t0.6-p0.9"]
        shared = prefill_prompt(target, PROMPT)
        law_one, law_two = exact_step_law(target, shared, sampling)
        acceptance = always_accept if rule == "always-accept" else standard_acceptance
        one, two = Counter(), Counter()
        for seed in range(REAL_SAMPLES):
            cfg = SamplingConfig(sampling.temperature, sampling.top_p, seed=seed)
            drafter = ModelDrafter(draft, draft.new_cache(PROMPT.shape[1] + NEW_TOKENS + GAMMA))
            out = speculative(target, drafter, PROMPT, NEW_TOKENS, GAMMA, cfg, prefilled=shared,
                              acceptance=acceptance)
            tokens = tuple(out.tokens[0, :2].tolist())
            one[tokens[:1]] += 1
            two[tokens] += 1
    finally:
        kernels.use_tiles(before)
    first, pair = chi_square_pvalue(one, law_one, REAL_SAMPLES), chi_square_pvalue(two, law_two, REAL_SAMPLES)
    if rule == "standard":
        assert first > 0.01 and pair > 0.01, (first, pair)
    else:
        assert min(first, pair) < 1e-4, (first, pair)
