"""BudgetCache: the chunks it keeps, exact rollback, the full-budget limit, misuse."""

import pytest
import torch

from sparsedraft.speculative.budget import budget_prefill
from sparsedraft.caches import BudgetCache
from sparsedraft.caches.budget import observation_window, top_chunks
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.model import Capture
from sparsedraft.engine.tiny import tiny_model

CHUNK, WINDOW = 8, 16


def naive_choice(attention, start, stop, keep):
    """Per batch row: the `keep` best complete chunks by attention of queries [start, stop), by plain loops."""
    chosen = []
    for row in attention:  # [H, T, S]
        scores = []
        for c in range(stop // CHUNK):
            total = float(row[:, start:stop, c * CHUNK:(c + 1) * CHUNK].double().sum())
            scores.append((-total, c))
        chosen.append(sorted(c for _, c in sorted(scores)[:keep]))
    return chosen


def test_top_chunks_prefers_high_scores_then_earlier_chunks():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    assert top_chunks(scores, 2).tolist() == [[False, True, True, False, False]]
    assert top_chunks(scores, 9).tolist() == [[True] * 5]


@pytest.mark.parametrize("prompt_len", [77, 80])
def test_selection_matches_naive_reference(prompt_len):
    model = tiny_model("llama")  # GQA: 4 query heads over 2 KV heads
    tokens = torch.randint(0, 256, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    budget = 24
    cache = BudgetCache(model.cfg, budget, prompt_len + 8, CHUNK, WINDOW, batch=2)
    budget_prefill(model, cache, tokens)
    capture = Capture(layers={0, 1}, weights=True)
    full = model.new_cache(prompt_len, batch=2)
    with torch.no_grad():
        model(tokens, cache=full, capture=capture)
    start, stop = observation_window(prompt_len, CHUNK, WINDOW)
    for layer in (0, 1):
        expected = naive_choice(capture.attention[layer], start, stop, budget // CHUNK)
        assert cache.chosen[layer].tolist() == expected
        kept = [[p for c in row for p in range(c * CHUNK, (c + 1) * CHUNK)] + list(range(stop, prompt_len))
                for row in expected]
        for b in range(2):
            torch.testing.assert_close(cache.k[layer][b, :, :cache.slots], full.k[layer][b, :, kept[b]])
            torch.testing.assert_close(cache.v[layer][b, :, :cache.slots], full.v[layer][b, :, kept[b]])
    assert cache.slots == budget + prompt_len - stop and cache.length == prompt_len


def test_budget_covering_the_prompt_is_the_full_cache():
    model = tiny_model("qwen2")
    tokens = torch.randint(0, 256, (1, 60))
    cache = BudgetCache(model.cfg, 64, 80, CHUNK, WINDOW)
    full = model.new_cache(80)
    with torch.no_grad():
        ours = torch.cat([budget_prefill(model, cache, tokens[:, :50])[:, None], model(tokens[:, 50:], cache=cache)], 1)
        ref = torch.cat([prefill(model, full, tokens[:, :50])[:, None], model(tokens[:, 50:], cache=full)], 1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_rollback_after_selection_is_exact():
    model = tiny_model("llama")
    tokens = torch.randint(0, 256, (1, 70))
    draft, other = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 3))
    cache = BudgetCache(model.cfg, 16, 90, CHUNK, WINDOW)
    fresh = BudgetCache(model.cfg, 16, 90, CHUNK, WINDOW)
    with torch.no_grad():
        budget_prefill(model, cache, tokens)
        budget_prefill(model, fresh, tokens)
        model(draft, cache=cache)
        cache.rollback(3)
        after = model(other, cache=cache)
        expected = model(torch.cat((draft[:, :2], other), 1), cache=fresh)[:, 2:]
    assert torch.equal(cache.chosen[0], fresh.chosen[0])
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=0)
    with pytest.raises(SparsedraftError, match="roll back"):
        cache.rollback(6)  # 5 tokens appended since the selection


def test_bad_budgets_and_misuse_fail_clearly():
    cfg = tiny_model("llama").cfg
    with pytest.raises(SparsedraftError, match="multiple of chunk_size"):
        BudgetCache(cfg, 100, 200, chunk_size=8)
    with pytest.raises(SparsedraftError, match="multiple of chunk_size"):
        BudgetCache(cfg, 0, 200, chunk_size=8)
    with pytest.raises(SparsedraftError, match="sliding"):
        BudgetCache(tiny_model("mistral").cfg, 64, 200)
    model = tiny_model("llama")
    cache = BudgetCache(cfg, 16, 64, CHUNK, WINDOW)
    with pytest.raises(SparsedraftError, match="budget_prefill"):
        model(torch.randint(0, 256, (1, 20)), cache=cache)
    with pytest.raises(SparsedraftError, match="max_len"):
        budget_prefill(model, cache, torch.randint(0, 256, (1, 70)))
    with pytest.raises(SparsedraftError, match="every layer"):
        BudgetCache(cfg, 16, 64, CHUNK, WINDOW).select({})


def naive_key_choice(keys, last, keep):
    """One KV head: the `keep` complete chunks whose mean key has the largest dot product with `last` (chunk 0
    first whatever its score), by plain loops in float64."""
    scores = []
    for c in range(keys.shape[0] // CHUNK):
        score = float("inf") if c == 0 else float(keys[c * CHUNK:(c + 1) * CHUNK].double().mean(0) @ last.double())
        scores.append((-score, c))
    return sorted(c for _, c in sorted(scores)[:keep])


@pytest.mark.parametrize("prompt_len", [77, 80])
def test_key_scoring_keeps_per_kv_head_the_chunks_whose_mean_key_meets_the_last_key(prompt_len):
    model = tiny_model("llama")  # 2 KV heads: each chooses for itself
    tokens = torch.randint(0, 256, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    budget = 24
    cache = BudgetCache(model.cfg, budget, prompt_len + 8, CHUNK, WINDOW, batch=2, scoring="keys")
    budget_prefill(model, cache, tokens)
    full = model.new_cache(prompt_len, batch=2)
    prefill(model, full, tokens)
    stop = prompt_len // CHUNK * CHUNK
    heads_differ = False
    for layer in range(model.cfg.num_layers):
        keys = full.k[layer]
        for b in range(2):
            expected = [naive_key_choice(keys[b, h, :stop], keys[b, h, prompt_len - 1], budget // CHUNK)
                        for h in range(model.cfg.num_kv_heads)]
            assert cache.chosen[layer][b].tolist() == expected
            heads_differ |= expected[0] != expected[1]
            for h, chunks in enumerate(expected):
                kept = [p for c in chunks for p in range(c * CHUNK, (c + 1) * CHUNK)] + list(range(stop, prompt_len))
                # a full cache prefills through other attention paths than a BudgetCache: equal to rounding
                torch.testing.assert_close(cache.k[layer][b, h, :len(kept)], keys[b, h, kept], atol=1e-5, rtol=0)
                torch.testing.assert_close(cache.v[layer][b, h, :len(kept)], full.v[layer][b, h, kept], atol=1e-5,
                                           rtol=0)
    assert heads_differ  # the per-head choice is exercised, not one choice copied to both heads
    assert cache.slots == budget + prompt_len - stop


def test_the_chunk_rule_decides_what_select_takes():
    model = tiny_model("llama")
    tokens = torch.randint(0, 256, (1, 40))
    keys = BudgetCache(model.cfg, 16, 48, CHUNK, WINDOW, scoring="keys")
    keys.open_prefix()
    prefill(model, keys, tokens)
    with pytest.raises(SparsedraftError, match="selects from its own keys"):
        keys.select({layer: torch.zeros(1) for layer in range(model.cfg.num_layers)})
    by_attention = BudgetCache(model.cfg, 16, 48, CHUNK, WINDOW)
    by_attention.open_prefix()
    prefill(model, by_attention, tokens)
    with pytest.raises(SparsedraftError, match="needs the attention of every layer"):
        by_attention.select()
    with pytest.raises(SparsedraftError, match="chunk scoring must be one of"):
        BudgetCache(model.cfg, 16, 48, CHUNK, WINDOW, scoring="mean")


@pytest.mark.parametrize("scoring", ["attention", "keys"])
def test_a_forked_prefill_selects_exactly_what_a_prefill_of_its_own_would(scoring):
    from sparsedraft.speculative.budget import fill_prefix
    model = tiny_model("llama")
    tokens = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    prefix = BudgetCache(model.cfg, 16, 100, CHUNK, WINDOW, scoring=scoring)
    _, attention = fill_prefix(model, prefix, tokens)
    for budget in (16, 40, 64):
        alone = BudgetCache(model.cfg, budget, 100, CHUNK, WINDOW, scoring=scoring)
        budget_prefill(model, alone, tokens)
        forked = prefix.fork(budget)
        forked.select(attention)
        assert (forked.length, forked.slots, forked.budget) == (alone.length, alone.slots, budget)
        for layer in range(model.cfg.num_layers):
            assert torch.equal(forked.chosen[layer], alone.chosen[layer])
            assert torch.equal(forked.k[layer][:, :, :alone.slots], alone.k[layer][:, :, :alone.slots])
            assert torch.equal(forked.v[layer][:, :, :alone.slots], alone.v[layer][:, :, :alone.slots])
    assert prefix.selected_at is None and prefix.slots == 90  # the prefix itself is never selected
    with pytest.raises(SparsedraftError, match="already selected"):
        forked.fork(16)
