"""Rotary position embeddings with the scalings long-context checkpoints use.

Positions are always explicit: a cache may ask for queries and keys rotated at
true positions or at positions inside a compacted cache (StreamingLLM), so the
rotation is a small object the model hands to the cache, not a buffer indexed
by step. Frequencies follow the "rotate half" layout of Hugging Face weights;
GGUF checkpoints are permuted to that layout when loaded.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] fp32, attention scale applied to cos/sin)."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # fp32 like the checkpoints
    inv_freq = 1.0 / (base ** exponents)
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", "default")
    attention_scale = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, attention_scale = _yarn(inv_freq, dim, base, scaling, cfg.max_position_embeddings)
    return inv_freq.float(), attention_scale


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    original = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(medium, blended, out)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    # YaRN: extrapolate high frequencies, interpolate low ones, linear ramp between,
    # and scale attention logits through cos/sin by `attention_factor`.
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where we extrapolate (keep the original frequency)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


class Rotary(torch.nn.Module):
    """Produces :class:`Angles` for explicit positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_scale = inverse_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> "Angles":
        """positions: [B, T] int -> Angles with cos/sin [B, 1, T, head_dim]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        scale = self.attention_scale
        return Angles((emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype))


class Angles:
    """cos/sin for a set of positions; ``apply(x)`` rotates [B, H, T, D] tensors."""

    __slots__ = ("cos", "sin", "_rows")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [B, T, head_dim] contiguous: one row per position, what ``kernels.rope`` takes."""
        if self._rows is None:  # asked by every layer of a forward
            self._rows = self.cos[:, 0].contiguous(), self.sin[:, 0].contiguous()
        return self._rows

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rotated * self.sin
