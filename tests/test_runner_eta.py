"""The overall ETA of a notebook run: each notebook's expected time is its newest finished run's wall time under
the same profile (another profile's when that one never ran), and a notebook that never ran is said to have no
estimate rather than given an invented one."""

import json
from pathlib import Path

from sparsedraft.runner.config import NotebookRun
from sparsedraft.runner.eta import Overall, Plan, recorded_seconds


def record(outputs: Path, notebook: str, folder: str, **fields) -> None:
    path = outputs / notebook / folder
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps(fields))


def run_of(outputs: Path, notebook: str, profile: str = "cpu") -> NotebookRun:
    return NotebookRun(Path(f"notebooks/{notebook}.ipynb"), profile, {"x": 1}, outputs)


def test_the_newest_ok_run_of_the_same_profile_sets_the_expected_time(tmp_path):
    record(tmp_path, "05_a", "cpu-1", profile="cpu", status="ok", wall_s=100.0, started="2026-12-01T00:00:00")
    record(tmp_path, "05_a", "cpu-2", profile="cpu", status="ok", wall_s=300.0, started="2026-12-02T00:00:00")
    record(tmp_path, "05_a", "cpu-3", profile="cpu", status="failed", wall_s=5.0, started="2026-12-03T00:00:00")
    record(tmp_path, "05_a", "quick-1", profile="quick", status="ok", wall_s=7.0, started="2026-12-04T00:00:00")
    assert recorded_seconds(run_of(tmp_path, "05_a")) == 300.0
    assert recorded_seconds(run_of(tmp_path, "05_a", "quick")) == 7.0
    assert recorded_seconds(run_of(tmp_path, "05_a", "long")) == 7.0  # never ran as "long": the newest of any
    assert recorded_seconds(run_of(tmp_path, "06_b")) is None


def test_the_plan_says_which_runs_have_no_estimate_and_the_bar_counts_them_at_the_mean(tmp_path, capsys):
    record(tmp_path, "01_a", "cpu-1", profile="cpu", status="ok", wall_s=120.0, started="2026-12-01T00:00:00")
    record(tmp_path, "02_b", "cpu-1", profile="cpu", status="ok", wall_s=240.0, started="2026-12-01T00:00:00")
    runs = [run_of(tmp_path, n) for n in ("01_a", "02_b", "03_c")]
    plan = Plan.of(runs)
    assert plan.summary() == "3 notebook run(s), about 6 min for the 2 with a recorded time; 1 never ran here or " \
                             "in a committed record, so no estimate for them"
    assert plan.seconds("03_c:" + runs[2].run_id) == 180.0
    overall = Overall(runs, show=False)
    for run in runs:
        overall.done(run)
    overall.close()
    assert overall.count == 3
    assert capsys.readouterr().out.startswith("plan: 3 notebook run(s)")


def test_a_fresh_clone_takes_the_profiles_committed_timing_record(tmp_path):
    committed = tmp_path / "results" / "reproduce-{profile}.json"
    committed.parent.mkdir()
    (tmp_path / "results" / "reproduce-cpu.json").write_text(json.dumps({"result": {"rows": [
        {"notebook": "05_a", "status": "ok", "wall_s": 638.0}, {"notebook": "06_b", "status": "failed", "wall_s": 9.0}]}}))
    outputs = tmp_path / "outputs"
    assert recorded_seconds(run_of(outputs, "05_a"), committed) == 638.0
    assert recorded_seconds(run_of(outputs, "06_b"), committed) is None  # a failed run is no estimate
    assert recorded_seconds(run_of(outputs, "05_a", "quick"), committed) is None  # no record for that profile
    record(outputs, "05_a", "cpu-1", profile="cpu", status="ok", wall_s=100.0, started="2026-12-01T00:00:00")
    assert recorded_seconds(run_of(outputs, "05_a"), committed) == 100.0  # a run here beats the record
    (tmp_path / "results" / "reproduce-cpu.json").write_text("[1, 2]")
    assert recorded_seconds(run_of(outputs, "06_b"), committed) is None  # not a timing record
