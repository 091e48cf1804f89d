"""Reference models and hardware profiles for the back-of-envelope analyses.

The TriForce paper argues from three models (Yarn-Llama-2-7b-128k as target,
llama-68m as draft) on datacenter and consumer GPUs; our own runs use
SmolLM2-135M on whatever machine is at hand. Keeping their shapes here as
Hugging Face ``config.json`` dictionaries (copied from the model cards'
configs) lets every formula run through the same :class:`ModelConfig` the
engine uses, so a cost number and a measured number never disagree about
what a "layer" or a "KV head" is.

Hardware numbers are datasheet peaks: memory bandwidth in GB/s (1e9 bytes per
second) and dense fp16 tensor-core TFLOPs (no 2:4 sparsity). Real kernels
reach a fraction of both; :func:`this_machine` wraps a measured bandwidth so
predictions can use what the machine actually delivers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import require

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


def this_machine(measured_bandwidth_gb_s: float, name: str = "this machine",
                 fp16_tflops: float | None = None, memory_gb: float | None = None) -> Hardware:
    """A profile for the machine a notebook runs on, from a measured bandwidth in GB/s.

    ``sparsedraft.hardware.measure_copy_bandwidth`` returns bytes per second:
    pass ``measure_copy_bandwidth(device) / 1e9``.
    """
    return Hardware(name, float(measured_bandwidth_gb_s), fp16_tflops, memory_gb)
