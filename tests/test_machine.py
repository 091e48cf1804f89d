"""The run-time path report, the per-dtype matmul peak and every step's roofline, on sample flags and a
tiny config counted by hand (never a wall-clock assertion)."""

import warnings

import pytest
import torch

from sparsedraft.engine import machine
from sparsedraft.bench.steps import step_row
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.roofline import (attention_flops, chunk_cost, kv_bytes, measure_matmul_flops, step_cost,
                                         weight_bytes)
from sparsedraft.engine.tiny import tiny_model

AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\nprocessor\t: 1\nflags\t\t: fpu avx avx2 fma\n"


@pytest.mark.parametrize("flags, best, bf16", [
    ("fpu sse avx avx2", "AVX2", False),
    ("fpu sse avx avx2 fma", "AVX2+FMA", False),
    ("avx2 fma avx512f avx512bw", "AVX-512", False),
    ("avx2 fma avx512f avx512_bf16", "AVX512-BF16", True),
    ("avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8", "AMX", True),
])
def test_best_isa_climbs_the_ladder_from_cpuinfo_flags(flags, best, bf16):
    parsed = machine.cpu_flags(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert machine.best_isa(parsed) == best and machine.native_bf16(parsed) is bf16


def test_cpu_flags_joins_every_processor_and_reads_arm_features():
    assert machine.cpu_flags(AVX2) == {"fpu", "sse", "sse2", "avx", "avx2", "fma", "bmi2"}
    arm = machine.cpu_flags("Features\t: fp asimd bf16 i8mm\n")
    assert machine.native_bf16(arm) and machine.best_isa(set()) not in ("AVX2", "AMX")


def test_report_names_cpu_kernel_and_torch_paths_and_warns_once_per_slow_cause(monkeypatch):
    avx2 = machine.cpu_flags(AVX2)
    monkeypatch.setattr(machine, "cpu_flags", lambda cpuinfo=None: avx2)
    monkeypatch.setenv("SPARSEDRAFT_KERNELS", "0")
    path = machine.report("cpu")
    assert path.cpu == "AVX2+FMA" and not path.bf16_native and path.torch == torch.backends.cpu.get_cpu_capability()
    assert path.kernels.startswith("off (SPARSEDRAFT_KERNELS=0)") and "torch path" in str(path)
    assert machine.MachineReport(**path.to_dict()) == path
    # the real load average varies (make test runs two workers): the warnings are judged on set ones
    idle = machine.MachineReport(**{**path.to_dict(), "threads": 2, "cores": 2, "load_1min": 0.0})
    with pytest.warns(RuntimeWarning, match="no bf16 instructions"):
        machine.warn_slow(idle, [torch.bfloat16], torch.device("cpu"))
    busy = machine.MachineReport(**{**idle.to_dict(), "load_1min": 7.5})
    with pytest.warns(RuntimeWarning, match="OMP_NUM_THREADS=1"):
        machine.warn_slow(busy, [torch.float32], torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        machine.warn_slow(idle, [torch.float32], torch.device("cpu"))


def test_a_half_precision_peak_is_at_least_fp32s_each_gemm_measured_once(monkeypatch):
    calls = []

    def fake(device, dtype, seconds):  # an AVX2-like machine: torch's bf16 GEMM 8x slower than fp32
        calls.append(dtype)
        return {torch.float32: 160e9, torch.bfloat16: 20e9, torch.float16: 400e9}[dtype]

    monkeypatch.setattr(machine, "measure_matmul_flops", fake)
    assert machine.peak_gflops(["bf16", "fp32", "fp16"]) == {"bf16": 160.0, "fp32": 160.0, "fp16": 400.0}
    assert calls == [torch.bfloat16, torch.float32, torch.float16]


def test_peak_gflops_per_dtype_name_and_refuses_unknown_ones():
    peaks = machine.peak_gflops(["fp32", "bf16", "fp32"], "cpu", seconds=0.01)
    assert list(peaks) == ["fp32", "bf16"] and all(v > 0 for v in peaks.values())
    assert measure_matmul_flops("cpu", n=64, repeats=2, seconds=0.01) > 0
    with pytest.raises(SparsedraftError, match="int4"):
        machine.peak_gflops(["int4"])
    with pytest.raises(SparsedraftError, match="seconds"):
        measure_matmul_flops("cpu", n=64, seconds=0)


def test_chunk_cost_counts_causal_pairs_and_one_head_row_by_hand():
    cfg = tiny_model("llama").cfg
    h, d, inner, v, layers = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    per_token = 2 * layers * (h * (2 * cfg.num_heads * d + 2 * cfg.num_kv_heads * d) + 3 * h * inner)
    cost = chunk_cost(cfg, 10, 14, 4)  # tokens 10..13: they see 11, 12, 13, 14 keys
    assert cost.tokens == 4 and cost.kv_bytes == kv_bytes(cfg, 14, 4) == 2 * layers * cfg.num_kv_heads * d * 14 * 4
    assert cost.attention_flops == 4 * layers * cfg.num_heads * d * (11 + 12 + 13 + 14)
    assert cost.weight_flops == 4 * per_token + 2 * v * h and cost.weight_bytes == weight_bytes(cfg, 4)
    with pytest.raises(SparsedraftError, match="start < stop"):
        chunk_cost(cfg, 5, 5, 4)


def test_step_row_is_the_slower_side_of_each_part_added():
    cfg = tiny_model("llama").cfg
    cost = step_cost(cfg, 100, 3, 2)
    bandwidth, peak = 1e9, 2.0  # bytes/s, GFLOP/s
    memory_ms = 1000 * (cost.weight_bytes / bandwidth), 1000 * (cost.kv_bytes / bandwidth)
    compute_ms = 1000 * (cost.weight_flops / 2e9), 1000 * (3 * attention_flops(cfg, 100) / 2e9)
    expected = max(memory_ms[0], compute_ms[0]) + max(memory_ms[1], compute_ms[1])
    row = step_row("verify-3", "bf16", 5.0, cost, bandwidth, peak)
    assert row.roofline_ms == pytest.approx(expected) and row.over_roofline == pytest.approx(5.0 / expected)
    assert (row.context, row.tokens, row.gb) == (100, 3, pytest.approx((cost.weight_bytes + cost.kv_bytes) / 1e9))
    prefill = step_row("prefill", "fp32", 9.0, [chunk_cost(cfg, 0, 8, 4), chunk_cost(cfg, 8, 9, 4)], bandwidth, peak)
    assert (prefill.context, prefill.tokens) == (9, 9)
    with pytest.raises(SparsedraftError, match="ms > 0"):
        step_row("decode", "fp32", 0.0, cost, bandwidth, peak)


def test_a_quantised_self_draft_level_is_judged_by_the_bytes_it_reads():
    from types import SimpleNamespace

    from sparsedraft.bench.steps import method_steps
    cfg = tiny_model("llama").cfg
    row = SimpleNamespace(seconds={"level2_verify": 0.2, "verify": 0.5}, verifications={"level2": 10, "target": 5},
                          drafted={"level2": 30, "target": 20})
    steps = {}
    for weights, kv in (("same", "same"), ("int8", "same"), ("w8a8", "same"), ("int8", "int8"), ("int4", "int4")):
        opts = SimpleNamespace(budget=64, draft_weights=weights, draft_kv=kv)
        rows = method_steps(cfg, "fp32", "triforce", opts, 200, row, 1e9, 2.0)
        steps[weights, kv] = next(r for r in rows if r.step.startswith("level2"))
        assert next(r for r in rows if r.step.startswith("verify")).gb == rows[0].gb  # the verifier keeps fp32
    full = step_cost(cfg, 64, 4, 4)
    assert steps["same", "same"].gb == pytest.approx((full.weight_bytes + full.kv_bytes) / 1e9)
    assert steps["int8", "same"].gb == pytest.approx((full.weight_bytes / 4 + full.kv_bytes) / 1e9)
    assert steps["w8a8", "same"].gb == steps["int8", "same"].gb  # the same codes; x's rounding reads nothing more
    assert steps["int8", "int8"].gb == pytest.approx((full.weight_bytes + full.kv_bytes * (1 + 4 / cfg.head_dim)) / 4 / 1e9)
    assert steps["int4", "int4"].gb < steps["int8", "int8"].gb


def test_mapped_blocks_sets_glibcs_threshold_where_glibc_runs():
    """The sampling loop's guard against heap growth (runtime.mapped_blocks): glibc takes the setting; elsewhere
    it says it did not, and the block runs all the same."""
    import platform

    from sparsedraft.engine.runtime import mapped_blocks
    with mapped_blocks() as taken:
        assert bytearray(2 << 20)  # a block past the threshold, allocated and freed inside
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert taken
