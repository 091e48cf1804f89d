"""Turning logits into a distribution, and drawing from it reproducibly.

Every decoder (autoregressive and speculative, at every level) uses
:func:`probabilities`, so the distribution a draft proposes from and the one a
verifier accepts against are processed identically -- a precondition for
lossless rejection sampling. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import require


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy; > 0: sample from softmax(logits / temperature)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p, (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    seed: int = 0  # seeds the torch.Generator a decoder creates

    def __post_init__(self) -> None:
        require(self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities [..., V] after temperature, top-k and top-p.

    Greedy gives a one-hot distribution on the argmax, so greedy verification
    is the special case of rejection sampling with deterministic proposals.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [B, V] -> tokens [B] (argmax of one-hot rows costs no random draw)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]: argmax when greedy, else a seeded draw."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, cfg), generator)
