"""w8a8 past 8 rows (quant/modules.py): each activation row rounded to int8 with its own scale,
times the int8 weights in oneDNN's integer GEMM, against the same arithmetic in float64 and
against the float product within the rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend, choose_backend
from brisk.quant.formats import quantize
from brisk.quant.modules import OUTLIER_THRESHOLD, QuantizedLinear, set_int8_activations
from tests.helpers import require_c_compiler


int8_rows = KernelBackend().quantize_rows_int8  # the torch formulation, the C kernel's reference


def _layer(rows: int, cols: int, seed: int = 0, kernels: KernelBackend | None = None) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    layer = QuantizedLinear(quantize(torch.randn(rows, cols, generator=g), "int8"), torch.randn(rows, generator=g),
                            kernels=kernels or choose_backend(torch.device("cpu")))
    set_int8_activations(nn.Sequential(layer))
    assert layer.int8_activations
    return layer


def test_int8_rows_round_each_row_to_its_own_scale():
    x = torch.randn(6, 70, generator=torch.Generator().manual_seed(1)) * torch.tensor([1, 100, 0, 1e-3, 5, 1])[:, None]
    codes, scales, outliers = int8_rows(x, float("inf"))
    assert codes.dtype == torch.int8 and scales.shape == (6, 1) and not len(outliers)
    assert ((codes.float() * scales - x).abs() <= scales / 2 * (1 + 1e-6)).all()
    assert scales[2].item() == 1.0 and not codes[2].any()  # an all-zero row
    assert (codes.abs().amax(dim=1)[[0, 1, 3, 4, 5]] == 127).all()  # each row spans its own range


@pytest.mark.parametrize("m", [9, 17, 70])
@pytest.mark.parametrize("in_c", [True, False], ids=["c", "torch"])
def test_more_than_eight_rows_multiply_in_integers(m, in_c):
    if in_c:
        require_c_compiler()
    layer = _layer(37, 131, kernels=cpu_kernels.CBackend() if in_c else KernelBackend())
    x = torch.randn(m, 131, generator=torch.Generator().manual_seed(2)).clamp(-3, 3)  # no outliers
    codes, scales, _ = int8_rows(x, OUTLIER_THRESHOLD)
    weight = layer.qweight
    exact = (codes.double() @ weight.data.double().T) * scales.double() * weight.scales.double() + layer.bias.double()
    y = layer(x).double()
    assert torch.allclose(y, exact, rtol=1e-6, atol=1e-6)
    dense = weight.dequantize().double()
    error = (y - (x.double() @ dense.T + layer.bias.double())).abs()
    assert (error <= scales.double() / 2 * dense.abs().sum(dim=1) + 1e-5).all()
    assert (error > 0).any()  # it does round: this is not the float path
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_outlier_columns_are_multiplied_in_float():
    """Two columns far above the threshold (in one row each): they go through float, the rest
    rounds to a scale set by its own values, so the product is as close as without them."""
    layer = _layer(37, 131)
    x = torch.randn(20, 131, generator=torch.Generator().manual_seed(4)).clamp(-3, 3)
    x[3, 7], x[11, 100] = 40.0, -7.0
    codes, scales, outliers = int8_rows(x, OUTLIER_THRESHOLD)
    assert outliers.tolist() == [7, 100] and not codes[:, [7, 100]].any()
    weight = layer.qweight
    dense = weight.dequantize().double()
    exact = ((codes.double() @ weight.data.double().T) * scales.double() * weight.scales.double()
             + x[:, [7, 100]].double() @ dense[:, [7, 100]].T + layer.bias.double())
    y = layer(x).double()
    assert torch.allclose(y, exact, rtol=1e-6, atol=1e-5)
    error = (y - (x.double() @ dense.T + layer.bias.double())).abs()
    assert (error <= scales.double() / 2 * dense.abs().sum(dim=1) + 1e-5).all()
    assert OUTLIER_THRESHOLD < 7.0


def test_the_c_rounding_and_scaling_equal_torch():
    require_c_compiler()
    x = torch.randn(33, 300, generator=torch.Generator().manual_seed(5)) * 2
    x[4, 10], x[20, 299], x[7] = 9.0, -50.0, 0.0
    for threshold in (OUTLIER_THRESHOLD, float("inf")):
        (codes, scales, outliers), expected = cpu_kernels.quantize_rows_int8(x, threshold), int8_rows(x, threshold)
        assert torch.equal(codes, expected[0]) and torch.equal(outliers, expected[2])
        assert torch.allclose(scales, expected[1], rtol=1e-6, atol=0)  # -ffast-math: amax * (1 / 127)
    acc = torch.randint(-2**20, 2**20, (33, 50), dtype=torch.int32)
    rows, cols, bias = torch.rand(33, 1), torch.rand(50), torch.randn(50)
    for b in (bias, None):
        expected = acc.double() * rows.double() * cols.double() + (0 if b is None else b.double())
        assert torch.allclose(cpu_kernels.scale_int32(acc, rows, cols, b).double(), expected, rtol=1e-6, atol=1e-6)


def test_up_to_eight_rows_keep_the_per_block_kernel():
    require_c_compiler()
    layer = _layer(24, 576)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer(x), cpu_kernels.quant_linear(x, layer.kernel_weight()))
