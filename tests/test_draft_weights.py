"""Quantised self-drafts (``draft_weights``): a draft level that is the target itself reads int8, int4 or bf16
copies of its weights, the verifier keeps its own, so greedy output equals plain greedy token for token.
Tiny random models in process; bad values of it and of ``draft_kv`` (tests/test_draft_kv.py) fail before any
forward."""

import pytest
import torch

from sparsedraft import decode
from sparsedraft.__main__ import build_parser
from sparsedraft.errors import SparsedraftError
from sparsedraft.speculative.methods import method_options
from sparsedraft.engine.quant import Int4Linear, check_draft_weights, draft_copy
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
NEW = 24
RUNS = {  # method -> options: every place a draft level is the target itself
    "retrieval": dict(budget=16, chunk_size=4, gamma=4),
    "triforce": dict(budget=16, chunk_size=4, gamma1=2, gamma2=4),
    "spec": dict(draft="self", draft_cache="streaming", sink=4, window=12, gamma=4),
}


def prompt(length: int = 48) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_model(request.param, 0, **({"tie_word_embeddings": False} if request.param == "llama" else {}))


@pytest.mark.parametrize("weights", ["int8", "w8a8", "int4", "bf16"])
@pytest.mark.parametrize("method", sorted(RUNS))
def test_greedy_tokens_equal_ar_with_a_quantised_self_draft(target, method, weights):
    expected = decode(target, prompt(), "ar", NEW).tokens
    result = decode(target, prompt(), method, NEW, draft_weights=weights, **RUNS[method])
    assert torch.equal(result.tokens, expected)
    assert result.levels[-1].drafted > 0  # the quantised level really drafted
    assert weights in target._sparsedraft_draft_copies


def test_the_copy_is_made_once_shares_embedding_and_norms_and_leaves_the_target_alone():
    target = tiny_model("qwen2", 0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    copy = draft_copy(target, "int4")
    assert draft_copy(target, "int4") is copy and draft_copy(target, "same") is target
    decode(target, prompt(), "retrieval", 8, draft_weights="int4", **RUNS["retrieval"])
    assert target._sparsedraft_draft_copies["int4"] is copy
    assert copy.embed_tokens.weight is target.embed_tokens.weight and copy.norm.weight is target.norm.weight
    assert isinstance(copy.layers[0].mlp.down_proj, Int4Linear) and isinstance(target.lm_head, torch.nn.Linear)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    logits, exact = copy(prompt(9)), target(prompt(9))
    assert 0 < (logits - exact).abs().max() < 0.2 * exact.abs().max()  # close, not equal: really quantised


@pytest.mark.parametrize("method, options, match", [
    ("retrieval", dict(draft_weights="int3"), "draft_weights must be one of"),
    ("triforce", dict(draft_weights="fp8"), "draft_weights must be one of"),
    ("spec", dict(draft="ngram", draft_weights="int8"), "add draft self"),
])
def test_bad_draft_weights_fail_when_the_options_are_built(method, options, match):
    with pytest.raises(SparsedraftError, match=match):
        method_options(method, **options)


@pytest.mark.parametrize("weights", ["int4", "w8a8"])
def test_cpu_only_draft_weights_are_refused_for_another_device(weights):
    check_draft_weights(weights, device=torch.device("cpu"))
    with pytest.raises(SparsedraftError, match=f"draft_weights {weights} runs on CPU only"):
        check_draft_weights(weights, device=torch.device("cuda"))


@pytest.mark.parametrize("widths, option, message", [
    (dict(hidden_size=48, intermediate_size=96), dict(draft_weights="int4"), "int4 groups 32 input features"),
    (dict(hidden_size=48, num_attention_heads=2, num_key_value_heads=1), dict(draft_kv="int4"),
     "draft_kv int4 groups 32 values"),  # head_dim 24
])
def test_int4_on_widths_that_are_not_whole_groups_fails_before_any_forward(no_forward, widths, option, message):
    target = tiny_model("qwen2", 0, **widths)
    with pytest.raises(SparsedraftError, match=message):
        decode(target, prompt(), "retrieval", 8, **option, **RUNS["retrieval"])


@pytest.mark.parametrize("flag, good, bad", [("draft-weights", "int8", "int2"), ("draft-kv", "int4", "int3")])
def test_the_bench_flags_have_the_option_names(flag, good, bad):
    args = build_parser().parse_args(["bench", "triforce", f"--{flag}", good])
    assert getattr(args, flag.replace("-", "_")) == good
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "retrieval", f"--{flag}", bad])
