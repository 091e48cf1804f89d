"""Our forward against transformers: tiny random models of every family, and SmolLM2."""

import pytest
import torch

from oracle import hf_pair
from sparsedraft.engine.generate import generate
from sparsedraft.engine.tiny import TINY_CONFIGS

FAMILIES = sorted(TINY_CONFIGS)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_decode_logits_match_transformers(family):
    hf, ours = hf_pair(family)
    torch.manual_seed(1)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 64))
    steps = torch.randint(0, ours.cfg.vocab_size, (2, 16))
    with torch.no_grad():
        reference = hf(torch.cat([ids, steps], 1)).logits
        cache = ours.new_cache(80, batch=2)
        got = [ours(ids, cache=cache)]
        got += [ours(steps[:, i:i + 1], cache=cache) for i in range(16)]
    diff = (torch.cat(got, 1) - reference).abs().max().item()
    assert diff <= 1e-4, f"{family}: max abs logit difference {diff}"


@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_view_matches_transformers(family):
    hf, ours = hf_pair(family, seed=3)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 48))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_parity_is_sensitive_to_a_wrong_weight():
    """The oracle comparison has teeth: a perturbed weight breaks it."""
    hf, ours = hf_pair("qwen2")
    with torch.no_grad():
        ours.layers[0].self_attn.k_proj.bias.add_(0.05)
        ids = torch.randint(0, ours.cfg.vocab_size, (1, 32))
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff > 1e-4


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    from sparsedraft.engine.data import prompt_tokens
    from sparsedraft.engine.weights import smollm2_path

    model, tok = smollm2
    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompt = prompt_tokens(tok, 512)[None]
    with torch.no_grad():
        ref = hf(prompt).logits
        cache = model.new_cache(512)
        ours = model(prompt, cache=cache)
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-3, f"max abs logit difference {diff}"
    with torch.no_grad():
        hf_tokens = hf.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, 512:]
    assert torch.equal(generate(model, prompt, 64).tokens[0], hf_tokens)
