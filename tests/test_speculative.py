"""Speculative decoding: verification rules, drafters, drivers, and greedy losslessness.

Every decoder must reproduce plain greedy decoding token for token, on tiny
random models of every family. Random drafts disagree with the target almost
always, so each decoder also runs with a *perturbed copy* of the target as its
draft: acceptance is then high and multi-token acceptance, bonus tokens and
long rollbacks are exercised.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sparsedraft.caches import StreamingCache
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.generate import generate
from sparsedraft.engine.sampling import SamplingConfig
from sparsedraft.speculative import (DRAFT, REBUILD, RETRIEVAL_LEVEL, SYNC, TARGET, VERIFY, DraftContext, LevelStats,
                                     ModelDrafter, NgramDrafter, Stopwatch, region, retrieval, speculative, triforce,
                                     truncated_draft, verify_greedy, verify_sampled)
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
# Tied embeddings make the tiny random Llama repeat its input token forever; untie them for varied outputs.
VARIED = {"llama": {"tie_word_embeddings": False}}
NEW = 40
GAMMA = 4


def make_prompt(length: int = 48, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    """Random tokens with a repeated stretch, so prompt lookup finds matches."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (length - 12,), generator=gen)
    return torch.cat((head, head[4:16]))[None]


def perturbed(model, scale: float = 0.1, seed: int = 1):
    """A copy of ``model`` with every weight moved by ``scale`` of its own spread: a draft that mostly agrees."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return draft


def streaming(model, positions: str) -> StreamingCache:
    return StreamingCache(model.cfg, sink=4, window=8, spec_slots=GAMMA, rotary=model.rotary, positions=positions)


def run_decoder(name: str, target, far, near, prompt: torch.Tensor, sampling=SamplingConfig()):
    context = prompt.shape[1] + NEW
    if name == "static-far":
        return speculative(target, ModelDrafter(far, far.new_cache(context)), prompt, NEW, GAMMA, sampling)
    if name == "static-near":
        return speculative(target, ModelDrafter(near, near.new_cache(context)), prompt, NEW, GAMMA, sampling)
    if name.startswith("streaming-"):
        drafter = ModelDrafter(near, streaming(near, name.removeprefix("streaming-")))
        return speculative(target, drafter, prompt, NEW, GAMMA, sampling)
    if name == "ngram":
        return speculative(target, NgramDrafter(target.cfg.vocab_size), prompt, NEW, GAMMA, sampling)
    if name == "truncated":
        draft = truncated_draft(target, 1)
        return speculative(target, ModelDrafter(draft, draft.new_cache(context)), prompt, NEW, GAMMA, sampling)
    if name == "retrieval":
        return retrieval(target, prompt, NEW, sampling, gamma=GAMMA, budget=16, chunk_size=4, rebuild="every:8")
    if name == "retrieval-accept":
        return retrieval(target, prompt, NEW, sampling, gamma=GAMMA, budget=16, chunk_size=4,
                         rebuild="accept<0.9:2", group_reduce="max")
    if name == "triforce-ngram":
        return triforce(target, NgramDrafter(target.cfg.vocab_size), prompt, NEW, sampling, gamma1=3, gamma2=5,
                        budget=16, chunk_size=4, rebuild="every:8")
    if name.startswith("triforce-"):
        draft = near if name == "triforce-near" else far
        return triforce(target, draft, prompt, NEW, sampling, gamma1=2, gamma2=5, budget=16, chunk_size=4,
                        sink=4, window=8, rebuild="accept<0.9:2")
    raise AssertionError(name)


DECODERS = ["static-far", "static-near", "streaming-true", "streaming-cache", "ngram", "truncated", "retrieval",
            "retrieval-accept", "triforce-far", "triforce-near", "triforce-ngram"]



@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    family = request.param
    target = tiny_model(family, 0, **VARIED.get(family, {}))
    far = tiny_model(family, 1, num_hidden_layers=1, **VARIED.get(family, {}))
    prompt = make_prompt()
    return target, far, perturbed(target), prompt, generate(target, prompt, NEW).tokens


NEAR = {"static-near", "streaming-cache", "retrieval", "triforce-near"}  # drafts that mostly agree


@pytest.mark.parametrize("decoder", DECODERS)
def test_greedy_equals_autoregressive(models, decoder):
    target, far, near, prompt, expected = models
    result = run_decoder(decoder, target, far, near, prompt)
    assert torch.equal(result.tokens, expected)
    stats = result.stats
    assert stats.generated == NEW and stats.target_forwards == stats.levels[-1].verifications
    for level in stats.levels:
        assert sum(level.histogram) == level.verifications
        assert level.accepted == sum(n * c for n, c in enumerate(level.histogram))
        assert level.drafted == sum(g * sum(row) for g, row in level.rounds.items())
    if decoder in NEAR:  # reach the paths a random draft never does: whole drafts kept, bonus tokens
        assert stats.levels[-1].histogram[-1] > 0 and stats.tokens_per_iteration > 2


def test_triforce_stats_name_levels_and_count_rebuilds():
    target = tiny_model("qwen2", 0)
    prompt = make_prompt()
    stats = run_decoder("triforce-far", target, tiny_model("qwen2", 1, num_hidden_layers=1), None, prompt).stats
    assert [lvl.name for lvl in stats.levels] == [RETRIEVAL_LEVEL, TARGET]
    assert stats.rebuilds > 0  # 16 retrieved tokens of ~50 keep level-3 acceptance below 0.9 at times
    assert {DRAFT, VERIFY, SYNC, REBUILD, region(RETRIEVAL_LEVEL, DRAFT), region(RETRIEVAL_LEVEL, VERIFY)} \
        <= set(stats.seconds)
    stats = retrieval(target, prompt, NEW, gamma=GAMMA, budget=16, chunk_size=4, rebuild="every:8").stats
    assert stats.rebuilds == pytest.approx(NEW / 8, abs=1)


@pytest.mark.parametrize("decoder", ["static-near", "ngram", "triforce-near"])
def test_sampling_run_is_reproducible(decoder):
    target = tiny_model("qwen2", 0)
    near, prompt = perturbed(target), make_prompt()
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=7)
    first = run_decoder(decoder, target, None, near, prompt, sampling).tokens
    assert torch.equal(first, run_decoder(decoder, target, None, near, prompt, sampling).tokens)
    other = SamplingConfig(temperature=0.8, top_p=0.95, seed=8)
    assert not torch.equal(first, run_decoder(decoder, target, None, near, prompt, other).tokens)


def test_eos_stops_generation():
    target = tiny_model("qwen3", 0)
    prompt = make_prompt()
    expected = generate(target, prompt, NEW).tokens[0]
    eos = int(expected[5])
    stop = int((expected == eos).nonzero()[0]) + 1
    result = speculative(target, ModelDrafter(perturbed(target), perturbed(target).new_cache(100)), prompt, NEW,
                         GAMMA, eos_token_id=eos)
    assert result.tokens[0].tolist() == expected[:stop].tolist()


# ---- verification rules ----------------------------------------------------------------------

def one_hot(ids: list[int], vocab: int = 5) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_verification_keeps_matching_prefix_then_corrects():
    p = one_hot([2, 3, 1, 4])
    verdict = verify_greedy(torch.tensor([2, 3, 1]), p)
    assert (verdict.accepted, verdict.token) == (3, 4)  # all kept, bonus token
    verdict = verify_greedy(torch.tensor([2, 0, 1]), p)
    assert (verdict.accepted, verdict.token) == (1, 3)
    verdict = verify_greedy(torch.tensor([], dtype=torch.long), p[:1])
    assert (verdict.accepted, verdict.token) == (0, 2)


def test_sampled_verification_edge_cases():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    # A draft token the verifier gives zero mass is always rejected; the residual excludes it.
    for _ in range(50):
        verdict = verify_sampled(torch.tensor([2]), one_hot([2], 3), p, gen)
        assert verdict.accepted == 0 and verdict.token in (0, 1)
    # q == p: always accepted, the bonus comes from the last row.
    verdict = verify_sampled(torch.tensor([1]), p[:1], p, gen)
    assert verdict.accepted == 1
    # The acceptance rule is injectable: "never accept" always takes the residual max(0, p - q).
    verdict = verify_sampled(torch.tensor([0]), p[:1], p, gen, acceptance=lambda px, qx: torch.zeros_like(px))
    assert verdict.accepted == 0 and verdict.token in (0, 1)


def test_sampled_verification_first_token_law_exact():
    """P(first emitted = x) = p(x), computed from the rule itself for one draft token."""
    p = torch.tensor([[0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([0.5, 0.2, 0.3])
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    n = 4_000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    for x in drafts.tolist():
        verdict = verify_sampled(torch.tensor([x]), q[None], p, gen)
        counts[x if verdict.accepted else verdict.token] += 1
    assert torch.allclose(counts / n, p[0], atol=0.03)


# ---- drafters and validation -----------------------------------------------------------------

def test_ngram_drafter_proposes_continuation_of_latest_match():
    drafter = NgramDrafter(10, max_ngram=2)
    drafter.start(torch.tensor([1, 2, 3, 9, 1, 2, 4, 5, 1, 2]), None, DraftContext(SamplingConfig(), None, Stopwatch()))
    proposal = drafter.propose(3)
    assert proposal.tokens.tolist() == [4, 5, 1]  # "1 2" last seen before "4 5 1"
    assert torch.equal(proposal.q, one_hot([4, 5, 1], 10))
    drafter.commit(1, 7)
    assert drafter.history.tolist()[-3:] == [2, 4, 7]
    assert drafter.propose(2).tokens.numel() == 0  # "4 7" / "7" never seen


def test_truncated_draft_shares_weights_and_runs_first_layers():
    target = tiny_model("qwen3", 0)
    draft = truncated_draft(target, 1)
    assert draft.cfg.num_layers == 1 and draft.layers[0] is target.layers[0]
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    reference = copy.deepcopy(target)
    reference.layers = reference.layers[:1]
    tokens = make_prompt()
    with torch.inference_mode():
        assert torch.allclose(draft(tokens), reference(tokens))
    with pytest.raises(SparsedraftError, match="1 <= k < 2"):
        truncated_draft(target, 2)


def test_invalid_runs_fail_before_any_forward():
    target = tiny_model("qwen2", 0)
    prompt = make_prompt()
    drafter = ModelDrafter(target, target.new_cache(200))
    with pytest.raises(SparsedraftError, match="gamma"):
        speculative(target, drafter, prompt, 8, gamma=0)
    other = tiny_model("qwen2", 1, vocab_size=128)
    with pytest.raises(SparsedraftError, match="128 tokens but the target's has 256"):
        speculative(target, ModelDrafter(other, other.new_cache(200)), prompt, 8)
    with pytest.raises(SparsedraftError, match="holds one sequence.*as a list"):
        speculative(target, drafter, prompt.expand(2, -1), 8)
    with pytest.raises(SparsedraftError, match="max_len >= 56"):
        speculative(target, ModelDrafter(target, target.new_cache(20)), prompt, 8)
    with pytest.raises(SparsedraftError, match="multiple of chunk_size"):
        retrieval(target, prompt, 8, budget=18, chunk_size=4)
    with pytest.raises(SparsedraftError, match="smaller than the cached context"):
        triforce(target, target, prompt, 8, budget=48, chunk_size=4)
    with pytest.raises(SparsedraftError, match="rebuild policy"):
        retrieval(target, prompt, 8, budget=16, chunk_size=4, rebuild="sometimes")


def test_level_stats_histogram_and_rates():
    level = LevelStats("x")
    level.record(4, 4)
    level.record(2, 0)
    assert level.histogram == [1, 0, 0, 0, 1] and level.acceptance_rate == pytest.approx(4 / 6)
    assert level.rounds == {4: [0, 0, 0, 0, 1], 2: [1, 0, 0]}
    assert level.mean_accepted == 2 and level.to_dict()["verifications"] == 2
