"""The batch roofline: bytes and FLOPs of a step over a batch, the kernel's lanes, the self-speculation ceiling."""

from __future__ import annotations

import pytest

from sparsedraft.engine import kernels
from sparsedraft.analysis.batching import (attention_rows, batch_roofline, best_selfspec_ceiling, per_draft_acceptance,
                                           selfspec_ceiling, step_ms)
from sparsedraft.engine.roofline import kv_bytes, weight_bytes
from sparsedraft.engine.weights import load_config

CFG = load_config("tiny-llama")


def test_lanes_are_the_built_kernels_one_register_on_avx2_alone():
    if not kernels.available():
        pytest.skip("no C++ kernels here")
    assert kernels.lanes() == (8 if kernels.path().startswith("AVX2") else 16)


def test_attention_rows_round_a_group_up_to_whole_lane_blocks():
    g = CFG.group_size
    assert attention_rows(CFG, 1) == g and attention_rows(CFG, 5) == 5 * g
    assert attention_rows(CFG, 1, lanes=16) == 16 and attention_rows(CFG, 9, lanes=16) == -(-9 * g // 16) * 16


def test_steps_within_key_rows_pay_only_their_own_rows():
    """The kernel's keys-as-lanes path: a decode's g rows cost g rows, not a 16-lane block; past key_rows the
    row blocks come back."""
    g = CFG.group_size
    assert attention_rows(CFG, 1, lanes=16, key_rows=2 * g) == g
    assert attention_rows(CFG, 2, lanes=16, key_rows=2 * g) == 2 * g
    assert attention_rows(CFG, 3, lanes=16, key_rows=2 * g) == -(-3 * g // 16) * 16
    fast_memory = dict(dtype_bytes=2, bandwidth=1e30, peak_flops=1e9)
    padded = step_ms(CFG, 4096, 1, 1, lanes=64, **fast_memory)
    exact = step_ms(CFG, 4096, 1, 1, lanes=64, key_rows=g, **fast_memory)
    assert exact < padded and exact == pytest.approx(step_ms(CFG, 4096, 1, 1, **fast_memory))


def test_kv_share_grows_with_the_batch_and_weights_are_read_once():
    frame = batch_roofline(CFG, [512], [1, 2, 8], 3, 2, bandwidth=1e12, peak_flops=1e30)  # bandwidth-bound
    w, kv = weight_bytes(CFG, 2), kv_bytes(CFG, 512, 2)
    assert list(frame.kv_share) == pytest.approx([b * kv / (w + b * kv) for b in (1, 2, 8)])
    assert list(frame.decode_ms) == pytest.approx([1000 * (w + b * kv) / 1e12 for b in (1, 2, 8)])
    assert list(frame.verify_over_decode) == pytest.approx([1.0] * 3)  # memory-bound: k tokens ride on the same bytes


def test_compute_bound_verification_costs_its_rows_and_lanes_make_small_steps_free():
    fast_memory = dict(dtype_bytes=2, bandwidth=1e30, peak_flops=1e9)
    ideal = step_ms(CFG, 4096, 4, 3, **fast_memory) / step_ms(CFG, 4096, 4, 1, **fast_memory)
    assert ideal == pytest.approx(3.0)
    wide = step_ms(CFG, 4096, 4, 2, lanes=64, **fast_memory) / step_ms(CFG, 4096, 4, 1, lanes=64, **fast_memory)
    assert 1.0 < wide < ideal  # the attention rows of 1 and 2 tokens fill the same lane block


def test_selfspec_ceiling_is_accepted_tokens_over_draft_and_verify_cost():
    args = dict(dtype_bytes=2, bandwidth=1e12, peak_flops=1e30)
    ceiling = selfspec_ceiling(CFG, 2048, 4, 256, 3, 2.0, **args)
    decode, draft = step_ms(CFG, 2048, 4, 1, **args), step_ms(CFG, 256, 4, 1, **args)
    assert ceiling == pytest.approx(3 * decode / (3 * draft + decode))
    with pytest.raises(Exception, match="accepted"):
        selfspec_ceiling(CFG, 2048, 4, 256, 3, 4.0, **args)


def test_per_draft_acceptance_inverts_the_expected_accepted_drafts():
    for alpha, gamma in [(0.0, 3), (0.5, 2), (0.9, 4), (1.0, 1)]:
        fraction = sum(alpha ** i for i in range(1, gamma + 1)) / gamma
        assert per_draft_acceptance(fraction, gamma) == pytest.approx(alpha, abs=1e-9)
    assert per_draft_acceptance(0.874, 2) > 0.874  # a round stops at its first rejection
    with pytest.raises(Exception, match="fraction"):
        per_draft_acceptance(1.2, 2)


def test_best_selfspec_ceiling_takes_the_best_gamma():
    args = dict(dtype_bytes=2, bandwidth=1e12, peak_flops=1e30)  # bandwidth-bound: verification costs one decode
    best, gamma = best_selfspec_ceiling(CFG, 2048, 4, 256, 0.8, max_gamma=12, **args)
    each = [selfspec_ceiling(CFG, 2048, 4, 256, g, sum(0.8 ** i for i in range(1, g + 1)), **args)
            for g in range(1, 13)]
    assert best == pytest.approx(max(each)) and gamma == 1 + each.index(max(each))
    assert 1 < gamma < 12  # longer rounds pay until the expected extra draft is worth less than its step
    all_accepted, longest = best_selfspec_ceiling(CFG, 2048, 4, 256, 1.0, max_gamma=12, **args)
    assert longest == 12 and all_accepted > best
    # compute-bound and a draft cache as large as the full one: a k-token step costs k drafts, so the best is
    # gamma 1 at 2 tokens for 3 steps' work, even with every draft accepted
    slow_flops = dict(dtype_bytes=2, bandwidth=1e30, peak_flops=1e9)
    assert best_selfspec_ceiling(CFG, 2048, 4, 2048, 1.0, **slow_flops) == (pytest.approx(2 / 3), 1)
