"""The feature drafter at work: a :class:`~.feature.FeatureHead` over its own one-layer KV cache.

Entry ``t`` of the head's sequence is ``(f_t, x_{t+1})``: the feature of token
``t`` and the token after it. A draft step feeds the newest entry and reads a
predicted feature ``f^_{t+1}``; the target's head turns it into the next
token, and ``(f^_{t+1}, that token)`` is the next entry. So ``propose(g)`` is
``g`` one-layer forwards, the first of which also feeds the entries that the
last verification settled.

After a verification the target has computed the true features of the
pending token and of every accepted draft, in the forward it ran anyway
(``TargetState.features``). The drafter writes them over its predictions and
forgets the head's K/V from the first predicted entry on, so the next round
starts from exactly what EAGLE's drafter sees: true features up to the last
accepted token, then the verifier's own token. No extra target forward.

The cache is the caller's choice, as for every drafter (``FeatureDrafter.create``):
``full`` (one layer over the whole context, 1/num_layers of the target's KV),
``streaming`` (sink + window, constant size: LongSpec's choice), or ``budget``
(BudgetDraft's chunk selection over the head's own prompt KV). It is filled
from the target's prefill features, one layer over the prompt, never a second
model prefill.

A head that reads prompt lookup's proposals (``FeatureHead(lookup=True)``) gets
each entry's from a :class:`~.lookup_input.LookupTable` kept beside the token
history, grown and cut with it; a gated one's draft logits read the newest
entry's row too.
"""

from __future__ import annotations

import torch

from ..caches import BudgetCache, RetrievalCache, StreamingCache
from ..engine.cache import KVCache, StaticCache
from ..engine.prefill import prefill
from ..engine.sampling import probabilities
from ..errors import require
from .budget import budget_prefill
from .drafters import DraftContext, Drafter, Proposal, TargetState, draw, proposal_of
from .feature import Entries, FeatureHead
from .lookup_input import LookupTable

FEATURE_CACHES = ("full", "streaming", "budget")


class FeatureDrafter(Drafter):
    """Drafts with a feature head; needs the target's features at start and after each verification."""

    needs_target_features = True

    def __init__(self, head: FeatureHead, cache: KVCache):
        require(not isinstance(cache, RetrievalCache),
                "a feature head fills its own cache; a RetrievalCache is built from the target's full cache")
        require(cache.num_layers in (None, head.depth),
                lambda: f"a cache of {cache.num_layers} layers cannot serve a feature head of {head.depth}: size it "
                        "with the head's own config, head.cfg")
        self.head, self.cache = head, cache
        self.vocab_size = head.cfg.vocab_size
        self.feature_layers = head.fuse_layers  # the target captures these layers' outputs before the top's
        self.tokens: list[int] = []
        self.lookup = LookupTable() if head.lookup else None  # prompt lookup's rows beside tokens, for such a head
        self.feats = torch.zeros(0, head.cfg.hidden_size)
        self.known = 0  # rows of feats that hold a feature (row i: the feature of tokens[i])
        self.cached = 0  # entries whose K/V the head's cache holds (positions 0 .. cached-1)

    @classmethod
    def create(cls, head: FeatureHead, cache: str, max_len: int, *, gamma: int = 8, sink: int = 16,
               window: int = 240, budget: int = 1024, chunk_size: int = 8, scoring: str = "attention",
               positions: str = "cache") -> "FeatureDrafter":
        """A drafter with a fresh cache of kind ``cache`` (:data:`FEATURE_CACHES`) for runs of ``max_len``
        tokens; ``gamma`` bounds the entries a verification may take back (a streaming cache keeps that many
        spare slots)."""
        require(cache in FEATURE_CACHES, f"a feature drafter's cache is one of {FEATURE_CACHES}, got {cache!r}")
        cfg, dtype, device = head.cfg, head.dtype, head.device
        if cache == "full":
            kv: KVCache = StaticCache(cfg, max_len, 1, dtype, device)
        elif cache == "streaming":
            kv = StreamingCache(cfg, sink, window, spec_slots=gamma, dtype=dtype, device=device,
                                rotary=head.target.rotary, positions=positions)
        else:
            kv = BudgetCache(cfg, budget, max_len, chunk_size, scoring=scoring, dtype=dtype, device=device)
        return cls(head, kv)

    def check(self, context: int) -> None:
        limit = getattr(self.cache, "max_len", None)
        require(limit is None or limit >= context,
                f"the feature drafter's {type(self.cache).__name__} holds {limit} tokens but the run needs {context} "
                f"(prompt + new tokens); create it with max_len >= {context}")

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        require(target.features is not None and target.features.shape[0] >= prompt.numel() - 1,
                "a feature drafter starts from the target's features of every prompt token; run it through "
                "speculative(), which captures them with the prefill")
        require(prompt.numel() >= 3, f"a feature drafter needs a prompt of >= 3 tokens, got {prompt.numel()}")
        self._check_width(target.features)
        self.ctx, self.proposed = ctx, 0
        self.tokens = []
        if self.lookup is not None:
            self.lookup = LookupTable()
        self._add(prompt.tolist())
        n = len(self.tokens)
        self.feats = torch.empty(n + 256, self.head.cfg.hidden_size, dtype=self.head.dtype, device=self.head.device)
        self.known = min(n, target.features.shape[0])  # the last prompt token's too, when the prefill gives it
        self.feats[:self.known] = self.head.fused(target.features[:self.known])
        self.cache.reset()
        # Every prompt entry but the newest goes in now; the newest is the first draft step's input.
        entries = torch.tensor([self.tokens[1:n - 1]], device=self.head.device)
        filler = Entries(self.head, self.feats[None, :n - 2], self._lookups(0, n))
        if isinstance(self.cache, BudgetCache):
            budget_prefill(filler, self.cache, entries)
        else:
            prefill(filler, self.cache, entries)
        self.cached = n - 2

    def _grow(self, rows: int) -> None:
        if rows > self.feats.shape[0]:
            extra = self.feats.new_empty(max(rows, 2 * self.feats.shape[0]) - self.feats.shape[0], self.feats.shape[1])
            self.feats = torch.cat((self.feats, extra))

    def propose(self, gamma: int) -> Proposal:
        tokens, qs = [], []
        tops = self.top1_list()
        for _ in range(gamma):
            n = len(self.tokens)
            require(self.known >= n - 1, "the feature drafter lacks the feature of a committed token; its verifier "
                                         "must hand over features (TargetState.features)")
            start = self.cached
            device = self.head.device
            rows = self._lookups(start + 1, n)
            out = self.head(self.feats[None, start:n - 1], torch.tensor([self.tokens[start + 1:n]], device=device),
                            torch.arange(start, n - 1, device=device), self.cache, None, rows)
            self.cached = n - 1
            predicted = out[0, -1]  # the feature of tokens[n - 1]
            logits = self.head.logits(predicted, None if rows is None else rows[0, -1])
            q = probabilities(logits, self.ctx.sampling)
            token = draw(q, self.ctx)
            self._grow(n)
            self.feats[n - 1] = predicted
            self.known = n
            self._add([token])
            tokens.append(token)
            qs.append(q)
            if self.unsure_after(tops, logits):
                break
        self.proposed = len(tokens)
        return proposal_of(tokens, qs, self.vocab_size, self.head.device, tops)

    def observe(self, target: TargetState | None) -> None:
        """Write the verifier's true features over this drafter's (positions ``features_start`` on) and forget
        the head's K/V computed from predicted ones."""
        if target is None or target.features is None:
            return
        start = target.features_start
        rows = min(target.features.shape[0], len(self.tokens) - start)
        if rows <= 0:
            return
        self._check_width(target.features)
        self._grow(start + rows)
        self.feats[start:start + rows] = self.head.fused(target.features[:rows]).to(self.feats.dtype)
        self.known = max(self.known, start + rows)
        self._uncache(min(self.cached, start))

    def _check_width(self, features: torch.Tensor) -> None:
        require(features.shape[-1] == self.head.feature_width,
                f"the target handed over features of width {features.shape[-1]}, but this head reads "
                f"{self.head.feature_width} (the outputs of target layers {list(self.feature_layers)} and the top "
                "one); the driver captures them as the drafter's feature_layers say: prefill with "
                f"prefill_prompt(..., feature_layers={self.feature_layers}) when passing prefilled=")

    def follow(self, tokens: list[int]) -> None:
        """Another proposer's tokens, tentatively: their features come with the verification (:meth:`observe`)."""
        self._add(tokens)
        self.proposed = len(tokens)

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        self.rewind(self.proposed - accepted)
        self.observe(target)
        self.push(token)
        self.proposed = 0

    def _uncache(self, keep: int) -> None:
        if keep < self.cached:
            self.cache.rollback(self.cached - keep)
            self.cached = keep

    def rewind(self, n: int) -> None:
        require(0 <= n <= len(self.tokens) - 2, f"cannot rewind {n} tokens")
        del self.tokens[len(self.tokens) - n:]
        if self.lookup is not None:
            self.lookup.truncate(len(self.tokens))
        self.known = min(self.known, len(self.tokens))
        self._uncache(min(self.cached, len(self.tokens) - 1))

    def push(self, token: int) -> None:
        require(self.known >= len(self.tokens),
                "the feature drafter needs the feature of the token before a pushed one; its verifier must hand "
                "over features (TargetState.features) before the push")
        self._add([token])

    def _add(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.lookup is not None:
            self.lookup.extend(tokens)

    def _lookups(self, start: int, stop: int) -> torch.Tensor | None:
        """Prompt lookup's rows ``start..stop-1`` [1, n, 2] for a lookup head; None for any other."""
        return None if self.lookup is None else self.lookup.table(start, stop, self.head.device)[None]
