"""Low-bit weights multiplied as stored, in Triton: the GPU's counterpart of kernels/quant.h.

A decode step streams every weight once, so a weight read in 4 or 8 bits is 4x or 2x fewer
bytes than bf16, if it is never widened in memory first (the torch fallback, `dequantize()`
then a matmul, writes and reads a float copy of the whole matrix every step). Here each
program loads a [BN, 32] tile of codes, widens it in registers with its scales (and int4's
minimums) and multiplies it on the tensor cores against a [BM, 32] tile of activations.

Formats served (quant/formats.py): int8 (a scale per row: applied once to the sum) and int4
(codes 0..15 per group of 32/64/128 columns with a scale and a minimum, packed two per byte in
GGUF's order: byte t of a 32-column block holds column t low and column t + 16 high), which is
also how a GGUF file's Q4_0 and Q4_1 matrices load. The other formats (fp8, nf4, q8_0, int5, the
K-quants, and mixed weights, part by part) take the dequantizing path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from brisk.kernels.packed import BLOCK, QuantizedTensor

FORMATS = ("int8", "int4")


@triton.jit(do_not_specialize=["M"])  # the batch changes step to step: no recompiles
def _int8_matmul_kernel(X, CODES, SCALES, BIAS, OUT, M, N, K, stride_xm, stride_cn, stride_om,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                        IEEE: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        codes = tl.load(CODES + cols[:, None] * stride_cn + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K),
                        other=0)
        if IEEE:
            acc += tl.dot(x, tl.trans(codes.to(x.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(codes.to(x.dtype)))
    acc *= tl.load(SCALES + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _int4_matmul_kernel(X, CODES, SCALES, MINS, BIAS, OUT, M, N, K, stride_xm, stride_cn, stride_sn, stride_om,
                        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        IEEE: tl.constexpr):
    """A 32-column block at a time: its low nibbles are columns k0..k0+15, its high ones k0+16..k0+31,
    two products of depth 16 each."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    t = tl.arange(0, 16)
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, 32):
        packed = tl.load(CODES + cols[:, None] * stride_cn + (k0 // 2 + t)[None, :], mask=col_ok, other=0)
        group = k0 // GROUP
        scale = tl.load(SCALES + cols * stride_sn + group, mask=cols < N, other=0.0)[:, None]
        low = tl.load(MINS + cols * stride_sn + group, mask=cols < N, other=0.0)[:, None]
        w_low = ((packed & 15).to(tl.float32) * scale + low).to(X.dtype.element_ty)  # [BN, 16]
        w_high = ((packed >> 4).to(tl.float32) * scale + low).to(X.dtype.element_ty)
        k_low = k0 + t
        x_low = tl.load(X + rows[:, None] * stride_xm + k_low[None, :], mask=row_ok & (k_low[None, :] < K), other=0.0)
        x_high = tl.load(X + rows[:, None] * stride_xm + (k_low + 16)[None, :],
                         mask=row_ok & (k_low[None, :] + 16 < K), other=0.0)
        if IEEE:
            acc += tl.dot(x_low, tl.trans(w_low), input_precision="ieee")
            acc += tl.dot(x_high, tl.trans(w_high), input_precision="ieee")
        else:
            acc += tl.dot(x_low, tl.trans(w_low))
            acc += tl.dot(x_high, tl.trans(w_high))
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def quant_linear(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias) -> [M, N] in x's dtype, for weight in FORMATS."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else 64
    bn = 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    has_bias = bias is not None
    ieee = x.dtype == torch.float32
    if weight.format == "int8":
        _int8_matmul_kernel[grid](x, weight.data, weight.scales, bias if has_bias else weight.scales, out, m, n, k,
                                  x.stride(0), weight.data.stride(0), out.stride(0),
                                  BM=bm, BN=bn, BK=32, HAS_BIAS=has_bias, IEEE=ieee)
    else:
        assert weight.group_size % BLOCK == 0
        _int4_matmul_kernel[grid](x, weight.data, weight.scales, weight.mins, bias if has_bias else weight.scales, out,
                                  m, n, k, x.stride(0), weight.data.stride(0), weight.scales.stride(0), out.stride(0),
                                  GROUP=weight.group_size, BM=bm, BN=bn, HAS_BIAS=has_bias, IEEE=ieee)
    return out
