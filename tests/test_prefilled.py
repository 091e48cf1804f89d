"""One prefill shared by every decoder: each method started from a prefill gives the tokens of a run that
prefilled itself (greedy and seeded sampling), the prefill is never written, drafter caches are built from
the copy, and a prefill of another model or prompt is refused before any forward."""

from __future__ import annotations

import copy

import pytest
import torch

from sparsedraft import METHODS, decode, load_model
from sparsedraft.caches import RetrievalCache
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.generate import generate
from sparsedraft.engine.model import Transformer
from sparsedraft.engine.prefill_store import prefill_prompt
from sparsedraft.engine.prefilled import weights_digest
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([list(("The best way to get startup ideas is not to try to think of startup ideas. " * 3)
                            .encode())])
NEW = 24
OPTIONS = {  # small budgets so a short prompt fits
    "ar": {},
    "spec": {"draft": "truncated:1", "gamma": 3},
    "retrieval": {"budget": 64, "gamma": 3},
    "triforce": {"budget": 64, "gamma1": 2, "gamma2": 4},
    "budgetdraft": {"draft": "truncated:1", "budget": 64, "gamma": 3},
}
LAWS = {"greedy": {}, "sampled": {"temperature": 0.7, "top_p": 0.9, "seed": 3}}


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen2")


def snapshot(prefilled) -> dict[str, torch.Tensor]:
    """Every tensor of a prefill, cloned, plus its cache length."""
    state = {f"cache.{k}": v.clone() for k, v in prefilled.cache.state().items()}
    state.update({f"q{k}": v.clone() for k, v in prefilled.queries.items()})
    return {**state, "logits": prefilled.logits.clone(), "tokens": prefilled.tokens.clone(),
            "length": torch.tensor(prefilled.cache.length)}


def test_every_registered_method_is_exercised_here():
    assert set(OPTIONS) == set(METHODS)


@pytest.mark.parametrize("law", sorted(LAWS))
@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_a_shared_prefill_gives_the_tokens_of_a_run_that_prefilled_itself(model, method, law):
    prefilled = prefill_prompt(model, PROMPT)
    own = decode(model, PROMPT, method, NEW, **LAWS[law], **OPTIONS[method])
    shared = decode(model, PROMPT, method, NEW, prefilled=prefilled, **LAWS[law], **OPTIONS[method])
    assert torch.equal(shared.tokens, own.tokens)
    if law == "greedy":
        assert torch.equal(shared.tokens, generate(model, PROMPT, NEW).tokens)
    assert shared.shared_prefill_s == prefilled.seconds > 0 and own.shared_prefill_s == 0
    assert 0 < shared.setup_s < shared.prefill_s
    assert shared.setup_s == pytest.approx(shared.prefill_s - prefilled.seconds)


def test_the_prefill_is_left_bit_identical_by_every_method(model):
    prefilled = prefill_prompt(model, PROMPT)
    before = snapshot(prefilled)
    for method, options in OPTIONS.items():
        for law in LAWS.values():
            decode(model, PROMPT, method, NEW, prefilled=prefilled, **law, **options)
    after = snapshot(prefilled)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before), [
        name for name in before if not torch.equal(before[name], after[name])]


def test_retrieval_caches_are_built_from_the_runs_copy(model, monkeypatch):
    prefilled = prefill_prompt(model, PROMPT)
    built_from = []
    original = RetrievalCache.build
    monkeypatch.setattr(RetrievalCache, "build", lambda self, full, queries: built_from.append(full)
                        or original(self, full, queries))
    for method in ("retrieval", "triforce"):
        decode(model, PROMPT, method, NEW, prefilled=prefilled, **OPTIONS[method])
    assert len(built_from) == 2
    assert all(full is not prefilled.cache and full.max_len == PROMPT.shape[1] + NEW for full in built_from)


def test_a_batch_decodes_from_one_prefill(model):
    batch = torch.cat((PROMPT, PROMPT.flip(1)))
    prefilled = prefill_prompt(model, batch)
    assert torch.equal(decode(model, batch, "ar", 8, prefilled=prefilled).tokens, generate(model, batch, 8).tokens)


def _other_weights(model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.layers[0].mlp.up_proj.weight[0, 0] += 1
    return other


def _other_rope(model):
    other = tiny_model("qwen2", rope_theta=10_000.0)  # the same seed and shapes: only the config differs
    other.source = model.source
    return other


@pytest.mark.parametrize("make_other, words", [
    (_other_weights, "another model \\(weights"),
    (lambda m: copy.deepcopy(m).to(torch.bfloat16), "another model \\(dtype"),
    (_other_rope, "another model \\(config.rope_theta"),
])
def test_a_prefill_of_another_model_is_refused_before_any_forward(model, make_other, words, monkeypatch):
    prefilled = prefill_prompt(model, PROMPT)
    other = make_other(model)
    monkeypatch.setattr(Transformer, "forward", lambda *a, **k: pytest.fail("ran a forward"))
    for method in ("ar", "retrieval"):
        with pytest.raises(SparsedraftError, match=words):
            decode(other, PROMPT, method, NEW, prefilled=prefilled, **OPTIONS[method])


def test_a_prefill_of_another_prompt_or_a_touched_cache_is_refused(model, monkeypatch):
    prefilled = prefill_prompt(model, PROMPT)
    monkeypatch.setattr(Transformer, "forward", lambda *a, **k: pytest.fail("ran a forward"))
    with pytest.raises(SparsedraftError, match="not the prompt given"):
        decode(model, PROMPT[:, 1:], "ar", NEW, prefilled=prefilled)
    with pytest.raises(SparsedraftError, match="not the prompt given"):
        generate(model, PROMPT.flip(1), NEW, prefilled=prefilled)
    prefilled.cache.rollback(1)
    with pytest.raises(SparsedraftError, match="holds 224 tokens, not its 225-token prompt"):
        decode(model, PROMPT, "spec", NEW, prefilled=prefilled, **OPTIONS["spec"])


def test_the_weights_digest_follows_a_write_in_place(model):
    other = copy.deepcopy(model)
    before = weights_digest(other)
    assert weights_digest(other) == before == weights_digest(model)
    with torch.no_grad():
        other.norm.weight.mul_(2)
    assert weights_digest(other) != before


def test_a_cache_takes_only_a_state_that_fits_it(model):
    prefilled = prefill_prompt(model, PROMPT)
    state = prefilled.cache.state()
    bigger = model.new_cache(PROMPT.shape[1] + 8)
    bigger.load_state(state)
    assert bigger.length == PROMPT.shape[1] and torch.equal(bigger.keys(1), prefilled.cache.keys(1))
    with pytest.raises(SparsedraftError, match="does not fit"):
        model.new_cache(PROMPT.shape[1] - 1).load_state(state)
    with pytest.raises(SparsedraftError, match="this cache takes torch.bfloat16"):
        copy.deepcopy(model).to(torch.bfloat16).new_cache(PROMPT.shape[1]).load_state(state)
    with pytest.raises(SparsedraftError, match="for this cache's 1 layers"):
        tiny_model("qwen2", num_hidden_layers=1).new_cache(PROMPT.shape[1]).load_state(state)
