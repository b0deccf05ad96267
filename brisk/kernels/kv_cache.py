"""The KV cache's storage formats: what one layer's K and V blocks are made of.

Decode attention reads every cached key and value once per step, so at large batches and long
contexts the cache, not the weights, is the byte stream that bounds a step; and the cache's size
bounds how many tokens fit in memory. Storing it in fewer bits helps both:

| kv_cache_dtype | bytes per token and head (K + V, head dim 64) | stored as                        |
|----------------|----------------------------------------------:|----------------------------------|
| float32        | 512                                           | the values                       |
| bfloat16       | 256                                           | the values, rounded              |
| float16        | 256                                           | the values, rounded              |
| int8           | 136                                           | codes round(x / s), s = max|x| / 127: one float32 per token and head |

A per token and head scale (as vLLM's and llama.cpp's int8 caches) follows the outliers of
each head without a calibration pass. The C kernels (kernels/attention.h) read every format as
stored and fold int8's scales into the scores and the softmax weights; the torch methods here
are their reference and the path off CPU.

Layout, per layer: k [blocks, H_kv, D, B] (keys transposed per block), v [blocks, H_kv, B, D],
scales [blocks, H_kv, B] for int8 (see kernels/attention.py for why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.kernels.memory import huge_page_zeros

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
_FLOAT_KINDS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_token(kind: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take across all layers in a cache of this kind."""
    per_head = head_dim * _FLOAT_KINDS[kind].itemsize if kind in _FLOAT_KINDS else head_dim + 4  # int8: codes + scale
    return 2 * num_layers * num_kv_heads * per_head


@dataclass(eq=False)  # tensors: identity, not a generated element-wise __eq__
class KVCacheLayer:
    """One layer's K and V blocks in one storage kind (float32, bfloat16, float16 or int8)."""

    kind: str
    k: torch.Tensor  # [blocks, H_kv, D, B]
    v: torch.Tensor  # [blocks, H_kv, B, D]
    k_scales: torch.Tensor | None = None  # int8: [blocks, H_kv, B] float32, one per token and head
    v_scales: torch.Tensor | None = None

    @classmethod
    def allocate(cls, kind: str, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 device: torch.device) -> KVCacheLayer:
        if kind not in _FLOAT_KINDS and kind != "int8":
            raise ValueError(f"unknown KV cache kind {kind!r}: choose one of {', '.join(KV_CACHE_DTYPES[1:])}")
        dtype = _FLOAT_KINDS.get(kind, torch.int8)

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            if torch.device(device).type == "cpu":  # decode attention streams it: huge pages (kernels/memory.py)
                return huge_page_zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        k = zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype)
        v = zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
        if kind in _FLOAT_KINDS:
            return cls(kind, k, v)
        return cls(kind, k, v, zeros(num_blocks, num_kv_heads, block_size), zeros(num_blocks, num_kv_heads, block_size))

    @property
    def scaled(self) -> bool:
        return self.k_scales is not None

    @property
    def block_size(self) -> int:
        return self.v.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None]

    def write(self, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """k, v [T, H_kv, D]: token t's heads into slot offsets[t] of block blocks[t]."""
        if self.scaled:
            k, k_scales = _quantize_heads(k)
            v, v_scales = _quantize_heads(v)
            self.k_scales[blocks, :, offsets] = k_scales
            self.v_scales[blocks, :, offsets] = v_scales
        self.k[blocks, :, :, offsets] = k.to(self.k.dtype)
        self.v[blocks, :, offsets] = v.to(self.v.dtype)

    def copy_slots(self, src_blocks: torch.Tensor, src_offsets: torch.Tensor, dst_blocks: torch.Tensor,
                   dst_offsets: torch.Tensor) -> None:
        """Copies the K/V stored in slots src to slots dst, as stored (codes and scales alike):
        how the accepted branch of a draft tree moves next to the tokens before it."""
        self.k[dst_blocks, :, :, dst_offsets] = self.k[src_blocks, :, :, src_offsets]
        self.v[dst_blocks, :, dst_offsets] = self.v[src_blocks, :, src_offsets]
        if self.scaled:
            self.k_scales[dst_blocks, :, dst_offsets] = self.k_scales[src_blocks, :, src_offsets]
            self.v_scales[dst_blocks, :, dst_offsets] = self.v_scales[src_blocks, :, src_offsets]

    def keys(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The key blocks `blocks` (any index shape S) as [*S, H_kv, D, B] values in dtype."""
        keys = self.k[blocks].to(dtype)
        return keys * self.k_scales[blocks].unsqueeze(-2).to(dtype) if self.scaled else keys

    def values(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The value blocks `blocks` as [*S, H_kv, B, D] values in dtype."""
        values = self.v[blocks].to(dtype)
        return values * self.v_scales[blocks].unsqueeze(-1).to(dtype) if self.scaled else values


def _quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] -> int8 codes [T, H, D] and float32 scales [T, H]; all-zero heads get scale 0.
    The same float32 arithmetic as store_head_i8 (dtypes.h): equal codes but where -ffast-math's
    reordering moves a value across a rounding tie."""
    x = x.float()
    scales = x.abs().amax(dim=-1) * torch.tensor(1 / 127, dtype=torch.float32)
    inverse = torch.where(scales > 0, 1.0 / scales, 0.0)
    return torch.round(x * inverse.unsqueeze(-1)).to(torch.int8), scales
