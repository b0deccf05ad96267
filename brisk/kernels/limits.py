"""What the host itself allows, measured by kernels/limits.c built as every other kernel is (for
the instruction set the process targets): memory read bandwidth, and the int8 dot-product peak
of the build's instruction set. `brisk bench scale` states its rows as fractions of them."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from brisk.kernels import cpu, isa


@dataclass(frozen=True)
class Limits:
    read_gb_s: float  # GB/s (10^9 bytes) read by every thread together
    int8_gmac_s: float  # int8 multiply-adds per second, in billions (0: the build has no SIMD int8 path)
    int8_sequence: str  # the instructions that peak was measured with
    threads: int


def _kernels() -> ctypes.CDLL:
    library = cpu._library("limits.c")
    if library is None:
        raise RuntimeError("measuring the host's limits needs a C compiler")
    return library


def read_bandwidth(gib: float = 1.0, passes: int = 5) -> float:
    """GB/s that torch's threads read together: the best of `passes` sums over a buffer of
    `gib` (far past the last-level cache), after one pass that pages it in."""
    words = torch.ones(int(gib * 2**30) // 8, dtype=torch.int64)
    sink = ctypes.c_int64()
    library = _kernels()
    library.read_words(words.data_ptr(), words.numel(), 1, ctypes.byref(sink))
    best = min(library.read_words(words.data_ptr(), words.numel(), 1, ctypes.byref(sink)) for _ in range(passes))
    return words.numel() * 8 / best / 1e9


def int8_dot_peak(iterations: int = 20_000_000, rounds: int = 3) -> tuple[float, str]:
    """The build's int8 multiply-adds per second in billions, best of `rounds`, and the
    instruction sequence that ran."""
    library = _kernels()
    macs, sink = ctypes.c_int64(), (ctypes.c_int32 * torch.get_num_threads())()
    best = 0.0
    for _ in range(rounds):
        seconds = library.int8_dot_peak(iterations, ctypes.byref(macs), sink)
        best = max(best, macs.value / seconds / 1e9)
    return best, _sequence()


def _sequence() -> str:
    flags, march = isa.cpu_flags(), isa.chosen().march
    if march == "native" and {"avx512_vnni", "avx512f"} <= flags:
        return "vpdpbusd zmm (AVX512-VNNI)"
    if march == "native" and "avx_vnni" in flags:
        return "vpdpbusd ymm (AVX-VNNI)"
    if "avx2" in flags or march == "x86-64-v3":
        return "vpmaddubsw + vpmaddwd + vpaddd ymm (AVX2)"
    return "none (no SIMD int8 path in this build)"


def measure() -> Limits:
    peak, sequence = int8_dot_peak()
    return Limits(read_bandwidth(), peak, sequence, torch.get_num_threads())


