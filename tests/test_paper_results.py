"""The papers' numbers table: every context and budget names where it is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsedraft import report
from sparsedraft.errors import SparsedraftError

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "paper_results.csv"


def test_shipped_rows_name_the_source_of_each_context_and_budget():
    paper = report.paper_results(SHIPPED)
    for column in ("context", "budget"):
        given = paper[paper[column].notna()]
        assert set(given[f"{column}_source"]) <= set(report.VALUE_SOURCES), column
    assert report.paper_row(paper, "triforce.fig1.draft_ms")["budget_source"] == "triforce-code"


@pytest.mark.parametrize("edit, words", [
    (lambda line: line.replace(",paper,paper,", ",,paper,", 1), "without context_source"),
    (lambda line: line.replace(",4096,paper,paper,", ",,paper,paper,", 1), "empty budget"),
])
def test_a_number_without_its_source_is_refused(tmp_path, edit, words):
    lines = SHIPPED.read_text().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("triforce.table2.speedup,"))
    lines[row] = edit(lines[row])
    broken = tmp_path / "paper_results.csv"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(SparsedraftError, match=words):
        report.paper_results(broken)
