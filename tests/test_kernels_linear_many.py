"""Several projections of the same rows in one kernel call (q, k and v; gate and up).

``kernels.linear_many`` must give each weight's outputs the bits ``kernels.linear`` gives that weight alone,
for every dtype (fp32, bf16 on tiles and off them, int8 codes under fp32 and bf16 rows), with and without
biases, for every step length, on every vector path this CPU can run (the ``built`` fixture); the model's
``project_many`` must then equal one ``project`` per layer, and keep torch's path where the kernel does not
apply."""

import pytest
import torch

from sparsedraft.engine import kernels
from sparsedraft.engine.model import project, project_many
from sparsedraft.engine.quant import Int4Linear, Int8Linear
from sparsedraft.errors import SparsedraftError

SHAPES = [((48, 16, 16), 64), ((37, 5, 200), 70), ((96, 32), 576)]  # (N of each weight, K)


def _weights(ns, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        weights = [torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8) for n in ns]
        scales = [torch.rand(n, generator=gen) / 100 + 1e-3 for n in ns]
        return weights, scales
    return [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for n in ns], None


def _check(ns, k, wdtype, xdtype, seed=0):
    weights, scales = _weights(ns, k, wdtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    biases = [torch.randn(n, generator=gen).to(xdtype) if i % 2 == 0 else None for i, n in enumerate(ns)]
    x = torch.randn(16, k, generator=gen).to(xdtype)
    for rows in (1, 2, 7, 16):
        out = kernels.linear_many(x[:rows], weights, biases, scales)
        alone = [kernels.linear(x[:rows], w, b, None if scales is None else scales[i])
                 for i, (w, b) in enumerate(zip(weights, biases))]
        assert out.dtype == xdtype and out.shape == (rows, sum(ns))
        assert torch.equal(out, torch.cat(alone, -1)), rows
    lead = kernels.linear_many(x[None, :3], weights, biases, scales)  # leading dims are kept
    assert lead.shape == (1, 3, sum(ns)) and torch.equal(lead[0], kernels.linear_many(x[:3], weights, biases, scales))


@pytest.mark.parametrize("ns, k", SHAPES)
@pytest.mark.parametrize("wdtype, xdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.int8, torch.float32), (torch.int8, torch.bfloat16)])
def test_one_call_gives_each_weight_the_bits_it_gets_alone(built, ns, k, wdtype, xdtype):
    _check(ns, k, wdtype, xdtype)


@pytest.fixture
def tiles_off():
    before = kernels.use_tiles(False)
    yield
    kernels.use_tiles(before)


@pytest.mark.parametrize("ns, k", SHAPES)
def test_bf16_without_tiles_keeps_the_same_contract(built, tiles_off, ns, k):
    _check(ns, k, torch.bfloat16, torch.bfloat16, seed=3)


def test_bad_calls_are_refused(built):
    x = torch.randn(2, 8)
    w = [torch.randn(4, 8), torch.randn(3, 8)]
    with pytest.raises(SparsedraftError, match="1..16 rows"):
        kernels.linear_many(torch.randn(17, 8), w, [None, None])
    with pytest.raises(SparsedraftError, match="a bias \\(or None\\) per weight"):
        kernels.linear_many(x, w, [None])
    with pytest.raises(SparsedraftError, match="a scale per weight with int8 weights and only then"):
        kernels.linear_many(x, w, [None, None], [torch.ones(4), torch.ones(3)])
    with pytest.raises(RuntimeError, match="w \\[N, K\\]"):
        kernels.linear_many(x, [torch.randn(4, 8), torch.randn(3, 9)], [None, None])
    with pytest.raises(RuntimeError, match="weights of x's dtype"):
        kernels.linear_many(x, [torch.randn(4, 8), torch.randn(3, 8).bfloat16()], [None, None])


@pytest.mark.parametrize("kind", ["linear", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_project_many_is_one_project_per_layer(built, kind, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    layers = tuple(torch.nn.Linear(64, n, bias=n == 16).to(dtype) for n in (48, 16, 16))
    if kind == "int8":
        layers = tuple(Int8Linear(layer) for layer in layers)
    calls = []
    real = kernels.linear_many
    monkeypatch.setattr(kernels, "linear_many", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        for shape in ((1, 1, 64), (1, 5, 64), (2, 8, 64)):
            x = torch.randn(shape, generator=gen).to(dtype)
            together, apart = project_many(layers, x), [project(layer, x) for layer in layers]
            assert all(torch.equal(a, b) for a, b in zip(together, apart)), shape
    assert len(calls) == 3  # each step, up to 16 rows, was one call


def test_project_many_keeps_torchs_path_where_the_kernel_does_not_apply(built, monkeypatch):
    monkeypatch.setattr(kernels, "linear_many", lambda *a, **k: pytest.fail("the kernel was called"))
    linear = torch.nn.Linear(64, 32)
    mixed = (Int8Linear(linear), Int4Linear(torch.nn.Linear(64, 32)))
    x = torch.randn(1, 1, 64)
    with torch.inference_mode():
        out = project_many(mixed, x)
        assert [o.shape for o in out] == [(1, 1, 32), (1, 1, 32)]
        assert torch.equal(out[1], mixed[1](x))
        many = torch.randn(2, 9, 64)  # 18 rows: a batch of steps, one kernel call per 16 rows per layer
        assert all(torch.equal(a, project(b, many)) for a, b in zip(project_many((linear, linear), many),
                                                                     (linear, linear)))
    x.requires_grad_(True)
    out = project_many((linear,), x)[0]  # training: autograd through torch
    assert out.requires_grad and out.grad_fn is not None
