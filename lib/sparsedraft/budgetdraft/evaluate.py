"""Acceptance of a drafter with a KV budget against the full-cache verifier, over context and budget.

Greedy speculative decoding emits the verifier's greedy continuation y, and
each round keeps the drafter's tokens up to its first disagreement with y.
After a rollback the drafter's cache holds exactly the committed tokens (a
BudgetCache selects once at prefill and rolls back exactly), so the drafter's
token at step j is its argmax after ``prompt + y[:j]`` -- what one
teacher-forced forward over y computes. :func:`draft_matches` does that and
:func:`simulate_greedy` replays the driver's rounds (capped at ``gamma`` and
at the tokens left, like :func:`~sparsedraft.speculative.speculative`), so
one verifier generation per prompt serves every drafter and budget. Up to
floating-point ties between one multi-token forward and many one-token
forwards this equals the real decoder's statistics, which
:func:`speculative_acceptance` measures directly (the tests compare both).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from ..caches.budget import BUDGETS, BudgetCache, check_scoring
from ..data import Tokenizer, prompt_tokens
from ..errors import require
from ..generate import generate, prefill
from ..model import Transformer
from ..progress import bar
from ..speculative import speculative
from .checkpoint import load_checkpoint, load_drafter
from .drafter import BudgetDrafter, budget_prefill
from .init import init_drafter


@dataclass(frozen=True)
class AcceptanceStats:
    drafted: int  # draft tokens offered to the verifier
    accepted: int  # of which kept
    verifications: int  # verifier forwards after the prefill
    generated: int  # tokens emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_verification(self) -> float:
        return self.generated / self.verifications if self.verifications else float("nan")

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "tokens_per_verification": self.tokens_per_verification}


def greedy_continuation(verifier: Transformer, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[T] prompt -> [new_tokens] greedy tokens of the verifier with its full cache."""
    return generate(verifier, prompt[None], new_tokens).tokens[0]


@torch.inference_mode()
def draft_matches(drafter: Transformer, prompt: torch.Tensor, continuation: torch.Tensor, budget: int | None,
                  chunk_size: int = 8, obs_window: int = 32, scoring: str = "attention") -> torch.Tensor:
    """bool [N]: the drafter's argmax after ``prompt + continuation[:j]`` equals ``continuation[j]``.

    ``budget=None`` drafts with a full cache. The prefill stops before the
    last prompt token, as :class:`BudgetDrafter` does, so the selection is the
    one the speculative run would make. ``scoring`` is the cache's chunk rule
    (:data:`~sparsedraft.caches.budget.SCORINGS`).
    """
    require(prompt.numel() >= 2 and continuation.numel() >= 1,
            f"need a prompt of >= 2 tokens and a continuation of >= 1, got {prompt.numel()} and {continuation.numel()}")
    device = drafter.device
    total = prompt.numel() + continuation.numel()
    body = prompt[None, :-1].to(device)
    if budget is None:
        cache = drafter.new_cache(total)
        prefill(drafter, cache, body)
    else:
        cache = BudgetCache(drafter.cfg, budget, total, chunk_size, obs_window, dtype=drafter.dtype, device=device,
                            scoring=scoring)
        budget_prefill(drafter, cache, body)
    fed = torch.cat((prompt[-1:], continuation[:-1]))[None].to(device)
    logits = drafter(fed, cache=cache)
    return (logits[0].argmax(-1).cpu() == continuation.cpu())


def simulate_greedy(matches: torch.Tensor, gamma: int) -> AcceptanceStats:
    """Rounds of greedy speculative decoding along ``matches`` [N] (see the module docstring)."""
    require(gamma >= 1, f"gamma must be >= 1, got {gamma}")
    flags = matches.tolist()
    n, i = len(flags), 0
    drafted = accepted = rounds = 0
    while i < n:
        g = min(gamma, n - i - 1)
        k = 0
        while k < g and flags[i + k]:
            k += 1
        drafted, accepted, rounds = drafted + g, accepted + k, rounds + 1
        i += k + 1
    return AcceptanceStats(drafted, accepted, rounds, n)


def speculative_acceptance(verifier: Transformer, drafter: Transformer, prompt: torch.Tensor, new_tokens: int,
                           budget: int, gamma: int = 4, chunk_size: int = 8, obs_window: int = 32,
                           scoring: str = "attention") -> AcceptanceStats:
    """The real greedy speculative decoder with a :class:`BudgetDrafter` (slower; the reference)."""
    draft = BudgetDrafter.create(drafter, budget, prompt.numel() + new_tokens, chunk_size, obs_window, scoring)
    stats = speculative(verifier, draft, prompt[None], new_tokens, gamma).stats
    level = stats.levels[-1]
    return AcceptanceStats(level.drafted, level.accepted, level.verifications, stats.generated)


def check_trained_budgets(budgets: Sequence[int | None], trained_budgets: Sequence[int] | None) -> None:
    """Refuse sparse budgets outside ``trained_budgets`` (None: the drafters are untrained, nothing to check).

    A drafter trained on some budgets says nothing about others: BudgetDraft's
    claim is robustness over the budgets it was trained on.
    """
    if trained_budgets is None:
        return
    untrained = sorted({b for b in budgets if b is not None} - set(trained_budgets))
    require(not untrained, f"budgets {untrained} were not among the drafter's training budgets "
                           f"{sorted(trained_budgets)}; evaluate only those, or train with --budgets covering them")


def acceptance_rows(verifier: Transformer, drafters: Mapping[str, Transformer], prompts: Sequence[torch.Tensor],
                    budgets: Sequence[int | None], new_tokens: int = 64, gamma: int = 4, chunk_size: int = 8,
                    obs_window: int = 32, trained_budgets: Sequence[int] | None = None,
                    scorings: Sequence[str] = ("attention",)) -> list[dict]:
    """One row per (prompt, drafter, budget, chunk scoring); ``None`` in ``budgets`` is the drafter's full cache
    (scored once: it keeps every chunk).

    ``trained_budgets``: the budgets the trained drafters saw (see :func:`check_trained_budgets`).
    A :func:`~sparsedraft.progress.bar` counts the rows when bars are on.
    """
    check_trained_budgets(budgets, trained_budgets)
    require(len(scorings) >= 1 and len(set(scorings)) == len(scorings), f"name distinct scorings, got {scorings}")
    for scoring in scorings:
        check_scoring(scoring)
    cells = [(budget, scoring) for budget in budgets for scoring in (scorings if budget is not None else scorings[:1])]
    rows = []
    with bar(total=len(prompts) * len(drafters) * len(cells), desc="acceptance", unit="row") as progress:
        for p, prompt in enumerate(prompts):
            continuation = greedy_continuation(verifier, prompt, new_tokens)
            for name, drafter in drafters.items():
                for budget, scoring in cells:
                    matches = draft_matches(drafter, prompt, continuation, budget, chunk_size, obs_window, scoring)
                    stats = simulate_greedy(matches, gamma)
                    rows.append({"drafter": name, "context": prompt.numel() + new_tokens, "prompt": p,
                                 "budget": "full" if budget is None else budget, "gamma": gamma,
                                 "scoring": scoring if budget is not None else "full",
                                 "top1_agreement": float(matches.float().mean()), **stats.to_dict()})
                    progress.update(1)
    return rows


def acceptance_grid(verifier: Transformer, drafters: Mapping[str, Transformer], tokenizer: Tokenizer,
                    contexts: Sequence[int] = (1024, 2048, 4096, 8192), budgets: Sequence[int | None] = BUDGETS,
                    new_tokens: int = 64, gamma: int = 4, prompts: int = 1, split: str = "heldout",
                    chunk_size: int = 8, obs_window: int = 32,
                    trained_budgets: Sequence[int] | None = None, scorings: Sequence[str] = ("attention",)) -> pd.DataFrame:
    """Acceptance per (context, drafter, budget, chunk scoring), averaged over ``prompts`` held-out windows.

    ``context`` counts prompt + generated tokens, so it must fit the verifier's
    context limit; budgets at or above a context are full caches. Pass the
    training config's ``budgets`` as ``trained_budgets`` to refuse any other.
    With more than one context, a :func:`~sparsedraft.progress.bar` counts them when bars are on.
    """
    check_trained_budgets(budgets, trained_budgets)
    limit = verifier.cfg.max_position_embeddings
    require(max(contexts) <= limit, f"context {max(contexts)} exceeds the verifier's {limit} tokens; "
                                    f"use contexts <= {limit} (prompt + new tokens)")
    require(min(contexts) > new_tokens + 1, f"every context must exceed new_tokens + 1 ({new_tokens + 1})")
    rows = []
    for context in bar(contexts, desc="acceptance grid", unit="context", show=len(contexts) > 1):
        texts = [prompt_tokens(tokenizer, context - new_tokens, split=split, variant=v) for v in range(prompts)]
        rows += acceptance_rows(verifier, drafters, texts, budgets, new_tokens, gamma, chunk_size, obs_window,
                                trained_budgets, scorings)
    frame = pd.DataFrame(rows)
    keys = ["drafter", "context", "budget", "gamma", "scoring"]
    return frame.groupby(keys, sort=False)[["acceptance_rate", "tokens_per_verification", "top1_agreement"]] \
        .mean().reset_index()


def robustness_table(verifier: Transformer, drafters: Mapping[str, Transformer], tokenizer: Tokenizer,
                     contexts: Sequence[int] = (4096, 8192), budgets: Sequence[int | None] = BUDGETS,
                     new_tokens: int = 64, gamma: int = 4, prompts: int = 1, chunk_size: int = 8,
                     obs_window: int = 32, trained_budgets: Sequence[int] | None = None,
                     scorings: Sequence[str] = ("attention",)) -> pd.DataFrame:
    """The paper's robustness view: acceptance rate, one row per drafter and context, one column per budget.

    ``drafters`` would hold e.g. {"naive": untrained init, "lambda=0": L_A-only, "budgetdraft": L_A + L_C}
    (see :func:`drafters_from_runs`); the spread across a row is the budget sensitivity BudgetDraft
    removes. ``None`` in ``budgets`` adds the drafter's full cache as a "full" column (left out of the spread).
    """
    grid = acceptance_grid(verifier, drafters, tokenizer, contexts, list(budgets), new_tokens, gamma, prompts,
                           chunk_size=chunk_size, obs_window=obs_window, trained_budgets=trained_budgets,
                           scorings=scorings)
    return robustness_from_grid(grid, budgets)


def robustness_from_grid(grid: pd.DataFrame, budgets: Sequence[int | None]) -> pd.DataFrame:
    """Pivot an :func:`acceptance_grid` frame to the robustness view: one row per drafter and context,
    one column per budget (``None`` -> "full"), plus ``spread`` (max - min over the sparse budgets)
    and ``mean`` (their average)."""
    columns = ["full" if b is None else b for b in budgets]
    missing = sorted(set(map(str, columns)) - set(map(str, grid.budget.unique())))
    require(not missing, f"the grid has no rows for budgets {missing}; evaluate them with acceptance_grid first")
    scorings = [s for s in grid.get("scoring", pd.Series(dtype=str)).unique() if s != "full"]
    if len(scorings) > 1:  # one row per scoring, its full-cache column repeated from the scoring-free rows
        full = grid[grid.budget == "full"]
        grid = pd.concat([grid[grid.budget != "full"]] + [full.assign(scoring=s) for s in scorings])
    index = ["drafter", "context"] + (["scoring"] if len(scorings) > 1 else [])
    table = grid.pivot_table(index=index, columns="budget", values="acceptance_rate", sort=False)
    table = table[columns]
    sparse = table[[b for b in budgets if b is not None]]
    table["spread"] = sparse.max(axis=1) - sparse.min(axis=1)
    table["mean"] = sparse.mean(axis=1)
    return table


def drafters_from_runs(verifier: Transformer, runs: Mapping[str, str | Path],
                       naive: str | None = "naive") -> dict[str, Transformer]:
    """Trained drafters of ``runs`` {name: run folder} (eval mode, the verifier's device and dtype), plus
    under the name ``naive`` the untrained init of the first run's config -- the robustness table's baseline."""
    require(len(runs) >= 1, "name at least one run folder")
    drafters = {}
    if naive is not None:
        first = load_checkpoint(Path(next(iter(runs.values())))).config
        drafters[naive] = init_drafter(verifier, first).to(verifier.dtype).eval()
    for name, run_dir in runs.items():
        drafters[name] = load_drafter(run_dir, verifier.dtype, verifier.device)
    return drafters
