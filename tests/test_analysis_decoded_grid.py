"""The decoded acceptance grid: real greedy runs per drafter, context and draft cache, checked against AR."""

from __future__ import annotations

import pytest
import torch

from sparsedraft import SparsedraftError
from sparsedraft.analysis.decoded_grid import decoded_acceptance_grid, grid_table
from sparsedraft.speculative.feature import FeatureHead
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_grid_rows_cover_every_cell_and_every_run_matches_ar():
    target = tiny_model("qwen3", seed=2)
    head = FeatureHead(target.cfg).init_from(target).attach(target).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    prompts = {ctx: [torch.randint(0, target.cfg.vocab_size, (1, ctx), generator=gen) for _ in range(2)]
               for ctx in (40, 56)}
    grid = decoded_acceptance_grid(target, {"feature": head, "slice": "truncated:1"}, prompts, [16, 32], gamma=3,
                                   new_tokens=10, chunk_size=4)
    assert len(grid) == 2 * 2 * 2 * 3  # contexts x prompts x drafters x (full + 2 budgets)
    assert grid.tokens_match.all()
    assert ((grid.acceptance >= 0) & (grid.acceptance <= 1)).all() and grid.acceptance.max() > 0
    assert (grid.tokens_per_round >= 1).all()
    table = grid_table(grid)
    assert list(table.columns) == ["drafter", "context", "full", "16", "32", "spread"]
    row = table[(table.drafter == "feature") & (table.context == 40)].iloc[0]
    cells = grid[(grid.drafter == "feature") & (grid.context == 40) & (grid.budget.isin([16, 32]))]
    means = cells.groupby("budget").acceptance.mean()
    assert row["spread"] == pytest.approx(means.max() - means.min())


def test_a_budget_that_does_not_fit_is_refused_before_any_run():
    target = tiny_model("qwen3", seed=2)
    with pytest.raises(SparsedraftError, match="do not fit"):
        decoded_acceptance_grid(target, {"slice": "truncated:1"}, {48: [torch.zeros(1, 40, dtype=torch.long)]}, [40])
