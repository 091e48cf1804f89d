"""A step's whole decoder stack in one C++ call (engine/stack.py) gives the layer-by-layer path's bits.

Each test runs the same forwards with the stack on and off (stack_steps) and compares logits, cache contents and
captured features bit for bit, and checks which path ran: the stack leaves its object on the cache, the
layer-by-layer path calls kernels.layer_head from Python.
"""

import pytest
import torch
from torch import nn

from sparsedraft.caches import BudgetCache, RetrievalCache
from sparsedraft.caches.kv_quant import QuantizedRetrievalCache
from sparsedraft.engine import kernels, model as engine, stack
from sparsedraft.engine.model import Block, Capture
from sparsedraft.engine.quant import draft_copy
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.speculative.budget import budget_prefill


@pytest.fixture
def built():
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")


def _layered(monkeypatch) -> list[int]:
    """Counts the layers run from Python (each calls kernels.layer_head once)."""
    seen = []
    real = kernels.layer_head
    monkeypatch.setattr(kernels, "layer_head", lambda *a: seen.append(1) or real(*a))
    return seen


def _run(target, cache, tokens, lengths, stacked: bool, capture=None):
    """Logits of ``tokens``' first 30 as a prefill, then steps of ``lengths`` tokens (rolled back where negative)."""
    before = stack.stack_steps(stacked)
    try:
        with torch.inference_mode():
            out = [target(tokens[:, :30], cache=cache)]
            start = 30
            for n in lengths:
                if n < 0:
                    cache.rollback(-n)
                    start += n
                    continue
                out.append(target(tokens[:, start:start + n], cache=cache, capture=capture))
                if capture is not None:
                    out.append(capture.features)
                start += n
    finally:
        stack.stack_steps(before)
    return out


def _tokens(target, batch=1, n=64):
    return torch.randint(0, target.cfg.vocab_size, (batch, n), generator=torch.Generator().manual_seed(5))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


LENGTHS = (1, 3, -2, 7, 8, 1)  # 8 tokens of a batch of 2: the 16 rows the few-row kernels take


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["same", "int8", "w8a8"])
def test_the_stack_gives_the_layer_by_layer_bits(built, monkeypatch, family, dtype, weights):
    target = draft_copy(tiny_model(family, dtype=dtype), weights)
    tokens = _tokens(target, batch=2)
    seen = _layered(monkeypatch)
    cache = target.new_cache(80, batch=2)
    stacked = _run(target, cache, tokens, LENGTHS, stacked=True)
    assert seen == [] and "_layer_stacks" in cache.__dict__  # every step took the stack, the prefill not
    layered_cache = target.new_cache(80, batch=2)
    _same(stacked, _run(target, layered_cache, tokens, LENGTHS, stacked=False))
    assert len(seen) == target.cfg.num_layers * (len(LENGTHS) - 1)
    for a, b in zip(cache.k + cache.v, layered_cache.k + layered_cache.v):
        assert torch.equal(a[:, :, :cache.length], b[:, :, :cache.length])


def test_captured_features_and_lower_layers_are_the_layer_by_layer_ones(built):
    target = tiny_model("llama", num_hidden_layers=3)
    tokens = _tokens(target)
    runs = [_run(target, target.new_cache(80), tokens, (1, 4), stacked=on,
                 capture=Capture(layers=set(), hidden=True, hidden_layers=(0, 1))) for on in (True, False)]
    _same(*runs)
    assert runs[0][2].shape[-1] == 3 * target.cfg.hidden_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_retrieval_views_step_through_the_stack_over_full_precision_and_int8_slots(built, dtype):
    """TriForce's level 2: a view of full-precision slots, and one whose budget is int8 codes (attend_int8);
    an int4 view is made dense for torch's attention and keeps the layer-by-layer path."""
    target = draft_copy(tiny_model("llama", dtype=dtype), "w8a8")
    tokens = _tokens(target)
    outputs = {}
    for kind, on in [(kind, on) for kind in ("same", "int8", "int4") for on in (True, False)]:
        full = target.new_cache(48)
        capture = Capture(layers=set(range(target.cfg.num_layers)))
        with torch.inference_mode():
            target(tokens[:, :30], cache=full, capture=capture)
        queries = {layer: q[:, :, -1] for layer, q in capture.queries.items()}
        view = (RetrievalCache(target.cfg, 16, 4, spec_slots=8, dtype=dtype) if kind == "same"
                else QuantizedRetrievalCache(target.cfg, 16, 4, spec_slots=8, draft_kv=kind, dtype=dtype))
        view.build(full, queries)
        before = stack.stack_steps(on)
        try:
            with torch.inference_mode():
                outputs[kind, on] = [target(tokens[:, 30:33], cache=view), target(tokens[:, 33:34], cache=view)]
                view.rollback(2)
                outputs[kind, on].append(target(tokens[:, 35:37], cache=view))
        finally:
            stack.stack_steps(before)
        assert ("_layer_stacks" in view.__dict__) == (kind != "int4" and on)
    for kind in ("same", "int8", "int4"):
        _same(outputs[kind, True], outputs[kind, False])
    assert not torch.equal(outputs["same", True][0], outputs["int8", True][0])  # the codes were read


def test_budget_draft_steps_after_the_selection_step_through_the_stack(built, monkeypatch):
    """BudgetDraft's cache: its prefix forward keeps the layer-by-layer path (it captures the attention that
    scores the chunks), and every step after the selection is plainly causal over the kept slots, so it runs in
    one call with the layer-by-layer bits, and a 4-token step gives each row what four 1-token steps give."""
    target = tiny_model("llama")
    tokens = _tokens(target)
    layered = _layered(monkeypatch)
    outputs = {}
    for on in (True, False):
        cache = BudgetCache(target.cfg, 16, 48, 8, 16)
        before = stack.stack_steps(on)
        try:
            with torch.inference_mode():
                budget_prefill(target, cache, tokens[:, :30])
                prefix_layers = len(layered)
                outputs[on] = [target(tokens[:, 30:34], cache=cache)]
                cache.rollback(4)
                outputs[on].append(torch.cat([target(tokens[:, i:i + 1], cache=cache) for i in range(30, 34)], 1))
        finally:
            stack.stack_steps(before)
        assert prefix_layers > 0 and (len(layered) == prefix_layers) == on
        layered.clear()
    _same(outputs[True], outputs[False])
    assert torch.equal(outputs[True][0], outputs[True][1])


def test_new_weights_and_new_buffers_are_read_not_the_ones_first_seen(built):
    target = tiny_model("llama")
    tokens = _tokens(target)
    cache = target.new_cache(80)
    _run(target, cache, tokens, (1,), stacked=True)
    stacks = cache.__dict__["_layer_stacks"]
    assert len(stacks) == 1
    down = target.layers[1].mlp.down_proj
    down.weight = nn.Parameter(down.weight.detach() * 3, requires_grad=False)
    cache.reset()
    stacked = _run(target, cache, tokens, (1, 2), stacked=True)
    assert len(stacks) == 2  # a stack over the new weight beside the first
    _same(stacked, _run(target, target.new_cache(80), tokens, (1, 2), stacked=False))
    cache.reset()
    cache.k[0] = torch.zeros_like(cache.k[0])  # a cache whose buffers were swapped gets a stack over the new ones
    _same(_run(target, cache, tokens, (1, 2), stacked=True), stacked)
    assert len(stacks) == 3


def test_queries_asked_for_or_a_changed_block_keep_the_layer_by_layer_path(built, monkeypatch):
    target = tiny_model("llama")
    tokens = _tokens(target)
    seen = _layered(monkeypatch)
    cache = target.new_cache(80)
    _run(target, cache, tokens, (1,), stacked=True, capture=Capture(layers={0}, hidden=True))
    assert len(seen) == target.cfg.num_layers and "_layer_stacks" not in cache.__dict__

    class Doubled(Block):  # a subclass with its own forward: the stack would skip it
        def forward(self, x, angles, cache, capture):
            return 2 * super().forward(x, angles, cache, capture)

    target.layers[0].__class__ = Doubled
    seen.clear()
    _run(target, target.new_cache(80), tokens, (1,), stacked=True)
    assert len(seen) == target.cfg.num_layers
    assert engine._stacked_linears(target.layers[0], torch.zeros(1, 1, target.cfg.hidden_size)) is None
