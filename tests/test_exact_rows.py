"""Lossless in low precision: a verification forward gives each of its tokens the bits a one-token decode
step gives it, so speculative greedy output equals plain greedy output in bf16 as in fp32.

Two things make this hold on CPU: the C++ kernels (attention and the few-row linear layers) compute each
row in a fixed order whatever the step's length (:mod:`sparsedraft.engine.kernels`), and the prefill runs the last prompt token as its own one-token
forward, the token a speculative run feeds again as the first row of its first verification
(:func:`sparsedraft.engine.prefill.prefill_spans`). Without the kernel, torch's SDPA rounds a few-row step and a
one-row step differently for some cache lengths; these tests are then skipped with that reason.
"""

import os
import warnings

import pytest
import torch

from sparsedraft import decode, load_model
from sparsedraft.engine import kernels
from sparsedraft.engine.prefill import prefill, prefill_spans

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def all_threads(one_thread):
    """Undo the module's one thread for the SmolLM2 test (real matrices: both cores help)."""
    torch.set_num_threads(max(torch.get_num_threads(), os.cpu_count() or 1))


@pytest.fixture(scope="module")
def kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not kernels.available():
            pytest.skip(f"the C++ attention kernel is unavailable here ({kernels._failure}); SDPA is not row-exact")


def test_prefill_runs_the_last_token_alone():
    assert prefill_spans(1, 4) == [(0, 1)]
    assert prefill_spans(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert prefill_spans(10, 4) == [(0, 4), (4, 8), (8, 9), (9, 10)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("steps", [2, 5, 9, 16])
def test_verification_rows_equal_decode_steps_bitwise(kernel, family, steps, dtype):
    model = load_model(f"tiny-{family}", dtype=dtype)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    new = torch.randint(0, model.cfg.vocab_size, (1, steps), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        for start in (0, 7, 250):  # several cache lengths: chunk boundaries of the kernel fall differently
            cache = model.new_cache(400)
            prefill(model, cache, prompt[:, :300 - start])
            together = model(new, cache=cache)[0]
            cache.rollback(steps)
            one_by_one = torch.cat([model(new[:, i:i + 1], cache=cache)[0] for i in range(steps)])
            assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("method, options", [("spec", {"draft": "truncated:1", "gamma": 4}),
                                             ("retrieval", {"budget": 64, "gamma": 6}),
                                             ("triforce", {"budget": 64, "gamma1": 2, "gamma2": 8})])
def test_speculative_greedy_equals_plain_greedy_in_bf16(kernel, method, options):
    model = load_model("tiny-llama", dtype=torch.bfloat16)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 400), generator=torch.Generator().manual_seed(3))
    plain = decode(model, prompt, "ar", 48)
    fast = decode(model, prompt, method, 48, **options)
    assert torch.equal(fast.tokens, plain.tokens)


def test_without_the_kernel_steps_still_match_in_fp32(monkeypatch):
    """The SDPA paths (decode fold, causal prefill, additive mask for later chunks) agree with the kernel."""
    model = load_model("tiny-llama")
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(4))

    def run():
        with torch.inference_mode():
            cache = model.new_cache(320)
            logits = [prefill(model, cache, prompt, chunk=128)]
            logits.append(model(prompt[:, :5], cache=cache)[0])
            return logits

    with_kernel = run()
    monkeypatch.setattr(kernels, "available", lambda: False)
    without = run()
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gemm_batches_hands_a_batch_to_torch_and_only_inside_the_block(kernel, monkeypatch):
    """Data making (gemm_batches) skips the few-row kernel and stays close to it; outside the block a batch of
    steps is back on the kernel, 16 rows a call, each row the bits of its batch-1 step."""
    from sparsedraft.engine.model import gemm_batches
    model = load_model("tiny-llama")
    prompt = torch.randint(0, model.cfg.vocab_size, (20, 12), generator=torch.Generator().manual_seed(5))
    calls = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *args: calls.append(1) or real(*args))

    def step(batch):
        with torch.inference_mode():
            cache = model.new_cache(16, batch.shape[0])
            model(batch[:, :-1], cache=cache)
            return model(batch[:, -1:], cache=cache)[:, -1]

    with gemm_batches():
        fast = step(prompt)
    assert not calls
    exact = step(prompt)
    assert calls
    torch.testing.assert_close(fast, exact, rtol=1e-4, atol=1e-4)
    assert torch.equal(exact[3], step(prompt[3:4])[0])


@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_plain_greedy_in_bf16(kernel, smollm2, all_threads):
    """The case that used to break: SmolLM2 in bf16 at 2K, where spec left plain greedy after 20-32 tokens."""
    from sparsedraft.engine.data import bench_prompt
    model = load_model("smollm2-135m", dtype=torch.bfloat16)
    prompt = bench_prompt("smollm2-135m", 2000)
    plain = decode(model, prompt, "ar", 48)
    fast = decode(model, prompt, "spec", 48)
    assert torch.equal(fast.tokens, plain.tokens)
