"""SmolLM2-135M: every speculative decoder reproduces greedy decoding on real essay prompts.

Each prompt (eight at 1K, two at 4K context, 64 new tokens: 10 x 64 tokens)
is decoded autoregressively and by one speculative decoder, in turn: prompt
lookup, a layer-truncated draft (two levels), prompt lookup first with that
draft where lookup's match is one token (``LookupFirst``), retrieval without
hierarchy and TriForce (a truncated draft at level 1). A truncated SmolLM2 is a poor draft
(a few % acceptance): these runs check equality, not speed.

Both runs of a case start from one shared prefill (each copies it); that every decoder's own prefill
equals the shared one is `tests/test_prefilled.py`'s. Slow: a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch

from sparsedraft.engine.data import prompt_tokens
from sparsedraft.engine.generate import generate
from sparsedraft.engine.prefill_store import prefill_prompt
from sparsedraft.speculative import (LookupFirst, ModelDrafter, NgramDrafter, retrieval, speculative, triforce,
                                     truncated_draft)

pytestmark = pytest.mark.slow

NEW = 64
DECODERS = ("ngram", "truncated", "lookup-first", "retrieval", "triforce")
CASES = [(1024, v, DECODERS[v % len(DECODERS)]) for v in range(8)] + [(4096, v, DECODERS[3 + v]) for v in range(2)]


def decode(name: str, target, prompt: torch.Tensor, prefilled):
    context = prompt.shape[1] + NEW
    budget = 256 if prompt.shape[1] <= 1024 else 1024
    if name == "ngram":
        return speculative(target, NgramDrafter(target.cfg.vocab_size), prompt, NEW, gamma=4, prefilled=prefilled)
    if name == "truncated":
        draft = truncated_draft(target, 4)
        return speculative(target, ModelDrafter(draft, draft.new_cache(context)), prompt, NEW, gamma=4,
                           prefilled=prefilled)
    if name == "lookup-first":
        draft = truncated_draft(target, 4)
        drafter = LookupFirst(ModelDrafter(draft, draft.new_cache(context)), 0.5)
        return speculative(target, drafter, prompt, NEW, gamma=4, prefilled=prefilled)
    if name == "retrieval":
        return retrieval(target, prompt, NEW, gamma=6, budget=budget, chunk_size=8, rebuild="accept<0.6:4",
                         prefilled=prefilled)
    if name == "triforce":
        return triforce(target, truncated_draft(target, 4), prompt, NEW, gamma1=2, gamma2=6, budget=budget,
                        chunk_size=8, sink=16, window=240, rebuild="every:32", prefilled=prefilled)
    raise AssertionError(name)



def test_cases_cover_ten_prompts_of_64_tokens_at_1k_and_4k():
    assert len(CASES) >= 10 and {c for c, _, _ in CASES} == {1024, 4096}
    assert {d for _, _, d in CASES} == set(DECODERS)


@pytest.mark.parametrize("context,variant,decoder", CASES, ids=[f"{c}-{v}-{d}" for c, v, d in CASES])
def test_greedy_speculative_equals_autoregressive_smollm2(smollm2, context, variant, decoder):
    model, tokenizer = smollm2
    prompt = prompt_tokens(tokenizer, context, split="heldout", variant=variant)[None]
    prefilled = prefill_prompt(model, prompt)  # one prefill per prompt, copied by both runs (never written)
    expected = generate(model, prompt, NEW, prefilled=prefilled).tokens
    result = decode(decoder, model, prompt, prefilled)
    assert torch.equal(result.tokens, expected)
    assert result.stats.generated == NEW
