"""BudgetDraft: one drafter trained to agree with its verifier under any KV budget.

- :mod:`.config`: :class:`TrainConfig`, the validated run description;
- :mod:`.teacher`: the verifier's greedy targets, cached on disk;
- :mod:`.view`: the BudgetCache's drafting view as a differentiable training view;
- :mod:`.loss`: L = L_A + lambda * L_C and the agreement proxy;
- :mod:`.init`: drafter inits (verifier layers, scratch body, another model);
- :mod:`.train` / :mod:`.checkpoint`: the loop, resume, writing run folders (reading them for inference is
  :mod:`sparsedraft.speculative.loading`'s: :func:`load_drafter` is re-exported here);
- :func:`budget_prefill` and :class:`BudgetDrafter` for the speculative driver live with the other drafters
  (:mod:`sparsedraft.speculative.budget`) and are re-exported here;
- :mod:`.evaluate`: acceptance over context and budget, the robustness table;
- :mod:`.cli`: ``train-drafter``.

The inference cache itself is :class:`sparsedraft.caches.BudgetCache`.
"""

from ..speculative.budget import BudgetDrafter, budget_prefill
from ..speculative.loading import load_drafter
from .config import TrainConfig
from .evaluate import (AcceptanceStats, acceptance_grid, check_trained_budgets, draft_matches, robustness_from_grid,
                       robustness_table, simulate_greedy, speculative_acceptance)
from .loss import agreement, budgetdraft_loss
from .train import TrainResult, train_drafter
from .view import BudgetView, RecordingView, kept_prefix

__all__ = ["AcceptanceStats", "BudgetDrafter", "BudgetView", "RecordingView", "TrainConfig", "TrainResult",
           "acceptance_grid", "agreement", "budget_prefill", "budgetdraft_loss", "check_trained_budgets",
           "draft_matches", "kept_prefix", "load_drafter", "robustness_from_grid", "robustness_table",
           "simulate_greedy", "speculative_acceptance", "train_drafter"]
