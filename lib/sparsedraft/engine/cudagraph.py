"""CUDA graphs for fixed-size steps: capture one forward of ``T`` tokens over a static-shape cache, replay it.

Why: a decode step of a small model (TriForce's 68M draft) or over a small
cache (its 4K retrieval view) launches hundreds of short kernels, and the
launches, not the bytes, set its time. A CUDA graph records those kernels
once and replays them with one launch; TriForce's App. A runs its drafts this
way. A replay repeats the recorded kernels with the recorded shapes and the
Python values of the capture, so the cache must be one whose step reads only
device tensors (see :mod:`sparsedraft.caches.static`): ``static_shapes =
True``, and its host-side work split into ``reserve(t)`` (checks, before the
step) and ``end()`` (the length, after it), which :class:`GraphedStep` calls
around each replay.

:func:`check_static` tests that promise where it can be tested without a
GPU: two eager steps at different lengths must hand attention tensors of the
same shapes (a :class:`~sparsedraft.engine.cache.StaticCache` fails: its keys grow).
Without CUDA, or with ``graph=False``, :class:`GraphedStep` runs the same
forward eagerly, so every caller has one code path on every device.
"""

from __future__ import annotations

import torch

from ..errors import require
from .cache import KVCache
from .model import Transformer

Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]


class _ShapeRecorder(KVCache):
    """Passes every call to ``inner`` and records the shapes its ``attend`` returns."""

    def __init__(self, inner: KVCache):
        self.inner = inner
        self.keys_prerope = inner.keys_prerope
        self.shapes: list[Shapes] = []

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        return self.inner.begin(positions)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        keys, values, mask = self.inner.attend(layer, k, v)
        self.shapes.append((tuple(keys.shape), tuple(values.shape), tuple(getattr(mask, "shape", (repr(mask),)))))
        return keys, values, mask

    def end(self) -> None:
        self.inner.end()


def next_positions(cache: KVCache, tokens: int, batch: int, device: torch.device) -> torch.Tensor:
    """Positions ``[batch, tokens]`` continuing from ``cache.length`` (the model's default)."""
    start = cache.length
    return torch.arange(start, start + tokens, device=device)[None].expand(batch, -1)


@torch.inference_mode()
def check_static(model: Transformer, cache: KVCache, tokens: int = 1, batch: int = 1) -> None:
    """Raise unless ``cache`` promises static shapes and keeps them for steps of ``tokens`` tokens.

    Runs a step of random tokens at the cache's length and another one token
    later, rolling everything back (``tokens + 1`` tokens at most beyond the
    length, so the cache needs that much room and rollback); its committed
    contents are unchanged (static caches hide rolled-back slots by position).
    """
    name = type(cache).__name__
    require(getattr(cache, "static_shapes", False) and hasattr(cache, "reserve"),
            f"{name} hands attention tensors whose shapes change from step to step, so a CUDA graph cannot "
            "replay its steps; use a static-shape cache (sparsedraft.caches.static: StaticFullCache, "
            "StaticRetrievalCache, StaticStreamingCache)")

    def random_step(n: int, cache_view: KVCache) -> None:
        ids = torch.randint(0, model.cfg.vocab_size, (batch, n), device=model.device)
        model(ids, next_positions(cache, n, batch, model.device), cache_view)

    seen = []
    for later in (0, 1):
        if later:
            random_step(1, cache)
        recorder = _ShapeRecorder(cache)
        random_step(tokens, recorder)
        cache.rollback(tokens)
        seen.append(recorder.shapes)
    cache.rollback(1)
    require(seen[0] == seen[1],
            f"{name} claims static shapes but steps of {tokens} token(s) one position apart attended to different "
            f"shapes ({seen[0][0]} then {seen[1][0]} in layer 0: keys, values, mask); a CUDA graph cannot replay it")


class GraphedStep:
    """``model(tokens, positions, cache)`` for a fixed ``[batch, tokens]`` shape, replayed from a CUDA graph.

    Call it like the model: ``step(ids, positions=None)`` returns logits
    ``[batch, tokens, vocab]`` (a fresh tensor; positions default to the
    cache's length onwards). The graph is captured at the first call, after
    warm-up forwards on a side stream whose tokens are rolled back, so the
    cache must have room for them. ``graph=None`` uses a graph on CUDA and
    runs eagerly elsewhere; ``graph=False`` always runs eagerly (same
    results, for comparison). The graph holds the cache's buffers: keep using
    this cache object (``reset``, ``build``, ``sync`` and ``rollback`` are
    fine; they change contents in place) and build a new step for another.
    The cache must be static-shape on every device, so code tried on CPU
    runs unchanged under a graph.
    """

    def __init__(self, model: Transformer, cache: KVCache, tokens: int = 1, batch: int = 1,
                 graph: bool | None = None, warmup: int = 2):
        require(tokens >= 1 and batch >= 1, f"tokens and batch must be >= 1, got {tokens} and {batch}")
        require(warmup >= 1, f"warmup must be >= 1 forward before a capture, got {warmup}")
        require(getattr(cache, "static_shapes", False) and hasattr(cache, "reserve"),
                f"{type(cache).__name__} is not a static-shape cache, so its steps cannot be replayed from a CUDA "
                "graph; use one from sparsedraft.caches.static")
        on_cuda = model.device.type == "cuda"
        self.graphed = on_cuda if graph is None else graph
        require(not self.graphed or on_cuda,
                f"a CUDA graph needs the model on a CUDA device, but it is on {model.device}; use graph=None or False")
        self.model, self.cache, self.tokens, self.batch, self.warmup = model, cache, tokens, batch, warmup
        self._ids = torch.zeros(batch, tokens, dtype=torch.long, device=model.device)
        self._positions = torch.zeros(batch, tokens, dtype=torch.long, device=model.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        require(tuple(ids.shape) == (self.batch, self.tokens),
                f"this step was built for tokens of shape {(self.batch, self.tokens)}, got {tuple(ids.shape)}; "
                "build one GraphedStep per step shape")
        if positions is None:
            positions = next_positions(self.cache, self.tokens, self.batch, self.model.device)
        if not self.graphed:
            return self.model(ids, positions, self.cache)
        self._ids.copy_(ids)
        self._positions.copy_(positions.expand(self.batch, -1))
        if self._graph is None:
            self._capture()
        self.cache.reserve(self.tokens)
        self._graph.replay()
        self.cache.end()
        return self._logits.clone()

    def _capture(self) -> None:
        check_static(self.model, self.cache, self.tokens, self.batch)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.model(self._ids, self._positions, self.cache)
                self.cache.rollback(self.tokens)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._logits = self.model(self._ids, self._positions, self.cache)
        self.cache.rollback(self.tokens)  # the capture ran the cache's host bookkeeping, not its kernels
