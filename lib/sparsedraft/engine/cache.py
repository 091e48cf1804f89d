"""KV caches: the only place that decides what a step attends to.

Every cache follows one protocol, driven by :meth:`Transformer.forward`:

1. ``begin(positions)`` once per forward with the new tokens' positions
   ``[B, T]``; returns the positions RoPE should use (true positions unless
   the cache re-rotates, like StreamingLLM's cache-relative mode).
2. ``attend(layer, k, v)`` per layer with the new keys/values
   ``[B, kv_heads, T, head_dim]``; stores them and returns
   ``(keys, values, mask)`` where keys/values are ``[B, kv_heads, S, head_dim]``
   views and ``mask`` is ``None`` (attend to all S), :data:`CAUSAL` (the T
   new tokens are the last T keys and each sees every key before it: plain
   decoding, verification and prefill chunks over a full cache, which lets
   the model use causal kernels that read no mask) or bool ``[B, 1, T, S]``.
   A quantised draft view may hand :class:`Int8Slots` instead of the two
   tensors, so the attention reads its int8 codes where a kernel can.
3. ``end()`` commits the T tokens.

``rollback(n)`` forgets the last n committed tokens (rejected drafts) and
``reset()`` empties the cache. The model never asks which policy it talks to.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import torch

from ..errors import require
from .config import ModelConfig


class Causal:
    """The mask of a full cache in order: the T new tokens are the last T of S keys, each attending to every
    key before it and to itself. :func:`causal_tail` is the same mask written out."""

    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = Causal()


class Int8Slots(NamedTuple):
    """Keys or values as a quantised draft view stores them: int8 ``codes`` [B, KV, N, D] times a ``scale`` per
    token [B, KV, N], then a full-precision ``tail`` [B, KV, S - N, D] (the step's new tokens and those since
    the view last took in the target's). ``dense()`` gives all S as one [B, KV, S, D] tensor of the model's dtype,
    for the paths without the fused kernel (``kernels.attend_int8``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    tail: torch.Tensor
    dense: Callable[[], torch.Tensor]


def causal_tail(t: int, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [1, 1, t, s]: :data:`CAUSAL` as a tensor (query i sees keys 0 .. s - t + i)."""
    return (torch.arange(s, device=device)[None] <= torch.arange(s - t, s, device=device)[:, None])[None, None]


def in_order(positions: torch.Tensor, stored: torch.Tensor) -> bool:
    """True when ``positions`` [B, T] rise strictly and follow every ``stored`` [B, S] position (then the
    positional causal mask is :data:`CAUSAL`)."""
    rising = positions.shape[1] == 1 or bool((positions[:, 1:] > positions[:, :-1]).all())
    return rising and (stored.shape[1] == 0 or bool((stored.amax(1) < positions[:, 0]).all()))


class KVCache:
    """Interface and shared bookkeeping; subclasses own the buffers (``k``, ``v``: one tensor per layer)."""

    keys_prerope = False  # True: the model hands keys unrotated and the cache rotates them

    @property
    def num_layers(self) -> int | None:
        """The layers this cache holds buffers for, or None for one that holds none per layer (a view that
        serves a forward of any depth). What a caller checks a model's depth against before the first step."""
        k = getattr(self, "k", None)
        return len(k) if isinstance(k, list) else None

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError

    def step_slots(self) -> tuple[int, int] | None:
        """(start, stop) where, after :meth:`begin`, this step's :meth:`attend` is exactly: its keys and values
        written at slots [start, stop) of ``k[layer]`` / ``v[layer]``, and every slot before stop attended
        causally (:data:`CAUSAL`); None otherwise. What lets a step run its layers in one C++ call
        (``engine/stack.py``)."""
        return None

    def step_codes(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                  int] | None:
        """For a step with :meth:`step_slots` whose first ``n`` slots are read as int8 codes instead of ``k`` /
        ``v`` (:class:`Int8Slots`): per layer the key codes [B, KV, n, D], key scales [B, KV, n], value codes and
        value scales, then ``n``; None where every slot is read from ``k`` / ``v``."""
        return None

    def end(self) -> None:
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [B, 1, T, S]: key visible when its position is <= the query's (and inside the window)."""
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return mask[:, None]


class StaticCache(KVCache):
    """Full KV cache over preallocated buffers ``[B, kv_heads, max_len, head_dim]`` per layer.

    Appending is an index write, rolling back is a length change, and the mask
    is built from stored positions, so rejected drafts need no copying.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        require(max_len > 0, f"cache max_len must be > 0, got {max_len}")
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.window = cfg.sliding_window
        self.max_len, self.batch, self.length = max_len, batch, 0
        self._new = 0
        self._mask: torch.Tensor | Causal | None = None

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        n = positions.shape[1]
        require(self.length + n <= self.max_len,
                f"prompt/step of {n} tokens does not fit: cache holds {self.length} of {self.max_len} slots; "
                f"create the cache with max_len >= {self.length + n}")
        end = self.length + n
        self._new = n
        windowed = self.window is not None and end > self.window
        ordered = not windowed and in_order(positions, self.pos[:, :self.length])
        self.pos[:, self.length:end] = positions
        self._mask = CAUSAL if ordered else causal_mask(positions, self.pos[:, :end], self.window)
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        start, end = self.length, self.length + self._new
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], self._mask

    def step_slots(self) -> tuple[int, int] | None:
        plain = self._mask is CAUSAL and type(self).attend is StaticCache.attend
        return (self.length, self.length + self._new) if plain else None

    def end(self) -> None:
        self.length += self._new
        self._new = 0

    def rollback(self, n: int) -> None:
        require(0 <= n <= self.length, f"cannot roll back {n} tokens from a cache of {self.length}")
        self.length -= n

    def reset(self) -> None:
        self.length = 0

    def keys(self, layer: int) -> torch.Tensor:
        """Committed keys of one layer, [B, kv_heads, length, head_dim] (a view)."""
        return self.k[layer][:, :, :self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer][:, :, :self.length]

    def state(self) -> dict[str, torch.Tensor]:
        """The committed tokens as views: ``k{layer}``/``v{layer}`` ``[B, kv_heads, length, head_dim]`` and
        ``pos`` ``[B, length]``; flat names, so the dict can go to safetensors as it is."""
        state = {"pos": self.pos[:, :self.length]}
        for layer in range(len(self.k)):
            state[f"k{layer}"], state[f"v{layer}"] = self.keys(layer), self.values(layer)
        return state

    def copy_into(self, other: "StaticCache") -> None:
        """Make ``other`` hold exactly this cache's tokens (a copy: this cache is never written)."""
        other.load_state(self.state())

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Hold exactly the tokens of ``state`` (from :meth:`state`), copied into this cache's buffers, so the
        cache it came from is never written: one prefill can seed any number of runs."""
        layers = len(self.k)
        names = {"pos", *(f"{kind}{layer}" for kind in "kv" for layer in range(layers))}
        require(set(state) == names, f"a cache state holds pos, k0..k{layers - 1} and v0..v{layers - 1} for this "
                                     f"cache's {layers} layers, got {sorted(state)}; it comes from another model")
        n = state["pos"].shape[-1]
        require(tuple(state["pos"].shape) == (self.batch, n),
                f"cache state pos is {tuple(state['pos'].shape)}, this cache takes [{self.batch}, tokens]")
        require(n <= self.max_len, f"a cache state of {n} tokens does not fit {self.max_len} slots; create the "
                                   f"cache with max_len >= {n}")
        expected = (self.batch, self.k[0].shape[1], n, self.k[0].shape[3])
        for name in names - {"pos"}:
            require(tuple(state[name].shape) == expected and state[name].dtype == self.k[0].dtype,
                    f"cache state {name} is {state[name].dtype} {tuple(state[name].shape)}, this cache takes "
                    f"{self.k[0].dtype} {expected}; it comes from another model, dtype or batch")
        for layer in range(layers):
            self.k[layer][:, :, :n] = state[f"k{layer}"]
            self.v[layer][:, :, :n] = state[f"v{layer}"]
        self.pos[:, :n] = state["pos"]
        self.length, self._new, self._mask = n, 0, None


class SequenceView(KVCache):
    """Stateless causal attention over the tokens of one forward (training, analysis).

    Holds no buffers, so it is autograd-friendly; ``extra_mask`` ([B, 1, T, T]
    bool, optional) further restricts what each query sees, e.g. a KV budget.
    """

    def __init__(self, window: int | None = None, extra_mask: torch.Tensor | None = None):
        self.window, self.extra_mask = window, extra_mask
        self._mask: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        self._mask = causal_mask(positions, positions, self.window)
        if self.extra_mask is not None:
            self._mask = self._mask & self.extra_mask
        return positions

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return k, v, self._mask

    def end(self) -> None:
        self._mask = None

    def rollback(self, n: int) -> None:
        require(n == 0, "a SequenceView keeps no state to roll back")

    def reset(self) -> None:
        self._mask = None


class RowCaches(KVCache):
    """A batch whose rows live in caches of their own: one forward over rows of any lengths and cache kinds.

    Row ``b`` of a ``[B, T]`` forward holds ``counts[b] <= T`` real tokens at
    the *end* of the step (the step is left-padded); only those reach
    ``rows[b]``, a batch-1 cache of any class, which keeps its own length,
    positions, mask and rollback. The model asks :meth:`attend_row` per row
    (see :class:`~sparsedraft.engine.model.Attention`), so each row's attention is the
    very call its batch-1 run makes. Padded queries get zeros; their outputs
    mean nothing and the caller drops them. Built per forward by
    :mod:`sparsedraft.speculative.lockstep`, which batches independent batch-1 decoders.
    """

    def __init__(self, rows: list[KVCache], counts: list[int]):
        require(len(rows) == len(counts) and rows, "RowCaches takes one cache and one token count per row")
        prerope = {row.keys_prerope for row in rows}
        require(len(prerope) == 1, "the rows of one forward must all store keys rotated, or all unrotated")
        self.rows, self.counts = rows, counts
        self.keys_prerope = prerope.pop()

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        t = positions.shape[1]
        require(all(1 <= n <= t for n in self.counts), f"row token counts {self.counts} must be in 1..{t}")
        rope = positions.clone()
        for b, (row, n) in enumerate(zip(self.rows, self.counts)):
            rope[b, t - n:] = row.begin(positions[b:b + 1, t - n:])[0].to(rope.device)
        return rope

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError("RowCaches attends row by row: the model calls attend_row")

    def attend_row(self, b: int, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Row ``b``'s real tokens of k, v ``[B, kv_heads, T, D]`` into its cache: (keys, values, mask) as
        ``rows[b].attend`` gives them, and the row's token count."""
        n = self.counts[b]
        t = k.shape[2]
        return (*self.rows[b].attend(layer, k[b:b + 1, :, t - n:], v[b:b + 1, :, t - n:]), n)

    def end(self) -> None:
        for row in self.rows:
            row.end()

    def rollback(self, n: int) -> None:
        raise NotImplementedError("roll back each row's own cache (rows[b].rollback)")

    def reset(self) -> None:
        for row in self.rows:
            row.reset()
