"""Weight formats: how a [rows, cols] matrix is stored in 4 or 8 bits, and how to read it back.

Every format keeps one row of the matrix in one row of its tensors (codes [rows, bytes],
scales [rows, groups], ...), so fusing q/k/v is a concatenation (or, where the file stores the
shards in different formats, a MixedTensor of them: `stack`) and a row permutation is an index,
whatever the format. The C kernels (kernels/quant.h) read these tensors as they are;
`QuantizedTensor.dequantize` is the torch reference the kernels are tested against, and the
fallback where the kernels don't run (no compiler, GPUs).

| format | per weight | stored as                                                            |
|--------|-----------:|----------------------------------------------------------------------|
| int8   | 8 bits     | symmetric codes, one fp32 scale per output channel (row)             |
| fp8    | 8 bits     | e4m3 values, one fp32 scale per row                                  |
| int4   | 4 bits     | codes 0..15 per group of 32/64/128 columns, fp16 scale + fp16 minimum |
| nf4    | 4 bits     | bitsandbytes' normal-float codebook, one fp16 absmax per group        |
| q8_0   | 8.5 bits   | GGUF blocks of 32, as in the file: f16 scale + 32 int8               |
| int5   | 6 bits     | codes 0..31 per group of 32: a u32 of fifth bits + 16 bytes of nibbles, fp16 scale + fp16 minimum |
| q4_k   | 4.5 bits   | GGUF super-blocks of 256, as in the file (below)                     |
| q5_k   | 5.5 bits   | GGUF super-blocks of 256, as in the file                             |
| q6_k   | 6.56 bits  | GGUF super-blocks of 256, as in the file                             |
| mixed  |            | row ranges in their own formats (MixedTensor: a fused projection whose shards differ) |

A GGUF file's Q4_0 and Q4_1 matrices load as int4 with groups of 32 (`from_gguf_blocks`): the
same nibbles, the same f16 scale and minimum (Q4_0: -8 x scale, also exact in f16), so nothing is
rounded. Its Q5_0 and Q5_1 matrices load as int5 the same way (Q5_0: minimum -16 x scale): a block
keeps the file's 20 bytes of codes, {u32 qh; u8 qs[16]}, where bit t of qh is element t's fifth
bit and qs holds the low four as int4 does. The grouped formats keep their scales in f16, as GGUF
does, because a decode step reads them with every block: in f32 they were a third of a 4-bit
weight's bytes (8 of 24 per 32 weights), in f16 a fifth (4 of 20).

The K-quants are kept as the file's super-blocks of 256 columns, 8 blocks of 32 (ggml-common.h):

    q4_k  {f16 d, dmin; u8 scales[12]; u8 qs[128]}            block k: w = d sc_k q - dmin m_k
    q5_k  {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}  the same with q's fifth bit
    q6_k  {u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d}     w = d sc_s (q - 32), s = column // 16

sc_k and m_k are 6 bits each, packed in 12 bytes: for k < 4 the low 6 bits of bytes k and k + 4;
for k >= 4 the low and high nibbles of byte k + 4, their top 2 bits those of bytes k - 4 and k.
Element t of block k has its low four bits at qs[32 (k // 2) + t] >> 4 (k % 2) (two blocks share
32 bytes), q5_k its fifth bit at qh[t] >> k. q6_k's element e of a super-block: c = e // 128,
i = e % 128, low four bits at ql[64 c + i % 64] >> 4 (i // 64), high two at qh[32 c + i % 32] >>
2 (i // 32). The file's own values need no second rounding: the kernels read these blocks as
stored (kernels/quant.h), and `QuantizedTensor.dequantize` follows ggml's formulas exactly.

4-bit codes are packed two per byte in GGUF's order within each block of 32 columns: byte t
holds column t in its low nibble and column t + 16 in its high one. Columns are padded up to a
multiple of 32 with zero codes, which the kernels never multiply.
"""

from __future__ import annotations

import torch

from brisk.kernels.packed import (BLOCK, GGUF_BLOCK_BYTES, GROUP_SIZES, GROUPED_FORMATS, K_QUANTS,  # noqa: F401
                                  NF4_VALUES, MixedTensor, QuantizedTensor, _half, dequantize_gguf_blocks, stack,
                                  unpack_int5, unpack_nibbles)

_FP8_MAX = 448.0  # largest finite e4m3 value


def quantize(weight: torch.Tensor, method: str, group_size: int = 32) -> QuantizedTensor:
    """A float [rows, cols] matrix in `method` (int8, fp8, int4 or nf4), rounded to nearest."""
    if method not in _QUANTIZERS:
        raise ValueError(f"cannot quantize to {method!r}: choose one of {', '.join(_QUANTIZERS)}")
    if method in GROUPED_FORMATS and group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    if weight.dim() != 2:
        raise ValueError(f"only matrices can be quantized, got shape {tuple(weight.shape)}")
    return _QUANTIZERS[method](weight.detach().float(), group_size)


def _int8(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    scales = _nonzero(w.abs().amax(dim=1) / 127.0)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", tuple(w.shape), codes, scales)


def _fp8(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    scales = _nonzero(w.abs().amax(dim=1) / _FP8_MAX)
    codes = (w / scales[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedTensor("fp8", tuple(w.shape), codes, scales)


def _int4(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Asymmetric: each group's [min, max] spread over the 16 codes, w = scale * code + min. The
    zero point is kept as a float (GGUF Q4_1's choice) rather than rounded to a code: an integer
    zero point moves the grid off a group's own ends, which re-rounds every weight of a model that
    was 4-bit already (measured: 8% weight error instead of 0 on the default model at group 32).
    The scale and minimum are rounded to f16 first and the codes chosen against the rounded ones."""
    groups = _groups(w, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales, low = _nonzero(_half_of(((high - low) / 15.0))), _half_of(low).contiguous()
    codes = torch.round((groups - low.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return QuantizedTensor("int4", tuple(w.shape), pack_nibbles(_ungroup(codes, w.shape[1])), scales, low,
                           group_size)


def _nf4(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    groups = _groups(w, group_size)
    scales = _nonzero(_half_of(groups.abs().amax(dim=2)))
    normalized = groups / scales.float()[..., None]
    # nearest codebook entry: the codebook is sorted, so search between midpoints
    midpoints = ((NF4_VALUES[1:] + NF4_VALUES[:-1]) / 2).to(w.device)
    codes = torch.bucketize(normalized, midpoints)
    return QuantizedTensor("nf4", tuple(w.shape), pack_nibbles(_ungroup(codes, w.shape[1])), scales,
                           group_size=group_size)


_QUANTIZERS = {"int8": _int8, "fp8": _fp8, "int4": _int4, "nf4": _nf4}


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """All-zero rows or groups get scale 1 (their codes are zero either way), in scales' dtype."""
    return torch.where(scales > 0, scales, torch.ones_like(scales)).contiguous()


def _half_of(values: torch.Tensor) -> torch.Tensor:
    """A grouped format's scales or minimums in f16, which holds up to 65504."""
    halves = values.half()
    if not torch.isfinite(halves).all():
        raise ValueError(f"int4 and nf4 keep scales in float16, whose largest value is 65504; this weight "
                         f"reaches {values.abs().max().item():.4g}")
    return halves


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, cols] -> [rows, groups, group_size], the last group padded with zeros."""
    rows, cols = w.shape
    padded = -(-cols // group_size) * group_size
    return torch.nn.functional.pad(w, (0, padded - cols)).view(rows, -1, group_size)


def _ungroup(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """[rows, groups, group_size] codes -> [rows, cols padded to a multiple of 32], pad codes 0."""
    rows = codes.shape[0]
    flat = codes.reshape(rows, -1)[:, :cols]
    return torch.nn.functional.pad(flat, (0, -(-cols // BLOCK) * BLOCK - cols)).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, 32 n] in 0..15 -> [rows, 16 n] bytes, GGUF order within each block."""
    rows = codes.shape[0]
    blocks = codes.view(rows, -1, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, -1).contiguous()


def from_gguf_blocks(kind: str, shape: tuple[int, int], blocks: torch.Tensor) -> QuantizedTensor:
    """A GGUF matrix's blocks (a GGUF_BLOCK_BYTES kind; [rows, bytes per row]) as a
    QuantizedTensor whose values are the file's exactly. Q8_0 and the K-quants stay as stored.
    Q4_0 and Q4_1 are repacked into int4 groups of 32, Q5_0 and Q5_1 into int5 (llama.cpp repacks
    Q4_0 at load as well, into interleaved rows): the nibbles are already in int4's order, so the
    kernels need one 4-bit reader, not three, and int5 is that reader and a bit. Q4_1 keeps its 20
    bytes per 32 weights and Q5_1 its 24; Q4_0 and Q5_0 take 2 more (their minimum is stored)."""
    if kind == "q8_0" or kind in K_QUANTS:
        return QuantizedTensor(kind, shape, blocks)
    rows = shape[0]
    flat = blocks.reshape(-1, GGUF_BLOCK_BYTES[kind])
    scales = _half(flat, 0)
    if kind in ("q4_0", "q5_0"):
        mins, codes = (-8.0 if kind == "q4_0" else -16.0) * scales, flat[:, 2:]
    else:
        mins, codes = _half(flat, 2), flat[:, 4:]
    return QuantizedTensor("int4" if kind.startswith("q4") else "int5", shape, codes.reshape(rows, -1).contiguous(),
                           scales.reshape(rows, -1), mins.reshape(rows, -1), BLOCK)
