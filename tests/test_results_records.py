"""Results records: the README's table is rendered from them, and a record without its provenance is refused."""

import json
import re

import pytest

from sparsedraft.bench import CompareConfig
from sparsedraft.bench.record import (BEGIN, END, TIMES_BEGIN, TIMES_END, load_records, refresh_readme, render_table,
                                      render_times,
                                      resolved_options, step_rows, write_record)
from sparsedraft.errors import SparsedraftError


def _result() -> dict:
    row = dict(method="ar", ms_per_token=50.0, speedup=1.0, tokens_match=True, acceptance={}, options={})
    tri = dict(method="triforce", ms_per_token=40.0, speedup=1.25, tokens_match=True,
               acceptance={"level2": 0.5, "target": 0.75}, options={"budget": 512})
    config = dict(model="smollm2-135m", new_tokens=64, temperature=0.0, top_p=1.0)
    return {"bench": "compare", "config": config, "prompt_len": 4000, "read_gb_s": 20.0, "rows": [row, tri]}


def _record(tmp_path, name="tri.json", drop=None):
    path = write_record(tmp_path / name, _result(), read_gb_s=20.0, command="python -m sparsedraft bench triforce")
    record = json.loads(path.read_text())
    if drop:
        record.pop(drop)
        path.write_text(json.dumps(record))
    return record


def test_write_record_names_command_commit_date_and_machine(tmp_path):
    record = _record(tmp_path)
    assert record["command"] == "python -m sparsedraft bench triforce"
    assert record["machine"]["read_gb_s"] == 20.0 and record["machine"]["isa"]
    assert set(record) >= {"commit", "dirty", "date", "result"}


def test_render_table_gives_one_line_per_method_row(tmp_path):
    record = _record(tmp_path)
    record.update(commit="0123456789abcdef", dirty=False, date="2026-12-03T21:00:00Z")
    record["machine"].update(isa="AVX2", torch_threads=1, load_1min=2.0)
    lines = render_table([("tri.json", record)]).splitlines()
    assert len(lines) == 3  # header, rule, the triforce row (the baseline is a column, not a row)
    assert lines[2] == ("| triforce (budget 512) | smollm2-135m | 4,000 | 64 greedy | 50.0 | 40.0 | **1.25x** "
                        "| 0.50 / 0.75 | yes | 2026-12-03, 0123456 | AVX2, 1 thread, 20.0 GB/s, load 2.0 | "
                        "[tri.json](docs/results/tri.json) |")


def test_a_compare_row_shows_the_cost_models_speedup_beside_the_measured_one(tmp_path):
    from sparsedraft.analysis.costmodel import predicted_speedup
    record = _record(tmp_path)
    record.update(commit="0123456789abcdef", dirty=False, date="2026-12-03T21:00:00Z")
    tri = record["result"]["rows"][1]
    tri["predicted_speedup"] = 1.3125
    assert "| **1.25x** (model 1.31x) |" in render_table([("tri.json", record)])
    del tri["predicted_speedup"]  # a record from before compare stored it: the same model over the parts it kept
    parts = dict(seconds={"draft": 0.08, "verify": 0.3}, drafted={"target": 40}, verifications={"target": 10},
                 rounds={"target": {"4": [2, 2, 2, 2, 2]}}, decode_s=0.39)
    tri.update(method="spec", **parts)
    assert "| **1.25x** |" in render_table([("tri.json", record)])  # no resolved gamma: no prediction
    record["result"]["resolved_options"] = {"spec": {"gamma": 4}}
    value = predicted_speedup({"gamma": 4}, *parts.values(), 50.0)
    assert f"| **1.25x** (model {value:.2f}x) |" in render_table([("tri.json", record)])
    record["result"]["config"]["batch"] = 2
    assert "| **1.25x** |" in render_table([("tri.json", record)])  # a batch: no model


def test_the_model_cell_names_a_dtype_other_than_fp32(tmp_path):
    record = _record(tmp_path)
    record.update(commit="0123456789abcdef", dirty=False, date="2026-12-03T21:00:00Z")
    assert "| smollm2-135m |" in render_table([("tri.json", record)])  # no dtype in the config: fp32
    record["result"]["config"]["dtype"] = "bf16"
    assert "| smollm2-135m bf16 |" in render_table([("tri.json", record)])


def test_the_context_cell_names_a_prompt_window_other_than_the_first(tmp_path):
    record = _record(tmp_path)
    record.update(commit="0123456789abcdef", dirty=False, date="2026-12-03T21:00:00Z")
    n = f"{record['result']['prompt_len']:,}"
    assert f"| {n} |" in render_table([("tri.json", record)])  # no variant in the config: window 0
    record["result"]["config"]["variant"] = 1
    assert f"| {n} (window 1) |" in render_table([("tri.json", record)])


@pytest.mark.parametrize("field", ["commit", "date", "machine", "command"])
def test_a_record_missing_a_field_is_refused(tmp_path, field):
    _record(tmp_path, drop=field)
    with pytest.raises(SparsedraftError, match=field):
        load_records(tmp_path)


def test_refresh_readme_replaces_only_between_the_markers(tmp_path):
    records = tmp_path / "results"
    _record(records)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\nmiddle\n{TIMES_BEGIN}\nold times\n{TIMES_END}\nafter\n")
    refresh_readme(readme, records)
    text = readme.read_text()
    assert text.startswith(f"intro\n{BEGIN}\n| method") and f"|\n{END}\nmiddle\n{TIMES_BEGIN}\n| profile" in text
    assert text.endswith(f"|\n{TIMES_END}\nafter\n")
    assert "old table" not in text and "old times" not in text and "**1.25x**" in text
    for broken in ("no markers\n", f"{BEGIN}\n{END}\n"):  # the times markers are required too
        readme.write_text(broken)
        with pytest.raises(SparsedraftError, match="markers"):
            refresh_readme(readme, records)


def test_the_table_shows_the_options_a_record_resolved():
    result = _result()
    result["resolved_options"] = resolved_options(CompareConfig(model="tiny-llama", methods=(("triforce", {"budget": 512}),)))
    assert result["resolved_options"]["triforce"]["budget"] == 512 and "gamma1" in result["resolved_options"]["triforce"]
    record = {"command": "c", "commit": "0" * 40, "dirty": False, "date": "2026-12-03T00:00:00Z",
              "machine": {"isa": "AVX2", "read_gb_s": 20.0}, "result": result}
    options = result["resolved_options"]["triforce"]
    assert render_table([("r.json", record)]).splitlines()[2].startswith(
        f"| triforce (draft {options['draft']}, budget 512, gamma1 {options['gamma1']}, gamma2 {options['gamma2']}) |")


def test_bench_record_flag_writes_a_record_the_table_renders(tmp_path, capsys):
    from sparsedraft.__main__ import main
    path = tmp_path / "tiny.json"
    assert main(["bench", "triforce", "--model", "tiny-llama", "--context", "200", "--new-tokens", "8",
                 "--budget", "64", "--warmup", "0", "--record", str(path)]) == 0
    [(name, record)] = load_records(tmp_path)
    assert record["command"] == ("python -m sparsedraft bench triforce --model tiny-llama --context 200 "
                                 f"--new-tokens 8 --budget 64 --warmup 0 --record {path}")
    assert record["result"]["resolved_options"]["triforce"]["budget"] == 64
    assert "| triforce (draft ngram, budget 64," in render_table([(name, record)])


def test_the_readme_table_is_the_rendering_of_the_committed_records():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    records = load_records(root / "docs" / "results")
    assert table == render_table(records), \
        "README's results table differs from docs/results: run python -m sparsedraft results and commit both"
    times = text.split(TIMES_BEGIN, 1)[1].split(TIMES_END, 1)[0].strip()
    assert times == render_times(records), \
        "README's run times differ from docs/results: run python -m sparsedraft results and commit both"


def _curve_run(outputs, commit="fedcba9876543210", machine=True):
    """A finished notebook-05 run folder as the runner and the notebook leave it (two contexts, the race)."""
    run = outputs / "05_triforce_decoding" / "cpu-abc"
    run.mkdir(parents=True)
    record = {"notebook": "05_triforce_decoding", "profile": "cpu", "status": "ok", "started": "2026-12-04T15:00:00+00:00",
              "wall_s": 900.0, "threads": None, "commit": commit, "dirty": False}
    if machine:
        record["machine"] = {"isa": "AVX2+FMA", "cores": 2, "torch_threads": 2, "read_gb_s": None}
    (run / "run.json").write_text(json.dumps(record))
    (run / "parameters.json").write_text(json.dumps({"curve_model": "smollm2-135m-yarn32k"}))
    (run / "speedup_vs_context.png").write_bytes(b"\x89PNG fake")
    (run / "speedup_vs_context.csv").write_text(
        "context,ar_ms_per_token,triforce_budget,triforce_gamma1,triforce_gamma2,triforce_speedup,retrieval_budget,"
        "retrieval_gamma2,retrieval_speedup,predicted_speedup,read_gb_s,new_tokens\n"
        "8000,60.0,1024,2,6,1.5,1024,8,1.2,1.6,21.0,128\n"
        "32000,150.0,2048,2,6,1.4,2048,6,1.1,1.45,20.0,128\n")
    (run / "speedup_vs_context_runs.csv").write_text(
        "context,decoding,method,budget,gamma1,gamma2,ms_per_token,ar_ms_per_token,speedup,acceptance_level2,"
        "acceptance_target,tokens_match\n"
        "8000,greedy,triforce,1024,4.0,8,45.0,60.0,1.33,0.6,0.9,True\n"
        "8000,greedy,triforce,1024,2.0,6,40.0,60.0,1.5,0.7,0.95,True\n"
        "8000,greedy,retrieval,1024,,8,50.0,60.0,1.2,,0.9,True\n"
        "8000,sampled,triforce,1024,2.0,6,41.0,61.0,1.49,0.7,0.9,\n"
        "32000,greedy,triforce,2048,2.0,6,107.1,150.0,1.4,0.75,0.9,True\n"
        "32000,greedy,retrieval,2048,,6,136.4,150.0,1.1,,0.92,True\n")
    (run / "level1_race.csv").write_text(
        "context,level1,speedup,ms_per_token,ar_ms_per_token,acceptance_level2,acceptance_target,tokens_match,"
        "read_gb_s\n"
        "32000,prompt lookup,1.4,107.0,150.0,0.75,0.9,True,20.5\n"
        "32000,feature drafter,0.9,166.7,150.0,0.3,0.9,True,20.5\n")
    (run / "level2_race.csv").write_text(
        "context,draft_weights,draft_confidence,speedup,ms_per_token,ar_ms_per_token,level2_step_over_decode,"
        "acceptance_level2,acceptance_target,tokens_match,read_gb_s\n"
        "32000,same,0.0,1.38,108.7,150.0,0.4,0.75,0.9,True,20.5\n"
        "32000,int8,0.0,1.6,93.8,150.0,0.3,0.74,0.9,True,20.5\n"
        "32000,int8,0.3,1.9,78.9,150.0,0.3,0.74,0.97,True,20.5\n")
    return run


def test_the_curve_record_takes_each_context_best_rows_and_the_race_from_notebook_05s_run(tmp_path):
    from sparsedraft.runner.results import record_curve
    _curve_run(tmp_path / "outputs")
    path = record_curve(tmp_path / "outputs", "cpu", tmp_path / "results")
    record = json.loads(path.read_text())
    assert path.name == "speedup-vs-context-cpu.json"
    assert record["commit"].startswith("fedcba") and record["machine"]["read_gb_s"] == 20.5
    rows = record["result"]["rows"]
    assert [(r["context"], r["method"], r["options"].get("draft")) for r in rows] == [
        (8000, "triforce", "ngram"), (8000, "retrieval", None), (32000, "triforce", "ngram"),
        (32000, "retrieval", None), (32000, "triforce", "feature"), (32000, "triforce", "ngram"),
        (32000, "triforce", "ngram")]
    quantised, stopped = rows[-2:]
    assert quantised["options"]["draft_weights"] == "int8" and quantised["level2_step_over_decode"] == 0.3
    assert "draft_confidence" not in quantised["options"] and stopped["options"]["draft_confidence"] == 0.3
    assert stopped["speedup"] == 1.9 and stopped["options"]["draft_weights"] == "int8"
    assert rows[0]["ms_per_token"] == 40.0 and rows[0]["options"]["gamma1"] == 2  # the best, not the first, setting
    lines = render_table(load_records(tmp_path / "results")).splitlines()
    assert len(lines) == 2 + 7
    assert "| 8,000 | 128 greedy | 60.0 | 40.0 | **1.50x** (model 1.60x) | 0.70 / 0.95 | yes | 2026-12-04, fedcba9 |" \
        in lines[2]


def test_the_curve_record_refuses_a_run_without_commit_or_curve(tmp_path):
    from sparsedraft.runner.results import record_curve
    with pytest.raises(SparsedraftError, match="no finished run of notebook 05"):
        record_curve(tmp_path / "outputs", "cpu", tmp_path / "results")
    run = _curve_run(tmp_path / "outputs", machine=False)
    with pytest.raises(SparsedraftError, match="names no commit or machine"):
        record_curve(tmp_path / "outputs", "cpu", tmp_path / "results")
    (run / "level1_race.csv").unlink()
    (run / "speedup_vs_context_runs.csv").unlink()
    with pytest.raises(SparsedraftError, match="speedup_vs_context_runs.csv missing"):
        record_curve(tmp_path / "outputs", "cpu", tmp_path / "results")


def _speed_run(outputs, label="BudgetDraft (budget cache)"):
    """A finished notebook-06 run folder holding its timed runs of the feature drafter at 16K."""
    run = outputs / "06_budgetdraft" / "budgetdraft-long-abc"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "notebook": "06_budgetdraft", "profile": "budgetdraft-long", "status": "ok",
        "started": "2026-12-05T19:00:00+00:00", "wall_s": 4000.0, "threads": None, "commit": "ab" * 20,
        "dirty": False, "machine": {"isa": "AMX", "cores": 2, "torch_threads": 2, "read_gb_s": 28.0}}))
    (run / "parameters.json").write_text(json.dumps({
        "verifier": "smollm2-135m-yarn32k", "speed_tokens": 128, "gamma": 4, "feature_draft_vocab": 8192,
        "triforce_gammas": [2, 6]}))
    (run / "feature_speed.csv").write_text(
        "context,method,budget,speedup,predicted_speedup,ms_per_token,ar_ms_per_token,tokens_per_iteration,"
        "acceptance,alpha,draft_ms,verify_ms,lossless,read_gb_s\n"
        "16384,EAGLE (full cache),,1.1,1.2,90.0,99.0,2.0,0.3,0.35,3.0,120.0,True,26.0\n"
        f"16384,{label},1024.0,1.05,1.15,94.3,99.0,1.9,0.28,0.33,2.5,120.0,True,27.0\n"
        "16384,\"TriForce, feature level 1\",512.0,0.9,0.95,110.0,99.0,3.0,0.8,,,,True,25.0\n"
        "16384,\"TriForce, prompt lookup level 1\",512.0,2.0,2.2,49.5,99.0,3.5,0.85,,,,True,25.0\n")
    return run


def test_the_speed_record_turns_notebook_06s_timed_runs_into_results_rows(tmp_path):
    from sparsedraft.runner.results import record_speed
    with pytest.raises(SparsedraftError, match="no finished run of notebook 06"):
        record_speed(tmp_path / "outputs", "budgetdraft-long", tmp_path / "results")
    _speed_run(tmp_path / "outputs")
    path = record_speed(tmp_path / "outputs", "budgetdraft-long", tmp_path / "results")
    record = json.loads(path.read_text())
    assert path.name == "budgetdraft-speed-budgetdraft-long.json"
    assert record["machine"]["read_gb_s"] == 26.0 and record["result"]["model"] == "smollm2-135m-yarn32k"
    rows = record["result"]["rows"]
    assert [(r["method"], r["options"]["draft"], r["options"].get("budget")) for r in rows] == [
        ("spec", "feature", None), ("budgetdraft", "feature", 1024), ("triforce", "feature", 512),
        ("triforce", "ngram", 512)]
    assert rows[1]["options"] == {"draft": "feature", "budget": 1024, "gamma": 4, "draft_vocab": 8192}
    assert rows[2]["options"]["gamma1"] == 2 and rows[2]["options"]["gamma2"] == 6
    assert all(r["context"] == 16384 - 128 and r["tokens"] == 128 and r["tokens_match"] for r in rows)
    lines = render_table(load_records(tmp_path / "results")).splitlines()
    assert len(lines) == 2 + 4
    assert ("| budgetdraft (draft feature, budget 1024, gamma 4, draft_vocab 8192) | smollm2-135m-yarn32k | 16,256 "
            "| 128 greedy | 99.0 | 94.3 | **1.05x** (model 1.15x) | 0.28 | yes | 2026-12-05, abababa |") in lines[3]


def test_the_speed_record_names_the_head_behind_prompt_lookup_and_lookup_alone(tmp_path):
    """Notebook 06 also times the head behind prompt lookup (feature_draft_lookup) and prompt lookup alone, with
    its confidence stop where set: each row carries the options it ran with."""
    from sparsedraft.runner.results import record_speed
    run = _speed_run(tmp_path / "outputs", label="EAGLE behind prompt lookup")
    parameters = json.loads((run / "parameters.json").read_text())
    (run / "parameters.json").write_text(json.dumps({**parameters, "feature_draft_lookup": 0.5,
                                                     "feature_draft_confidence": 0.4}))
    with (run / "feature_speed.csv").open("a") as table:
        table.write("16384,prompt lookup,,1.5,1.6,66.0,99.0,2.4,0.5,0.45,0.3,120.0,True,27.0\n")
    rows = json.loads(record_speed(tmp_path / "outputs", "budgetdraft-long", tmp_path / "results").read_text())
    options = [r["options"] for r in rows["result"]["rows"]]
    assert options[0] == {"draft": "feature", "draft_cache": "full", "gamma": 4, "draft_vocab": 8192,
                          "draft_confidence": 0.4}
    assert options[1] == {**options[0], "draft_lookup": 0.5}
    assert options[-1] == {"draft": "ngram", "gamma": 4}


def test_the_speed_record_refuses_a_row_it_cannot_name(tmp_path):
    from sparsedraft.runner.results import record_speed
    _speed_run(tmp_path / "outputs", label="Medusa (tree)")
    with pytest.raises(SparsedraftError, match="SPEED_METHODS"):
        record_speed(tmp_path / "outputs", "budgetdraft-long", tmp_path / "results")


def test_results_from_runs_records_each_notebook_the_profile_ran(tmp_path):
    from sparsedraft.__main__ import main
    outputs, results = tmp_path / "outputs", tmp_path / "results"
    _speed_run(outputs)
    (outputs / "run-budgetdraft-long.json").write_text(json.dumps({
        "profile": "budgetdraft-long", "commit": "ab" * 20, "dirty": False, "date": "2026-12-05T19:00:00Z",
        "wall_s": 4000.0, "peak_rss_mb": 6000, "machine": {"isa": "AMX", "read_gb_s": None}, "threads": None,
        "notebooks": [{"notebook": "06_budgetdraft", "status": "ok", "wall_s": 3990.0,
                       "run": "outputs/06_budgetdraft/budgetdraft-long-abc"}]}))
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n{TIMES_BEGIN}\n{TIMES_END}\n")
    assert main(["results", "--from-runs", str(outputs), "--profile", "budgetdraft-long", "--records", str(results),
                 "--readme", str(readme)]) in (0, None)
    assert sorted(p.name for p in results.iterdir()) == ["budgetdraft-speed-budgetdraft-long.json",
                                                         "reproduce-budgetdraft-long.json"]
    timing = json.loads((results / "reproduce-budgetdraft-long.json").read_text())
    assert timing["machine"]["read_gb_s"] == 26.0  # the runner measured none: the timed runs' own
    assert "| `budgetdraft-long` | 67 min | 06 3990 s |" in readme.read_text()
    assert "budgetdraft (draft feature, budget 1024" in readme.read_text()


def test_the_reproduce_record_carries_the_runners_timing(tmp_path):
    from sparsedraft.runner.results import record_timing
    outputs = tmp_path / "outputs"
    with pytest.raises(SparsedraftError, match="no timing in"):
        record_timing(outputs, "cpu", tmp_path / "results")
    outputs.mkdir()
    (outputs / "run-cpu.json").write_text(json.dumps({
        "profile": "cpu", "commit": "ab" * 20, "dirty": False, "date": "2026-12-04T16:00:00Z", "wall_s": 3000.0,
        "peak_rss_mb": 5400, "machine": {"isa": "AVX2+FMA", "read_gb_s": None}, "threads": None,
        "notebooks": [{"notebook": "01_bottleneck_shift", "status": "ok", "wall_s": 250.0, "run": "x"},
                      {"notebook": "02_attention_sparsity", "status": "ok", "wall_s": 90.0,
                       "run": "outputs/02_attention_sparsity/cpu-1234"}]}))
    run = outputs / "02_attention_sparsity" / "cpu-1234"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"recovery_topk": 0.89, "debug": 3, "headline": ["recovery_topk"]}))
    (tmp_path / "results").mkdir()
    record = json.loads(record_timing(outputs, "cpu", tmp_path / "results", read_gb_s=21.5).read_text())
    assert "metrics" not in record["result"]["rows"][0]  # no run folder: no metrics, no error
    assert record["result"]["rows"][1]["metrics"] == {"recovery_topk": 0.89, "debug": 3, "headline": ["recovery_topk"]}
    assert record["result"]["wall_s"] == 3000.0 and record["result"]["rows"][0]["wall_s"] == 250.0
    assert record["machine"]["read_gb_s"] == 21.5
    measured = json.loads((outputs / "run-cpu.json").read_text())  # --measure-machine: the run's own bandwidth wins
    measured["machine"] = {"isa": "AVX2+FMA", "read_gb_s": 17.0, "peak_gflops_fp32": 30.0}
    (outputs / "run-cpu.json").write_text(json.dumps(measured))
    record = json.loads(record_timing(outputs, "cpu", tmp_path / "results", read_gb_s=21.5).read_text())
    assert record["machine"]["read_gb_s"] == 17.0 and record["machine"]["peak_gflops_fp32"] == 30.0
    assert load_records(tmp_path / "results")  # a valid record; the results table has no row for it
    assert render_table(load_records(tmp_path / "results")).count("\n") == 1
    times = render_times(load_records(tmp_path / "results")).splitlines()
    assert times[2] == ("| `cpu` | 50 min | 01 250 s, 02 90 s | 5.3 GB | 2026-12-04, abababa | AVX2+FMA, 17.0 GB/s, 30 GFLOP/s "
                        "| [reproduce-cpu.json](docs/results/reproduce-cpu.json) |")


def test_a_profile_without_a_curve_is_timed_alone_and_needs_its_own_bandwidth(tmp_path, capsys):
    from sparsedraft.__main__ import main
    outputs, results = tmp_path / "outputs", tmp_path / "results"
    outputs.mkdir()
    results.mkdir()
    run = {"profile": "batch-16k", "commit": "cd" * 20, "dirty": False, "date": "2026-12-05T17:00:00Z",
           "wall_s": 1500.0, "peak_rss_mb": 7000, "machine": {"isa": "AMX", "read_gb_s": None}, "threads": None,
           "notebooks": [{"notebook": "09_batching", "status": "ok", "wall_s": 1490.0, "run": "x"}]}
    (outputs / "run-batch-16k.json").write_text(json.dumps(run))
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n{TIMES_BEGIN}\n{TIMES_END}\n")
    args = ["results", "--from-runs", str(outputs), "--profile", "batch-16k", "--records", str(results),
            "--readme", str(readme)]
    assert main(args) != 0  # no curve gives a bandwidth either
    assert "--measure-machine" in capsys.readouterr().err
    run["machine"]["read_gb_s"] = 25.0
    (outputs / "run-batch-16k.json").write_text(json.dumps(run))
    assert main(args) in (0, None)
    assert sorted(p.name for p in results.iterdir()) == ["reproduce-batch-16k.json"]  # no curve record
    assert "| `batch-16k` | 25 min | 09 1490 s |" in readme.read_text()


def test_the_figure_takes_each_context_from_the_newest_curve_record(tmp_path, monkeypatch):
    from sparsedraft import report
    from sparsedraft.runner.results import draw_curves, record_curve
    assert draw_curves(tmp_path / "results") is None  # no curve record: no figure
    run = _curve_run(tmp_path / "outputs")
    record_curve(tmp_path / "outputs", "cpu", tmp_path / "results")
    older = tmp_path / "results" / "speedup-vs-context-cpu-long.json"
    (tmp_path / "results" / "speedup-vs-context-cpu.json").rename(older)
    record = json.loads(older.read_text())
    record["date"], record["commit"] = "2026-12-01T00:00:00Z", "1111111111"
    for row in record["result"]["rows"]:  # the quantised level-2 row is not drawn: the figure is full precision
        row["speedup"] = 99.0 if row["options"].get("draft_weights", "same") != "same" else 9.0
    older.write_text(json.dumps(record))
    (run / "speedup_vs_context.csv").write_text(  # the newer run holds 8K only
        "context,ar_ms_per_token,triforce_budget,triforce_gamma1,triforce_gamma2,triforce_speedup,retrieval_budget,"
        "retrieval_gamma2,retrieval_speedup,predicted_speedup,read_gb_s,new_tokens\n"
        "8000,60.0,1024,2,6,1.5,1024,8,1.2,1.6,21.0,128\n")
    record_curve(tmp_path / "outputs", "cpu", tmp_path / "results")
    drawn = {}
    real = report.line_figure
    monkeypatch.setattr(report, "line_figure", lambda frame, *a, **k: drawn.update(frame=frame, **k) or real(frame, *a, **k))
    path = draw_curves(tmp_path / "results")
    assert path.read_bytes().startswith(b"\x89PNG")
    got = {(r.context, r.method, r.source): r.speedup for r in drawn["frame"].itertuples()}
    assert got[(8000, "TriForce", "measured")] == 1.5 and got[(8000, "TriForce", "cost model")] == 1.6
    assert got[(32000, "TriForce", "measured")] == 9.0  # only the older record holds 32K
    assert "8K-8K: 2026-12-04, fedcba9" in drawn["title"] and "32K-32K: 2026-12-01, 1111111" in drawn["title"]


def test_step_rows_flatten_every_timed_step_with_its_record(tmp_path):
    record = _record(tmp_path)
    decode = dict(step="decode", dtype="fp32", context=4064, tokens=1, ms=200.0, roofline_ms=80.0, over_roofline=2.5,
                  bound="memory", gb=0.7, gflop=0.5)
    level2 = dict(decode, step="level2 verify-4", context=1024, tokens=4, ms=120.0, roofline_ms=60.0)
    record["result"]["rows"][0]["steps"] = [decode]
    record["result"]["rows"][1]["steps"] = [level2]
    rows = step_rows([("tri.json", record), ("curve.json", {**record, "result": {"bench": "curve", "rows": []}})])
    assert [(r["record"], r["method"], r["step"], r["ms"], r["roofline_ms"]) for r in rows] == [
        ("tri.json", "ar", "decode", 200.0, 80.0), ("tri.json", "triforce", "level2 verify-4", 120.0, 60.0)]
    assert rows[0]["read_gb_s"] == 20.0 and rows[0]["date"] == record["date"][:10] and "gb" not in rows[0]


def test_kernel_timing_writes_a_record_with_its_own_bandwidth(tmp_path, capsys):
    from sparsedraft.bench import kernel_timing
    from sparsedraft.engine import kernels
    if not kernels.available():
        pytest.skip("the C++ kernel does not build here")
    with pytest.raises(SparsedraftError, match="takes a .json path"):
        kernel_timing.main(["--record", str(tmp_path / "k.txt")])
    kernel_timing.main(["--context", "300", "--tokens", "1", "3", "--dtype", "fp32", "--repeats", "1",
                        "--record", str(tmp_path / "k.json")])
    [(name, record)] = load_records(tmp_path)
    rows = record["result"]["rows"]
    assert {r["method"] for r in rows} == {"sdpa", "kernel", "kernel, rows as lanes"} and len(rows) == 6
    assert record["machine"]["read_gb_s"] > 0 and record["command"].endswith(f"--record {tmp_path / 'k.json'}")
    assert render_table([(name, record)]).count("\n") == 1  # a kernel record adds no results-table row


def test_a_timed_command_is_recorded_with_its_exit_status_and_peak_memory(tmp_path):
    """``timed`` runs the command, and its record (rc, wall time, the largest process's RSS) renders as a run-times
    line; a command that fails keeps its status; a folder outside git is refused before anything runs."""
    import sys
    from pathlib import Path
    from sparsedraft.__main__ import main
    root = Path(__file__).resolve().parents[1]
    record = tmp_path / "command-x.json"
    grab = f"{sys.executable} -c 'x = bytearray(200 * 2**20); x[::4096] = b\"1\" * len(x[::4096])'; exit 3"
    assert main(["timed", "--record", str(record), "--label", "test", "--cwd", str(root), "--", "sh", "-c",
                 grab]) == 3
    saved = json.loads(record.read_text())
    run = saved["result"]["rows"][0]
    assert run["rc"] == 3 and run["argv"][:2] == ["sh", "-c"]
    assert run["peak_rss_mb"] >= 200 and saved["commit"] and saved["machine"]["read_gb_s"] > 0
    line = render_times(load_records(tmp_path)).splitlines()[2]
    assert line.startswith("| `sh -c ") and "(test) |" in line and f"| exit status 3 | {run['peak_rss_mb'] / 1024:.1f} GB |" in line
    assert main(["timed", "--record", str(record), "--cwd", str(root)]) == 2  # nothing to run: one error
    assert main(["timed", "--record", str(tmp_path / "y.json"), "--cwd", str(tmp_path), "--", "true"]) == 2
    assert not (tmp_path / "y.json").exists()


def test_every_record_the_docs_cite_is_committed_and_every_page_says_where_its_figures_come_from():
    """README and docs/ cite their figures' records by file name; a cited record that is not in docs/results/
    (renamed, never committed) would leave a figure with nothing behind it. Pages that state measurements open
    with a note naming where they come from."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    results = root / "docs" / "results"
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    cited = {(page.name, name) for page in pages
             for name in re.findall(r"([\w.-]+\.json)", page.read_text()) if not name.startswith(("feature_drafter",
                                                                                              "metrics", "parameters",
                                                                                              "run", "state"))}
    assert cited, "no page cites a record"
    committed = {path.name for path in results.rglob("*.json")}  # drafter-runs/ and the like count too
    missing = sorted((page, name) for page, name in cited if name not in committed
                     and "<" not in name and "NAME" not in name and "*" not in name and "R.json" != name)
    assert not missing, f"records cited but not committed: {missing}"
    measured = ("batching.md", "budgetdraft.md", "engine.md", "long-context.md", "notebooks.md")
    for name in measured:
        head = (root / "docs" / name).read_text()[:600]
        assert "Where the" in head and "come from" in head, f"docs/{name} does not open with where its figures come from"


def test_also_times_variants_of_the_method_in_the_same_process_and_each_gets_a_row(tmp_path, capsys):
    """``--also`` adds the method again with options changed: one record, the baseline and a row per variant,
    each rendered with the options it ran with; a misspelt option or a mistyped value is refused before any
    model loads."""
    from sparsedraft.__main__ import main
    path = tmp_path / "race.json"
    assert main(["bench", "spec", "--model", "tiny-llama", "--context", "120", "--new-tokens", "8", "--warmup", "0",
                 "--draft", "truncated:1", "--gamma", "3", "--also", "draft=ngram",
                 "--also", "gamma=2,draft-lookup=0.5",
                 "--record", str(path)]) == 0
    [(name, record)] = load_records(tmp_path)
    rows = record["result"]["rows"]
    assert [r["method"] for r in rows][0] == "ar" and len(rows) == 4
    assert all(r["tokens_match"] for r in rows[1:])
    resolved = list(record["result"]["resolved_options"].values())
    assert [(o["draft"], o["gamma"], o["draft_lookup"]) for o in resolved] == [
        ("truncated:1", 3, 0.0), ("ngram", 3, 0.0), ("truncated:1", 2, 0.5)]
    lines = render_table([(name, record)]).splitlines()[2:]
    assert len(lines) == 3 and lines[1].startswith("| spec (draft ngram,") and "draft_lookup 0.5" in lines[2]
    for bad, message in (("gama=2", "not OPTION=VALUE"), ("gamma=two", "type int"), ("draft_lookup", "not OPTION")):
        assert main(["bench", "spec", "--model", "no-such-model", "--also", bad]) == 2
        assert message in capsys.readouterr().err, bad
