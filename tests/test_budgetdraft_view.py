"""The training view is the drafting view: the same chunks, and the same logits at every drafted position."""

import pytest
import torch

from sparsedraft.speculative.budget import budget_prefill
from sparsedraft.budgetdraft.loss import full_forward, sparse_forward
from sparsedraft.budgetdraft.view import kept_prefix
from sparsedraft.caches import BudgetCache
from sparsedraft.engine.tiny import tiny_model

CHUNK, WINDOW, BUDGET = 8, 16, 24
PREFIX = 70  # chunks 0..7 compete; the partial chunk 64..69 is always kept
DRAFTED = 3 * CHUNK + 5  # past three chunk boundaries: the selection stays, the tail grows


def drafted_logits(model, tokens, prefix, budget):
    """The BudgetCache's logits, one drafted token at a time after the drafter's prefill; and the cache."""
    cache = BudgetCache(model.cfg, budget, tokens.shape[1], CHUNK, WINDOW, batch=tokens.shape[0])
    with torch.no_grad():
        budget_prefill(model, cache, tokens[:, :prefix])
        steps = [model(tokens[:, t:t + 1], cache=cache) for t in range(prefix, tokens.shape[1])]
    return torch.cat(steps, 1), cache


def view_logits(model, tokens, prefix, budget):
    with torch.no_grad():
        return sparse_forward(model, tokens, full_forward(model, tokens), prefix, budget, CHUNK, WINDOW)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_view_logits_equal_drafting_logits_over_several_chunks(family):
    model = tiny_model(family, num_hidden_layers=3)
    tokens = torch.randint(0, 256, (2, PREFIX + DRAFTED), generator=torch.Generator().manual_seed(1))
    drafted, cache = drafted_logits(model, tokens, PREFIX, BUDGET)
    torch.testing.assert_close(view_logits(model, tokens, PREFIX, BUDGET), drafted, atol=1e-5, rtol=0)
    with torch.no_grad():
        full = full_forward(model, tokens)
    kept = kept_prefix(model, full.queries, full.view.keys, PREFIX, BUDGET, CHUNK, WINDOW)
    for layer in range(3):
        chunks = kept[layer][:, :PREFIX // CHUNK * CHUNK:CHUNK]
        assert [row.nonzero()[:, 0].tolist() for row in chunks] == cache.chosen[layer].tolist()
        assert kept[layer][:, PREFIX // CHUNK * CHUNK:].all()  # the partial chunk


def test_view_does_not_reselect_at_later_chunk_boundaries():
    """Re-selecting at the continuation's chunk boundaries (the old training view) picks other chunks here,
    so the drafting logits after those boundaries would differ; the view keeps the prefix's choice."""
    model = tiny_model("llama", num_hidden_layers=2)
    tokens = torch.randint(0, 256, (1, PREFIX + DRAFTED), generator=torch.Generator().manual_seed(4))
    boundary = (PREFIX // CHUNK + 2) * CHUNK  # two chunk boundaries into the continuation
    with torch.no_grad():
        full = full_forward(model, tokens)
    once = kept_prefix(model, full.queries, full.view.keys, PREFIX, BUDGET, CHUNK, WINDOW)
    again = kept_prefix(model, full.queries, full.view.keys, boundary, BUDGET, CHUNK, WINDOW)
    assert any(not torch.equal(once[layer], again[layer][:, :PREFIX]) for layer in once)  # the case is real
    drafted, _ = drafted_logits(model, tokens, PREFIX, BUDGET)
    view = view_logits(model, tokens, PREFIX, BUDGET)
    after = slice(boundary - PREFIX, None)
    torch.testing.assert_close(view[:, after], drafted[:, after], atol=1e-5, rtol=0)
    reselected = view_logits(model, tokens, boundary, BUDGET)
    assert (reselected - drafted[:, after]).abs().max() > 1e-3


def test_budget_covering_the_prefix_is_the_full_view():
    model = tiny_model("llama")
    tokens = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = full_forward(model, tokens)
        sparse = sparse_forward(model, tokens, full, 40, 40, CHUNK, WINDOW)
    torch.testing.assert_close(sparse, full.logits[:, 40:], atol=1e-5, rtol=0)


def test_key_scored_view_equals_key_scored_drafting_with_a_choice_per_kv_head():
    """The public code's rule (mean key vs last key, per KV head): the training view masks each KV head's own
    chunks and still gives the drafting logits."""
    model = tiny_model("llama", num_hidden_layers=3)
    tokens = torch.randint(0, 256, (2, PREFIX + DRAFTED), generator=torch.Generator().manual_seed(2))
    cache = BudgetCache(model.cfg, BUDGET, tokens.shape[1], CHUNK, WINDOW, batch=2, scoring="keys")
    with torch.no_grad():
        budget_prefill(model, cache, tokens[:, :PREFIX])
        drafted = torch.cat([model(tokens[:, t:t + 1], cache=cache) for t in range(PREFIX, tokens.shape[1])], 1)
        full = full_forward(model, tokens)
        view = sparse_forward(model, tokens, full, PREFIX, BUDGET, CHUNK, WINDOW, scoring="keys")
    torch.testing.assert_close(view, drafted, atol=1e-5, rtol=0)
    kept = kept_prefix(model, full.queries, full.view.keys, PREFIX, BUDGET, CHUNK, WINDOW, scoring="keys")
    stop = PREFIX // CHUNK * CHUNK
    for layer in range(3):
        assert kept[layer].shape == (2, model.cfg.num_kv_heads, PREFIX)
        chunks = kept[layer][..., :stop:CHUNK]
        assert [[head.nonzero()[:, 0].tolist() for head in row] for row in chunks] == cache.chosen[layer].tolist()
    assert any(not torch.equal(kept[layer][:, 0], kept[layer][:, 1]) for layer in range(3))  # heads differ
    other = sparse_forward(model, tokens, full, PREFIX, BUDGET, CHUNK, WINDOW)  # the attention rule
    assert not torch.allclose(other, view)  # the rule matters here, so the equality above is not vacuous


def test_a_mask_per_kv_head_reaches_every_query_head_of_its_group():
    """attention() with a [B, KV, T, S] mask: the fused path, the explicit one and a per-head loop agree."""
    from sparsedraft.engine.model import attention
    g = torch.Generator().manual_seed(5)
    b, kv, group, t, s, d = 2, 2, 3, 4, 10, 8
    q, k, v = (torch.randn(b, kv * group, t, d, generator=g), torch.randn(b, kv, s, d, generator=g),
               torch.randn(b, kv, s, d, generator=g))
    mask = torch.rand(b, kv, t, s, generator=g) > 0.4
    mask[..., -1] = True  # every query sees at least one key
    fused, _ = attention(q, k, v, mask, 0.3)
    explicit, _ = attention(q, k, v, mask, 0.3, need_weights=True)
    for head in range(kv * group):
        scores = (q[:, head] @ k[:, head // group].transpose(-1, -2)) * 0.3
        want = scores.masked_fill(~mask[:, head // group], float("-inf")).softmax(-1) @ v[:, head // group]
        torch.testing.assert_close(fused[:, head], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(explicit[:, head], want, atol=1e-5, rtol=0)
