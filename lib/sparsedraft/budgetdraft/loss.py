"""The BudgetDraft objective L = L_A + lambda * L_C, and its cheap agreement proxy.

- L_A: cross-entropy of the drafter's full-prefix logits against the
  verifier's greedy tokens x*_t -- greedy verification accepts a draft token
  iff it equals x*_t, so this is the acceptance-aware target.
- L_C: the same cross-entropy with the drafter attending through the budget-B
  sparse view of :mod:`.view`, B sampled per step from a budget set, so one
  drafter learns to agree with the verifier at every sparsity it may be
  deployed with.

Both branches run the model's explicit-softmax attention path (a capture of
all layers): the full branch needs the weights to score chunks, and running
the sparse branch through the same kernel makes the two differ by the mask
alone -- with a budget covering the sequence, L_C equals L_A bit for bit.

Only a sampled subset of positions gets logits: on SmolLM2 the 49K-way head
costs more than three transformer layers, so the loss reads the final norm's
output at those positions (a forward hook) and skips the head elsewhere.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from ..cache import SequenceView
from ..model import Capture, Transformer
from .view import BudgetView, budget_masks


@dataclass
class LossParts:
    total: torch.Tensor  # L_A + lam * L_C, differentiable
    full: float  # L_A
    sparse: float | None  # L_C (None when lam == 0: the branch is skipped)


@contextmanager
def only_positions(model: Transformer, positions: torch.Tensor | None) -> Iterator[None]:
    """While active, ``model`` returns logits [B, len(positions), V] for those positions only."""
    if positions is None:
        yield
        return
    handle = model.norm.register_forward_hook(lambda module, args, out: out[:, positions])
    try:
        yield
    finally:
        handle.remove()


def full_forward(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Full-prefix logits and every layer's attention weights [B, H, T, T] (detached)."""
    capture = Capture(layers=set(range(model.cfg.num_layers)), weights=True)
    logits = model(tokens, cache=SequenceView(model.cfg.sliding_window), capture=capture)
    return logits, capture.attention


def sparse_forward(model: Transformer, tokens: torch.Tensor, attention: dict[int, torch.Tensor], budget: int,
                   chunk_size: int, obs_window: int) -> torch.Tensor:
    """Logits with every position attending through the budget-``budget`` view chosen from ``attention``."""
    masks = budget_masks(attention, budget, chunk_size, obs_window)
    same_kernel = Capture(layers=set(range(model.cfg.num_layers)), weights=True)
    return model(tokens, cache=BudgetView(masks, model.cfg.sliding_window), capture=same_kernel)


def budgetdraft_loss(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor, lam: float, budget: int,
                     chunk_size: int, obs_window: int, positions: torch.Tensor | None = None) -> LossParts:
    """tokens, targets [B, T]; ``positions`` [P] (default all) get logits and loss."""
    wanted = targets if positions is None else targets[:, positions]
    with only_positions(model, positions):
        logits, attention = full_forward(model, tokens)
        full = F.cross_entropy(logits.flatten(0, 1).float(), wanted.flatten())
        if lam == 0:
            return LossParts(full, full.item(), None)
        logits = sparse_forward(model, tokens, attention, budget, chunk_size, obs_window)
    sparse = F.cross_entropy(logits.flatten(0, 1).float(), wanted.flatten())
    return LossParts(full + lam * sparse, full.item(), sparse.item())


@torch.no_grad()
def agreement(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor, budgets: Sequence[int],
              chunk_size: int, obs_window: int) -> dict[str, float]:
    """Top-1 agreement with the teacher, full view ("full") and per sparse budget: the acceptance proxy."""
    logits, attention = full_forward(model, tokens)
    out = {"full": float((logits.argmax(-1) == targets).float().mean())}
    for budget in budgets:
        logits = sparse_forward(model, tokens, attention, budget, chunk_size, obs_window)
        out[str(budget)] = float((logits.argmax(-1) == targets).float().mean())
    return out
