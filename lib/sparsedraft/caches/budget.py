"""BudgetDraft's sparse drafter cache: the prefix chunks that got the most attention, plus every later token.

The rule, shared with the training view of :mod:`sparsedraft.budgetdraft.view`
through :func:`choose_chunks` (so the drafter is trained on the view it drafts
with):

- The prefix (the prompt) is cut into chunks of ``chunk_size`` tokens. Only
  complete chunks compete; the partial chunk at the end of the prefix is
  always kept.
- The *observation window* is the ``obs_window`` queries just before the
  start of the partial chunk, i.e. positions ``[c*C - W, c*C)`` where
  ``c = prefix_len // C`` (SnapKV's observation window).
- A chunk's score, per layer, is the softmax attention weight those queries
  pay to its tokens, summed over the queries and over *all* query heads (so
  over every KV group). One selection per layer, shared by its KV heads.
- The ``budget // C`` highest-scoring chunks are kept (ties: the earlier chunk).
- ``scoring="keys"`` is the rule of BudgetDraft's public code instead: per
  layer *and per KV head*, a chunk scores its mean key against the last
  prefix key (the query's proxy; raw dot product, post-RoPE keys), chunk 0
  (the attention sinks) is always kept, and no attention is needed, so the
  cache selects from its own keys (:func:`choose_chunks_by_keys`).
- Selection happens once, at the end of the prefix (:meth:`BudgetCache.select`),
  and is never refreshed: every token appended afterwards is kept, so a
  speculative rollback is only a length change (contextual locality makes one
  selection last; TriForce, Observation 3).

With ``budget >= prefix_len`` nothing is dropped and the cache behaves exactly
like a full :class:`~sparsedraft.engine.cache.StaticCache`.

The cache protocol hands a cache keys and values, never attention, so under
the attention rule the cache cannot score its own chunks: whoever fills it (the drafter's prefill,
:func:`sparsedraft.speculative.budget.budget_prefill`) opens the prefix with
:meth:`BudgetCache.open_prefix`, runs the model over it capturing the
observation window's attention, and passes that to :meth:`BudgetCache.select`.
A forward into a cache whose prefix was never opened is an error, not a
silently full cache.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..engine.cache import CAUSAL, Causal, KVCache, causal_mask
from ..engine.config import ModelConfig
from ..errors import require
from .retrieval import mean_key_scores

BUDGETS = (256, 512, 1024, 2048)  # the paper's budget set; any multiple of the chunk size works
SCORINGS = ("attention", "keys")  # cumulative observation-window attention per layer; mean key vs last key per head
# This drafting view's version (a fixed chunk selection from the prefix plus the growing tail): a trained drafter
# records the one it was trained on, and one trained on another is refused (sparsedraft.speculative.loading)
VIEW_VERSION = 2


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


def top_chunks(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """scores [..., n] float -> bool [..., n]: the ``keep`` best chunks.

    A stable descending sort breaks ties towards the earlier chunk, so the
    inference cache, the training view and the tests agree on every choice.
    """
    n = scores.shape[-1]
    if keep >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
    return rank < keep


def choose_chunks(window_attention: torch.Tensor, budget: int, chunk_size: int) -> torch.Tensor:
    """[B, H, W, stop] softmax weights of the observation queries -> bool [B, stop // C] chunks kept.

    ``stop`` (a multiple of the chunk size) is where the partial chunk begins;
    the weights of a query cover the keys up to itself, all before ``stop``.
    """
    b, _, _, stop = window_attention.shape
    received = window_attention.float().sum((1, 2))  # [B, stop]
    scores = received.view(b, stop // chunk_size, chunk_size).sum(-1)
    return top_chunks(scores, budget // chunk_size)


def check_scoring(scoring: str) -> None:
    """Fail with the choices when a chunk-scoring rule is unknown."""
    require(scoring in SCORINGS, f"chunk scoring must be one of {SCORINGS} (attention: the observation window's "
                                 f"attention per layer; keys: mean key vs last key per KV head), got {scoring!r}")


def choose_chunks_by_keys(keys: torch.Tensor, last: torch.Tensor, budget: int, chunk_size: int) -> torch.Tensor:
    """keys [B, KV, stop, D] of the complete chunks, last [B, KV, D] the last prefix key -> bool [B, KV, stop // C].

    Per KV head, a chunk's score is its mean key dotted with the last key (the
    query's proxy), computed in fp32; chunk 0 always ranks first (it holds the
    attention sinks), ties go to the earlier chunk (:func:`top_chunks`).
    """
    scores = mean_key_scores(keys, last[:, :, None], chunk_size)[:, :, 0]  # [B, KV, n]
    if scores.shape[-1]:
        scores[..., 0] = float("inf")
    return top_chunks(scores, budget // chunk_size)


class BudgetCache(KVCache):
    """Drafter cache holding ``budget`` tokens of the prefix (best chunks) plus every later token.

    Buffers ``k[layer]``, ``v[layer]``: ``[batch, kv_heads, max_len, head_dim]``.
    Until :meth:`select` the cache is a full cache (slot i = position i);
    :meth:`select` moves the kept chunks and the partial chunk to the front, in
    position order, and later tokens append after them. :attr:`length` is the
    true position of the next token, :attr:`slots` the filled slots. The
    buffers are sized for the whole run because the prompt must be scored
    before anything can be dropped; what the budget bounds is what every
    drafting step reads: ``budget`` + partial chunk + appended tokens.
    """

    def __init__(self, cfg: ModelConfig, budget: int, max_len: int, chunk_size: int = 8, obs_window: int = 32,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 scoring: str = "attention"):
        check_budget(budget, chunk_size)
        check_scoring(scoring)
        require(obs_window >= 1, f"obs_window must be >= 1 query, got {obs_window}")
        require(max_len >= 1, f"max_len must be >= 1 (prompt + new tokens), got {max_len}")
        require(cfg.sliding_window is None,
                f"BudgetCache does not support sliding-window attention (window {cfg.sliding_window}); "
                "use a drafter without sliding_window")
        self.cfg, self.budget, self.chunk_size, self.obs_window = cfg, budget, chunk_size, obs_window
        self.scoring = scoring
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
        self.chosen: list[torch.Tensor] = []  # per layer: [B, kept] chunk ids (keys: [B, KV, kept]), ascending
        self._open = False  # forwards before select() are allowed only after open_prefix()
        self._new = 0
        self._mask: torch.Tensor | Causal | None = None

    def open_prefix(self) -> None:
        """Declare that the next forwards are the prefix, to be scored and cut by :meth:`select`."""
        require(self.length == 0, f"open_prefix needs an empty BudgetCache, it holds {self.length} tokens; reset() it")
        self._open = True

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        n = positions.shape[1]
        require(self.slots + n <= self.max_len,
                f"a step of {n} tokens does not fit: the BudgetCache holds {self.slots} of {self.max_len} "
                f"slots; create it with max_len >= {self.slots + n} (prompt + new tokens)")
        end = self.slots + n
        if self.selected_at is None:
            require(self._open,
                    "a BudgetCache must be filled by sparsedraft.budgetdraft.budget_prefill (or drafted with "
                    "BudgetDrafter), which scores the prompt's chunks and selects them; a plain prefill would "
                    "silently leave it a full cache")
            self.pos[:, self.slots:end] = positions
            self._mask = causal_mask(positions, self.pos[:, :end], None) if n > 1 else None
        else:
            # Slots after the selection are in position order: new token i sees slots < slots + i + 1, the
            # causal rule over the slots, so a drafting step takes the attention kernel and the one-call stack
            self._mask = CAUSAL
        self._new = n
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        start, end = self.slots, self.slots + self._new
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], self._mask

    def step_slots(self) -> tuple[int, int] | None:
        plain = self._mask is CAUSAL and type(self).attend is BudgetCache.attend
        return (self.slots, self.slots + self._new) if plain else None

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

    def fork(self, budget: int) -> "BudgetCache":
        """A copy of this prefilled, not yet selected cache with another ``budget`` (its own buffers): one
        prefill, then one :meth:`select` per budget, as if each had been prefilled alone."""
        require(self.selected_at is None and self.length >= 1,
                "fork() copies a prefilled BudgetCache before its select(); this one is "
                + ("empty" if not self.length else "already selected"))
        other = BudgetCache(self.cfg, budget, self.max_len, self.chunk_size, self.obs_window, self.batch,
                            self.k[0].dtype, self.k[0].device, self.scoring)
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            for layer, buffer in enumerate(mine):
                theirs[layer][:, :, :self.slots] = buffer[:, :, :self.slots]
        other.pos[:, :self.slots] = self.pos[:, :self.slots]
        other.length, other.slots = self.length, self.slots
        return other

    def observation_window(self) -> tuple[int, int]:
        """(start, stop) positions whose attention :meth:`select` expects for the current prefix."""
        return observation_window(self.length, self.chunk_size, self.obs_window)

    @torch.no_grad()
    def select(self, window_attention: Mapping[int, torch.Tensor] | None = None) -> None:
        """Keep the best ``budget // chunk_size`` complete chunks per layer (per KV head with ``scoring="keys"``);
        from now on only append.

        ``window_attention`` (``scoring="attention"`` only): {layer: [B, heads,
        W, stop]} softmax weights of the queries at the positions
        :meth:`observation_window` names over the keys before ``stop`` (W may
        be 0 when the prefix has no complete chunk). ``scoring="keys"`` reads
        the cache's own keys and takes none.
        """
        require(self.selected_at is None, "select() already ran since the last reset(); reset() and prefill again")
        start, stop = self.observation_window()
        cfg = self.cfg
        if self.scoring == "keys":
            require(window_attention is None, "a BudgetCache scoring chunks by keys selects from its own keys; "
                                              "call select() without attention")
            require(self.length >= 1, "select() needs a prefilled prefix (its last key is the query's proxy)")
        else:
            require(window_attention is not None and set(window_attention) == set(range(cfg.num_layers)),
                    f"select() needs the attention of every layer 0..{cfg.num_layers - 1}, got layers "
                    f"{sorted(window_attention or {})}; capture them with "
                    "Capture(layers=set(range(num_layers)), weights=True)")
            expected = (self.batch, cfg.num_heads, stop - start, stop)
            for layer, weights in window_attention.items():
                require(tuple(weights.shape) == expected,
                        f"attention of layer {layer} has shape {tuple(weights.shape)}, expected {expected}: queries "
                        f"[{start}, {stop}) over keys [0, {stop}) of a {self.length}-token prefix")
        cs, kv = self.chunk_size, cfg.num_kv_heads
        tail = torch.arange(stop, self.length, device=self.pos.device)
        self.chosen = []
        for layer in range(cfg.num_layers):
            if self.scoring == "keys":
                keep = choose_chunks_by_keys(self.k[layer][:, :, :stop], self.k[layer][:, :, self.length - 1],
                                             self.budget, cs)
                ids = keep.nonzero()[:, -1].view(self.batch, kv, -1)  # ascending per head: position order
                self.chosen.append(ids)
            else:
                ids = choose_chunks(window_attention[layer], self.budget, cs).nonzero()[:, 1].view(self.batch, -1)
                self.chosen.append(ids)  # ascending per row: position order
                ids = ids[:, None].expand(-1, kv, -1)
            tokens = torch.cat(((ids[..., None] * cs + torch.arange(cs, device=ids.device)).flatten(2),
                                tail.expand(self.batch, kv, -1)), dim=2)
            index = tokens[..., None].expand(-1, -1, -1, cfg.head_dim)
            kept = tokens.shape[2]
            self.k[layer][:, :, :kept] = self.k[layer].gather(2, index)
            self.v[layer][:, :, :kept] = self.v[layer].gather(2, index)
        self.slots = min(self.budget // cs, stop // cs) * cs + tail.numel()
        self.selected_at = self.length
        self._open = False
