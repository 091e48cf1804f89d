"""Benchmark plumbing on tiny models: rows and the CLI's last-line JSON contract."""

import json
import subprocess
import sys

import pytest
import torch

from sparsedraft.__main__ import main
from sparsedraft.bench import (BENCHES, ArBenchConfig, format_table, matching_prefix, resolve_device,
                               run_ar_bench)
from sparsedraft.errors import SparsedraftError

TINY = dict(model="tiny-llama", device="cpu", context=48, new_tokens=4, warmup=0, repeats=1, read_mib=1)


@pytest.mark.parametrize("bad, match", [(dict(new_tokens=1), "new_tokens"), (dict(dtype="int8"), "dtype"),
                                        (dict(context=0), "context"), (dict(repeats=0), "repeats"),
                                        (dict(split="dev"), "split")])
def test_config_validation(bad, match):
    with pytest.raises(SparsedraftError, match=match):
        ArBenchConfig(**{**TINY, **bad})


def test_context_beyond_the_model_fails_before_timing():
    with pytest.raises(SparsedraftError, match="maximum context"):
        run_ar_bench(ArBenchConfig(**{**TINY, "context": 2046}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_request_without_cuda():
    with pytest.raises(SparsedraftError, match="CUDA is not available"):
        resolve_device("cuda")


def test_ar_bench_without_transformers():
    result = run_ar_bench(ArBenchConfig(**TINY, hf=False))
    assert [r.engine for r in result.engines] == ["sparsedraft"]
    assert result.hf_ms_over_ours is None and result.tokens_match is None
    assert result.prompt_len == 48 and result.verify.tokens == 7 and result.verify.context == 48
    row = result.engines[0]
    assert row.decode_ms > 0 and row.tokens_per_s == pytest.approx(1000 / row.decode_ms)
    assert row.bandwidth_gbps * 1e9 == pytest.approx(result.bytes_per_token / (row.decode_ms / 1000))
    json.dumps(result.to_dict())
    assert "sparsedraft" in result.table()


def test_ar_bench_against_transformers_agrees_token_for_token():
    result = run_ar_bench(ArBenchConfig(**TINY, hf=True))
    assert [r.engine for r in result.engines] == ["sparsedraft", "transformers"]
    assert result.tokens_match and result.matching_prefix == 4
    assert result.hf_ms_over_ours == pytest.approx(result.engines[1].decode_ms / result.engines[0].decode_ms)
    assert "transformers" in result.to_dict()["versions"]


def test_matching_prefix_and_table():
    assert matching_prefix(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 9, 4]])) == 2
    assert matching_prefix(torch.tensor([[5, 6]]), torch.tensor([[5, 6]])) == 2
    assert format_table(["a", "bb"], [["1", "2"]]).splitlines() == ["a  bb", "1   2"]


def test_cli_prints_json_as_last_line():
    args = ["bench", "ar", "--model", "tiny-llama", "--device", "cpu", "--context", "32", "--new-tokens", "3",
            "--warmup", "0", "--repeats", "1", "--no-hf", "--read-mib", "1"]
    proc = subprocess.run([sys.executable, "-m", "sparsedraft", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    record = json.loads(lines[-1])
    assert record["bench"] == "ar" and record["config"]["context"] == 32 and record["config"]["hf"] is False
    assert {"engines", "verify", "read_bandwidth_gbps", "bytes_per_token"} <= record.keys()
    assert len(lines) > 1  # the human table comes first


def test_cli_reports_user_errors_in_one_line(capsys):
    assert main(["bench", "ar", "--model", "tiny-llama", "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: new_tokens must be >= 2")


def test_every_bench_config_has_cli_defaults():
    for bench in BENCHES.values():
        bench.config()  # defaults alone must validate, so the CLI works without options
