"""Each weight format's round trip (quantize -> dequantize) against a bound that follows from how
it rounds, on shapes that are not multiples of the group or the block."""

from __future__ import annotations

import gguf
import pytest
import torch

from brisk.kernels.packed import TILE_BLOCK_BYTES, tile_rows, untile_rows
from brisk.quant.formats import (GGUF_BLOCK_BYTES, NF4_VALUES, QuantizedTensor, dequantize_gguf_blocks, from_gguf_blocks,
                                 pack_nibbles, quantize, unpack_nibbles)
from tests.kernels.test_quant_kernels import random_gguf_blocks

SHAPES = [(7, 45), (33, 100), (64, 128), (3, 31)]


def _weight(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g)  # rows of different scale


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_rounds_to_half_a_step_per_channel(shape):
    w = _weight(shape)
    q = quantize(w, "int8")
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert q.data.dtype == torch.int8 and q.scales.shape == (shape[0],)
    assert ((q.dequantize() - w).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_rounds_to_half_a_step_per_group(shape, group):
    w = _weight(shape)
    q = quantize(w, "int4", group)
    groups = -(-shape[1] // group)
    assert q.scales.shape == q.mins.shape == (shape[0], groups)
    assert q.data.shape == (shape[0], -(-shape[1] // 32) * 16)  # two codes a byte, padded to blocks of 32
    padded = torch.nn.functional.pad(w, (0, groups * group - shape[1])).view(shape[0], groups, group)
    span = padded.amax(dim=2) - padded.amin(dim=2)
    step = (span / 15).repeat_interleave(group, dim=1)[:, :shape[1]]
    assert q.scales.dtype == q.mins.dtype == torch.float16
    assert ((q.dequantize() - w).abs() <= step / 2 * (1 + 2 ** -10) + 1e-7).all()  # the step rounded to f16


def test_int4_at_group_32_reproduces_a_q4_1_grid_exactly():
    """Weights that were 4-bit already (16 levels per 32 columns, f16 scale and minimum) come back
    as they were."""
    g = torch.Generator().manual_seed(5)
    scale, low = (torch.rand(6, 3, 1, generator=g) + 0.1).half().float(), torch.randn(6, 3, 1, generator=g).half().float()
    codes = torch.randint(0, 16, (6, 3, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans its whole grid
    w = (codes * scale + low).view(6, 96)
    assert torch.allclose(quantize(w, "int4", 32).dequantize(), w, atol=1e-6)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_load_with_the_values_of_the_file(kind):
    """Q4_0 / Q4_1 are repacked into int4 groups of 32, Q8_0 kept: either way every weight is the
    value the GGUF block stands for (ggml's own formula, dequantize_gguf_blocks), bit for bit."""
    g = torch.Generator().manual_seed(6)
    rows, cols = 5, 96
    n = rows * cols // 32
    halves = lambda: (torch.randn(n, 1, generator=g) * 0.02).half().view(torch.uint8)  # noqa: E731
    codes = torch.randint(0, 256, (n, GGUF_BLOCK_BYTES[kind] - (4 if kind == "q4_1" else 2)), generator=g,
                          dtype=torch.uint8)
    blocks = torch.cat([halves(), halves(), codes] if kind == "q4_1" else [halves(), codes], dim=1)
    loaded = from_gguf_blocks(kind, (rows, cols), blocks.reshape(rows, -1))
    assert loaded.format == ("q8_0" if kind == "q8_0" else "int4") and loaded.group_size == 32
    assert torch.equal(loaded.dequantize(), dequantize_gguf_blocks(kind, blocks).view(rows, cols))


@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_picks_the_nearest_codebook_value(shape):
    w = _weight(shape)
    q = quantize(w, "nf4", 64)
    scales = q.scales.repeat_interleave(64, dim=1)[:, :shape[1]]
    distances = (w[..., None] / scales[..., None] - NF4_VALUES).abs()
    chosen = (q.dequantize() / scales)[..., None]
    assert torch.allclose(distances.min(dim=-1).values, (w[..., None] / scales[..., None] - chosen).abs()[..., 0],
                          atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_keeps_three_mantissa_bits(shape):
    w = _weight(shape)
    q = quantize(w, "fp8")
    error = (q.dequantize() - w).abs()
    scale = q.scales[:, None]
    # e4m3: relative spacing 2^-3 for normal values (half of it rounding), absolute 2^-9 * scale below 2^-6 * scale
    assert (error <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)).all()


def test_all_zero_rows_and_groups_stay_zero():
    w = torch.zeros(3, 70)
    w[1, 40:] = 1.0
    for method in ("int8", "fp8", "int4", "nf4"):
        q = quantize(w, method, 32).dequantize()
        assert torch.equal(q[w == 0], w[w == 0]), method
        assert torch.allclose(q, w, atol=2 ** -11, rtol=0), method  # int4's f16 step of 1/15 gives 15 steps = 0.99976


def test_nibbles_pack_in_gguf_order():
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = pack_nibbles(codes)
    assert packed[0, 0] == (codes[0, 0] | codes[0, 16] << 4)  # byte t: column t low, column t + 16 high
    assert torch.equal(unpack_nibbles(packed), codes)


def test_rows_and_cat_keep_every_format_consistent():
    w = _weight((10, 96))
    for method in ("int8", "fp8", "int4", "nf4"):
        q = quantize(w, method, 32)
        order = torch.tensor([3, 1, 7])
        assert torch.equal(q.rows(order).dequantize(), q.dequantize()[order])
        assert torch.equal(QuantizedTensor.cat([q.rows(order), q]).dequantize(),
                           torch.cat([q.dequantize()[order], q.dequantize()]))


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_int4_in_tiles_of_16_rows_keeps_every_byte(rows):
    """int4x16 (the CPU integer products' layout): the same codes, scales and minimums, rows
    interleaved by 16 and the last tile padded; back to int4 whole or row by row, bit for bit."""
    q = quantize(_weight((rows, 96)), "int4", 32)
    tiled = tile_rows(q)
    assert tiled.data.shape == (-(-rows // 16), 3 * TILE_BLOCK_BYTES["int4x16"])
    # tile 0, block 1: word 2 of lane 0 is bytes 8..11 of row 0's second block, its scale after the codes
    block = tiled.data[0, TILE_BLOCK_BYTES["int4x16"]:2 * TILE_BLOCK_BYTES["int4x16"]]
    assert torch.equal(block[2 * 64:2 * 64 + 4], q.data[0, 16 + 8:16 + 12])
    assert torch.equal(block[256:258].view(torch.float16), q.scales[0, 1:2])
    _untiles_bit_for_bit(tiled, q)


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_q8_0_in_tiles_of_16_rows_keeps_every_byte(rows):
    """q8_0x16: each code + 128 (the unsigned operand of vpdpbusd), then the f16 scales."""
    q = _quantize_gguf(_weight((rows, 96)), "q8_0")
    tiled = tile_rows(q)
    assert tiled.data.shape == (-(-rows // 16), 3 * TILE_BLOCK_BYTES["q8_0x16"])
    block = tiled.data[0, TILE_BLOCK_BYTES["q8_0x16"]:2 * TILE_BLOCK_BYTES["q8_0x16"]]  # tile 0, block 1
    stored = q.data[0, 34:68]  # row 0's block 1 as the file has it: f16 scale, 32 int8 codes
    assert torch.equal(block[5 * 64:5 * 64 + 4], stored[2 + 20:2 + 24] ^ 0x80)  # word 5 of lane 0
    assert torch.equal(block[512:514], stored[:2])
    _untiles_bit_for_bit(tiled, q)


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_int5_in_tiles_of_16_rows_keeps_every_byte(rows):
    """int5x16 (Q5_0 and Q5_1 as the integer products read them): int4x16's nibble words, then the
    fifth bits regrouped by word (bit t of byte e: element 4t + e), then scales and minimums."""
    q = _quantize_gguf(_weight((rows, 96)), "q5_1")
    tiled = tile_rows(q)
    assert tiled.data.shape == (-(-rows // 16), 3 * TILE_BLOCK_BYTES["int5x16"])
    block = tiled.data[0, TILE_BLOCK_BYTES["int5x16"]:2 * TILE_BLOCK_BYTES["int5x16"]]  # tile 0, block 1
    stored = q.data[0, 20:40]  # row 0's block 1: u32 of fifth bits (bit e: element e), 16 nibble bytes
    assert torch.equal(block[2 * 64:2 * 64 + 4], stored[4 + 8:4 + 12])  # word 2 of lane 0
    fifth = int.from_bytes(bytes(stored[:4].tolist()), "little")
    lane0 = block[256:260].tolist()
    assert [lane0[e % 4] >> (e // 4) & 1 for e in range(32)] == [fifth >> e & 1 for e in range(32)]
    assert torch.equal(block[320:322].view(torch.float16), q.scales[0, 1:2])
    assert torch.equal(block[352:354].view(torch.float16), q.mins[0, 1:2])
    _untiles_bit_for_bit(tiled, q)


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_q4_k_in_tiles_of_16_rows_keeps_every_byte(rows):
    """q4_kx16: per super-block, 8 records of a block's nibbles (element t low, t + 16 high, as
    int4's), its 6-bit scales and minimums as bytes; then the rows' d and dmin. Back to the file's
    super-blocks, packed scales included, bit for bit."""
    q = _random_gguf("q4_k", rows, 512)
    tiled = tile_rows(q)
    assert tiled.data.shape == (-(-rows // 16), 16 * TILE_BLOCK_BYTES["q4_kx16"])
    stored = q.data[0, 144:288]  # row 0's second super-block: d, dmin, 12 bytes of scales, 128 of codes
    second = tiled.data[0, 8 * TILE_BLOCK_BYTES["q4_kx16"]:]
    record = second[3 * 288:4 * 288]  # its block 3: codes in the high nibbles of bytes 32 .. 63
    codes = [b >> 4 for b in stored[16 + 32:16 + 64].tolist()]
    assert record[64:68].tolist() == [codes[4 + e] | codes[20 + e] << 4 for e in range(4)]  # word 1 of lane 0
    packed = stored[4:16].tolist()  # block 3's scale and minimum: the low 6 bits of bytes 3 and 7
    assert (record[256].item(), record[272].item()) == (packed[3] & 63, packed[7] & 63)
    assert torch.equal(second[8 * 288:8 * 288 + 2], stored[:2]) and torch.equal(second[8 * 288 + 32:8 * 288 + 34],
                                                                               stored[2:4])
    _untiles_bit_for_bit(tiled, q)


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_q5_k_in_tiles_of_16_rows_keeps_every_byte(rows):
    """q5_kx16: q4_kx16's records with a word of fifth bits after the nibble words, as int5x16's
    (bit t of byte e: element 4t + e); a block's fifth bits are bit k of the file's qh bytes. Back
    to the file's super-blocks, qh and packed scales included, bit for bit."""
    q = _random_gguf("q5_k", rows, 512)
    tiled = tile_rows(q)
    assert tiled.data.shape == (-(-rows // 16), 16 * TILE_BLOCK_BYTES["q5_kx16"])
    stored = q.data[0, 176:352]  # row 0's second super-block: d, dmin, 12 bytes of scales, qh [32], qs [128]
    second = tiled.data[0, 8 * TILE_BLOCK_BYTES["q5_kx16"]:]
    record = second[5 * 352:6 * 352]  # its block 5: codes in the high nibbles of qs bytes 64 .. 95
    codes = [b >> 4 for b in stored[48 + 64:48 + 96].tolist()]
    assert record[64:68].tolist() == [codes[4 + e] | codes[20 + e] << 4 for e in range(4)]  # word 1 of lane 0
    fifth = [qh >> 5 & 1 for qh in stored[16:48].tolist()]  # block 5's: bit 5 of qh[l]
    assert [record[256 + e].item() >> t & 1 for t in range(8) for e in range(4)] == fifth
    packed = stored[4:16].tolist()  # block 5's scale and minimum: bytes 8 + 1's nibbles and 1 + 4's top bits
    assert record[320].item() == (packed[9] & 15) | (packed[1] >> 6) << 4
    assert record[336].item() == (packed[9] >> 4) | (packed[5] >> 6) << 4
    assert torch.equal(second[8 * 352:8 * 352 + 2], stored[:2]) and torch.equal(second[8 * 352 + 32:8 * 352 + 34],
                                                                               stored[2:4])
    _untiles_bit_for_bit(tiled, q)


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_q6_k_in_tiles_of_16_rows_keeps_every_byte(rows):
    """q6_kx16: per super-block, 8 records of a block's low 4 bits (int4x16's words), their high 2
    bits as two more words (bits 2t, 2t + 1 of byte e: element 4t + e, then 16 + 4t + e), the
    halves' signed scales; then the rows' d. Back to the file's super-blocks bit for bit."""
    q = _random_gguf("q6_k", rows, 512)
    tiled = tile_rows(q)
    assert tiled.data.shape == (-(-rows // 16), 16 * TILE_BLOCK_BYTES["q6_kx16"])
    stored = q.data[0, 210:420]  # row 0's second super-block: ql [128], qh [64], scales [16], d
    ql, qh = stored[:128].tolist(), stored[128:192].tolist()
    # element t of the first 128: ql[t % 64] (low nibble if t < 64), qh[t % 32] bits 2 (t // 32)
    code = lambda t: (ql[t % 64] >> 4 * (t // 64) & 15) | (qh[t % 32] >> 2 * (t // 32) & 3) << 4  # noqa: E731
    record = tiled.data[0, 8 * TILE_BLOCK_BYTES["q6_kx16"] + 416:][:416]  # its block 1: elements 32 .. 63
    assert record[64:68].tolist() == [code(32 + 4 + e) & 15 | (code(32 + 20 + e) & 15) << 4 for e in range(4)]
    assert record[256 + 64:256 + 68].tolist() == [sum((code(32 + 16 + 4 * t + e) >> 4) << 2 * t for t in range(4))
                                                  for e in range(4)]  # lane 0 of the second high-bits word
    assert record[384:385].tolist() == stored[192 + 2:192 + 3].tolist()  # sc of columns 32 .. 47
    assert record[400:401].tolist() == stored[192 + 3:192 + 4].tolist()
    assert tiled.data[0, 16 * TILE_BLOCK_BYTES["q6_kx16"] - 32:][:2].tolist() == stored[208:210].tolist()
    _untiles_bit_for_bit(tiled, q)


def _quantize_gguf(w: torch.Tensor, kind: str):
    """w in `kind` as the gguf package's quantizer writes it, loaded as brisk loads a file's blocks."""
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind.upper()])
    return from_gguf_blocks(kind, tuple(w.shape), torch.from_numpy(blocks.copy()))


def _random_gguf(kind: str, rows: int, cols: int):
    """Random blocks of `kind` (the gguf package quantizes no K-quant), loaded as a file's."""
    return from_gguf_blocks(kind, (rows, cols), random_gguf_blocks(kind, rows, cols, seed=rows))


def _untiles_bit_for_bit(tiled, q):
    """Back to q's format whole, every tensor equal (codes, and scales and minimums where it has
    them), and row by row."""
    back = untile_rows(tiled)
    for mine, theirs in ((back.data, q.data), (back.scales, q.scales), (back.mins, q.mins)):
        assert mine is None and theirs is None or torch.equal(mine, theirs)
    _same_rows(tiled, q)


def _same_rows(tiled, q):
    rows = q.shape[0]
    order = torch.tensor([rows - 1, 0, rows // 2])
    assert torch.equal(tiled.rows(order).dequantize(), q.dequantize()[order])
    assert torch.equal(tiled.dequantize(), q.dequantize())


def test_only_q8_0_the_k_quants_and_int4_or_int5_with_a_scale_per_block_tile():
    for q in (quantize(_weight((4, 128)), "int4", 64), quantize(_weight((4, 128)), "int8"),
              quantize(_weight((4, 45)), "int4", 32)):
        with pytest.raises(ValueError, match="only q8_0, the K-quants, and int4 or int5 with a scale per block of 32"):
            tile_rows(q)


def test_bad_requests_name_the_problem():
    with pytest.raises(ValueError, match="cannot quantize to 'int3'"):
        quantize(torch.zeros(2, 32), "int3")
    with pytest.raises(ValueError, match="group size"):
        quantize(torch.zeros(2, 32), "int4", 48)
    with pytest.raises(ValueError, match="only matrices"):
        quantize(torch.zeros(32), "int8")
