"""Counter-based random numbers: one uniform per (seed, position), computed for a batch at once.

A seeded request must produce the same tokens whatever else shares its batch, and after a
preemption that recomputes it. A generator object per request gives that, but it is stateful
(a recompute would have to rewind it) and costs one generator call per row per step. A counter-
based stream has no state: the uniform for the token at output position `n` of a request with
seed `s` is a pure function `u(s, n)`, evaluated for the whole batch as a few integer tensor ops.

The function is SplitMix64 (Steele, Lea & Flood, 2014), which is itself counter-based: output n
of the stream with seed s is mix(s' + (n + 1) * GAMMA). The seed is first mixed (s' = mix(s)) so
that nearby seeds give unrelated streams rather than shifted copies of one another.

torch has no unsigned 64-bit shifts, so the arithmetic runs on int64 with wrapping multiplies
and logical shifts made by masking; the tests check it bit for bit against Python integers.
"""

from __future__ import annotations

import torch

_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - 2**64 if value >= 2**63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def to_int64(seed: int) -> int:
    """A seed anywhere in [-2**63, 2**64) as the int64 with the same low 64 bits."""
    return _signed(seed % 2**64)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 seeds and positions [B] -> float64 uniforms in [0, 1), one per row (53 random bits)."""
    x = _mix(seeds) + (positions + 1) * _signed(_GAMMA)
    return _shift_right(_mix(x), 11).double() * 2.0**-53
