"""The low-bit kernels (kernels/quant.h) against x @ W^T with W the format's own dequantized
matrix, for every format, on widths that are not multiples of the block or the group, and on
1..70 activation rows (the register path up to 8 rows, the panel path above). The AVX2 and the
portable builds are compared with the host's build too, whatever the host has."""

from __future__ import annotations

import ctypes
import mmap
import platform

import pytest
import torch

from brisk.kernels import cpu as cpu_kernels
from brisk.quant.formats import GGUF_BLOCK_BYTES, K_QUANTS, QuantizedTensor, from_gguf_blocks, quantize
from tests.helpers import require_c_compiler

require_c_compiler()

FLOAT_FORMATS = ("int8", "fp8", "int4", "nf4")


# where each kind keeps its f16 scales (d, and dmin or the minimum) in a block
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2),
              "q5_k": (0, 2), "q6_k": (208,)}


def random_gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random, valid GGUF blocks of a [rows, cols] matrix (small fp16 scales and mins, any codes
    and sub-block scales), [rows, bytes per row] as a file has them."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols // (256 if kind in K_QUANTS else 32)
    blocks = torch.randint(0, 256, (n, GGUF_BLOCK_BYTES[kind]), generator=g, dtype=torch.uint8)
    if kind == "q8_0":
        blocks[blocks == 128] = 129  # -128 is never written by ggml's rounding (|q| <= 127)
    for at in F16_FIELDS[kind]:
        blocks[:, at:at + 2] = (torch.rand(n, 1, generator=g) * 0.02 + 0.001).half().view(torch.uint8)
    return blocks.reshape(rows, -1)


def _weights(rows: int, cols: int) -> list[QuantizedTensor]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    made = [quantize(w, f, group) for f in FLOAT_FORMATS for group in ((32, 64, 128) if f in ("int4", "nf4") else (64,))]
    return made + [from_gguf_blocks(kind, (rows, cols), random_gguf_blocks(kind, rows, cols)) for kind in GGUF_BLOCK_BYTES
                   if cols % (256 if kind in K_QUANTS else 32) == 0]


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rel: float) -> None:
    """|y - x W^T| within rel of the sum of |x w| per output: float32 sums in another order."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = rel * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all(), ((y.double() - ref).abs() / bound).max()


@pytest.mark.parametrize("rows, cols", [(37, 45), (19, 131), (40, 96), (8, 576), (11, 512)])
def test_every_format_matches_its_dequantized_matrix(rows, cols):
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(rows)
    for weight in _weights(rows, cols):
        dense = weight.dequantize()
        kernel = cpu_kernels.KernelWeight.quantized(weight, bias)
        for m in range(1, 71):
            _check(cpu_kernels.quant_linear(x[:m], kernel), x[:m], dense, bias, 1e-5)


@pytest.mark.parametrize("rows, cols", [(37, 45), (13, 235), (24, 576), (9, 768)])  # 1, 7, 18 and 24 full blocks
def test_int8_activations_stay_within_their_rounding(rows, cols):
    """Each block of x is rounded to int8 with step amax/127: the product moves by at most half
    a step per element times |w|, plus float noise."""
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(3))
    full = cols // 32 * 32
    amax = x[:, :full].abs().view(9, -1, 32).amax(dim=2).repeat_interleave(32, dim=1)
    step = torch.cat([amax / 127, torch.zeros(9, cols - full)], dim=1)  # the tail stays float
    for weight in _weights(rows, cols):
        if weight.format not in cpu_kernels.INT8_ACTIVATION_FORMATS:
            continue
        dense = weight.dequantize().double()
        kernel = cpu_kernels.KernelWeight.quantized(weight, quantize_activations=True)
        for m in (1, 4, 5, 9):
            y = cpu_kernels.quant_linear(x[:m], kernel).double()
            error = (y - x[:m].double() @ dense.T).abs()
            bound = (step[:m].double() / 2) @ dense.abs().T + 1e-5 * (x[:m].double().abs() @ dense.abs().T)
            assert (error <= bound).all(), weight.format
            assert (error > 0).any()  # it does round: this is not the float path


def _before_a_guard_page(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose last byte is followed by an inaccessible page: a kernel that reads past
    the end of a weight's codes (a vector load of a short last block) faults instead of reading
    its neighbour's bytes harmlessly, as it would in a model's packed weights."""
    nbytes, page = t.numel() * t.element_size(), mmap.PAGESIZE
    size = -(-nbytes // page) * page + page
    buffer = torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(buffer.data_ptr() + size - page), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    copy = buffer[size - page - nbytes:size - page].view(t.dtype).view(t.shape)
    return copy.copy_(t)


@pytest.mark.skipif(platform.system() != "Linux", reason="mprotect through libc")
@pytest.mark.parametrize("cols", [32, 96, 235, 256])  # an odd number of full blocks, the last one alone; a super-block
def test_no_kernel_reads_past_the_last_block_of_the_codes(cols):
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(5))
    for weight in _weights(3, cols):
        guarded = QuantizedTensor(weight.format, weight.shape, _before_a_guard_page(weight.data), weight.scales,
                                  weight.mins, weight.group_size)
        dense = weight.dequantize()
        for activations in (False, True) if weight.format in cpu_kernels.INT8_ACTIVATION_FORMATS else (False,):
            kernel = cpu_kernels.KernelWeight.quantized(guarded, quantize_activations=activations)
            for m in (1, 4, 5):
                y = cpu_kernels.quant_linear(x[:m], kernel)
                _check(y, x[:m], dense, None, 1e-5 if not activations else 0.05)


def test_a_group_size_the_kernels_cannot_shift_to_is_refused():
    weight = quantize(torch.randn(4, 192), "int4", 64)
    odd = QuantizedTensor("int4", weight.shape, weight.data, weight.scales, weight.mins, 96)
    with pytest.raises(ValueError, match="group size 96 is not one of"):
        cpu_kernels.KernelWeight.quantized(odd)


def test_activation_rounding_refuses_formats_without_an_integer_product():
    weight = quantize(torch.randn(4, 64), "nf4", 32)
    with pytest.raises(ValueError, match="nf4 weights multiply float activations only"):
        cpu_kernels.KernelWeight.quantized(weight, quantize_activations=True)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set variants")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # the AVX2 + FMA path; the portable C path
def test_avx2_and_portable_builds_agree_with_the_host_build(march):
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(4))  # 16 blocks, int4 groups of 64 and 128
    for weight in _weights(21, 512):
        for activations in (False, True) if weight.format in cpu_kernels.INT8_ACTIVATION_FORMATS else (False,):
            kernel = cpu_kernels.KernelWeight.quantized(weight, quantize_activations=activations)
            for m in (1, 3, 12):
                native = cpu_kernels.quant_linear(x[:m], kernel)
                other = cpu_kernels.quant_linear(x[:m], kernel, march=march)
                scale = x[:m].abs() @ weight.dequantize().abs().T
                assert ((native - other).abs() <= 1e-5 * scale + 1e-30).all(), (weight.format, activations, m)
