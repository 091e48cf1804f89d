"""A drafter model over a :class:`~sparsedraft.caches.budget.BudgetCache`, for the speculative driver.

:class:`~sparsedraft.speculative.ModelDrafter` prefills with plain forwards,
but a BudgetCache scores chunks by attention and the cache protocol never
shows a cache the queries; so this drafter prefills through
:meth:`BudgetCache.prefill`, which captures them. Everything after the
prefill (drafting, exact rollback, commit) is ModelDrafter's.
"""

from __future__ import annotations

import torch

from ..caches.budget import BudgetCache
from ..errors import require
from ..model import Transformer
from ..speculative import DraftContext, ModelDrafter, TargetState


class BudgetDrafter(ModelDrafter):
    """The BudgetDraft inference pipeline's drafter: a (trained) draft model with a KV budget."""

    def __init__(self, model: Transformer, cache: BudgetCache):
        require(isinstance(cache, BudgetCache), f"BudgetDrafter drafts over a BudgetCache, got {type(cache).__name__}")
        super().__init__(model, cache)

    @classmethod
    def create(cls, model: Transformer, budget: int, max_len: int, chunk_size: int = 8,
               obs_window: int = 32) -> "BudgetDrafter":
        """A drafter with a fresh batch-1 cache on the model's device and dtype."""
        return cls(model, BudgetCache(model.cfg, budget, max_len, chunk_size, obs_window,
                                      dtype=model.dtype, device=model.device))

    def check(self, context: int) -> None:
        require(self.cache.max_len >= context,
                f"the drafter's BudgetCache holds {self.cache.max_len} tokens but the run needs {context} "
                f"(prompt + new tokens); create it with max_len >= {context}")

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        require(prompt.numel() >= 2, f"BudgetDrafter needs a prompt of >= 2 tokens, got {prompt.numel()}")
        self.ctx, self.proposed = ctx, 0
        self.cache.reset()
        self.cache.prefill(self.model, prompt[None, :-1].to(self.model.device))
        self.position = prompt.numel() - 1
        self.pending = prompt[-1:].tolist()
