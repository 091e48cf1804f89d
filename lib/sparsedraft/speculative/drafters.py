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

A drafter with a model may stop a proposal early (``confidence``, EAGLE-2's
use of the draft's own confidence, for a chain): after a draft whose top-1
probability under the draft model is below it, the proposal ends. The stop
depends only on the drafter's own forwards, so verification stays lossless;
what it saves is verification rows the target would most likely reject,
which a CPU pays for (a 4-token verification at 4K costs ~1.2 decode steps).

Drafters whose cache follows the target's full cache instead of their own
forwards (TriForce's level 2) live in :mod:`.hierarchy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..caches import RetrievalCache
from ..engine.cache import KVCache, StaticCache
from ..engine.model import Capture, Transformer
from ..engine.prefill import prefill
from ..engine.sampling import SamplingConfig, probabilities
from ..errors import require
from .lookup_input import MAX_NGRAM
from .stats import LevelStats, Stopwatch


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [g] drafted ids, g <= the requested length
    q: torch.Tensor  # [g, V] float32: the distribution each token was drawn from
    # [g] float32: each draft's top-1 probability under the drafter's own model at temperature 1 (``top1``),
    # whatever the run samples with, from a drafter that stops on its confidence or ``reports_top1``; else None
    top1: torch.Tensor | None = None


@dataclass
class TargetState:
    """What a drafter may read from the full-cache target.

    At ``start`` the cache holds the whole prompt (the driver rolls the last
    prompt token back afterwards, so that the first verification re-feeds it
    and verifies the first new token like every other); after a verification
    it holds every committed token except the pending one.
    """

    cache: StaticCache
    queries: dict[int, torch.Tensor]  # layer -> [B, heads, head_dim] post-RoPE query of the newest token
    logits: torch.Tensor | None = None  # [V] at start: the target's logits after the last prompt token
    # For a drafter that ``needs_target_features``: top-layer features [n, hidden] of the positions
    # features_start.. (at start the whole prompt; after a verification its rows: the pending token, then
    # each drafted token), from the forward the target ran anyway
    features: torch.Tensor | None = None
    features_start: int = 0


@dataclass(frozen=True)
class DraftContext:
    """Per-run settings a driver lends its drafters (shared so a run is reproducible from one seed)."""

    sampling: SamplingConfig
    generator: torch.Generator | None
    watch: Stopwatch


def top1(logits: torch.Tensor) -> float:
    """The top-1 probability of ``logits`` [V] at temperature 1 (of [n, V]: the least sure row's)."""
    return float(logits.float().softmax(-1).amax(-1).min())


def sure(logits: torch.Tensor, confidence: float) -> bool:
    """Whether a draft step may be followed by another: its top-1 probability (:func:`top1`, whatever the run
    samples with) reaches ``confidence``; always when ``confidence`` is 0. Logits [n, V] of n emitted tokens are
    sure when every row is."""
    return confidence <= 0 or top1(logits) >= confidence


def check_confidence(confidence: float) -> None:
    """A ``draft_confidence`` is a probability below 1 (1 would stop every proposal after its first token)."""
    require(0.0 <= confidence < 1.0, f"draft_confidence is a probability in [0, 1) (0: never stop early), got "
                                     f"{confidence}")


def draw(q: torch.Tensor, ctx: DraftContext) -> int:
    """One token from q [V]: the argmax when greedy (no random draw), else a seeded sample."""
    if ctx.sampling.greedy:
        return int(q.argmax())
    return int(torch.multinomial(q, 1, generator=ctx.generator))


class Drafter(ABC):
    """Interface of every drafter; ``commit`` is built from ``rewind`` and ``push``."""

    vocab_size: int
    needs_target_queries = False  # True: the driver captures the target's queries for start and rebuild
    needs_target_features = False  # True: the driver hands over the target's features (TargetState.features)
    feature_layers: tuple[int, ...] = ()  # lower target layers whose outputs precede the top's in those features
    proposed = 0  # length of the last proposal, not yet committed
    confidence = 0.0  # a drafter with a model stops a proposal after a draft less sure than this (see ``sure``)
    # A drafter with a model fills Proposal.top1 when set (by a proposer that weighs its confidence: LookupFirst);
    # otherwise only a confidence stop pays for the softmax over the vocabulary each draft step
    reports_top1 = False

    def check(self, context: int) -> None:
        """Fail before heavy work if ``context`` total tokens cannot fit."""

    def top1_list(self) -> list[float] | None:
        """Where a proposal's draft steps keep each draft's top-1 probability (:meth:`unsure_after` fills it):
        a list when a confidence stop or ``reports_top1`` reads them, else None, so no softmax is taken."""
        return [] if self.confidence or self.reports_top1 else None

    def unsure_after(self, tops: list[float] | None, logits: torch.Tensor) -> bool:
        """Keep the draft's top-1 probability in ``tops`` (where kept) and say whether the proposal stops after
        it: the same test as :func:`sure`, from the probability just taken."""
        if tops is None:
            return False
        tops.append(top1(logits))
        return tops[-1] < self.confidence

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

    def follow(self, tokens: list[int]) -> None:
        """Append ``tokens`` that another proposer drafted, tentatively, as if this drafter had proposed them
        (its next :meth:`commit` settles them): how a drafter keeps up with a round it did not draft
        (:class:`~.lookup_first.LookupFirst`)."""
        for token in tokens:
            self.push(token)
        self.proposed = len(tokens)

    def observe(self, target: TargetState | None) -> None:
        """Take what a verifier computed anyway (its features) after a ``rewind``, before the ``push``; only a
        drafter that ``needs_target_features`` reads it."""

    def rebuild(self, target: TargetState) -> bool:
        """Rebuild a cache that follows the target from its latest state; False when there is none."""
        return False

    def levels(self) -> list[LevelStats]:
        """Stats of verifications done inside this drafter (nested speculation), draft-most first."""
        return []


class ModelDrafter(Drafter):
    """Any model over a cache it fills itself: a small draft model, a layer-truncated
    target, or the target over a streaming cache. It also verifies for a nested
    drafter (:meth:`score`, :meth:`keep`), as the middle level of a hierarchy."""

    def __init__(self, model: Transformer, cache: KVCache):
        self.check_cache(cache)
        self.model, self.cache = model, cache
        self.vocab_size = model.cfg.vocab_size
        self.pending: list[int] = []
        self.position = 0  # true position of pending[0] = tokens whose K/V the cache holds
        self._scored = 0  # tokens of the last score() call, settled by keep()
        # Set by a level above whose inner drafter reads features: each forward then keeps its tokens'
        # top-layer features [t, hidden] and the position of the first (TargetState.features for that drafter)
        self.keep_features = False
        self.feature_layers: tuple[int, ...] = ()  # lower layers kept before the top one (the inner drafter's)
        self.features: torch.Tensor | None = None
        self.features_start = 0

    def check_cache(self, cache: KVCache) -> None:
        """Fail on a cache this drafter cannot fill (before any forward)."""
        require(not isinstance(cache, RetrievalCache),
                "a RetrievalCache is built from the target's full cache, not filled by its own model: "
                "draft over it with RetrievalDrafter(model, cache)")

    def check(self, context: int) -> None:
        if isinstance(self.cache, StaticCache):
            require(self.cache.max_len >= context,
                    f"the drafter's StaticCache holds {self.cache.max_len} tokens but the run needs {context} "
                    f"(prompt + new tokens); create it with max_len >= {context}")

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.ctx, self.proposed = ctx, 0
        self.cache.reset()
        if prompt.numel() > 1:
            prefill(self.model, self.cache, prompt[None, :-1].to(self.model.device))
        self.position = prompt.numel() - 1
        self.pending = prompt[-1:].tolist()

    def _forward(self, tokens: list[int], last_only: bool) -> torch.Tensor:
        """Feed ``tokens`` at their true positions; logits [t, V] (or [1, V])."""
        device = self.model.device
        positions = torch.arange(self.position, self.position + len(tokens), device=device)
        capture = Capture(layers=set(), hidden=True, hidden_layers=self.feature_layers) if self.keep_features \
            else None
        logits = self.model(torch.tensor([tokens], device=device), positions, self.cache, last_only=last_only,
                            capture=capture)
        if capture is not None:
            self.features, self.features_start = capture.features[0], self.position
        self.position += len(tokens)
        return logits[0]

    def propose(self, gamma: int) -> Proposal:
        tokens, qs = [], []
        tops = self.top1_list()
        feed = self.pending
        for _ in range(gamma):
            logits = self._forward(feed, True)[-1]
            q = probabilities(logits, self.ctx.sampling)
            feed = [draw(q, self.ctx)]
            tokens += feed
            qs.append(q)
            if self.unsure_after(tops, logits):
                break
        if tokens:
            self.pending = feed
        self.proposed = len(tokens)
        return proposal_of(tokens, qs, self.vocab_size, self.model.device, tops)

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Cache the pending tokens and ``tokens``; logits [len(tokens) + 1, V]: this model's next-token
        distribution after the last pending token and after each of ``tokens`` (what verifying them needs)."""
        logits = self._forward(self.pending + tokens, False)[-(len(tokens) + 1):]
        self.pending, self._scored = [], len(tokens)
        return logits

    def keep(self, accepted: int, token: int) -> None:
        """After :meth:`score`: keep the first ``accepted`` scored tokens and append ``token``, tentatively,
        as if this drafter had proposed them (its next :meth:`commit` settles them)."""
        self.rewind(self._scored - accepted)
        self.push(token)
        self.proposed += accepted + 1

    def rewind(self, n: int) -> None:
        require(0 <= n <= self.position + len(self.pending), f"cannot rewind {n} tokens")
        from_pending = min(n, len(self.pending))
        del self.pending[len(self.pending) - from_pending:]
        cached = n - from_pending
        if cached:
            self.cache.rollback(cached)
            self.position -= cached

    def push(self, token: int) -> None:
        self.pending.append(token)


class NgramDrafter(Drafter):
    """Prompt lookup: find the newest earlier occurrence of the last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose what followed it. No model;
    proposals are deterministic, so q is one-hot and sampling stays lossless."""

    def __init__(self, vocab_size: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1):
        require(1 <= min_ngram <= max_ngram,
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.history = torch.zeros(0, dtype=torch.long)
        self.matched = 0  # tokens of the match the last proposal came from (0: none)

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.history, self.proposed = prompt.detach().clone(), 0

    def propose(self, gamma: int) -> Proposal:
        tokens, self.matched = ngram_lookup(self.history, gamma, self.max_ngram, self.min_ngram) if gamma \
            else (self.history[:0], 0)
        self.history = torch.cat((self.history, tokens))
        self.proposed = tokens.numel()
        q = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Proposal(tokens, q)

    def rewind(self, n: int) -> None:
        require(0 <= n <= self.history.numel(), f"cannot rewind {n} tokens")
        self.history = self.history[:self.history.numel() - n]

    def push(self, token: int) -> None:
        self.history = torch.cat((self.history, self.history.new_tensor([token])))

    def follow(self, tokens: list[int]) -> None:
        self.history = torch.cat((self.history, self.history.new_tensor(tokens)))
        self.proposed = len(tokens)


def ngram_lookup(history: torch.Tensor, gamma: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = 1) -> tuple[torch.Tensor, int]:
    """Prompt lookup over ``history`` [L]: up to ``gamma`` tokens that followed the newest earlier occurrence of its
    last n tokens, n from ``max_ngram`` down to ``min_ngram``, and that n; empty and 0 when none occurs."""
    h = history
    for n in range(min(max_ngram, h.numel() - 1), min_ngram - 1, -1):
        earlier = h[:-1].unfold(0, n, 1)  # every n-gram that has a successor, [L - n, n]
        hits = (earlier == h[-n:]).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return h[start:start + gamma], n
    return h[:0], 0


def proposal_of(tokens: list[int], qs: list[torch.Tensor], vocab: int, device: torch.device,
                tops: list[float] | None = None) -> Proposal:
    """A Proposal from token ids, their distributions (rows of [V] or [n, V] blocks, in order) and, where the
    drafter took them, each token's top-1 probability (:func:`top1`)."""
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    q = torch.cat([x.reshape(-1, vocab) for x in qs]) if qs else torch.zeros(0, vocab, device=device)
    return Proposal(ids, q, None if tops is None else torch.tensor(tops, dtype=torch.float32))
