"""Exact attention rows of chosen queries, recomputed from one prefill.

Asking the model for attention weights (``Capture(weights=True)``) would
materialise [heads, T, T] per layer, 2.4 GB per layer at 8K in fp32. We only
need a few query rows, so one chunked prefill records the post-RoPE queries
of the chosen layers and leaves the post-RoPE keys in a :class:`StaticCache`;
afterwards each layer's rows are a cheap ``q @ k.T`` for the queries we ask
about, block by block. Memory stays near the KV cache plus the kept queries.

Only the queries from a first position on are kept: the last ones of the
prompt for most analyses, a few megabytes, against 0.6 GB at 8K and 2.2 GB
at 32K for every row of all 30 SmolLM2 layers in fp32 (what H2O's cumulative
score needs). Given a stored prefill of the prompt
(:class:`~sparsedraft.engine.prefilled.PrefilledPrompt`, from memory or a
:class:`~sparsedraft.engine.prefill_store.PrefillStore`), the keys before that
position come from a copy of its cache, and the model runs again only over
the last few tokens to record their queries, instead of every notebook
prefilling the whole prompt again (minutes at 32K on 2 cores).

Grouped-query attention: query head ``h`` reads KV head ``h // group``; the
queries of a group are folded into one matmul, as in the model.
Positions are cache slots: the prompt runs from position 0 with no sliding
window, so key ``j`` sits at position ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from ..engine.model import Capture, Transformer
from ..engine.prefill import PREFILL_CHUNK, prefill
from ..engine.prefill_store import prefill_prompt
from ..engine.prefilled import PrefilledPrompt
from ..errors import require

if TYPE_CHECKING:
    from ..engine.prefill_store import PrefillStore


@dataclass(frozen=True)
class LayerQK:
    """Queries and keys of one layer for a single sequence; the queries may be only the last rows."""

    layer: int
    queries: torch.Tensor  # [H, T - start, D] post-RoPE, of positions start .. T - 1
    keys: torch.Tensor  # [KV, T, D] post-RoPE
    scale: float  # softmax scale, head_dim ** -0.5 in the model
    start: int = 0  # position of the first query row; the queries before it were not kept

    def __post_init__(self) -> None:
        h, t, d = self.queries.shape
        kv, tk, dk = self.keys.shape
        require(0 <= self.start and self.start + t == tk and d == dk,
                f"queries {tuple(self.queries.shape)} from position {self.start} and keys "
                f"{tuple(self.keys.shape)} must end at the same position and share head_dim")
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

    def queries_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Queries at the absolute ``positions`` [m]: [H, m, D] (float32)."""
        require(positions.numel() == 0 or int(positions.min()) >= self.start,
                f"the queries before position {self.start} were not kept, got position {int(positions.min())}; "
                "capture from an earlier position (layer_qk's first)")
        return self.queries[:, positions - self.start].float()

    def grouped_queries(self, positions: torch.Tensor) -> torch.Tensor:
        """Queries at ``positions`` [m] folded by KV head: [KV, group * m, D] (float32)."""
        q = self.queries_at(positions)
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
        blocks of ``block`` rows, so it needs every query from position 0.
        """
        require(self.start == 0, f"H2O's cumulative score sums the attention of every query, but only those from "
                                 f"position {self.start} on were kept; capture every query (layer_qk with first=0)")
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


def stored_prefill(model: Transformer, prompt: torch.Tensor, prefilled: PrefilledPrompt | None,
                   store: PrefillStore | None) -> PrefilledPrompt | None:
    """``prefilled``, else ``store``'s prefill of ``prompt`` [1, T] (computed and written there when
    missing, so the next notebook reads it), checked to be ``model``'s prefill of ``prompt``; None when
    neither is given."""
    require(prefilled is None or store is None, "pass a prefill or a prefill store, not both")
    if prefilled is None and store is not None:
        prefilled = prefill_prompt(model, prompt, store=store)
    if prefilled is not None:
        prefilled.check(model, prompt)
    return prefilled


@torch.inference_mode()
def layer_qk(model: Transformer, prompt: torch.Tensor, layers: Iterable[int] | None = None,
             prefill_chunk: int = PREFILL_CHUNK, *, first: int = 0, prefilled: PrefilledPrompt | None = None,
             store: PrefillStore | None = None) -> Iterator[LayerQK]:
    """Yield each chosen layer's keys and the queries of positions ``first`` on (float32, model's device).

    Without ``prefilled`` or ``store`` the whole prompt is prefilled. With
    one of them (``first`` > 0: :meth:`LayerQK.cumulative` needs every
    query, which only a full prefill yields) the stored prefill's cache is
    copied, rolled back to ``first`` tokens and the rest of the prompt run
    again to record its queries; the stored cache is never written.
    """
    prompt = as_sequence(prompt).to(model.device)
    length = prompt.shape[1]
    chosen = check_layers(model, layers)
    window = model.cfg.sliding_window
    require(window is None or length <= window,
            f"prompt of {length} tokens exceeds the sliding window ({window}); the analyses assume every query "
            "sees all earlier keys, so use a prompt of at most the window")
    require(0 <= first < length, f"first query position must lie in [0, {length}) (the prompt length), got {first}")
    require(first > 0 or (prefilled is None and store is None),
            "every query (first=0) comes from a full prefill, which a stored prefill cannot shorten; "
            "pass no prefill or store")
    source = stored_prefill(model, prompt, prefilled, store)
    cache = model.new_cache(length)
    rerun = 0
    if source is not None:
        source.seed(cache)  # a copy: the stored cache stays as it was
        cache.rollback(length - first)
        rerun = first
    capture = Capture(layers=set(chosen))
    prefill(model, cache, prompt[:, rerun:], prefill_chunk, capture=capture, capture_last=length - first)
    scale = model.cfg.head_dim ** -0.5
    for layer in chosen:
        yield LayerQK(layer, capture.queries.pop(layer)[0], cache.keys(layer)[0].float(), scale, first)
