"""Tiny random models of every family, built in process for tests and quick runs.

Configs are Hugging Face ``config.json`` dictionaries, so the same dictionary
builds our model and the transformers oracle. Each family keeps its
distinguishing switches (GQA ratio, qkv bias, q/k norm, untied head, a RoPE
scaling) so parity tests exercise them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..errors import SparsedraftError
from .config import ModelConfig
from .model import Transformer

_BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, "model_type": "llama", "head_dim": 32, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "mistral": {**_BASE, "model_type": "mistral", "head_dim": 16, "num_attention_heads": 4,
                "num_key_value_heads": 1, "sliding_window": 4096},
    "qwen2": {**_BASE, "model_type": "qwen2", "rope_theta": 1000000.0,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
    "qwen3": {**_BASE, "model_type": "qwen3", "head_dim": 24, "attention_bias": False,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}


def tiny_hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A copy of the tiny HF-style config of ``family`` with ``overrides`` applied."""
    if family not in TINY_CONFIGS:
        raise SparsedraftError(f"no tiny config for {family!r}; choose one of {sorted(TINY_CONFIGS)}")
    cfg = copy.deepcopy(TINY_CONFIGS[family])
    cfg.update(overrides)
    return cfg


def tiny_model(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
               **overrides: Any) -> Transformer:
    """A randomly initialised tiny model (weights ~ N(0, 0.02), norms perturbed around 1)."""
    cfg = ModelConfig.from_hf(tiny_hf_config(family, **overrides))
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen) * (5 if "embed" in name else 1))
    return model.to(dtype).eval()
