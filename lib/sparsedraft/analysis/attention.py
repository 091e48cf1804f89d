"""Exact attention rows of chosen queries, recomputed from one prefill.

Asking the model for attention weights (``Capture(weights=True)``) would
materialise [heads, T, T] per layer, 2.4 GB per layer at 8K in fp32. We only
need a few query rows, so one chunked prefill records the post-RoPE queries
of the chosen layers and leaves the post-RoPE keys in a :class:`StaticCache`;
afterwards each layer's rows are a cheap ``q @ k.T`` for the queries we ask
about, block by block. Memory stays near the KV cache plus the queries of the
chosen layers (about 0.6 GB for all 30 SmolLM2 layers at 8K in fp32).

Grouped-query attention: query head ``h`` reads KV head ``h // group``; the
queries of a group are folded into one matmul, as in the model.
Positions are cache slots: the prompt runs from position 0 with no sliding
window, so key ``j`` sits at position ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ..errors import require
from ..generate import PREFILL_CHUNK, prefill
from ..model import Capture, Transformer


@dataclass(frozen=True)
class LayerQK:
    """Queries and keys of one layer for a single sequence."""

    layer: int
    queries: torch.Tensor  # [H, T, D] post-RoPE
    keys: torch.Tensor  # [KV, T, D] post-RoPE
    scale: float  # softmax scale, head_dim ** -0.5 in the model

    def __post_init__(self) -> None:
        h, t, d = self.queries.shape
        kv, tk, dk = self.keys.shape
        require(t == tk and d == dk, f"queries {tuple(self.queries.shape)} and keys {tuple(self.keys.shape)} "
                                     "must share length and head_dim")
        require(h % kv == 0, f"query heads ({h}) must be a multiple of KV heads ({kv})")

    @property
    def heads(self) -> int:
        return self.queries.shape[0]

    @property
    def group(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def grouped_queries(self, positions: torch.Tensor) -> torch.Tensor:
        """Queries at ``positions`` [m] folded by KV head: [KV, group * m, D] (float32)."""
        q = self.queries[:, positions].float()
        return q.reshape(self.keys.shape[0], self.group * positions.numel(), q.shape[-1])

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Softmax attention of the queries at ``positions`` [m] over keys at or before them: [H, m, T]."""
        m = positions.numel()
        scores = (self.grouped_queries(positions) @ self.keys.float().transpose(-1, -2)) * self.scale
        scores = scores.reshape(self.heads, m, self.length)
        keys = torch.arange(self.length, device=scores.device)
        scores = scores.masked_fill(keys[None, None, :] > positions[None, :, None], float("-inf"))
        return scores.softmax(-1)

    def cumulative(self, positions: torch.Tensor, block: int) -> torch.Tensor:
        """Attention each key received from all queries before each position (H2O's score): [H, m, T].

        Costs a full causal pass over queries ``0 .. max(positions) - 1`` in
        blocks of ``block`` rows.
        """
        out = torch.zeros(self.heads, positions.numel(), self.length, device=self.keys.device)
        total = torch.zeros(self.heads, self.length, device=self.keys.device)
        end = int(positions.max()) if positions.numel() else 0
        for start in range(0, end + 1, block):
            stop = min(start + block, end + 1)
            rows = self.rows(torch.arange(start, stop, device=self.keys.device))
            before = rows.cumsum(1) - rows + total[:, None]  # received from queries < each row's position
            inside = (positions >= start) & (positions < stop)
            if inside.any():
                out[:, inside] = before[:, positions[inside] - start]
            total += rows.sum(1)
        return out


def as_sequence(prompt: torch.Tensor) -> torch.Tensor:
    """Accept [T] or [1, T] token ids and return [1, T]."""
    prompt = prompt[None] if prompt.dim() == 1 else prompt
    require(prompt.dim() == 2 and prompt.shape[0] == 1 and prompt.shape[1] > 0,
            f"the analyses take one sequence of token ids, [T] or [1, T]; got shape {tuple(prompt.shape)}")
    return prompt


def check_positions(positions: Iterable[int] | torch.Tensor, length: int) -> torch.Tensor:
    """Sorted unique query positions as a long tensor, each inside [0, length)."""
    values = sorted({int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)})
    require(len(values) > 0, "give at least one query position")
    require(values[0] >= 0 and values[-1] < length,
            f"query positions must lie in [0, {length}) (the prompt length); got {values[0]}..{values[-1]}")
    return torch.tensor(values, dtype=torch.long)


def check_layers(model: Transformer, layers: Iterable[int] | None) -> list[int]:
    n = model.cfg.num_layers
    chosen = list(range(n)) if layers is None else sorted({int(layer) for layer in layers})
    require(len(chosen) > 0 and all(0 <= layer < n for layer in chosen),
            f"layers must be indices in [0, {n}) for this {n}-layer model; got {chosen}")
    return chosen


@torch.inference_mode()
def layer_qk(model: Transformer, prompt: torch.Tensor, layers: Iterable[int] | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> Iterator[LayerQK]:
    """Prefill ``prompt`` once and yield each chosen layer's queries and keys (float32 on the model's device)."""
    prompt = as_sequence(prompt).to(model.device)
    length = prompt.shape[1]
    chosen = check_layers(model, layers)
    window = model.cfg.sliding_window
    require(window is None or length <= window,
            f"prompt of {length} tokens exceeds the sliding window ({window}); the analyses assume every query "
            "sees all earlier keys, so use a prompt of at most the window")
    cache = model.new_cache(length)
    capture = Capture(layers=set(chosen))
    prefill(model, cache, prompt, prefill_chunk, capture=capture, capture_last=length)
    scale = model.cfg.head_dim ** -0.5
    for layer in chosen:
        yield LayerQK(layer, capture.queries.pop(layer)[0], cache.keys(layer)[0].float(), scale)
