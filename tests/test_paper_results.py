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


def test_budgetdraft_public_repo_rows_are_present_and_consistent():
    paper = report.paper_results(SHIPPED)
    repo = paper[paper.key.str.startswith("budgetdraft.repo.")]
    assert len(repo) == 179 and set(repo.paper) == {"BudgetDraft"}
    assert repo.source.str.startswith("public repo EXPECTED_RESULTS.md").all()
    assert repo.value.notna().all() and repo.context.isin([4096, 8192, 16384]).all()
    accept = repo[repo.key.str.endswith(".acceptance")]
    assert len(accept) == 72 and set(accept.unit) == {"fraction"} and accept.value.between(0, 1).all()
    assert set(repo[repo.key.str.endswith(".speedup")].unit) == {"x"}
    # 4K acceptance does not move with the budget (per dataset and table); 16K LWM at gamma 5 falls from 256 to 2048
    for prefix in ("budgetdraft.repo.", "budgetdraft.repo.gamma5."):
        for ds in ("gs", "longbench", "lwm"):
            values = {report.paper_row(paper, f"{prefix}{ds}.4k.b{b}.acceptance")["value"] for b in (256, 512, 1024, 2048)}
            assert len(values) == 1, (prefix, ds)
    lwm = [report.paper_row(paper, f"budgetdraft.repo.gamma5.lwm.16k.b{b}.acceptance")["value"] for b in (256, 2048)]
    assert lwm == pytest.approx([0.6648, 0.3392])
    assert report.paper_row(paper, "budgetdraft.repo.compare.lwm.16k.triforce.speedup")["value"] == pytest.approx(
        report.paper_row(paper, "budgetdraft.lwm16k.triforce")["value"])
