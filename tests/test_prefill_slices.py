"""A bf16 prefill chunk's causal attention through the kernel in slices (:func:`sparsedraft.engine.model.attend_slices`).

Each slice is one kernel call, and the kernel gives a row the same bits whatever
the call's length, so every prompt token's attention must equal, bit for bit, a
one-token call over the keys it sees; it must also match attention with the
causal mask written out. The route is taken exactly where bf16 attention runs
on AVX512-BF16 dot products and :func:`prefill_slices` allows it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsedraft.engine import kernels
from sparsedraft.engine import model as engine_model
from sparsedraft.engine.cache import causal_tail
from sparsedraft.engine.model import _slices_fit, attend_slices, prefill_slices, sliced_prefill
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.tiny import tiny_model


@pytest.fixture
def built():
    if not kernels.available():
        pytest.skip(f"no C++ kernels here: {kernels.path()}")


def qkv(t: int, s: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(t * s)
    return (torch.randn(1, heads, n, 64, generator=g).to(dtype) for heads, n in ((6, t), (2, s), (2, s)))


@pytest.mark.parametrize("t,s", [(70, 70), (70, 100), (kernels.MAX_TOKENS, 40)])
def test_each_row_is_its_one_token_call_and_the_masked_attention(built, t, s):
    q, k, v = qkv(t, s)
    out = attend_slices(q, k, v, 0.125)
    for j in range(t):  # token j sees keys 0 .. s - t + j
        seen = s - t + j + 1
        alone = kernels.attend(q[:, :, j:j + 1].reshape(1, 2, 3, 64), k[:, :, :seen], v[:, :, :seen], 0.125, 1)
        assert torch.equal(out[:, :, j], alone.reshape(1, 6, 64)), j
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal_tail(t, s),
                                          enable_gqa=True, scale=0.125)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_the_route_is_taken_exactly_where_bf16_attention_runs_on_dot_products(built):
    q, k, v = qkv(64, 64)
    hardware = kernels.on_dots()
    assert _slices_fit(q, k, v) == hardware
    assert not _slices_fit(*qkv(64, 64, torch.float32))  # fp32: torch's flash kernel is as fast
    before = prefill_slices(False)
    try:
        assert not _slices_fit(q, k, v)
    finally:
        prefill_slices(before)
    strided = torch.randn(1, 2, 64, 128).bfloat16()[..., :64]  # rows of head_dim values 128 apart
    assert not _slices_fit(q, strided, strided)
    cpu = torch.device("cpu")
    assert kernels.on_dots(64) == kernels.on_dots() and sliced_prefill(torch.bfloat16, cpu, 64) == hardware
    assert not kernels.on_dots(48) and not sliced_prefill(torch.bfloat16, cpu, 48)  # the kernel's rule: 32 | D


def test_a_bf16_prefill_runs_its_chunks_through_the_slices_where_it_can(built, monkeypatch):
    model = tiny_model("llama", 0, torch.bfloat16, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(engine_model, "attend_slices", lambda *a: calls.append(a[0].shape[2]) or attend_slices(*a))
    logits = {}
    for on in (True, False):
        before = prefill_slices(on)
        try:
            logits[on] = prefill(model, model.new_cache(150), tokens, chunk=64).float()
        finally:
            prefill_slices(before)
    hardware = kernels.on_dots()
    assert calls == ([64] * 4 + [21] * 2 if hardware else []), calls  # 149 tokens: chunks 64, 64, 21 in 2 layers
    torch.testing.assert_close(logits[True], logits[False], rtol=0.05, atol=0.05)


def test_a_prefill_names_its_sliced_attention_so_a_flash_one_is_not_taken_for_it(built):
    from sparsedraft.engine.prefilled import compute_prefill, model_identity
    from sparsedraft.errors import SparsedraftError
    shape = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32)
    model = tiny_model("llama", 0, torch.bfloat16, **shape)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    assert ("prefill_attention" in model_identity(model)) == kernels.on_dots()
    assert "prefill_attention" not in model_identity(tiny_model("llama", 0, **shape))  # fp32 keeps flash
    before = prefill_slices(False)
    try:
        flash = compute_prefill(model, tokens)
    finally:
        prefill_slices(before)
    if kernels.on_dots():
        with pytest.raises(SparsedraftError, match="prefill_attention"):
            flash.check(model, tokens)
    else:
        flash.check(model, tokens)
