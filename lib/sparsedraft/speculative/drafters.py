"""Drafters: whatever proposes tokens for a verifier, at any level of the hierarchy.

A drafter follows the committed sequence. It holds that sequence except for a
few *pending* tokens whose K/V it has not computed yet (normally one: the
token the verifier emitted last). ``propose(g)`` returns up to ``g`` tokens
with the distributions q they were drawn from and appends them tentatively;
``commit(accepted, token)`` then keeps the accepted prefix, forgets the rest
and appends the verifier's correction/bonus token. ``rewind``/``push`` are
the two primitives behind commit, public so that a nested drafter can undo
tokens its own verifier had accepted but the level above rejected.

Lossless verification only needs q to be the exact law each token was drawn
from given its prefix. For a model that is its probabilities; for a
deterministic proposer a one-hot; for a drafter that is itself a speculative
decoder (TriForce level 2) it is its own model's probabilities at that
position, because speculative sampling emits tokens with exactly that law.

A drafter whose cache is built from the target's full cache (TriForce's
retrieval cache, see :func:`follows_target`) does not roll back after a
verification: it copies the committed tokens from the full cache (``sync``),
and can be rebuilt from the target's latest queries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..cache import KVCache, StaticCache
from ..errors import require
from ..model import Transformer
from ..sampling import SamplingConfig, probabilities
from .stats import LevelStats, Stopwatch
from .verify import AcceptanceRule, standard_acceptance, verify

PREFILL_CHUNK = 1024  # tokens per draft prefill forward: bounds activation memory on long prompts


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [g] drafted ids, g <= the requested length
    q: torch.Tensor  # [g, V] float32: the distribution each token was drawn from


@dataclass
class TargetState:
    """What a drafter may read from the full-cache target after a verification."""

    cache: StaticCache  # every committed token except the pending one
    queries: dict[int, torch.Tensor]  # layer -> [B, heads, head_dim] post-RoPE query of the newest token


@dataclass(frozen=True)
class DraftContext:
    """Per-run settings a driver lends its drafters (shared so a run is reproducible from one seed)."""

    sampling: SamplingConfig
    generator: torch.Generator | None
    watch: Stopwatch


def follows_target(cache: KVCache) -> bool:
    """Whether ``cache`` is built from the target's full cache instead of from its own model's forwards:
    it has ``build(full, queries)`` and ``sync(full)``, like the retrieval cache."""
    return callable(getattr(cache, "build", None)) and callable(getattr(cache, "sync", None))


def draw(q: torch.Tensor, ctx: DraftContext) -> int:
    """One token from q [V]: the argmax when greedy (no random draw), else a seeded sample."""
    if ctx.sampling.greedy:
        return int(q.argmax())
    return int(torch.multinomial(q, 1, generator=ctx.generator))


class Drafter(ABC):
    """Interface of every drafter; ``commit`` is built from ``rewind`` and ``push``."""

    vocab_size: int
    follows_target = False  # True: wants the target's queries and is resynced from its full cache
    proposed = 0  # length of the last proposal, not yet committed

    def check(self, context: int) -> None:
        """Fail before heavy work if ``context`` total tokens cannot fit."""

    @abstractmethod
    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        """Synchronise with ``prompt`` [T] (all of it committed, the last token pending)."""

    @abstractmethod
    def propose(self, gamma: int) -> Proposal:
        """Up to ``gamma`` tokens, appended tentatively."""

    @abstractmethod
    def rewind(self, n: int) -> None:
        """Forget the newest ``n`` tokens of the sequence this drafter follows."""

    @abstractmethod
    def push(self, token: int) -> None:
        """Append a token decided elsewhere."""

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        """The verifier kept ``accepted`` tokens of the last proposal and emitted ``token``."""
        self.rewind(self.proposed - accepted)
        self.push(token)
        self.proposed = 0

    def rebuild(self, target: TargetState) -> bool:
        """Rebuild a cache that follows the target from its latest state; False when there is none."""
        return False

    def levels(self) -> list[LevelStats]:
        """Stats of verifications done inside this drafter (nested speculation), draft-most first."""
        return []


class ModelDrafter(Drafter):
    """Any model with any cache: a small draft model, a layer-truncated target, or the
    target itself over a sparse cache (the retrieval cache: TriForce level 2)."""

    def __init__(self, model: Transformer, cache: KVCache):
        self.model, self.cache = model, cache
        self.vocab_size = model.cfg.vocab_size
        self.follows_target = follows_target(cache)
        self.pending: list[int] = []
        self.position = 0  # true position of pending[0] = tokens whose K/V the cache holds

    def check(self, context: int) -> None:
        if isinstance(self.cache, StaticCache):
            require(self.cache.max_len >= context,
                    f"the drafter's StaticCache holds {self.cache.max_len} tokens but the run needs {context} "
                    f"(prompt + new tokens); create it with max_len >= {context}")

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.ctx, self.proposed = ctx, 0
        self.cache.reset()
        if self.follows_target:
            self.cache.build(target.cache, target.queries)
            self.position = target.cache.length
        else:
            self.position = 0
            for start in range(0, prompt.numel() - 1, PREFILL_CHUNK):
                self._forward(prompt[start:min(start + PREFILL_CHUNK, prompt.numel() - 1)].tolist(), True)
        self.pending = prompt[self.position:].tolist()

    def _forward(self, tokens: list[int], last_only: bool) -> torch.Tensor:
        """Feed ``tokens`` at their true positions; logits [t, V] (or [1, V])."""
        device = self.model.device
        positions = torch.arange(self.position, self.position + len(tokens), device=device)
        logits = self.model(torch.tensor([tokens], device=device), positions, self.cache, last_only=last_only)
        self.position += len(tokens)
        return logits[0]

    def propose(self, gamma: int) -> Proposal:
        tokens, qs = [], []
        feed = self.pending
        for _ in range(gamma):
            q = probabilities(self._forward(feed, True)[-1], self.ctx.sampling)
            feed = [draw(q, self.ctx)]
            tokens += feed
            qs.append(q)
        if gamma:
            self.pending = feed
        self.proposed = gamma
        return _proposal(tokens, qs, self.vocab_size, self.model.device)

    def _rewind_own(self, n: int) -> None:
        require(0 <= n <= self.position + len(self.pending), f"cannot rewind {n} tokens")
        from_pending = min(n, len(self.pending))
        del self.pending[len(self.pending) - from_pending:]
        cached = n - from_pending
        if cached:
            self.cache.rollback(cached)
            self.position -= cached

    def rewind(self, n: int) -> None:
        self._rewind_own(n)

    def push(self, token: int) -> None:
        self.pending.append(token)

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        if not self.follows_target:
            self._rewind_own(self.proposed - accepted)
            self.pending.append(token)
        else:
            require(target is not None, "a drafter over a target-following cache must be verified by the "
                                        "full-cache target (pass its TargetState to commit)")
            self.cache.sync(target.cache)  # the full cache now holds every committed token but `token`
            self.position, self.pending = target.cache.length, [token]
        self.proposed = 0

    def rebuild(self, target: TargetState) -> bool:
        if not self.follows_target:
            return False
        self.cache.build(target.cache, target.queries)
        return True


class SpeculativeDrafter(ModelDrafter):
    """Drafts its tokens by speculative decoding: ``inner`` proposes ``gamma_inner`` tokens,
    this drafter's model verifies them over its own cache (TriForce level 2: target +
    retrieval cache over a level-1 draft with a streaming cache).

    The q it reports is its own model's distribution at each emitted position,
    the exact law of the token it emits, so the level above stays lossless.
    """

    def __init__(self, model: Transformer, cache: KVCache, inner: Drafter, gamma_inner: int,
                 acceptance: AcceptanceRule = standard_acceptance, name: str = "level2"):
        super().__init__(model, cache)
        require(gamma_inner >= 1, f"gamma_inner must be >= 1 draft token per inner round, got {gamma_inner}")
        require(inner.vocab_size == self.vocab_size,
                f"the inner drafter's vocabulary ({inner.vocab_size}) differs from this drafter's model "
                f"({self.vocab_size}); both levels must share one tokenizer")
        self.inner, self.gamma_inner, self.acceptance, self.name = inner, gamma_inner, acceptance, name
        self.level = LevelStats(name)

    def check(self, context: int) -> None:
        super().check(context)
        self.inner.check(context)

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        super().start(prompt, target, ctx)
        self.inner.start(prompt, target, ctx)
        self.level = LevelStats(self.name)

    def propose(self, gamma: int) -> Proposal:
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        ctx = self.ctx
        while len(tokens) < gamma:
            # Never overshoot: the last round may verify nothing and emit this model's own token.
            with ctx.watch(f"{self.name}_draft"):
                inner = self.inner.propose(min(self.gamma_inner, gamma - len(tokens) - 1))
            g = inner.tokens.numel()
            with ctx.watch(f"{self.name}_verify"):
                logits = self._forward(self.pending + inner.tokens.tolist(), False)[-(g + 1):]
                p = probabilities(logits, ctx.sampling)  # [g+1, V]
                verdict = verify(inner.tokens, inner.q, p, ctx.sampling.greedy, ctx.generator, self.acceptance)
            self.level.record(g, verdict.accepted)
            self.inner.commit(verdict.accepted, verdict.token)
            self.pending = []
            self._rewind_own(g - verdict.accepted)
            self.pending = [verdict.token]
            tokens += inner.tokens[:verdict.accepted].tolist() + [verdict.token]
            qs.append(p[:verdict.accepted + 1])
        self.proposed = gamma
        return _proposal(tokens, qs, self.vocab_size, self.model.device)

    def rewind(self, n: int) -> None:
        self._rewind_own(n)
        self.inner.rewind(n)

    def push(self, token: int) -> None:
        super().push(token)
        self.inner.push(token)

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        rejected = self.proposed - accepted
        super().commit(accepted, token, target)
        self.inner.rewind(rejected)
        self.inner.push(token)

    def levels(self) -> list[LevelStats]:
        return self.inner.levels() + [self.level]


class NgramDrafter(Drafter):
    """Prompt lookup: find the newest earlier occurrence of the last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose what followed it. No model;
    proposals are deterministic, so q is one-hot and sampling stays lossless."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        require(1 <= min_ngram <= max_ngram,
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.history = torch.zeros(0, dtype=torch.long)

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.history, self.proposed = prompt.detach().clone(), 0

    def propose(self, gamma: int) -> Proposal:
        tokens = self._lookup(gamma) if gamma else self.history[:0]
        self.history = torch.cat((self.history, tokens))
        self.proposed = tokens.numel()
        q = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Proposal(tokens, q)

    def _lookup(self, gamma: int) -> torch.Tensor:
        h = self.history
        for n in range(min(self.max_ngram, h.numel() - 1), self.min_ngram - 1, -1):
            earlier = h[:-1].unfold(0, n, 1)  # every n-gram that has a successor, [L - n, n]
            hits = (earlier == h[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return h[start:start + gamma]
        return h[:0]

    def rewind(self, n: int) -> None:
        require(0 <= n <= self.history.numel(), f"cannot rewind {n} tokens")
        self.history = self.history[:self.history.numel() - n]

    def push(self, token: int) -> None:
        self.history = torch.cat((self.history, self.history.new_tensor([token])))


def _proposal(tokens: list[int], qs: list[torch.Tensor], vocab: int, device: torch.device) -> Proposal:
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    q = torch.cat([x.reshape(-1, vocab) for x in qs]) if qs else torch.zeros(0, vocab, device=device)
    return Proposal(ids, q)
