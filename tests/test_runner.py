"""The notebook runner: parameter layering and validation, skip logic, the results index, report helpers.

Everything here uses tiny notebooks written into a temporary folder; only
``test_end_to_end`` starts a Jupyter kernel (one short notebook, run once and
then skipped).
"""

import json
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from sparsedraft import report
from sparsedraft.errors import SparsedraftError
from sparsedraft.__main__ import main
from sparsedraft.runner import RunConfig, execute, latest_results, plan, run_id, write_index
from sparsedraft.runner.config import notebook_defaults
from sparsedraft.runner.execute import RUN_FILE, notebook_digest

REPO = Path(__file__).resolve().parents[1]

TRIVIAL_BODY = """
from sparsedraft import report
report.init(output_dir)
import pandas as pd
report.save_metrics({"double": 2 * x, "name": name}, headline=True)
report.save_metrics({"detail": scale})
report.save_table(pd.DataFrame({"item": items}), "items")
report.answer("Twice x is {double}.", **report.metrics())
"""


def write_notebook(path: Path, parameters: str, body: str = "x = 1", tag: bool = True) -> Path:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(parameters)
    if tag:
        cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# question"), cell, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def lab(tmp_path):
    """notebooks/ with two numbered notebooks and a profile; outputs/ beside it."""
    books = tmp_path / "notebooks"
    (books / "profiles").mkdir(parents=True)
    write_notebook(books / "01_trivial.ipynb",
                   'output_dir = ""\nx = 1\nscale = 0.5\nname = "a"\nitems = [1, 2]\nanything = None',
                   TRIVIAL_BODY)
    write_notebook(books / "02_other.ipynb", 'output_dir = ""\nx = 10\ny = 2')
    (books / "profiles" / "test.yaml").write_text(
        "description: test profile\ndefaults:\n  x: 3\nnotebooks:\n  '01':\n    scale: 2\n")
    return tmp_path


def config(lab, **kw) -> RunConfig:
    kw.setdefault("profile", "test")
    return RunConfig(notebooks_dir=lab / "notebooks", outputs_dir=lab / "outputs", **kw)


def by_name(runs):
    return {r.name: r for r in runs}


def test_layers_apply_in_order_defaults_profile_cli(lab):
    runs = by_name(plan(config(lab)))
    assert runs["01_trivial"].parameters == {"x": 3, "scale": 2, "name": "a", "items": [1, 2], "anything": None}
    assert runs["02_other"].parameters == {"x": 3, "y": 2}
    runs = by_name(plan(config(lab, overrides=("x=5", "01.x=7", "name=b", "items=[3]", "anything=[1, 2]"))))
    assert runs["01_trivial"].parameters["x"] == 7  # a targeted override beats a global one
    assert runs["02_other"].parameters["x"] == 5
    assert runs["01_trivial"].parameters["name"] == "b"
    assert runs["01_trivial"].parameters["items"] == [3]
    assert runs["01_trivial"].parameters["anything"] == [1, 2]  # a None default takes any value


def test_float_default_accepts_an_int_and_keeps_it(lab):
    params = by_name(plan(config(lab, overrides=("01.scale=4",))))["01_trivial"].parameters
    assert params["scale"] == 4 and isinstance(params["scale"], int)  # budgets: int = tokens, float = share


@pytest.mark.parametrize("override, words", [
    ("x=abc", ["01_trivial", "x", "int"]),
    ("01.x=1.5", ["x", "int", "1.5"]),
    ("x=true", ["x", "int"]),
    ("01.name=3", ["name", "str"]),
    ("nope=1", ["no notebook declares", "nope"]),
    ("02.scale=1", ["02_other", "scale", "'x'", "'y'"]),
    ("09.x=1", ["'09'", "01_trivial"]),
    ("01.output_dir=/tmp", ["output_dir"]),
    ("x", ["key=value"]),
    ("01.x-y=1", ["parameter name"]),
])
def test_bad_overrides_fail_with_a_message_naming_the_problem(lab, override, words):
    with pytest.raises(SparsedraftError) as info:
        plan(config(lab, overrides=(override,)))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("text, words", [
    ("defaults:\n  nope: 1\n", ["nope", "no notebook declares"]),
    ("notebooks:\n  '02':\n    scale: 1\n", ["02_other", "scale"]),
    ("notebooks:\n  '07':\n    x: 1\n", ["'07'"]),
    ("default:\n  x: 1\n", ["unknown top-level keys", "default"]),
    ("- 1\n- 2\n", ["YAML mapping"]),
    ("defaults:\n  x: [1]\n", ["x", "int"]),
])
def test_bad_profiles_fail_before_anything_runs(lab, text, words):
    (lab / "notebooks" / "profiles" / "bad.yaml").write_text(text)
    with pytest.raises(SparsedraftError) as info:
        plan(config(lab, profile="bad"))
    for word in words:
        assert word in str(info.value)


def test_missing_profile_and_notebooks_folder(lab):
    with pytest.raises(SparsedraftError, match="profile .*nope.yaml not found"):
        plan(config(lab, profile="nope"))
    with pytest.raises(SparsedraftError, match="notebooks folder"):
        RunConfig(notebooks_dir=lab / "missing")


def test_profile_may_be_a_path(lab):
    path = lab / "elsewhere.yaml"
    path.write_text("defaults:\n  y: 9\n")
    runs = by_name(plan(config(lab, profile=str(path))))
    assert runs["02_other"].parameters["y"] == 9
    assert runs["02_other"].run_id.startswith("elsewhere-")


def test_only_selects_by_number_or_stem_in_given_order(lab):
    assert [r.name for r in plan(config(lab, only=("02",)))] == ["02_other"]
    assert [r.name for r in plan(config(lab, only=("02_other", "1")))] == ["02_other", "01_trivial"]
    with pytest.raises(SparsedraftError, match="names no notebook"):
        plan(config(lab, only=("03",)))


def test_run_id_is_profile_plus_parameter_hash(lab):
    first = by_name(plan(config(lab)))["01_trivial"]
    again = by_name(plan(config(lab)))["01_trivial"]
    changed = by_name(plan(config(lab, overrides=("01.x=4",))))["01_trivial"]
    assert first.run_id == again.run_id and first.run_id.startswith("test-")
    assert changed.run_id != first.run_id
    assert first.output_dir == lab / "outputs" / "01_trivial" / first.run_id
    assert run_id("p", {"a": 1, "b": 2}) == run_id("p", {"b": 2, "a": 1})


@pytest.mark.parametrize("parameters, tag, words", [
    ('output_dir = ""\nx = len("ab")', True, ["literal"]),
    ('output_dir = ""\nprint(1)', True, ["name = literal"]),
    ("x = 1", True, ["output_dir"]),
    ('output_dir = ""', False, ["exactly one cell"]),
    ('output_dir = "', True, ["not valid Python"]),
    ('output_dir = ""\nsize = 4  # bytes (>= 4)', True, ["papermill cannot parse", "size"]),
])
def test_parameters_cell_rules(tmp_path, parameters, tag, words):
    path = write_notebook(tmp_path / "01_x.ipynb", parameters, tag=tag)
    with pytest.raises(SparsedraftError) as info:
        notebook_defaults(path)
    for word in words:
        assert word in str(info.value)


def fake_papermill(monkeypatch, fail: bool = False):
    """Replace papermill's executor by one that copies the notebook and writes a metric (or fails)."""
    import papermill
    calls = []

    def execute_notebook(input_path, output_path, parameters, **kwargs):
        calls.append(parameters)
        Path(output_path).write_text(Path(input_path).read_text())
        if fail:
            raise RuntimeError("cell failed\nsecond line")
        folder = Path(parameters["output_dir"])
        (folder / "metrics.json").write_text(json.dumps({"double": 2, "detail": 1, "headline": ["double"],
                                                         "headline_figure": "curve"}))
        (folder / "answer.md").write_text("Twice x is 2.\n")
        (folder / "curve.png").write_bytes(b"png")
        (folder / "items.csv").write_text("item\n1\n")

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    return calls


def test_finished_runs_are_skipped_unless_forced(lab, monkeypatch):
    calls = fake_papermill(monkeypatch)
    run = by_name(plan(config(lab)))["01_trivial"]
    assert execute(run).status == "ok"
    assert len(calls) == 1 and calls[0]["output_dir"] == str(run.output_dir.resolve())
    assert json.loads((run.output_dir / "parameters.json").read_text()) == run.parameters
    record = json.loads((run.output_dir / RUN_FILE).read_text())
    assert record["status"] == "ok" and record["notebook_sha256"] == notebook_digest(run.notebook)
    assert len(record["commit"]) == 40 and record["machine"]["isa"]  # what a results record needs of a run
    assert execute(run).status == "skipped" and len(calls) == 1
    assert execute(run, force=True).status == "ok" and len(calls) == 2


def test_failed_stale_or_edited_runs_are_rerun(lab, monkeypatch):
    run = by_name(plan(config(lab)))["01_trivial"]
    fake_papermill(monkeypatch, fail=True)
    outcome = execute(run)
    assert outcome.status == "failed" and outcome.error == "RuntimeError: cell failed"
    calls = fake_papermill(monkeypatch)
    (run.output_dir / "stale.csv").write_text("old")
    assert execute(run).status == "ok" and len(calls) == 1
    assert not (run.output_dir / "stale.csv").exists()  # an earlier attempt's files are cleared
    write_notebook(run.notebook, 'output_dir = ""\nx = 1\nscale = 0.5\nname = "a"\nitems = [1, 2]\nanything = None',
                   TRIVIAL_BODY + "\n# edited")
    assert execute(run).status == "ok" and len(calls) == 2


def one_ok_one_failed(lab, monkeypatch):
    """Run 01 (ok) and 02 (a failing cell) with the fake papermill; their planned runs."""
    fake_papermill(monkeypatch)
    runs = by_name(plan(config(lab)))
    execute(runs["01_trivial"])
    fake_papermill(monkeypatch, fail=True)
    execute(runs["02_other"])
    return runs["01_trivial"], runs["02_other"]


def test_index_links_every_run_with_headline_metrics(lab, monkeypatch):
    ok, failed = one_ok_one_failed(lab, monkeypatch)
    text = write_index(lab / "outputs").read_text()
    assert f"## 01_trivial" in text and f"`{ok.run_id}` (ok," in text
    assert f"(01_trivial/{ok.run_id}/01_trivial.ipynb)" in text
    assert f"(01_trivial/{ok.run_id}/parameters.json)" in text
    assert "| double | 2 |" in text and "detail" not in text  # headline metrics only
    assert "> Twice x is 2." in text
    assert f"[curve](01_trivial/{ok.run_id}/curve.png)" in text
    assert f"![curve](01_trivial/{ok.run_id}/curve.png)" in text  # the headline figure is shown, not only linked
    assert f'<img src="01_trivial/{ok.run_id}/curve.png"' in (lab / "outputs" / "index.html").read_text()
    assert f"[items](01_trivial/{ok.run_id}/items.csv)" in text
    assert f"`{failed.run_id}` (failed," in text and "RuntimeError: cell failed" in text
    latest = latest_results(lab / "outputs", "01")
    assert latest["metrics"]["double"] == 2 and latest["parameters"] == ok.parameters
    assert latest_results(lab / "outputs", "02") is None  # failed runs do not count
    assert latest_results(lab / "outputs", "01", profile="other") is None


def test_a_summary_notebook_reruns_whenever_another_notebook_ran(lab, monkeypatch, capsys):
    books = lab / "notebooks"
    summary = write_notebook(books / "03_summary.ipynb", 'output_dir = ""')
    nb = nbformat.read(summary, as_version=4)
    nb.metadata["sparsedraft"] = {"reads_outputs": True}
    nbformat.write(nb, summary)
    calls = fake_papermill(monkeypatch)
    args = ["run", "--profile", "test", "--notebooks", str(books), "--outputs", str(lab / "outputs"),
            "--only", "01,03"]
    assert main(args) == 0 and len(calls) == 2
    assert main(args) == 0 and len(calls) == 2  # nothing changed: both skipped
    write_notebook(books / "01_trivial.ipynb", 'output_dir = ""\nx = 1\nscale = 0.5\nname = "a"\nitems = [1, 2]\n'
                   'anything = None', TRIVIAL_BODY + "\n# edited")
    assert main(args) == 0 and len(calls) == 4  # 01 changed, so the summary ran again
    assert main(args[:-2] + ["--only", "03"]) == 0 and len(calls) == 4


def test_index_of_an_empty_folder(tmp_path):
    assert "No runs yet" in write_index(tmp_path / "outputs").read_text()


def test_end_to_end_with_a_real_kernel(lab, capsys):
    args = ["run", "--profile", "test", "--notebooks", str(lab / "notebooks"), "--outputs", str(lab / "outputs"),
            "--only", "01", "-p", "01.x=21"]
    assert main(args) == 0
    folder = next((lab / "outputs" / "01_trivial").iterdir())
    names = {p.name for p in folder.iterdir()}
    assert {"01_trivial.ipynb", "01_trivial.html", "parameters.json", "metrics.json", "items.csv", "answer.md",
            "run.log", RUN_FILE} <= names
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["double"] == 42 and metrics["detail"] == 2 and metrics["headline"] == ["double", "name"]
    assert (folder / "answer.md").read_text().strip() == "Twice x is 42."
    assert "| double | 42 |" in (lab / "outputs" / "README.md").read_text()
    assert main(args) == 0
    assert "skipped" in capsys.readouterr().out


def test_threads_reach_the_kernel_environment_only_during_the_run(lab, monkeypatch):
    import os
    import papermill
    seen = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: seen.append(os.environ.get("OMP_NUM_THREADS")))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    execute(by_name(plan(config(lab)))["02_other"], threads=1)
    assert seen == ["1"] and os.environ["OMP_NUM_THREADS"] == "7"


def test_cli_reports_configuration_errors(lab, capsys):
    assert main(["run", "--profile", "test", "--notebooks", str(lab / "notebooks"), "-p", "nope=1"]) == 2
    assert "error:" in capsys.readouterr().err


def test_report_metrics_merge_and_convert(tmp_path):
    report.init(tmp_path / "run")
    report.save_metrics({"a": np.float32(1.5), "b": torch.tensor(3), "c": float("nan")}, headline=True)
    report.save_metrics({"a": 2, "d": [np.int64(1), {"e": True}]})
    data = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert data == {"a": 2, "b": 3, "c": None, "d": [1, {"e": True}], "headline": ["a", "b", "c"]}
    with pytest.raises(SparsedraftError, match="not JSON-ready"):
        report.save_metrics({"x": object()})


def test_the_headline_figure_is_the_marked_one_else_the_first(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    report.init(tmp_path / "run")
    for name, headline in (("first", False), ("second", False)):
        report.save_figure(plt.figure(), name, headline=headline)
    assert report.metrics()["headline_figure"] == "first"
    report.save_figure(plt.figure(), "main", headline=True)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["headline_figure"] == "main"


def test_report_text_and_display_only_mode(tmp_path):
    report.init("")
    assert report.output_dir() is None
    assert report.answer("{n:.1f} tokens", n=2) == "2.0 tokens"
    report.save_metrics({"a": 1})
    assert report.metrics() == {"a": 1}
    with pytest.raises(SparsedraftError, match=r"\['missing'\]"):
        report.render("{missing} and {n}", n=1)
    with pytest.raises(SparsedraftError, match="plain file stem"):
        report.save_table(None, "../escape")
    assert not any(tmp_path.iterdir())


def test_report_writes_tables_and_figures(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import pandas as pd
    report.init(tmp_path)
    frame = pd.DataFrame({"x": [1, 2, 4], "y": [1.0, 0.5, 0.25], "kind": ["a", "a", "a"]})
    report.save_table(frame, "curve", show=False)
    report.save_figure(report.line_figure(frame, "x", "y", hue="kind", logx=True, hline=0.5), "curve")
    report.save_figure(report.bar_figure(frame, "kind", "y"), "bars")
    assert {p.name for p in tmp_path.iterdir()} == {"curve.csv", "curve.png", "bars.png", "metrics.json"}
    assert json.loads((tmp_path / "metrics.json").read_text())["headline_figure"] == "curve"  # the first figure


def test_shipped_paper_results_table():
    paper = report.paper_results(REPO / "data" / "paper_results.csv")
    assert set(report.PAPER_COLUMNS) <= set(paper.columns)
    assert set(paper.paper) == {"TriForce", "BudgetDraft", "MagicDec"}
    assert report.paper_row(paper, "triforce.table2.speedup")["value"] == pytest.approx(2.31)
    with pytest.raises(SparsedraftError, match="no paper result"):
        report.paper_row(paper, "nope")


def test_shipped_profiles_plan_against_the_shipped_notebooks():
    for profile in ("cpu", "quick", "gpu-paper"):
        runs = plan(RunConfig(profile=profile, notebooks_dir=REPO / "notebooks", outputs_dir=REPO / "outputs"))
        assert [r.name[:2] for r in runs] == ["01", "02", "03", "04", "05", "06", "07", "08", "09"]


def test_the_shipped_sweep_profile_expands_its_grid():
    runs = plan(RunConfig(profile="cpu-sweep", notebooks_dir=REPO / "notebooks", outputs_dir=REPO / "outputs"))
    assert {r.name for r in runs} == {"05_triforce_decoding"} and len(runs) == 12
    points = {(r.parameters["context"], r.parameters["budget"], r.parameters["draft"]) for r in runs}
    assert len(points) == 12 and len({r.output_dir for r in runs}) == 12


def test_the_shipped_cost_sweep_is_four_runs_of_notebook_04():
    runs = plan(RunConfig(profile="cost-sweep", notebooks_dir=REPO / "notebooks", outputs_dir=REPO / "outputs"))
    assert {r.name for r in runs} == {"04_cost_walkthrough"}
    assert sorted((r.parameters["gamma1"], r.parameters["gamma2"]) for r in runs) == [(1, 6), (1, 8), (2, 6), (2, 8)]
