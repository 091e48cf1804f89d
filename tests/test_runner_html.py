"""Each executed notebook gets an HTML page, and outputs/index.html links them beside the markdown index."""

from __future__ import annotations

import importlib
import importlib.util
import re

import nbformat
import pytest

from sparsedraft.__main__ import main
from sparsedraft.runner import execute, plan, write_index
from sparsedraft.runner import cli
from sparsedraft.runner.html import render_html
from test_runner import by_name, config, fake_papermill, lab, one_ok_one_failed  # noqa: F401 (fixtures)


def test_render_html_keeps_sources_outputs_and_inline_figures(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(6 * 7)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n"),
                    nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "fig"})]
    nb.cells = [nbformat.v4.new_markdown_cell("# A question"), cell]
    path = tmp_path / "01_x.ipynb"
    nbformat.write(nb, path)
    page = render_html(path)
    assert page == tmp_path / "01_x.html"
    text = page.read_text()
    assert "A question" in text and "42" in text and "data:image/png;base64,iVBORw0KGgo=" in text
    assert "<title>01_x</title>" in text


def test_the_html_index_carries_the_markdown_index_links(lab, monkeypatch):
    ok, failed = one_ok_one_failed(lab, monkeypatch)
    markdown = write_index(lab / "outputs").read_text()
    page = (lab / "outputs" / "index.html").read_text()
    for run in (ok, failed):  # papermill saved both notebooks (the failed one up to its error): both rendered
        html_link = f"{run.name}/{run.run_id}/{run.name}.html"
        assert (lab / "outputs" / html_link).is_file()
        assert f"[HTML]({html_link})" in markdown and f'href="{html_link}"' in page
    assert f'href="01_trivial/{ok.run_id}/run.log"' in page
    assert re.search(r"<td>double</td>\s*<td>2</td>", page)
    assert "RuntimeError: cell failed" in page and page.startswith("<!DOCTYPE html>")


def test_a_page_that_cannot_be_rendered_fails_the_run_with_the_reason(lab, monkeypatch):
    fake_papermill(monkeypatch)
    execute_module = importlib.import_module("sparsedraft.runner.execute")  # the package exports its function

    def broken(path):
        raise ValueError("bad notebook json")
    monkeypatch.setattr(execute_module, "render_html", broken)
    outcome = execute(by_name(plan(config(lab)))["01_trivial"])
    assert outcome.status == "failed" and outcome.error == "HTML rendering failed: ValueError: bad notebook json"


def test_missing_nbconvert_is_one_clear_error_before_any_run(lab, monkeypatch, capsys):
    calls = fake_papermill(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "nbconvert" else real(name, *a))
    assert main(["run", "--profile", "test", "--notebooks", str(lab / "notebooks"),
                 "--outputs", str(lab / "outputs")]) == 2
    err = capsys.readouterr().err
    assert "nbconvert" in err and "pip install" in err and calls == []
    assert not (lab / "outputs").exists()


@pytest.mark.parametrize("name", ["README.md", "index.html"])
def test_an_empty_outputs_folder_gets_both_pages(tmp_path, name):
    write_index(tmp_path / "outputs")
    assert "No runs yet" in (tmp_path / "outputs" / name).read_text()
