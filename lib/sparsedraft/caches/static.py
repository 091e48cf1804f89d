"""Static-shape caches: every step of a given token count attends to buffers of the same shape.

Why: a CUDA graph (:mod:`sparsedraft.engine.cudagraph`) replays the kernels it
recorded, with the shapes and the Python values of the capture, so a step
may read only device tensors whose *contents* change. The library's caches
hand attention a slice that grows with the length
(:class:`~sparsedraft.engine.cache.StaticCache`) or with the speculative tokens
(:class:`~sparsedraft.caches.RetrievalCache`), or compact their buffer
(:class:`~sparsedraft.caches.StreamingCache`). The caches here attend to the
whole buffer every step and let a positional mask hide what is not there:

- the slot a token lands in is computed on the device from its position;
- every slot's position is stored on the device, :data:`EMPTY` while it holds
  nothing, so the causal mask hides empty slots and rolled-back tokens alike
  and a rollback is a host-side length change;
- host work is split off: :meth:`reserve` (room checks, called by ``begin``)
  and ``end`` (the length) touch no tensor, so a graph replay calls them
  around the recorded kernels.

The price is attention over the whole buffer. For the full cache that is
``max_len`` slots every step, worth it only where launch overhead dominates;
the retrieval and streaming caches are small and fixed by design, which is
what lets TriForce run its drafts under CUDA graphs (its App. A).

Each class returns the same logits as its library counterpart (the tests
drive both through the same schedules). All batch rows share one length and
one set of positions, as in the library's caches.
"""

from __future__ import annotations

import torch

from ..engine.cache import KVCache, StaticCache, causal_mask
from ..engine.config import ModelConfig
from ..engine.rope import Angles, Rotary
from ..errors import require
from .retrieval import RetrievalCache
from .streaming import POSITION_MODES

EMPTY = 1 << 40  # stored position of a slot without a token: no query position reaches it


class StaticFullCache(StaticCache):
    """A :class:`StaticCache` whose steps attend to all ``max_len`` slots under a positional mask.

    A token's slot is its position, so positions must start at 0 and follow
    :attr:`length` (the model's default). ``keys(layer)`` and the buffers are
    laid out as in :class:`StaticCache`, so a :class:`RetrievalCache` builds
    from this cache too.
    """

    static_shapes = True

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(cfg, max_len, batch, dtype, device)
        self.pos.fill_(EMPTY)
        self._slots: torch.Tensor | None = None

    def reserve(self, n: int) -> None:
        """Host part of :meth:`begin`: check room for ``n`` tokens."""
        require(self.length + n <= self.max_len,
                f"step of {n} tokens does not fit: cache holds {self.length} of {self.max_len} slots; "
                f"create the cache with max_len >= {self.length + n}")
        self._new = n

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        self.reserve(positions.shape[1])
        self._slots = positions[0]
        self.pos.index_copy_(1, self._slots, positions)
        self._mask = causal_mask(positions, self.pos, self.window)
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k[layer].index_copy_(2, self._slots, k)
        self.v[layer].index_copy_(2, self._slots, v)
        return self.k[layer], self.v[layer], self._mask

    def reset(self) -> None:
        super().reset()
        self.pos.fill_(EMPTY)


class StaticRetrievalCache(RetrievalCache):
    """A :class:`RetrievalCache` whose level-2 steps attend to all ``budget + spec_slots`` slots.

    Which budget slots hold a token changes only at ``build`` and ``sync``, so
    it is copied into a device mask then; a speculative token's slot is
    ``budget + position - base`` with ``base`` on the device as well.
    """

    static_shapes = True

    def __init__(self, cfg: ModelConfig, budget: int, chunk_size: int, spec_slots: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 group_reduce: str = "sum", allow_full: bool = False):
        # device state first: the parent's constructor calls reset(), which fills it
        self._filled = torch.zeros(max(budget, 0), dtype=torch.bool, device=device)
        self._base = torch.zeros((), dtype=torch.long, device=device)
        self._slots: torch.Tensor | None = None
        super().__init__(cfg, budget, chunk_size, spec_slots, batch, dtype, device, group_reduce, allow_full)

    def reset(self) -> None:
        super().reset()
        self._refresh()

    def build(self, full: StaticCache, queries: dict[int, torch.Tensor]) -> None:
        super().build(full, queries)
        self._refresh()

    def sync(self, full: StaticCache) -> None:
        super().sync(full)
        self._refresh()

    def _refresh(self) -> None:
        """Mirror the host state that changes at build/sync into the device tensors a step reads."""
        self._filled.copy_(self.valid_slots())
        self._base.fill_(self.base)
        self.spec_pos.fill_(EMPTY)

    def reserve(self, t: int) -> None:
        """Host part of :meth:`begin`: the view is built and ``t`` tokens fit the speculative slots."""
        require(self.built, "build(full, queries) the retrieval view before running the model with it")
        require(self.spec + t <= self.spec_slots,
                f"a level-2 step of {t} tokens does not fit: {self.spec} of {self.spec_slots} speculative slots are "
                "used; sync(full) after each level-3 verification, or create the cache with "
                f"spec_slots >= {self.spec + t}")
        self._new = t

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        t = positions.shape[1]
        self.reserve(t)
        q = positions.to(self.device)
        spec_slot = q[0] - self._base
        self._slots = spec_slot + self.budget
        self.spec_pos.index_copy_(1, spec_slot, q)
        context = self._filled.expand(self.batch, t, -1)
        speculative = self.spec_pos[:, None, :] <= q[:, :, None]
        self._mask = torch.cat((context, speculative), dim=-1)[:, None]
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k[layer].index_copy_(2, self._slots, k)
        self.v[layer].index_copy_(2, self._slots, v)
        return self.k[layer], self.v[layer], self._mask


class StaticStreamingCache(KVCache):
    """StreamingLLM sinks + recent window over a ring buffer ``[batch, kv_heads, slots, head_dim]``.

    ``slots = sink + ring`` with ``ring = window + spec_slots``: position
    ``p`` lives in slot ``p`` below ``sink``, else in ``sink + (p - sink) mod
    ring``. Writing ``p`` overwrites ``p - ring``, which the window of any
    later query no longer needs as long as a step holds at most ``spec_slots +
    1`` tokens (prefill in chunks of that size) and a rollback undoes at most
    the tokens appended since the window it returns to was intact; a rollback
    that would need an overwritten token raises. Visibility and the two RoPE
    schemes (``positions``) are those of
    :class:`~sparsedraft.caches.StreamingCache`, computed from stored positions.
    """

    static_shapes = True

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
        self.ring = window + spec_slots
        self.slots = sink + self.ring
        self.rotary, self.keys_prerope = rotary, positions == "cache"
        self.model_window = cfg.sliding_window
        self.batch, self.dtype = batch, dtype
        shape = (batch, cfg.num_kv_heads, self.slots, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.device = self.k[0].device
        self.pos = torch.full((self.slots,), EMPTY, dtype=torch.long, device=self.device)
        self.reset()

    @property
    def max_step(self) -> int:
        """Most tokens one forward may hold."""
        return self.spec_slots + 1

    def reset(self) -> None:
        self.length = 0  # tokens seen (true position of the next token)
        self.high = 0  # one past the highest position ever written since reset
        self.pos.fill_(EMPTY)
        self._new = 0
        self._slot: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._key_angles: Angles | None = None

    def reserve(self, t: int) -> None:
        """Host part of :meth:`begin`: the step fits the ring."""
        require(1 <= t <= self.max_step,
                f"a step of {t} tokens does not fit the ring of {self.ring} slots: feed at most spec_slots + 1 = "
                f"{self.max_step} tokens per forward (prefill in chunks of that size)")
        self._new = t
        self.high = max(self.high, self.length + t)

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        self.reserve(positions.shape[1])
        s = self.sink
        q = positions.to(self.device)
        p = q[0]
        self._slot = torch.where(p < s, p, s + (p - s) % self.ring)
        self.pos.index_copy_(0, self._slot, p)
        k_pos = self.pos[None]  # [1, S]
        visible = (k_pos[:, None] <= q[:, :, None]) & (
            (k_pos[:, None] < s) | (k_pos[:, None] > q[:, :, None] - self.window))
        rope_q, rope_k = q, k_pos
        self._key_angles = None
        if self.keys_prerope:
            base = (q[:, :1] - self.window + 1).clamp_min(s)  # window start of the step's first query
            rope_q = torch.where(q < s, q, q - base + s)
            rope_k = torch.where(k_pos < s, k_pos, k_pos - base + s)
            self._key_angles = self.rotary.angles(rope_k, self.dtype)
        if self.model_window is not None:
            visible &= rope_k[:, None] > rope_q[:, :, None] - self.model_window
        self._mask = visible[:, None].expand(self.batch, -1, -1, -1)
        return rope_q

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k[layer].index_copy_(2, self._slot, k)
        self.v[layer].index_copy_(2, self._slot, v)
        keys = self.k[layer] if self._key_angles is None else self._key_angles.apply(self.k[layer])
        return keys, self.v[layer], self._mask

    def end(self) -> None:
        self.length += self._new
        self._new = 0

    def rollback(self, n: int) -> None:
        require(0 <= n <= self.length, f"cannot roll back {n} tokens from a cache of {self.length}")
        target = self.length - n
        require(max(self.sink, target - self.window + 1) >= self.high - self.ring,
                f"cannot roll back {n} tokens: the ring of {self.ring} slots already overwrote the window before "
                f"position {target}; create the cache with spec_slots >= the most tokens a speculation round "
                f"appends before rolling back (now {self.spec_slots})")
        self.length = target
