"""Observation 3 (contextual locality): does a selection made at step t still serve step t + Δ?

TriForce builds its retrieval cache once from one query and reuses it for
many decoding steps; that only pays off if the old context a token attends to
is nearly the same as what the next tokens attend to (the paper's Fig. 3c).
Two measurements, both at one fixed budget:

- *overlap*: the keys the oracle picks for query t versus for query t + Δ
  (``selection="topk"``), and the chunks the retrieval cache picks
  (``selection="chunk"``), as Jaccard index and as the share of t's set still
  chosen at t + Δ;
- *decay*: the attention mass of query t + Δ that a cache built at t still
  recovers, following the cache lifecycle: each of the Δ tokens decoded since t
  overwrites the lowest-ranked entry, so the cache holds t's best b − Δ keys
  plus the Δ newest (``recovery``), beside a cache rebuilt at t + Δ
  (``fresh_recovery``).

Prompt positions stand in for decoding steps (teacher forcing: the causal
attention of position t + Δ is exactly what step t + Δ would compute). With
grouped-query attention and shared selection every head of a group reports its
group's sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import pandas as pd
import torch

from ..engine.model import Transformer
from ..engine.prefill import PREFILL_CHUNK
from ..errors import require
from . import selection
from .attention import LayerQK, as_sequence, check_positions, layer_qk

if TYPE_CHECKING:
    from ..engine.prefill_store import PrefillStore
    from ..engine.prefilled import PrefilledPrompt

SELECTIONS = ("topk", "chunk")


@dataclass(frozen=True)
class LocalityConfig:
    budget: int | float = 0.05  # int: tokens (multiple of chunk_size); float: share of query t's context
    deltas: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)  # steps between building and using a selection
    chunk_size: int = 8
    share_across_group: bool = True  # GQA: one selection per KV head, as a real cache
    query_block: int = 64
    prefill_chunk: int = PREFILL_CHUNK

    def __post_init__(self) -> None:
        require(len(self.deltas) > 0 and all(d >= 0 for d in self.deltas),
                f"LocalityConfig.deltas must be a non-empty list of steps >= 0, got {list(self.deltas)}")
        for name in ("chunk_size", "query_block", "prefill_chunk"):
            require(getattr(self, name) >= 1, f"LocalityConfig.{name} must be >= 1, got {getattr(self, name)}")
        selection.resolve_budgets(self.budget, torch.zeros(1, dtype=torch.long), self.chunk_size)


@dataclass(frozen=True)
class LocalityResult:
    overlap: pd.DataFrame  # layer, head, selection, delta, budget, jaccard, intersection
    decay: pd.DataFrame  # layer, head, selection, delta, budget, recovery, fresh_recovery


def _key_and_chunk_ranks(qk: LayerQK, positions: torch.Tensor, config: LocalityConfig):
    """(key ranks per selection [G, m, T], retrieval chunk ranks [G, m, C], attention rows [H, m, T])."""
    weights = qk.rows(positions)
    kv, share = qk.keys.shape[0], config.share_across_group
    scores = selection.chunk_scores(qk.queries_at(positions), qk.keys, positions, config.chunk_size, share)
    chunk_rank = selection.ranks(scores)
    key_ranks = {"topk": selection.topk_ranks(weights, positions, kv, share),
                 "chunk": selection.chunk_key_ranks(chunk_rank, positions, config.chunk_size, qk.length)}
    return key_ranks, chunk_rank, weights


def _overlap(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Jaccard, share of a kept in b) over the last axis of two bool sets [G, m, N]."""
    inter = (a & b).sum(-1).double()
    return inter / (a | b).sum(-1).clamp(min=1), inter / a.sum(-1).clamp(min=1)


def _chosen_chunks(chunk_rank: torch.Tensor, budgets: torch.Tensor, positions: torch.Tensor,
                   chunk_size: int) -> torch.Tensor:
    """bool [G, m, C]: the whole chunks a budget of ``budgets`` tokens holds, among those seen."""
    ids = torch.arange(chunk_rank.shape[-1], device=chunk_rank.device)
    seen = ids[None, None] <= (positions // chunk_size)[None, :, None]
    return (chunk_rank < (budgets // chunk_size)[None, :, None]) & seen


def _mass(weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Attention mass on kept keys, summed over queries: [H]."""
    return (weights * selection.expand_heads(kept, weights.shape[0])).sum(-1).sum(1)


def _block(qk: LayerQK, bases: torch.Tensor, config: LocalityConfig) -> tuple[list[dict], list[dict]]:
    """Per-head sums over one block of base positions, for every delta and selection."""
    h, c = qk.heads, config.chunk_size
    budgets = selection.resolve_budgets(config.budget, bases, c)
    then_ranks, then_chunks, _ = _key_and_chunk_ranks(qk, bases, config)
    keys = torch.arange(qk.length, device=bases.device)
    overlap, decay = [], []
    for delta in config.deltas:
        later = bases + delta
        now_ranks, now_chunks, weights = _key_and_chunk_ranks(qk, later, config)
        decoded = budgets.clamp(max=delta)  # tokens decoded since t that the cache holds (newest first)
        newest = (keys[None, :] > bases[:, None]) & (keys[None, :] > later[:, None] - decoded[:, None])
        for name in SELECTIONS:
            kept_now = selection.keep(now_ranks[name], budgets, later)
            if name == "topk":
                sets = (selection.keep(then_ranks[name], budgets, bases), kept_now)
            else:  # compare the chosen chunks, not their keys
                sets = (_chosen_chunks(then_chunks, budgets, bases, c), _chosen_chunks(now_chunks, budgets, later, c))
            jaccard, share = (selection.expand_heads(x, h).sum(1) for x in _overlap(*sets))
            cached = selection.keep(then_ranks[name], budgets - decoded, bases) | newest[None]
            recovery, fresh = _mass(weights, cached), _mass(weights, kept_now)
            for head in range(h):
                common = {"head": head, "selection": name, "delta": delta}
                overlap.append({**common, "jaccard": jaccard[head].item(), "intersection": share[head].item()})
                decay.append({**common, "recovery": recovery[head].item(), "fresh_recovery": fresh[head].item()})
    return overlap, decay


def _mean(rows: list[dict], values: list[str], count: int, budget: int | float) -> pd.DataFrame:
    frame = pd.DataFrame(rows).groupby(["head", "selection", "delta"], sort=False)[values].sum() / count
    frame = frame.reset_index()
    frame.insert(3, "budget", budget)
    return frame


def _check_reach(bases: torch.Tensor, config: LocalityConfig, length: int) -> None:
    require(int(bases[-1]) + max(config.deltas) < length,
            f"base position {int(bases[-1])} + largest delta {max(config.deltas)} must stay inside the "
            f"{length}-token prompt; use earlier bases or smaller deltas")


def layer_locality(qk: LayerQK, base_positions: Iterable[int] | torch.Tensor,
                   config: LocalityConfig = LocalityConfig()) -> LocalityResult:
    """Overlap and decay for one layer, averaged over the base positions t."""
    bases = check_positions(base_positions, qk.length).to(qk.keys.device)
    _check_reach(bases, config, qk.length)
    overlap, decay = [], []
    for start in range(0, bases.numel(), config.query_block):
        o, d = _block(qk, bases[start:start + config.query_block], config)
        overlap += o
        decay += d
    n = bases.numel()
    return LocalityResult(_mean(overlap, ["jaccard", "intersection"], n, config.budget),
                          _mean(decay, ["recovery", "fresh_recovery"], n, config.budget))


def contextual_locality(model: Transformer, prompt: torch.Tensor, base_positions: Iterable[int] | torch.Tensor,
                        layers: Iterable[int] | None = None, config: LocalityConfig = LocalityConfig(), *,
                        prefilled: PrefilledPrompt | None = None,
                        store: PrefillStore | None = None) -> LocalityResult:
    """Overlap and decay for each chosen layer of ``model`` on ``prompt`` (one prefill).

    Only queries from the first base on are read, so ``prefilled`` or
    ``store`` (see :func:`~.attention.layer_qk`) replace the prefill by a copy
    of a stored one and a re-run of the last ``T - bases[0]`` tokens.
    """
    prompt = as_sequence(prompt)
    bases = check_positions(base_positions, prompt.shape[1])
    _check_reach(bases, config, prompt.shape[1])  # fail before the prefill
    overlaps, decays = [], []
    for qk in layer_qk(model, prompt, layers, config.prefill_chunk, first=int(bases[0]), prefilled=prefilled,
                       store=store):
        result = layer_locality(qk, bases, config)
        for frame, out in ((result.overlap, overlaps), (result.decay, decays)):
            frame.insert(0, "layer", qk.layer)
            out.append(frame)
    return LocalityResult(pd.concat(overlaps, ignore_index=True), pd.concat(decays, ignore_index=True))
