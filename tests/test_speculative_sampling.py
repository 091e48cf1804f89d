"""Sampling losslessness: every speculative decoder emits the target's exact distribution.

20,000 runs per decoder take minutes with even 1-layer transformers on a CPU
(5-10 ms per run, mostly per-op overhead), so the default cases drive *table
models*: next-token logits are a fixed random function of (position, previous
two tokens), and the "KV cache" stores token ids (a noise level per cache
makes a sparse cache change the distribution, as the retrieval cache does).
The drivers, drafters and verification are the real code; only the
arithmetic inside the model is replaced, and the exact target law is read
from the same table. Real tiny transformers with the real streaming and
retrieval caches are checked the same way in the slow tests at the end.

A chi-square goodness-of-fit test (cells with expected count < 5 pooled)
must give p > 0.01 for the first token and for the first two tokens, at
temperature 1.0 and at 0.6 with top_p 0.9; the same test with an
always-accept rule injected into verification must fail.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from sparsedraft.cache import KVCache
from sparsedraft.sampling import SamplingConfig, probabilities
from sparsedraft.speculative import (AcceptanceRule, Drafter, ModelDrafter, NgramDrafter, RetrievalDrafter,
                                     SpeculativeDrafter, speculative, standard_acceptance)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 8
SAMPLES = 20_000
NEW_TOKENS = 3  # two drafts in the first round: both kept, then a bonus, is a path to the first two tokens
GAMMA = 2
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 4]])  # "1 4" recurs, so prompt lookup proposes
CONFIGS = {"t1.0": SamplingConfig(temperature=1.0), "t0.6-p0.9": SamplingConfig(temperature=0.6, top_p=0.9)}


def always_accept(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p_x)


def chi_square_pvalue(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's test; outcomes with expected count < 5 form one pooled cell. Impossible outcomes fail outright."""
    if any(expected.get(k, 0.0) * n == 0 for k in counts):
        return 0.0
    stat, cells, pooled_obs, pooled_exp = 0.0, 0, 0.0, 0.0
    for outcome, prob in expected.items():
        e, o = prob * n, counts.get(outcome, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    dof = torch.tensor(cells - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, torch.tensor(stat / 2, dtype=torch.float64)))


# ---- table models: real decoders, memoised arithmetic ------------------------------------------

@dataclass(frozen=True)
class TableConfig:
    vocab_size: int
    num_layers: int = 1
    max_position_embeddings: int = 1 << 20


class HistoryCache(KVCache):
    """Stores the token ids a model has seen; ``noise`` makes the model read it differently
    (a sparse cache changes the target's distribution, so this stands in for one)."""

    def __init__(self, noise: float = 0.0):
        self.noise, self.tokens, self._new = noise, [], []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def begin(self, positions):
        return positions

    def end(self):
        self.tokens += self._new

    def rollback(self, n: int) -> None:
        assert 0 <= n <= len(self.tokens)
        del self.tokens[len(self.tokens) - n:]

    def reset(self) -> None:
        self.tokens = []


class FollowingHistoryCache(HistoryCache):
    """Stand-in for the retrieval cache: built and synced from the full cache, exact rollback."""

    def __init__(self, noise: float, spec_slots: int):
        super().__init__(noise)
        self.spec_slots, self.base = spec_slots, 0

    def build(self, full, queries):
        self.tokens, self.base = list(full.tokens), full.length

    def sync(self, full):
        assert full.length >= self.base and full.tokens[:self.base] == self.tokens[:self.base]
        self.build(full, {})

    def rollback(self, n: int) -> None:
        assert n <= len(self.tokens) - self.base, "rollback past a sync"
        super().rollback(n)

    def end(self):
        super().end()
        assert len(self.tokens) - self.base <= self.spec_slots, "speculative slots overflow"


class TableModel:
    """Next-token logits from a fixed random table indexed by (position, previous two tokens),
    plus ``noise`` times a second table; the cache's own ``noise`` adds to the model's."""

    PERIOD = 32  # positions before the table repeats (runs here are far shorter)

    def __init__(self, seed: int, noise: float = 0.0, vocab: int = VOCAB):
        self.cfg, self.noise = TableConfig(vocab), noise
        self.device, self.dtype = torch.device("cpu"), torch.float32
        shape = (self.PERIOD, vocab, vocab, vocab)
        self.base = 1.5 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        self.other = 1.5 * torch.randn(shape, generator=torch.Generator().manual_seed(10_000 + seed))
        self.memo: dict[tuple, torch.Tensor] = {}  # the same few histories recur across 20,000 runs

    def new_cache(self, max_len: int, batch: int = 1) -> HistoryCache:
        return HistoryCache()

    def logits(self, history: list[int], first: int, cache_noise: float) -> torch.Tensor:
        """[len(history) - 1, V]: logits after history[1:], whose first token sits at position ``first``."""
        h = torch.tensor(history)
        index = (torch.arange(first, first + len(history) - 1) % self.PERIOD, h[:-1], h[1:])
        noise = self.noise + cache_noise
        return self.base[index] + noise * self.other[index] if noise else self.base[index]

    def __call__(self, tokens, positions=None, cache=None, *, last_only=False, capture=None):
        new = tokens[0].tolist()
        assert positions is None or int(positions.flatten()[0]) == cache.length, "positions must continue the cache"
        history = (cache.tokens[-1:] or new[:1]) + new  # a sequence's first token stands in for its predecessor
        key = (tuple(history), cache.length, cache.noise)
        if key not in self.memo:
            self.memo[key] = self.logits(history, cache.length, cache.noise)
        logits = self.memo[key]
        cache._new = new
        cache.end()
        return (logits[-1:] if last_only else logits)[None]


def exact_prefix_law(model: TableModel, sampling: SamplingConfig) -> tuple[dict, dict]:
    """Target probabilities of the first token and of the first two tokens."""
    prompt = PROMPT[0].tolist()
    first = probabilities(model.logits(prompt[-2:], len(prompt) - 1, 0.0)[-1], sampling)
    one, two = {}, {}
    for a in range(VOCAB):
        one[(a,)] = float(first[a])
        second = probabilities(model.logits([prompt[-1], a], len(prompt), 0.0)[-1], sampling)
        for b in range(VOCAB):
            two[(a, b)] = float(first[a] * second[b])
    return one, two


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
    from sparsedraft.tiny import tiny_model
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
    from sparsedraft.generate import prefill
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
    from sparsedraft.speculative import retrieval, triforce
    target, draft = real_models()
    sampling = CONFIGS["t0.6-p0.9"]
    law_one, law_two = exact_real_law(target, sampling)
    one, two = Counter(), Counter()
    for seed in range(SAMPLES):
        cfg = SamplingConfig(sampling.temperature, sampling.top_p, seed=seed)
        if decoder == "retrieval":
            out = retrieval(target, PROMPT, NEW_TOKENS, cfg, gamma=GAMMA, budget=4, chunk_size=2)
        else:
            out = triforce(target, draft, PROMPT, NEW_TOKENS, cfg, gamma1=2, gamma2=GAMMA, budget=4, chunk_size=2,
                           sink=2, window=4)
        tokens = tuple(out.tokens[0, :2].tolist())
        one[tokens[:1]] += 1
        two[tokens] += 1
    first, pair = chi_square_pvalue(one, law_one, SAMPLES), chi_square_pvalue(two, law_two, SAMPLES)
    assert first > 0.01 and pair > 0.01, (first, pair)
