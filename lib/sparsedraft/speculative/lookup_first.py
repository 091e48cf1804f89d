"""Prompt lookup first, a draft model where the context has nothing to copy or where the model knows better.

Why: SmolLM2-135M's greedy continuations of the held-out essays fall into
loops within a few dozen tokens (the agreement bench's continuations), and
in a loop the next tokens are already in the context. Prompt lookup
(:class:`~.drafters.NgramDrafter`) finds them for free; the one-layer
feature head, which has to rebuild them from the target's features, mostly
does not (``bench.agreement``'s ``lookup`` rows beside the head's). Where the
context has nothing to copy, only a model can guess. So each round asks both:

- lookup proposes what followed the newest earlier occurrence of the last
  tokens (up to ``gamma``, one-hot q);
- where lookup found its tokens from a match of a single token, the model
  drafts its first token; if it is at least ``override`` sure of a
  different first token (its own top-1 probability at temperature 1,
  :func:`~.drafters.top1`), the model drafts the round (its chain, with its
  own confidence stop); otherwise lookup's tokens go, and the model's first
  draft is taken back. Where lookup found nothing the model drafts.
- A match of :data:`TRUSTED_MATCH` tokens or more goes without asking the
  model, and at ``override`` 1 every match does: the model then costs nothing
  in those rounds (a feature head takes the entries it skipped in its next
  forward). A head step reads its layer, its KV and its LM head from
  memory, since the verification between two steps evicts them from the
  caches, so asking every round costs a round about a tenth at 4K
  (docs/feature-drafter.md).

The choice reads only the model's logits and the context, never a random
draw, so under sampling each proposal's q is still the exact law its
tokens were drawn from given the choice, and verification stays lossless
(the chi-square test covers it). The model follows every round either way
(:meth:`~.drafters.Drafter.follow`), so a feature drafter still receives the
verifier's features of whatever was accepted. Known as a hybrid of
retrieval and model drafts (SAM-Decoding, Hu et al. 2024, does this with a
suffix automaton and EAGLE).
"""

from __future__ import annotations

import torch

from ..errors import require
from .drafters import DraftContext, Drafter, ModelDrafter, NgramDrafter, Proposal, TargetState
from .feature_drafter import FeatureDrafter
from .lookup_input import MAX_NGRAM
from .stats import LevelStats


# A continuation found from a match of this many tokens or more goes without asking the model. Simulated on the
# agreement bench's positions (scratch, in the message of the commit that set it), asking only on one-token
# matches kept nearly as many drafts a round as asking every round, with the model run in about a fifth of the
# rounds; the races since (docs/feature-drafter.md) halved the drafting time a round.
TRUSTED_MATCH = 2


def asks_model(matched, override: float):
    """Whether the model drafts its first token in a round where lookup's proposal came from a match of
    ``matched`` tokens (0: none): always without a proposal, never at ``override`` 1 or from a trusted match
    (ints or tensors of them)."""
    return (matched == 0) | ((matched < TRUSTED_MATCH) & (override < 1))


def overrides(sure, model_token, lookup_token, override: float):
    """Whether the model, asked, takes a round lookup has tokens for: its first draft ``model_token`` is another
    token than lookup's and its top-1 probability ``sure`` reaches ``override`` (floats or tensors of them)."""
    return (sure >= override) & (model_token != lookup_token)


def check_override(override: float) -> None:
    """``override`` is a probability in (0, 1]; at 1 the model drafts only the rounds lookup has no tokens for."""
    require(0.0 < override <= 1.0, f"draft_lookup is the draft's top-1 probability above which it overrides prompt "
                                   f"lookup, in (0, 1] (0 turns lookup off in decode()), got {override}")


class LookupFirst(Drafter):
    """Prompt lookup's continuation unless ``model`` is at least ``override`` sure of another first token."""

    def __init__(self, model: Drafter, override: float, max_ngram: int = MAX_NGRAM, min_ngram: int = 1):
        check_override(override)
        require(isinstance(model, (ModelDrafter, FeatureDrafter)),
                f"LookupFirst needs a drafter with a model of its own (a ModelDrafter or FeatureDrafter) to weigh "
                f"against prompt lookup, got {type(model).__name__}")
        self.model, self.override = model, override
        model.reports_top1 = True  # the choice reads the model's first draft's top-1 probability
        self.lookup = NgramDrafter(model.vocab_size, max_ngram, min_ngram)
        self.vocab_size = model.vocab_size
        self.needs_target_queries = model.needs_target_queries
        self.needs_target_features = model.needs_target_features
        self.feature_layers = model.feature_layers
        self.lookup_rounds = self.model_rounds = 0  # rounds each source drafted since start

    @property
    def confidence(self) -> float:  # the model's own stop, set through this drafter as on any other
        return self.model.confidence

    @confidence.setter
    def confidence(self, value: float) -> None:
        self.model.confidence = value

    def check(self, context: int) -> None:
        self.model.check(context)

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        self.proposed = self.lookup_rounds = self.model_rounds = 0
        self.lookup.start(prompt, target, ctx)
        self.model.start(prompt, target, ctx)

    def propose(self, gamma: int) -> Proposal:
        found = self.lookup.propose(gamma)
        if not gamma:
            return found
        first = self.model.propose(1) if asks_model(self.lookup.matched, self.override) else None
        if found.tokens.numel() and (first is None or not overrides(float(first.top1[0]), int(first.q[0].argmax()),
                                                                    int(found.tokens[0]), self.override)):
            if first is not None:
                self.model.rewind(1)
            self.model.follow(found.tokens.tolist())  # lookup's round: the model only follows it
            self.lookup_rounds += 1
            self.proposed = found.tokens.numel()
            return found
        sure = float(first.top1[0])
        own = first
        if gamma > 1 and sure >= self.confidence:  # the model's chain goes on unless its own stop ends it
            more = self.model.propose(gamma - 1)
            own = Proposal(torch.cat((first.tokens, more.tokens)), torch.cat((first.q, more.q)),
                           torch.cat((first.top1, more.top1)))
        self.model.proposed = own.tokens.numel()
        self.lookup.rewind(found.tokens.numel())
        self.lookup.follow(own.tokens.tolist())
        self.model_rounds += 1
        self.proposed = own.tokens.numel()
        return own

    def rewind(self, n: int) -> None:
        self.lookup.rewind(n)
        self.model.rewind(n)

    def push(self, token: int) -> None:
        self.lookup.push(token)
        self.model.push(token)

    def observe(self, target: TargetState | None) -> None:
        self.model.observe(target)

    def commit(self, accepted: int, token: int, target: TargetState | None = None) -> None:
        self.lookup.commit(accepted, token)
        self.model.commit(accepted, token, target)
        self.proposed = 0

    def rebuild(self, target: TargetState) -> bool:
        return self.model.rebuild(target)

    def levels(self) -> list[LevelStats]:
        return self.model.levels()
