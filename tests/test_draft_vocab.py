"""A draft head over the most frequent tokens: exact logits where it scores, -inf elsewhere, the target untouched,
and decoding through it still lossless (greedy here; the sampled law in test_speculative_sampling)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from sparsedraft import decode, load_model
from sparsedraft.bench import CompareConfig, compare
from sparsedraft.engine.data import corpus_tokens, model_tokenizer
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.generate import generate
from sparsedraft.speculative import truncated_draft
from sparsedraft.speculative.vocab import SubsetHead, coverage, frequent_tokens, restrict_head

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The best way to get startup ideas is not to try to think of startup ideas. " * 3


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen2")


def test_subset_head_scores_its_tokens_exactly_and_nothing_else(model):
    ids = torch.tensor([3, 10, 101, 200])
    draft = restrict_head(model, ids)
    tokens = torch.tensor([list(b"speculative")])
    with torch.inference_mode():
        full, part = model(tokens), draft(tokens)
    assert isinstance(draft.lm_head, SubsetHead) and not isinstance(model.lm_head, SubsetHead)
    torch.testing.assert_close(part[..., ids], full[..., ids], rtol=0, atol=0)
    outside = torch.ones(model.cfg.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(part[..., outside]).all()
    assert draft.layers is model.layers and draft.embed_tokens is model.embed_tokens  # shared, not copied


def test_frequent_tokens_are_the_train_splits_most_common(model):
    tokenizer = model_tokenizer("tiny-qwen2")
    ids = frequent_tokens(tokenizer, 20, model.cfg.vocab_size)
    counts = Counter(corpus_tokens(tokenizer, "train").tolist())
    assert ids.tolist() == sorted(ids.tolist()) and len(set(ids.tolist())) == 20
    assert min(counts[i] for i in ids.tolist()) >= max(c for t, c in counts.items() if t not in set(ids.tolist()))
    assert 0.5 < coverage(tokenizer, ids) < 1.0  # bytes: 20 of them cover most of English text, not all of it
    with pytest.raises(SparsedraftError, match="draft vocabulary"):
        frequent_tokens(tokenizer, model.cfg.vocab_size, model.cfg.vocab_size)


@pytest.mark.parametrize("method,options", [
    ("spec", {"draft": "truncated:1", "gamma": 3}),
    ("budgetdraft", {"draft": "truncated:1", "budget": 64, "gamma": 3}),
    ("triforce", {"draft": "truncated:1", "budget": 64, "gamma1": 2, "gamma2": 4}),
])
def test_greedy_decoding_with_a_restricted_draft_equals_plain_greedy(model, method, options):
    plain = generate(model, torch.tensor([list(TEXT.encode())]), 24)
    full = decode(model, TEXT, method, 24, **options)
    restricted = decode(model, TEXT, method, 24, draft_vocab=12, **options)
    assert torch.equal(restricted.tokens, plain.tokens) and torch.equal(full.tokens, plain.tokens)


def test_compare_with_a_restricted_draft_stays_lossless(model):
    result = compare(CompareConfig(model="tiny-qwen2", context=96, new_tokens=12, warmup=0, repeats=1,
                                   methods=(("spec", {"draft": "truncated:1", "draft_vocab": 16}),)), target=model)
    assert all(row.tokens_match for row in result.rows)


def test_the_frequency_list_is_computed_once_per_source_and_size(model):
    from sparsedraft.speculative.vocab import frequent_tokens_of
    first = frequent_tokens_of("tiny-qwen2", 16, model.cfg.vocab_size)
    assert frequent_tokens_of("tiny-qwen2", 16, model.cfg.vocab_size) is first  # kept, not recounted
    assert torch.equal(first, frequent_tokens(model_tokenizer("tiny-qwen2"), 16, model.cfg.vocab_size))


def test_the_target_drafting_for_itself_keeps_its_full_head(model):
    draft = truncated_draft(model, 1)
    restrict_head(draft, torch.arange(8))
    assert not isinstance(model.lm_head, SubsetHead) and not isinstance(draft.lm_head, SubsetHead)


@pytest.mark.parametrize("method,options,message", [
    ("spec", {"draft": "ngram", "draft_vocab": 8}, "has no head of its own"),
    ("triforce", {"budget": 64, "draft_vocab": 8}, "has no head of its own"),
    ("spec", {"draft": "truncated:1", "draft_vocab": -1}, "must be >= 0"),
    ("spec", {"draft": "truncated:1", "draft_vocab": 100_000}, "smaller than the model's vocabulary"),
])
def test_bad_draft_vocab_fails_before_any_forward(model, method, options, message):
    with pytest.raises(SparsedraftError, match=message):
        decode(model, TEXT, method, 8, **options)


def test_draft_step_costs_time_each_head_against_the_verifier_in_one_set_of_rounds(model):
    from sparsedraft.bench.draft_cost import draft_step_costs
    from sparsedraft.budgetdraft.init import copy_first_layers
    drafter = copy_first_layers(model, 1).eval()
    prompt = torch.tensor([list(TEXT.encode())])
    rows = draft_step_costs(model, drafter, prompt, 64, [0, 32, 8], model_tokenizer("tiny-qwen2"), repeats=3)
    assert [r.draft_vocab for r in rows] == [model.cfg.vocab_size, 32, 8]
    assert len({r.verifier_ms for r in rows}) == 1  # one verifier timing, shared by the rows
    assert all(r.ratio == pytest.approx(r.draft_ms / r.verifier_ms) and r.draft_ms > 0 for r in rows)
    assert rows[0].heldout_coverage == 1.0 > rows[1].heldout_coverage > rows[2].heldout_coverage
    assert len({r.verify_ratio for r in rows}) == 1 and rows[0].verify_ratio > 0 and rows[0].verify_tokens == 5
    assert not isinstance(drafter.lm_head, SubsetHead)  # restricted copies only
    with pytest.raises(SparsedraftError, match="draft_vocabs"):
        draft_step_costs(model, drafter, prompt, 64, [model.cfg.vocab_size], model_tokenizer("tiny-qwen2"))


def test_draft_step_costs_time_a_feature_head_and_its_restricted_views(model):
    from sparsedraft.bench.draft_cost import draft_step_costs
    from sparsedraft.speculative.feature import FeatureHead
    head = FeatureHead(model.cfg).init_from(model).attach(model).eval()
    prompt = torch.tensor([list(TEXT.encode())])
    rows = draft_step_costs(model, head, prompt, 64, [0, 16], model_tokenizer("tiny-qwen2"), repeats=3)
    assert [r.draft_vocab for r in rows] == [model.cfg.vocab_size, 16]
    assert all(r.draft_ms > 0 and r.ratio == pytest.approx(r.draft_ms / r.verifier_ms) for r in rows)
    assert head._head is model.lm_head  # the restricted row used a view, the head itself is unchanged


def test_draft_cost_command_times_a_drafter_folder_against_the_verifier_its_record_names(model, tmp_path, capsys):
    from sparsedraft.bench.draft_cost import main
    from sparsedraft.speculative.feature import FeatureHead, save_feature_head
    head = FeatureHead(model.cfg).init_from(model)
    folder = save_feature_head(head, tmp_path / "feature", model, {"recipe": {"verifier": "tiny-qwen2"}})
    record = tmp_path / "cost.json"
    main(["--draft", str(folder), "--context", "300", "--budget", "64", "--draft-vocab", "0", "16", "--repeats", "3",
          "--record", str(record)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["kind"] == "feature" and result["model"] == "tiny-qwen2" and result["context"] == 300
    assert [r["draft_vocab"] for r in result["rows"]] == [model.cfg.vocab_size, 16]
    assert result["read_gb_s"] > 0 and result["peak_gflops"]["fp32"] > 0 and result["isa"]
    steps = {s["step"]: s for s in result["steps"]}
    assert set(steps) == {"decode", "verify-5", f"draft (head {model.cfg.vocab_size})", "draft (head 16)"}
    assert all(s["roofline_ms"] > 0 and s["over_roofline"] == pytest.approx(s["ms"] / s["roofline_ms"])
               for s in steps.values())
    assert steps["draft (head 16)"]["gb"] < steps[f"draft (head {model.cfg.vocab_size})"]["gb"] < steps["decode"]["gb"]
    written = json.loads(record.read_text())
    assert written["result"]["rows"] == result["rows"] and written["machine"]["read_gb_s"] > 0
    assert written["command"].startswith("python -m sparsedraft.bench.draft_cost --draft")
    with pytest.raises(SparsedraftError, match="must exceed --budget"):
        main(["--draft", str(folder), "--context", "64", "--budget", "64"])
    with pytest.raises(SparsedraftError, match="holds no trained drafter"):
        main(["--draft", str(tmp_path)])
    nameless = save_feature_head(head, tmp_path / "nameless", model, {"recipe": "test"})
    with pytest.raises(SparsedraftError, match="does not name the verifier"):
        main(["--draft", str(nameless)])


def test_needed_acceptance_inverts_the_two_level_cost_model():
    from sparsedraft.analysis.costmodel import expected_tokens_per_verify, needed_acceptance
    alpha = needed_acceptance(1.5, 4, 0.06, 1.4)
    assert 0 < alpha < 1
    assert expected_tokens_per_verify(alpha, 4) / (4 * 0.06 + 1.4) == pytest.approx(1.5, rel=1e-9)
    assert needed_acceptance(1.5, 4, 0.06, 1.6) > alpha  # a dearer verification needs more acceptance
    assert needed_acceptance(1.0, 4, 0.0, 1.0) == pytest.approx(0.0, abs=1e-9)  # free drafts: break even at 0
    assert needed_acceptance(6.0, 4, 0.0, 1.0) != needed_acceptance(6.0, 4, 0.0, 1.0)  # NaN: 5 tokens at most


def test_a_feature_head_with_a_restricted_vocabulary_stays_lossless_and_unchanged(model):
    from sparsedraft.speculative.feature import FeatureHead
    head = FeatureHead(model.cfg).init_from(model).attach(model).eval().requires_grad_(False)
    ar = decode(model, TEXT, "ar", 12).tokens
    for method, options in (("spec", {}), ("budgetdraft", {"budget": 16, "chunk_size": 4})):
        out = decode(model, TEXT, method, 12, draft=head, draft_vocab=16, **options)
        assert torch.equal(out.tokens, ar)
    assert head._head is model.lm_head  # the restricted head was a view
