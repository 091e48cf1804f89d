"""Roofline of one decode step: what a token reads and computes, and how fast a machine can do it.

Decoding one token at batch size 1 is memory bound: every weight matrix and
every cached key and value is read once, while the arithmetic is two FLOPs
per weight and four per cached (key, value) pair and head dimension. So the
bytes read per token, divided by the time per token, is the bandwidth a
decoder achieves, and the measured read bandwidth of the machine is the
floor every speed figure is judged against. Weight bytes are fixed; KV bytes
grow with the context. The context where the two cross is where a draft model
stops helping (it shrinks weight reads only) and a sparse KV cache starts to
(it shrinks KV reads): TriForce's "bottleneck shift" and its reason for two
draft levels.

Conventions (one definition, used by benchmarks, cost models and notebooks):
- bytes are what one decode step *reads*: every linear layer, norm and bias,
  plus the output head once (a tied head is the embedding table, read in full
  by the head's matmul); the embedding lookup reads one row and is ignored.
  The memory *footprint* (:func:`footprint_bytes`) counts every parameter;
  the two differ by an untied embedding table.
- ``dtype_bytes`` applies to weights and KV alike (2 for fp16/bf16).
- ideal latency = bytes / bandwidth (or FLOPs / peak when that is larger):
  a lower bound that ignores kernel launches, activations and attention
  softmax traffic, which is why measured forwards are slower.
  :class:`StepCost` applies it to a k-token step part by part (weights,
  attention) against a measured peak (:func:`measure_matmul_flops`): a
  verification's attention can be compute bound on a CPU and not on a GPU.
- :data:`HARDWARE` holds datasheet peaks: bandwidth in GB/s (1e9 bytes/s) and
  dense fp16 tensor-core TFLOPs (no 2:4 sparsity). Real kernels reach a
  fraction of both; :func:`measure_read_bandwidth` and :func:`this_machine`
  give what the machine at hand delivers.
- :data:`MODELS` holds the papers' models (Yarn-Llama-2-7b-128k target,
  llama-68m draft) and our SmolLM2-135M as Hugging Face ``config.json``
  dictionaries (from the model cards), parsed by the engine's own
  :class:`ModelConfig`, so a cost and a measurement never disagree about what
  a "layer" or a "KV head" is.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import pandas as pd
import torch

from ..errors import require
from .config import ModelConfig
from .runtime import synchronize

MIB = 1 << 20
GIB = 1 << 30


# ---- bytes and FLOPs of one decode step ---------------------------------------------------------

def _check_dtype_bytes(dtype_bytes: int) -> None:
    require(dtype_bytes > 0, f"dtype_bytes must be > 0 (2 for fp16/bf16, 4 for fp32), got {dtype_bytes}")


def weight_params_read(cfg: ModelConfig) -> int:
    """Parameters a one-token forward reads (everything but the embedding lookup)."""
    h, d, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h
    if cfg.qkv_bias:
        attention += q + 2 * kv
    if cfg.o_bias:
        attention += h
    if cfg.qk_norm:
        attention += 2 * d
    mlp = 3 * h * inner + (2 * inner + h if cfg.mlp_bias else 0)
    norms = 2 * h
    head = cfg.vocab_size * h
    return cfg.num_layers * (attention + mlp + norms) + h + head


def parameter_count(cfg: ModelConfig) -> int:
    """All parameters: what a forward reads plus an untied embedding table."""
    return weight_params_read(cfg) + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Weight bytes one forward streams, at ``dtype_bytes`` per parameter."""
    _check_dtype_bytes(dtype_bytes)
    return weight_params_read(cfg) * dtype_bytes


def kv_bytes(cfg: ModelConfig, context: int, dtype_bytes: int) -> int:
    """Bytes of keys and values over ``context`` cached tokens (all layers, batch 1)."""
    require(context >= 0, f"context must be >= 0 tokens, got {context}")
    _check_dtype_bytes(dtype_bytes)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * dtype_bytes


def bytes_per_token(cfg: ModelConfig, context: int, dtype_bytes: int) -> int:
    """Bytes a one-token decode reads at ``context`` cached tokens: weights + KV cache."""
    return weight_bytes(cfg, dtype_bytes) + kv_bytes(cfg, context, dtype_bytes)


def footprint_bytes(cfg: ModelConfig, context: int = 0, dtype_bytes: int = 2, batch: int = 1) -> int:
    """Memory held by the weights plus ``batch`` KV caches of ``context`` tokens."""
    return parameter_count(cfg) * dtype_bytes + batch * kv_bytes(cfg, context, dtype_bytes)


def weight_flops(cfg: ModelConfig) -> int:
    """Matmul FLOPs per token outside attention: 2 per weight of every linear layer and the head."""
    d = cfg.head_dim
    linear = (cfg.hidden_size * (2 * cfg.num_heads * d + 2 * cfg.num_kv_heads * d)
              + 3 * cfg.hidden_size * cfg.intermediate_size)
    return 2 * (cfg.num_layers * linear + cfg.vocab_size * cfg.hidden_size)


def attention_flops(cfg: ModelConfig, context: int) -> int:
    """FLOPs of q.k and weights.v for one query over ``context`` keys, all layers and heads."""
    require(context >= 0, f"context must be >= 0 tokens, got {context}")
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


# ---- reference models ---------------------------------------------------------------------------

LLAMA2_7B_128K_HF: dict[str, Any] = {  # NousResearch/Yarn-Llama-2-7b-128k
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

LLAMA_68M_HF: dict[str, Any] = {  # JackFram/llama-68m
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 12,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 2,
}

SMOLLM2_135M_HF: dict[str, Any] = {  # HuggingFaceTB/SmolLM2-135M(-Instruct)
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}

MODELS: dict[str, ModelConfig] = {
    "llama2-7b-128k": ModelConfig.from_hf(LLAMA2_7B_128K_HF),
    "llama-68m": ModelConfig.from_hf(LLAMA_68M_HF),
    "smollm2-135m": ModelConfig.from_hf(SMOLLM2_135M_HF),
}


# ---- machines: datasheets and measured bandwidth ------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """One accelerator (or host) as the cost formulas see it."""

    name: str
    bandwidth_gb_s: float  # memory bandwidth, GB/s (1e9 bytes/s)
    fp16_tflops: float | None = None  # dense fp16 tensor peak; None when unknown (a measured host)
    memory_gb: float | None = None  # device memory capacity, GB; None when unknown

    def __post_init__(self) -> None:
        require(bool(self.name), "Hardware.name must be a non-empty string")
        require(math.isfinite(self.bandwidth_gb_s) and self.bandwidth_gb_s > 0,
                f"Hardware.bandwidth_gb_s must be a positive number of GB/s, got {self.bandwidth_gb_s}")
        for field_name in ("fp16_tflops", "memory_gb"):
            value = getattr(self, field_name)
            require(value is None or value > 0,
                    f"Hardware.{field_name} must be positive or None (unknown), got {value}")

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gb_s * 1e6

    @property
    def flops_per_ms(self) -> float | None:
        return None if self.fp16_tflops is None else self.fp16_tflops * 1e9


HARDWARE: dict[str, Hardware] = {
    "a100-80gb": Hardware("A100-80GB", 2039.0, 312.0, 80.0),  # SXM datasheet
    "rtx-4090": Hardware("RTX 4090", 1008.0, 165.2, 24.0),  # fp16 tensor with fp32 accumulate
    "l40": Hardware("L40", 864.0, 181.0, 48.0),
    "h100-sxm": Hardware("H100 SXM", 3350.0, 989.0, 80.0),
    "h200": Hardware("H200", 4800.0, 989.0, 141.0),
}


def measure_read_bandwidth(device: str | torch.device = "cpu", nbytes: int = GIB, repeats: int = 5) -> float:
    """Bytes per second of one pure read of ``nbytes`` on ``device``: the rate speed figures are judged by.

    A decode step streams weights and KV cache without writing them back, so
    the matching access pattern is a read, here a sum over an fp32 buffer.
    One untimed sum warms the kernels and page tables; the best of
    ``repeats`` timed sums is returned, each between device synchronisations
    so asynchronous GPU work is counted. Use at least 1 GiB (the default):
    smaller buffers sit partly in a CPU's last-level cache and overstate the
    rate.
    """
    require(nbytes >= 4 and repeats > 0,
            f"nbytes must be >= 4 (one fp32) and repeats > 0, got {nbytes} and {repeats}; use nbytes >= 1 GiB")
    device = torch.device(device)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buffer.sum()
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


def measure_matmul_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048,
                         repeats: int = 7, seconds: float | None = None) -> float:
    """FLOP/s of an ``n`` x ``n`` by ``n`` x ``n`` matmul on ``device``: the compute peak the roofline uses.

    The product is ``x @ W^T`` with ``W`` stored [out, in], the layout every
    linear layer multiplies in: on a CPU without bf16 instructions torch runs
    bf16 ``a @ b`` about 8x slower than ``a @ b.T`` (measured at n = 512 on
    AVX2), so the layout is part of the peak.

    A verification of k tokens turns attention from a matrix-vector product
    into a k-row matmul, and a prefill chunk is a GEMM, so the rate that bounds
    them once they stop being memory bound is what a dense matmul reaches here
    in their dtype (not a datasheet peak). On a CPU without bf16 instructions
    torch's bf16 GEMM runs several times slower than fp32, so
    :func:`sparsedraft.engine.machine.peak_gflops` takes fp32's rate for bf16
    there (widened bf16 products reach it). One untimed product warms
    the kernels; the median of ``repeats`` timed products, each between device
    synchronisations, is returned. The default ``n`` (2 * 2048**3 = 17 GFLOP)
    takes about 0.1 s per fp32 product on a 2-core CPU.

    With ``seconds``, the size is found for the machine instead: ``n`` starts
    at 256 and doubles (up to the ``n`` given) while one product takes under
    a tenth of ``seconds``, then up to ``repeats`` products are timed,
    stopping once ``seconds`` have passed (after three at least): about
    ``seconds`` per call whether the dtype runs at 1 or 1000 GFLOP/s.
    """
    require(n >= 1 and repeats >= 1, f"n must be >= 1 and repeats >= 1, got n={n}, repeats={repeats}")
    require(seconds is None or seconds > 0, f"seconds must be > 0 (or None for a fixed n), got {seconds}")
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(size, size, generator=generator, device=device).to(dtype) for _ in range(2))

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        synchronize(device)
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)
        synchronize(device)
        return time.perf_counter() - start

    size = n if seconds is None else min(n, 256)
    a, b = operands(size)
    first = timed(a, b)  # warms the kernels, and sizes the product when a time budget is given
    while seconds is not None and size < n and first < seconds / 10:
        size = min(n, 2 * size)
        a, b = operands(size)
        first = timed(a, b)
    samples: list[float] = []
    deadline = None if seconds is None else time.perf_counter() + seconds
    while len(samples) < repeats and (deadline is None or len(samples) < 3 or time.perf_counter() < deadline):
        samples.append(timed(a, b))
    return 2 * size ** 3 / statistics.median(samples)


def this_machine(measured_bandwidth_gb_s: float, name: str = "this machine",
                 fp16_tflops: float | None = None, memory_gb: float | None = None) -> Hardware:
    """A profile for the machine at hand, from a measured bandwidth in GB/s.

    :func:`measure_read_bandwidth` returns bytes per second: pass
    ``measure_read_bandwidth(device) / 1e9``.
    """
    return Hardware(name, float(measured_bandwidth_gb_s), fp16_tflops, memory_gb)


# ---- tables: per-token costs against context and hardware ---------------------------------------

def _contexts(contexts: Iterable[int]) -> list[int]:
    values = [int(c) for c in contexts]
    require(len(values) > 0 and all(c >= 0 for c in values),
            f"contexts must be a non-empty list of token counts >= 0, got {values}")
    return values


def bytes_per_token_table(cfg: ModelConfig, contexts: Iterable[int], dtype_bytes: int = 2) -> pd.DataFrame:
    """Per-token bytes read, weights vs KV: columns context, weights_bytes, kv_bytes, total, kv_share."""
    weights = weight_bytes(cfg, dtype_bytes)
    rows = []
    for context in _contexts(contexts):
        kv = kv_bytes(cfg, context, dtype_bytes)
        rows.append({"context": context, "weights_bytes": weights, "kv_bytes": kv,
                     "total": weights + kv, "kv_share": kv / (weights + kv)})
    return pd.DataFrame(rows)


def flops_per_token_table(cfg: ModelConfig, contexts: Iterable[int], dtype_bytes: int = 2) -> pd.DataFrame:
    """Per-token FLOPs, weights vs attention, and arithmetic intensity (FLOPs per byte read).

    Columns: context, weight_flops, attention_flops, total, attention_share,
    flops_per_byte. Intensity near 1 is why decoding is memory bound: GPUs
    need hundreds of FLOPs per byte to be compute bound.
    """
    weights = weight_flops(cfg)
    rows = []
    for row in bytes_per_token_table(cfg, contexts, dtype_bytes).itertuples():
        attention = attention_flops(cfg, row.context)
        rows.append({"context": row.context, "weight_flops": weights, "attention_flops": attention,
                     "total": weights + attention, "attention_share": attention / (weights + attention),
                     "flops_per_byte": (weights + attention) / row.total})
    return pd.DataFrame(rows)


def crossover_context(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Smallest context whose KV bytes per token reach the weight bytes per token."""
    return math.ceil(weight_bytes(cfg, dtype_bytes) / kv_bytes(cfg, 1, dtype_bytes))


def ideal_latency_ms(n_bytes: float, hardware: Hardware, flops: float = 0.0) -> float:
    """Lower bound on one forward: bytes over bandwidth, or FLOPs over peak if that is slower."""
    memory = n_bytes / hardware.bytes_per_ms
    peak = hardware.flops_per_ms
    return memory if peak is None else max(memory, flops / peak)


def latency_table(cfg: ModelConfig, hardware: Sequence[Hardware], contexts: Iterable[int],
                  dtype_bytes: int = 2, batch: int = 1) -> pd.DataFrame:
    """Ideal per-step latency on each hardware profile as the context grows.

    ``batch`` sequences share the weight reads but each brings its own KV
    cache and FLOPs, which is how batching moves a step toward compute bound.
    Columns: hardware, context, batch, bytes, flops, memory_ms, compute_ms,
    ideal_ms, bound ("memory" or "compute"), footprint_gb, fits.
    """
    require(batch >= 1, f"batch must be >= 1, got {batch}")
    require(len(hardware) > 0, "pass at least one Hardware profile (see roofline.HARDWARE)")
    rows = []
    for hw in hardware:
        for context in _contexts(contexts):
            n_bytes = weight_bytes(cfg, dtype_bytes) + batch * kv_bytes(cfg, context, dtype_bytes)
            flops = batch * (weight_flops(cfg) + attention_flops(cfg, context))
            memory_ms = n_bytes / hw.bytes_per_ms
            compute_ms = math.nan if hw.flops_per_ms is None else flops / hw.flops_per_ms
            footprint = footprint_bytes(cfg, context, dtype_bytes, batch) / 1e9
            rows.append({
                "hardware": hw.name, "context": context, "batch": batch, "bytes": n_bytes, "flops": flops,
                "memory_ms": memory_ms, "compute_ms": compute_ms,
                "ideal_ms": ideal_latency_ms(n_bytes, hw, flops),
                "bound": "compute" if compute_ms > memory_ms else "memory",
                "footprint_gb": footprint,
                "fits": None if hw.memory_gb is None else footprint <= hw.memory_gb,
            })
    return pd.DataFrame(rows)


# ---- a k-token step over a cache, under the roofline -------------------------------------------

@dataclass(frozen=True)
class StepCost:
    """Bytes read and FLOPs of one forward of ``tokens`` query tokens over ``context`` cached tokens.

    The weights are read once whatever ``tokens`` is; their FLOPs grow with
    it. The cache is read once too (the queries of a GQA group are folded
    into one matmul per KV head), while its FLOPs grow with ``tokens`` and
    the group size: attention's intensity is 2 * tokens * heads / kv_heads /
    dtype_bytes FLOPs per byte, so a k-token verification over a long cache
    can cross a machine's ridge point while a one-token step stays below it.
    """

    tokens: int
    context: int
    weight_bytes: int
    weight_flops: int
    kv_bytes: int
    attention_flops: int

    @property
    def attention_flops_per_byte(self) -> float:
        return self.attention_flops / self.kv_bytes if self.kv_bytes else 0.0

    def ms(self, bandwidth: float, peak_flops: float) -> float:
        """Roofline time at ``bandwidth`` bytes/s and ``peak_flops`` FLOP/s: each part (weight matmuls,
        attention) takes max(bytes / bandwidth, FLOPs / peak), and the parts add, since one runs after the
        other in a forward."""
        require(bandwidth > 0 and peak_flops > 0,
                f"bandwidth and peak_flops must be > 0 (bytes/s, FLOP/s), got {bandwidth} and {peak_flops}")
        parts = ((self.weight_bytes, self.weight_flops), (self.kv_bytes, self.attention_flops))
        return 1000 * sum(max(n_bytes / bandwidth, flops / peak_flops) for n_bytes, flops in parts)


def step_cost(cfg: ModelConfig, context: int, tokens: int, dtype_bytes: int) -> StepCost:
    """Cost of a ``tokens``-token forward over ``context`` cached tokens (each query sees ``context`` keys;
    the few new keys of the step itself are left out)."""
    require(tokens >= 1, f"tokens must be >= 1 query tokens per step, got {tokens}")
    return StepCost(tokens, context, weight_bytes(cfg, dtype_bytes), tokens * weight_flops(cfg),
                    kv_bytes(cfg, context, dtype_bytes), tokens * attention_flops(cfg, context))


def chunk_cost(cfg: ModelConfig, start: int, stop: int, dtype_bytes: int) -> StepCost:
    """Cost of a prefill chunk, prompt tokens ``start`` .. ``stop - 1`` over the ``start`` cached before them.

    Unlike a decode step its own keys are not few: query i sees ``start + i + 1``
    keys (causal), so attention FLOPs count ``start * n + n (n + 1) / 2``
    query-key pairs, and the chunk reads (and has just written) ``stop`` keys.
    The output head scores the chunk's last token only (a prefill keeps just
    the last logits).
    """
    require(0 <= start < stop, f"a chunk needs 0 <= start < stop, got start={start}, stop={stop}")
    n = stop - start
    pairs = start * n + n * (n + 1) // 2
    head = 2 * cfg.vocab_size * cfg.hidden_size
    return StepCost(n, start, weight_bytes(cfg, dtype_bytes), n * (weight_flops(cfg) - head) + head,
                    kv_bytes(cfg, stop, dtype_bytes), pairs * attention_flops(cfg, 1))


def verify_roofline_table(cfg: ModelConfig, contexts: Iterable[int], tokens: int, dtype_bytes: int,
                          bandwidth: float, peak_flops: float) -> pd.DataFrame:
    """Roofline decode-1 and verify-``tokens`` ms against context at ``bandwidth`` bytes/s and ``peak_flops``.

    Columns: context, tokens, decode1_ms, verify_ms, cost_ratio (verify /
    decode-1; the names of :class:`sparsedraft.bench.ar.VerifyRow`),
    attention_flops_per_byte (of the verification) and ridge_flops_per_byte
    (peak / bandwidth: attention above it is compute bound).
    """
    rows = []
    for context in _contexts(contexts):
        one, many = step_cost(cfg, context, 1, dtype_bytes), step_cost(cfg, context, tokens, dtype_bytes)
        decode1, verify = one.ms(bandwidth, peak_flops), many.ms(bandwidth, peak_flops)
        rows.append({"context": context, "tokens": tokens, "decode1_ms": decode1, "verify_ms": verify,
                     "cost_ratio": verify / decode1, "attention_flops_per_byte": many.attention_flops_per_byte,
                     "ridge_flops_per_byte": peak_flops / bandwidth})
    return pd.DataFrame(rows)


# The paper's Fig. 1: (setting, model, cached tokens, paper GB, paper ms per forward).
FIG1_PAPER = (
    ("target, full cache", "llama2-7b-128k", 131072, 78.0, 56.0),
    ("target, 4K retrieval cache", "llama2-7b-128k", 4096, 16.0, 14.0),
    ("draft, StreamingLLM cache", "llama-68m", 256, 0.15, 0.45),
)


def _fig1_note(setting: str, kv: int, weights: int, ideal_ms: float, paper_ms: float) -> str:
    speed = f"the ideal read time is {ideal_ms / paper_ms:.0%} of the paper's {paper_ms:g} ms"
    if setting == "target, full cache":
        return (f"78 matches {kv / 2**30:.0f} GiB of KV plus {weights / 1e9:.1f} GB of weights added across "
                f"units; in GB it is {(kv + weights) / 1e9:.1f}, in GiB {(kv + weights) / 2**30:.1f}; {speed} "
                "(a real forward reaches part of peak bandwidth)")
    if setting == "target, 4K retrieval cache":
        return (f"weights {weights / 1e9:.1f} GB dominate, 4K of KV adds {kv / 1e9:.1f} GB; {speed} "
                "(retrieval gather and kernel overheads)")
    return (f"{weights / 1e6:.0f} MB of weights and {kv / 1e6:.1f} MB of KV; {speed}: a 2-layer model is bound by "
            "kernel launch latency, not bandwidth")


def fig1_table(hardware: Hardware = HARDWARE["a100-80gb"], dtype_bytes: int = 2) -> pd.DataFrame:
    """Fig. 1's memory and latency figures recomputed from the configs, beside the paper's.

    Columns: setting, model, context, weights_gb (footprint), kv_gb, total_gb,
    total_gib, paper_gb, ideal_ms (bytes read / bandwidth), paper_ms,
    ideal_over_paper, explanation.
    """
    rows = []
    for setting, name, context, paper_gb, paper_ms in FIG1_PAPER:
        cfg = MODELS[name]
        weights, kv = parameter_count(cfg) * dtype_bytes, kv_bytes(cfg, context, dtype_bytes)
        ideal = ideal_latency_ms(bytes_per_token(cfg, context, dtype_bytes), hardware)
        rows.append({
            "setting": setting, "model": name, "context": context,
            "weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "total_gb": (weights + kv) / 1e9,
            "total_gib": (weights + kv) / 2**30, "paper_gb": paper_gb,
            "ideal_ms": ideal, "paper_ms": paper_ms, "ideal_over_paper": ideal / paper_ms,
            "explanation": _fig1_note(setting, kv, weights, ideal, paper_ms),
        })
    return pd.DataFrame(rows)
