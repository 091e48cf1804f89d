"""BudgetDraft's sparse drafter cache: the prefix chunks that got the most attention, plus recent tokens.

The rule (shared with the training-time view in
:mod:`sparsedraft.budgetdraft.view`, so the drafter is trained on the view it
drafts with):

- The prefix is cut into chunks of ``chunk_size`` tokens. Only complete
  chunks compete; the partial chunk at the end of the prefix is always kept.
- The *observation window* is the ``obs_window`` queries just before the
  start of the partial chunk, i.e. positions ``[c*C - W, c*C)`` where
  ``c = prefix_len // C`` (the last ``W`` prompt queries when the prefix is
  chunk-aligned; SnapKV's observation window).
- A chunk's score, per layer, is the cumulative softmax attention weight
  those queries pay to its tokens, summed over *all* query heads of the layer
  (so over every KV group). One selection per layer, shared by its KV heads:
  the model's attention mask is ``[B, 1, T, S]`` (broadcast over heads), so a
  per-KV-head choice could not be expressed in the differentiable training
  view, and training and inference must select the same way.
- The ``budget // C`` highest-scoring chunks are kept (ties: the earlier chunk).
- Selection happens once, at the end of the prefill (:meth:`BudgetCache.prefill`),
  and is never refreshed: every token appended afterwards is kept, so a
  speculative rollback is only a length change (contextual locality makes one
  selection last; TriForce, Observation 3).

With ``budget >= prefix_len`` nothing is dropped and the cache behaves exactly
like a full :class:`~sparsedraft.cache.StaticCache`.

Why the cache runs its own prefill: the cache protocol hands a cache keys and
values, never queries, so scoring by attention needs the observation window's
queries captured (:class:`~sparsedraft.model.Capture`) and passed to
:meth:`BudgetCache.select`. :meth:`BudgetCache.prefill` does both; a forward
outside it before the selection is an error, not a silently full cache.
"""

from __future__ import annotations

import torch

from ..cache import KVCache, causal_mask
from ..config import ModelConfig
from ..errors import require
from ..generate import prefill
from ..model import Capture, Transformer

BUDGETS = (256, 512, 1024, 2048)  # the paper's budget set; any multiple of the chunk size works


def check_budget(budget: int, chunk_size: int) -> None:
    """Fail with the fix when a budget cannot be filled with whole chunks."""
    require(chunk_size >= 1, f"chunk_size must be >= 1 token (TriForce uses 8), got {chunk_size}")
    require(budget >= chunk_size and budget % chunk_size == 0,
            f"KV budget {budget} must be a positive multiple of chunk_size {chunk_size}; "
            f"use e.g. {max(budget // chunk_size, 1) * chunk_size} (the paper's budgets are {BUDGETS})")


def observation_window(prefix_len: int, chunk_size: int, obs_window: int) -> tuple[int, int]:
    """(start, stop) positions of the queries that score the complete chunks of a prefix."""
    stop = prefix_len // chunk_size * chunk_size
    return max(0, stop - obs_window), stop


def top_chunks(scores: torch.Tensor, eligible: torch.Tensor, keep: int) -> torch.Tensor:
    """scores [..., n] float, eligible bool [..., n] -> bool [..., n]: the ``keep`` best eligible chunks.

    A stable descending sort breaks ties towards the earlier chunk, so the
    inference cache, the training view and the tests agree on every choice.
    """
    n = scores.shape[-1]
    if keep >= n:
        return eligible.clone()
    order = scores.masked_fill(~eligible, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
    return (rank < keep) & eligible


class BudgetCache(KVCache):
    """Drafter cache holding ``budget`` tokens of the prefix (best chunks) plus every later token.

    Buffers ``k[layer]``, ``v[layer]``: ``[batch, kv_heads, max_len, head_dim]``.
    Before :meth:`select` the cache is a full cache (slot i = position i);
    :meth:`select` moves the kept chunks and the partial chunk to the front, in
    position order, and later tokens append after them. :attr:`length` is the
    true position of the next token, :attr:`slots` the filled slots. The
    buffers are sized for the whole run because the prompt must be scored
    before anything can be dropped; what the budget bounds is what every
    drafting step reads: ``budget`` + partial chunk + appended tokens.
    """

    def __init__(self, cfg: ModelConfig, budget: int, max_len: int, chunk_size: int = 8, obs_window: int = 32,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        check_budget(budget, chunk_size)
        require(obs_window >= 1, f"obs_window must be >= 1 query, got {obs_window}")
        require(max_len >= 1, f"max_len must be >= 1 (prompt + new tokens), got {max_len}")
        require(cfg.sliding_window is None,
                f"BudgetCache does not support sliding-window attention (window {cfg.sliding_window}); "
                "use a drafter without sliding_window")
        self.cfg, self.budget, self.chunk_size, self.obs_window = cfg, budget, chunk_size, obs_window
        self.max_len, self.batch = max_len, batch
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.pos = torch.zeros(batch, max_len, dtype=torch.long, device=self.k[0].device)
        self.reset()

    def reset(self) -> None:
        self.length = 0  # true position of the next token
        self.slots = 0  # filled buffer slots (== length until select)
        self.selected_at: int | None = None  # prefix length when select() ran; None while prefilling
        self.chosen: list[torch.Tensor] = []  # per layer: [B, kept] chunk ids, ascending
        self._prefilling = False  # forwards before select() are allowed only inside prefill()
        self._new = 0
        self._mask: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        n = positions.shape[1]
        require(self.slots + n <= self.max_len,
                f"a step of {n} tokens does not fit: the BudgetCache holds {self.slots} of {self.max_len} "
                f"slots; create it with max_len >= {self.slots + n} (prompt + new tokens)")
        end = self.slots + n
        if self.selected_at is None:
            require(self._prefilling,
                    "a BudgetCache must be filled by BudgetCache.prefill(model, tokens) (or drafted with "
                    "sparsedraft.budgetdraft.BudgetDrafter), which captures the queries select() needs; "
                    "a plain prefill would silently leave it a full cache")
            self.pos[:, self.slots:end] = positions
            self._mask = causal_mask(positions, self.pos[:, :end], None) if n > 1 else None
        else:
            # Slots after the selection are in position order: new token i sees slots < slots + i + 1.
            slot = torch.arange(end, device=self.pos.device)
            row = self.slots + torch.arange(n, device=self.pos.device)
            self._mask = (slot <= row[:, None]).expand(self.batch, 1, n, end) if n > 1 else None
        self._new = n
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        start, end = self.slots, self.slots + self._new
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], self._mask

    def end(self) -> None:
        self.slots += self._new
        self.length += self._new
        self._new = 0

    def rollback(self, n: int) -> None:
        floor = 0 if self.selected_at is None else self.selected_at
        require(0 <= n <= self.length - floor,
                f"cannot roll back {n} tokens: only the {self.length - floor} tokens appended since the chunk "
                "selection can be forgotten (the dropped prefix chunks cannot come back); reset() and prefill again")
        self.slots -= n
        self.length -= n

    def observation_window(self) -> tuple[int, int]:
        """(start, stop) positions whose queries :meth:`select` expects for the current prefix."""
        return observation_window(self.length, self.chunk_size, self.obs_window)

    @torch.no_grad()
    def select(self, queries: dict[int, torch.Tensor]) -> None:
        """Keep the best ``budget // chunk_size`` complete chunks per layer; from now on only append.

        ``queries``: {layer: [B, heads, W, head_dim]} post-RoPE queries at the
        positions :meth:`observation_window` names (W may be 0 when the prefix
        has no complete chunk).
        """
        require(self.selected_at is None, "select() already ran since the last reset(); reset() and prefill again")
        start, stop = self.observation_window()
        cfg = self.cfg
        require(set(queries) == set(range(cfg.num_layers)),
                f"select() needs queries of every layer 0..{cfg.num_layers - 1}, got layers {sorted(queries)}; "
                "capture them with Capture(layers=set(range(num_layers)))")
        expected = (self.batch, cfg.num_heads, stop - start, cfg.head_dim)
        for layer, q in queries.items():
            require(tuple(q.shape) == expected,
                    f"queries of layer {layer} have shape {tuple(q.shape)}, expected {expected}: the observation "
                    f"window is positions [{start}, {stop}) of a {self.length}-token prefix")
        cs = self.chunk_size
        complete, keep = stop // cs, self.budget // cs
        tail = torch.arange(stop, self.length, device=self.pos.device)
        self.chosen = []
        for layer in range(cfg.num_layers):
            scores = self.chunk_scores(layer, queries[layer], start)
            chosen = top_chunks(scores, torch.ones_like(scores, dtype=torch.bool), keep)
            ids = chosen.nonzero()[:, 1].view(self.batch, -1)  # ascending per row: position order
            self.chosen.append(ids)
            tokens = torch.cat(((ids[..., None] * cs + torch.arange(cs, device=ids.device)).flatten(1),
                                tail.expand(self.batch, -1)), dim=1)
            index = tokens[:, None, :, None].expand(-1, cfg.num_kv_heads, -1, cfg.head_dim)
            kept = tokens.shape[1]
            self.k[layer][:, :, :kept] = self.k[layer].gather(2, index)
            self.v[layer][:, :, :kept] = self.v[layer].gather(2, index)
        self.slots = min(keep, complete) * cs + tail.numel()
        self.selected_at = self.length
        self._prefilling = False

    def chunk_scores(self, layer: int, queries: torch.Tensor, start: int) -> torch.Tensor:
        """[B, complete chunks]: attention the observation queries (from ``start``) pay to each chunk.

        Recomputed from the stored keys exactly as the model's explicit
        attention path computes it (grouped queries, fp32 softmax).
        """
        b, h, w, d = queries.shape
        cs = self.chunk_size
        stop = start + w
        complete = stop // cs
        if w == 0:
            return torch.zeros(b, complete, device=queries.device)
        kv = self.cfg.num_kv_heads
        keys = self.k[layer][:, :, :stop]
        logits = (queries.reshape(b, kv, (h // kv) * w, d) @ keys.transpose(-1, -2)).float() * d ** -0.5
        q_pos = torch.arange(start, stop, device=keys.device).repeat(h // kv)
        visible = torch.arange(stop, device=keys.device) <= q_pos[:, None]
        weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)  # [B, kv, g*W, stop]
        return weights.sum((1, 2)).view(b, complete, cs).sum(-1)

    @torch.inference_mode()
    def prefill(self, model: Transformer, tokens: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Prefill ``tokens`` [B, T] into this (reset) cache and select its chunks; return the last logits [B, V].

        The tokens before the observation window go through in chunks; the
        window and the partial chunk after it go through in one forward that
        captures their queries (at most ``obs_window + chunk_size - 1`` tokens).
        """
        require(self.length == 0, f"prefill needs an empty BudgetCache, it holds {self.length} tokens; reset() it")
        require(tokens.dim() == 2 and tokens.shape[1] >= 1,
                f"tokens must be [batch, T >= 1], got {tuple(tokens.shape)}")
        start, stop = observation_window(tokens.shape[1], self.chunk_size, self.obs_window)
        self._prefilling = True
        if start:
            prefill(model, self, tokens[:, :start], chunk)
        capture = Capture(layers=set(range(model.cfg.num_layers)))
        logits = model(tokens[:, start:], cache=self, last_only=True, capture=capture)
        self.select({layer: q[:, :, :stop - start] for layer, q in capture.queries.items()})
        return logits[:, -1]
