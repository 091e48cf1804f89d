"""A draft whose head scores only part of the vocabulary: the cheap end of a drafter's cost.

On a small model the output head is the largest single read of a draft step:
SmolLM2's tied 49,152 x 576 head is 113 MB in fp32, more than three of its
layers. :func:`restrict_head` gives a draft a head over ``ids`` only (the most
frequent training tokens from :func:`frequent_tokens`, say); every other
token gets logit ``-inf``, so the draft's probability ``q`` is exactly 0 there.

Decoding stays lossless: greedy verification only compares token ids, and
sampled verification accepts a drafted token ``x`` with ``min(1, p(x)/q(x))``
and resamples from ``max(p - q, 0)`` -- tokens the draft cannot propose keep
their whole target mass ``p`` in the residual. The draft only proposes less
often well.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from ..engine.data import corpus_tokens
from ..engine.model import Transformer, project
from ..errors import require


class SubsetHead(nn.Module):
    """``x -> logits [..., vocab_size]``: ``x @ weight[ids].T`` at ``ids``, ``-inf`` everywhere else."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        require(ids.dim() == 1 and ids.numel() >= 1, f"ids must be a non-empty 1-D tensor, got {tuple(ids.shape)}")
        require(int(ids.min()) >= 0 and int(ids.max()) < vocab_size and ids.unique().numel() == ids.numel(),
                f"ids must be distinct token ids in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.proj = nn.Linear(weight.shape[1], ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
        self.proj.weight = nn.Parameter(weight.detach()[ids.to(weight.device)].clone(), requires_grad=False)
        self.register_buffer("ids", ids.to(weight.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_full((*x.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, project(self.proj, x))


def restrict_head(model: Transformer, ids: torch.Tensor) -> Transformer:
    """A Transformer sharing ``model``'s embedding, layers and norm, with a :class:`SubsetHead` over ``ids``.

    ``model`` itself is untouched (a target drafting for itself keeps its full head)."""
    require(isinstance(model, Transformer), f"restrict_head needs a Transformer, got {type(model).__name__}")
    vocab = model.cfg.vocab_size
    require(ids.numel() < vocab, f"a head over {ids.numel()} of {vocab} tokens restricts nothing; keep fewer tokens")
    with torch.device("meta"):  # placeholders only: every module is replaced below
        draft = Transformer(model.cfg)
    draft.embed_tokens, draft.layers, draft.norm, draft.rotary = model.embed_tokens, model.layers, model.norm, model.rotary
    draft.lm_head = SubsetHead(model.lm_head.weight, ids, vocab)
    return draft.train(model.training)


def frequent_tokens(tokenizer, n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` token ids most frequent in the essays' train split (ties: lower id first), ascending.

    Only the train split is counted, so no held-out prompt decides what the draft can propose."""
    require(1 <= n < vocab_size, f"a draft vocabulary of {n} tokens must lie in [1, {vocab_size}) "
                                 f"(the model's vocabulary is {vocab_size}; 0 keeps the full head)")
    counts = torch.bincount(corpus_tokens(tokenizer, "train"), minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:n].sort().values


@lru_cache(maxsize=8)
def frequent_tokens_of(source: str, n: int, vocab_size: int) -> torch.Tensor:
    """:func:`frequent_tokens` with the tokenizer of the model named ``source``, kept: loading that tokenizer and
    tokenising the corpus takes seconds, and every run restricting a draft asks again."""
    from ..engine.data import model_tokenizer
    return frequent_tokens(model_tokenizer(source), n, vocab_size)


def coverage(tokenizer, ids: torch.Tensor, split: str = "heldout") -> float:
    """The share of ``split``'s tokens that are among ``ids``: an upper bound on how often the draft can be right."""
    tokens = corpus_tokens(tokenizer, split)
    return float(torch.isin(tokens, ids).float().mean())
