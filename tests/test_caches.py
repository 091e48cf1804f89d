"""StreamingCache, RetrievalCache and rebuild policies against hand-built references on tiny models."""

import pytest
import torch

from sparsedraft.engine.cache import CAUSAL, KVCache, SequenceView, StaticCache
from sparsedraft.caches import (AcceptanceBelow, EveryN, MovingAverage, Never, RetrievalCache, StreamingCache,
                                rebuild_policy)
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.model import Capture
from sparsedraft.engine.sampling import SamplingConfig, probabilities
from sparsedraft.speculative import DraftContext, RetrievalDrafter, Stopwatch, prefill_target
from sparsedraft.engine.tiny import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
BATCH = 2


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, n), generator=torch.Generator().manual_seed(seed))


def sink_window_mask(n: int, sink: int, window: int) -> torch.Tensor:
    """bool [B, 1, n, n]: query q sees keys p <= q with p < sink or p > q - window."""
    p = torch.arange(n)
    k, q = p[None], p[:, None]
    return ((k <= q) & ((k < sink) | (k > q - window)))[None, None].expand(BATCH, 1, n, n)


# Prefill in chunks of 7 (the third chunk overflows the buffer even after compaction: the
# concatenating path), then draft rounds of single tokens with rollbacks of up to spec_slots
# (which compact the buffer mid-round), and a two-token append as a decoder feeding accepted tokens.
SCHEDULE = [("append", 7), ("append", 7), ("append", 7), ("append", 3)] + [
    op for r in range(8) for op in (("append", 1), ("append", 1), ("append", 1), ("rollback", r % 4),
                                    ("append", 2 if r % 3 == 0 else 1))]


def run_schedule(model, cache, reference, sink: int, window: int) -> None:
    """Drive ``cache`` through SCHEDULE; after each append compare with ``reference(sequence)``."""
    sequence = torch.zeros(BATCH, 0, dtype=torch.long)
    for step, (op, n) in enumerate(SCHEDULE):
        if op == "rollback":
            cache.rollback(n)
            sequence = sequence[:, :sequence.shape[1] - n]
            continue
        new = tokens(n, seed=step)
        got = model(new, cache=cache)
        sequence = torch.cat((sequence, new), 1)
        want = reference(sequence)[:, -n:]
        torch.testing.assert_close(got, want, msg=f"step {step} ({op} {n})")
    assert cache.length == sequence.shape[1]
    assert cache.oldest > sink + window  # the schedule did evict


@torch.no_grad()
def test_streaming_true_positions_equal_full_forward_under_sink_window_mask():
    model = tiny_model("llama")
    sink, window = 2, 5
    cache = StreamingCache(model.cfg, sink, window, spec_slots=3, batch=BATCH)
    assert not cache.keys_prerope

    def reference(seq):
        return model(seq, cache=SequenceView(extra_mask=sink_window_mask(seq.shape[1], sink, window)))

    run_schedule(model, cache, reference, sink, window)


class ReRotatingReference(KVCache):
    """Keeps every token's pre-RoPE K/V and rotates by hand at StreamingLLM cache positions.

    One-token steps gather the visible keys (sinks, then the window) and rotate them at their
    index in that list, the query at the last index: StreamingLLM's definition. Multi-token steps
    use the documented rule: recent keys counted from the first query's window start.
    """

    keys_prerope = True

    def __init__(self, model, sink: int, window: int):
        self.rotary, self.dtype = model.rotary, model.dtype
        self.sink, self.window, self.length = sink, window, 0
        self.k = [None] * model.cfg.num_layers
        self.v = [None] * model.cfg.num_layers

    def begin(self, positions):
        t, n, s, w = positions.shape[1], self.length, self.sink, self.window
        if t == 1:
            self.index = torch.tensor(list(range(min(s, n + 1))) + list(range(max(s, n - w + 1), n + 1)))
            key_pos = torch.arange(len(self.index))
            query_pos = torch.full((BATCH, 1), len(self.index) - 1)
            self.mask = None
        else:
            self.index = torch.arange(n + t)
            base = max(s, n - w + 1)
            shift = lambda p: torch.where(p < s, p, p - base + s)  # noqa: E731
            key_pos, query_pos = shift(self.index), shift(positions)
            self.mask = sink_window_mask(n + t, s, w)[:, :, n:]
        self.angles = self.rotary.angles(key_pos[None].expand(BATCH, -1), self.dtype)
        self.new = t
        return query_pos

    def attend(self, layer, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat((self.k[layer][:, :, :self.length], k), 2)
            self.v[layer] = torch.cat((self.v[layer][:, :, :self.length], v), 2)
        return self.angles.apply(self.k[layer][:, :, self.index]), self.v[layer][:, :, self.index], self.mask

    def end(self):
        self.length += self.new

    def rollback(self, n):
        self.length -= n


@torch.no_grad()
def test_streaming_cache_positions_equal_hand_rotated_reference():
    model = tiny_model("qwen3")
    sink, window = 2, 5
    cache = StreamingCache(model.cfg, sink, window, spec_slots=3, batch=BATCH, rotary=model.rotary,
                           positions="cache")
    assert cache.keys_prerope
    reference = ReRotatingReference(model, sink, window)
    sequence_len = 0
    for step, (op, n) in enumerate(SCHEDULE):
        if op == "rollback":
            cache.rollback(n)
            reference.rollback(n)
            sequence_len -= n
            continue
        new = tokens(n, seed=step)
        torch.testing.assert_close(model(new, cache=cache), model(new, cache=reference), msg=f"step {step}")
        sequence_len += n
    assert cache.length == reference.length == sequence_len
    assert cache.oldest > sink + window


@pytest.mark.parametrize("positions", ["true", "cache"])
@torch.no_grad()
def test_streaming_with_window_covering_the_sequence_equals_full_cache(positions):
    model = tiny_model("qwen2")
    seq = tokens(30, seed=1)
    full = model.new_cache(30, BATCH)
    cache = StreamingCache(model.cfg, sink=4, window=30, spec_slots=2, batch=BATCH, rotary=model.rotary,
                           positions=positions)
    for start, stop in [(0, 11), (11, 22), (22, 25), (25, 26), (26, 28), (28, 30)]:
        torch.testing.assert_close(model(seq[:, start:stop], cache=cache), model(seq[:, start:stop], cache=full))


@pytest.mark.parametrize("positions", ["true", "cache"])
@torch.no_grad()
def test_streaming_prompt_in_one_forward_uses_true_positions(positions):
    # The prompt overflows the buffer before the sinks are even stored; in 'cache' mode a
    # single forward counts recent tokens from the sink, i.e. at their true positions.
    model = tiny_model("mistral")
    sink, window = 2, 5
    seq = tokens(30, seed=2)
    cache = StreamingCache(model.cfg, sink, window, spec_slots=1, batch=BATCH, rotary=model.rotary,
                           positions=positions)
    want = model(seq, cache=SequenceView(extra_mask=sink_window_mask(30, sink, window)))
    torch.testing.assert_close(model(seq, cache=cache), want)
    assert cache.oldest == 30 - cache.keep


def test_streaming_rollback_past_the_kept_window_is_an_error():
    model = tiny_model("llama")
    cache = StreamingCache(model.cfg, sink=2, window=4, spec_slots=1, batch=BATCH)
    with torch.no_grad():
        for step in range(30):
            model(tokens(1, seed=step), cache=cache)
    cache.rollback(1)  # always allowed right after an append
    with pytest.raises(SparsedraftError, match="evicted"):
        for _ in range(10):
            cache.rollback(1)


def test_streaming_validation():
    cfg = tiny_model("llama").cfg
    with pytest.raises(SparsedraftError, match="rotary"):
        StreamingCache(cfg, 4, 16, 2, positions="cache")
    with pytest.raises(SparsedraftError, match="positions must be one of"):
        StreamingCache(cfg, 4, 16, 2, positions="relative")
    with pytest.raises(SparsedraftError, match="window"):
        StreamingCache(cfg, 4, 0, 2)
    with pytest.raises(SparsedraftError, match="spec_slots"):
        StreamingCache(cfg, 4, 16, -1)


# ---------------------------------------------------------------- retrieval


def naive_chunks(keys, query, chunk_size, budget, reduce):
    """Loop reference: chunk ids [B, kv_heads, kept], chunk 0 first, then by score descending."""
    b_size, kv, length, _ = keys.shape
    group = query.shape[1] // kv
    n = length // chunk_size
    kept = min(budget // chunk_size, n)
    out = []
    for b in range(b_size):
        row = []
        for h in range(kv):
            scores = []
            for c in range(n):
                mean = keys[b, h, c * chunk_size:(c + 1) * chunk_size].double().mean(0)
                per_head = [float(query[b, h * group + g].double() @ mean) for g in range(group)]
                scores.append(sum(per_head) if reduce == "sum" else max(per_head))
            row.append([0] + sorted(range(1, n), key=lambda c: -scores[c])[:kept - 1])
        out.append(row)
    return torch.tensor(out, dtype=torch.long)


def random_full_cache(cfg, length, max_len=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = StaticCache(cfg, max_len, BATCH)
    for layer in range(cfg.num_layers):
        full.k[layer].copy_(torch.randn(full.k[layer].shape, generator=gen))
        full.v[layer].copy_(torch.randn(full.v[layer].shape, generator=gen))
    full.length = length
    return full


def random_queries(cfg, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(BATCH, cfg.num_heads, cfg.head_dim, generator=gen)
            for layer in range(cfg.num_layers)}


@pytest.mark.parametrize("family", ["llama", "mistral"])  # GQA groups of 2 and 4 query heads
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_chunk_selection_equals_naive_loop(family, reduce):
    cfg = tiny_model(family).cfg
    full, queries = random_full_cache(cfg, length=45), random_queries(cfg)  # 11 chunks of 4 + 1 token
    view = RetrievalCache(cfg, budget=16, chunk_size=4, spec_slots=4, batch=BATCH, group_reduce=reduce)
    view.build(full, queries)
    for layer in range(cfg.num_layers):
        want = naive_chunks(full.keys(layer), queries[layer], 4, 16, reduce)
        assert torch.equal(view.chosen[layer], want)
        for b in range(BATCH):
            for h in range(cfg.num_kv_heads):
                for rank, chunk in enumerate(want[b, h].tolist()):
                    stop = 4 if rank < 3 else 3  # slot 15 holds the partial chunk's token
                    assert torch.equal(view.k[layer][b, h, rank * 4:rank * 4 + stop],
                                       full.k[layer][b, h, chunk * 4:chunk * 4 + stop])
        assert torch.equal(view.k[layer][:, :, 15], full.k[layer][:, :, 44])
        assert torch.equal(view.v[layer][:, :, 15], full.v[layer][:, :, 44])
    assert view.length == 45 and view.builds == 1 and view.scanned_tokens == 45


def test_recent_selection_is_sinks_plus_the_latest_chunks():
    """group_reduce="recent": StreamingLLM (the sink chunk and a recent window) as a view of the full cache."""
    cfg = tiny_model("llama").cfg
    full = random_full_cache(cfg, length=45)  # 11 complete chunks of 4 + 1 token
    view = RetrievalCache(cfg, budget=16, chunk_size=4, spec_slots=4, batch=BATCH, group_reduce="recent")
    view.build(full, random_queries(cfg))
    for layer in range(cfg.num_layers):
        assert view.chosen[layer].tolist() == [[[0, 10, 9, 8]] * cfg.num_kv_heads] * BATCH
        assert torch.equal(view.k[layer][:, :, 4:8], full.k[layer][:, :, 40:44])  # the newest complete chunk


def test_sync_writes_new_tokens_over_the_least_important_slots():
    cfg = tiny_model("llama").cfg
    budget, chunk = 12, 4
    full = random_full_cache(cfg, length=18)  # 4 complete chunks + 2 recent tokens
    view = RetrievalCache(cfg, budget=budget, chunk_size=chunk, spec_slots=3, batch=BATCH)
    view.build(full, random_queries(cfg))
    retrieved = {slot: view.k[0][:, :, slot].clone() for slot in range(budget)}
    expected = {}  # slot -> full-cache position, simulating the documented ring
    recent = list(range(16, 18))

    def check(committed):
        for i, position in enumerate(recent):
            expected[budget - 1 - i % (budget - chunk)] = position
        for slot in range(budget):
            want = full.k[0][:, :, expected[slot]] if slot in expected else retrieved[slot]
            assert torch.equal(view.k[0][:, :, slot], want), f"slot {slot}"
        assert view.length == committed and view.spec == 0
        assert bool(view.valid_slots().all())

    check(18)
    with torch.no_grad():
        view.begin(torch.tensor([[18, 19]] * BATCH))  # a level-2 step, later cleared by sync
        view.end()
    assert view.spec == 2
    full.length = 21
    view.sync(full)
    recent += [18, 19, 20]
    check(21)
    full.length = 33  # more than the 8 non-sink slots: only the newest 8 survive
    view.sync(full)
    recent += list(range(21, 33))
    check(33)
    assert view.syncs == 2 and view.synced_tokens == 15
    assert torch.equal(view.k[0][:, :, :chunk], full.k[0][:, :, :chunk])  # the sink chunk never moves


class SelectedTokensReference(KVCache):
    """Attends, per layer and KV head, to an explicit list of full-cache positions plus new tokens."""

    def __init__(self, full, positions):
        index = [p[..., None].expand(-1, -1, -1, full.k[0].shape[-1]) for p in positions]
        self.k = [full.k[layer].gather(2, i) for layer, i in enumerate(index)]
        self.v = [full.v[layer].gather(2, i) for layer, i in enumerate(index)]
        self.length = full.length

    def begin(self, positions):
        t = positions.shape[1]
        self.new = t
        context = self.k[0].shape[2]
        s = torch.arange(context + t)
        self.mask = ((s[None] < context) | (s[None] - context <= torch.arange(t)[:, None]))[None, None]
        self.mask = self.mask.expand(positions.shape[0], 1, t, -1)
        return positions

    def attend(self, layer, k, v):
        self.k[layer] = torch.cat((self.k[layer], k), 2)
        self.v[layer] = torch.cat((self.v[layer], v), 2)
        return self.k[layer], self.v[layer], self.mask

    def end(self):
        self.length += self.new

    def rollback(self, n):
        self.length -= n
        self.k = [k[:, :, :k.shape[2] - n] for k in self.k]
        self.v = [v[:, :, :v.shape[2] - n] for v in self.v]


def prefill_with_queries(model, prompt, max_len):
    """Full cache of ``prompt`` and the last token's post-RoPE queries per layer."""
    full = model.new_cache(max_len, BATCH)
    capture = Capture(layers=set(range(model.cfg.num_layers)))
    model(prompt, cache=full, capture=capture)
    return full, {layer: q[:, :, -1] for layer, q in capture.queries.items()}


TOLERANCE = {torch.float32: {}, torch.bfloat16: {"atol": 0.05, "rtol": 0.05}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_budget_covering_the_context_gives_the_full_cache_logits(family, dtype):
    model = tiny_model(family, dtype=dtype)
    seq = tokens(34, seed=3)
    full, queries = prefill_with_queries(model, seq[:, :22], max_len=40)  # 5 chunks of 4 + 2
    view = RetrievalCache(model.cfg, budget=32, chunk_size=4, spec_slots=4, batch=BATCH, dtype=dtype,
                          allow_full=True)
    view.build(full, queries)
    tol = TOLERANCE[dtype]

    def level2(chunk):
        """The view runs ahead of the full cache, which checks the same tokens and forgets them."""
        want = model(chunk, cache=full)
        full.rollback(chunk.shape[1])
        return model(chunk, cache=view), want

    torch.testing.assert_close(*level2(seq[:, 22:25]), **tol)
    view.rollback(1)
    model(seq[:, 22:24], cache=full)
    torch.testing.assert_close(*level2(seq[:, 25:26]), **tol)
    model(seq[:, 25:26], cache=full)  # level 3 committed 22, 23 and 25
    view.sync(full)
    assert view.length == full.length == 25
    torch.testing.assert_close(*level2(seq[:, 26:28]), **tol)
    view.rollback(2)
    torch.testing.assert_close(*level2(seq[:, 28:29]), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_sparse_view_attends_to_the_selected_chunks_and_recent_tokens(family, dtype):
    model = tiny_model(family, dtype=dtype)
    seq = tokens(46, seed=4)
    budget, chunk = 16, 4
    full, queries = prefill_with_queries(model, seq[:, :42], max_len=48)  # 10 chunks of 4 + 2 recent
    view = RetrievalCache(model.cfg, budget=budget, chunk_size=chunk, spec_slots=4, batch=BATCH, dtype=dtype,
                          group_reduce="max")
    view.build(full, queries)
    selected = []
    for layer in range(model.cfg.num_layers):
        chunks = naive_chunks(full.keys(layer), queries[layer], chunk, budget, "max")
        assert torch.equal(view.chosen[layer], chunks)
        tokens_kept = (chunks[..., None] * chunk + torch.arange(chunk)).flatten(2)[..., :budget - 2]
        selected.append(torch.cat((tokens_kept, torch.tensor([40, 41]).expand(BATCH, model.cfg.num_kv_heads, 2)), 2))
    reference = SelectedTokensReference(full, selected)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(model(seq[:, 42:45], cache=view), model(seq[:, 42:45], cache=reference), **tol)
    view.rollback(2)
    reference.rollback(2)
    torch.testing.assert_close(model(seq[:, 43:44], cache=view), model(seq[:, 43:44], cache=reference), **tol)


@torch.no_grad()
def test_a_filled_view_hands_the_causal_marker_and_a_filling_one_a_mask(monkeypatch):
    """A view whose budget is full has the full-cache layout (every slot, then causal speculative tokens): it must
    say CAUSAL so its steps take the decode kernel like the full cache; while slots are empty it needs its mask.
    Layer by layer, where the attention calls are seen (a filled view's steps otherwise run the whole stack in one
    call: tests/test_layer_stack.py)."""
    import sparsedraft.engine.model as model_module
    from sparsedraft.engine import stack
    monkeypatch.setattr(stack, "_ON", False)
    seen = []
    real = model_module.attention
    monkeypatch.setattr(model_module, "attention", lambda q, k, v, mask, *a, **kw: seen.append(mask) or
                        real(q, k, v, mask, *a, **kw))
    model = tiny_model("llama")
    seq = tokens(46, seed=4)
    full, queries = prefill_with_queries(model, seq[:, :42], max_len=48)
    view = RetrievalCache(model.cfg, budget=16, chunk_size=4, spec_slots=4, batch=BATCH)
    view.build(full, queries)
    for step in (seq[:, 42:45], seq[:, 45:46]):  # a 3-token level-2 verification, then one more token
        seen.clear()
        model(step, cache=view)
        assert seen and all(mask is CAUSAL for mask in seen)
    short, short_queries = prefill_with_queries(model, seq[:, :22], max_len=40)
    filling = RetrievalCache(model.cfg, budget=32, chunk_size=4, spec_slots=4, batch=BATCH, allow_full=True)
    filling.build(short, short_queries)
    seen.clear()
    model(seq[:, 22:24], cache=filling)
    assert seen and all(isinstance(mask, torch.Tensor) for mask in seen)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_retrieval_drafter_view_holds_the_last_prompt_token_once(family):
    """TriForce's selection: the last prompt token's query over every prompt key, its own included."""
    model = tiny_model(family)
    prompt = tokens(42, seed=6)[:1]  # 10 chunks of 4 + 2 recent tokens: the last prompt token is recent
    state = prefill_target(model, prompt, max_new_tokens=4, capture=True)
    full, chunk = state.cache, 4
    drafter = RetrievalDrafter(model, RetrievalCache(model.cfg, budget=16, chunk_size=chunk, spec_slots=4))
    drafter.start(prompt[0], state, DraftContext(SamplingConfig(), None, Stopwatch()))
    view = drafter.cache
    assert view.length == full.length == 42 and drafter.pending == []
    valid = view.valid_slots()
    for layer in range(model.cfg.num_layers):
        last = full.keys(layer)[0, :, 41]  # [kv_heads, D]
        held = (view.k[layer][0, :, :view.budget][:, valid] == last[:, None]).all(-1).sum(-1)
        assert held.tolist() == [1] * model.cfg.num_kv_heads
    selected = []
    for layer in range(model.cfg.num_layers):
        chunks = naive_chunks(full.keys(layer), state.queries[layer], chunk, 16, "sum")
        kept = (chunks[..., None] * chunk + torch.arange(chunk)).flatten(2)[..., :14]
        selected.append(torch.cat((kept, torch.tensor([40, 41]).expand(1, model.cfg.num_kv_heads, 2)), 2))
    first = drafter.propose(1)  # from the target's prefill logits: no forward feeds token 41 again
    assert torch.equal(first.q[0], probabilities(state.logits, SamplingConfig())) and view.spec == 0
    reference = SelectedTokensReference(full, selected)
    nxt = first.tokens[None]  # the next query, at position 42, over the selected chunks + tokens 40 and 41
    torch.testing.assert_close(model(nxt, torch.tensor([42]), view), model(nxt, torch.tensor([42]), reference))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@torch.no_grad()
def test_caches_follow_the_model_device(device):
    model = tiny_model("qwen2", dtype=torch.bfloat16).to(device)
    seq = tokens(34, seed=5).to(device)
    full, queries = prefill_with_queries(model, seq[:, :30], max_len=34)
    view = RetrievalCache(model.cfg, budget=32, chunk_size=4, spec_slots=4, batch=BATCH, dtype=model.dtype,
                          device=device, allow_full=True)
    view.build(full, queries)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(model(seq[:, 30:33], cache=view), model(seq[:, 30:33], cache=full), **tol)
    for positions in ("true", "cache"):
        cache = StreamingCache(model.cfg, 4, 34, 2, BATCH, model.dtype, device, model.rotary, positions)
        got = torch.cat([model(seq[:, start:stop], cache=cache) for start, stop in ((0, 16), (16, 33))], 1)
        torch.testing.assert_close(got, model(seq[:, :33]), **tol)


def test_retrieval_validation():
    model = tiny_model("llama")
    cfg = model.cfg
    with pytest.raises(SparsedraftError, match="multiple of chunk_size"):
        RetrievalCache(cfg, budget=30, chunk_size=8, spec_slots=2)
    with pytest.raises(SparsedraftError, match="chunk_size must be >= 1"):
        RetrievalCache(cfg, budget=30, chunk_size=0, spec_slots=2)
    with pytest.raises(SparsedraftError, match="spec_slots"):
        RetrievalCache(cfg, budget=32, chunk_size=8, spec_slots=0)
    with pytest.raises(SparsedraftError, match="sink chunk"):
        RetrievalCache(cfg, budget=8, chunk_size=8, spec_slots=2)
    with pytest.raises(SparsedraftError, match="group_reduce"):
        RetrievalCache(cfg, budget=32, chunk_size=8, spec_slots=2, group_reduce="mean")
    view = RetrievalCache(cfg, budget=16, chunk_size=4, spec_slots=2, batch=BATCH)
    with pytest.raises(SparsedraftError, match="build"):
        view.begin(torch.zeros(BATCH, 1, dtype=torch.long))
    queries = random_queries(cfg)
    with pytest.raises(SparsedraftError, match="use a budget smaller than the context"):
        view.build(random_full_cache(cfg, length=16), queries)
    full = random_full_cache(cfg, length=30)
    with pytest.raises(SparsedraftError, match="one tensor per layer"):
        view.build(full, {0: queries[0]})
    with pytest.raises(SparsedraftError, match="capture.queries"):
        view.build(full, {layer: q[:, :, None] for layer, q in queries.items()})
    view.build(full, queries)
    with torch.no_grad():
        with pytest.raises(SparsedraftError, match="spec_slots >= 3"):
            model(tokens(3, seed=0), cache=view)
        model(tokens(2, seed=0), cache=view)
    with pytest.raises(SparsedraftError, match="cannot roll back 3"):
        view.rollback(3)
    full.length = 20
    with pytest.raises(SparsedraftError, match="rebuild"):
        view.sync(full)


# ---------------------------------------------------------------- rebuild policies


def test_rebuild_policies_parse_and_decide():
    assert rebuild_policy("never") == Never()
    assert rebuild_policy("every:64") == EveryN(64)
    assert rebuild_policy("accept<0.6") == AcceptanceBelow(0.6)
    assert rebuild_policy(" Accept<0.5:4 ") == AcceptanceBelow(0.5, 4)
    assert not Never().should_rebuild(10 ** 6, 0.0)
    assert not EveryN(64).should_rebuild(63, None) and EveryN(64).should_rebuild(64, None)
    policy = AcceptanceBelow(0.6, window=2)
    average = MovingAverage(policy.acceptance_window)
    average.add(0.2)
    assert average.value is None and not policy.should_rebuild(5, average.value)
    average.add(0.9)
    assert average.value == pytest.approx(0.55) and policy.should_rebuild(5, average.value)
    average.add(0.9)
    assert average.value == pytest.approx(0.9) and not policy.should_rebuild(5, average.value)
    average.reset()
    assert average.value is None
    assert Never().acceptance_window == EveryN(3).acceptance_window == 1


@pytest.mark.parametrize("spec, message", [("sometimes", "unknown rebuild policy"), ("every:x", "cannot read"),
                                           ("every:0", "must be >= 1"), ("accept<1.5", r"\(0, 1\]"),
                                           ("accept<0.5:0", "window")])
def test_rebuild_policy_errors(spec, message):
    with pytest.raises(SparsedraftError, match=message):
        rebuild_policy(spec)
