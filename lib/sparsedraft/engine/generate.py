"""Autoregressive generation: the baseline every speedup is measured against.

:func:`generate` decodes one token per forward and reports prefill and
decode times separately, with the device synchronised around each timed
region. Its prompt goes through the one chunked prefill
(:func:`sparsedraft.engine.prefill.prefill`); given a
:class:`~sparsedraft.engine.prefilled.PrefilledPrompt`, it copies that prefill's
cache and logits instead of running the prompt forward (one prefill shared by
every decoder of a bench).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import require
from .cache import KVCache, StaticCache
from .model import Transformer
from .prefill import check_prompt, prefill
from .prefilled import PrefilledPrompt
from .runtime import synchronize
from .sampling import SamplingConfig, choose


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, N] generated ids (prompt excluded)
    prefill_s: float  # wall time of the prompt forward(s); with a shared prefill, its seconds plus the copy
    decode_s: float  # wall time of the token-by-token loop
    prompt_len: int


@torch.inference_mode()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), cache: KVCache | None = None,
             eos_token_id: int | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None, *,
             prefilled: PrefilledPrompt | None = None) -> GenerationResult:
    """Plain decoding. ``cache`` defaults to a full static cache sized for the run.

    ``prefilled`` (``prefill_prompt(model, prompt)``) starts from a copy of that
    prefill instead of a prompt forward; it must be this model's prefill of
    ``prompt``, and it is left as it was.
    """
    check_prompt(model, prompt, max_new_tokens)
    if prefilled is not None:
        prefilled.check(model, prompt)
        require(cache is None or isinstance(cache, StaticCache),
                f"a prefill seeds a full StaticCache, got a {type(cache).__name__}; pass no cache or no prefill")
    prompt = prompt.to(model.device)
    cache = cache if cache is not None else model.new_cache(prompt.shape[1] + max_new_tokens, prompt.shape[0])
    gen = sampling.generator(model.device)
    synchronize(model.device)
    t0 = time.perf_counter()
    if prefilled is None:
        logits = prefill(model, cache, prompt)
    else:
        prefilled.seed(cache)
        logits = prefilled.logits.clone()
    synchronize(model.device)
    t1 = time.perf_counter()
    out = []
    for _ in range(max_new_tokens):
        token = choose(logits, sampling, gen)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if eos_token_id is not None and bool((token == eos_token_id).all()):
            break
        if len(out) == max_new_tokens:
            break
        logits = model(token[:, None], cache=cache)[:, -1]
    synchronize(model.device)
    t2 = time.perf_counter()
    tokens = torch.stack(out, 1) if out else prompt.new_zeros(prompt.shape[0], 0)
    shared = prefilled.seconds if prefilled is not None else 0.0
    return GenerationResult(tokens.cpu(), shared + t1 - t0, t2 - t1, prompt.shape[1])
