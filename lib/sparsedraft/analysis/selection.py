"""Which keys each KV policy keeps, expressed as a ranking of keys per query.

Every policy here orders the keys a query can see (rank 0 is kept first); a
budget of b tokens keeps the keys ranked below b. One ranking therefore
serves every budget, and two policies compare at exactly equal budgets.

- ``topk``: keys by the query's own attention weight (the oracle).
- ``chunk`` (TriForce retrieval cache): keys grouped in chunks of
  ``chunk_size`` positions; a chunk scores ``q · mean(k)`` over its keys seen
  so far; chunk 0 always comes first (a sink); the budget is filled chunk by
  chunk in score order (the last chunk may be cut to fit).
- ``streaming`` (StreamingLLM): ``sink`` first keys, then the most recent.
- ``h2o`` (Heavy-Hitter Oracle): a recent window plus the keys with the most
  attention received from earlier queries; the window is a share of the
  budget, so its ranking depends on the budget.

Grouped-query attention: a real cache keeps keys per KV head, so all query
heads of a group share one selection. With ``share`` the scores of a group's
heads are summed and rankings come back per KV head ([KV, m, T]); without it
each query head picks its own keys ([H, m, T], an upper bound).
"""

from __future__ import annotations

import torch

from ..errors import require


def group_scores(scores: torch.Tensor, kv_heads: int, share: bool) -> torch.Tensor:
    """[H, m, N] per-head scores -> [KV, m, N] summed per group when ``share``, else unchanged."""
    if not share:
        return scores
    h, m, n = scores.shape
    return scores.reshape(kv_heads, h // kv_heads, m, n).sum(1)


def expand_heads(values: torch.Tensor, heads: int) -> torch.Tensor:
    """[G, ...] per selection group -> [H, ...] per query head (G divides H)."""
    return values if values.shape[0] == heads else values.repeat_interleave(heads // values.shape[0], 0)


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last axis, 0 for the highest score (ties by index)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    out = torch.empty_like(order)
    out.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return out


def visible(positions: torch.Tensor, length: int) -> torch.Tensor:
    """bool [1, m, T]: key j is visible to the query at position p when j <= p."""
    keys = torch.arange(length, device=positions.device)
    return (keys[None, :] <= positions[:, None])[None]


def keep(key_ranks: torch.Tensor, budgets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """bool [G, m, T]: visible keys ranked below each query's budget (``budgets`` [m])."""
    return (key_ranks < budgets[None, :, None]) & visible(positions, key_ranks.shape[-1])


def resolve_budgets(budget: int | float, positions: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Tokens kept per query [m]: an int is a count; a float in (0, 1] is a share of the query's context,
    rounded to whole chunks (at least one)."""
    if isinstance(budget, float):
        require(0.0 < budget <= 1.0, f"a fractional budget must lie in (0, 1], got {budget}")
        chunks = torch.round(budget * (positions + 1).double() / chunk_size).long().clamp(min=1)
        return chunks * chunk_size
    require(budget >= chunk_size and budget % chunk_size == 0,
            f"budget {budget} must be a positive multiple of chunk_size={chunk_size}; round it to whole chunks")
    return torch.full_like(positions, int(budget))


def topk_ranks(weights: torch.Tensor, positions: torch.Tensor, kv_heads: int, share: bool) -> torch.Tensor:
    """Keys by attention weight; ``weights`` [H, m, T] -> ranks [G, m, T] (unseen keys last)."""
    scores = group_scores(weights, kv_heads, share)
    return ranks(scores.masked_fill(~visible(positions, scores.shape[-1]), float("-inf")))


def chunk_scores(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, chunk_size: int,
                 share: bool) -> torch.Tensor:
    """Retrieval scores q · mean(k) per chunk: [G, m, C]; chunk 0 +inf, unseen chunks -inf.

    ``queries`` [H, m, D] are the queries at ``positions``; ``keys`` [KV, T, D].
    The chunk holding the query itself is scored on the keys seen so far.
    """
    kv, length, d = keys.shape
    h, m = queries.shape[:2]
    n_chunks = -(-length // chunk_size)
    padded = torch.zeros(kv, n_chunks * chunk_size, d, device=keys.device)
    padded[:, :length] = keys
    sizes = (length - torch.arange(n_chunks, device=keys.device) * chunk_size).clamp(max=chunk_size)
    means = padded.reshape(kv, n_chunks, chunk_size, d).sum(2) / sizes[None, :, None]
    folded = queries.reshape(kv, (h // kv) * m, d)
    scores = (folded @ means.transpose(-1, -2)).reshape(h, m, n_chunks)
    own = positions // chunk_size  # chunk holding each query, partly seen
    prefix = torch.cat([torch.zeros(kv, 1, d, device=keys.device), keys.cumsum(1)], 1)
    seen = (prefix[:, positions + 1] - prefix[:, own * chunk_size]) / (positions - own * chunk_size + 1)[None, :, None]
    partial = (queries.reshape(kv, h // kv, m, d) * seen[:, None]).sum(-1).reshape(h, m)
    scores[:, torch.arange(m), own] = partial
    chunk_ids = torch.arange(n_chunks, device=keys.device)
    scores = scores.masked_fill(chunk_ids[None, None, :] > own[None, :, None], float("-inf"))
    scores[..., 0] = float("inf")
    return group_scores(scores, kv, share)


def chunk_key_ranks(chunk_rank: torch.Tensor, positions: torch.Tensor, chunk_size: int, length: int) -> torch.Tensor:
    """Key ranks [G, m, T] from chunk ranks [G, m, C]: chunks in rank order, positions in order within."""
    keys = torch.arange(length, device=chunk_rank.device)
    order = chunk_rank[..., keys // chunk_size] * chunk_size + keys % chunk_size
    order = order.masked_fill(~visible(positions, length), chunk_rank.shape[-1] * chunk_size)
    return ranks(-order.double())


def chunk_ranks(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, chunk_size: int,
                share: bool) -> torch.Tensor:
    """Key ranks [G, m, T] of the retrieval cache."""
    chunk_rank = ranks(chunk_scores(queries, keys, positions, chunk_size, share))
    return chunk_key_ranks(chunk_rank, positions, chunk_size, keys.shape[1])


def streaming_ranks(positions: torch.Tensor, length: int, sink: int) -> torch.Tensor:
    """Key ranks [1, m, T]: the first ``sink`` keys, then keys by recency."""
    keys = torch.arange(length, device=positions.device)[None, :]
    age = positions[:, None] - keys
    order = torch.where(keys < sink, keys, sink + age)
    return order.masked_fill(age < 0, length)[None]


def h2o_ranks(cumulative: torch.Tensor, positions: torch.Tensor, budgets: torch.Tensor, recent_share: float,
              kv_heads: int, share: bool) -> torch.Tensor:
    """Key ranks [G, m, T] for H2O at the given budgets: a recent window, then heavy hitters.

    ``cumulative`` [H, m, T] is the attention each key received from earlier
    queries; the window holds ``round(recent_share * budget)`` keys (at least 1).
    """
    length = cumulative.shape[-1]
    heavy = group_scores(cumulative, kv_heads, share)
    recent = torch.round(recent_share * budgets.double()).long().clamp(min=1)
    keys = torch.arange(length, device=positions.device)[None, :]
    age = positions[:, None] - keys
    in_window = (age >= 0) & (age < recent[:, None])
    score = heavy.double().masked_fill(in_window[None], float("inf"))
    return ranks(score.masked_fill((age < 0)[None], float("-inf")))
