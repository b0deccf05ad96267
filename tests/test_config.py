"""EngineConfig's choices that depend on the machine at hand; ServerConfig's names and flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from brisk.args import add_config_arguments, config_flags, config_from_args
from brisk.config import ConfigError, EngineConfig, ServerConfig
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


def test_served_model_name_takes_one_name_or_several_aliases():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ServerConfig, "server options")
    config = config_from_args(ServerConfig, parser.parse_args(["--served-model-name", "a", "org/b"]))
    assert config.served_model_name == ["a", "org/b"]
    assert config_from_args(ServerConfig, parser.parse_args(config_flags(config))) == config  # flags round-trip
    assert ServerConfig(served_model_name="a").served_model_name == ["a"]
    assert ServerConfig().served_model_name is None
    for names in ([], ["a", ""], ["a", "a"]):
        with pytest.raises(ConfigError, match="served_model_name"):
            ServerConfig(served_model_name=names)
