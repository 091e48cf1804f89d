"""Static-shape caches against the library's caches, and the CUDA-graph step wrapper.

On CPU: every static cache gives its counterpart's logits through schedules
of appends and rollbacks; the staticness checks refuse growing caches; the
wrapper's eager fallback equals the model. With CUDA (``gpu`` marker): the
replayed graph equals eager steps through the same schedules.
"""

import random

import pytest
import torch

from sparsedraft.engine.cache import StaticCache
from sparsedraft.caches import RetrievalCache, StreamingCache
from sparsedraft.caches.static import StaticFullCache, StaticRetrievalCache, StaticStreamingCache
from sparsedraft.engine.cudagraph import GraphedStep, check_static
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill import prefill
from sparsedraft.engine.model import Capture
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
BATCH = 2


def tokens(n: int, seed: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, n), generator=torch.Generator().manual_seed(seed)).to(device)


def streaming_schedule(seed: int, steps: int, most: int, rollback: int) -> list[tuple[str, int]]:
    """Appends of 1..most tokens, and now and then a rollback of up to ``rollback`` of the tokens just appended."""
    rng = random.Random(seed)
    ops, since = [], 0
    for i in range(steps):
        if i % 4 == 3 and since:
            n = rng.randint(0, min(rollback, since))
            ops.append(("rollback", n))
            since = 0
        else:
            n = rng.randint(1, most)
            ops.append(("append", n))
            since = n
    return ops


def drive(model, caches, schedule, device="cpu", step=None) -> None:
    """Run ``schedule`` through every cache in ``caches``; each append's logits must agree across caches."""
    length = 0
    sequence = tokens(400, seed=11, device=device)
    for i, (op, n) in enumerate(schedule):
        if op == "rollback":
            for cache in caches:
                cache.rollback(n)
            length -= n
            continue
        x = sequence[:, length:length + n]
        outs = [(step(cache, x) if step is not None and j > 0 else model(x, cache=cache))
                for j, cache in enumerate(caches)]
        tolerance = dict(atol=2e-5, rtol=1e-4) if device == "cpu" else dict(atol=1e-4, rtol=1e-3)
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], msg=f"step {i} ({op} {n})", **tolerance)
        length += n


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@torch.no_grad()
def test_static_full_cache_equals_static_cache(family):
    model = tiny_model(family, sliding_window=24) if family == "mistral" else tiny_model(family)
    schedule = [("append", 9), ("append", 1), ("append", 3), ("rollback", 2), ("append", 1)] * 6
    drive(model, [StaticCache(model.cfg, 80, BATCH), StaticFullCache(model.cfg, 80, BATCH)], schedule)


@pytest.mark.parametrize("positions", ["true", "cache"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_static_streaming_cache_equals_streaming_cache(family, positions):
    model = tiny_model(family)
    sink, window, spec = 2, 7, 3
    caches = [StreamingCache(model.cfg, sink, window, spec, BATCH, rotary=model.rotary, positions=positions),
              StaticStreamingCache(model.cfg, sink, window, spec, BATCH, rotary=model.rotary, positions=positions)]
    drive(model, caches, streaming_schedule(seed=3, steps=60, most=spec + 1, rollback=spec))
    assert caches[1].length == caches[0].length > caches[1].slots  # the ring wrapped several times


@torch.no_grad()
def test_static_streaming_cache_refuses_what_the_ring_cannot_hold():
    model = tiny_model("llama")
    cache = StaticStreamingCache(model.cfg, sink=2, window=5, spec_slots=2, batch=BATCH)
    with pytest.raises(SparsedraftError, match="at most spec_slots \\+ 1 = 3 tokens"):
        model(tokens(4, 0), cache=cache)
    for i in range(8):
        model(tokens(3, i), cache=cache)
    with pytest.raises(SparsedraftError, match="already overwrote the window"):
        cache.rollback(4)
    cache.rollback(3)


def built_views(model, context: int, budget: int, spec: int):
    """A full cache holding ``context`` tokens and a RetrievalCache and StaticRetrievalCache built from it."""
    full = StaticFullCache(model.cfg, 200, BATCH)
    capture = Capture(layers=set(range(model.cfg.num_layers)))
    prefill(model, full, tokens(400, seed=11)[:, :context], capture=capture)
    queries = {layer: q[:, :, -1] for layer, q in capture.queries.items()}
    views = [RetrievalCache(model.cfg, budget, 4, spec, BATCH), StaticRetrievalCache(model.cfg, budget, 4, spec, BATCH)]
    for view in views:
        view.build(full, queries)
    return full, views


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_static_retrieval_cache_equals_retrieval_cache_through_syncs(family):
    model = tiny_model(family)
    full, views = built_views(model, context=101, budget=32, spec=6)
    sequence = tokens(400, seed=11)
    for _ in range(16):  # level-2 rounds: steps, a rollback, the full cache commits, both views sync
        drive(model, views, [("append", 1), ("append", 2), ("append", 1), ("rollback", 2)])
        model(sequence[:, full.length:views[0].length], cache=full)
        for view in views:
            view.sync(full)
    assert views[1].written == views[0].written > views[0].recent_capacity  # recent tokens wrapped around


def test_check_static_refuses_growing_caches():
    model = tiny_model("llama")
    with pytest.raises(SparsedraftError, match="StaticCache hands attention tensors whose shapes change"):
        check_static(model, StaticCache(model.cfg, 16))

    class Pretender(StaticCache):
        static_shapes = True

        def reserve(self, n: int) -> None:
            pass

    cache = Pretender(model.cfg, 16)
    with pytest.raises(SparsedraftError, match="claims static shapes but steps"):
        check_static(model, cache)
    with pytest.raises(SparsedraftError, match="is not a static-shape cache"):
        GraphedStep(model, StaticCache(model.cfg, 16), graph=True)


@torch.no_grad()
def test_check_static_accepts_static_caches_and_keeps_their_contents():
    model = tiny_model("llama")
    full = StaticFullCache(model.cfg, 40, BATCH)
    model(tokens(10, 0), cache=full)
    before = model(tokens(1, 1), cache=full)
    full.rollback(1)
    check_static(model, full, tokens=2, batch=BATCH)
    assert full.length == 10
    torch.testing.assert_close(model(tokens(1, 1), cache=full), before)
    streaming = StaticStreamingCache(model.cfg, 2, 5, 1, BATCH)
    model(tokens(2, 0), cache=streaming)
    check_static(model, streaming, tokens=1, batch=BATCH)
    _, views = built_views(model, context=60, budget=16, spec=4)
    check_static(model, views[1], tokens=2, batch=BATCH)


@torch.no_grad()
def test_graphed_step_without_cuda_runs_the_model_eagerly():
    model = tiny_model("qwen3")
    cache = StaticStreamingCache(model.cfg, 2, 6, 2, BATCH, rotary=model.rotary, positions="cache")
    reference = StreamingCache(model.cfg, 2, 6, 2, BATCH, rotary=model.rotary, positions="cache")
    step = GraphedStep(model, cache, tokens=1, batch=BATCH)
    assert not step.graphed and not step.captured
    drive(model, [reference, cache], streaming_schedule(seed=5, steps=30, most=1, rollback=2),
          step=lambda c, x: step(x))
    with pytest.raises(SparsedraftError, match="built for tokens of shape \\(2, 1\\)"):
        step(tokens(2, 0))
    if not torch.cuda.is_available():
        with pytest.raises(SparsedraftError, match="needs the model on a CUDA device"):
            GraphedStep(model, cache, graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_graph_replay_equals_eager_steps_on_cuda():
    model = tiny_model("llama").cuda()
    sink, window, spec = 2, 7, 3
    eager = StreamingCache(model.cfg, sink, window, spec, BATCH, device="cuda", rotary=model.rotary, positions="cache")
    static = StaticStreamingCache(model.cfg, sink, window, spec, BATCH, device="cuda", rotary=model.rotary,
                                  positions="cache")
    step = GraphedStep(model, static, tokens=1, batch=BATCH)
    drive(model, [eager, static], streaming_schedule(seed=7, steps=60, most=1, rollback=spec), device="cuda",
          step=lambda c, x: step(x))
    assert step.captured
    full = StaticFullCache(model.cfg, 200, BATCH, device="cuda")
    reference = StaticCache(model.cfg, 200, BATCH, device="cuda")
    for cache in (full, reference):
        model(tokens(50, 1, "cuda"), cache=cache)
    two = GraphedStep(model, full, tokens=2, batch=BATCH)
    drive(model, [reference, full], [("append", 2), ("rollback", 1), ("append", 2)] * 10, device="cuda",
          step=lambda c, x: two(x))
