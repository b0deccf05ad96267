"""Rotary position embeddings: cos/sin tables built once, looked up by position each step.

Rotation is rotate-half ("neox") style, as Hugging Face's Llama applies it; the C kernel that
writes K/V to the cache (kernels/attention.h) rotates with the same tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from brisk.model.hparams import HParams


def rope_inverse_frequencies(hparams: HParams, local: bool = False) -> torch.Tensor:
    """local: the sliding-window layers' frequencies where they have their own base (Gemma 3:
    hparams.local_rope_theta, never scaled; the scaling stretches the global layers' long range)."""
    dim = hparams.head_dim
    theta = hparams.local_rope_theta if local else hparams.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = None if local else hparams.rope_scaling_dict
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short kept."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, indexed by each token's position.
    local: the sliding-window layers' tables (rope_inverse_frequencies)."""

    def __init__(self, hparams: HParams, max_len: int, local: bool = False):
        super().__init__()
        self.hparams, self.max_len, self.local = hparams, max_len, local
        self.cos = self.signed_sin = None

    def build(self, device: torch.device) -> None:
        """Computes the fp32 tables; separate from __init__ so modules built on `meta` get real ones."""
        inv_freq = rope_inverse_frequencies(self.hparams, self.local)
        freqs = torch.outer(torch.arange(self.max_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        half = self.hparams.head_dim // 2
        # rotate_half(x) * sin == cat(x2, x1) * signed_sin with the sign folded into the table.
        signed_sin = torch.cat((-angles[:, :half].sin(), angles[:, half:].sin()), dim=-1)
        self.cos = angles.cos().float().to(device)
        self.signed_sin = signed_sin.float().to(device)

    def at(self, positions: torch.Tensor) -> "Rope":
        return Rope(self.cos, self.signed_sin, positions)


@dataclass
class Rope:
    """One step's rotary embedding, shared by every layer: the tables and each token's position."""

    cos: torch.Tensor  # [max_len, D] float32
    signed_sin: torch.Tensor  # [max_len, D] float32, rotate_half's sign folded in
    positions: torch.Tensor  # [T] int64
    _per_token: dict = field(default_factory=dict, repr=False, compare=False)

    def per_token(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [T, 1, D] in dtype; gathered on first use (torch path only)."""
        if dtype not in self._per_token:
            self._per_token[dtype] = (self.cos[self.positions].unsqueeze(1).to(dtype),
                                      self.signed_sin[self.positions].unsqueeze(1).to(dtype))
        return self._per_token[dtype]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by each token's position."""
        cos, signed_sin = self.per_token(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
