"""The prefill profile bench: each engine's operators by self time, largest first, in a record the docs can cite."""

import json

import pytest
import torch

from sparsedraft.bench import prefill_profile
from sparsedraft.bench.record import check_record
from sparsedraft.errors import SparsedraftError


def test_prefill_profile_ranks_each_engines_operators_and_writes_a_record(tmp_path, capsys):
    record = tmp_path / "profile.json"
    prefill_profile.main(["--model", "tiny-llama", "--context", "200", "--top", "3", "--record", str(record)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["isa"] and result["read_gb_s"] > 0 and result["dtype"] == "bf16"
    for engine in ("sparsedraft", "transformers"):
        rows = [r for r in result["rows"] if r["engine"] == engine]
        assert len(rows) == 3 and all(0 < r["share"] <= 1 and r["calls"] >= 1 for r in rows)
        assert [r["self_s"] for r in rows] == sorted((r["self_s"] for r in rows), reverse=True)
        assert sum(r["share"] for r in rows) <= 1 + 1e-9 and sum(r["self_s"] for r in rows) <= rows[0]["profiled_s"] + 1e-9
    assert any("mm" in r["op"] for r in result["rows"])  # a prefill is matmuls first
    written = json.loads(record.read_text())
    check_record(written, str(record))
    assert written["command"].startswith("python -m sparsedraft.bench.prefill_profile --model tiny-llama")


def test_prefill_profile_refuses_a_bad_context_before_loading_anything(monkeypatch):
    monkeypatch.setattr(prefill_profile, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SparsedraftError, match="--context >= 2"):
        prefill_profile.main(["--context", "1"])


def test_a_sliced_bf16_prefill_is_profiled_beside_torch_flash(monkeypatch, capsys):
    """Where ours would slice, it is profiled a second time with torch's flash kernel, in the same process."""
    from sparsedraft.engine import model as engine_model
    sliced = []
    monkeypatch.setattr(prefill_profile, "sliced_prefill", lambda *a: True)
    def prefill_prompt(*args, **kwargs):  # notes the switch each prefill ran under, and runs an op to profile
        sliced.append(engine_model._SLICES)
        return torch.ones(4).add(1)

    monkeypatch.setattr(prefill_profile, "prefill_prompt", prefill_prompt)
    prefill_profile.main(["--model", "tiny-llama", "--context", "200", "--top", "2", "--no-hf"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(dict.fromkeys(r["engine"] for r in result["rows"])) == ["sparsedraft", "sparsedraft, torch flash"]
    assert sliced == [True, True, True, False, False] and engine_model._SLICES  # warm-up, ours x2, flash x2
