"""A trained tiny drafter drafting over a BudgetCache: lossless greedy output, and the cheap
acceptance estimate agrees with the real speculative decoder."""

import pytest
import torch

from sparsedraft.speculative.budget import BudgetDrafter
from sparsedraft.analysis.intervals import mean_interval
from sparsedraft.budgetdraft.evaluate import (acceptance_grid, draft_matches, drafters_from_runs, robustness_from_grid,
                                              robustness_table, simulate_greedy, speculative_acceptance)
from sparsedraft.budgetdraft.config import TrainConfig
from sparsedraft.budgetdraft.train import train_drafter
from sparsedraft.caches.budget import BudgetCache
from sparsedraft.engine.data import ByteTokenizer, prompt_tokens
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.generate import generate
from sparsedraft.speculative import ModelDrafter, speculative
from sparsedraft.engine.tiny import tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(verifier with 3 layers, drafter = its first layer trained for a few steps on essays)."""
    tmp = tmp_path_factory.mktemp("budgetdraft")
    verifier = tiny_model("llama", num_hidden_layers=3)
    cfg = TrainConfig(verifier="tiny-llama", layers=1, seq_len=128, continuation=32, sequences=4, eval_sequences=0,
                      budgets=(16, 32, 64),
                      steps=8, lr=1e-3, warmup=1, eval_every=0, final_context=0, teacher_dir=str(tmp / "teacher"),
                      out_dir=str(tmp / "run"))
    return verifier, train_drafter(cfg, verifier, progress=False).drafter, cfg.run_dir


@pytest.mark.parametrize("budget,gamma", [(16, 3), (48, 5), (512, 4)])
def test_greedy_speculative_with_budget_cache_equals_autoregressive(pair, budget, gamma):
    verifier, drafter, _ = pair
    prompt = prompt_tokens(ByteTokenizer(), 150, split="heldout")[None]
    expected = generate(verifier, prompt, 40).tokens
    out = speculative(verifier, BudgetDrafter.create(drafter, budget, 190), prompt, 40, gamma)
    assert torch.equal(out.tokens, expected)


@pytest.mark.parametrize("budget", [16, 64, None])
def test_teacher_forced_estimate_equals_the_real_decoder(pair, budget):
    verifier, drafter, _ = pair
    prompt = prompt_tokens(ByteTokenizer(), 150, split="heldout", variant=1)
    continuation = generate(verifier, prompt[None], 40).tokens[0]
    estimate = simulate_greedy(draft_matches(drafter, prompt, continuation, budget), gamma=4)
    if budget is None:
        draft = ModelDrafter(drafter, drafter.new_cache(190))
        stats = speculative(verifier, draft, prompt[None], 40, 4).stats
        real = (stats.levels[-1].drafted, stats.levels[-1].accepted, stats.levels[-1].verifications)
        assert (estimate.drafted, estimate.accepted, estimate.verifications) == real
    else:
        assert estimate == speculative_acceptance(verifier, drafter, prompt, 40, budget, gamma=4)
    assert estimate.generated == 40


def test_plain_model_drafter_over_budget_cache_fails_clearly(pair):
    verifier, drafter, _ = pair
    prompt = torch.randint(0, 256, (1, 60))
    with pytest.raises(SparsedraftError, match="budget_prefill"):
        speculative(verifier, ModelDrafter(drafter, BudgetCache(drafter.cfg, 16, 80)), prompt, 8)


def test_grid_and_robustness_table_shapes(pair):
    verifier, drafter, run_dir = pair
    drafters = drafters_from_runs(verifier, {"trained": run_dir})
    assert list(drafters) == ["naive", "trained"]
    assert all(torch.equal(a, drafter.state_dict()[k]) for k, a in drafters["trained"].state_dict().items())
    assert torch.equal(drafters["naive"].layers[0].mlp.up_proj.weight, verifier.layers[0].mlp.up_proj.weight)
    grid = acceptance_grid(verifier, drafters, ByteTokenizer(), contexts=(96, 160), budgets=(16, 32, None),
                           new_tokens=16, trained_budgets=(16, 32, 64))
    assert len(grid) == 2 * 2 * 3 and grid["acceptance_rate"].between(0, 1).all()
    table = robustness_table(verifier, drafters, ByteTokenizer(), contexts=(160,), budgets=(16, 32, None),
                             new_tokens=16)
    assert list(table.columns) == [16, 32, "full", "spread", "mean"] and len(table) == 2
    assert (table["spread"] == table[[16, 32]].max(axis=1) - table[[16, 32]].min(axis=1)).all()
    assert (table["mean"] == table[[16, 32]].mean(axis=1)).all()
    from_grid = robustness_from_grid(grid[grid.context == 160], (16, 32, None))
    assert from_grid.equals(table)  # the same prompts give the same table, from one grid
    with pytest.raises(SparsedraftError, match="no rows for budgets"):
        robustness_from_grid(grid, (16, 64))


def test_evaluating_an_untrained_budget_is_refused_before_any_forward(pair):
    verifier, drafter, _ = pair
    with pytest.raises(SparsedraftError, match=r"budgets \[48\] were not among the drafter's training budgets"):
        acceptance_grid(verifier, {"trained": drafter}, ByteTokenizer(), contexts=(10**9,), budgets=(16, 48, None),
                        trained_budgets=(16, 32, 64))


def test_simulate_greedy_counts_rounds():
    stats = simulate_greedy(torch.tensor([True, True, False, True, True, True, True, False]), gamma=3)
    # rounds: accept 2 + correction (3 tokens), accept 3 + bonus (4), last token alone
    assert (stats.drafted, stats.accepted, stats.verifications, stats.generated) == (3 + 3 + 0, 5, 3, 8)


@pytest.mark.parametrize("budget", [16, 48])
def test_key_scored_budget_cache_is_lossless_and_its_estimate_is_the_real_decoder(pair, budget):
    verifier, drafter, _ = pair
    prompt = prompt_tokens(ByteTokenizer(), 150, split="heldout", variant=2)
    expected = generate(verifier, prompt[None], 40).tokens
    out = speculative(verifier, BudgetDrafter.create(drafter, budget, 190, scoring="keys"), prompt[None], 40, 4)
    assert torch.equal(out.tokens, expected)
    estimate = simulate_greedy(draft_matches(drafter, prompt, expected[0], budget, scoring="keys"), gamma=4)
    assert estimate == speculative_acceptance(verifier, drafter, prompt, 40, budget, gamma=4, scoring="keys")


def test_the_grid_compares_chunk_rules(pair):
    verifier, drafter, _ = pair
    grid = acceptance_grid(verifier, {"trained": drafter}, ByteTokenizer(), contexts=(160,), budgets=(16, 32, None),
                           new_tokens=16, scorings=("attention", "keys"))
    assert sorted(map(str, zip(grid.budget, grid.scoring))) == sorted(map(str, [
        (16, "attention"), (16, "keys"), (32, "attention"), (32, "keys"), ("full", "full")]))
    table = robustness_from_grid(grid, (16, 32, None))
    assert list(table.index.names) == ["drafter", "context", "scoring"] and len(table) == 2
    assert table["full"].nunique() == 1  # the full cache has no chunk rule: one value, shown on both rows
    with pytest.raises(SparsedraftError, match="chunk scoring must be one of"):
        acceptance_grid(verifier, {"trained": drafter}, ByteTokenizer(), contexts=(160,), budgets=(16,),
                        scorings=("mean",))


def test_the_grid_takes_prompts_per_context_and_gives_each_cell_a_t_interval(pair):
    verifier, drafter, _ = pair
    grid = acceptance_grid(verifier, {"trained": drafter}, ByteTokenizer(), contexts=(96, 160), budgets=(16, None),
                           new_tokens=16, prompts={96: 3, 160: 1})
    assert dict(zip(grid.context, grid.prompts)) == {96: 3, 160: 1}
    assert grid[grid.context == 160].acceptance_ci95.isna().all()  # one prompt: no interval
    # the interval is the t interval of the per-prompt rates: rebuild it from single-prompt grids
    rates = []
    for v in range(3):
        prompt = prompt_tokens(ByteTokenizer(), 80, split="heldout", variant=v)
        rates.append(speculative_acceptance(verifier, drafter, prompt, 16, 16, gamma=4).acceptance_rate)
    mean, half = mean_interval(rates)
    cell = grid[(grid.context == 96) & (grid.budget == 16)].iloc[0]
    assert cell.acceptance_rate == pytest.approx(mean) and cell.acceptance_ci95 == pytest.approx(half)
    with pytest.raises(SparsedraftError, match="no count for contexts"):
        acceptance_grid(verifier, {"trained": drafter}, ByteTokenizer(), contexts=(96, 160), budgets=(16,),
                        new_tokens=16, prompts={96: 2})


def test_t_quantiles_and_intervals():
    from sparsedraft.analysis.intervals import t_quantile
    assert [round(t_quantile(0.975, df), 3) for df in (1, 2, 4, 30)] == [12.706, 4.303, 2.776, 2.042]
    assert mean_interval([0.1, 0.2, 0.3]) == pytest.approx((0.2, 4.3027 * 0.1 / 3 ** 0.5), rel=1e-4)
