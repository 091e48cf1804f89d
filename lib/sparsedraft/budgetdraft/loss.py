"""The BudgetDraft objective L = L_A + lambda * L_C, and its cheap agreement proxy.

- L_A: cross-entropy of the drafter's full-prefix logits against the
  verifier's greedy tokens x*_t -- greedy verification accepts a draft token
  iff it equals x*_t, so this is the acceptance-aware target.
- L_C: the same cross-entropy at the continuation positions (after the
  window's prefix of ``prefix_len`` tokens), with the drafter attending
  through the budget-B drafting view of :mod:`.view`, B sampled per step from
  a budget set, so one drafter learns to agree with the verifier at every
  sparsity it may be deployed with.

The full branch records every layer's post-RoPE queries, keys and values:
the observation window's queries and keys score the prefix chunks, and the
prefix keys and values are what the continuation attends to. With a budget
covering the prefix the sparse view is the full view, and L_C equals the full
branch's loss at the same positions up to rounding.

Only a sampled subset of positions gets L_A logits: on SmolLM2 the 49K-way
head costs more than three transformer layers, so the loss reads the final
norm's output at those positions (a forward hook) and skips the head elsewhere.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from ..engine.model import Capture, Transformer
from ..errors import require
from .view import BudgetView, RecordingView, kept_prefix


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


@dataclass
class FullPass:
    logits: torch.Tensor  # [B, T or len(positions), V]
    queries: dict[int, torch.Tensor]  # layer -> post-RoPE queries [B, H, T, D] (detached)
    view: RecordingView  # every layer's keys and values [B, kv_heads, T, D], graph included


def full_forward(model: Transformer, tokens: torch.Tensor) -> FullPass:
    """The drafter with its full causal context over ``tokens`` [B, T], recording what the sparse view reuses."""
    capture = Capture(layers=set(range(model.cfg.num_layers)))
    view = RecordingView(model.cfg.sliding_window)
    logits = model(tokens, cache=view, capture=capture)
    return FullPass(logits, capture.queries, view)


def sparse_forward(model: Transformer, tokens: torch.Tensor, full: FullPass, prefix_len: int, budget: int,
                   chunk_size: int, obs_window: int, scoring: str = "attention") -> torch.Tensor:
    """Logits [B, T - prefix_len, V] of the continuation drafted through the budget-``budget`` view."""
    kept = kept_prefix(model, full.queries, full.view.keys, prefix_len, budget, chunk_size, obs_window, scoring)
    positions = torch.arange(prefix_len, tokens.shape[1], device=tokens.device)
    return model(tokens[:, prefix_len:], positions, cache=BudgetView(full.view.keys, full.view.values, kept))


def check_view(model: Transformer, tokens: torch.Tensor, prefix_len: int) -> None:
    """Fail before any forward when the drafting view cannot be built."""
    require(model.cfg.sliding_window is None,
            f"the BudgetDraft view needs a drafter without sliding-window attention (window "
            f"{model.cfg.sliding_window}), like the BudgetCache it trains for")
    require(1 <= prefix_len < tokens.shape[1],
            f"prefix_len ({prefix_len}) must leave a continuation in windows of {tokens.shape[1]} tokens; "
            f"use 1 <= prefix_len < {tokens.shape[1]}")


def budgetdraft_loss(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor, lam: float, budget: int,
                     prefix_len: int, chunk_size: int, obs_window: int,
                     positions: torch.Tensor | None = None, scoring: str = "attention") -> LossParts:
    """tokens, targets [B, T]; ``positions`` [P] (default all) get L_A; L_C covers positions >= prefix_len."""
    check_view(model, tokens, prefix_len)
    wanted = targets if positions is None else targets[:, positions]
    with only_positions(model, positions):
        full_pass = full_forward(model, tokens)
    full = F.cross_entropy(full_pass.logits.flatten(0, 1).float(), wanted.flatten())
    if lam == 0:
        return LossParts(full, full.item(), None)
    logits = sparse_forward(model, tokens, full_pass, prefix_len, budget, chunk_size, obs_window, scoring)
    sparse = F.cross_entropy(logits.flatten(0, 1).float(), targets[:, prefix_len:].flatten())
    return LossParts(full + lam * sparse, full.item(), sparse.item())


@torch.no_grad()
def agreement(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor, budgets: Sequence[int],
              prefix_len: int, chunk_size: int, obs_window: int, scoring: str = "attention") -> dict[str, float]:
    """Top-1 agreement with the teacher on the continuation, full view ("full") and per budget: the acceptance proxy."""
    check_view(model, tokens, prefix_len)
    full_pass = full_forward(model, tokens)
    wanted = targets[:, prefix_len:]
    out = {"full": float((full_pass.logits[:, prefix_len:].argmax(-1) == wanted).float().mean())}
    for budget in budgets:
        logits = sparse_forward(model, tokens, full_pass, prefix_len, budget, chunk_size, obs_window, scoring)
        out[str(budget)] = float((logits.argmax(-1) == wanted).float().mean())
    return out
