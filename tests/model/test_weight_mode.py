"""quantization auto, resolved once at load (model/loader.py: resolve_weight_mode): a GGUF file on
CPU keeps its blocks with int8 activations, anything else runs as "none"; flags that run the same
numbers resolve to equal modes, and int8 activations that the chosen weights cannot take are an
error naming the field."""

from __future__ import annotations

import logging

import pytest
import torch

from brisk import LLM
from brisk.config import ConfigError, EngineConfig
from brisk.model import loader
from brisk.kernels import isa
from brisk.model.loader import Checkpoint, Precision, WeightMode, resolve_precision, resolve_weight_mode
from brisk.quant.checkpoint import QuantizedLayout
from brisk.transport.client import ModelInfo
from tests.conftest import build_tiny_checkpoint

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # a device name only: nothing runs on it here


def _gguf(*kinds: str) -> Checkpoint:
    """What resolution reads of a GGUF file (no weights, no tokenizer): its matrices' kinds."""
    return Checkpoint("/models/m.Q4_1.gguf", "gguf", None, None, None, quantization="+".join(kinds),
                      matrix_kinds=kinds)


def _folder(layout: QuantizedLayout | None = None) -> Checkpoint:
    return Checkpoint("/models/m/", "hf", None, None, None, quantization=layout and str(layout), layout=layout)


def _resolve(checkpoint: Checkpoint, device=CPU, dtype=torch.bfloat16, **config) -> WeightMode:
    return resolve_weight_mode(EngineConfig(**config), checkpoint, device, dtype)


def test_auto_keeps_a_gguf_files_blocks_on_cpu_with_int8_activations():
    auto = _resolve(_gguf("Q4_1", "Q8_0"))
    assert auto == WeightMode("gguf", 32, True, "gguf+a8", "the file's Q4_1+Q8_0 blocks, int8 activations")
    assert auto == _resolve(_gguf("Q4_1", "Q8_0"), quantization="gguf", int8_activations=True)
    assert auto == _resolve(_gguf("Q4_1", "Q8_0"), int8_activations=True)  # asking for what auto does anyway


@pytest.mark.parametrize("flags, sixteen_bits", [("avx2 avx512f avx512_bf16", "bfloat16"), ("avx2 fma", "float16")])
def test_the_files_blocks_run_float32_activations_over_a_16_bit_cache(monkeypatch, flags, sixteen_bits):
    """As llama.cpp: the blocks hold the weights, activations are float32, the cache 16-bit (bf16
    where the CPU multiplies it); an explicit dtype or cache kind stands, and floats follow the
    fast dtype, their cache the dtype."""
    monkeypatch.setattr(isa, "host_flags", lambda: frozenset(flags.split()))
    monkeypatch.setenv(isa.ENV, "native")  # a host of these flags as it is, whatever BRISK_ISA this run has
    fast = torch.bfloat16 if sixteen_bits == "bfloat16" else torch.float32
    blocks = _gguf("Q4_1", "Q8_0")
    assert resolve_precision(EngineConfig(), blocks, CPU) == Precision(torch.float32, sixteen_bits)
    assert resolve_precision(EngineConfig(quantization="gguf"), blocks, CPU) == Precision(torch.float32, sixteen_bits)
    assert resolve_precision(EngineConfig(kv_cache_dtype="int8"), blocks, CPU) == Precision(torch.float32, "int8")
    assert resolve_precision(EngineConfig(dtype="bfloat16"), blocks, CPU) == Precision(torch.bfloat16, "bfloat16")
    dequantized = resolve_precision(EngineConfig(quantization="none"), blocks, CPU)
    assert dequantized == Precision(fast, str(fast).removeprefix("torch."))
    assert resolve_precision(EngineConfig(), _folder(), CPU) == dequantized
    assert resolve_precision(EngineConfig(), blocks, GPU) == Precision(torch.bfloat16, "bfloat16")


def test_auto_runs_floats_on_a_host_without_a_c_compiler(monkeypatch):
    """The blocks' integer products are C kernels; torch would dequantize them at every step."""
    from brisk.kernels import cpu

    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    assert _resolve(_gguf("Q4_1", "Q8_0")).name == "bfloat16 (dequantized)"


def test_auto_keeps_the_kinds_it_can_and_dequantizes_the_rest():
    mode = _resolve(_gguf("Q3_K", "Q4_K", "Q5_0", "Q6_K", "Q8_0", "IQ4_XS"))
    assert (mode.quantization, mode.name) == ("gguf", "gguf+a8")
    assert mode.weights == ("the file's Q4_K+Q5_0+Q6_K+Q8_0 blocks, its Q3_K+IQ4_XS matrices dequantized to "
                            "bfloat16, int8 activations")


def test_gguf_says_in_the_log_which_matrices_it_dequantizes_and_why(caplog):
    matrices = (("token_embd.weight", "Q8_0"), ("blk.0.attn_q.weight", "Q5_0"), ("blk.0.ffn_down.weight", "Q3_K"),
                ("blk.1.ffn_down.weight", "IQ4_XS"), ("blk.0.ffn_up.weight", "F16"))
    checkpoint = Checkpoint("/models/m.gguf", "gguf", None, None, None, matrix_tensors=matrices)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        loader._log_dequantized(checkpoint, torch.float32)
        loader._log_dequantized(Checkpoint("/models/m.gguf", "gguf", None, None, None, matrix_tensors=matrices[:2]),
                                torch.float32)
    assert [r.getMessage() for r in caplog.records] == [
        "m.gguf: 2 matrices stored as IQ4_XS+Q3_K are dequantized to float32, as brisk has no product for those "
        "kinds (it multiplies Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K blocks as stored): "
        "blk.0.ffn_down.weight, blk.1.ffn_down.weight"]


@pytest.mark.parametrize("checkpoint, device, name, weights", [
    (_gguf("Q4_1", "Q8_0"), GPU, "bfloat16 (dequantized)", "the file's Q4_1+Q8_0 dequantized to bfloat16"),
    (_gguf("F16"), CPU, "bfloat16 (dequantized)", "the file's F16 dequantized to bfloat16"),  # no blocks to keep
    (_folder(), CPU, "bfloat16", "the file's weights converted to bfloat16"),
])
def test_auto_elsewhere_is_none_the_weights_in_the_dtype(checkpoint, device, name, weights):
    auto = _resolve(checkpoint, device)
    assert auto == WeightMode(None, 32, False, name, weights)
    assert auto == _resolve(checkpoint, device, quantization="none")


def test_none_dequantizes_a_gguf_file_on_cpu_too():
    assert _resolve(_gguf("Q4_1", "Q8_0"), dtype=torch.float32, quantization="none") == WeightMode(
        None, 32, False, "float32 (dequantized)", "the file's Q4_1+Q8_0 dequantized to float32")


def test_explicit_modes_resolve_as_they_ask():
    assert _resolve(_gguf("Q4_1", "Q8_0"), quantization="w8a8") == _resolve(
        _gguf("Q4_1", "Q8_0"), quantization="int8", int8_activations=True)
    assert _resolve(_gguf("Q4_1", "Q8_0"), quantization="w8a8").name == "w8a8"
    assert _resolve(_gguf("Q4_1", "Q8_0"), quantization="gguf").name == "gguf"  # no int8 activations unasked
    int4 = _resolve(_folder(), quantization="int4", quantization_group_size=64, int8_activations=True)
    assert int4 == WeightMode("int4", 64, True, "int4+a8",
                              "the file's weights converted to int4, groups of 64 at load, int8 activations")


def test_a_quantized_folder_runs_as_stored():
    stored = _folder(QuantizedLayout("int4", 64))
    expected = WeightMode("int4", 64, False, "int4", "int4, groups of 64 as `brisk quantize` stored them")
    assert _resolve(stored) == _resolve(stored, quantization="none") == expected
    assert _resolve(stored, int8_activations=True).name == "int4+a8"


@pytest.mark.parametrize("checkpoint, device", [
    (_folder(), CPU),  # float weights
    (_gguf("Q4_1", "Q8_0"), GPU),  # dequantized on a GPU
    (_folder(QuantizedLayout("fp8", 32)), CPU),  # a format with no integer product
])
def test_int8_activations_that_auto_cannot_give_name_the_field(checkpoint, device):
    with pytest.raises(ConfigError, match="^int8_activations: quantization auto runs m"):
        _resolve(checkpoint, device, int8_activations=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


def test_a_safetensors_folder_loads_its_float_weights_by_default(tiny_folder):
    engine = LLM(tiny_folder, dtype="float32", num_kv_blocks=16, max_model_len=64).engine
    info = ModelInfo.of(engine)
    assert (info.runtime_quantization, info.weight_mode) == (None, "float32")
    assert engine.model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ConfigError, match="^int8_activations: .* as float32 on cpu"):
        LLM(tiny_folder, dtype="float32", int8_activations=True, num_kv_blocks=16, max_model_len=64)
