"""TriForce's retrieval cache: the target model drafting for itself from a few chunks of its cache.

Level 2 of the hierarchy runs the *target* model with this view instead of its
full cache. :meth:`RetrievalCache.build` splits the full cache's committed keys
into chunks of ``chunk_size`` tokens, scores every chunk per layer and per KV
head by the current query (post-RoPE) against the chunk's mean key (raw dot
product), and copies the best chunks into a fixed ``budget`` of slots, ordered
by rank. Chunk 0 is always kept: it holds the attention sinks.

GQA: the query heads of a KV head's group each score the chunk; the KV head's
score is their ``group_reduce`` ("sum": the group's total attention logit mass,
"max": keep a chunk any head wants). ``group_reduce="recent"`` scores no query:
it keeps the sink chunk and the latest chunks, StreamingLLM's sinks + window
as a view of the full cache (MagicDec's self-speculation draft), built by a
copy instead of a second prefill.

Recent tokens -- the partial chunk at the end of the context at build time
and every token committed afterwards -- are always kept: they are written
over the *least important* entries, i.e. the budget slots from its end
backwards (the lowest-ranked chunks first). The ``i``-th recent token written
since the build lands in slot ``budget - 1 - (i mod (budget - chunk_size))``;
once every non-sink slot holds a recent token the oldest recent token is
overwritten, so a view that is never rebuilt degrades to sinks + a recent
window (StreamingLLM) rather than failing. Only complete chunks compete for
rank; a partial chunk would need a mean over fewer keys and a per-head
validity mask that the ``[B, 1, T, S]`` mask cannot express.

Lifecycle, driven by the speculative decoder:

1. ``build(full, queries)`` after the prompt, from a full cache holding the
   whole prompt and the last prompt token's queries, so that token's own key
   enters the selection as in TriForce (a recent token when its chunk is
   partial, always kept); or on a rebuild policy's call, with the newest
   committed token's queries;
2. level-2 forwards write new tokens into the ``spec_slots`` after the budget;
   the mask shows every filled budget slot plus causal among those tokens
   (once every slot is filled that is the :data:`~sparsedraft.engine.cache.CAUSAL`
   layout, handed as the marker so the step takes the decode kernel);
   ``rollback(n)`` trims them;
3. after the level-3 (full cache) verification, ``sync(full)`` copies the tokens
   the full cache committed since the last build/sync over the least important
   entries and empties the speculative region.

Counters (:attr:`builds`, :attr:`scanned_tokens`, :attr:`syncs`,
:attr:`synced_tokens`) and the chosen chunks per layer (:attr:`chosen`) are
exposed for analysis; the cache does no timing.
"""

from __future__ import annotations

import torch

from ..engine.cache import CAUSAL, Causal, KVCache, StaticCache, in_order
from ..engine.config import ModelConfig
from ..errors import require

GROUP_REDUCTIONS = ("sum", "max", "recent")


def mean_key_scores(keys: torch.Tensor, queries: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """keys [B, kv_heads, chunks * chunk_size, D], queries [B, kv_heads, G, D] (G per KV head) -> fp32 scores
    [B, kv_heads, G, chunks]: each query against each chunk's mean key (raw dot product)."""
    b, kv, n, d = keys.shape
    means = keys.float().reshape(b, kv, n // chunk_size, chunk_size, d).mean(3)
    return queries.float() @ means.transpose(-1, -2)


class RetrievalCache(KVCache):
    """A fixed-size view of a full :class:`StaticCache`: best chunks, recent tokens, speculative tail.

    Buffers ``k[layer]``, ``v[layer]``: ``[batch, kv_heads, budget + spec_slots, head_dim]``;
    slots ``[0, budget)`` hold the retrieved context, the rest the level-2 tokens.

    ``allow_full``: building with ``budget >= context`` keeps the whole cache,
    which makes retrieval pointless, so it is an error unless allowed (the
    parity tests use it: the view then gives the full cache's logits).
    """

    def __init__(self, cfg: ModelConfig, budget: int, chunk_size: int, spec_slots: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 group_reduce: str = "sum", allow_full: bool = False):
        require(chunk_size >= 1, f"chunk_size must be >= 1 token (TriForce uses 8), got {chunk_size}")
        require(budget % chunk_size == 0,
                f"budget ({budget}) must be a multiple of chunk_size ({chunk_size}); "
                f"use budget={max(budget // chunk_size, 2) * chunk_size}")
        require(budget >= 2 * chunk_size,
                f"budget ({budget}) must hold the sink chunk plus at least one more chunk: "
                f"use budget >= {2 * chunk_size} (2 * chunk_size)")
        require(spec_slots >= 1, f"spec_slots must be >= 1 (level-2 tokens between syncs), got {spec_slots}")
        require(batch >= 1, f"batch must be >= 1, got {batch}")
        require(group_reduce in GROUP_REDUCTIONS,
                f"group_reduce must be one of {GROUP_REDUCTIONS}, got {group_reduce!r}")
        self.cfg = cfg
        self.budget, self.chunk_size, self.spec_slots = budget, chunk_size, spec_slots
        self.group_reduce, self.allow_full = group_reduce, allow_full
        self.recent_capacity = budget - chunk_size  # every slot but the sink chunk can take a recent token
        self.batch, self.dtype = batch, dtype
        shape = (batch, cfg.num_kv_heads, budget + spec_slots, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.device = self.k[0].device
        self.spec_pos = torch.zeros(batch, spec_slots, dtype=torch.long, device=self.device)
        self.reset()

    def reset(self) -> None:
        self.built = False
        self.base = 0  # tokens of the full cache the budget region reflects (true position of spec slot 0)
        self.spec = 0  # committed level-2 tokens in the speculative region
        self.chunk_slots = 0  # leading slots filled with retrieved chunks
        self.written = 0  # recent tokens written since the build
        self.chosen: list[torch.Tensor] = []  # per layer [B, kv_heads, kept] chunk ids, best first
        self.builds = 0  # counters since reset, for cost accounting (the decoder does the timing)
        self.scanned_tokens = 0  # full-cache tokens whose keys builds scored (per layer)
        self.syncs = 0
        self.synced_tokens = 0  # tokens taken in by sync()
        self._new = 0
        self._mask: torch.Tensor | Causal | None = None

    @property
    def length(self) -> int:
        """True position of the next token (the model's default positions start here)."""
        return self.base + self.spec

    def _check_full(self, full: StaticCache) -> None:
        require(isinstance(full, StaticCache),
                f"a RetrievalCache views a full StaticCache, got {type(full).__name__}")
        require(len(full.k) == len(self.k) and full.k[0].shape[:2] == self.k[0].shape[:2]
                and full.k[0].shape[3] == self.k[0].shape[3],
                f"full cache shape {tuple(full.k[0].shape)} x {len(full.k)} layers does not match this view "
                f"(batch, kv_heads, head_dim of {tuple(self.k[0].shape)} x {len(self.k)} layers); "
                "build both caches from the same model config and batch")
        require(full.k[0].dtype == self.dtype and full.k[0].device == self.device,
                f"full cache is {full.k[0].dtype} on {full.k[0].device} but this view is {self.dtype} on "
                f"{self.device}; create the RetrievalCache with the model's dtype and device")
        window = self.cfg.sliding_window
        require(window is None or full.length + self.spec_slots <= window,
                f"the model's sliding window ({window}) would hide part of a context of {full.length} + "
                f"{self.spec_slots} speculative tokens, and a retrieval view cannot apply a per-head window; "
                "use the full cache for this context")

    def build(self, full: StaticCache, queries: dict[int, torch.Tensor]) -> None:
        """Fill the budget with the best chunks of ``full`` for ``queries`` {layer: [B, heads, head_dim]}.

        The queries are post-RoPE, of one token (TriForce: the last prompt token,
        or the last accepted token of the latest verification).
        """
        self._check_full(full)
        context, layers = full.length, len(self.k)
        require(context >= 1, "the full cache is empty: prefill the prompt before building the retrieval view")
        require(self.allow_full or self.budget < context,
                f"budget ({self.budget}) >= context ({context}): the retrieval view would hold the whole cache; "
                "decode with the full cache, or use a budget smaller than the context")
        require(set(queries) == set(range(layers)),
                f"queries must hold one tensor per layer 0..{layers - 1}, got layers {sorted(queries)}; "
                "capture them with Capture(layers=set(range(num_layers)))")
        expected = (self.batch, self.cfg.num_heads, self.cfg.head_dim)
        for layer, q in queries.items():
            require(tuple(q.shape) == expected,
                    f"query of layer {layer} has shape {tuple(q.shape)}, expected {expected} [B, heads, head_dim] "
                    "for one token: pass capture.queries[layer][:, :, i] for the token i that scores")
        cs = self.chunk_size
        complete = context // cs
        kept = min(self.budget // cs, complete)
        self.chosen = []
        for layer in range(layers):
            ids = self._select(full.keys(layer)[:, :, :complete * cs], queries[layer], kept)
            self.chosen.append(ids)
            tokens = (ids[..., None] * cs + torch.arange(cs, device=self.device)).flatten(2)
            index = tokens[..., None].expand(-1, -1, -1, self.cfg.head_dim)
            self.k[layer][:, :, :kept * cs] = full.k[layer].gather(2, index)
            self.v[layer][:, :, :kept * cs] = full.v[layer].gather(2, index)
            self._stored(layer, slice(0, kept * cs))
        self.chunk_slots, self.written, self.spec = kept * cs, 0, 0
        self.base = complete * cs
        self._write_recent(full)
        self.built = True
        self.builds += 1
        self.scanned_tokens += context

    def _select(self, keys: torch.Tensor, query: torch.Tensor, kept: int) -> torch.Tensor:
        """keys [B, kv_heads, chunks * cs, D], query [B, heads, D] -> chunk ids [B, kv_heads, kept], best first."""
        b, kv, n, d = keys.shape
        if kept == 0:
            return torch.zeros(b, kv, 0, dtype=torch.long, device=keys.device)
        chunks = n // self.chunk_size
        if self.group_reduce == "recent":  # no query: the latest chunks rank first
            scores = torch.arange(chunks, dtype=torch.float32, device=keys.device).expand(b, kv, chunks).clone()
        else:
            scores = mean_key_scores(keys, query.reshape(b, kv, self.cfg.group_size, d), self.chunk_size)
            scores = scores.sum(2) if self.group_reduce == "sum" else scores.amax(2)
        scores[..., 0] = float("inf")  # the sink chunk always stays
        return scores.topk(kept, dim=-1).indices

    def sync(self, full: StaticCache) -> None:
        """Take in the tokens ``full`` committed since the last build/sync; empty the speculative region."""
        require(self.built, "build(full, queries) the retrieval view before syncing it")
        self._check_full(full)
        require(full.length >= self.base,
                f"the full cache holds {full.length} tokens but the retrieval view already reflects {self.base}; "
                "the full cache was rolled back past a sync: rebuild the view")
        self.synced_tokens += full.length - self.base
        self.syncs += 1
        self._write_recent(full)
        self.spec = 0

    def _write_recent(self, full: StaticCache) -> None:
        """Copy ``full``'s tokens [base, length) over the least important slots (see module docstring)."""
        start, stop = self.base, full.length
        skipped = max(0, stop - start - self.recent_capacity)  # would be overwritten within this call anyway
        start += skipped
        order = self.written + skipped + torch.arange(stop - start, device=self.device)
        slots = self.budget - 1 - order % self.recent_capacity
        for layer in range(len(self.k)):
            self.k[layer].index_copy_(2, slots, full.k[layer][:, :, start:stop])
            self.v[layer].index_copy_(2, slots, full.v[layer][:, :, start:stop])
            self._stored(layer, slots)
        self.written += stop - self.base
        self.base = stop

    def _stored(self, layer: int, slots: torch.Tensor | slice) -> None:
        """Hook: ``slots`` of the budget region of ``layer`` were just written (a quantised view re-stores them)."""

    def valid_slots(self) -> torch.Tensor:
        """bool [budget]: which budget slots hold a token (retrieved chunk or recent token)."""
        slot = torch.arange(self.budget, device=self.device)
        recent = min(self.written, self.recent_capacity)
        return (slot < self.chunk_slots) | (slot >= self.budget - recent)

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        require(self.built, "build(full, queries) the retrieval view before running the model with it")
        t = positions.shape[1]
        require(self.spec + t <= self.spec_slots,
                f"a level-2 step of {t} tokens does not fit: {self.spec} of {self.spec_slots} speculative slots are "
                "used; sync(full) after each level-3 verification, or create the RetrievalCache with "
                f"spec_slots >= {self.spec + t}")
        end = self.spec + t
        self.spec_pos[:, self.spec:end] = positions
        self._new = t
        every_slot_filled = self.chunk_slots + min(self.written, self.recent_capacity) >= self.budget
        if every_slot_filled and in_order(positions.to(self.device), self.spec_pos[:, :self.spec]):
            # every budget slot visible, earlier level-2 tokens before these: the CAUSAL layout, so the step
            # takes the same attention path as a full-cache decode (the C++ kernel on CPU) instead of SDPA
            self._mask = CAUSAL
            return positions
        q_pos = positions.to(self.device)[:, :, None]
        context = self.valid_slots().expand(self.batch, 1, t, -1)
        causal = (self.spec_pos[:, None, :end] <= q_pos)[:, None]
        self._mask = torch.cat((context, causal.expand(self.batch, -1, -1, -1)), dim=-1)
        return positions

    def attend(self, layer: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | Causal | None]:
        stop = self._write_new(layer, k, v)
        return self.k[layer][:, :, :stop], self.v[layer][:, :, :stop], self._mask

    def step_slots(self) -> tuple[int, int] | None:
        plain = self._mask is CAUSAL and type(self).attend is RetrievalCache.attend
        return self._new_slots() if plain else None

    def _new_slots(self) -> tuple[int, int]:
        """The speculative-region slots [start, stop) this step's tokens take."""
        start = self.budget + self.spec
        return start, start + self._new

    def _write_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """This step's keys and values into the speculative region; returns the end of what the step sees."""
        start, stop = self._new_slots()
        self.k[layer][:, :, start:stop] = k
        self.v[layer][:, :, start:stop] = v
        return stop

    def end(self) -> None:
        self.spec += self._new
        self._new = 0

    def rollback(self, n: int) -> None:
        require(0 <= n <= self.spec,
                f"cannot roll back {n} tokens: the retrieval view holds {self.spec} speculative tokens since the "
                "last sync; committed context changes only through sync(full) or build(full, queries)")
        self.spec -= n
