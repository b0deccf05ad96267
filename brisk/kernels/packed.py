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
GROUPED_FORMATS = ("int4", "nf4")  # a scale per group of GROUP_SIZES columns; the others per row or block
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


GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, cols] weight in one of the formats above."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor  # [rows, bytes per row]: int8 codes (int8), uint8 otherwise
    scales: torch.Tensor | None = None  # float32 [rows] (int8, fp8), float16 [rows, groups] (int4, nf4)
    mins: torch.Tensor | None = None  # float16 [rows, groups]: int4's zero points, as the value of code 0
    group_size: int = BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix this stands for."""
        rows, cols = self.shape
        if self.format == "q8_0":
            blocks = self.data.reshape(-1, GGUF_BLOCK_BYTES[self.format])
            return _GGUF_BLOCKS[self.format](blocks).view(rows, -1)[:, :cols]
        if self.format in ("int8", "fp8"):
            values = self.data.float() if self.format == "int8" else self.data.view(torch.float8_e4m3fn).float()
            return values * self.scales[:, None]
        codes = unpack_nibbles(self.data)[:, :cols].long()
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, :cols]
        if self.format == "nf4":
            return _nf4_values(self.data.device)[codes] * scales
        mins = self.mins.float().repeat_interleave(self.group_size, dim=1)[:, :cols]
        return codes.float() * scales + mins

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (a permutation, a lookup) in the same format."""
        index = index.to(self.data.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return replace(self, shape=(len(index), self.shape[1]), data=pick(self.data), scales=pick(self.scales),
                       mins=pick(self.mins))

    def to(self, device: torch.device) -> QuantizedTensor:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, data=move(self.data), scales=move(self.scales), mins=move(self.mins))

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Stacks the rows of same-format tensors (q, k and v into one fused weight)."""
        first = parts[0]
        if any((p.format, p.shape[1], p.group_size) != (first.format, first.shape[1], first.group_size) for p in parts):
            raise ValueError("only tensors of one format, width and group size can be stacked")
        join = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return replace(first, shape=(sum(p.shape[0] for p in parts), first.shape[1]),
                       data=join([p.data for p in parts]), scales=join([p.scales for p in parts]),
                       mins=join([p.mins for p in parts]))


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: [rows, 16 n] bytes -> uint8 codes [rows, 32 n]."""
    rows = packed.shape[0]
    blocks = packed.view(rows, -1, BLOCK // 2)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).reshape(rows, -1)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte `start` of every block, as a float16 column."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31 (ggml order)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1).float()


# [n_blocks, block bytes] -> [n_blocks, 32] float32, for the GGUF block formats.
_GGUF_BLOCKS = {
    "q8_0": lambda b: _half(b, 0).float() * b[:, 2:].contiguous().view(torch.int8).float(),
    "q4_0": lambda b: _half(b, 0).float() * (_nibbles(b[:, 2:]) - 8.0),
    "q4_1": lambda b: _half(b, 0).float() * _nibbles(b[:, 4:]) + _half(b, 2).float(),
}


def dequantize_gguf_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks of `kind` (q8_0, q4_0 or q4_1) [n_blocks, block bytes] -> float32 [n_blocks, 32]."""
    return _GGUF_BLOCKS[kind](blocks)
