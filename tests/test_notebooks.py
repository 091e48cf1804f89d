"""Every notebook runs end to end with the ``quick`` profile through the runner (what CI does).

The quick profile uses tiny random models and short contexts, so the suite
checks that each notebook executes, saves its artifacts and writes its answer
-- not the papers' claims. The outputs go to a temporary folder; the shipped
``outputs/`` is left alone.
"""

import json
import re
from pathlib import Path

import nbformat
import pytest

from sparsedraft.__main__ import main
from sparsedraft.runner.config import discover

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
# Numbers that state results (a percentage, a speedup, milliseconds, a decimal) must come from computed
# values, never from a markdown cell; names such as "Fig. 3a", "Table 2" or "γ1" are fine.
RESULT_NUMBER = re.compile(r"\d+(\.\d+)?\s*(%|×|ms\b|GB\b|s/token)|\b\d+\.\d+\b")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    # One thread per kernel: test machines are shared, and two OpenMP threads per process then thrash.
    status = main(["run", "--profile", "quick", "--notebooks", str(NOTEBOOKS), "--outputs", str(outputs),
                   "--threads", "1"])
    return status, outputs


def test_markdown_cells_state_no_hand_typed_results():
    for path in discover(NOTEBOOKS):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                found = RESULT_NUMBER.search(cell.source)
                assert found is None, f"{path.name}: markdown states {found.group(0)!r}; compute it and use report.show_text"


def test_every_notebook_opens_with_a_question_and_has_one_parameters_cell():
    for path in discover(NOTEBOOKS):
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].cell_type == "markdown" and "**Question.**" in nb.cells[0].source, path.name
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and nb.cells[1] is tagged[0], path.name
        assert all(c.cell_type != "code" or not c.get("outputs") for c in nb.cells), f"{path.name} is saved with outputs"


@pytest.mark.slow
def test_quick_profile_runs_every_notebook(quick_run):
    status, outputs = quick_run
    assert status == 0, (outputs / "README.md").read_text()
    index = (outputs / "README.md").read_text()
    for path in discover(NOTEBOOKS):
        folders = list((outputs / path.stem).iterdir())
        assert len(folders) == 1, path.stem
        folder = folders[0]
        record = json.loads((folder / "run.json").read_text())
        assert record["status"] == "ok", record
        names = {p.name for p in folder.iterdir()}
        assert {path.name, "parameters.json", "metrics.json", "answer.md"} <= names, (path.stem, names)
        assert any(n.endswith(".csv") for n in names) and any(n.endswith(".png") for n in names), path.stem
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["headline"], path.stem
        executed = nbformat.read(folder / path.name, as_version=4)
        errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, path.stem
        assert f"## {path.stem}" in index and f"`{folder.name}` (ok," in index
