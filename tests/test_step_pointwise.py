"""The C++ row-wise step operations (RMSNorm, rotary embedding) against the torch forms they
stand in for, their bitwise row independence, and the rule that sends a forward to them (steps of at
most 16 tokens, never prefill chunks or training)."""

import pytest
import torch

from sparsedraft import load_model
from sparsedraft.engine import kernels, stack
from sparsedraft.engine import model as engine
from sparsedraft.engine.config import ModelConfig
from sparsedraft.engine.rope import Rotary

TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 70, 576])
def test_rms_norm_matches_torch_and_rows_are_independent(built, dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(2, 7, dim, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(dim, generator=gen) / 4).to(dtype)
    out = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out.float(), engine.rms_norm(x, weight, 1e-5).float(), **TOLERANCE[dtype])
    alone = torch.stack([torch.cat([kernels.rms_norm(x[b, t:t + 1], weight, 1e-5) for t in range(7)])
                         for b in range(2)])
    assert torch.equal(out, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_angles_apply_and_rows_are_independent(built, dtype):
    cfg = ModelConfig(family="llama", vocab_size=32, hidden_size=96, intermediate_size=64, num_layers=1, num_heads=3,
                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, max_position_embeddings=4096,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    positions = torch.tensor([[5, 6, 7, 900], [0, 1, 2, 3]])
    angles = Rotary(cfg).angles(positions, dtype)
    x = torch.randn(2, 4, 3, 32, generator=torch.Generator().manual_seed(3)).to(dtype)  # [B, T, H, D]
    out = kernels.rope(x, *angles.rows())
    expected = angles.apply(x.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    cos, sin = angles.rows()
    alone = torch.cat([kernels.rope(x[:, t:t + 1].contiguous(), cos[:, t:t + 1].contiguous(),
                                    sin[:, t:t + 1].contiguous()) for t in range(4)], 1)
    assert torch.equal(out, alone)


def test_bad_inputs_are_refused(built):
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight \\[64\\]"):
        kernels.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(torch.randn(64, 4).t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="one row of D"):
        kernels.rope(torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8))


def _calls(monkeypatch):
    """The step kernels each call runs, in order: a layer's two fused calls count as the norms and rotations
    they run (layer_head: a norm and RoPE; layer_tail: a norm)."""
    seen = []
    runs = {"rms_norm": ["rms_norm"], "rope": ["rope"], "layer_head": ["rms_norm", "rope"], "layer_tail": ["rms_norm"]}
    for name, ran in runs.items():
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _ran=ran: seen.extend(_ran) or _real(*a))
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_steps_take_the_kernels_and_agree_with_the_torch_forms(built, family, monkeypatch):
    monkeypatch.setattr(stack, "_ON", False)  # layer by layer, where the step kernels' calls are seen
    model = load_model(f"tiny-{family}")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        cache = model.new_cache(64, batch=2)
        model(tokens[:, :33], cache=cache)
        seen = _calls(monkeypatch)
        step = model(tokens[:, 33:], cache=cache)  # 7 tokens: a verification
        assert {"rms_norm", "rope"} <= set(seen)
        cache.rollback(7)
        monkeypatch.setattr(engine, "is_step", lambda x: False)
        torch_step = model(tokens[:, 33:], cache=cache)
    torch.testing.assert_close(step, torch_step, atol=1e-4, rtol=1e-4)


def test_prefill_chunks_and_training_keep_torch(built, monkeypatch):
    model = load_model("tiny-llama")
    seen = _calls(monkeypatch)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 40))
    with torch.inference_mode():
        model(tokens, cache=model.new_cache(64))  # one 40-token chunk
    assert seen == []
    model(tokens[:, :5]).sum().backward()  # autograd: torch's ops, which it can differentiate
    assert seen == [] and model.layers[0].input_layernorm.weight.grad is not None



def test_a_forward_without_autograd_asks_whether_it_is_a_step_once(built, monkeypatch):
    """run_layers asks kernels.step_fits once for all of its layers (each ask read the environment, ~3% of a
    draft step); with autograd on, every call asks again, so trainable layers still take torch."""
    monkeypatch.setattr(stack, "_ON", False)  # layer by layer, where the step kernels' calls are seen
    model = load_model("tiny-llama")
    asked = []
    real = kernels.step_fits
    monkeypatch.setattr(kernels, "step_fits", lambda x: asked.append(1) or real(x))
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = model.new_cache(32)
        model(tokens[:, :17], cache=cache)
        asked.clear()
        seen = _calls(monkeypatch)
        model(tokens[:, 17:], cache=cache)  # a 3-token step through every layer
    assert {"rms_norm", "rope"} <= set(seen)
    assert len(asked) <= 3, f"{len(asked)} asks for one step"  # run_layers, then the final norm and the head
    asked.clear()
    model(tokens[:, 17:])  # autograd on: each norm, matmul and attention call asks
    assert len(asked) > 3 * model.cfg.num_layers
