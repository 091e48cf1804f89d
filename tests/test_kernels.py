"""The C++ attention kernel against its pure-torch reference, its bitwise row independence, and the
paths where it is off or cannot be built."""

import os
import platform
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from sparsedraft.engine import kernels
from sparsedraft.engine.cpuinfo import cpu_flags
from sparsedraft.engine.cache import causal_mask
from sparsedraft.errors import SparsedraftError


def _inputs(b, kv, g, t, s, d, dtype, seed=0, q_scale=1.0):
    """q [B, KV, g*T, D] (non-contiguous) and k, v [B, KV, S, D] views into bigger buffers: extra slots
    after S and one extra head before, so batch and head strides differ from a packed tensor's."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, kv, d, g * t, generator=gen) * q_scale).to(dtype).transpose(-1, -2)
    k_buf = torch.randn(b, kv + 1, s + 9, d, generator=gen).to(dtype)
    v_buf = torch.randn(b, kv + 1, s + 9, d, generator=gen).to(dtype)
    return q, k_buf[:, 1:, :s], v_buf[:, 1:, :s]


SIZES = [1, 255, 256, 257, 1000, 5000]
CASES = [  # (B, KV, g, T, S, D)
    *[(1 + i % 2, (1, 3)[i % 2], (3, 1, 4)[i % 3], t, s, d)
      for i, (t, s, d) in enumerate((t, s, d) for s in SIZES for t in (1, 3, 8, 16) for d in (64, 128)
                                    if t <= s)],
    *[(1, 2, 2, t, t, 64) for t in (2, 8, 16)],  # S == T: every key is new
    (1, 1, 8, 16, 300, 64),  # 128 rows: several row-vector groups
    (1, 2, 3, 4, 600, 80),   # head_dim not a multiple of 64
    (1, 1, 2, 2, 70, 72),    # nor of 16
]


@pytest.mark.parametrize("b,kv,g,t,s,d", CASES)
def test_fp32_matches_reference(built, b, kv, g, t, s, d):
    q, k, v = _inputs(b, kv, g, t, s, d, torch.float32, q_scale=2.0)
    out = kernels.attend(q, k, v, d ** -0.5, t)
    assert out.shape == q.shape and out.dtype == torch.float32
    # both sit ~1e-6 from an fp64 oracle on outputs of magnitude ~1, in different rounding orders
    torch.testing.assert_close(out, kernels.attend_reference(q, k, v, d ** -0.5, t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,kv,g,t,s,d", CASES[::3])
def test_bf16_matches_reference(built, b, kv, g, t, s, d):
    q, k, v = _inputs(b, kv, g, t, s, d, torch.bfloat16)
    out = kernels.attend(q, k, v, d ** -0.5, t)
    assert out.dtype == torch.bfloat16
    ref = kernels.attend_reference(q, k, v, d ** -0.5, t)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,t,s,d", [(3, 2, 2, 64), (3, 8, 259, 64), (3, 16, 1000, 64), (4, 5, 513, 128),
                                     (8, 16, 270, 64), (2, 3, 40, 80)])
def test_rows_equal_one_token_calls_bitwise(built, dtype, g, t, s, d):
    """Token t's rows of a T-token verification are exactly what a 1-token decode over the first
    S-T+t+1 keys gives (tails crossing a 256-key chunk boundary included)."""
    q, k, v = _inputs(1, 2, g, t, s, d, dtype, seed=1, q_scale=3.0)
    out = kernels.attend(q, k, v, d ** -0.5, t)
    for token in range(t):
        seen = s - t + token + 1
        one = kernels.attend(q[:, :, token::t], k[:, :, :seen], v[:, :, :seen], d ** -0.5, 1)
        assert torch.equal(out[:, :, token::t], one), f"token {token} of {t} differs from its 1-token call"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,kv,g,t,s,d", CASES[::2])
def test_keys_as_lanes_and_rows_as_lanes_give_the_same_bits(built, dtype, b, kv, g, t, s, d):
    """The two ways a chunk is computed (kernels.KEY_ROWS picks one by the rows per KV head) agree
    bitwise, so a decode and a verification may take different ones."""
    q, k, v = _inputs(b, kv, g, t, s, d, dtype, seed=3, q_scale=3.0)
    by_rows = kernels.attend(q, k, v, d ** -0.5, t, key_rows=0)
    by_keys = kernels.attend(q, k, v, d ** -0.5, t, key_rows=g * t)
    assert torch.equal(by_rows, by_keys)


@pytest.fixture
def tiles_off():
    """bf16 attention on the same build's vector code instead of AMX tiles or AVX512-BF16 dot products (skipped
    where it runs on neither: then the other tests already cover that code)."""
    if not (kernels.on_tiles() or kernels.on_dots()):
        pytest.skip("bf16 attention runs on neither AMX tiles nor AVX512-BF16 dot products here")
    kernels.use_tiles(False)
    try:
        yield
    finally:
        kernels.use_tiles(True)


def test_the_path_says_when_bf16_attention_runs_on_tiles(built):
    assert ("AMX tiles" in kernels.path()) == kernels.on_tiles()
    flags = cpu_flags()
    if built == "auto" and {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags and platform.system() == "Linux":
        assert kernels._module.tiles() != 0  # -march=native on an AMX CPU builds them; -1 would say the OS refused
    if built != "auto":
        assert not kernels.on_tiles()  # the forced paths name their instruction sets, AMX not among them


def test_bf16_attention_runs_on_dot_products_exactly_where_the_build_has_them_without_amx(built, native):
    flags = cpu_flags()
    want = ((native or built == "avx512bf16") and {"avx512_bf16", "avx512bw"} <= flags
            and not (native and {"amx_tile", "amx_bf16"} <= flags))
    assert kernels.on_dots() == want
    assert ("AVX512-BF16 dot products" in kernels.path()) == want
    if want:
        kernels.use_tiles(False)
        try:
            assert not kernels.on_dots() and "dot products" not in kernels.path()
        finally:
            kernels.use_tiles(True)


@pytest.mark.parametrize("g,t,s,d", [(3, 8, 259, 64), (4, 5, 513, 128), (8, 16, 270, 64)])
def test_bf16_without_tiles_matches_reference_and_its_rows_stay_exact(built, tiles_off, g, t, s, d):
    q, k, v = _inputs(1, 2, g, t, s, d, torch.bfloat16, seed=1, q_scale=3.0)
    out = kernels.attend(q, k, v, d ** -0.5, t)
    ref = kernels.attend_reference(q, k, v, d ** -0.5, t)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-3)
    one = kernels.attend(q[:, :, t - 1::t], k, v, d ** -0.5, 1)
    assert torch.equal(out[:, :, t - 1::t], one)


@pytest.mark.parametrize("n, k", [(48, 64), (200, 576)])
def test_bf16_linear_without_tiles_matches_torch_and_rows_stay_exact(built, tiles_off, n, k):
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    x = torch.randn(9, k, generator=gen).bfloat16()
    out = kernels.linear(x, w)
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    assert all(torch.equal(kernels.linear(x[m:m + 1], w)[0], out[m]) for m in range(9))


def test_bf16_linear_rows_do_not_depend_on_how_threads_split_the_weight(built):
    """On tiles the weight rows go in blocks of 16 from each thread's first row, the last one padded: a
    row's bits must not depend on where a thread's share begins."""
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(1000, 576, generator=gen) / 24).bfloat16()
    x = torch.randn(3, 576, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, w)
        torch.set_num_threads(max(2, threads))
        many = kernels.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_tiles_and_vector_code_are_two_paths_that_both_hold_the_contract(built):
    """On tiles (and on AVX512-BF16 dot products) the softmax weights are rounded to bf16 before they weigh the
    values: the two paths agree to bf16's precision, not bitwise (a generation keeps one path from start to end)."""
    if not (kernels.on_tiles() or kernels.on_dots()):
        pytest.skip("bf16 attention runs on neither AMX tiles nor AVX512-BF16 dot products here")
    q, k, v = _inputs(1, 3, 3, 8, 3000, 64, torch.bfloat16, seed=4, q_scale=3.0)
    w, x = (torch.randn(300, 576) / 24).bfloat16(), torch.randn(5, 576).bfloat16()
    on = kernels.attend(q, k, v, 0.125, 8), kernels.linear(x, w)
    kernels.use_tiles(False)
    try:
        off = kernels.attend(q, k, v, 0.125, 8), kernels.linear(x, w)
    finally:
        kernels.use_tiles(True)
    for a, b in zip(on, off):
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=2e-2)
    assert not torch.equal(on[0], off[0])  # else the switch did nothing (the linear's sums differ in fp32 only,
    # and its bf16 outputs may round them alike)


def test_result_independent_of_thread_count(built):
    q, k, v = _inputs(2, 3, 3, 8, 3000, 64, torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.attend(q, k, v, 0.125, 8)
        torch.set_num_threads(max(2, threads))
        many = kernels.attend(q, k, v, 0.125, 8)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_supports_the_masks_static_cache_builds(built):
    s, t = 300, 8
    q, k, v = _inputs(1, 3, 3, t, s, 64, torch.float32)
    tail = causal_mask(torch.arange(s - t, s)[None], torch.arange(s)[None], None)  # [1, 1, T, S]
    assert kernels.supports(q, k, v, tail, t)
    assert kernels.supports(q, k, v, tail, t)  # the remembered answer for the same mask
    assert kernels.supports(q[:, :, :3], k, v, None, 1)
    assert not kernels.supports(q, k, v, None, t)  # T > 1 without a mask: not causal
    long = kernels.MAX_TOKENS + 1  # a prefill chunk: SDPA's territory
    q_long = torch.randn(1, 3, 3 * long, 64)
    assert not kernels.supports(q_long, k, v, causal_mask(torch.arange(s - long, s)[None], torch.arange(s)[None], None),
                                long)
    windowed = causal_mask(torch.arange(s - t, s)[None], torch.arange(s)[None], 100)
    assert not kernels.supports(q, k, v, windowed, t)
    assert not kernels.supports(q, k, v, tail[:, :, :, :-1], t)
    assert not kernels.supports(q, k[:, :, 1:], v[:, :, 1:], tail, t)  # a mask for other keys
    assert not kernels.supports(q.half(), k.half(), v.half(), tail, t)
    token_major = torch.randn(1, s, 3, 64).transpose(1, 2)
    assert not kernels.supports(q, token_major, token_major, tail, t)


def test_bad_inputs_are_refused(built):
    q, k, v = _inputs(1, 2, 3, 4, 100, 64, torch.float32)
    with pytest.raises(SparsedraftError, match="divide"):
        kernels.attend(q, k, v, 0.125, 5)
    with pytest.raises(SparsedraftError, match="S must be >= T"):
        kernels.attend(q[:, :, :12], k[:, :, :3], v[:, :, :3], 0.125, 4)
    with pytest.raises(SparsedraftError, match="float32 or bfloat16"):
        kernels.attend(q.half(), k.half(), v.half(), 0.125, 4)
    token_major = torch.randn(1, 100, 2, 64).transpose(1, 2)  # consecutive keys 2*64 apart
    with pytest.raises(SparsedraftError, match="consecutive keys"):
        kernels.attend(q, token_major, token_major, 0.125, 4)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("SPARSEDRAFT_KERNELS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turning it off is not worth a warning
        assert not kernels.available()
    q, k, v = _inputs(1, 1, 1, 1, 10, 64, torch.float32)
    with pytest.raises(RuntimeError, match="SPARSEDRAFT_KERNELS=0"):
        kernels.attend(q, k, v, 0.125, 1)


def test_build_failure_warns_once_and_reports_unavailable(monkeypatch):
    def fail(flags):
        raise RuntimeError(f"Ninja is required to load C++ extensions\nmore detail ({flags[0]})")

    monkeypatch.setattr(kernels, "_build", fail)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.delenv("SPARSEDRAFT_KERNELS", raising=False)
    with pytest.warns(RuntimeWarning) as record:
        assert not kernels.available()
        assert not kernels.available()
    assert len(record) == 1
    message = str(record[0].message)
    assert "Ninja is required" in message and "SDPA" in message and "\n" not in message
    q, k, v = _inputs(1, 1, 1, 1, 10, 64, torch.float32)
    with pytest.raises(RuntimeError, match="Ninja is required"):
        kernels.attend(q, k, v, 0.125, 1)


def test_a_native_build_that_fails_is_one_warning_naming_why_and_the_portable_build_runs(monkeypatch):
    """A -march=native build can fail where the portable one builds (a source the assembler refuses for this
    CPU's extensions): that is a slower path, so it is said once, with the reason."""
    def build(flags):
        if "-march=native" in flags:
            raise RuntimeError("Error building extension\n/tmp/x.s:12: Error: bad register name `%tmmK0'")
        return types.SimpleNamespace(allow_tiles=lambda on: None, allow_pairs=lambda on: None, vector_path="portable")

    monkeypatch.setattr(kernels, "_build", build)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_pairs", None)
    monkeypatch.setattr(kernels, "_pairs_chosen", None)
    monkeypatch.setattr(kernels, "_flags", kernels._flags)
    monkeypatch.setattr(kernels, "_isa", None)  # auto: the flag sets in turn, whatever path the file has forced
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.delenv("SPARSEDRAFT_KERNELS", raising=False)
    monkeypatch.delenv("SPARSEDRAFT_KERNEL_ISA", raising=False)
    with pytest.warns(RuntimeWarning) as record:
        assert kernels.available()
        assert kernels.available()
    assert len(record) == 1
    message = str(record[0].message)
    assert "-march=native build failed" in message and "bad register name" in message and "portable" in message
    assert "-march=native" not in kernels._flags


def test_no_compiler_in_a_fresh_process(tmp_path):
    """The real failure path: a compiler that does not exist, an empty build cache."""
    code = ("import warnings\nfrom sparsedraft.engine import kernels\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    print(kernels.available(), kernels.available(), len(seen))\n"
            "    print(seen[0].message if seen else '')\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": str(Path(kernels.__file__).parents[3])}
    env.pop("SPARSEDRAFT_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    first, message = run.stdout.splitlines()[:2]
    assert first == "False False 1"
    assert "unavailable" in message and "not found" in message and "SDPA" in message
    assert "WARNING" not in run.stderr  # torch's own compiler notices are held back


def test_build_failure_reason_is_the_telling_line():
    gcc = RuntimeError("Error building extension 'x': [1/2] c++ -O3 -c /a/decode_attention.cpp -o decode_attention.o\n"
                       "FAILED: decode_attention.o\n/a/decode_attention.cpp:9:1: error: expected ';' before '}'\n"
                       "ninja: build stopped: subcommand failed.")
    assert kernels._reason(gcc) == "RuntimeError: /a/decode_attention.cpp:9:1: error: expected ';' before '}'"
    assert kernels._reason(OSError("")) == "OSError: no message"


def other_layout(run):
    """run() with the few-row linear's AVX2 steps past pair_from() rows in the layout this process did not choose."""
    before = kernels.use_pairs(not kernels.use_pairs(True))
    try:
        return run()
    finally:
        kernels.use_pairs(before)


def test_linear_layout_past_8_rows_is_chosen_once_forced_by_the_environment_and_said_by_path(built, monkeypatch):
    module, kept = kernels._module, kernels._pairs
    avx2 = module.vector_path.startswith("AVX2")
    monkeypatch.setattr(kernels, "_pairs", None)
    monkeypatch.setattr(kernels, "_pairs_chosen", None)
    monkeypatch.setattr(kernels, "_time_pairs", lambda: pytest.fail("a forced layout is not timed"))
    monkeypatch.setenv(kernels.PAIRS_ENV, "0")
    try:
        assert kernels._choose_pairs() is (not avx2)  # other builds ignore the layout: "unused"
        past = f"linear steps past {kernels.pair_from()} rows"
        assert 1 <= kernels.pair_from() < kernels.MAX_LINEAR_ROWS == kernels._module.linear_rows  # kernels.h's
        assert (f"{past} unpaired (SPARSEDRAFT_PAIR_ROWS=0)" in kernels.path()) == avx2
        assert kernels.use_pairs(True) is (not avx2)
        assert (f"{past} paired (use_pairs)" in kernels.path()) == avx2
        monkeypatch.setattr(kernels, "_pairs", None)
        monkeypatch.setenv(kernels.PAIRS_ENV, "yes")
        with pytest.raises(SparsedraftError, match="SPARSEDRAFT_PAIR_ROWS='yes' is not allowed"):
            kernels._choose_pairs()
        monkeypatch.setattr(kernels, "_module", None)
        monkeypatch.setattr(kernels, "_build", lambda flags: pytest.fail("built with a bad layout setting"))
        with pytest.raises(SparsedraftError, match="SPARSEDRAFT_PAIR_ROWS='yes' is not allowed"):
            kernels.available()
        monkeypatch.setattr(kernels, "_module", module)
        monkeypatch.delenv(kernels.PAIRS_ENV)
        monkeypatch.setattr(kernels, "_time_pairs", lambda: False)
        assert kernels._choose_pairs() is (not avx2)
        assert kernels._pairs_chosen[1] == ("measured" if avx2 else "unused")
    finally:
        module.allow_pairs(kept)  # the module as the rest of this process chose it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 64), (37, 70), (200, 576)])
def test_few_rows_linear_matches_torch_and_each_row_is_independent_of_the_others(built, dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(16, k, generator=gen).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    alone = [kernels.linear(x[m:m + 1], w, b) for m in range(16)]
    for rows in range(1, 17):
        out = kernels.linear(x[:rows], w, b)
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(x[:rows], w, b).float(), **tol)
        for m in range(rows):
            assert torch.equal(out[m], alone[m][0])
        assert torch.equal(other_layout(lambda: kernels.linear(x[:rows], w, b)), out)  # AVX2's row layouts agree
    torch.testing.assert_close(kernels.linear(x[None, :3], w).float()[0],
                               torch.nn.functional.linear(x[:3], w).float(), **tol)  # leading dims, no bias


def test_few_rows_linear_refuses_many_rows(built):
    with pytest.raises(SparsedraftError, match="1..16 rows"):
        kernels.linear(torch.randn(17, 8), torch.randn(4, 8))


def test_a_forced_path_this_cpu_lacks_is_one_error_before_any_build(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2"})
    with pytest.raises(SparsedraftError, match="cannot run the avx2 kernel path .*lacks avx2, fma"):
        kernels.use_isa("avx2")
    monkeypatch.setattr(kernels, "_isa", None)  # the environment speaks where use_isa has not
    monkeypatch.setenv("SPARSEDRAFT_KERNEL_ISA", "avx9")
    with pytest.raises(SparsedraftError, match="SPARSEDRAFT_KERNEL_ISA='avx9' is not one of"):
        kernels.requested_isa()


def test_the_cli_refuses_a_forced_path_this_cpu_lacks_before_any_work(monkeypatch, capsys):
    import sparsedraft.__main__ as cli
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2"})
    monkeypatch.setattr(kernels, "_isa", None)
    monkeypatch.setenv("SPARSEDRAFT_KERNEL_ISA", "avx2")
    monkeypatch.setitem(cli.COMMANDS, "results", ("", lambda parser: None, lambda args: pytest.fail("it ran")))
    assert cli.main(["results"]) == 2
    assert "cannot run the avx2 kernel path" in capsys.readouterr().err


def test_the_portable_path_reports_itself(built):
    if built == "portable" and platform.machine() in ("x86_64", "AMD64"):
        assert kernels._module.vector_path == "portable"  # no AVX in the build: the baseline's code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 64), (37, 70), (200, 576)])
def test_int8_linear_matches_its_dequantised_product_and_rows_are_independent(built, dtype, n, k):
    gen = torch.Generator().manual_seed(n * k)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100 + 1e-3
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(16, k, generator=gen).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    alone = [kernels.linear(x[m:m + 1], codes, bias, scale) for m in range(16)]
    for rows in (1, 3, 9, 16):
        out = kernels.linear(x[:rows], codes, bias, scale)
        want = (x[:rows].float() @ codes.float().T) * scale + bias.float()
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want, **tol)
        for m in range(rows):
            assert torch.equal(out[m], alone[m][0])
        assert torch.equal(other_layout(lambda: kernels.linear(x[:rows], codes, bias, scale)), out)


def test_int8_linear_module_uses_the_kernel_and_agrees_with_torchs_packed_op(built, monkeypatch):
    from sparsedraft.engine.model import project
    from sparsedraft.engine.quant import Int8Linear
    layer = Int8Linear(torch.nn.Linear(96, 40, bias=True).eval())
    kernel_linear = kernels.linear
    x = torch.randn(5, 96)
    calls = []
    monkeypatch.setattr(kernels, "linear", lambda *a, **k: calls.append(a) or kernel_linear(*a, **k))
    with torch.no_grad():
        ours = project(layer, x)  # the model's one dispatch: an Int8Linear step goes to the kernel
        torchs = torch.ops.aten._weight_int8pack_mm(x, layer.weight_int8, layer.scale) + layer.bias
    assert len(calls) == 1 and calls[0][1] is layer.weight_int8
    with pytest.raises(SparsedraftError, match="a scale with int8 weights"):
        kernels.linear(x, layer.weight_int8)
    torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-5)
