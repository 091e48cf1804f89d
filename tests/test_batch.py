"""Batches: rows of any length decoded in lockstep give, row by row, exactly their batch-1 runs.

Checked here: one RowCaches forward gives each row the bits of its batch-1
forward; batched plain decoding equals batch-1 plain decoding; every method's
batched greedy output equals each row's plain greedy output; a sampled row
equals its batch-1 run with seed + row and keeps the target law (chi-square,
with an always-accept mutant that must fail); bad batches fail before any
forward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from table_models import always_accept, chi_square_pvalue
from test_decode import OPTIONS  # every method, with budgets small enough for short prompts

from sparsedraft import decode, load_model
from sparsedraft.engine import kernels
from sparsedraft.bench.comparison import CompareConfig, compare
from sparsedraft.engine.cache import RowCaches, StaticCache
from sparsedraft.caches import RetrievalCache, StreamingCache
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill import prefill
from sparsedraft.speculative.lockstep import run_rows
from sparsedraft.engine.model import Capture, Transformer
from sparsedraft.engine.sampling import SamplingConfig, probabilities
from sparsedraft.speculative import NgramDrafter, retrieval, standard_acceptance, triforce
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The best way to get startup ideas is not to try to think of startup ideas. " * k for k in (3, 4, 2)]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen2")


@pytest.fixture(scope="module")
def plain(model):
    """Each text's batch-1 greedy tokens."""
    return [decode(model, text, "ar", 40).tokens[0] for text in TEXTS]


def test_one_row_caches_forward_gives_every_row_its_batch1_logits():
    model = tiny_model("llama")
    lengths, steps = [30, 17, 24], [1, 4, 3]  # rows of different lengths, each step of its own size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen) for n in lengths]
    feeds = [torch.randint(0, model.cfg.vocab_size, (1, t), generator=gen) for t in steps]
    alone, rows = [], []
    for prompt, feed in zip(prompts, feeds):
        cache = model.new_cache(64)
        prefill(model, cache, prompt)
        copy = StaticCache(model.cfg, 64)
        copy.load_state(cache.state())
        with torch.inference_mode():
            alone.append(model(feed, cache=cache)[0])
        rows.append(copy)
    t = max(steps)
    tokens = torch.zeros(3, t, dtype=torch.long)
    positions = torch.zeros(3, t, dtype=torch.long)
    for b, (feed, cache) in enumerate(zip(feeds, rows)):
        tokens[b, t - steps[b]:] = feed[0]
        positions[b, t - steps[b]:] = torch.arange(cache.length, cache.length + steps[b])
    with torch.inference_mode():
        logits = model(tokens, positions, RowCaches(rows, steps))
    for b in range(3):
        got = logits[b, t - steps[b]:]
        if kernels.available():  # the row-exact kernels: bit for bit
            assert torch.equal(got, alone[b]), b
        else:
            torch.testing.assert_close(got, alone[b])
        assert rows[b].length == lengths[b] + steps[b]


def test_one_forward_mixes_cache_kinds_row_by_row():
    """A full cache, a StreamingLLM cache and a retrieval view in one forward: each row as at batch 1."""
    model = tiny_model("llama")
    cfg, layers = model.cfg, set(range(model.cfg.num_layers))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, 40), generator=gen)

    def kinds():
        full = model.new_cache(64)
        capture = Capture(layers=layers)
        prefill(model, full, prompt, capture=capture)
        streaming = StreamingCache(cfg, sink=4, window=16, spec_slots=8)
        prefill(model, streaming, prompt[:, :33])
        view = RetrievalCache(cfg, budget=16, chunk_size=4, spec_slots=8)
        view.build(full, {layer: q[:, :, -1] for layer, q in capture.queries.items()})
        return [full, streaming, view]

    steps = [2, 1, 3]
    feeds = [torch.randint(0, cfg.vocab_size, (1, t), generator=gen) for t in steps]
    with torch.inference_mode():
        alone = [model(feed, cache=cache)[0] for feed, cache in zip(feeds, kinds())]
        rows = kinds()
        t = max(steps)
        tokens, positions = torch.zeros(3, t, dtype=torch.long), torch.zeros(3, t, dtype=torch.long)
        for b, (feed, cache) in enumerate(zip(feeds, rows)):
            tokens[b, t - steps[b]:] = feed[0]
            positions[b, t - steps[b]:] = torch.arange(cache.length, cache.length + steps[b])
        logits = model(tokens, positions, RowCaches(rows, steps))
    for b in range(3):
        if kernels.available():
            assert torch.equal(logits[b, t - steps[b]:], alone[b]), b
        else:
            torch.testing.assert_close(logits[b, t - steps[b]:], alone[b])
    rows[0].rollback(1)  # per-row rollback is each row's own cache's
    assert [rows[0].length, rows[1].length, rows[2].spec] == [41, 34, 3]


def test_batched_plain_decoding_equals_batch1(model, plain):
    result = decode(model, TEXTS, "ar", 40)
    assert result.tokens.shape == (3, 40)
    for b in range(3):
        assert torch.equal(result.tokens[b], plain[b])
        assert torch.equal(result.rows[b].tokens[0], plain[b])
    assert result.lockstep.mean_rows == 3  # every decode step ran the three rows in one forward


STREAMING = {  # StreamingLLM in a batch: the target drafting for itself (MagicDec), TriForce's level 1
    "retrieval-recent": ("retrieval", {"budget": 64, "gamma": 3, "group_reduce": "recent"}),
    "spec-self-streaming": ("spec", {"draft": "self", "draft_cache": "streaming", "sink": 4, "window": 32, "gamma": 3}),
    "triforce-streaming": ("triforce", {"draft": "truncated:1", "budget": 64, "gamma1": 2, "gamma2": 4, "sink": 4,
                                        "window": 32}),
}


@pytest.mark.parametrize("method", sorted(OPTIONS) + sorted(STREAMING))
def test_batched_greedy_equals_each_rows_plain_greedy(model, plain, method):
    name, options = STREAMING.get(method, (method, OPTIONS.get(method)))
    result = decode(model, TEXTS, name, 40, **options)
    for b in range(3):
        assert torch.equal(result.tokens[b], plain[b]), (method, b)
    assert result.lockstep.mean_rows > 1  # forwards were shared, not run row after row
    if name != "ar":
        assert result.levels and sum(lvl.drafted for lvl in result.levels) == sum(
            lvl.drafted for r in result.rows for lvl in r.levels)


@pytest.mark.parametrize("method", ["ar", "retrieval", "triforce"])
def test_sampled_row_equals_its_batch1_run_with_seed_plus_row(model, method):
    result = decode(model, TEXTS, method, 30, temperature=0.8, top_p=0.9, seed=5, **OPTIONS[method])
    for b in range(3):
        alone = decode(model, TEXTS[b], method, 30, temperature=0.8, top_p=0.9, seed=5 + b, **OPTIONS[method])
        assert torch.equal(result.tokens[b], alone.tokens[0]), (method, b)


def test_padded_tensor_with_attention_mask_left_or_right(model, plain):
    ids = [torch.tensor(model_tokens) for model_tokens in
           (list(TEXTS[0].encode()), list(TEXTS[2].encode()))]  # tiny models read UTF-8 bytes
    width = max(len(i) for i in ids)
    for side in ("left", "right"):
        batch = torch.zeros(2, width, dtype=torch.long)
        mask = torch.zeros(2, width, dtype=torch.long)
        for b, row in enumerate(ids):
            span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            batch[b, span], mask[b, span] = row, 1
        result = decode(model, batch, "retrieval", 40, attention_mask=mask, **OPTIONS["retrieval"])
        assert torch.equal(result.tokens[0], plain[0]) and torch.equal(result.tokens[1], plain[2]), side


# ---- sampling law per row: real tiny transformers, two rows of different prompts ----------------

VOCAB = 8
PROMPTS = [torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 1, 4]]), torch.tensor([[2, 7, 1, 2, 7, 6, 0, 1, 2, 7]])]
SAMPLES = 1500
SAMPLING = SamplingConfig(temperature=1.0)


def law_models() -> tuple[Transformer, Transformer]:
    shape = dict(vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target, draft = tiny_model("qwen2", 0, **shape), tiny_model("qwen2", 3, **shape)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # random weights give near-uniform laws; sharpen them
    return target, draft


def pair_law(target: Transformer, prompt: torch.Tensor) -> dict:
    """The target's law of the first two tokens after ``prompt``."""
    def law(tokens):
        return probabilities(prefill(target, target.new_cache(tokens.shape[1]), tokens)[0], SAMPLING)
    first = law(prompt)
    return {(a, b): float(first[a] * law(torch.cat((prompt, torch.tensor([[a]])), 1))[b])
            for a in range(VOCAB) for b in range(VOCAB)}


def row_pvalues(decoder: str, acceptance) -> list[float]:
    target, draft = law_models()
    counts = [Counter() for _ in PROMPTS]

    def job(row, wrap, seed):
        cfg = SamplingConfig(SAMPLING.temperature, seed=seed)
        if decoder == "retrieval":
            return retrieval(wrap(target), PROMPTS[row], 3, cfg, gamma=2, budget=4, chunk_size=2,
                             acceptance=acceptance)
        return triforce(wrap(target), wrap(draft), PROMPTS[row], 3, cfg, gamma1=2, gamma2=2, budget=4,
                        chunk_size=2, sink=2, window=4, acceptance=acceptance)

    for n in range(SAMPLES):
        outs, _ = run_rows(lambda row, wrap: job(row, wrap, n * len(PROMPTS) + row), len(PROMPTS))
        for row, out in enumerate(outs):
            counts[row][tuple(out.tokens[0, :2].tolist())] += 1
    return [chi_square_pvalue(counts[row], pair_law(target, PROMPTS[row]), SAMPLES) for row in range(len(PROMPTS))]


@pytest.mark.parametrize("decoder", ["retrieval", "triforce"])
def test_every_row_keeps_the_target_law(decoder):
    assert min(row_pvalues(decoder, standard_acceptance)) > 0.01


def test_always_accept_mutant_fails_the_row_law():
    assert min(row_pvalues("triforce", always_accept)) < 0.01


# ---- bad input: one clear error before any forward ------------------------------------------------

class PadTokenizer:
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_padded_tensor_without_mask_is_refused(model, no_forward):
    batch = torch.tensor([[72, 105, 33, 33], [72, 105, 0, 0]])
    with pytest.raises(SparsedraftError, match="attention_mask"):
        decode(model, batch, "ar", 4, tokenizer=PadTokenizer())


@pytest.mark.parametrize("mask,words", [([[1, 0, 1], [1, 1, 1]], "not contiguous"), ([[0, 0, 0], [1, 1, 1]], "no real"),
                                        ([[1, 1], [1, 1]], "shape")])
def test_bad_attention_mask_is_refused(model, no_forward, mask, words):
    with pytest.raises(SparsedraftError, match=words):
        decode(model, torch.tensor([[65, 66, 67], [68, 69, 70]]), "ar", 4, attention_mask=torch.tensor(mask))


def test_batch_over_the_memory_cap_is_refused(model, no_forward):
    with pytest.raises(SparsedraftError, match=r"needs about .* GB .*fewer rows.*bfloat16"):
        decode(model, TEXTS, "retrieval", 40, max_memory="10KB", **OPTIONS["retrieval"])


def test_drafter_object_and_single_prefill_are_refused(model, no_forward):
    with pytest.raises(SparsedraftError, match="Drafter object follows one sequence"):
        decode(model, TEXTS, "spec", 8, draft=NgramDrafter(model.cfg.vocab_size))
    with pytest.raises(SparsedraftError, match="one prefill per row"):
        decode(model, TEXTS, "ar", 8, prefilled=object())


def test_bench_batch_reports_throughput_over_the_batch():
    result = compare(CompareConfig(model="tiny-llama", context=200, new_tokens=8, batch=3, warmup=0,
                                   methods=(("retrieval", {"budget": 64, "gamma": 3}),)))
    ar, method = result.rows
    assert method.tokens_match is True
    assert ar.tokens_per_s == pytest.approx(3 * 1000 / ar.ms_per_token)
    assert method.acceptance and result.peak_rss_gb > 0


def test_bench_refuses_a_batch_over_the_memory_cap_before_any_prefill(no_forward):
    with pytest.raises(SparsedraftError, match="needs about"):
        compare(CompareConfig(model="tiny-llama", context=200, new_tokens=8, batch=3, warmup=0, max_memory="10KB",
                              methods=(("retrieval", {"budget": 64, "gamma": 3}),)))


def test_memory_estimate_counts_the_caches_the_methods_build(model):
    """batch_bytes' draft caches are the buffers TriForce allocates: a retrieval view and a draft's streaming cache."""
    from sparsedraft.speculative.batching import batch_bytes
    from sparsedraft.speculative.methods import load_draft, method_options
    from sparsedraft.speculative import triforce_drafter
    opts = method_options("triforce", draft="truncated:1", budget=64, gamma1=2, gamma2=4, sink=4, window=32)
    draft = load_draft(opts.draft, model)
    built = triforce_drafter(model, draft, opts.gamma1, opts.gamma2, opts.budget, opts.chunk_size, opts.sink,
                             opts.window)
    caches = (built.verifier.cache, built.inner.cache)
    held = sum(t.numel() * t.element_size() for cache in caches for t in (*cache.k, *cache.v))
    parts = batch_bytes(model, draft, [100, 120], 8, "triforce", opts, prefilled=False)
    assert parts["draft caches"] == 2 * held
    assert parts["weights"] == sum(p.numel() * p.element_size() for p in model.parameters())  # the draft shares them
