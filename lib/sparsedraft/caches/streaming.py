"""StreamingLLM cache for the level-1 draft model: attention sinks plus a recent window.

A query at true position ``q`` sees the ``sink`` first tokens of the sequence
and the last ``window`` tokens ending at itself (``q - window < p <= q``);
nothing else. The draft model prefills the whole prompt (in chunks of any
size), then appends drafted tokens and rolls rejected ones back, so the cache
must never forget a token that a rollback could bring back into the window.

Layout: one linear buffer ``[batch, kv_heads, slots, head_dim]`` per layer.
Slots ``[0, sink)`` hold the sink tokens; slot ``sink`` onwards holds
consecutive recent tokens starting at true position ``oldest``. Appending is an
index write; only when the buffer is full does a *compaction* copy the last
``window - 1 + spec_slots`` tokens down to slot ``sink`` -- enough for the next
query's window even after rolling back ``spec_slots`` tokens. One extra window
of slots between compactions makes copying amortised O(1) per token. Stale
tokens still in the buffer are hidden by the mask, which is always built from
true positions, so rollback is only a length change.

Two positional schemes (``positions``):

``"true"``
    keys are stored rotated at their true positions (``keys_prerope`` False)
    and queries use true positions: exactly sliding-window attention with
    sinks, i.e. a full-cache forward under a sink + window mask.
``"cache"``
    as StreamingLLM and TriForce's draft: keys are stored before RoPE
    (``keys_prerope`` True) and rotated at attend time at *cache* positions --
    sink token ``i`` at ``i``, recent tokens consecutive after the sink -- so
    a model never sees positions beyond ``sink + window`` however long the
    context. Within one forward the keys are rotated once, with the recent
    tokens counted from ``base``, the window start of the forward's first
    query (``max(sink, q0 - window + 1)``): a key at true position ``p >=
    sink`` sits at ``sink + p - base`` and a query at ``q`` at ``sink + q -
    base``. For one-token steps (drafting) this is StreamingLLM exactly; in a
    multi-token forward (prefill chunks) later queries see the sinks up to
    ``T - 1`` positions further away than a token-by-token run would, and a
    whole prompt in one chunk reproduces true positions.

A model's own sliding window (Mistral) is applied on top, to the positions
RoPE sees.

Positions handed to :meth:`begin` must continue from :attr:`length` (the
model's default); the slot arithmetic relies on it. All batch rows share one
length, as in :class:`~sparsedraft.engine.cache.StaticCache`.
"""

from __future__ import annotations

import torch

from ..engine.cache import KVCache
from ..engine.config import ModelConfig
from ..engine.rope import Angles, Rotary
from ..errors import require

POSITION_MODES = ("true", "cache")


class StreamingCache(KVCache):
    """Sink + recent-window cache with exact rollback of up to ``spec_slots`` tokens.

    Buffers ``k[layer]``, ``v[layer]``: ``[batch, kv_heads, slots, head_dim]``
    with ``slots = sink + keep + window`` where ``keep = window - 1 +
    spec_slots`` (see the module docstring for why).

    Rollback guarantee: if a speculation round appends at most ``spec_slots``
    tokens (in any number of forwards), rolling back to any length the round
    passed through is exact. A rollback that would need an evicted token raises
    instead of attending to the wrong window. :attr:`length` is the number of
    tokens seen; :attr:`oldest` the earliest recent token still stored.
    """

    def __init__(self, cfg: ModelConfig, sink: int, window: int, spec_slots: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 rotary: Rotary | None = None, positions: str = "true"):
        require(sink >= 0, f"sink must be >= 0 tokens (StreamingLLM uses 4, TriForce 16), got {sink}")
        require(window >= 1, f"window must be >= 1 token, got {window}")
        require(spec_slots >= 0, f"spec_slots must be >= 0 (the most tokens a rollback undoes), got {spec_slots}")
        require(batch >= 1, f"batch must be >= 1, got {batch}")
        require(positions in POSITION_MODES, f"positions must be one of {POSITION_MODES}, got {positions!r}")
        require(positions == "true" or rotary is not None,
                "positions='cache' rotates keys at cache positions and needs the model's rotary: "
                "pass rotary=model.rotary (or use positions='true')")
        self.sink, self.window, self.spec_slots = sink, window, spec_slots
        self.mode, self.rotary = positions, rotary
        self.keys_prerope = positions == "cache"
        self.model_window = cfg.sliding_window
        self.keep = window - 1 + spec_slots  # recent tokens a compaction keeps
        self.slots = self.slots_for(sink, window, spec_slots)
        self.batch, self.dtype = batch, dtype
        shape = (batch, cfg.num_kv_heads, self.slots, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.device = self.k[0].device
        self.reset()


    @staticmethod
    def slots_for(sink: int, window: int, spec_slots: int) -> int:
        """Slots of each layer's buffer: the sinks, the ``window - 1 + spec_slots`` recent tokens a compaction
        keeps, and one window of fresh tokens between compactions."""
        return sink + (window - 1 + spec_slots) + window
    def reset(self) -> None:
        self.length = 0  # tokens seen (true position of the next token)
        self.oldest = self.sink  # true position held by slot `sink`
        self._clear_step()

    def _clear_step(self) -> None:
        self._new = 0
        self._shift = 0  # slots a compaction drops from the front of the recent region
        self._wide = False  # the step does not fit even after compaction: concatenate instead
        self._mask: torch.Tensor | None = None
        self._key_angles: Angles | None = None

    def _slot(self, position: int, oldest: int) -> int:
        return position if position < self.sink else self.sink + position - oldest

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        t, n, s = positions.shape[1], self.length, self.sink
        layout_oldest = self.oldest
        if self._slot(n + t - 1, layout_oldest) >= self.slots:
            compacted = max(s, n - self.keep)
            if self._slot(n + t - 1, compacted) < self.slots:
                self._shift, layout_oldest = compacted - self.oldest, compacted
            else:
                self._wide = True
        self._new = t
        end = self._slot(n + t - 1, layout_oldest) + 1
        slot = torch.arange(end, device=self.device)
        k_pos = torch.where(slot < s, slot, slot - s + layout_oldest)[None]  # true position per slot, [1, S]
        q_pos = positions.to(self.device)
        visible = (k_pos[:, None] <= q_pos[:, :, None]) & (
            (k_pos[:, None] < s) | (k_pos[:, None] > q_pos[:, :, None] - self.window))
        rope_q, rope_k = q_pos, k_pos
        if self.mode == "cache":
            base = max(s, n - self.window + 1)
            rope_q = torch.where(q_pos < s, q_pos, q_pos - base + s)
            rope_k = torch.where(k_pos < s, k_pos, k_pos - base + s)
            self._key_angles = self.rotary.angles(rope_k.expand(q_pos.shape[0], -1), self.dtype)
        if self.model_window is not None:
            visible &= rope_k[:, None] > rope_q[:, :, None] - self.model_window
        self._mask = visible[:, None].expand(self.batch, -1, -1, -1)
        return rope_q

    def attend(self, layer: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        keys, values = self._store(self.k[layer], k), self._store(self.v[layer], v)
        if self._key_angles is not None:
            keys = self._key_angles.apply(keys)
        return keys, values, self._mask

    def _store(self, buf: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write the step's ``new`` [B, kv_heads, T, D] into ``buf``; return what the step attends to."""
        n, t, s = self.length, self._new, self.sink
        if self._shift:
            kept = n - self.oldest - self._shift
            buf[:, :, s:s + kept] = buf[:, :, s + self._shift:s + self._shift + kept].clone()
        oldest = self.oldest + self._shift
        start = self._slot(n, oldest)
        if not self._wide:
            buf[:, :, start:start + t] = new
            return buf[:, :, :start + t]
        everything = torch.cat((buf[:, :, :start], new), dim=2)
        if n < s:
            buf[:, :, :s] = everything[:, :, :s]
        retained = max(s, n + t - self.keep)
        first = self._slot(retained, oldest)
        buf[:, :, s:s + n + t - retained] = everything[:, :, first:]
        return everything

    def end(self) -> None:
        n, t = self.length, self._new
        if self._wide:
            self.oldest = max(self.sink, n + t - self.keep)
        else:
            self.oldest += self._shift
        self.length = n + t
        self._clear_step()

    def rollback(self, n: int) -> None:
        require(0 <= n <= self.length, f"cannot roll back {n} tokens from a cache of {self.length}")
        target = self.length - n
        require(max(self.sink, target - self.window + 1) >= self.oldest,
                f"cannot roll back {n} tokens: the window before position {target} was already evicted "
                f"(oldest kept token is {self.oldest}); create the StreamingCache with spec_slots >= the most "
                f"tokens a speculation round appends before rolling back (now {self.spec_slots})")
        self.length = target
