"""The kernel backend is chosen once per model, and config's names are the layers' own
(tests/test_rooms.py checks that the kernels and config import nothing above them)."""

from __future__ import annotations

import pytest
import torch

from brisk import config
from brisk.kernels import cpu as cpu_kernels
from brisk.kernels import isa
from brisk.kernels.backend import KernelBackend, choose_backend, fast_dtype
from brisk.kernels.kv_cache import KV_CACHE_DTYPES
from brisk.kernels.packed import GROUP_SIZES
from brisk.quant.modules import METHODS
from tests.helpers import require_c_compiler

def test_the_names_config_accepts_are_the_layers_own():
    assert config.KV_CACHE_DTYPES == KV_CACHE_DTYPES
    assert config.GROUP_SIZES == GROUP_SIZES
    assert config.QUANTIZATION_METHODS == METHODS


def test_each_device_gets_its_backend():
    require_c_compiler()
    assert type(choose_backend(torch.device("cpu"))) is cpu_kernels.CBackend
    assert type(choose_backend(torch.device("meta"))) is KernelBackend  # neither a compiler's nor Triton's


@pytest.mark.parametrize("flags, expected", [
    ("avx avx2 fma", torch.float32),  # the AVX2-only EPYCs: bf16 would be emulated
    ("avx2 avx512f avx512_vnni", torch.float32),  # AVX-512 without its bf16 extension
    ("avx2 avx512f avx512_bf16 avx512_vnni", torch.bfloat16),  # Zen 4
    ("avx2 amx_bf16 amx_tile", torch.bfloat16),  # Sapphire Rapids' AMX
])
def test_the_fast_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(isa, "host_flags", lambda: frozenset(flags.split()))  # the host, not a kernel choice
    monkeypatch.setenv(isa.ENV, "native")  # a host of these flags as it is, whatever BRISK_ISA this run has
    assert fast_dtype(torch.device("cpu")) == expected
    assert fast_dtype(torch.device("cuda")) == torch.bfloat16


def test_every_layer_runs_in_the_models_backend(tiny_model_dir):
    from brisk.model.loader import load_model, open_checkpoint
    from brisk.quant.modules import QuantizedWeight

    model = load_model(open_checkpoint(tiny_model_dir), torch.float32, torch.device("cpu"), 16, quantization="int8",
                       kernels=KernelBackend())
    holders = [m for m in model.modules() if hasattr(m, "kernels")]
    assert any(isinstance(m, QuantizedWeight) for m in holders)  # layers quantized after loading too
    assert {type(m.kernels) for m in holders} == {KernelBackend}
    layered = cpu_kernels.CBackend(fuse_decode=False)
    model.use_kernels(layered)
    assert all(m.kernels is layered for m in holders) and model.kernels is layered
