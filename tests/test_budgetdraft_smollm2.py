"""SmolLM2-135M with a trained BudgetDraft drafter: greedy speculative output equals plain greedy output.

The drafter (the verifier's first 2 layers) is trained for a few steps on
essays, enough to make it a trained drafter with its own weights; the test
checks equality, not acceptance. It drafts over BudgetCaches of several
budgets (two levels) and serves as TriForce's level 1.

Slow: about a minute on a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch

from sparsedraft.budgetdraft import BudgetDrafter, TrainConfig, train_drafter
from sparsedraft.engine.data import prompt_tokens
from sparsedraft.engine.generate import generate
from sparsedraft.speculative import speculative, triforce

pytestmark = pytest.mark.slow

NEW = 48


@pytest.fixture(scope="module")
def setup(smollm2, tmp_path_factory):
    verifier, tokenizer = smollm2
    tmp = tmp_path_factory.mktemp("budgetdraft_smollm2")
    cfg = TrainConfig(layers=2, seq_len=128, continuation=32, sequences=2, eval_sequences=0, budgets=(32, 64),
                      steps=3, warmup=1, eval_every=0, final_context=0, teacher_dir=str(tmp / "teacher"),
                      out_dir=str(tmp / "run"))
    drafter = train_drafter(cfg, verifier, tokenizer, progress=False).drafter.eval()
    prompt = prompt_tokens(tokenizer, 1024, split="heldout", variant=3)[None]
    return verifier, drafter, prompt, generate(verifier, prompt, NEW).tokens


def test_the_drafter_was_trained(setup):
    verifier, drafter, _, _ = setup
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, verifier.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("budget", [64, 256])
def test_budget_cache_drafting_equals_autoregressive(setup, budget):
    verifier, drafter, prompt, expected = setup
    draft = BudgetDrafter.create(drafter, budget, prompt.shape[1] + NEW)
    assert torch.equal(speculative(verifier, draft, prompt, NEW, gamma=4).tokens, expected)


def test_trained_drafter_as_triforce_level1_equals_autoregressive(setup):
    verifier, drafter, prompt, expected = setup
    out = triforce(verifier, drafter, prompt, NEW, gamma1=2, gamma2=6, budget=256, chunk_size=8)
    assert torch.equal(out.tokens, expected)
