"""Training the feature drafter on tiny random models: the unrolled test is the inference drafter's context,
the loss falls, resume is exact, the saved folder loads for its target only, bad flags fail early."""

import json
import re

import pytest
import torch

from sparsedraft.__main__ import main
from sparsedraft.budgetdraft.feature_config import FeatureTrainConfig
from sparsedraft.budgetdraft.feature_eval import (accepted_per_round, agreement_summary, by_confidence, chain_conditionals,
                                                 stopped_rounds, training_fit)
from sparsedraft.budgetdraft.feature_data import Window
from sparsedraft.budgetdraft.feature_loss import TokenHead, token_ce, unroll
from sparsedraft.budgetdraft import feature_train
from sparsedraft.budgetdraft.feature_train import train_feature_drafter
from sparsedraft.engine.cache import StaticCache
from sparsedraft.engine.data import model_tokenizer
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.sampling import SamplingConfig
from sparsedraft.speculative.drafters import DraftContext, TargetState
from sparsedraft.speculative.feature import FeatureHead, load_feature_head
from sparsedraft.speculative.feature_drafter import FeatureDrafter
from sparsedraft.speculative.stats import Stopwatch
from sparsedraft.engine.tiny import tiny_model


class Stop(Exception):
    pass


def config(tmp_path, name, **changes):
    base = dict(verifier="tiny-llama", seq_len=64, sequences=3, pydoc_sequences=1, sampled_sequences=0,
                eval_sequences=1, draft_vocab=64, chains=16, continuation=16, budgets=(16, 32), obs_window=8,
                steps=4, warmup=1, checkpoint_every=2, eval_every=2, final_context=0,
                teacher_dir=str(tmp_path / "teacher"), out_dir=str(tmp_path / name))
    return FeatureTrainConfig(**{**base, **changes})


def random_head(target, seed=0):
    """A head whose fc mixes both halves (the init's zero embedding half would hide a wrong token index)."""
    head = FeatureHead(target.cfg).init_from(target).attach(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.fc.weight.add_(0.05 * torch.randn(head.fc.weight.shape, generator=gen))
    return head.eval()


def test_unrolled_steps_are_what_the_head_computes_over_its_cache():
    target = tiny_model("llama")
    head = random_head(target)
    gen = torch.Generator().manual_seed(1)
    t, steps = 24, 3
    features = torch.randn(1, t, target.cfg.hidden_size, generator=gen)
    tokens = torch.randint(target.cfg.vocab_size, (1, t), generator=gen)
    starts = torch.tensor([0, 5, 9, 18])
    with torch.no_grad():
        outs, _, _ = unroll(head, features, tokens, starts, steps)
        for row, s in enumerate(starts.tolist()):
            cache = StaticCache(head.cfg, t, 1)
            if s:  # true entries 0 .. s-1, then the round's first step feeds entry s
                head(features[:, :s], tokens[:, 1:s + 1], torch.arange(s), cache)
            pred = head(features[:, s:s + 1], tokens[:, s + 1:s + 2], torch.tensor([s]), cache)
            torch.testing.assert_close(pred[0, 0], outs[0][0, s], rtol=1e-5, atol=1e-5)
            for j in range(1, steps + 1):  # its own prediction in, the next token of the data
                pred = head(pred, tokens[:, s + j + 1:s + j + 2], torch.tensor([s + j]), cache)
                torch.testing.assert_close(pred[0, 0], outs[j][0, row], rtol=1e-5, atol=1e-5)


def test_unrolled_steps_draft_what_the_feature_drafter_drafts():
    target = tiny_model("llama")
    head = random_head(target, seed=2)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(target.cfg.vocab_size, (12,), generator=gen)
    features = torch.randn(12, target.cfg.hidden_size, generator=gen)
    drafter = FeatureDrafter.create(head, "full", 32)
    state = TargetState(cache=StaticCache(target.cfg, 32), queries={}, features=features)
    drafter.start(prompt, state, DraftContext(SamplingConfig(), None, Stopwatch()))
    with torch.no_grad():
        drafted = drafter.propose(4).tokens
    # The round starts at entry 10 (features of tokens 0..10 known, token 11 the verifier's); its drafts are
    # tokens 12..15, each the input token of the next step.
    tokens = torch.cat((prompt, drafted, drafted[-1:]))[None]
    padded = torch.cat((features, torch.zeros(5, features.shape[1])))[None]
    with torch.no_grad():
        outs, _, _ = unroll(head, padded, tokens, torch.tensor([10]), 3)
    steps = [outs[0][:, 10]] + [o[:, 0] for o in outs[1:]]
    assert [int(head.logits(s).argmax()) for s in steps] == drafted.tolist()


def test_the_loss_falls_and_the_curve_is_written(tmp_path):
    result = train_feature_drafter(config(tmp_path, "a", steps=12, lr=3e-3, eval_every=4, checkpoint_every=4,
                                          sequences=1, pydoc_sequences=0),
                                   tiny_model("llama"), progress=False, provenance=False)
    losses = [e["loss_a"] for e in result.history if "loss_a" in e]
    assert sum(losses[-3:]) < sum(losses[:3])
    curve = (result.run_dir / "curve.csv").read_text().splitlines()
    assert curve[0].startswith("step,train_tokens_seen,first_draft,first_draft_vocab,step_1")
    assert len(curve) >= 4
    assert (result.run_dir / "drafter" / "curve.csv").read_text().splitlines() == curve  # shipped with the drafter


def test_the_topk_target_is_the_greedy_ce_when_the_verifier_is_sure_and_drops_ids_outside_the_vocab():
    target = tiny_model("llama")
    head = random_head(target)
    ids = torch.tensor([5, 9, 17, 30, 41])
    tokens = TokenHead(head, ids)
    pred = torch.randn(1, 3, target.cfg.hidden_size)
    greedy = torch.tensor([[9, 30, 5]])
    top_ids = torch.stack([greedy, torch.full_like(greedy, 17), torch.full_like(greedy, 2)], dim=-1)
    sure = torch.tensor([1.0, 0.0, 0.0]).expand(1, 3, 3)
    hard = token_ce(tokens, pred, greedy)
    assert torch.allclose(token_ce(tokens, pred, greedy, (top_ids, sure)), hard)
    # token 2 is outside the draft vocabulary: its mass is dropped and the rest renormalised
    split = torch.tensor([0.3, 0.3, 0.4]).expand(1, 3, 3)
    logp = tokens.logits(pred).float().log_softmax(-1)
    expected = -(0.5 * logp[0, torch.arange(3), tokens.targets(greedy)[0]] + 0.5 * logp[0, :, 2]).mean()
    assert torch.allclose(token_ce(tokens, pred, greedy, (top_ids, split)), expected)
    assert not torch.allclose(expected, hard)


def test_a_topk_run_trains_on_the_cached_distribution(tmp_path):
    run = config(tmp_path, "k", steps=12, lr=3e-3, eval_every=4, checkpoint_every=4, sequences=1,
                 pydoc_sequences=0, token_target="topk")
    result = train_feature_drafter(run, tiny_model("llama"), progress=False, provenance=False)
    losses = [e["loss_a"] for e in result.history if "loss_a" in e]
    assert sum(losses[-3:]) < sum(losses[:3])
    greedy = train_feature_drafter(config(tmp_path, "g", steps=2, sequences=1, pydoc_sequences=0),
                                   tiny_model("llama"), progress=False, provenance=False)
    first = [e["token_0"] for e in result.history if "token_0" in e][0]
    assert first != [e["token_0"] for e in greedy.history if "token_0" in e][0]  # the target changed the loss


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    target = tiny_model("llama")
    straight = train_feature_drafter(config(tmp_path, "a"), target, progress=False, provenance=False)

    def crash(entry):
        if entry["step"] == 3:  # after the step-2 checkpoint and one more step that is lost
            raise Stop

    with pytest.raises(Stop):
        train_feature_drafter(config(tmp_path, "b"), target, progress=False, callback=crash, provenance=False)
    resumed = train_feature_drafter(config(tmp_path, "b"), target, progress=False, provenance=False)
    assert resumed.step == straight.step == 4
    assert resumed.record["resumed_from_step"] == 2 and "resumed_from_step" not in straight.record
    for (name, a), (_, b) in zip(straight.head.state_dict().items(), resumed.head.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(SparsedraftError, match="different run"):
        train_feature_drafter(config(tmp_path, "b", lam=0.0), target, progress=False, provenance=False)


def test_the_saved_drafter_loads_for_its_target_only(tmp_path):
    target = tiny_model("llama")
    result = train_feature_drafter(config(tmp_path, "a", steps=2, export=str(tmp_path / "export"),
                                          sampled_sequences=2, sampled_prompt=16, sampled_tokens=32), target,
                                   progress=False, provenance=False)
    for folder in (result.run_dir / "drafter", tmp_path / "export"):
        head = load_feature_head(folder, target)
        for name, value in result.head.state_dict().items():
            torch.testing.assert_close(head.state_dict()[name], value.to(torch.bfloat16).float())
        record = json.loads((folder / "feature_drafter.json").read_text())
        assert record["recipe"]["steps"] == 2 and record["loss"] == "L_A + lam * L_C"
        assert record["held_out_agreement"]["first_draft"] >= 0 and record["data"]["pydoc_tokens"] == 64
        assert record["data"]["sampled_tokens"] == 96
        assert set(record["training_fit"]) == {"essays", "pydoc", "sampled"}
    with pytest.raises(SparsedraftError, match="trained for target"):
        load_feature_head(tmp_path / "export", tiny_model("llama", seed=1))


def test_a_second_sampled_set_continues_the_same_prompts_anew_and_keeps_the_first_sets_file(tmp_path):
    target = tiny_model("llama")
    shape = dict(sequences=0, pydoc_sequences=0, sampled_sequences=2, sampled_prompt=16, sampled_tokens=32,
                 eval_sequences=0, lam=0.0)
    one = feature_train.load_feature_data(config(tmp_path, "a", **shape), target, model_tokenizer("tiny-llama"), False)
    two = feature_train.load_feature_data(config(tmp_path, "a", sampled_sets=2, **shape), target,
                                          model_tokenizer("tiny-llama"), False)
    assert len(list((tmp_path / "teacher").glob("sampled-*"))) == 2
    assert [w.tokens.tolist() for w in two.train[:2]] == [w.tokens.tolist() for w in one.train]
    for first, second in zip(two.train[:2], two.train[2:]):
        assert torch.equal(first.tokens[:16], second.tokens[:16]) and not torch.equal(first.tokens, second.tokens)
    assert two.sizes()["sampled_tokens"] == 2 * one.sizes()["sampled_tokens"]


def test_a_warm_start_begins_at_the_folders_weights_and_keeps_its_lineage(tmp_path, monkeypatch):
    target = tiny_model("llama")
    first = train_feature_drafter(config(tmp_path, "a", steps=2), target, progress=False, provenance=False)
    folder = first.run_dir / "drafter"
    saved = load_feature_head(folder, target).state_dict()
    starts = []
    real_step = feature_train.train_step

    def first_weights(cfg, head, *args):
        if not starts:
            starts.append({k: v.clone() for k, v in head.state_dict().items()})
        return real_step(cfg, head, *args)

    monkeypatch.setattr(feature_train, "train_step", first_weights)
    def fc_sum(head):  # an end-of-run check: the record keeps it for the start head and for the trained one
        return {"fc": float(head.fc.weight.detach().sum())}

    warm = train_feature_drafter(config(tmp_path, "b", steps=2, head_init=str(folder)), target, progress=False,
                                 provenance=False, evaluate=fc_sum)
    assert all(torch.equal(starts[0][k], saved[k]) for k in saved)  # the first step sees the folder's head
    assert not all(torch.equal(warm.head.state_dict()[k], saved[k]) for k in saved)  # and it trains on
    assert warm.history[0]["step"] == 0 and "eval" in warm.history[0]  # the curve starts at its agreement
    assert warm.record["started_from"]["steps"] == 2
    assert warm.record["started_from"]["held_out_agreement"] == first.record["held_out_agreement"]
    assert warm.record["started_from"]["measured"] == {"fc": float(saved["fc.weight"].sum())}
    assert warm.record["measured"] == fc_sum(warm.head) != warm.record["started_from"]["measured"]
    curve = (warm.run_dir / "drafter" / "curve.csv").read_text().splitlines()
    parent = (folder / "curve.csv").read_text().splitlines()
    assert curve[:len(parent)] == parent and len(curve) > len(parent)  # the drafter's curve covers both runs
    assert curve[len(parent)].startswith("4,")  # its steps are counted on from the parent's last (2)

    def no_data(*args, **kwargs):
        raise AssertionError("teacher data was made before the folder was checked")

    monkeypatch.setattr("sparsedraft.budgetdraft.feature_train.load_feature_data", no_data)
    with pytest.raises(SparsedraftError, match="trained for target"):
        train_feature_drafter(config(tmp_path, "d", head_init=str(folder)), tiny_model("llama", seed=1),
                              progress=False, provenance=False)


def test_a_warm_starts_curve_continues_its_parents():
    from sparsedraft.budgetdraft.feature_train import continue_curve
    parent = [{"step": 0, "train_tokens_seen": 0, "first_draft": 0.1},
              {"step": 400, "train_tokens_seen": 8000, "first_draft": 0.3}]
    own = [{"step": 0, "train_tokens_seen": 0, "first_draft": 0.3}, {"step": 100, "train_tokens_seen": 900,
                                                                      "first_draft": 0.35}]
    assert continue_curve(parent, own) == parent + [{"step": 500, "train_tokens_seen": 8900, "first_draft": 0.35}]
    assert continue_curve([], own) == own


def test_an_unknown_token_target_is_refused_by_the_config(tmp_path):
    with pytest.raises(SparsedraftError, match="token_target must be one of"):
        config(tmp_path, "x", token_target="kl")


@pytest.mark.parametrize("flags, message", [
    (["--kind", "feature", "--layers", "2"], "has no option.*--layers"),
    (["--kind", "slice", "--unroll", "2"], "has no option.*--unroll"),
    (["--kind", "feature", "--unroll", "-1"], "unroll must be >= 0"),
    (["--kind", "feature", "--budgets", "2048"], "longer than the largest budget"),
    (["--kind", "feature", "--temperature", "0", "--sampled-sets", "2"], "same text in every set"),
    (["--kind", "feature", "--temperature", "-0.1"], "temperature must be >= 0"),
    (["--kind", "feature", "--sequences", "0", "--pydoc-sequences", "0", "--sampled-sequences", "0"],
     "no training data"),
])
def test_bad_flags_fail_before_any_model_loads(flags, message, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("sparsedraft.budgetdraft.feature_train.load_model", no_loading)
    monkeypatch.setattr("sparsedraft.budgetdraft.train.load_model", no_loading)
    assert main(["train-drafter", *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_greedy_continuations_follow_the_teachers_own_greedy_tokens(tmp_path):
    from sparsedraft.budgetdraft.feature_data import sampled_teacher
    target = tiny_model("llama")
    prompt, new = 16, 24
    windows = sampled_teacher(target, "tiny-llama", model_tokenizer("tiny-llama"), 3, prompt, new, 0.0, 5, tmp_path,
                              batch=2)
    for w in windows:  # every continued token is the greedy token the decode computed one position before
        assert torch.equal(w.tokens[prompt:], w.greedy[prompt - 1:-1])
    sampled = sampled_teacher(target, "tiny-llama", model_tokenizer("tiny-llama"), 3, prompt, new, 1.0, 5,
                              tmp_path, batch=2)
    assert any(not torch.equal(w.tokens[prompt:], w.greedy[prompt - 1:-1]) for w in sampled)  # the check can fail


def test_an_offset_moves_every_sampled_prompt_that_many_tokens_into_its_stride(tmp_path):
    from sparsedraft.budgetdraft.feature_data import sampled_teacher
    from sparsedraft.engine.data import corpus_tokens
    target, tokenizer = tiny_model("llama"), model_tokenizer("tiny-llama")
    corpus = corpus_tokens(tokenizer, "train")
    count, prompt, offset = 3, 16, 7
    stride = corpus.numel() // count
    moved = sampled_teacher(target, "tiny-llama", tokenizer, count, prompt, 4, 0.0, 5, tmp_path, batch=3,
                            offset=offset)
    for i, w in enumerate(moved):
        assert torch.equal(w.tokens[:prompt], corpus[i * stride + offset:i * stride + offset + prompt])
    with pytest.raises(SparsedraftError, match="smaller offset"):
        sampled_teacher(target, "tiny-llama", tokenizer, count, prompt, 4, 0.0, 5, tmp_path, offset=stride)


def test_training_fit_scores_a_sampled_window_on_its_continued_part_only():
    target = tiny_model("llama")
    head = random_head(target)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.cfg.vocab_size, (40,), generator=g)
    features = torch.randn(40, target.cfg.hidden_size, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        out = head(features[None, :-1].float(), tokens[None, 1:], torch.arange(39))
    drafts = TokenHead(head, None).predict(out)[0]  # entry e drafts the target's greedy token at e + 1
    greedy = torch.cat((tokens[:1], drafts))  # a target that agrees with the head everywhere ...
    greedy[1:25] = (drafts[:24] + 1) % target.cfg.vocab_size  # ... but on the first 24 entries
    window = lambda source: Window(tokens, features, greedy, greedy[:, None], torch.ones(40, 1), source)
    fit = training_fit(head, [window("essays"), window("sampled")], sampled_prompt=25)
    assert fit["essays"] == pytest.approx(15 / 39) and fit["sampled"] == 1.0


def test_greedy_rounds_skip_past_the_bonus_token():
    hits = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert accepted_per_round(hits, 3) == [2, 1, 3]  # rows 0, 3 (0 + 2 + 1), 5 (3 + 1 + 1)
    assert accepted_per_round(hits, 1) == [1, 0, 1, 1]  # rows 0, 2, 3, 5


def test_a_round_stops_after_its_first_unsure_draft():
    hits = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    sure = torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    # row 0 drafts 2 (its second is unsure) and keeps both; row 3 drafts 3 and keeps them all
    assert stopped_rounds(hits, 3, sure) == [(2, 2), (3, 3)]
    assert stopped_rounds(hits, 3) == [(3, 2), (3, 3)]  # no stop: every round drafts gamma
    assert stopped_rounds(hits, 3, torch.zeros_like(sure)) == [(1, 1), (1, 1), (1, 0)]  # rows 0, 2, 4


def test_chain_conditionals_count_only_rounds_whose_earlier_drafts_all_held():
    hits = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    got = chain_conditionals(hits)
    assert [(c["reached"], c["kept"]) for c in got] == [(4, 3), (3, 2), (2, 1)]  # row 1's later hits never count
    assert got[1]["rate"] == pytest.approx(2 / 3) and got[2]["rate"] == 0.5
    assert chain_conditionals(torch.zeros(2, 2, dtype=torch.bool))[1]["rate"] is None


def test_greedy_continuations_are_each_prompts_own_greedy_decode(tmp_path, monkeypatch):
    """The end-of-run check's continuations, decoded one prompt at a time (a batched 6 x 4K prefill peaked at
    11.5 GB), are each prompt's plain greedy continuation, with the target's features of every token."""
    from sparsedraft.budgetdraft import feature_eval
    from sparsedraft.engine.generate import generate
    target = tiny_model("llama")
    rows = torch.randint(0, target.cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(feature_eval, "prompt_tokens", lambda tokenizer, context, split, variant: rows[variant])
    data = feature_eval.greedy_continuations(target, "tiny", None, tmp_path, prompts=3, context=40, new_tokens=6)
    assert data.tokens.shape == (3, 46) and data.features.shape == (3, 46, target.cfg.hidden_size)
    for i in range(3):
        assert torch.equal(data.tokens[i, 40:], generate(target, rows[i:i + 1], 6).tokens[0, -6:])
    assert len(list(tmp_path.glob("continuations-*.safetensors"))) == 1


def test_agreement_by_target_confidence_splits_the_first_draft_figure(tmp_path, monkeypatch):
    """Each scored position lands in the bucket of the target's own top-1 probability there (from its true
    feature, as its forward computes it); the buckets' shares sum to 1 and their agreements average back to
    first_draft."""
    from sparsedraft.budgetdraft import feature_eval
    target = tiny_model("llama")
    rows = torch.randint(0, target.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(feature_eval, "prompt_tokens", lambda tokenizer, context, split, variant: rows[variant])
    data = feature_eval.greedy_continuations(target, "tiny", None, tmp_path, prompts=2, context=40, new_tokens=12)
    report = feature_eval.continuation_report(random_head(target), data, gammas=(2,))
    buckets = report["by_target_confidence"]
    assert [b["from"] for b in buckets] == list(feature_eval.CONFIDENCE_EDGES[:-1])
    assert sum(b["share"] for b in buckets) == pytest.approx(1.0)
    assert sum(b["share"] * (b["first_draft"] or 0.0) for b in buckets) == pytest.approx(report["first_draft"])
    with torch.no_grad():  # positions 40..50 predict tokens 41..51, the ones the first drafts are scored on
        probs = torch.cat([target(data.tokens[i:i + 1]).float().softmax(-1)[0, 40:51].amax(-1) for i in range(2)])
    assert report["target_top1_mean"] == pytest.approx(float(probs.mean()), abs=1e-5)


def test_confidence_buckets_close_the_last_edge_and_leave_empty_ones_empty():
    hits = torch.tensor([1.0, 0.0, 1.0, 1.0])
    got = by_confidence(hits, torch.tensor([0.1, 0.2, 0.95, 1.0]))
    assert [b["share"] for b in got] == [0.5, 0.0, 0.0, 0.0, 0.5]
    assert got[0]["first_draft"] == 0.5 and got[1]["first_draft"] is None and got[-1]["first_draft"] == 1.0


def test_agreement_summary_reads_the_committed_drafters_record():
    """Notebook 06's agreement table reads the training run's record through agreement_summary: every figure is
    the record's own, and the best gamma is the one that keeps the most tokens per round."""
    from pathlib import Path
    record = json.loads((Path(__file__).parents[1] / "data/drafters/feature/feature_drafter.json").read_text())
    got = agreement_summary(record)
    assert got["first_draft_held_out"] == record["held_out_agreement"]["first_draft"]
    assert got["first_draft_continuations"] == record["measured"]["first_draft"]
    gammas = record["measured"]["gamma"]
    best = gammas[str(got["best_gamma"])]
    assert all(best["tokens_per_round"] >= g["tokens_per_round"] for g in gammas.values())
    assert got["kept_per_round"] == best["accepted_per_round"]
    assert got["train_tokens"] == record["data"]["train_tokens"] and got["steps"] == record["steps"]
    with_slice = {**record, "measured": {**record["measured"], "slice_first_draft": {"run": "x", "first_draft": 0.1}}}
    assert agreement_summary(with_slice)["slice_first_draft_continuations"] == 0.1
    empty = agreement_summary({})
    assert empty["best_gamma"] is None and empty["first_draft_continuations"] is None
    assert (empty["runs"], empty["steps_all_runs"], empty["started_from"]) == (1, 0, "")
    warm = {"steps": 3, "started_from": {"steps": 2, "command": "python -m sparsedraft train-drafter --out-dir runs/a "
                                                                "--lr 1e-3", "started_from": {"steps": 5}}}
    assert {k: agreement_summary(warm)[k] for k in ("runs", "steps_all_runs", "started_from")} == {
        "runs": 3, "steps_all_runs": 10, "started_from": "runs/a"}
    warm["started_from"]["command"] = "python -m sparsedraft train-drafter --out-dir=runs/b"
    assert agreement_summary(warm)["started_from"] == "runs/b"


def test_the_agreement_bench_measures_a_folder_as_the_training_run_would(tmp_path, capsys, monkeypatch):
    """bench.agreement on a trained folder: the same continuation report the end-of-run check computes, written
    as a results record that the README's loader accepts."""
    from sparsedraft.bench import agreement
    from sparsedraft.bench.record import load_records
    from sparsedraft.budgetdraft import feature_eval
    from sparsedraft.engine.data import model_tokenizer
    from sparsedraft import load_model
    target = load_model("tiny-llama")  # the loader names its source, which the drafter's fingerprint keeps
    run = train_feature_drafter(config(tmp_path, "a", steps=2), target, progress=False, provenance=False)
    folder, records = run.run_dir / "drafter", tmp_path / "records"
    agreement.main(["--draft", str(folder), "--context", "40", "--prompts", "2", "--tokens", "10",
                    "--draft-vocab", "0", "--cache-dir", str(tmp_path / "cont"), "--record", str(records / "a.json")])
    assert "first draft = the target's greedy token" in capsys.readouterr().out
    [(name, record)] = load_records(records)
    data = feature_eval.greedy_continuations(target, "tiny-llama", model_tokenizer("tiny-llama"), tmp_path / "cont",
                                             2, 40, 10)
    expected = feature_eval.continuation_report(load_feature_head(folder, target).eval(), data)
    assert record["result"]["report"]["first_draft"] == expected["first_draft"]
    assert record["result"]["bench"] == "agreement" and record["machine"]["read_gb_s"] > 0
    with pytest.raises(SparsedraftError, match="no slice drafter"):
        agreement.main(["--draft", str(folder), "--slice", str(tmp_path / "none")])
    agreement.main(["--draft", str(folder), "--context", "40", "--prompts", "2", "--tokens", "10", "--draft-vocab",
                    "0", "--cache-dir", str(tmp_path / "cont"), "--head-window", "2", "8"])
    windowed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert windowed["head_window"] == [2, 8]
    assert windowed["report"]["first_draft"] == feature_eval.continuation_report(
        load_feature_head(folder, target).eval(), data, window=(2, 8))["first_draft"]
    with pytest.raises(SparsedraftError, match="--head-window takes SINK >= 0 and WINDOW >= 1"):
        agreement.main(["--draft", str(folder), "--head-window", "2", "0"])
    agreement.main(["--draft", str(folder), "--context", "40", "--prompts", "2", "--tokens", "10", "--draft-vocab",
                    "0", "--cache-dir", str(tmp_path / "cont"), "--behind", "30"])
    behind = json.loads(capsys.readouterr().out.splitlines()[-1])["report"]["behind"]
    assert behind["prefix"] == 30 and behind["positions"] == 2 * 9
    assert all(0 <= behind[k] <= 1 for k in ("first_draft_alone", "first_draft_behind", "target_argmax_unchanged"))
    with pytest.raises(SparsedraftError, match="--behind takes a prefix length"):
        agreement.main(["--draft", str(folder), "--behind", "-1"])
    monkeypatch.setattr(agreement, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(SparsedraftError, match=r"one prefix per prompt: \[2, N\]"):
        agreement.measure(str(folder), 40, 2, 10, 0, "", str(tmp_path / "cont"), None, torch.zeros(3, 5, dtype=torch.long))


def test_the_context_check_reads_the_same_text_alone_whatever_the_prefix():
    """feature_context: the 'alone' reading ignores the prefix (two prefixes, the same figure), the 'behind' one
    reads the continuation after it, and each scores the drafts on the continued positions against the target's
    argmax in that reading."""
    from sparsedraft.budgetdraft.feature_context import first_draft_behind
    from sparsedraft.budgetdraft.feature_data import teacher_of
    from sparsedraft.budgetdraft.feature_eval import Continuations
    target = tiny_model("llama")
    head = random_head(target, seed=6)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(target.cfg.vocab_size, (2, 30), generator=gen)
    data = Continuations(tokens, torch.zeros(2, 30, target.cfg.hidden_size), prompt_len=10)
    prefixes = torch.randint(target.cfg.vocab_size, (2, 20), generator=gen)
    a = first_draft_behind(head, data, prefixes)
    b = first_draft_behind(head, data, torch.randint(target.cfg.vocab_size, (2, 25), generator=gen))
    assert a["first_draft_alone"] == b["first_draft_alone"] and a["positions"] == 2 * 19

    def by_hand(before):  # entry e drafts token e + 2, scored against the target's argmax there
        hits = []
        with torch.no_grad():
            for row, prefix in zip(tokens, before):
                seq = torch.cat((prefix, row))
                start = prefix.numel() + 10
                teacher = teacher_of(target, seq)
                outs, _, _ = unroll(head, teacher["features"][None].float(), seq[None],
                                    torch.zeros(0, dtype=torch.long), 0)
                hits.append(TokenHead(head, None).predict(outs[0][:, start - 1:seq.numel() - 2])[0]
                            == teacher["greedy"][start:-1])
        return float(torch.cat(hits).float().mean())
    assert a["first_draft_alone"] == pytest.approx(by_hand(prefixes[:, :0]))
    assert a["first_draft_behind"] == pytest.approx(by_hand(prefixes))
    with pytest.raises(SparsedraftError, match="one prefix of >= 1 tokens per continuation"):
        first_draft_behind(head, data, torch.zeros(1, 5, dtype=torch.long))


def test_a_windowed_unroll_is_what_the_head_computes_over_a_streaming_cache():
    """bench.agreement --head-window: the unroll's (sink, window) view gives, at every entry and draft step,
    what the head computes over its StreamingLLM cache at true positions; without the window it differs."""
    from sparsedraft.caches import StreamingCache
    target = tiny_model("llama")
    head = random_head(target, seed=4)
    gen = torch.Generator().manual_seed(5)
    t, steps, sink, window = 40, 3, 2, 6
    features = torch.randn(1, t, target.cfg.hidden_size, generator=gen)
    tokens = torch.randint(target.cfg.vocab_size, (1, t), generator=gen)
    starts = torch.tensor([3, 17, 30])
    with torch.no_grad():
        outs, _, _ = unroll(head, features, tokens, starts, steps, window=(sink, window))
        full, _, _ = unroll(head, features, tokens, starts, steps)
        assert not torch.allclose(outs[0][0, 20:], full[0][0, 20:], atol=1e-3)
        for row, s in enumerate(starts.tolist()):
            cache = StreamingCache(head.cfg, sink, window, spec_slots=steps + 1, positions="true")
            for e in range(s):  # one entry at a time, as a drafter's cache fills
                head(features[:, e:e + 1], tokens[:, e + 1:e + 2], torch.tensor([e]), cache)
            pred = head(features[:, s:s + 1], tokens[:, s + 1:s + 2], torch.tensor([s]), cache)
            torch.testing.assert_close(pred[0, 0], outs[0][0, s], rtol=1e-5, atol=1e-5)
            for j in range(1, steps + 1):
                pred = head(pred, tokens[:, s + j + 1:s + j + 2], torch.tensor([s + j]), cache)
                torch.testing.assert_close(pred[0, 0], outs[j][0, row], rtol=1e-5, atol=1e-5)
