"""Acceptance over context and draft cache, measured by decoding: the collapse grid for any drafter.

BudgetDraft's robustness claim is about acceptance per context and KV budget.
For the slice drafters, :func:`sparsedraft.budgetdraft.acceptance_grid`
estimates it teacher-forced (cheap, and tested equal to the decoder). A
feature drafter's drafts depend on the target's features at every verified
position, so here the figure is simply what the speculative decoder does:
for each prompt, one target prefill shared by every run (the ``prefilled``
path every bench takes), then greedy ``spec`` runs with each drafter over
each draft cache -- its full cache (EAGLE's setting) and a budget cache of
each budget (BudgetDraft's). Every run's tokens are checked against plain
decoding from the same prefill, so the grid is also a losslessness check at
real scale.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pandas as pd
import torch

from ..engine.model import Transformer
from ..engine.prefill_store import PrefillStore, prefill_prompt
from ..errors import require
from ..progress import bar
from ..speculative.decoding import decode
from ..speculative.feature import feature_layers_of

FULL = "full"  # the draft cache column value of a drafter over its whole context


def decoded_acceptance_grid(target: Transformer, drafters: Mapping[str, Any],
                            prompts: Mapping[int, Sequence[torch.Tensor]], budgets: Sequence[int], *, gamma: int = 4,
                            new_tokens: int = 64, chunk_size: int = 8, full: bool = True, draft_vocab: int = 0,
                            store: PrefillStore | None = None) -> pd.DataFrame:
    """One row per (drafter, context, prompt, draft cache): greedy acceptance of its drafts by the full target.

    ``drafters`` maps a row name to anything ``decode(..., draft=)`` takes (a feature drafter folder or
    :class:`~sparsedraft.speculative.feature.FeatureHead`, a BudgetDraft run folder, a model); ``prompts`` maps
    a context (its label in the rows, e.g. prompt + generated tokens) to its prompts ([1, T] ids, one T per
    context). ``full`` adds each drafter over its full cache (budget None).
    Columns: drafter, context, prompt, cache, budget, acceptance (accepted / drafted), mean_accepted (per
    round), tokens_per_round (accepted + the target's own token), rounds, tokens_match."""
    require(gamma >= 1 and new_tokens >= 1, f"need gamma >= 1 and new_tokens >= 1, got {gamma}, {new_tokens}")
    require(drafters and prompts, "give at least one drafter and one context with prompts")
    for context, group in prompts.items():
        require(len(group) >= 1 and all(p.dim() == 2 and p.shape == group[0].shape and p.shape[0] == 1 for p in group),
                f"the prompts at context {context} must be [1, T] ids of one length T")
        cached = group[0].shape[1] - 1  # the prompt minus its pending last token
        too_big = [b for b in budgets if b >= cached]
        require(not too_big, f"budgets {too_big} do not fit below the {cached}-token cached context of the prompts at "
                             f"context {context}; drop them or use longer prompts")
    caches: list[tuple[str, int | None]] = ([(FULL, None)] if full else []) + [("budget", b) for b in budgets]
    layers = feature_layers_of(*drafters.values())  # one prefill per prompt serves every drafter's features
    rows = []
    total = sum(len(group) for group in prompts.values()) * len(drafters) * len(caches)
    with bar(total=total, desc="decoded grid", unit="run") as progress:
        for context, group in prompts.items():
            for index, prompt in enumerate(group):
                shared = prefill_prompt(target, prompt, store=store, feature_layers=layers)
                ar = decode(target, prompt, "ar", new_tokens, prefilled=shared).tokens
                for name, draft in drafters.items():
                    for cache, budget in caches:
                        options = {"budget": budget, "chunk_size": chunk_size} if budget else {}
                        out = decode(target, prompt, "spec", new_tokens, prefilled=shared, draft=draft,
                                     draft_cache=cache, gamma=gamma, draft_vocab=draft_vocab, **options)
                        level = out.levels[-1]
                        rounds = max(level.verifications, 1)
                        rows.append({"drafter": name, "context": context, "prompt": index, "cache": cache,
                                     "budget": budget, "acceptance": level.accepted / max(level.drafted, 1),
                                     "mean_accepted": level.accepted / rounds,
                                     "tokens_per_round": (level.accepted + level.verifications) / rounds,
                                     "rounds": level.verifications, "tokens_match": torch.equal(out.tokens, ar)})
                        progress.update(1)
    return pd.DataFrame(rows)


def grid_table(grid: pd.DataFrame) -> pd.DataFrame:
    """Mean acceptance per drafter and context, one column per draft cache (``full``, then each budget), with
    ``spread`` = the largest minus the smallest acceptance over the budgets (the sensitivity BudgetDraft
    removes; full excluded)."""
    label = grid.apply(lambda r: FULL if r["cache"] == FULL else int(r["budget"]), axis=1)
    table = grid.assign(column=label).pivot_table(index=["drafter", "context"], columns="column",
                                                  values="acceptance", aggfunc="mean")
    budgets = [c for c in table.columns if c != FULL]
    table = table[([FULL] if FULL in table.columns else []) + sorted(budgets)]
    table["spread"] = table[budgets].max(axis=1) - table[budgets].min(axis=1) if budgets else float("nan")
    table.columns = [str(c) for c in table.columns]
    return table.reset_index()
