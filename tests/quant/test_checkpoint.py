"""`brisk quantize`: the folder it writes loads back to the very model quantized at load time."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from brisk import LLM
from brisk.cli import main
from brisk.transport.client import ModelInfo
from brisk.model.loader import load_model, open_checkpoint
from brisk.sample.params import SamplingParams
from tests.conftest import build_tiny_checkpoint

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _same_weights(a, b) -> None:
    """Two models' HF-named weights, tensor by tensor (quantized ones by their stored parts)."""
    left, right = dict(a.hf_weights()), dict(b.hf_weights())
    assert left.keys() == right.keys()
    for name, x in left.items():
        y = right[name]
        assert type(x) is type(y), name
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert (x.format, x.shape, x.group_size) == (y.format, y.shape, y.group_size), name
            for part in ("data", "scales", "mins"):
                p, q = getattr(x, part), getattr(y, part)
                assert (p is None and q is None) or torch.equal(p, q), (name, part)


@pytest.fixture(scope="module")
def int4_folder(real_model_path, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("quantized") / "smollm2-int4-g64")
    assert main(["quantize", real_model_path, "--to", "int4", "--group-size", "64", "--out", out]) == 0
    return out


@pytest.mark.real_model
def test_quantized_folder_reloads_to_identical_outputs(real_model_path, int4_folder, capsys):
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    at_load = LLM(model=real_model_path, dtype="float32", quantization="int4", quantization_group_size=64)
    saved = LLM(model=int4_folder, dtype="float32")
    for a, b in zip(at_load.generate(PROMPTS, params), saved.generate(PROMPTS, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same numbers, not just the same argmax
    _same_weights(at_load.engine.model, saved.engine.model)
    assert ModelInfo.of(saved.engine).runtime_quantization == "int4"
    assert ModelInfo.of(saved.engine).quantization == "int4, groups of 64"


@pytest.mark.real_model
def test_quantized_folder_keeps_the_tokenizer_and_config(real_model_path, int4_folder):
    source, saved = open_checkpoint(real_model_path), open_checkpoint(int4_folder)
    assert saved.hparams == source.hparams
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <3, ünïcode?"}]
    assert saved.tokenizer.encode_chat(messages) == source.tokenizer.encode_chat(messages)
    assert saved.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    size = sum(os.path.getsize(os.path.join(int4_folder, f)) for f in os.listdir(int4_folder))
    assert size < 0.25 * 4 * 134_515_008  # under a quarter of the fp32 weights, tokenizer included


@pytest.mark.real_model
def test_quantized_folder_refuses_another_format(int4_folder, capsys):
    checkpoint = open_checkpoint(int4_folder)
    for quantization, group in (("int8", 32), ("int4", 128)):  # another format; the same one, other groups
        with pytest.raises(ValueError, match="stored in int4, groups of 64"):
            load_model(checkpoint, torch.float32, torch.device("cpu"), 16, quantization=quantization, group_size=group)
    load_model(checkpoint, torch.float32, torch.device("cpu"), 16, quantization="int4", group_size=64)  # as stored
    assert main(["quantize", int4_folder, "--to", "int8", "--out", int4_folder + "-again"]) == 2
    assert "already quantized (int4, groups of 64)" in capsys.readouterr().err


@pytest.mark.parametrize("architecture,method", [("qwen2", "int8"), ("llama", "nf4"), ("qwen3", "fp8")])
def test_every_format_and_architecture_round_trips(tmp_path, architecture, method):
    """Biases on fused q/k/v (qwen2), an untied head (llama), q/k norms (qwen3): every tensor the
    loader fills comes back equal."""
    source = build_tiny_checkpoint(str(tmp_path / "source"), architecture)
    out = str(tmp_path / "out")
    assert main(["quantize", source, "--to", method, "--out", out]) == 0
    before = load_model(open_checkpoint(source), torch.float32, torch.device("cpu"), 16, quantization=method)
    after = load_model(open_checkpoint(out), torch.float32, torch.device("cpu"), 16)
    _same_weights(before, after)


def test_a_folder_with_f32_group_scales_loads_as_f16(tmp_path):
    """brisk wrote int4's scales and minimums in f32 before they moved to f16: such a folder loads
    with them rounded to f16, which is what quantizing gives now (it rounds them before the codes)."""
    source = build_tiny_checkpoint(str(tmp_path / "source"), "llama")
    out = str(tmp_path / "out")
    assert main(["quantize", source, "--to", "int4", "--out", out]) == 0
    path = os.path.join(out, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    widened = {name: t.float() if name.endswith((".scales", ".mins")) else t for name, t in tensors.items()}
    assert any(t.dtype == torch.float16 for t in tensors.values())
    save_file(widened, path, metadata=metadata)
    before = load_model(open_checkpoint(source), torch.float32, torch.device("cpu"), 16, quantization="int4")
    after = load_model(open_checkpoint(out), torch.float32, torch.device("cpu"), 16)
    _same_weights(before, after)
    quantized = [w for _, w in after.hf_weights() if not isinstance(w, torch.Tensor) and w.format == "int4"]
    assert quantized and all(w.scales.dtype == w.mins.dtype == torch.float16 for w in quantized)


def test_quantize_refuses_a_folder_in_use_and_foreign_configs(tmp_path, capsys):
    source = build_tiny_checkpoint(str(tmp_path / "source"), "llama")
    assert main(["quantize", source, "--to", "int4", "--out", source]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert main(["quantize", source, "--to", "int4", "--out", os.path.join(source, "config.json")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(source, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        open_checkpoint(source)
