"""The int8 form of the attention kernel (a quantised draft view's codes, a scale per key, then a float tail):
bitwise what the float kernel gives over the same values dequantised, so it keeps that kernel's contract
(rows independent of the step's length, both lane layouts alike); and an int8 retrieval view's step reads
it, with the logits its dense fallback gives."""

import pytest
import torch

from sparsedraft.caches import kv_quant
from sparsedraft.caches.kv_quant import QuantizedRetrievalCache
from sparsedraft.engine import kernels, stack
from sparsedraft.engine.cache import StaticCache
from sparsedraft.engine.model import Capture
from sparsedraft.engine.tiny import tiny_model
from sparsedraft.errors import SparsedraftError

pytestmark = pytest.mark.usefixtures("one_thread")


def _int8_inputs(kv, g, t, n, tail, d, seed=0):
    """q [1, KV, g*T, D]; codes [1, KV, N, D] as views into a longer buffer (a view's budget slots); scales
    [1, KV, N] varying by key; float tails [1, KV, tail, D] (a view's tail holds its new tokens; the kernel
    only needs N + tail >= T, and the cases include an empty tail)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kv, g * t, d, generator=gen) * 3
    codes = [torch.randint(-127, 128, (1, kv, n + 5, d), dtype=torch.int8, generator=gen)[:, :, :n] for _ in "kv"]
    scales = [(0.5 + torch.rand(1, kv, n, generator=gen) * 1.5) / 127 for _ in "kv"]  # values of about unit size
    tails = [torch.randn(1, kv, tail, d, generator=gen) for _ in "kv"]
    return q, codes, scales, tails


def _dense(codes, scale, tail):
    return torch.cat((codes.float() * scale[..., None], tail), dim=2)


@pytest.mark.parametrize("g,t,n,tail,d", [(3, 1, 256, 1, 64), (3, 1, 4096, 0, 64), (3, 5, 600, 8, 64),
                                          (3, 16, 250, 16, 64), (4, 3, 257, 3, 128), (2, 2, 70, 2, 72)])
@pytest.mark.parametrize("key_rows", [0, 64])
def test_int8_attention_is_bitwise_the_float_kernel_over_the_dequantised_values(built, g, t, n, tail, d, key_rows):
    q, (ck, cv), (sk, sv), (tk, tv) = _int8_inputs(2, g, t, n, tail, d)
    out = kernels.attend_int8(q, ck, sk, cv, sv, tk, tv, d ** -0.5, t, key_rows=key_rows)
    k, v = _dense(ck, sk, tk), _dense(cv, sv, tv)
    assert torch.equal(out, kernels.attend(q, k, v, d ** -0.5, t, key_rows=key_rows))
    torch.testing.assert_close(out, kernels.attend_reference(q, k, v, d ** -0.5, t), rtol=1e-5, atol=1e-5)


def test_int8_rows_equal_one_token_calls_bitwise(built):
    g, t, n, d = 3, 6, 300, 64
    q, (ck, cv), (sk, sv), (tk, tv) = _int8_inputs(1, g, t, n, t, d, seed=2)
    out = kernels.attend_int8(q, ck, sk, cv, sv, tk, tv, d ** -0.5, t)
    for token in range(t):
        one = kernels.attend_int8(q[:, :, token::t], ck, sk, cv, sv, tk[:, :, :token + 1], tv[:, :, :token + 1],
                                  d ** -0.5, 1)
        assert torch.equal(out[:, :, token::t], one), f"token {token} of {t} differs from its 1-token call"


def test_bf16_queries_and_tails_compute_in_float32(built):
    q, (ck, cv), (sk, sv), (tk, tv) = _int8_inputs(1, 3, 2, 300, 2, 64, seed=4)
    q, tk, tv = q.bfloat16(), tk.bfloat16(), tv.bfloat16()
    out = kernels.attend_int8(q, ck, sk, cv, sv, tk, tv, 0.125, 2)
    expected = kernels.attend_int8(q.float(), ck, sk, cv, sv, tk.float(), tv.float(), 0.125, 2).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_bad_int8_inputs_are_refused(built):
    q, (ck, cv), (sk, sv), (tk, tv) = _int8_inputs(1, 3, 2, 40, 2, 64)
    with pytest.raises(SparsedraftError, match="int8 codes of one shape"):
        kernels.attend_int8(q, ck.float(), sk, cv, sv, tk, tv, 0.125, 2)
    with pytest.raises(SparsedraftError, match="one float dtype"):
        kernels.attend_int8(q, ck, sk, cv, sv, tk.bfloat16(), tv, 0.125, 2)
    with pytest.raises(SparsedraftError, match=r"scales \[B, KV, N\]"):
        kernels.attend_int8(q, ck, sk[:, :, :10], cv, sv, tk, tv, 0.125, 2)
    with pytest.raises(SparsedraftError, match="T must be"):
        kernels.attend_int8(q, ck, sk, cv, sv, tk, tv, 0.125, 4)


@torch.inference_mode()
def test_an_int8_view_step_reads_the_codes_and_gives_its_dense_fallbacks_logits(built, monkeypatch):
    monkeypatch.setattr(stack, "_ON", False)  # layer by layer, where the calls are seen (the stack: test_layer_stack)
    target = tiny_model("llama", 0)
    cfg = target.cfg
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    full = StaticCache(cfg, 64)
    capture = Capture(layers=set(range(cfg.num_layers)))
    target(prompt, cache=full, capture=capture)
    queries = {layer: q[:, :, -1] for layer, q in capture.queries.items()}
    step = torch.tensor([[7, 8, 9]])

    def logits_and_calls():
        view = QuantizedRetrievalCache(cfg, 16, 4, spec_slots=4, draft_kv="int8")
        view.build(full, queries)
        calls = []
        real = kernels.attend_int8
        monkeypatch.setattr(kernels, "attend_int8", lambda *a, **k: calls.append(1) or real(*a, **k))
        logits = target(step, positions=torch.arange(40, 43)[None], cache=view)
        monkeypatch.setattr(kernels, "attend_int8", real)
        return logits, len(calls)

    fused, fused_calls = logits_and_calls()
    monkeypatch.setattr(kv_quant, "Int8Slots", lambda codes, scale, tail, dense: dense())  # the old dense path
    dense, dense_calls = logits_and_calls()
    assert (fused_calls, dense_calls) == (cfg.num_layers, 0)
    assert torch.equal(fused, dense)
