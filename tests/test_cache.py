"""The static cache is exact: step-by-step decoding, chunked prefill and rollback."""

import pytest
import torch

from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.model import Capture
from sparsedraft.engine.tiny import TINY_CONFIGS, tiny_model

FAMILIES = sorted(TINY_CONFIGS)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_by_one_equals_one_forward(family):
    model = tiny_model(family)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(40, batch=2)
        steps = torch.cat([model(ids[:, i:i + 1], cache=cache) for i in range(40)], 1)
    assert (steps - full).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_verify_block(family):
    model = tiny_model(family)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 50))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(64)
        parts = [model(ids[:, s:s + 16], cache=cache) for s in range(0, 48, 16)]
        parts.append(model(ids[:, 48:], cache=cache))  # a 2-token block like a small verification
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("capture_last", [1, 7, 50])  # inside the last chunk, across two chunks, everything
def test_prefill_returns_last_logits_and_the_last_tokens_queries(capture_last):
    model = tiny_model("qwen2")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 23))
    layers = set(range(model.cfg.num_layers))
    with torch.no_grad():
        whole = Capture(layers=layers)
        want = model(ids, capture=whole)[:, -1]
        capture = Capture(layers=layers)
        got = prefill(model, model.new_cache(23), ids, 5, capture=capture, capture_last=capture_last)
    torch.testing.assert_close(got, want)
    for layer in layers:
        torch.testing.assert_close(capture.queries[layer], whole.queries[layer][:, :, -min(capture_last, 23):])
    with pytest.raises(SparsedraftError, match="chunk must be >= 1"):
        prefill(model, model.new_cache(23), ids, 0)
    with pytest.raises(SparsedraftError, match="never attention weights"):
        prefill(model, model.new_cache(23), ids, capture=Capture(layers=layers, weights=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_then_redecode_is_identical(family):
    model = tiny_model(family)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 20))
    draft = torch.randint(0, model.cfg.vocab_size, (1, 6))
    with torch.no_grad():
        cache = model.new_cache(40)
        model(prompt, cache=cache)
        first = model(draft, cache=cache)
        cache.rollback(6)
        assert cache.length == 20
        second = model(draft, cache=cache)
        cache.rollback(4)  # keep 2 of the 6, then continue with other tokens
        other = torch.randint(0, model.cfg.vocab_size, (1, 3))
        after = model(other, cache=cache)
        reference = model(torch.cat([prompt, draft[:, :2], other], 1))[:, -3:]
    assert torch.equal(first, second)
    assert (after - reference).abs().max() <= 1e-5


def test_bf16_cache_runs_and_tracks_fp32():
    model = tiny_model("qwen3")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 24))
    with torch.no_grad():
        ref = model(ids)
        low = model.to(torch.bfloat16)
        cache = low.new_cache(24)
        got = low(ids, cache=cache)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_captured_weights_and_queries_match_the_fused_path():
    model = tiny_model("llama")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 30))
    with torch.no_grad():
        plain = model(ids)
        cap = Capture(layers={0, 1}, weights=True)
        recorded = model(ids, capture=cap)
    assert (plain - recorded).abs().max() <= 1e-5
    w = cap.attention[1]
    assert w.shape == (1, model.cfg.num_heads, 30, 30)
    assert torch.allclose(w.sum(-1), torch.ones(1, model.cfg.num_heads, 30))
    assert torch.all(w.triu(1) == 0)  # causal
    assert cap.queries[0].shape == (1, model.cfg.num_heads, 30, model.cfg.head_dim)


def test_training_forward_backpropagates_without_a_cache():
    model = tiny_model("qwen2").train()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_cache_says_how_many_layers_it_holds():
    """What a drafter checks a model's depth against: one buffer per layer, or none for a view of any depth."""
    from sparsedraft.caches import StreamingCache
    from sparsedraft.engine.cache import SequenceView

    model = tiny_model("llama")
    assert model.new_cache(8).num_layers == model.cfg.num_layers
    assert StreamingCache(model.cfg.replace(num_layers=2), 4, 4, spec_slots=2).num_layers == 2
    assert SequenceView(None).num_layers is None
