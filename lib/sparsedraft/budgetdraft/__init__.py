"""BudgetDraft: one drafter trained to agree with its verifier under any KV budget.

- :mod:`.config`: :class:`TrainConfig`, the validated run description;
- :mod:`.teacher`: the verifier's greedy targets, cached on disk;
- :mod:`.view`: the BudgetCache selection as a differentiable training view;
- :mod:`.loss`: L = L_A + lambda * L_C and the agreement proxy;
- :mod:`.init`: drafter inits (verifier layers, scratch body, another model);
- :mod:`.train` / :mod:`.checkpoint`: the loop, resume, run folders;
- :mod:`.drafter`: :class:`BudgetDrafter` for the speculative driver;
- :mod:`.evaluate`: acceptance over context and budget, the robustness table;
- :mod:`.cli`: ``train-drafter``.

The inference cache itself is :class:`sparsedraft.caches.budget.BudgetCache`.
"""

from .checkpoint import load_drafter
from .config import TrainConfig
from .drafter import BudgetDrafter
from .evaluate import (AcceptanceStats, acceptance_grid, draft_matches, robustness_from_grid, robustness_table,
                       simulate_greedy, speculative_acceptance)
from .loss import agreement, budgetdraft_loss
from .train import TrainResult, train_drafter
from .view import BudgetView, budget_masks

__all__ = ["AcceptanceStats", "BudgetDrafter", "BudgetView", "TrainConfig", "TrainResult", "acceptance_grid",
           "agreement", "budget_masks", "budgetdraft_loss", "draft_matches", "load_drafter", "robustness_from_grid",
           "robustness_table",
           "simulate_greedy", "speculative_acceptance", "train_drafter"]
