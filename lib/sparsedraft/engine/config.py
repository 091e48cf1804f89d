"""Model configuration: one frozen dataclass for every supported family.

The engine reads only these fields, so a Hugging Face ``config.json``, a GGUF
header and the tiny test registry all reduce to the same object. Families
differ in a handful of switches (qkv bias, q/k norm, sliding window), never in
code paths chosen by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import SparsedraftError, require

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # one of FAMILIES; only used for loading and error messages
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int  # taken from the config, not hidden_size // num_heads
    max_position_embeddings: int  # longest context the model supports
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] = field(default_factory=dict)  # {} or {"rope_type": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias) add a bias to q, k, v
    o_bias: bool = False  # Llama's attention_bias also adds one to the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head before RoPE
    sliding_window: int | None = None  # Mistral: attend only to the last N positions
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        require(self.family in FAMILIES,
                f"unknown architecture {self.family!r}: supported families are {FAMILIES}; "
                "convert the checkpoint to one of them or add the family to sparsedraft.engine.config")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"config field {name} must be > 0, got {getattr(self, name)}")
        require(self.num_heads % self.num_kv_heads == 0,
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_scaling.get("rope_type", "default") if self.rope_scaling else "default"
        require(rope_type in ROPE_TYPES,
                f"unsupported RoPE scaling {rope_type!r}: supported are {ROPE_TYPES}")

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary (transformers 4 or 5 layout)."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise SparsedraftError(
                f"unknown architecture {model_type!r} (config.json model_type): supported families are "
                f"{FAMILIES}; use a checkpoint of one of them")
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        if rope_type == "default":
            rope = {}
        else:
            rope["rope_type"] = rope_type
            if rope_type in ("llama3", "yarn"):
                rope.setdefault("original_max_position_embeddings",
                                hf.get("original_max_position_embeddings", hf["max_position_embeddings"]))
        bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
        eos = hf.get("eos_token_id")
        return cls(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias and model_type != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
