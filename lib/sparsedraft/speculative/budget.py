"""Filling a :class:`~sparsedraft.caches.budget.BudgetCache` from a prompt, and the drafter that drafts over it.

A BudgetCache keeps the prompt chunks its observation window attended to
most, but the cache protocol never shows a cache the attention, so the
prefill belongs here: :func:`budget_prefill` runs the model over the prompt
(in chunks, bounded memory), captures the observation window's attention
weights in one last forward, and hands them to :meth:`BudgetCache.select`.
:class:`BudgetDrafter` prefills that way; everything after (drafting, exact
rollback, commit) is :class:`~sparsedraft.speculative.ModelDrafter`'s.
``model`` may be anything called like a Transformer with a ``cfg``: a feature
drafter's head fills its budget cache through the same two functions
(:class:`~sparsedraft.speculative.feature.Entries`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..caches.budget import BudgetCache, observation_window
from ..engine.model import Capture, Transformer
from ..engine.prefill import PREFILL_CHUNK, prefill
from ..errors import require
from .drafters import DraftContext, ModelDrafter, TargetState


@torch.inference_mode()
def budget_prefill(model: Transformer | Callable, cache: BudgetCache, tokens: torch.Tensor,
                   chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Prefill ``tokens`` [B, T] into the (reset) ``cache`` and select its chunks; return the last logits [B, V].

    The tokens before the observation window go through in chunks of
    ``chunk``; the window and the partial chunk after it (at most
    ``obs_window + chunk_size - 1`` tokens) go through in one forward whose
    attention weights [B, H, tokens, T] are captured: small for a drafter, and
    only the window's rows over the keys before the partial chunk are scored.
    A cache scoring chunks by keys (``scoring="keys"``) needs no attention: the
    whole prompt is a plain chunked prefill, then the cache selects from its keys.
    """
    logits, attention = fill_prefix(model, cache, tokens, chunk)
    cache.select(attention)
    return logits


@torch.inference_mode()
def fill_prefix(model: Transformer | Callable, cache: BudgetCache, tokens: torch.Tensor, chunk: int = PREFILL_CHUNK
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
    """:func:`budget_prefill` up to, not including, the selection: (last logits [B, V], what ``cache.select``
    takes -- the window's attention, or None for keys scoring). Between the two, ``cache.fork(budget)`` can copy
    the prefilled cache for other budgets."""
    require(isinstance(cache, BudgetCache), f"budget_prefill fills a BudgetCache, got {type(cache).__name__}")
    require(tokens.dim() == 2 and tokens.shape[1] >= 1, f"tokens must be [batch, T >= 1], got {tuple(tokens.shape)}")
    cache.open_prefix()
    if cache.scoring == "keys":
        return prefill(model, cache, tokens, chunk), None
    start, stop = observation_window(tokens.shape[1], cache.chunk_size, cache.obs_window)
    if start:
        prefill(model, cache, tokens[:, :start], chunk)
    capture = Capture(layers=set(range(model.cfg.num_layers)), weights=True)
    logits = model(tokens[:, start:], cache=cache, last_only=True, capture=capture)
    return logits[:, -1], {layer: w[:, :, :stop - start, :stop] for layer, w in capture.attention.items()}


class BudgetDrafter(ModelDrafter):
    """The BudgetDraft inference pipeline's drafter: a (trained) draft model with a KV budget."""

    def __init__(self, model: Transformer, cache: BudgetCache):
        require(isinstance(cache, BudgetCache), f"BudgetDrafter drafts over a BudgetCache, got {type(cache).__name__}")
        super().__init__(model, cache)

    @classmethod
    def create(cls, model: Transformer, budget: int, max_len: int, chunk_size: int = 8,
               obs_window: int = 32, scoring: str = "attention") -> "BudgetDrafter":
        """A drafter with a fresh batch-1 cache on the model's device and dtype."""
        return cls(model, BudgetCache(model.cfg, budget, max_len, chunk_size, obs_window, scoring=scoring,
                                      dtype=model.dtype, device=model.device))

    def check(self, context: int) -> None:
        require(self.cache.max_len >= context,
                f"the drafter's BudgetCache holds {self.cache.max_len} tokens but the run needs {context} "
                f"(prompt + new tokens); create it with max_len >= {context}")

    def start(self, prompt: torch.Tensor, target: TargetState, ctx: DraftContext) -> None:
        require(prompt.numel() >= 2, f"BudgetDrafter needs a prompt of >= 2 tokens, got {prompt.numel()}")
        self.ctx, self.proposed = ctx, 0
        self.cache.reset()
        budget_prefill(self.model, self.cache, prompt[None, :-1].to(self.model.device))
        self.position = prompt.numel() - 1
        self.pending = prompt[-1:].tolist()
