"""Packed low-bit weights as the kernels read them: the QuantizedTensor layout, its constants
and its torch dequantization (the reference the kernels are tested against). The quantizers that
write them live in quant/formats.py, which documents every format.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

BLOCK = 32
GROUP_SIZES = (32, 64, 128)
# a scale per group of GROUP_SIZES columns (int5: 32 only); the others per row or block
GROUPED_FORMATS = ("int4", "nf4", "int5")
# The 16 quantiles of N(0, 1), normalized to [-1, 1]: bitsandbytes' NF4 table (functional.py).
NF4_VALUES = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])


@functools.cache
def _nf4_values(device: torch.device) -> torch.Tensor:
    """NF4_VALUES on `device`, copied once: a copy per matmul would break CUDA graph capture."""
    return NF4_VALUES.to(device)


# The GGUF block kinds whose values brisk multiplies as stored, and their bytes per block (of 32
# weights; the K-quants' super-blocks of 256). The others are dequantized at load.
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176,
                    "q6_k": 210}
K_QUANTS = ("q4_k", "q5_k", "q6_k")  # kept as the file's blocks: [rows, cols / 256 * block bytes]
INT5_BLOCK_BYTES = 20  # an int5 block's codes: u32 of fifth bits, then 16 bytes of nibbles
# int4x16, int5x16 and q8_0x16: int4 with a scale per block, int5 and GGUF's Q8_0 with their rows
# interleaved in tiles of TILE_ROWS for the CPU's integer products (kernels/quant.h, "tiles of 16
# rows"): per tile and block, the 16 rows' codes as words of 4 bytes, word-major (q8_0's + 128;
# int5's fifth bits a word after the nibbles, bit t of byte e for element 4t + e), then their f16
# scales (and int4's and int5's minimums).
TILE_ROWS = 16
TILED = {"int4": "int4x16", "int5": "int5x16", "q8_0": "q8_0x16", "q4_k": "q4_kx16", "q5_k": "q5_kx16",
         "q6_k": "q6_kx16"}
K_BLOCKS = 8  # blocks of 32 in a K-quant super-block
# words of 4 code bytes per row and block
_TILE_WORDS = {"int4x16": 4, "int5x16": 5, "q8_0x16": 8, "q4_kx16": 4, "q5_kx16": 5, "q6_kx16": 6}
# bytes per block of a tile (a K-quant's: a share of its super-block's, 8 blocks' records of codes and
# two bytes of scales per row, then the f16 super-block scales: Q4_K's d and dmin, Q6_K's d)
TILE_BLOCK_BYTES = {"int4x16": TILE_ROWS * (BLOCK // 2 + 4), "int5x16": TILE_ROWS * (INT5_BLOCK_BYTES + 4),
                    "q8_0x16": TILE_ROWS * (BLOCK + 2),
                    **{k: TILE_ROWS * (4 * _TILE_WORDS[k] + 2) + halves * 2 * TILE_ROWS // K_BLOCKS
                       for k, halves in (("q4_kx16", 2), ("q5_kx16", 2), ("q6_kx16", 1))}}


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, cols] weight in one of the formats above."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor  # [rows, bytes per row]: int8 codes (int8), uint8 otherwise (tiled: [tiles, bytes per tile])
    scales: torch.Tensor | None = None  # float32 [rows] (int8, fp8), float16 [rows, groups] (int4, nf4)
    mins: torch.Tensor | None = None  # float16 [rows, groups]: int4's zero points, as the value of code 0
    group_size: int = BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix this stands for."""
        rows, cols = self.shape
        if self.format in TILE_BLOCK_BYTES:
            return untile_rows(self).dequantize()
        if self.format in ("q8_0", *K_QUANTS):
            blocks = self.data.reshape(-1, GGUF_BLOCK_BYTES[self.format])
            return _GGUF_BLOCKS[self.format](blocks).view(rows, -1)[:, :cols]
        if self.format in ("int8", "fp8"):
            values = self.data.float() if self.format == "int8" else self.data.view(torch.float8_e4m3fn).float()
            return values * self.scales[:, None]
        codes = (unpack_int5(self.data) if self.format == "int5" else unpack_nibbles(self.data))[:, :cols].long()
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, :cols]
        if self.format == "nf4":
            return _nf4_values(self.data.device)[codes] * scales
        mins = self.mins.float().repeat_interleave(self.group_size, dim=1)[:, :cols]
        return codes.float() * scales + mins

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (a permutation, a lookup) in the same format (a tiled one's: untiled)."""
        if self.format in TILE_BLOCK_BYTES:
            return untile_rows(self, index)
        index = index.to(self.data.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return replace(self, shape=(len(index), self.shape[1]), data=pick(self.data), scales=pick(self.scales),
                       mins=pick(self.mins))

    def to(self, device: torch.device) -> QuantizedTensor:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, data=move(self.data), scales=move(self.scales), mins=move(self.mins))

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Stacks the rows of same-format tensors (q, k and v into one fused weight); `stack`
        takes tensors of any formats."""
        first = parts[0]
        if first.format == "mixed" or any(
                (p.format, p.shape[1], p.group_size) != (first.format, first.shape[1], first.group_size) for p in parts):
            raise ValueError("only tensors of one format, width and group size can be stacked")
        join = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return replace(first, shape=(sum(p.shape[0] for p in parts), first.shape[1]),
                       data=join([p.data for p in parts]), scales=join([p.scales for p in parts]),
                       mins=join([p.mins for p in parts]))


@dataclass(frozen=True)
class MixedTensor(QuantizedTensor):
    """A [rows, cols] weight whose row ranges are stored in different formats: a fused projection
    whose shards a GGUF file stores differently (Gemma 3's q and k in Q5_0, v in Q8_0). Each part
    keeps its own format; the kernels multiply each into its columns of the output, and the
    dequantized matrix is the parts' stacked. `data` is empty: the parts hold the codes."""

    parts: tuple[QuantizedTensor, ...] = ()

    @staticmethod
    def of(parts: list[QuantizedTensor]) -> MixedTensor:
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("the parts of one weight must have one width")
        empty = torch.empty(0, dtype=torch.uint8, device=parts[0].data.device)
        return MixedTensor("mixed", (sum(p.shape[0] for p in parts), parts[0].shape[1]), empty, parts=tuple(parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index`, each run of rows from one part in that part's format."""
        index = index.to(self.data.device)
        ends = torch.tensor([p.shape[0] for p in self.parts], device=index.device).cumsum(0)
        owner = torch.bucketize(index, ends, right=True)
        owners, counts = torch.unique_consecutive(owner, return_counts=True)
        pieces, at = [], 0
        for p, count in zip(owners.tolist(), counts.tolist()):
            first_row = ends[p] - self.parts[p].shape[0]
            pieces.append(self.parts[p].rows(index[at:at + count] - first_row))
            at += count
        return stack(pieces)

    def to(self, device: torch.device) -> MixedTensor:
        return MixedTensor.of([p.to(device) for p in self.parts])


def stack(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Row blocks in order as one weight: neighbours of one format (and group size) concatenated,
    and a MixedTensor of the runs where the formats differ. A run of one shard is copied too, as
    `cat` copies: the loader's tensors then die as loading goes (kept until the model moved to
    huge pages, they left 64 MB more resident on the default model)."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, MixedTensor) else (p,))]
    runs = [[flat[0]]]
    for part in flat[1:]:
        if (part.format, part.group_size) == (runs[-1][-1].format, runs[-1][-1].group_size):
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [QuantizedTensor.cat(run) for run in runs]
    return joined[0] if len(joined) == 1 else MixedTensor.of(joined)


def tiles_rows(weight: QuantizedTensor) -> bool:
    """Whether `weight` has a tiled layout (TILED): Q8_0 or a K-quant, or int4/int5 with a scale
    per block of 32 and rows of whole blocks."""
    return (weight.format in ("q8_0", *K_QUANTS) or weight.format in ("int4", "int5") and weight.group_size == BLOCK
            and weight.shape[1] % BLOCK == 0)


def tile_rows(weight: QuantizedTensor) -> QuantizedTensor:
    """int4, int5, q8_0 or a K-quant (tiles_rows) -> TILED[format]: the same codes and scales
    (q8_0's codes + 128, int5's and q5_k's fifth bits and q6_k's high two regrouped by word, the
    K-quants' nibbles paired per block and q4_k's and q5_k's 6-bit scales as bytes), rows
    interleaved by TILE_ROWS, the last tile padded with zero rows. kernels/quant.h, "tiles of 16
    rows", has the layouts."""
    if not tiles_rows(weight):
        raise ValueError(f"only q8_0, the K-quants, and int4 or int5 with a scale per block of {BLOCK} and rows of whole "
                         f"blocks, can be tiled, not {weight.format} (group {weight.group_size}, {weight.shape[1]} "
                         "columns)")
    rows, cols = weight.shape
    blocks, tiles = cols // BLOCK, -(-rows // TILE_ROWS)
    # per block: the codes in words of 4 bytes, then fields of one value per row [rows, blocks, 1, bytes]
    each = lambda t, width: t.reshape(rows, -1, 1, width)  # noqa: E731
    halves = lambda t: each(t.to(torch.float16).view(torch.uint8), 2)  # noqa: E731
    if weight.format == "q8_0":
        stored = weight.data.view(rows, blocks, GGUF_BLOCK_BYTES["q8_0"])
        codes, fields = stored[:, :, 2:] ^ 0x80, [each(stored[:, :, :2], 2)]
    elif weight.format in ("q4_k", "q5_k"):
        stored = weight.data.view(rows, -1, GGUF_BLOCK_BYTES[weight.format])
        pairs = _bit_planes(stored[:, :, -128:].reshape(-1, 4, 32), 4).reshape(rows, blocks, 2, 16)
        codes = pairs[:, :, 0] | pairs[:, :, 1] << 4  # element t low, t + 16 high, as int4's
        if weight.format == "q5_k":  # bit k of qh[l]: block k's element l -> a word of fifth bits, as int5x16's
            fifth = _bit_planes(stored[:, :, 16:48].reshape(-1, 1, 32), 1).reshape(rows, blocks, 32)
            codes = torch.cat([codes, _word_bits(fifth)], dim=2)
        fields = [each(t, 1) for t in _k_scale_bytes(stored[:, :, 4:16].reshape(-1, 12))]
        head = [stored[:, :, 0:2], stored[:, :, 2:4]]
    elif weight.format == "q6_k":
        stored = weight.data.view(rows, -1, GGUF_BLOCK_BYTES["q6_k"])
        values = _q6_k_codes(stored.reshape(-1, GGUF_BLOCK_BYTES["q6_k"])).view(rows, blocks, 2, 16)
        high = (values >> 4).view(rows, blocks, 2, 4, 4)  # [.., half, word t, byte e]: 2 bits each
        planes = (high << torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]).sum(3, dtype=torch.uint8)
        codes = torch.cat([(values[:, :, 0] & 15) | (values[:, :, 1] & 15) << 4, planes.view(rows, blocks, 8)], dim=2)
        scales = stored[:, :, 192:208].reshape(rows, blocks, 2)  # a signed byte per 16 columns
        fields = [each(scales[:, :, 0], 1), each(scales[:, :, 1], 1)]
        head = [stored[:, :, 208:210]]
    else:
        codes = weight.data.view(rows, blocks, -1)
        if weight.format == "int5":  # {u32 fifth bits, nibbles} -> {nibbles, fifth bits by word}
            codes = torch.cat([codes[:, :, 4:], _fifth_bits_by_word(codes[:, :, :4])], dim=2)
        fields = [halves(weight.scales), halves(weight.mins)]
    data = torch.cat([_to_lanes(f, tiles) for f in (codes.reshape(rows, blocks, -1, 4), *fields)], dim=2)
    if weight.format in K_QUANTS:  # [tiles, blocks, record] -> [tiles, supers, 8 records, then the f16 scales]
        supers = stored.shape[1]
        data = torch.cat([data.view(tiles, supers, -1), *(_to_lanes(each(h, 2), tiles) for h in head)], dim=2)
    return QuantizedTensor(TILED[weight.format], weight.shape, data.reshape(tiles, -1).contiguous(), group_size=BLOCK)


def untile_rows(weight: QuantizedTensor, index: torch.Tensor | None = None) -> QuantizedTensor:
    """The inverse of tile_rows: the rows `index` (default all) untiled, gathered from their tiles."""
    rows, cols = weight.shape
    index = (torch.arange(rows) if index is None else index).to(weight.data.device)
    tile, lane, n = index // TILE_ROWS, index % TILE_ROWS, len(index)
    blocks = cols // BLOCK
    lanes = lambda part, width: _from_lanes(part, width, tile, lane)  # noqa: E731  [n, blocks, fields, width]
    if weight.format in ("q4_kx16", "q5_kx16", "q6_kx16"):
        supers, code_bytes = blocks // K_BLOCKS, 4 * _TILE_WORDS[weight.format]
        data = weight.data.view(-1, supers, TILE_BLOCK_BYTES[weight.format] * K_BLOCKS)
        record = TILE_ROWS * (code_bytes + 2)
        body = data[:, :, :K_BLOCKS * record].reshape(-1, blocks, record)
        codes = lanes(body[:, :, :TILE_ROWS * code_bytes], 4).reshape(n, supers, K_BLOCKS, code_bytes)
        nibbles = codes[..., :16]
        low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3)  # [n, supers, blocks, 32]: each code's low 4 bits
        first, second = (lanes(body[:, :, a:a + TILE_ROWS], 1).reshape(n, supers, K_BLOCKS)
                         for a in (TILE_ROWS * code_bytes, TILE_ROWS * (code_bytes + 1)))
        halves = [lanes(data[:, :, a:a + 2 * TILE_ROWS], 2).reshape(n, supers, 2)
                  for a in range(K_BLOCKS * record, data.shape[2], 2 * TILE_ROWS)]
        if weight.format in ("q4_kx16", "q5_kx16"):
            qs = (low[:, :, 0::2] | low[:, :, 1::2] << 4).reshape(n, supers, 128)  # blocks 2k low, 2k + 1 high
            packed = _k_scales_packed(first.reshape(-1, K_BLOCKS), second.reshape(-1, K_BLOCKS)).view(n, supers, 12)
            qh = []
            if weight.format == "q5_kx16":  # the fifth bits back to bit k of qh[l]
                by_block = _element_bits(codes[..., 16:20])  # [n, supers, block k, element l]
                qh = [(by_block << torch.arange(K_BLOCKS, dtype=torch.uint8)[:, None]).sum(2, dtype=torch.uint8)]
            stored = torch.cat([*halves, packed, *qh, qs], dim=2)
        else:
            planes = codes[..., 16:].reshape(n, supers, K_BLOCKS, 2, 1, 4)  # [.., half, word t, byte e]
            high = (planes >> torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]) & 3
            values = (low | high.reshape(n, supers, K_BLOCKS, 32) << 4).reshape(-1, 256)
            scales = torch.stack([first, second], dim=3).reshape(n, supers, 16)
            stored = torch.cat([_q6_k_packed(values).view(n, supers, -1), scales, halves[0]], dim=2)
        return QuantizedTensor(weight.format[:4], (n, cols), stored.reshape(n, -1))
    words = _TILE_WORDS[weight.format]
    data = weight.data.view(-1, blocks, TILE_BLOCK_BYTES[weight.format])
    at = TILE_ROWS * words * 4  # where the scales start
    codes = lanes(data[:, :, :at], 4).reshape(n, blocks, -1)
    halves = [lanes(data[:, :, a:a + 2 * TILE_ROWS], 2).reshape(n, blocks, 2)  # scales, and int4's/int5's minimums
              for a in range(at, data.shape[2], 2 * TILE_ROWS)]
    if weight.format == "q8_0x16":
        return QuantizedTensor("q8_0", (n, cols), torch.cat([halves[0], codes ^ 0x80], dim=2).reshape(n, -1))
    scales, mins = (h.reshape(n, -1).view(torch.float16) for h in halves)
    if weight.format == "int5x16":
        codes = torch.cat([_fifth_bits_by_element(codes[:, :, 16:]), codes[:, :, :16]], dim=2)
    return QuantizedTensor(weight.format[:4], (n, cols), codes.reshape(n, -1), scales, mins, group_size=BLOCK)


def _to_lanes(field: torch.Tensor, tiles: int) -> torch.Tensor:
    """[rows, n, k, width] (k words of `width` bytes per row and block) -> [tiles, n, k * 16 *
    width]: per tile and block, word-major, the tile's 16 rows side by side in each word (rows past
    the last padded with zeros)."""
    rows, n, k, width = field.shape
    field = torch.nn.functional.pad(field, (0, 0, 0, 0, 0, 0, 0, tiles * TILE_ROWS - rows))
    return field.view(tiles, TILE_ROWS, n, k, width).permute(0, 2, 3, 1, 4).reshape(tiles, n, -1)


def _from_lanes(part: torch.Tensor, width: int, tile: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """The inverse of _to_lanes for rows (tile, lane): [tiles, n, k * 16 * width] -> [rows, n, k, width]."""
    tiles, n = part.shape[:2]
    return part.reshape(tiles, n, -1, TILE_ROWS, width)[tile, :, :, lane]


def _word_bits(bits: torch.Tensor) -> torch.Tensor:
    """A block's fifth bits [..., 32] (0 or 1, element order) -> int5x16's word of them [..., 4]:
    byte e holds element 4t + e in bit t."""
    by_word = bits.unflatten(-1, (8, 4)).transpose(-1, -2)  # [..., e, t]: element 4t + e
    return (by_word << torch.arange(8, dtype=torch.uint8, device=bits.device)).sum(-1, dtype=torch.uint8)


def _element_bits(word: torch.Tensor) -> torch.Tensor:
    """The inverse of _word_bits: [..., 4] -> [..., 32]."""
    bits = (word[..., None] >> torch.arange(8, dtype=torch.uint8, device=word.device)) & 1  # [..., e, t]
    return bits.transpose(-1, -2).flatten(-2)


def _fifth_bits_by_word(high: torch.Tensor) -> torch.Tensor:
    """int5's [..., 4] bytes of fifth bits (bit e: element e) -> int5x16's word (_word_bits)."""
    bits = (high[..., None] >> torch.arange(8, dtype=torch.uint8, device=high.device)) & 1  # [..., byte, bit]
    return _word_bits(bits.flatten(-2))


def _fifth_bits_by_element(fifth: torch.Tensor) -> torch.Tensor:
    """The inverse of _fifth_bits_by_word."""
    by_element = _element_bits(fifth).unflatten(-1, (4, 8))  # [..., byte, bit]
    return (by_element << torch.arange(8, dtype=torch.uint8, device=fifth.device)).sum(-1, dtype=torch.uint8)


def _k_scale_bytes(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [n, 12] -> the 8 blocks' 6-bit scales and minimums [n, 8] as bytes."""
    d, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    return (torch.cat((d & 63, (both & 15) | ((d >> 2) & 48)), dim=1),
            torch.cat((m & 63, (both >> 4) | ((m >> 2) & 48)), dim=1))


def _k_scales_packed(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The inverse of _k_scale_bytes: [n, 8] scales and minimums (6 bits) -> [n, 12] bytes."""
    return torch.cat((scales[:, :4] | (scales[:, 4:] >> 4) << 6, mins[:, :4] | (mins[:, 4:] >> 4) << 6,
                      (scales[:, 4:] & 15) | (mins[:, 4:] & 15) << 4), dim=1)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: [rows, 16 n] bytes -> uint8 codes [rows, 32 n]."""
    rows = packed.shape[0]
    blocks = packed.view(rows, -1, BLOCK // 2)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).reshape(rows, -1)


def unpack_int5(packed: torch.Tensor) -> torch.Tensor:
    """int5's [rows, 20 n] bytes -> uint8 codes [rows, 32 n] in 0..31 (quant/formats.py)."""
    blocks = packed.view(packed.shape[0], -1, INT5_BLOCK_BYTES)
    return _with_fifth_bit(blocks[..., 4:], blocks[..., :4]).reshape(packed.shape[0], -1)


def _with_fifth_bit(nibbles: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """[..., 16] nibble bytes and [..., 4] bytes of fifth bits (bit t: element t) -> [..., 32]."""
    bits = (high[..., None] >> torch.arange(8, dtype=torch.uint8, device=high.device)) & 1
    return torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1) | (bits.flatten(-2) << 4)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte `start` of every block, as a float16 column."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31 (ggml order)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1).float()


def _q5(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1 codes (their u32 of fifth bits at `start`, the nibbles after) as floats [n, 32]."""
    return _with_fifth_bit(blocks[:, start + 4:], blocks[:, start:start + 4]).float()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> the 8 blocks' 6-bit scales and minimums [n, 8] (quant.h's layout)."""
    return tuple(t.float() for t in _k_scale_bytes(packed))


def _bit_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, c, b] bytes -> [n, c, 8 / bits, b]: plane p holds each byte's bits p * bits onward."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return (packed[:, :, None, :] >> shifts[:, None]) & ((1 << bits) - 1)


def _q4_k(b: torch.Tensor, fifth: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_K (and, with its qh bytes, Q5_K) super-blocks -> [n, 256]: per block d sc q - dmin m."""
    n = len(b)
    scales, mins = _k_scales(b[:, 4:16])
    codes = _bit_planes(b[:, -128:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    if fifth is not None:
        codes = codes | (_bit_planes(fifth.reshape(n, 1, 32), 1).reshape(n, 8, 32) << 4)
    d = (_half(b, 0).float() * scales)[:, :, None]
    return (d * codes.float() - (_half(b, 2).float() * mins)[:, :, None]).reshape(n, 256)


def _q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks -> their codes [n, 256] in 0..63 (uint8)."""
    n = len(b)
    low = _bit_planes(b[:, :128].reshape(n, 2, 64), 4).reshape(n, 256)
    return low | _bit_planes(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 256) << 4


def _q6_k_packed(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of _q6_k_codes for the codes: [n, 256] -> Q6_K's ql [n, 128] and qh [n, 64]."""
    n = len(codes)
    halves = codes.view(n, 2, 4, 32)  # [n, half of 128, quarter, 32]
    low = halves & 15
    ql = (low[:, :, 0:2] | low[:, :, 2:4] << 4).reshape(n, 128)  # quarters 0, 1 low; 2, 3 high
    high = halves >> 4
    qh = (high << torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]).sum(2, dtype=torch.uint8).reshape(n, 64)
    return torch.cat([ql, qh], dim=1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks -> [n, 256]: per 16 columns d sc (q - 32)."""
    n = len(b)
    codes = (_q6_k_codes(b).to(torch.int16) - 32).float().view(n, 16, 16)
    d = _half(b, 208).float() * b[:, 192:208].contiguous().view(torch.int8).float()
    return (d[:, :, None] * codes).reshape(n, 256)


# [n_blocks, block bytes] -> [n_blocks, 32 or 256] float32, for the GGUF block formats: ggml's own
# formulas in float32, operation for operation, so the values are the `gguf` package's exactly.
_GGUF_BLOCKS = {
    "q8_0": lambda b: _half(b, 0).float() * b[:, 2:].contiguous().view(torch.int8).float(),
    "q4_0": lambda b: _half(b, 0).float() * (_nibbles(b[:, 2:]) - 8.0),
    "q4_1": lambda b: _half(b, 0).float() * _nibbles(b[:, 4:]) + _half(b, 2).float(),
    "q5_0": lambda b: _half(b, 0).float() * (_q5(b, 2) - 16.0),
    "q5_1": lambda b: _half(b, 0).float() * _q5(b, 4) + _half(b, 2).float(),
    "q4_k": _q4_k,
    "q5_k": lambda b: _q4_k(b, b[:, 16:48]),
    "q6_k": _q6_k,
}


def dequantize_gguf_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks of `kind` (a GGUF_BLOCK_BYTES key) [n_blocks, block bytes] -> float32
    [n_blocks, 32], or [n_blocks, 256] for the K-quants."""
    return _GGUF_BLOCKS[kind](blocks)
