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

from ..analysis.intervals import mean_interval
from ..caches.budget import BUDGETS, BudgetCache, check_scoring
from ..engine.data import Tokenizer, prompt_tokens
from ..engine.generate import generate
from ..engine.model import Transformer
from ..engine.prefill import prefill
from ..errors import require
from ..progress import bar
from ..speculative import speculative
from ..speculative.budget import BudgetDrafter, fill_prefix
from ..speculative.loading import load_drafter
from .checkpoint import load_checkpoint
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
    return draft_matches_by_budget(drafter, prompt, continuation, [budget], chunk_size, obs_window, scoring)[budget]


@torch.inference_mode()
def draft_matches_by_budget(drafter: Transformer, prompt: torch.Tensor, continuation: torch.Tensor,
                            budgets: Sequence[int | None], chunk_size: int = 8, obs_window: int = 32,
                            scoring: str = "attention") -> dict[int | None, torch.Tensor]:
    """:func:`draft_matches` for each of ``budgets`` from one budget-cache prefill (forked per budget before
    its selection, which is all that depends on the budget) and one full-cache prefill if ``None`` is asked."""
    require(prompt.numel() >= 2 and continuation.numel() >= 1,
            f"need a prompt of >= 2 tokens and a continuation of >= 1, got {prompt.numel()} and {continuation.numel()}")
    device = drafter.device
    total = prompt.numel() + continuation.numel()
    body = prompt[None, :-1].to(device)
    fed = torch.cat((prompt[-1:], continuation[:-1]))[None].to(device)

    def matches(cache) -> torch.Tensor:
        return drafter(fed, cache=cache)[0].argmax(-1).cpu() == continuation.cpu()

    out: dict[int | None, torch.Tensor] = {}
    if None in budgets:
        cache = drafter.new_cache(total)
        prefill(drafter, cache, body)
        out[None] = matches(cache)
    sparse = [b for b in budgets if b is not None]
    if sparse:
        prefix = BudgetCache(drafter.cfg, sparse[0], total, chunk_size, obs_window, dtype=drafter.dtype,
                             device=device, scoring=scoring)
        _, attention = fill_prefix(drafter, prefix, body)
        for budget in sparse:
            cache = prefix.fork(budget)
            cache.select(attention)
            out[budget] = matches(cache)
    return out


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
                found = {}  # one prefill per chunk rule (forked per budget) and one full-cache prefill
                for scoring in scorings:
                    asked = sorted({b for b, s in cells if s == scoring}, key=lambda b: (b is None, b or 0))
                    by_budget = draft_matches_by_budget(drafter, prompt, continuation, asked, chunk_size, obs_window,
                                                        scoring)
                    found.update({(b, scoring): m for b, m in by_budget.items()})
                for budget, scoring in cells:
                    matches = found[(budget, scoring)]
                    stats = simulate_greedy(matches, gamma)
                    rows.append({"drafter": name, "context": prompt.numel() + new_tokens, "prompt": p,
                                 "budget": "full" if budget is None else budget, "gamma": gamma,
                                 "scoring": scoring if budget is not None else "full",
                                 "top1_agreement": float(matches.float().mean()), **stats.to_dict()})
                    progress.update(1)
    return rows


def acceptance_grid(verifier: Transformer, drafters: Mapping[str, Transformer], tokenizer: Tokenizer,
                    contexts: Sequence[int] = (1024, 2048, 4096, 8192), budgets: Sequence[int | None] = BUDGETS,
                    new_tokens: int = 64, gamma: int = 4, prompts: int | Mapping[int, int] = 1,
                    split: str = "heldout", chunk_size: int = 8, obs_window: int = 32,
                    trained_budgets: Sequence[int] | None = None, scorings: Sequence[str] = ("attention",)) -> pd.DataFrame:
    """Acceptance per (context, drafter, budget, chunk scoring), averaged over ``prompts`` held-out windows
    (a number, or one per context: ``{32768: 3, ...}``), with ``acceptance_ci95``, the half-width of the 95%
    t interval of that mean over the prompts (NaN for one prompt), and ``prompts``, their number.

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
    counts = prompts_per_context(contexts, prompts)
    rows = []
    for context in bar(contexts, desc="acceptance grid", unit="context", show=len(contexts) > 1):
        texts = [prompt_tokens(tokenizer, context - new_tokens, split=split, variant=v) for v in range(counts[context])]
        rows += acceptance_rows(verifier, drafters, texts, budgets, new_tokens, gamma, chunk_size, obs_window,
                                trained_budgets, scorings)
    frame = pd.DataFrame(rows)
    grouped = frame.groupby(["drafter", "context", "budget", "gamma", "scoring"], sort=False)
    grid = grouped[["acceptance_rate", "tokens_per_verification", "top1_agreement"]].mean()
    grid["acceptance_ci95"] = grouped.acceptance_rate.agg(lambda rates: mean_interval(rates)[1])
    grid["prompts"] = grouped.size()
    return grid.reset_index()


def prompts_per_context(contexts: Sequence[int], prompts: int | Mapping[int, int]) -> dict[int, int]:
    """``{context: held-out prompts}`` from one number for all or a mapping that names every context."""
    counts = dict(prompts) if isinstance(prompts, Mapping) else {c: prompts for c in contexts}
    missing = sorted(set(contexts) - set(counts))
    require(not missing, f"prompts names no count for contexts {missing}; give one per context or a single number")
    require(all(counts[c] >= 1 for c in contexts), f"every context needs >= 1 prompt, got {counts}")
    return {c: int(counts[c]) for c in contexts}


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
