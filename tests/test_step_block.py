"""A step's layers in two fused C++ calls (kernels.layer_head / layer_tail) give the Python path's bits.

model.Block takes the fused calls for a decode or verification step whose seven linear layers the few-row
kernel reads (fp32/bf16 of the step's dtype, or int8 codes) and falls back to the Python path otherwise
(q/k norms, more than 16 rows, prefill chunks, autograd). Each test runs the same forwards with the fused
calls turned off and compares logits bit for bit. The whole stack in one call (engine/stack.py), which makes
these calls from C++, is off here so the calls are seen; tests/test_layer_stack.py holds it to this path.
"""

import pytest
import torch
from torch import nn

from sparsedraft.caches.streaming import StreamingCache
from sparsedraft.engine import kernels, model as engine, stack
from sparsedraft.engine.quant import draft_copy
from sparsedraft.engine.tiny import tiny_model


@pytest.fixture
def built():
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")


@pytest.fixture(autouse=True)
def layer_by_layer():
    before = stack.stack_steps(False)
    yield
    stack.stack_steps(before)


def _count(monkeypatch) -> list[str]:
    seen = []
    for name in ("layer_head", "layer_tail"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: seen.append(_name) or _real(*a))
    return seen


def _steps(target, batch: int, lengths=(1, 3, 7, 1), cache=None) -> list[torch.Tensor]:
    """Logits of a prefill then steps of ``lengths`` tokens, the same tokens every call."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, target.cfg.vocab_size, (batch, 30 + sum(lengths)), generator=gen)
    cache = target.new_cache(64, batch=batch) if cache is None else cache
    with torch.inference_mode():
        out = [target(tokens[:, :30], cache=cache)]
        start = 30
        for n in lengths:
            out.append(target(tokens[:, start:start + n], cache=cache))
            start += n
    return out


def _python_path(monkeypatch):
    monkeypatch.setattr(engine, "_step_linears", lambda *a: None)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["same", "int8", "w8a8"])
def test_fused_layers_give_the_python_paths_bits(built, monkeypatch, family, dtype, weights):
    target = tiny_model(family, dtype=dtype)
    target = draft_copy(target, weights)
    seen = _count(monkeypatch)
    fused = _steps(target, batch=2)
    layers = target.cfg.num_layers
    assert seen.count("layer_head") == seen.count("layer_tail") == 4 * layers  # every step, never the prefill
    monkeypatch.undo()
    _python_path(monkeypatch)
    for a, b in zip(fused, _steps(target, batch=2)):
        assert torch.equal(a, b)


def test_q_k_norms_and_wide_batches_keep_the_python_path(built, monkeypatch):
    seen = _count(monkeypatch)
    _steps(tiny_model("qwen3"), batch=1)  # q/k norms sit between the projections and RoPE
    _steps(tiny_model("llama"), batch=6, lengths=(3,))  # 18 rows: more than one kernel call per linear layer
    assert seen == []


def test_keys_kept_before_rope_are_handed_unrotated(built, monkeypatch):
    target = tiny_model("llama")
    cache = lambda: StreamingCache(target.cfg, 4, 40, 8, rotary=target.rotary, positions="cache")  # noqa: E731
    seen = _count(monkeypatch)
    fused = _steps(target, batch=1, cache=cache())
    assert seen
    monkeypatch.undo()
    _python_path(monkeypatch)
    for a, b in zip(fused, _steps(target, batch=1, cache=cache())):
        assert torch.equal(a, b)


def test_new_weights_are_read_not_the_ones_first_seen(built, monkeypatch):
    """The fused calls' tensors are kept per block while its layers hold the same weight tensors; a layer given
    a new weight is read anew."""
    target = tiny_model("llama")
    _steps(target, batch=1)
    down = target.layers[0].mlp.down_proj
    down.weight = nn.Parameter(down.weight.detach() * 3, requires_grad=False)
    fused = _steps(target, batch=1)
    _python_path(monkeypatch)
    for a, b in zip(fused, _steps(target, batch=1)):
        assert torch.equal(a, b)
