"""Every notebook runs end to end with the ``quick`` profile through the runner (what CI does).

The quick profile uses tiny random models and short contexts, so the suite
checks that each notebook executes, saves its artifacts and writes its answer
-- not the papers' claims. The outputs go to a temporary folder; the shipped
``outputs/`` is left alone.
"""

import ast
import json
import re
import string
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from sparsedraft.__main__ import main
from sparsedraft.runner.config import discover

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
# Numbers that state results (a percentage, a speedup, milliseconds, a decimal) must come from computed
# values, never from a markdown cell or a report.show_text/answer template's literal text; names such as
# "Fig. 3a", "Table 2" or "γ1" are fine.
RESULT_NUMBER = re.compile(r"\d+(\.\d+)?\s*(%|×|ms\b|GB\b|s/token)|\b\d+\.\d+\b")
REPORT_TEXT_CALLS = {"show_text", "answer"}  # report.<call>(template, **values) renders computed values


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    # One thread per kernel: test machines are shared, and two OpenMP threads per process then thrash.
    status = main(["run", "--profile", "quick", "--notebooks", str(NOTEBOOKS), "--outputs", str(outputs),
                   "--threads", "1"])
    return status, outputs


def template_texts(node: ast.AST):
    """The string literals of an expression as the template they make: an f-string's values (computed) become
    "_", so placeholders split across its pieces stay whole; other expressions are searched for literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        yield "".join(part.value if isinstance(part, ast.Constant) else "_" for part in node.values)
    else:
        for child in ast.iter_child_nodes(node):
            yield from template_texts(child)


def report_templates(source: str):
    """Literal text (``{...}`` placeholders dropped) of the templates passed to report.show_text/answer."""
    for call in ast.walk(ast.parse(TransformerManager().transform_cell(source))):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in REPORT_TEXT_CALLS
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "report"):
            template = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "template"), None)
            for text in template_texts(template) if template is not None else ():
                yield "".join(literal for literal, *_ in string.Formatter().parse(text))


def hand_typed_results(nb) -> list[tuple[str, str]]:
    """(number, the text stating it) for each result number typed into a markdown cell or a report template."""
    texts = [text for cell in nb.cells for text in (
        [cell.source] if cell.cell_type == "markdown" else report_templates(cell.source) if cell.cell_type == "code"
        else [])]
    return [(m.group(0), text) for text in texts for m in RESULT_NUMBER.finditer(text)]


def test_notebooks_state_no_hand_typed_results():
    found = {path.name: hand_typed_results(nbformat.read(path, as_version=4)) for path in discover(NOTEBOOKS)}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"compute these and pass them as template values, (number, text) per notebook: {found}"


@pytest.mark.parametrize("template,hits", [
    ('"Speedup **2.31×** at {context:,} tokens"', ["2.31×"]),
    ('"at {ctx:,} tokens " "it takes 14 ms"', ["14 ms"]),
    ('f"At {c:,} tokens {{share_{c}:.1%}} of 96.8% recovered"', ["96.8%"]),
    ('"**{speedup:.2f}×**, {share:.1%} of {n} tokens, Fig. 3a, γ1 = {g}"', []),
    ('" ".join(f"{{acc_{c}:.1%}} at {c} tokens" for c in cs)', []),
])
def test_hand_typed_result_guard_reads_report_templates(template, hits):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("Measured **4.4×** here."),
                                         nbformat.v4.new_code_cell(f"m = 1\nreport.show_text({template}, **m)"),
                                         nbformat.v4.new_code_cell(f"report.answer(template={template})")])
    found = hand_typed_results(nb)
    assert [number for number, _ in found] == ["4.4×"] + hits * 2, found


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
    html_index = (outputs / "index.html").read_text()
    for path in discover(NOTEBOOKS):
        folders = list((outputs / path.stem).iterdir())
        assert len(folders) == 1, path.stem
        folder = folders[0]
        record = json.loads((folder / "run.json").read_text())
        assert record["status"] == "ok", record
        names = {p.name for p in folder.iterdir()}
        page = path.with_suffix(".html").name
        assert {path.name, page, "run.log", "parameters.json", "metrics.json", "answer.md"} <= names, (path.stem, names)
        assert any(n.endswith(".csv") for n in names) and any(n.endswith(".png") for n in names), path.stem
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["headline"], path.stem
        executed = nbformat.read(folder / path.name, as_version=4)
        errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, path.stem
        assert f"## {path.stem}" in index and f"`{folder.name}` (ok," in index
        assert f'href="{path.stem}/{folder.name}/{page}"' in html_index


RAY_NOTEBOOKS = ("03", "04")  # two quick notebooks whose metrics hold no timing, so they must repeat exactly


@pytest.mark.slow
def test_the_ray_backend_reproduces_the_serial_run(quick_run, tmp_path):
    """Two quick notebooks as Ray tasks on an embedded 2-CPU local Ray: the same folders and the same metrics."""
    status, serial = quick_run
    assert status == 0
    outputs = tmp_path / "ray"
    assert main(["run", "--profile", "quick", "--notebooks", str(NOTEBOOKS), "--outputs", str(outputs),
                 "--only", ",".join(RAY_NOTEBOOKS), "--backend", "ray", "--ray-cpus", "2"]) == 0
    for key in RAY_NOTEBOOKS:
        name = next(p.name for p in discover(NOTEBOOKS) if p.name.startswith(key))[:-len(".ipynb")]
        [ray_run] = list((outputs / name).iterdir())
        [serial_run] = list((serial / name).iterdir())
        assert ray_run.name == serial_run.name  # same parameters, same folder
        assert {p.name for p in ray_run.iterdir()} == {p.name for p in serial_run.iterdir()}
        record = json.loads((ray_run / "run.json").read_text())
        assert record["status"] == "ok", record
        assert json.loads((ray_run / "metrics.json").read_text()) == json.loads((serial_run / "metrics.json").read_text())
