"""The one chunked prefill of the library: targets, drafters, analyses and benches all fill a cache here.

:func:`prefill` runs a prompt through a cache in chunks of
:data:`PREFILL_CHUNK` tokens (bounded activation memory at 8K and beyond), the
last token alone (see :func:`prefill_spans`), and returns the last logits,
optionally with the last tokens' queries or every token's top-layer features.
:func:`check_prompt` refuses a prompt that cannot run before any forward.
Plain decoding (:mod:`sparsedraft.engine.generate`), a shared prefill
(:mod:`sparsedraft.engine.prefilled`) and every drafter start from here, so this
module imports neither.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..errors import require
from ..progress import bar
from .cache import KVCache
from .model import Capture, Transformer

PREFILL_CHUNK = 1024  # tokens per prefill forward: bounds activation memory on long prompts, for every prefill


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
    (after ``capture.hidden_layers``' outputs, when it names lower layers):
    what a feature drafter's cache is filled from. A prompt of more than one
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
            step = Capture(layers=capture.layers if queries else set(), hidden=hidden,
                           hidden_layers=capture.hidden_layers) if queries or hidden else None
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
