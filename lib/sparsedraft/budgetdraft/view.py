"""The BudgetCache's drafting view as a differentiable training view.

A training window of T tokens is split like a drafting run: a prefix of P
tokens (the prompt) and a continuation (the drafted tokens). The prefix is
attended causally and in full, as the drafter's prefill does. Its chunks are
chosen *once*, from the observation window's attention in the full forward,
by :func:`~sparsedraft.caches.budget.choose_chunks`, the cache's own rule,
and a continuation query at position t then sees

- the chosen complete chunks of the prefix and its partial last chunk;
- every continuation token up to itself (the growing tail: nothing appended
  after the prefix is ever dropped).

That is the context the cache gives the drafter at every drafted position,
however many chunk boundaries the continuation crosses. The continuation
runs as one forward through :class:`BudgetView`, which reuses each layer's
prefix keys and values from the full forward (recorded, with their graph, by
:class:`RecordingView`) -- the prefix computation is the full one in both
views, so it is computed once and L_C's gradient still reaches it. The
selection itself is a discrete choice, made without gradient.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..caches.budget import check_budget, check_scoring, choose_chunks, choose_chunks_by_keys, observation_window
from ..engine.cache import KVCache, SequenceView, causal_mask
from ..engine.model import Transformer, attention
from ..errors import require


@torch.no_grad()
def kept_prefix(model: Transformer, queries: Mapping[int, torch.Tensor], keys: Mapping[int, torch.Tensor],
                prefix_len: int, budget: int, chunk_size: int, obs_window: int,
                scoring: str = "attention") -> dict[int, torch.Tensor]:
    """{layer: bool [B, prefix_len]} (``scoring="keys"``: [B, kv_heads, prefix_len]): the prefix keys a
    budget-``budget`` cache keeps, per layer (and per KV head).

    ``queries`` [B, H, >= P, D] and ``keys`` [B, kv_heads, >= P, D] are the
    full forward's post-RoPE tensors. Only the observation window's attention
    is needed, so it is recomputed here by the model's own attention function
    for those few rows instead of materialising [T, T] weights in the forward;
    scoring by keys reads the keys alone (the last prefix key is the proxy).
    """
    check_budget(budget, chunk_size)
    check_scoring(scoring)
    require(obs_window >= 1, f"obs_window must be >= 1 query, got {obs_window}")
    start, stop = observation_window(prefix_len, chunk_size, obs_window)
    positions = torch.arange(stop, device=model.device)
    kept = {}
    for layer, q in queries.items():
        k = keys[layer][:, :, :stop]
        if scoring == "keys":
            chunks = choose_chunks_by_keys(k, keys[layer][:, :, prefix_len - 1], budget, chunk_size)  # [B, KV, n]
        else:
            mask = causal_mask(positions[None, start:], positions[None], None).expand(q.shape[0], -1, -1, -1)
            _, weights = attention(q[:, :, start:stop], k, k, mask, model.layers[layer].self_attn.scale,
                                   need_weights=True)  # the values do not matter: only the weights are read
            chunks = choose_chunks(weights, budget, chunk_size)  # [B, stop // C]
        partial = chunks.new_ones(*chunks.shape[:-1], prefix_len - stop)
        kept[layer] = torch.cat((chunks.repeat_interleave(chunk_size, dim=-1), partial), dim=-1)
    return kept


class RecordingView(SequenceView):
    """Causal attention over one forward's tokens that keeps every layer's keys and values (graph included)."""

    def __init__(self, window: int | None = None):
        super().__init__(window)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [B, kv_heads, T, head_dim]
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.keys[layer], self.values[layer] = k, v
        return super().attend(layer, k, v)


class BudgetView(KVCache):
    """Stateless drafting context for a continuation: kept prefix keys, then the continuation causally.

    ``keys``/``values``: {layer: [B, kv_heads, >= P, head_dim]} from a
    :class:`RecordingView` (only the first P are read); ``kept``: {layer: bool
    [B, P] or, per KV head, [B, kv_heads, P]} from :func:`kept_prefix`. The
    forward through it takes the continuation tokens at positions P, P+1, ...
    """

    def __init__(self, keys: Mapping[int, torch.Tensor], values: Mapping[int, torch.Tensor],
                 kept: Mapping[int, torch.Tensor]):
        self.keys, self.values, self.kept = keys, values, kept
        self._tail: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        n = positions.shape[1]
        self._tail = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        kept = self.kept[layer]
        kept = kept[:, None] if kept.dim() == 2 else kept  # [B, 1 or kv_heads, P]
        b, heads, p = kept.shape
        n = k.shape[2]
        keys = torch.cat((self.keys[layer][:, :, :p], k), dim=2)
        values = torch.cat((self.values[layer][:, :, :p], v), dim=2)
        mask = torch.cat((kept[:, :, None, :].expand(b, heads, n, p), self._tail.expand(b, heads, n, n)), dim=-1)
        return keys, values, mask

    def end(self) -> None:
        self._tail = None

    def rollback(self, n: int) -> None:
        require(n == 0, "a BudgetView keeps no state to roll back")

    def reset(self) -> None:
        self._tail = None
