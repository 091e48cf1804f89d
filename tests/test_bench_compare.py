"""``compare`` on tiny models: every method's row against the baseline from one process, lossless greedy
tokens, per-level stats in range, drafts loaded once, int8 shared by baseline and draft, and a result that
turns into a data frame and JSON with the same numbers."""

import json
import math

import pytest

import sparsedraft.bench.comparison
import sparsedraft.speculative.methods
from sparsedraft.bench import CompareConfig, compare
from sparsedraft.budgetdraft.config import TrainConfig
from sparsedraft.budgetdraft.train import train_drafter
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.quant import Int8Linear

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="tiny-llama", device="cpu", context=200, new_tokens=12, warmup=0, repeats=1, peak_s=0.01)
METHODS = (("spec", {"draft": "truncated:1", "gamma": 3}), ("retrieval", {"budget": 64, "gamma": 3}),
           ("triforce", {"budget": 64, "gamma1": 2, "gamma2": 4}),
           ("budgetdraft", {"draft": "truncated:1", "budget": 64, "gamma": 3}))


@pytest.fixture(scope="module")
def every_method():
    return compare(CompareConfig(**TINY, methods=METHODS))


def test_every_method_has_a_row_with_sound_numbers(every_method):
    result = every_method
    assert [r.method for r in result.rows] == ["ar", "spec", "retrieval", "triforce", "budgetdraft"]
    assert result.prompt_len == 200 and result.device == "cpu"
    ar = result.row("ar")
    assert ar.speedup == 1.0 and ar.end_to_end == 1.0 and ar.tokens_per_iteration is None and ar.acceptance == {}
    for row in result.rows:
        assert row.tokens_match is True, row.method  # greedy: lossless against the baseline, every timed run
        assert row.prefill_s > 0 and row.ms_per_token > 0
        assert row.tokens_per_s == pytest.approx(1000 / row.ms_per_token)
        assert row.speedup == pytest.approx(ar.ms_per_token / row.ms_per_token)
    for row in result.rows[1:]:
        assert list(row.acceptance)[-1] == "target" and row.tokens_per_iteration >= 1
        assert all(0 <= rate <= 1 for rate in row.acceptance.values())
        assert all(sum(h) == row.verifications[level] for level, h in row.histogram.items())
        assert all(sum(map(sum, row.rounds[level].values())) == row.verifications[level] for level in row.rounds)
        assert row.decode_s >= max(row.seconds.values())
    assert list(result.row("triforce").acceptance) == ["level2", "target"]
    assert result.row("retrieval").options == {"budget": 64, "gamma": 3}


def test_each_method_row_carries_the_cost_models_speedup_from_its_own_parts(every_method):
    from sparsedraft.analysis.costmodel import predicted_speedup
    ar = every_method.row("ar")
    assert ar.predicted_speedup is None
    for row, (_, options) in zip(every_method.rows[1:], METHODS):
        gammas = {k: v for k, v in options.items() if k.startswith("gamma")}
        assert row.predicted_speedup == predicted_speedup(gammas, row.seconds, row.drafted, row.verifications,
                                                          row.rounds, row.decode_s, ar.ms_per_token) > 0, row.method
    assert "model" in every_method.table().splitlines()[2]


def test_a_stopped_run_reports_the_two_acceptance_rates_its_model_takes():
    from sparsedraft.analysis.costmodel import confidence_alphas
    result = compare(CompareConfig(**TINY, methods=(("triforce", {"budget": 64, "gamma1": 2, "gamma2": 4,
                                                                   "draft_confidence": 0.5}),)))
    row = result.row("triforce")
    sure, unsure = confidence_alphas(row.rounds["target"], 4)
    assert row.stop_acceptance == {"sure": sure, "stopped_after": unsure}
    assert "of the tokens the proposer was sure of" in result.table()
    assert json.loads(json.dumps(result.to_dict()))["rows"][1]["stop_acceptance"] == row.stop_acceptance
    assert result.row("ar").stop_acceptance is None


def test_frame_records_and_json_hold_the_same_numbers(every_method):
    result = every_method
    frame = result.frame()
    assert list(frame.method) == [r.method for r in result.rows]
    assert list(frame.ms_per_token) == [r.ms_per_token for r in result.rows]
    record = json.loads(json.dumps(result.to_dict()))
    assert record["bench"] == "compare"
    assert record["config"]["methods"][1] == ["retrieval", {"budget": 64, "gamma": 3}]
    assert [r["speedup"] for r in record["rows"]] == [r.speedup for r in result.rows]
    table = result.table()
    assert all(f"{r.ms_per_token:.2f}" in table for r in result.rows)
    # every figure comes with the read bandwidth measured in the same process
    assert result.read_gb_s > 0 and record["read_gb_s"] == result.read_gb_s
    assert f"read bandwidth {result.read_gb_s:.1f} GB/s (1 GiB, this process)" in table


def test_json_leads_with_the_path_and_each_row_times_its_steps_beside_their_rooflines(every_method):
    record = json.loads(json.dumps(every_method.to_dict()))
    assert list(record)[:4] == ["bench", "isa", "read_gb_s", "peak_gflops"] and record["peak_gflops"]["fp32"] > 0
    steps = {row["method"]: [s["step"] for s in row["steps"]] for row in record["rows"]}
    tri = every_method.row("triforce")
    tokens = round(tri.drafted["level2"] / tri.verifications["level2"]) + 1
    assert steps["ar"] == ["decode"] and steps["retrieval"][1] == "self draft"
    assert steps["triforce"][1] == f"level2 verify-{tokens}" and len(steps["spec"]) == 1  # a draft model's bytes
    for row in record["rows"]:                                                             # are not the target's
        assert row["steps"][0]["context"] == 200 + 12 // 2
        assert all(s["over_roofline"] == pytest.approx(s["ms"] / s["roofline_ms"]) for s in row["steps"])
    assert [s["context"] for s in record["rows"][2]["steps"]] == [206, 64]
    assert "ms / roofline" in every_method.table()


def test_the_same_method_twice_is_labelled_by_its_options():
    result = compare(CompareConfig(**{**TINY, "new_tokens": 6}, methods=(("retrieval", {"budget": 64}),
                                                                        ("retrieval", {"budget": 128}))))
    assert [r.method for r in result.rows] == ["ar", "retrieval(budget=64)", "retrieval(budget=128)"]


def test_sampling_reports_no_token_match():
    result = compare(CompareConfig(**{**TINY, "new_tokens": 6}, temperature=0.8, seed=1, methods=(("retrieval", {"budget": 64}),)))
    assert [r.tokens_match for r in result.rows] == [None, None]
    assert "temperature 0.8" in result.table()


def test_int8_quantises_baseline_and_truncated_draft_alike(monkeypatch):
    seen = []
    original = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: seen.append(1) or original(self, x))
    result = compare(CompareConfig(**{**TINY, "new_tokens": 6}, quant="int8", methods=METHODS[:1]))
    assert seen and all(r.tokens_match for r in result.rows) and " int8 on cpu" in result.table()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A BudgetDraft run folder: a 1-layer drafter trained a few steps against tiny-llama."""
    tmp = tmp_path_factory.mktemp("bench_compare")
    cfg = TrainConfig(verifier="tiny-llama", layers=1, seq_len=160, sequences=2, eval_sequences=0, budgets=(32, 64),
                      steps=2, warmup=1, eval_every=0, final_context=0, teacher_dir=str(tmp / "teacher"),
                      out_dir=str(tmp / "run"))
    train_drafter(cfg, progress=False)
    return cfg.run_dir


def test_a_budgetdraft_run_folder_plugs_in_everywhere_and_loads_once(run_dir, monkeypatch):
    loads = []
    original = sparsedraft.speculative.methods.load_draft
    monkeypatch.setattr(sparsedraft.bench.comparison, "load_draft", lambda *a: loads.append(a[0]) or original(*a))
    draft = str(run_dir)
    result = compare(CompareConfig(**TINY, methods=(
        ("spec", {"draft": draft, "draft_cache": "budget", "budget": 64, "gamma": 3}),
        ("triforce", {"draft": draft, "budget": 64}), ("budgetdraft", {"draft": draft, "budget": 64}))))
    assert loads == [draft]
    assert all(r.tokens_match for r in result.rows)
    assert not any(math.isnan(v) for r in result.rows[1:] for v in r.acceptance.values())


def test_triforce_retrieval_budget_is_not_the_drafters_budget(run_dir):
    # level 1 drafts over a streaming cache: a retrieval budget outside the drafter's trained budgets is fine
    result = compare(CompareConfig(**{**TINY, "new_tokens": 4}, methods=(("triforce", {"draft": str(run_dir),
                                                                                        "budget": 96}),)))
    assert result.row("triforce").tokens_match is True


def test_a_missing_level1_draft_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(sparsedraft.bench.comparison, "load_draft", lambda *a: pytest.fail("loaded a draft"))
    with pytest.raises(SparsedraftError, match="not found"):
        compare(CompareConfig(**TINY, methods=(("triforce", {"draft": "./no/such/model.gguf", "budget": 64}),)))


def test_a_run_folder_refuses_a_budget_it_was_not_trained_on_before_loading(run_dir, monkeypatch):
    monkeypatch.setattr(sparsedraft.bench.comparison, "load_draft", lambda *a: pytest.fail("loaded a draft"))
    for method, options in (("budgetdraft", {}), ("spec", {"draft_cache": "budget"})):
        config = CompareConfig(**TINY, methods=((method, {"draft": str(run_dir), "budget": 96, **options}),))
        with pytest.raises(SparsedraftError, match="budget 96 was not among"):
            compare(config)


@pytest.mark.parametrize("methods, words", [
    (("ar",), "baseline"),
    (("nope",), "unknown method"),
    ((("retrieval", {"budgett": 64}),), "no option"),
    ((("retrieval", {"budget": 64}), ("retrieval", {"budget": 64})), "listed twice"),
    ((("retrieval", 64),), "name or a"),
])
def test_bad_method_lists_fail_on_construction(methods, words):
    with pytest.raises(SparsedraftError, match=words):
        CompareConfig(**TINY, methods=methods)


@pytest.mark.parametrize("bad, words", [(dict(quant="int4"), "quant"), (dict(context=1), "context"),
                                        (dict(temperature=-1.0), "temperature")])
def test_bad_shared_options_fail_on_construction(bad, words):
    with pytest.raises(SparsedraftError, match=words):
        CompareConfig(**{**TINY, **bad})


def test_a_preloaded_target_and_an_offset_prompt():
    from sparsedraft import load_model
    from sparsedraft.engine.data import bench_prompt
    config = CompareConfig(**{**TINY, "new_tokens": 4, "offset": 500}, methods=(("retrieval", {"budget": 64}),))
    target = load_model("tiny-llama")
    result = compare(config, target=target)
    assert result.row("retrieval").tokens_match is True
    assert not bench_prompt("tiny-llama", 200, offset=500).equal(bench_prompt("tiny-llama", 200))
    with pytest.raises(SparsedraftError, match="not loaded as"):
        compare(CompareConfig(**{**TINY, "model": "tiny-qwen2"}), target=target)


@pytest.fixture
def prompt_forwards(monkeypatch):
    """Lengths of the prompt forwards (into an empty full cache) of the tiny-llama target passed to compare."""
    from sparsedraft import load_model
    from sparsedraft.engine.cache import StaticCache
    from sparsedraft.engine.model import Transformer
    target, seen = load_model("tiny-llama"), []
    original = Transformer.forward

    def counting(self, tokens, positions=None, cache=None, **kwargs):
        if self is target and isinstance(cache, StaticCache) and cache.length == 0:
            seen.append(tokens.shape[1])
        return original(self, tokens, positions, cache, **kwargs)
    monkeypatch.setattr(Transformer, "forward", counting)
    return target, seen


def test_every_run_starts_from_one_prefill(prompt_forwards):
    target, seen = prompt_forwards
    result = compare(CompareConfig(**{**TINY, "new_tokens": 6, "warmup": 1, "repeats": 2}, methods=METHODS),
                     target=target)
    # the untimed warm-up chunk, then the one timed prefill (all but the last prompt token in its first
    # forward, see prefill.prefill_spans): not one per run
    assert seen == [TINY["context"] - 1] * 2
    assert all(r.tokens_match for r in result.rows)
    assert result.prefill_loaded_from is None and result.prefill_s > 0
    for row in result.rows:
        assert 0 < row.setup_s < row.prefill_s
        assert row.prefill_s == pytest.approx(result.prefill_s + row.setup_s)
    assert f"one prefill for every run: {result.prefill_s:.3f} s (computed here)" in result.table()
    assert json.loads(json.dumps(result.to_dict()))["prefill_s"] == result.prefill_s


def test_the_bench_cli_reads_the_prefill_from_its_disk_cache(prompt_forwards, tmp_path, capsys, monkeypatch):
    from sparsedraft.__main__ import main
    target, seen = prompt_forwards
    monkeypatch.setattr(sparsedraft.bench.comparison.weights, "load_model", lambda *a: target)
    flags = ["bench", "retrieval", "--model", "tiny-llama", "--device", "cpu", "--context", "200", "--new-tokens",
             "4", "--warmup", "0", "--budget", "64", "--prefill-cache", str(tmp_path / "prefill"),
             "--prefill-cache-gib", "0.5"]
    records = []
    for _ in range(2):
        assert main(flags) == 0
        records.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert seen == [199]  # one prefill (its first forward: all but the last prompt token); the second bench read it
    first, second = records
    assert first["prefill_loaded_from"] is None and second["prefill_loaded_from"].startswith(str(tmp_path))
    assert second["prefill_s"] == first["prefill_s"]  # the time it took to compute, kept with the entry
    assert [r["tokens_match"] for r in second["rows"]] == [True, True]
    assert second["config"]["prefill_cache_gib"] == 0.5
