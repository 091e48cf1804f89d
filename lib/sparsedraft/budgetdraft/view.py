"""The BudgetCache selection as a training-time view: one forward, every position sparse at once.

At inference the drafter's prefix is scored once, by the observation window
before the partial chunk (see :mod:`sparsedraft.caches.budget`). Training
replays that moment for *every* chunk boundary of a sequence: a query at
position t, in chunk ``c = t // C``, sees

- its own chunk up to itself (the "partial chunk + recent tokens" of inference);
- the ``budget // C`` complete chunks before ``c`` with the highest attention
  from the queries ``[c*C - W, c*C)``, summed over heads, per layer.

The attention comes from the drafter's own full-prefix forward (the L_A
branch), detached: the selection is a discrete choice, the gradient flows
through the masked attention only. Masks go through :class:`BudgetView`, a
stateless cache like :class:`~sparsedraft.cache.SequenceView` but with one mask
per layer. With ``budget >= T`` every earlier chunk is kept, the mask equals
the causal mask, and the sparse forward is the full forward bit for bit.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ..cache import KVCache, causal_mask
from ..caches.budget import check_budget, top_chunks
from ..errors import require


def budget_masks(attention: Mapping[int, torch.Tensor], budget: int, chunk_size: int,
                 obs_window: int) -> dict[int, torch.Tensor]:
    """{layer: softmax weights [B, H, T, T]} -> {layer: bool [B, 1, T, T]} visible keys per query.

    The masks are not causal by themselves; :class:`BudgetView` adds causality.
    """
    check_budget(budget, chunk_size)
    require(obs_window >= 1, f"obs_window must be >= 1 query, got {obs_window}")
    masks = {}
    for layer, weights in attention.items():
        b, _, t, s = weights.shape
        require(t == s, f"attention of layer {layer} is {tuple(weights.shape)}; the view needs the full-prefix "
                        "self-attention [B, H, T, T] of one forward")
        n = -(-t // chunk_size)
        received = F.pad(weights.float().sum(1), (0, n * chunk_size - t))  # [B, T, n*C]
        per_chunk = received.view(b, t, n, chunk_size).sum(-1)  # [B, T(query), n(chunk)]
        boundary = torch.arange(n, device=weights.device)[:, None] * chunk_size
        query = torch.arange(t, device=weights.device)
        window = ((query >= boundary - obs_window) & (query < boundary)).float()  # [n, T]
        scores = window @ per_chunk  # [B, n(boundary), n(chunk)]
        chunk = torch.arange(n, device=weights.device)
        earlier = (chunk[None, :] < chunk[:, None]).expand(b, n, n)
        visible = top_chunks(scores, earlier, budget // chunk_size) | torch.eye(n, dtype=torch.bool,
                                                                                 device=weights.device)
        token_chunk = query // chunk_size
        masks[layer] = visible[:, token_chunk][:, :, token_chunk][:, None]
    return masks


class BudgetView(KVCache):
    """Stateless causal attention over one forward's tokens with a per-layer extra mask (training).

    ``masks``: {layer: bool [B, 1, T, T]}; layers without an entry attend causally.
    """

    def __init__(self, masks: Mapping[int, torch.Tensor], window: int | None = None):
        self.masks, self.window = dict(masks), window
        self._causal: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        self._causal = causal_mask(positions, positions, self.window)
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        extra = self.masks.get(layer)
        return k, v, self._causal if extra is None else self._causal & extra

    def end(self) -> None:
        self._causal = None

    def rollback(self, n: int) -> None:
        require(n == 0, "a BudgetView keeps no state to roll back")

    def reset(self) -> None:
        self._causal = None
