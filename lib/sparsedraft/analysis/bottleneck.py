"""Observation 1 (bottleneck shift): what one generated token reads and computes.

Decoding one token at batch size 1 is memory bound: every weight matrix and
every cached key and value is read once, while the arithmetic is two FLOPs
per weight and four per cached (key, value) pair and head dimension. Weight
bytes are fixed; KV bytes grow linearly with the context. The context where
the two lines cross is where a draft model stops helping (it shrinks weight
reads only) and a sparse KV cache starts to (it shrinks KV reads) -- the
reason TriForce stacks two draft levels.

Conventions (stated once, used by every table):
- bytes are what one decode step *reads*, counted by :mod:`sparsedraft.costs`
  (the one definition benchmarks use too): all linear layers, norms and the
  output head; the embedding lookup is ignored. The memory *footprint*
  (:func:`footprint_bytes`) counts every parameter; the two differ by an
  untied embedding table.
- ``dtype_bytes`` applies to weights and KV alike (2 for fp16/bf16).
- ideal latency = bytes / bandwidth (or FLOPs / peak when that is larger):
  a lower bound that ignores kernel launches, activations and attention
  softmax traffic, which is why measured forwards are slower.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import pandas as pd

from ..config import ModelConfig
from ..costs import kv_bytes, weight_bytes, weight_params_read
from ..errors import require
from .profiles import HARDWARE, MODELS, Hardware


def _check_dtype_bytes(dtype_bytes: int) -> None:
    require(dtype_bytes > 0, f"dtype_bytes must be > 0 (2 for fp16/bf16, 4 for fp32), got {dtype_bytes}")


def parameter_count(cfg: ModelConfig) -> int:
    """All parameters: what a forward reads plus an untied embedding table."""
    return weight_params_read(cfg) + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def footprint_bytes(cfg: ModelConfig, context: int = 0, dtype_bytes: int = 2, batch: int = 1) -> int:
    """Memory held by the weights plus ``batch`` KV caches of ``context`` tokens."""
    _check_dtype_bytes(dtype_bytes)
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


def _contexts(contexts: Iterable[int]) -> list[int]:
    values = [int(c) for c in contexts]
    require(len(values) > 0 and all(c >= 0 for c in values),
            f"contexts must be a non-empty list of token counts >= 0, got {values}")
    return values


def bytes_per_token_table(cfg: ModelConfig, contexts: Iterable[int], dtype_bytes: int = 2) -> pd.DataFrame:
    """Per-token bytes read, weights vs KV: columns context, weights_bytes, kv_bytes, total, kv_share."""
    _check_dtype_bytes(dtype_bytes)
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
    _check_dtype_bytes(dtype_bytes)
    per_token = kv_bytes(cfg, 1, dtype_bytes)
    return math.ceil(weight_bytes(cfg, dtype_bytes) / per_token)


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
    _check_dtype_bytes(dtype_bytes)
    require(len(hardware) > 0, "pass at least one Hardware profile (see analysis.profiles.HARDWARE)")
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
        ideal = ideal_latency_ms(weight_bytes(cfg, dtype_bytes) + kv, hardware)
        rows.append({
            "setting": setting, "model": name, "context": context,
            "weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "total_gb": (weights + kv) / 1e9,
            "total_gib": (weights + kv) / 2**30, "paper_gb": paper_gb,
            "ideal_ms": ideal, "paper_ms": paper_ms, "ideal_over_paper": ideal / paper_ms,
            "explanation": _fig1_note(setting, kv, weights, ideal, paper_ms),
        })
    return pd.DataFrame(rows)
