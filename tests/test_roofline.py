"""Roofline: byte and FLOP formulas against real buffers, hand counts and the paper's Fig. 1; read bandwidth."""

import math

import pytest

from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.roofline import (HARDWARE, MODELS, Hardware, StepCost, attention_flops, bytes_per_token,
                                         bytes_per_token_table, crossover_context, fig1_table, flops_per_token_table,
                                         footprint_bytes, ideal_latency_ms, kv_bytes, latency_table,
                                         measure_matmul_flops, measure_read_bandwidth, parameter_count, step_cost,
                                         this_machine, verify_roofline_table, weight_bytes, weight_flops,
                                         weight_params_read)
from sparsedraft.engine.tiny import TINY_CONFIGS, tiny_model


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_parameter_count_and_kv_bytes_match_real_buffers(family):
    model = tiny_model(family)
    assert parameter_count(model.cfg) == sum(p.numel() for p in model.parameters())
    cache = model.new_cache(37)
    buffers = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert kv_bytes(model.cfg, 37, dtype_bytes=4) == buffers


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_weight_params_read_are_the_model_minus_the_embedding_lookup(family):
    model = tiny_model(family)
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    embedding = 0 if model.cfg.tie_word_embeddings else model.embed_tokens.weight.numel()
    assert weight_params_read(model.cfg) == total - embedding
    assert weight_bytes(model.cfg, 2) == 2 * (total - embedding)
    assert bytes_per_token(model.cfg, 37, 4) == weight_bytes(model.cfg, 4) + kv_bytes(model.cfg, 37, 4)


def test_read_bandwidth_is_positive_and_validated():
    assert measure_read_bandwidth("cpu", nbytes=1 << 16, repeats=2) > 0
    with pytest.raises(SparsedraftError, match="nbytes"):
        measure_read_bandwidth("cpu", nbytes=0)


def test_matmul_peak_is_positive_and_validated():
    assert measure_matmul_flops("cpu", n=64, repeats=2) > 0
    with pytest.raises(SparsedraftError, match="repeats"):
        measure_matmul_flops("cpu", n=64, repeats=0)


def test_step_cost_hand_counts():
    cfg = tiny_model("llama").cfg  # 2 layers, 4 heads, 2 KV heads (group 2), head_dim 32
    step = step_cost(cfg, context=100, tokens=3, dtype_bytes=4)
    assert step.kv_bytes == 2 * 2 * 2 * 32 * 100 * 4 == 102_400  # read once for the three queries
    assert step.attention_flops == 3 * 4 * 2 * 4 * 32 * 100 == 307_200
    assert step.attention_flops_per_byte == 2 * 3 * 2 / 4 == 3.0  # 2 * tokens * group / dtype_bytes
    assert step.weight_bytes == weight_bytes(cfg, 4) and step.weight_flops == 3 * weight_flops(cfg)
    with pytest.raises(SparsedraftError, match="tokens"):
        step_cost(cfg, 100, 0, 4)


def test_step_time_is_the_roofline_of_each_part_added():
    step = StepCost(tokens=2, context=10, weight_bytes=1000, weight_flops=500, kv_bytes=200, attention_flops=900)
    # at 1e5 bytes/s and 1e5 FLOP/s: weights max(10 ms, 5 ms) + attention max(2 ms, 9 ms) = 19 ms
    assert step.ms(bandwidth=1e5, peak_flops=1e5) == pytest.approx(19.0)
    assert step.ms(bandwidth=1e5, peak_flops=1e6) == pytest.approx(10.0 + 2.0)  # both memory bound
    with pytest.raises(SparsedraftError, match="peak_flops"):
        step.ms(1e5, 0.0)


def test_smollm2_verification_at_32k_is_compute_bound_on_a_cpu_and_free_on_an_a100():
    cfg = MODELS["smollm2-135m"]
    cpu = verify_roofline_table(cfg, [32000], tokens=9, dtype_bytes=4, bandwidth=25e9, peak_flops=100e9).iloc[0]
    assert cpu.attention_flops_per_byte == 2 * 9 * 3 / 4 == 13.5 and cpu.ridge_flops_per_byte == 4.0
    # weights: 538,060,032 bytes, 268,959,744 FLOPs per token; KV at 32000: 1,474,560,000 bytes,
    # 2,211,840,000 FLOPs per query. Decode-1 is memory bound: 21.5224 + 58.9824 ms. Verify-9 is compute bound:
    # weights 9 * 268,959,744 / 100e9 = 24.2064 ms, attention 9 * 2,211,840,000 / 100e9 = 199.0656 ms.
    assert cpu.decode1_ms == pytest.approx(21.5224024 + 58.9824)
    assert cpu.verify_ms == pytest.approx(24.20637696 + 199.0656)
    assert cpu.cost_ratio == pytest.approx(223.27197696 / 80.5048024)
    a100 = HARDWARE["a100-80gb"]
    gpu = verify_roofline_table(cfg, [32000], 9, 2, a100.bandwidth_gb_s * 1e9, a100.fp16_tflops * 1e12).iloc[0]
    assert gpu.attention_flops_per_byte == 27.0 < gpu.ridge_flops_per_byte and gpu.cost_ratio == pytest.approx(1.0)


def test_tiny_llama_hand_counts():
    cfg = tiny_model("llama").cfg  # 2 layers, hidden 64, 4 heads, 2 KV heads, head_dim 32, vocab 256, tied
    assert kv_bytes(cfg, 10, 2) == 2 * 2 * 2 * 32 * 10 * 2
    assert weight_bytes(cfg, 2) == parameter_count(cfg) * 2  # tied: the head reads the whole table
    assert footprint_bytes(cfg, 10, 2, batch=3) == parameter_count(cfg) * 2 + 3 * kv_bytes(cfg, 10, 2)
    assert attention_flops(cfg, 10) == 4 * 2 * 4 * 32 * 10
    per_layer = 64 * (2 * 4 * 32 + 2 * 2 * 32) + 3 * 64 * 128
    assert weight_flops(cfg) == 2 * (2 * per_layer + 256 * 64)


def test_untied_embedding_counts_in_the_footprint_not_in_the_reads():
    cfg = MODELS["llama-68m"]
    assert parameter_count(cfg) == 68_030_208
    assert weight_bytes(cfg, 2) == (parameter_count(cfg) - 32_000 * 768) * 2


def test_smollm2_numbers():
    cfg = MODELS["smollm2-135m"]
    assert parameter_count(cfg) == 134_515_008
    assert kv_bytes(cfg, 1, 2) == 23_040  # 2 * 30 layers * 3 KV heads * 64 * 2 bytes
    assert kv_bytes(cfg, 8192, 2) == 188_743_680
    assert crossover_context(cfg, 2) == math.ceil(269_030_016 / 23_040) == 11_677


def test_llama2_7b_128k_numbers():
    cfg = MODELS["llama2-7b-128k"]
    assert parameter_count(cfg) == 6_738_415_616
    assert kv_bytes(cfg, 131072, 2) == 64 * 2**30
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0


def test_crossover_is_the_first_context_where_kv_reaches_weights():
    for cfg in MODELS.values():
        c = crossover_context(cfg)
        table = bytes_per_token_table(cfg, [c - 1, c])
        assert table.kv_bytes[0] < table.weights_bytes[0] <= table.kv_bytes[1]


def test_crossover_falls_as_kv_heads_grow_and_share_rises_with_context():
    cfg = MODELS["smollm2-135m"]
    crossovers = [crossover_context(cfg.replace(num_kv_heads=kv)) for kv in (1, 3, 9)]
    assert crossovers == sorted(crossovers, reverse=True)
    table = bytes_per_token_table(cfg, [0, 1024, 8192, 65536])
    assert list(table.columns) == ["context", "weights_bytes", "kv_bytes", "total", "kv_share"]
    assert table.kv_share.is_monotonic_increasing and table.kv_share[0] == 0.0
    assert (table.total == table.weights_bytes + table.kv_bytes).all()


def test_flops_table_shows_decoding_is_memory_bound():
    cfg = MODELS["llama2-7b-128k"]
    table = flops_per_token_table(cfg, [0, 4096, 131072])
    assert table.attention_flops[0] == 0 and table.attention_share.is_monotonic_increasing
    assert (table.total == table.weight_flops + table.attention_flops).all()
    assert (table.flops_per_byte < 2).all()  # about one FLOP per byte at fp16, far below any GPU's ratio


def test_latency_table_is_bytes_over_bandwidth():
    cfg = MODELS["llama2-7b-128k"]
    frame = latency_table(cfg, [HARDWARE["a100-80gb"], this_machine(20.0)], [4096, 131072])
    a100 = frame[frame.hardware == "A100-80GB"]
    assert (a100.bound == "memory").all()
    assert a100.ideal_ms.iloc[0] == pytest.approx(a100.bytes.iloc[0] / 2039e6)
    assert a100.fits.tolist() == [True, False]  # 82 GB does not fit 80 GB
    host = frame[frame.hardware == "this machine"]
    assert host.compute_ms.isna().all() and host.fits.isna().all()
    assert ideal_latency_ms(2039e6, HARDWARE["a100-80gb"]) == pytest.approx(1.0)


def test_fig1_table_is_close_to_the_paper():
    frame = fig1_table().set_index("setting")
    full = frame.loc["target, full cache"]
    assert full.kv_gb * 1e9 == 64 * 2**30
    assert full.kv_gb * 1e9 / 2**30 + full.weights_gb == pytest.approx(78, abs=0.6)  # the paper's mixed units
    assert frame.loc["target, 4K retrieval cache"].total_gb == pytest.approx(16, rel=0.05)
    assert frame.loc["draft, StreamingLLM cache"].total_gb == pytest.approx(0.15, rel=0.1)
    assert (frame.ideal_ms < frame.paper_ms).all()  # ideal bounds are lower bounds
    assert frame.explanation.str.len().min() > 40


def test_hardware_validates():
    with pytest.raises(SparsedraftError, match="bandwidth_gb_s"):
        Hardware("broken", 0.0)
    with pytest.raises(SparsedraftError, match="context"):
        bytes_per_token_table(MODELS["llama-68m"], [-1])
    with pytest.raises(SparsedraftError, match="dtype_bytes"):
        crossover_context(MODELS["llama-68m"], dtype_bytes=0)


@pytest.mark.slow
def test_smollm2_profile_matches_the_loaded_model(smollm2):
    model, _ = smollm2
    cfg = MODELS["smollm2-135m"]
    loaded = model.cfg
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(cfg, name) == getattr(loaded, name), name
    assert parameter_count(loaded) == sum(p.numel() for p in model.parameters())
