"""The batch roofline: bytes and FLOPs of a step over a batch, the kernel's lanes, the self-speculation ceiling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparsedraft import kernels
from sparsedraft.analysis.batching import attention_rows, batch_roofline, selfspec_ceiling, step_ms
from sparsedraft.roofline import kv_bytes, weight_bytes
from sparsedraft.weights import load_config

CFG = load_config("tiny-llama")


def test_lanes_constant_is_the_kernels():
    source = (Path(kernels.__file__).parent / "decode_attention.cpp").read_text()
    assert int(re.search(r"constexpr int64_t kLanes = (\d+);", source).group(1)) == kernels.LANES


def test_attention_rows_round_a_group_up_to_whole_lane_blocks():
    g = CFG.group_size
    assert attention_rows(CFG, 1) == g and attention_rows(CFG, 5) == 5 * g
    assert attention_rows(CFG, 1, lanes=16) == 16 and attention_rows(CFG, 9, lanes=16) == -(-9 * g // 16) * 16


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
