"""The speculative benchmark on tiny models: every draft kind it accepts stays lossless against its baseline."""

import json

import pytest

from sparsedraft.bench_spec import SpecBenchConfig, run_spec_bench
from sparsedraft.budgetdraft.config import TrainConfig
from sparsedraft.budgetdraft.train import train_drafter
from sparsedraft.errors import SparsedraftError
from sparsedraft.quant import Int8Linear

TINY = dict(model="tiny-llama", device="cpu", context=200, new_tokens=12, warmup=0, repeats=1, budget=64,
            chunk_size=8, gamma=3, window=48)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A BudgetDraft run folder: a 1-layer drafter trained a few steps against tiny-llama."""
    tmp = tmp_path_factory.mktemp("bench_spec")
    cfg = TrainConfig(verifier="tiny-llama", layers=1, seq_len=128, sequences=2, eval_sequences=0, budgets=(32,),
                      steps=2, warmup=1, eval_every=0, final_context=0, teacher_dir=str(tmp / "teacher"),
                      out_dir=str(tmp / "run"))
    train_drafter(cfg, progress=False)
    return cfg.run_dir


def check(result, decoder):
    assert [r.decoder for r in result.rows] == ["ar", decoder]
    assert result.tokens_match is True
    method = result.rows[1]
    assert method.decode_ms > 0 and method.speedup == pytest.approx(result.rows[0].decode_ms / method.decode_ms)
    json.dumps(result.to_dict())


def test_int8_quantises_baseline_and_truncated_draft_alike(one_thread, monkeypatch):
    seen = []
    original = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: seen.append(1) or original(self, x))
    result = run_spec_bench(SpecBenchConfig(**TINY, decoder="spec", draft="truncated:1", quant="int8"))
    check(result, "spec")
    assert seen and " int8 on cpu" in result.table()


@pytest.mark.parametrize("decoder,draft_cache", [("spec", "budget"), ("spec", "full"), ("triforce", "full")])
def test_budgetdraft_run_folder_plugs_in_as_a_draft(one_thread, run_dir, decoder, draft_cache):
    result = run_spec_bench(SpecBenchConfig(**TINY, decoder=decoder, draft=str(run_dir), draft_cache=draft_cache))
    check(result, decoder)


@pytest.mark.parametrize("bad, match", [
    (dict(quant="int4"), "quant must be one of"),
    (dict(decoder="spec", draft="ngram", draft_cache="budget"), "draft-cache budget"),
    (dict(decoder="triforce", draft_cache="budget"), "draft-cache budget"),
    (dict(decoder="spec", draft="truncated:1", draft_cache="budget", budget=400), "budget"),
])
def test_bad_options_fail_before_loading(bad, match):
    with pytest.raises(SparsedraftError, match=match):
        SpecBenchConfig(**{**TINY, **bad})
