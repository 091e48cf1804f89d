"""The front door: ``sparsedraft.decode`` runs every registered method, greedy output equals plain
decoding, text prompts go through the model's tokenizer, and bad options fail before any forward."""

from __future__ import annotations

import time

import pytest
import torch

import sparsedraft
from sparsedraft import METHODS, decode, load_model
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.generate import generate
from sparsedraft.speculative import TARGET
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The best way to get startup ideas is not to try to think of startup ideas. " * 3
OPTIONS = {  # small budgets so a short prompt fits
    "ar": {},
    "spec": {"draft": "truncated:1", "gamma": 3},
    "retrieval": {"budget": 64, "gamma": 3},
    "triforce": {"budget": 64, "gamma1": 2, "gamma2": 4},
    "budgetdraft": {"draft": "truncated:1", "budget": 64, "gamma": 3},
}


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen2")


def test_every_registered_method_is_exercised_here():
    assert set(OPTIONS) == set(METHODS)


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_greedy_decode_equals_plain_greedy(model, method):
    plain = generate(model, torch.tensor([list(TEXT.encode())]), 24)
    result = decode(model, TEXT, method, 24, **OPTIONS[method])
    assert result.tokens.shape == (1, 24)
    assert torch.equal(result.tokens, plain.tokens), method
    assert result.text is not None and len(result.text) == 1
    assert result.prompt_len == len(TEXT.encode())
    if method == "ar":
        assert result.levels == [] and result.decode_tokens == 23
    else:
        assert result.levels[-1].name == TARGET and result.decode_tokens == 24
        assert sum(lvl.verifications for lvl in result.levels) >= 1


def test_time_per_token_counts_the_tokens_the_decode_phase_emitted(model):
    result = decode(model, TEXT, "ar", 9)
    assert result.ms_per_token == pytest.approx(1000 * result.decode_s / 8)
    assert result.tokens_per_s == pytest.approx(1000 / result.ms_per_token)


def test_token_ids_and_batches_are_accepted(model):
    ids = list(TEXT.encode())
    single = decode(model, ids, "ar", 6)
    batch = decode(model, torch.tensor([ids, ids]), "ar", 6)
    assert batch.tokens.shape == (2, 6) and torch.equal(batch.tokens[0], single.tokens[0])
    assert single.text is None  # ids in, no tokenizer needed


def test_sampling_shortcuts_build_one_law(model):
    a = decode(model, TEXT, "triforce", 12, temperature=0.6, top_p=0.9, seed=3, **OPTIONS["triforce"])
    b = decode(model, TEXT, "triforce", 12, temperature=0.6, top_p=0.9, seed=3, **OPTIONS["triforce"])
    assert torch.equal(a.tokens, b.tokens)  # seeded: reproducible


@pytest.mark.parametrize("method, options, words", [
    ("nope", {}, "unknown method"),
    ("ar", {"gamma": 3}, "no option"),
    ("retrieval", {"budget": 7}, "multiple of chunk_size"),
    ("retrieval", {"budget": 4096}, "smaller than the cached context"),
    ("triforce", {"gamma1": 0}, "gamma1"),
    ("spec", {"draft": "truncated:x"}, "truncated:K"),
    ("spec", {"draft": "truncated:9"}, "1 <= K"),
    ("spec", {"draft_cache": "budget"}, "needs a draft model"),
    ("budgetdraft", {"draft": "ngram"}, "draft model"),
    ("budgetdraft", {"draft": "truncated:1", "chunk_scoring": "mean"}, "chunk_scoring must be one of"),
    ("spec", {"draft": "truncated:1", "draft_cache": "streaming", "chunk_scoring": "keys"}, "ranks the chunks of a budget"),
])
def test_bad_options_fail_before_any_forward(model, method, options, words, monkeypatch):
    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the options were checked")
    monkeypatch.setattr(type(model), "forward", no_forward)
    start = time.perf_counter()
    with pytest.raises(SparsedraftError, match=words):
        decode(model, TEXT, method, 8, **options)
    assert time.perf_counter() - start < 1.0


def test_text_needs_a_tokenizer_when_the_model_was_not_loaded_by_name():
    with pytest.raises(SparsedraftError, match="tokenizer"):
        decode(tiny_model("llama"), "hello there", "ar", 2)


def test_speculative_methods_take_a_batch_row_by_row(model):
    result = decode(model, [TEXT, TEXT], "retrieval", 4, budget=64)  # each row its batch-1 run (test_batch.py)
    assert torch.equal(result.tokens[0], decode(model, TEXT, "ar", 4).tokens[0])
    assert torch.equal(result.tokens[0], result.tokens[1]) and len(result.rows) == 2


def test_front_door_exports_decode():
    assert sparsedraft.decode is decode and "decode" in sparsedraft.__all__
