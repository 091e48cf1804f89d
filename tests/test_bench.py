"""The ``ar`` benchmark and the bench CLI on tiny models: cost formulas, returned values, the last-line
JSON contract, and bad input refused before any model loads."""

import json
import time
from pathlib import Path

import pytest
import torch

import sparsedraft.engine.weights
from sparsedraft import METHODS
from sparsedraft.__main__ import main
from sparsedraft.bench import BENCHES, ArBenchConfig, CompareConfig, compare, run_ar_bench
from sparsedraft.bench.ar import matching_prefix, time_verify_random
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.model import Transformer
from sparsedraft.report import format_table
from sparsedraft.engine.roofline import bytes_per_token, kv_bytes, weight_bytes
from sparsedraft.engine.runtime import resolve_device
from sparsedraft.engine.tiny import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="tiny-llama", device="cpu", context=48, new_tokens=4, warmup=0, repeats=1, read_mib=1, peak_s=0.01)
SHARED = ["--model", "tiny-llama", "--device", "cpu", "--warmup", "0", "--repeats", "1"]


@pytest.mark.parametrize("bad, match", [(dict(new_tokens=1), "new_tokens"), (dict(dtypes=("int8",)), "dtypes"), (dict(dtypes=("fp32", "fp32")), "dtypes"),
                                        (dict(peak_s=0), "peak_s"),
                                        (dict(verify_contexts=(3,)), "verify_contexts"),
                                        (dict(context=0), "context"), (dict(repeats=0), "repeats"),
                                        (dict(split="dev"), "split")])
def test_config_validation(bad, match):
    with pytest.raises(SparsedraftError, match=match):
        ArBenchConfig(**{**TINY, **bad})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_request_without_cuda():
    with pytest.raises(SparsedraftError, match="CUDA is not available"):
        resolve_device("cuda")


def test_ar_bench_returns_consistent_rows():
    result = run_ar_bench(ArBenchConfig(**TINY, hf=True, dtypes=("fp32", "bf16"), verify_contexts=(96,)))
    cfg = sparsedraft.engine.weights.load_config("tiny-llama")
    assert [run.dtype for run in result.runs] == ["fp32", "bf16"] and result.prompt_len == 48
    for run, size in zip(result.runs, (4, 2)):
        assert [r.engine for r in run.engines] == ["sparsedraft", "transformers"]
        assert run.tokens_match and run.matching_prefix == 4
        assert run.bytes_per_token == bytes_per_token(cfg, 48 + 4 // 2, size)
        assert run.weight_bytes == weight_bytes(cfg, size) and run.kv_bytes_at_context == kv_bytes(cfg, 48, size)
        assert run.floor_ms == pytest.approx(1000 * run.bytes_per_token / (result.read_bandwidth_gbps * 1e9))
        for row in run.engines:
            assert row.prefill_s > 0 and row.ms_per_token > 0
            assert row.tokens_per_s == pytest.approx(1000 / row.ms_per_token)
            assert row.bandwidth_gbps * 1e9 == pytest.approx(run.bytes_per_token / (row.ms_per_token / 1000))
            assert row.bandwidth_fraction == pytest.approx(row.bandwidth_gbps / result.read_bandwidth_gbps)
        ours, hf = run.engines
        assert run.ours_over_floor == pytest.approx(ours.ms_per_token / run.floor_ms)
        assert run.hf_ms_over_ours == pytest.approx(hf.ms_per_token / ours.ms_per_token)
        assert run.hf_prefill_over_ours == pytest.approx(hf.prefill_s / ours.prefill_s)
        assert [(v.tokens, v.context, v.filled) for v in run.verify] == [(7, 48, "prefill"), (7, 96, "random")]
        for v in run.verify:
            assert v.decode1_ms > 0 and v.verify_ms > 0 and v.cost_ratio == pytest.approx(v.verify_ms / v.decode1_ms)
    assert "transformers" in result.to_dict()["versions"]
    assert "verify-7 / decode-1 at context 96 (random)" in result.table()


def test_ar_bench_json_leads_with_the_path_bandwidth_and_peaks_and_times_each_step_beside_its_roofline():
    result = run_ar_bench(ArBenchConfig(**TINY, hf=False, dtypes=("fp32",), verify_contexts=(96,)))
    data = json.loads(json.dumps(result.to_dict()))
    assert list(data)[:4] == ["bench", "isa", "read_gb_s", "peak_gflops"]
    assert {"cpu", "kernels", "torch", "bf16_native"} <= set(data["isa"]) and data["peak_gflops"]["fp32"] > 0
    steps = data["runs"][0]["steps"]
    assert [s["step"] for s in steps] == ["prefill", "decode", "decode-1", "verify-7", "decode-1", "verify-7"]
    for s in steps:
        assert s["ms"] > 0 and s["roofline_ms"] > 0 and s["over_roofline"] == pytest.approx(s["ms"] / s["roofline_ms"])
    assert steps[1]["context"] == 48 + 4 // 2 and steps[-1]["context"] == 96 and steps[0]["tokens"] == 48
    assert "roofline ms" in result.table() and "path: CPU" in result.table()


def test_ar_bench_times_fp32_alone_by_default_where_bf16_has_no_hardware_support(monkeypatch):
    monkeypatch.setattr("sparsedraft.engine.machine.cpu_flags", lambda cpuinfo=None: {"avx2", "fma"})
    result = run_ar_bench(ArBenchConfig(**TINY, hf=False))
    assert [run.dtype for run in result.runs] == ["fp32"] and list(result.peak_gflops) == ["fp32"]


def test_verify_over_random_caches_one_row_per_context(monkeypatch):
    model = tiny_model("llama")
    rows = time_verify_random(model, [16, 40], tokens=3, iters=1)
    assert [(r.context, r.tokens, r.filled) for r in rows] == [(16, 3, "random"), (40, 3, "random")]
    assert all(r.decode1_ms > 0 and r.cost_ratio == pytest.approx(r.verify_ms / r.decode1_ms) for r in rows)

    def no_cache(*args):
        raise AssertionError("a cache was filled before the contexts were checked")
    monkeypatch.setattr("sparsedraft.bench.ar.random_cache", no_cache)
    limit = model.cfg.max_position_embeddings
    with pytest.raises(SparsedraftError, match="maximum of"):
        time_verify_random(model, [16, limit - 2], tokens=3, iters=1)


def test_matching_prefix_and_table():
    assert matching_prefix(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 9, 4]])) == 2
    assert matching_prefix(torch.tensor([[5, 6]]), torch.tensor([[5, 6]])) == 2
    assert format_table(["a", "bb"], [["1", "2"]]).splitlines() == ["a  bb", "1   2"]


def test_ar_cli_prints_the_table_then_the_same_numbers_as_json(capsys):
    assert main(["bench", "ar", *SHARED, "--context", "32", "--new-tokens", "3", "--no-hf", "--read-mib", "1",
                 "--dtypes", "fp32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert record["bench"] == "ar" and record["config"]["context"] == 32 and record["config"]["hf"] is False
    [run] = record["runs"]
    [engine] = run["engines"]
    assert engine["engine"] == "sparsedraft" and engine["ms_per_token"] > 0
    assert f"{engine['ms_per_token']:.2f}" in "\n".join(lines[:-1])


def test_method_cli_builds_one_method_with_its_options(capsys):
    assert main(["bench", "retrieval", *SHARED, "--context", "120", "--new-tokens", "6", "--budget", "32",
                 "--gamma", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert record["bench"] == "compare" and record["config"]["methods"][0][0] == "retrieval"
    ar, method = record["rows"]
    assert (ar["method"], method["method"]) == ("ar", "retrieval")
    assert method["options"]["budget"] == 32 and method["options"]["gamma"] == 2
    assert ar["speedup"] == 1.0 and method["tokens_match"] is True
    assert method["speedup"] == pytest.approx(ar["ms_per_token"] / method["ms_per_token"])
    table = "\n".join(lines[:-1])
    assert f"{method['ms_per_token']:.2f}" in table and f"{method['speedup']:.2f}x" in table


def test_every_method_is_a_bench_and_every_bench_runs_on_defaults():
    assert set(BENCHES) == {"ar"} | set(METHODS)
    for bench in BENCHES.values():
        bench.config()  # defaults alone must validate, so the CLI works without options


BAD_INPUT = [  # bench, flags, what the one error line says
    ("ar", ["--context", "2046"], "maximum context"),
    ("ar", ["--new-tokens", "1"], "new_tokens must be >= 2"),
    ("spec", ["--gamma", "0"], "gamma"),
    ("spec", ["--draft", "no-such-model"], "no-such-model"),
    ("spec", ["--draft", "truncated:9"], "1 <= K"),
    ("retrieval", ["--budget", "7"], "multiple of chunk_size"),
    ("retrieval", ["--budget", "256"], "smaller than the cached context"),
    ("triforce", ["--budget", "7", "--context", "2000"], "multiple of chunk_size"),
    ("triforce", ["--context", "2040", "--new-tokens", "16"], "maximum context"),
    ("budgetdraft", ["--draft", "outputs/no/such/run"], "is not ngram, truncated:K"),
    ("budgetdraft", ["--draft", "truncated:1", "--budget", "512"], "smaller than the cached context"),
]


@pytest.fixture
def nothing_heavy(monkeypatch):
    """Loading a model or running a forward fails the test: bad input must be refused before either."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded or a forward ran before the input was checked")
    monkeypatch.setattr(sparsedraft.engine.weights, "load_model", refuse)
    monkeypatch.setattr(Transformer, "forward", refuse)


def _flags(bench: str, flags: list[str]) -> list[str]:
    defaults = ["--context", "200", "--new-tokens", "8"] if "--context" not in flags else ["--new-tokens", "8"]
    return ["bench", bench, "--model", "tiny-llama", "--device", "cpu", *defaults, *flags]


@pytest.mark.parametrize("bench, flags, words", BAD_INPUT)
def test_bad_input_fails_fast_through_the_cli(nothing_heavy, capsys, bench, flags, words):
    start = time.perf_counter()
    assert main(_flags(bench, flags)) == 2
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0]


@pytest.mark.parametrize("bench, flags, words", BAD_INPUT)
def test_bad_input_fails_fast_from_python(nothing_heavy, bench, flags, words):
    values = dict(zip((f.lstrip("-").replace("-", "_") for f in flags[::2]), flags[1::2]))
    values = {k: int(v) if v.isdigit() else v for k, v in values.items()}
    common = dict(model="tiny-llama", device="cpu", context=200, new_tokens=8, warmup=0)
    common.update({k: values.pop(k) for k in ("context", "new_tokens") if k in values})
    start = time.perf_counter()
    with pytest.raises(SparsedraftError, match=words.replace("(", r"\(")):
        if bench == "ar":
            run_ar_bench(ArBenchConfig(**common, **values))
        else:
            compare(CompareConfig(**common, methods=((bench, values),)))
    assert time.perf_counter() - start < 1.0


def test_sampler_bench_times_both_paths_on_the_same_batch_step(monkeypatch):
    """bench.sampler: one row per linear path per batch, the GEMM row carrying the ratio of the two medians;
    the GEMM path really skips the few-row kernel (counted), the exact path does not."""
    from sparsedraft.bench.sampler import time_batch
    from sparsedraft.engine import kernels
    calls = {"n": 0}
    real = kernels.linear

    def counting(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(kernels, "linear", counting)
    model = tiny_model("llama")
    rows = time_batch(model, 20, 24, warmup=1, repeats=3)
    assert [r["path"] for r in rows] == ["row-exact kernel", "torch GEMM"]
    exact, gemm = rows
    assert exact["batch"] == gemm["batch"] == 20 and exact["context"] == 24
    assert gemm["speedup"] == pytest.approx(exact["ms"] / gemm["ms"], rel=0.02)
    assert exact["tokens_per_s"] == pytest.approx(20 / exact["ms"] * 1e3, rel=0.02)
    if kernels.available():
        assert calls["n"] > 0  # only the exact path's steps reach the kernel


def test_sampler_bench_refuses_bad_flags_before_loading_a_model(monkeypatch):
    from sparsedraft.bench import sampler
    monkeypatch.setattr(sampler, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SparsedraftError, match="--batch and --context must be >= 1"):
        sampler.main(["--batch", "0"])
    with pytest.raises(SparsedraftError, match="--record takes a .json path"):
        sampler.main(["--record", "out.txt"])


def test_linear_kernel_timing_refuses_bad_step_sizes_before_building_the_kernel(monkeypatch):
    from sparsedraft.bench import kernel_timing
    monkeypatch.setattr(kernel_timing, "available", lambda: pytest.fail("built the kernel"))
    with pytest.raises(SparsedraftError, match="--linear takes step sizes in 1..16"):
        kernel_timing.main(["--linear", "17"])



def test_step_ops_bench_times_every_form_and_only_the_on_runs_reach_the_kernels(monkeypatch):
    """bench.step_ops: a row per op and form; a row per step length with all four timings, where every 'stack'
    forward (2 warm-up + 2 timed per length) runs its layers in one call, every 'on' forward runs each norm in
    the fused layer calls, every 'layers' forward runs each in the RMSNorm kernel, and no 'off' one reaches
    the kernels."""
    from sparsedraft.bench import step_ops
    from sparsedraft.engine import kernels, stack
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    ops = step_ops.time_ops(repeats=1, calls=3)
    assert {(r["op"], r["form"]) for r in ops} == {(op, form) for op in ("rms_norm", "rope")
                                                   for form in ("torch", "kernel")}
    assert all(r["us"] > 0 for r in ops)
    calls = []
    for name in ("rms_norm", "layer_head", "layer_tail"):
        monkeypatch.setattr(kernels, name, lambda *a, real=getattr(kernels, name), n=name: calls.append(n) or real(*a))
    real_run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: (lambda out: out is not None and calls.append("stack") or out)(
        real_run(*a)))
    steps = step_ops.time_steps("tiny-llama", context=40, tokens=(1, 3), repeats=2)
    assert [(r["tokens"], r["context"]) for r in steps] == [(1, 40), (3, 40)]
    assert all(r["stack_ms"] > 0 and r["kernels_ms"] > 0 and r["python_layers_ms"] > 0 and r["torch_ops_ms"] > 0
               for r in steps)
    layers = sparsedraft.engine.weights.load_model("tiny-llama").cfg.num_layers
    forwards = 2 * (2 + 2)  # per form: 2 lengths, 2 warm-up + 2 timed
    assert calls.count("stack") == forwards  # the 'stack' forwards
    assert calls.count("layer_head") == calls.count("layer_tail") == forwards * layers  # the 'on' forwards
    assert calls.count("rms_norm") == forwards * (2 + 2 * layers + 1)  # 'stack', 'on': the final norm; 'layers': all
    calls.clear()  # over an int8 retrieval view (TriForce's level 2 with --draft-kv int8) the stack runs too
    view = step_ops.time_steps("tiny-llama", context=40, tokens=(2,), repeats=1, draft_weights="int8",
                               draft_kv="int8")
    assert view[0]["draft_kv"] == "int8" and calls.count("stack") == 2 + 1


def test_step_ops_bench_refuses_bad_flags_before_loading_a_model(monkeypatch):
    from sparsedraft.bench import step_ops
    monkeypatch.setattr(step_ops, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SparsedraftError, match="--tokens takes step lengths in 1..16"):
        step_ops.main(["--tokens", "17"])
    with pytest.raises(SparsedraftError, match="--record takes a .json path"):
        step_ops.main(["--record", "out.txt"])
    with pytest.raises(SparsedraftError, match="draft_weights must be one of"):
        step_ops.main(["--draft-weights", "int3"])


def test_kernel_timing_refuses_a_commit_that_is_not_there_before_building_the_kernel(monkeypatch):
    from sparsedraft.bench import kernel_timing
    monkeypatch.setattr(kernel_timing, "available", lambda: pytest.fail("built the kernel"))
    with pytest.raises(SparsedraftError, match="--against 'no-such-commit'"):
        kernel_timing.main(["--against", "no-such-commit"])


def test_kernels_at_refuses_a_commit_from_before_the_kernels_files():
    """The repository's first commit has no kernels: one error naming the missing file, before any build."""
    import subprocess
    from sparsedraft.bench.kernels_at import kernels_at
    from sparsedraft.engine import kernels
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True,
                           cwd=Path(kernels.__file__).parent).stdout.split()[0]
    with pytest.raises(SparsedraftError, match=r"has no lib/sparsedraft/engine/kernels/.*pick a later commit"):
        kernels_at(first)


def test_kernels_at_head_run_beside_the_loaded_ones_with_their_bits():
    """bench.kernel_timing --against: HEAD's kernels, built from git beside the loaded build, take turns with it
    in one process; where the checkout's kernels are HEAD's, every output has the same bits (and the build is
    the cached one: same files, same key)."""
    from sparsedraft.bench import kernel_timing
    from sparsedraft.bench.kernels_at import kernels_at
    from sparsedraft.engine import kernels
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    against = kernels_at("HEAD")
    rows = kernel_timing.time_step(layers=2, context=300, t=1, dtype="fp32", warmup=0, repeats=1, against=against)
    label = kernel_timing.then_label(against[1])
    assert [r["method"] for r in rows] == ["sdpa", "kernel", "kernel, rows as lanes", label]
    assert all(r["same_bits_as_against"] for r in rows)
    linear = kernel_timing.time_linear(2, layers=1, vocab=64, warmup=0, repeats=1, against=against)
    assert linear[-1]["method"] == label and linear[-1]["same_bits_as_against"]


def test_kernels_running_sends_every_kernel_call_to_another_build_and_back():
    """bench.whole_steps times whole steps on another build by pointing the library's kernel calls at it: inside
    ``kernels.running`` a call reaches that build, after it the loaded one again."""
    from sparsedraft.engine import kernels
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")

    class Other:
        def attend(self, *args):
            raise LookupError("the other build ran")

    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 4, 8)
    mine = kernels.attend(q, k, k, 0.3, 1)
    with kernels.running(Other()), pytest.raises(LookupError, match="other build"):
        kernels.attend(q, k, k, 0.3, 1)
    assert torch.equal(kernels.attend(q, k, k, 0.3, 1), mine)


def test_bench_modules_turn_bad_input_into_one_error_line():
    """``python -m sparsedraft.bench.<module>`` answers bad input as ``python -m sparsedraft`` does: one
    ``error:`` line naming the fix and exit status 2, before any model loads, not a traceback."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "sparsedraft.bench.whole_steps", "--against", "HEAD",
                           "--record", "steps.txt"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: --record takes a .json path, got 'steps.txt'"]


def test_whole_steps_time_a_tiny_model_on_both_builds_with_equal_logits():
    """The whole-step A/B against HEAD's kernels (the checkout's own where nothing changed them): a decode and a
    verification row per build, each beside its roofline, and the logits bitwise equal."""
    from sparsedraft.bench import whole_steps
    from sparsedraft.bench.kernels_at import kernels_at
    from sparsedraft.engine import kernels
    if not kernels.available():
        pytest.skip("the C++ kernels do not build here")
    against = kernels_at("HEAD")
    model = tiny_model("llama").eval()
    with torch.inference_mode():
        rows = whole_steps.time_steps(model, 40, [1, 3], against, 10e9, 10.0, warmup=0, repeats=1)
    then = whole_steps.then_label(against[1])
    assert [(r["method"], r["step"]) for r in rows] == [("kernels", "decode"), (then, "decode"),
                                                         ("kernels", "verify-3"), (then, "verify-3")]
    assert all(r["same_logits_as_against"] and r["roofline_ms"] > 0 and r["context"] == 40 for r in rows)
    with torch.inference_mode():  # the int8 draft copy's steps: a quarter of the weight bytes in the roofline
        int8 = whole_steps.time_steps(model, 40, [1], against, 10e9, 10.0, warmup=0, repeats=1, draft_weights="int8")
    assert all(r["same_logits_as_against"] and r["draft_weights"] == "int8" for r in int8)
    assert int8[0]["gb"] < rows[0]["gb"]
    with torch.inference_mode():  # TriForce's level 2: int8 weights over an int8 retrieval view of the context
        level2 = whole_steps.time_steps(model, 41, [1, 3], against, 10e9, 10.0, warmup=0, repeats=1,
                                        draft_weights="int8", draft_kv="int8")  # any context, not only whole chunks
    assert all(r["same_logits_as_against"] and r["draft_kv"] == "int8" and r["context"] == 41 for r in level2)
    assert level2[0]["gb"] < int8[0]["gb"]


def test_interleaved_runs_alternate_their_order_each_round():
    """A B, then B A: no runner always goes first in its round (the first of a round ran slower in A/Bs)."""
    from sparsedraft.bench.timing import interleaved_runs
    order = []
    runs = interleaved_runs({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2}, 1, 3)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert runs == {"a": [1, 1, 1], "b": [2, 2, 2]}
