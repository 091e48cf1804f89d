"""Observation 2 (attention sparsity): how much attention a small KV budget recovers.

TriForce's Fig. 3a: at 120K context, 4K keys (about 3%) hold 96.8% of the
attention mass, so a target restricted to them behaves almost like the full
target and can draft for itself. We measure the same quantity, *recovery* =
the attention mass of a query that falls on the kept keys, for the oracle
(top-k by the query's own weights) and for three realisable policies at the
same budget: TriForce's chunk retrieval, StreamingLLM and H2O (see
:mod:`.selection` for each rule).

The query rows come from one prefill (:mod:`.attention`), or from a stored
prefill and a short re-run of the queried tail, then each layer is handled on
its own and queries in blocks, so memory stays bounded at 32K context on
SmolLM2. H2O needs the attention every earlier query paid, a full causal pass
per layer over every query row: the one quadratic cost here, skipped when
``"h2o"`` is not among the methods, and the one case a stored prefill cannot
serve (see :func:`attention_recovery`).
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

METHODS = ("topk", "chunk", "streaming", "h2o")


@dataclass(frozen=True)
class SparsityConfig:
    """Budgets and policy parameters; every method is compared at each budget."""

    budgets: tuple[int | float, ...] = (0.05,)  # int: tokens (a multiple of chunk_size); float: share of context
    methods: tuple[str, ...] = METHODS
    chunk_size: int = 8  # retrieval chunk (TriForce default)
    sink: int = 16  # StreamingLLM sink tokens (TriForce's draft cache)
    h2o_recent_share: float = 0.5  # share of the budget H2O gives its recent window
    share_across_group: bool = True  # GQA: one selection per KV head (as a real cache), else per query head
    query_block: int = 64  # query rows processed at once; bounds memory to ~ heads * block * context
    prefill_chunk: int = PREFILL_CHUNK

    def __post_init__(self) -> None:
        require(len(self.budgets) > 0, "SparsityConfig.budgets needs at least one budget")
        unknown = [m for m in self.methods if m not in METHODS]
        require(len(self.methods) > 0 and not unknown,
                f"SparsityConfig.methods {list(self.methods)} has unknown entries {unknown}; choose from {METHODS}")
        for name in ("chunk_size", "query_block", "prefill_chunk"):
            require(getattr(self, name) >= 1, f"SparsityConfig.{name} must be >= 1, got {getattr(self, name)}")
        require(self.sink >= 0, f"SparsityConfig.sink must be >= 0 tokens, got {self.sink}")
        require(0.0 <= self.h2o_recent_share <= 1.0,
                f"SparsityConfig.h2o_recent_share must lie in [0, 1], got {self.h2o_recent_share}")
        for budget in self.budgets:  # same checks as at use, but before any forward
            selection.resolve_budgets(budget, torch.zeros(1, dtype=torch.long), self.chunk_size)


def last_positions(length: int, count: int) -> torch.Tensor:
    """The last ``count`` positions of a ``length``-token prompt (the usual query set)."""
    require(1 <= count <= length, f"count must lie in [1, {length}] (the prompt length), got {count}")
    return torch.arange(length - count, length)


def _block_recovery(qk: LayerQK, positions: torch.Tensor, cumulative: torch.Tensor | None,
                    config: SparsityConfig) -> list[dict]:
    """Recovery of every (method, budget) for one block of queries: rows with per-head sums over queries."""
    weights = qk.rows(positions)  # [H, m, T]
    kv, share, h = qk.keys.shape[0], config.share_across_group, qk.heads
    fixed = {}  # rankings that serve every budget
    if "topk" in config.methods:
        fixed["topk"] = selection.topk_ranks(weights, positions, kv, share)
    if "chunk" in config.methods:
        fixed["chunk"] = selection.chunk_ranks(qk.queries_at(positions), qk.keys, positions, config.chunk_size,
                                               share)
    if "streaming" in config.methods:
        fixed["streaming"] = selection.streaming_ranks(positions, qk.length, config.sink)
    rows = []
    for budget in config.budgets:
        budgets = selection.resolve_budgets(budget, positions, config.chunk_size)
        ranked = dict(fixed)
        if cumulative is not None:
            ranked["h2o"] = selection.h2o_ranks(cumulative, positions, budgets, config.h2o_recent_share, kv, share)
        tokens = torch.minimum(budgets, positions + 1).double().sum().item()
        for method in config.methods:
            kept = selection.expand_heads(selection.keep(ranked[method], budgets, positions), h)
            recovered = (weights * kept).sum(-1).sum(-1)  # [H] summed over the block's queries
            rows += [{"head": head, "method": method, "budget": budget, "tokens": tokens,
                      "recovery": recovered[head].item()} for head in range(h)]
    return rows


def layer_recovery(qk: LayerQK, positions: Iterable[int] | torch.Tensor,
                   config: SparsityConfig = SparsityConfig()) -> pd.DataFrame:
    """Mean recovery per (head, method, budget) over the queries at ``positions`` of one layer.

    Columns: head, method, budget, budget_tokens (mean tokens kept, capped
    by each query's context), recovery.
    """
    positions = check_positions(positions, qk.length).to(qk.keys.device)
    cumulative = qk.cumulative(positions, config.query_block) if "h2o" in config.methods else None
    rows = []
    for start in range(0, positions.numel(), config.query_block):
        block = slice(start, start + config.query_block)
        rows += _block_recovery(qk, positions[block], None if cumulative is None else cumulative[:, block], config)
    sums = pd.DataFrame(rows).groupby(["head", "method", "budget"], sort=False)[["tokens", "recovery"]].sum()
    out = (sums / positions.numel()).reset_index().rename(columns={"tokens": "budget_tokens"})
    return out[["head", "method", "budget", "budget_tokens", "recovery"]]


def attention_recovery(model: Transformer, prompt: torch.Tensor, query_positions: Iterable[int] | torch.Tensor,
                       layers: Iterable[int] | None = None, config: SparsityConfig = SparsityConfig(), *,
                       prefilled: PrefilledPrompt | None = None, store: PrefillStore | None = None) -> pd.DataFrame:
    """Recovery of every method and budget for each layer and head of ``model`` on ``prompt``.

    One prefill of ``prompt`` ([T] or [1, T]); ``query_positions`` (e.g.
    :func:`last_positions`) pick the queries; ``layers`` default to all.
    ``prefilled`` or ``store`` (see :func:`~.attention.layer_qk`) replace the
    prefill by a copy of a stored one and a re-run of the tail from the
    first query. H2O needs every query row, so with ``"h2o"`` among the
    methods the whole prompt is prefilled: a ``store`` is then not used and a
    ``prefilled`` is refused (it was paid for and could not help).
    Columns: layer, head, method, budget, budget_tokens, recovery.
    """
    prompt = as_sequence(prompt)
    positions = check_positions(query_positions, prompt.shape[1])  # fail before the prefill
    every_query = "h2o" in config.methods
    require(not (every_query and prefilled is not None),
            "H2O's cumulative score needs every query's attention row, which only a full prefill captures; "
            "drop 'h2o' from the methods or pass no prefill")
    first = 0 if every_query else int(positions[0])
    store = None if every_query else store
    frames = []
    for qk in layer_qk(model, prompt, layers, config.prefill_chunk, first=first, prefilled=prefilled, store=store):
        frame = layer_recovery(qk, positions, config)
        frame.insert(0, "layer", qk.layer)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def summarize_recovery(recovery: pd.DataFrame) -> pd.DataFrame:
    """Mean, min and max recovery over layers and heads per (method, budget)."""
    grouped = recovery.groupby(["method", "budget"], sort=False)["recovery"]
    return grouped.agg(["mean", "min", "max"]).reset_index()
