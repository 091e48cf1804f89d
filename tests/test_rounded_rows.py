"""``draft_weights="w8a8"``: int8 codes times each row of x rounded to int8, summed exactly. The kernel
(``rounded_rows_linear.cpp``, every path this machine builds) and the layer's torch path give the same bits for
any number of rows; the layer stays close to the float linear; the packing round-trips."""

import pytest
import torch
from torch import nn

from sparsedraft.engine import kernels
from sparsedraft.engine.cpuinfo import cpu_flags
from sparsedraft.engine.quant import RoundedInt8Linear, pack_codes, round_rows, unpack_codes


def _layer(n, k, bias, seed=0):
    torch.manual_seed(seed)
    return RoundedInt8Linear(nn.Linear(k, n, bias=bias)).eval()


@pytest.mark.parametrize("n, k", [(3, 5), (37, 70), (192, 576)])
def test_packing_round_trips_and_pads_with_zero_codes(n, k):
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    packed = pack_codes(codes)
    assert packed.shape == (-(-n // 4), -(-k // 32), 4, 32) and packed.is_contiguous()
    assert torch.equal(unpack_codes(packed, n, k), codes)
    assert int(packed.abs().sum()) == int(codes.abs().sum())  # nothing but zeros in the padding


def test_rows_round_half_to_even_on_their_own_scale():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [-254.0, 1.0, 3.0, 5.0, 0.0]])
    q, s = round_rows(x)
    assert q.tolist() == [[127, 0, 2, -2, 0], [0, 0, 0, 0, 0], [-127, 0, 2, 2, 0]]
    assert s.flatten().tolist() == [1.0, 0.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, bias", [(5, 37, True), (193, 100, False), (576, 576, True)])
def test_the_kernel_gives_the_torch_paths_bits_and_rows_their_own(built, dtype, n, k, bias):
    layer = _layer(n, k, bias, seed=n)
    x = (torch.randn(16, k) * torch.logspace(-2, 1, 16)[:, None]).to(dtype)  # rows of very different ranges
    x[5] = 0  # a zero row: its scale is 0, its output the bias
    with torch.no_grad():
        alone = [kernels.linear(x[m:m + 1], layer.packed, layer.bias, layer.scale) for m in range(16)]
        for rows in (1, 2, 3, 7, 11, 16):  # VNNI takes 3-8 rows at a time (11 is 8 + 3), 1-2 AVX2's sums
            out = kernels.linear(x[:rows], layer.packed, layer.bias, layer.scale)
            assert out.dtype == dtype and out.shape == (rows, n)
            assert torch.equal(out, layer(x[:rows]))
            assert all(torch.equal(out[m], alone[m][0]) for m in range(rows))
        want = torch.zeros(n) if layer.bias is None else layer.bias.float()
        assert torch.equal(alone[5][0].float(), want.to(dtype).float())


def test_the_layer_stays_close_to_the_float_linear():
    torch.manual_seed(1)
    linear = nn.Linear(576, 192)
    layer = RoundedInt8Linear(linear).eval()
    x = torch.randn(9, 576)
    with torch.no_grad():
        exact, rounded = linear(x), layer(x)
    error = (rounded - exact).norm() / exact.norm()
    assert 1e-4 < error < 0.02  # rounded, not exact, and within a couple of percent


def test_codes_packed_for_another_shape_are_one_clear_error(built):
    layer = _layer(40, 64, True)
    with pytest.raises(RuntimeError, match="packed for 64 inputs and 40 rows"):
        kernels.linear(torch.randn(2, 96), layer.packed, layer.bias, layer.scale)


def test_a_batch_of_steps_past_16_rows_takes_the_kernel_in_parts_with_the_same_bits(built, monkeypatch):
    from sparsedraft.engine.model import project
    layer = _layer(70, 64, True)
    calls = []
    real = kernels._module.linear_rounded
    monkeypatch.setattr(kernels._module, "linear_rounded", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(6, 3, 64)  # six sequences' 3-token steps: 18 rows
    with torch.no_grad():
        out = project(layer, x)
        assert out.shape == (6, 3, 70) and torch.equal(out, layer(x))
    assert [shape[0] for shape in calls] == [16, 2]


def test_the_vnni_path_is_built_exactly_where_the_cpu_and_the_build_have_it(built, native):
    want = (native or built == "avx512bf16") and {"avx512_vnni", "avx512bw"} <= cpu_flags()
    assert bool(kernels._module.vnni) == want
    assert ("w8a8 linear on VNNI" in kernels.path()) == want
