"""TriForce's middle level: the target drafting over a view of its own full cache, verifying a smaller drafter.

:class:`RetrievalDrafter` is the target model over a cache built from the
target's full cache (:class:`~sparsedraft.caches.RetrievalCache`): it starts
by building the cache from the prefilled prompt and the last prompt token's
queries, never rolls its committed context back (after each verification it
copies the committed tokens from the full cache, ``sync``), and can be
rebuilt from the newest token's queries. Because the build sees the whole
prompt, the last prompt token's key is already in the view, as in TriForce; the
drafter then has nothing pending, and its first distribution is the target's
own prefill logits for that token, so no forward feeds the token twice.

:class:`SpeculativeDrafter` drafts by speculative decoding: an inner drafter
proposes, a :class:`~.drafters.ModelDrafter` (TriForce: a RetrievalDrafter)
verifies. It composes its verifier instead of subclassing it, so any model
over any cache can be a middle level, and the verifier keeps its own start,
commit and rebuild. The q it reports is the verifier model's distribution at
each emitted position, the exact law of the token it emits, so the level
above stays lossless. With a ``confidence`` it hands its tokens up as soon
as it emits one its verifier model was less sure of (TriForce's
``draft_confidence``: the target's own probability over its retrieval
cache says which tokens the full target will likely reject).
"""

from __future__ import annotations

import torch

from ..caches import RetrievalCache
from ..engine.model import Transformer
from ..engine.sampling import probabilities
from ..errors import require
from .drafters import DraftContext, Drafter, ModelDrafter, Proposal, TargetState, proposal_of, sure
from .stats import DRAFT, RETRIEVAL_LEVEL, VERIFY, LevelStats, region
from .verify import AcceptanceRule, standard_acceptance, verify


class RetrievalDrafter(ModelDrafter):
    """The target over a cache that follows its full cache (``build(full, queries)``, ``sync(full)``)."""

    needs_target_queries = True

    def __init__(self, model: Transformer, cache: RetrievalCache):
        super().__init__(model, cache)
        self.head: torch.Tensor | None = None  # [V] logits after the newest built token, until a forward needs them

    def check_cache(self, cache: RetrievalCache) -> None:
        require(callable(getattr(cache, "build", None)) and callable(getattr(cache, "sync", None)),
                f"RetrievalDrafter drafts over a cache built from the target's full cache (build(full, queries) "
                f"and sync(full), like RetrievalCache), got {type(cache).__name__}; use ModelDrafter for a cache "
                "its model fills itself")

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.ctx, self.proposed = ctx, 0
        self.cache.reset()
        self.cache.build(target.cache, target.queries)
        self.position, self.head = target.cache.length, target.logits
        self.pending = prompt[self.position:].tolist()

    def _forward(self, tokens: list[int], last_only: bool) -> torch.Tensor:
        """As :meth:`ModelDrafter._forward`; right after the start nothing is pending and the target's
        prefill logits stand in for the distribution after the last prompt token."""
        head, self.head = self.head, None
        if head is None:
            return super()._forward(tokens, last_only)
        if not tokens:
            return head[None]
        logits = super()._forward(tokens, last_only)
        return logits if last_only else torch.cat((head[None], logits))

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        require(target is not None, "a RetrievalDrafter must be verified by the full-cache target "
                                    "(pass its TargetState to commit)")
        self.cache.sync(target.cache)  # the full cache now holds every committed token but `token`
        self.position, self.pending, self.proposed, self.head = target.cache.length, [token], 0, None

    def rebuild(self, target: TargetState) -> bool:
        self.cache.build(target.cache, target.queries)
        return True


class SpeculativeDrafter(Drafter):
    """``inner`` proposes ``gamma_inner`` tokens per round, ``verifier`` checks them over its own cache
    (TriForce level 2: a RetrievalDrafter over a level-1 draft with a streaming cache)."""

    def __init__(self, verifier: ModelDrafter, inner: Drafter, gamma_inner: int,
                 acceptance: AcceptanceRule = standard_acceptance, name: str = RETRIEVAL_LEVEL):
        require(gamma_inner >= 1, f"gamma_inner must be >= 1 draft token per inner round, got {gamma_inner}")
        require(inner.vocab_size == verifier.vocab_size,
                f"the inner drafter's vocabulary ({inner.vocab_size}) differs from its verifier's "
                f"({verifier.vocab_size}); both levels must share one tokenizer")
        self.verifier, self.inner, self.gamma_inner = verifier, inner, gamma_inner
        self.acceptance, self.name = acceptance, name
        self.vocab_size = verifier.vocab_size
        self.needs_target_queries = verifier.needs_target_queries
        # A feature drafter inside reads the verifier's features after each inner round, and the full target's
        # after each outer verification
        self.needs_target_features = inner.needs_target_features
        verifier.keep_features = inner.needs_target_features
        self.feature_layers = verifier.feature_layers = inner.feature_layers
        self.level = LevelStats(name)

    def check(self, context: int) -> None:
        self.verifier.check(context)
        self.inner.check(context)

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.ctx, self.proposed = ctx, 0
        self.verifier.start(prompt, target, ctx)
        self.inner.start(prompt, target, ctx)
        self.level = LevelStats(self.name)

    def propose(self, gamma: int) -> Proposal:
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        ctx = self.ctx
        while len(tokens) < gamma:
            # Never overshoot: the last round may verify nothing and emit the verifier's own token.
            with ctx.watch(region(self.name, DRAFT)):
                inner = self.inner.propose(min(self.gamma_inner, gamma - len(tokens) - 1))
            with ctx.watch(region(self.name, VERIFY)):
                logits = self.verifier.score(inner.tokens.tolist())  # [g+1, V]
                p = probabilities(logits, ctx.sampling)
                verdict = verify(inner.tokens, inner.q, p, ctx.sampling.greedy, ctx.generator, self.acceptance)
            self.level.record(inner.tokens.numel(), verdict.accepted)
            self.inner.commit(verdict.accepted, verdict.token, self._verified())
            self.verifier.keep(verdict.accepted, verdict.token)
            tokens += inner.tokens[:verdict.accepted].tolist() + [verdict.token]
            qs.append(p[:verdict.accepted + 1])
            if not sure(logits[:verdict.accepted + 1], self.confidence):  # the verifier's own, at what it emitted
                break
        self.proposed = len(tokens)
        return proposal_of(tokens, qs, self.vocab_size, self.verifier.model.device)

    def _verified(self) -> TargetState | None:
        """The verifier's last forward as the inner drafter's TargetState (only its features are read)."""
        v = self.verifier
        if not v.keep_features or v.features is None:
            return None
        return TargetState(v.cache, {}, None, v.features, v.features_start)

    def rewind(self, n: int) -> None:
        self.verifier.rewind(n)
        self.inner.rewind(n)

    def push(self, token: int) -> None:
        self.verifier.push(token)
        self.inner.push(token)

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        rejected = self.proposed - accepted
        self.verifier.commit(accepted, token, target)
        self.inner.rewind(rejected)
        self.inner.observe(target)
        self.inner.push(token)
        self.proposed = 0

    def rebuild(self, target: TargetState) -> bool:
        return self.verifier.rebuild(target)

    def levels(self) -> list[LevelStats]:
        return self.inner.levels() + [self.level]
