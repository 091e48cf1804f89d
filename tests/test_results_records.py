"""Results records: the README's table is rendered from them, and a record without its provenance is refused."""

import json

import pytest

from sparsedraft.bench import CompareConfig
from sparsedraft.bench.record import (BEGIN, END, load_records, refresh_readme, render_table,
                                      resolved_options, write_record)
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


@pytest.mark.parametrize("field", ["commit", "date", "machine", "command"])
def test_a_record_missing_a_field_is_refused(tmp_path, field):
    _record(tmp_path, drop=field)
    with pytest.raises(SparsedraftError, match=field):
        load_records(tmp_path)


def test_refresh_readme_replaces_only_between_the_markers(tmp_path):
    records = tmp_path / "results"
    _record(records)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\nafter\n")
    refresh_readme(readme, records)
    text = readme.read_text()
    assert text.startswith(f"intro\n{BEGIN}\n| method") and text.endswith(f"|\n{END}\nafter\n")
    assert "old table" not in text and "**1.25x**" in text
    readme.write_text("no markers\n")
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
    assert table == render_table(load_records(root / "docs" / "results")), \
        "README's results table differs from docs/results: run python -m sparsedraft results and commit both"
