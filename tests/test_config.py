"""EngineConfig's choices that depend on the machine at hand."""

from __future__ import annotations

import pytest
import torch

from brisk.config import EngineConfig
from brisk.kernels import cpu as cpu_kernels


@pytest.mark.parametrize("flags, expected", [
    ("avx avx2 fma", torch.float32),  # the AVX2-only EPYCs: bf16 would be emulated
    ("avx2 avx512f avx512_vnni", torch.float32),  # AVX-512 without its bf16 extension
    ("avx2 avx512f avx512_bf16 avx512_vnni", torch.bfloat16),  # Zen 4
    ("avx2 amx_bf16 amx_tile", torch.bfloat16),  # Sapphire Rapids' AMX
])
def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    assert EngineConfig(dtype="auto", device="cpu").torch_dtype == expected
    assert EngineConfig(dtype="float32", device="cpu").torch_dtype == torch.float32  # an explicit choice stands


def test_this_machine_reports_its_cpu_flags():
    assert cpu_kernels._cpu_flags()  # Linux: the flags line of /proc/cpuinfo
