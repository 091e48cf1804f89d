"""Autoregressive generation: the baseline every speedup is measured against.

:func:`prefill` fills a cache in chunks of :data:`PREFILL_CHUNK` (bounded
activation memory at 8K and beyond), the last token alone (see
:func:`prefill_spans`), and returns the last logits, optionally
with the last tokens' queries; it is the one prefill loop of the library
(targets, drafters, analyses); :func:`generate` decodes one token per
forward and reports prefill and decode times separately, with the device
synchronised around each timed region. Given a
:class:`~sparsedraft.prefilled.PrefilledPrompt`, it copies that prefill's
cache and logits instead of running the prompt forward (one prefill shared by
every decoder of a bench).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .cache import KVCache, StaticCache
from .errors import require
from .model import Capture, Transformer
from .progress import bar
from .sampling import SamplingConfig, choose

if TYPE_CHECKING:
    from .prefilled import PrefilledPrompt

PREFILL_CHUNK = 1024  # tokens per prefill forward: bounds activation memory on long prompts, for every prefill


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, N] generated ids (prompt excluded)
    prefill_s: float  # wall time of the prompt forward(s); with a shared prefill, its seconds plus the copy
    decode_s: float  # wall time of the token-by-token loop
    prompt_len: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(model: Transformer, prompt: torch.Tensor, max_new_tokens: int) -> None:
    """Fail fast on a prompt that cannot run (before any forward)."""
    require(prompt.dim() == 2 and prompt.shape[1] > 0, f"prompt must be [batch, tokens] with tokens > 0, "
                                                       f"got shape {tuple(prompt.shape)}")
    require(max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = prompt.shape[1] + max_new_tokens
    require(total <= model.cfg.max_position_embeddings,
            f"prompt ({prompt.shape[1]}) + new tokens ({max_new_tokens}) = {total} exceeds the model's maximum "
            f"context of {model.cfg.max_position_embeddings}; shorten the prompt or generate fewer tokens")
    require(int(prompt.max()) < model.cfg.vocab_size and int(prompt.min()) >= 0,
            f"prompt holds token ids outside the vocabulary [0, {model.cfg.vocab_size}); "
            "use the tokenizer that belongs to this model")


def prefill_spans(length: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each prefill forward: chunks of ``chunk`` tokens, then the last token alone.

    The last prompt token is what a speculative run feeds again as the first
    row of its first verification; running it here as a one-token forward,
    the shape of every decode step, gives its key, value and logits from the
    same kernels in plain and speculative decoding. That is what keeps greedy
    tokens identical in bf16, where a 1024-row chunk and a few-row step round
    differently (see ``tests/test_exact_rows.py``).
    """
    body = length - 1
    return [(s, min(s + chunk, body)) for s in range(0, body, chunk)] + [(body, length)]


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, tokens: torch.Tensor, chunk: int = PREFILL_CHUNK, *,
            capture: Capture | None = None, capture_last: int = 1) -> torch.Tensor:
    """Run ``tokens`` [B, T] through ``cache`` in chunks of ``chunk``; return the last logits [B, V].

    Positions continue from the cache's length (the model's default). With
    ``capture``, ``capture.queries[layer]`` ends as the post-RoPE queries
    [B, H, n, D] of the last ``n = min(capture_last, T)`` tokens for each layer
    in ``capture.layers``: the last prompt token's query that selects a
    retrieval cache (n = 1), or every query for the attention analyses (n = T).
    Only chunks holding those tokens record anything. ``capture.hidden`` also
    collects every token's top-layer features, ``capture.features`` [B, T, hidden]
    (what a feature drafter's cache is filled from). A prompt of more than one
    chunk counts its tokens on a :func:`~sparsedraft.progress.bar` (shown only
    when bars are on; on a GPU it counts chunks launched, as it adds no sync).
    """
    require(tokens.dim() == 2 and tokens.shape[1] >= 1,
            f"tokens must be [batch, T >= 1], got shape {tuple(tokens.shape)}")
    require(chunk >= 1, f"prefill chunk must be >= 1 token, got {chunk}")
    require(capture is None or (capture_last >= 1 and not capture.weights),
            f"a prefill captures the queries of its last capture_last >= 1 tokens (got {capture_last}), never "
            "attention weights (each chunk sees a different number of keys)")
    length = tokens.shape[1]
    first = length - min(capture_last, length)  # first token whose query is recorded
    parts: dict[int, list[torch.Tensor]] = defaultdict(list)
    hidden = capture is not None and capture.hidden
    features: list[torch.Tensor] = []
    logits = None
    spans = prefill_spans(length, chunk)
    with bar(total=length, desc="prefill", unit="tok", unit_scale=True, show=len(spans) > 2) as progress:
        for start, stop in spans:
            queries = capture is not None and stop > first
            step = Capture(layers=capture.layers if queries else set(), hidden=hidden) if queries or hidden else None
            logits = model(tokens[:, start:stop], cache=cache, last_only=True, capture=step)
            for layer, q in (step.queries.items() if step is not None else ()):
                parts[layer].append(q[:, :, max(first - start, 0):])
            if hidden:
                features.append(step.features)
            progress.update(stop - start)
    if capture is not None:
        capture.queries.update({layer: torch.cat(qs, 2) for layer, qs in parts.items()})
    if hidden:
        capture.features = torch.cat(features, 1)
    return logits[:, -1]


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
