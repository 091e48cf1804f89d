"""Table models and the chi-square test behind the sampling-losslessness tests.

20,000 decoder runs take minutes with even 1-layer transformers on a CPU
(5-10 ms per run, mostly per-op overhead), so the sampling tests drive *table
models*: next-token logits are a fixed random function of (position, previous
two tokens), and the "KV cache" stores token ids (a noise level per cache
makes a sparse cache change the distribution, as the retrieval cache does).
The drivers, drafters and verification are the real code; only the
arithmetic inside the model is replaced. Because the target is a
second-order Markov chain, its exact law over any generated window follows
by a forward recursion (:func:`pair_laws`), with no enumeration of sequences.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import product

import torch

from sparsedraft.engine.cache import KVCache
from sparsedraft.engine.sampling import SamplingConfig, probabilities

VOCAB = 8


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


def pair_laws(model: TableModel, prompt: list[int], sampling: SamplingConfig, n: int) -> list[torch.Tensor]:
    """Exact target law of ``n`` generated tokens x_1..x_n after ``prompt``, as [V, V] float64 tables:
    entry t-1 is P(x_{t-1} = a, x_t = b), with x_0 the last prompt token (so its row sums are x_t's marginal).

    The full-cache target reads (position, previous two tokens), so the law of the newest pair
    determines the next one: P(x_t, x_{t+1}) = sum_a P(a, x_t) P(x_{t+1} | a, x_t).
    """
    v = model.cfg.vocab_size
    pair = torch.zeros(v, v, dtype=torch.float64)
    pair[prompt[-2], prompt[-1]] = 1.0
    laws = []
    for t in range(n):
        position = (len(prompt) - 1 + t) % model.PERIOD  # of x_t, whose successor is drawn
        step = probabilities(model.base[position], sampling).double()  # [a, b, next]
        pair = torch.einsum("ab,abc->bc", pair, step)
        laws.append(pair)
    return laws


def table_law(joint: torch.Tensor) -> dict[tuple[int, ...], float]:
    """A probability table [V] or [V, V] as {outcome tuple: probability}, the form chi_square_pvalue takes."""
    return {index: float(joint[index]) for index in product(*map(range, joint.shape))}
