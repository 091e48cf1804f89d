"""Bytes read per decoded token: the one cost model every benchmark and notebook uses.

Decoding one token is memory bound: each forward streams every weight matrix
and the whole KV cache once, while the arithmetic is tiny. So the bytes read
per token, divided by the measured time per token, is the bandwidth a decoder
achieves, and the split between weight bytes and KV bytes is TriForce's
"bottleneck shift" (weights dominate at short context, the cache at long).

Counted: every linear layer, norm and bias, plus the output head once (a tied
head is the embedding table, read in full by the head's matmul). The
embedding lookup reads one row per token and is ignored.
"""

from __future__ import annotations

from .config import ModelConfig
from .errors import require


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


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Weight bytes one forward streams, at ``dtype_bytes`` per parameter."""
    return weight_params_read(cfg) * dtype_bytes


def kv_bytes(cfg: ModelConfig, context: int, dtype_bytes: int) -> int:
    """Bytes of keys and values over ``context`` cached tokens (all layers, batch 1)."""
    require(context >= 0, f"context must be >= 0, got {context}")
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * dtype_bytes


def bytes_per_token(cfg: ModelConfig, context: int, dtype_bytes: int) -> int:
    """Bytes a one-token decode reads at ``context`` cached tokens: weights + KV cache."""
    return weight_bytes(cfg, dtype_bytes) + kv_bytes(cfg, context, dtype_bytes)
