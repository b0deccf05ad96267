"""LoRA adapters read from PEFT's format (brisk/model/lora.py) against PEFT itself: a random
adapter on every linear layer of a tiny float32 model, saved by PEFT, read onto our fused
projections, adds exactly what PEFT's merge_and_unload adds to each weight (plain and rsLoRA
scaling, and a family whose checkpoint fuses q/k/v itself); what brisk does not implement is a
LoRAError naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from brisk import LLM
from brisk.model.lora import CONFIG_FILE, PROJECTIONS, LoRAAdapter, LoRAError, projection_shape
from tests.conftest import build_lora_adapter, build_tiny_checkpoint

LINEAR = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
          "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def _peft_adapter(base: str, folder: str, architecture: str, **options):
    """A random rank-4 adapter of every linear layer saved by PEFT; returns the merged model."""
    return build_lora_adapter(base, folder, 1, r=4, lora_alpha=8, target_modules=LINEAR[architecture],
                              lora_dropout=0.1, **options)


def _hf_projection(merged, layer: int, projection: str, architecture: str) -> torch.Tensor:
    """One of our fused projections' weights, from the merged HF model's modules."""
    block = merged.model.layers[layer]
    parts = {"llama": {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                       "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}}.get(architecture, {})
    names = parts.get(projection, [projection])
    return torch.cat([block.get_submodule(n).weight.detach() for n in names])


@pytest.mark.parametrize("architecture, options", [("llama", {}), ("llama", {"use_rslora": True}), ("phi3", {})])
def test_an_adapter_adds_what_peft_merges(tmp_path, architecture, options):
    base = build_tiny_checkpoint(str(tmp_path / "base"), architecture)
    merged = _peft_adapter(base, str(tmp_path / "adapter"), architecture, **options)
    model = LLM(base, dtype="float32", quantization="none").engine.model
    adapter = LoRAAdapter.load("tuned", str(tmp_path / "adapter"), model)
    assert adapter.config.scaling == pytest.approx(8 / (2 if options else 4))
    assert len(adapter.shards) == model.hparams.num_layers * len(LINEAR[architecture])
    for layer, block in enumerate(model.layers):
        for projection in PROJECTIONS:
            ours = block.get_submodule(projection).weight.detach()
            delta = adapter.delta(layer, projection, *projection_shape(model, projection))
            torch.testing.assert_close(ours + delta, _hf_projection(merged, layer, projection, architecture),
                                       rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_and_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    base = build_tiny_checkpoint(str(folder / "base"), "llama")
    _peft_adapter(base, str(folder / "adapter"), "llama")
    return LLM(base, dtype="float32", quantization="none").engine.model, folder / "adapter"


@pytest.mark.parametrize("field, value", [("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all"),
                                          ("rank_pattern", {"q_proj": 8}), ("alpha_pattern", {"q_proj": 4}),
                                          ("fan_in_fan_out", True), ("peft_type", "IA3"), ("r", 0),
                                          ("target_modules", ["q_proj", "embed_tokens"]), ("lora_alpha", "big")])
def test_what_brisk_does_not_implement_is_refused_by_name(tiny_and_adapter, tmp_path, field, value):
    model, adapter = tiny_and_adapter
    config = json.loads((adapter / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**config, field: value}))
    (tmp_path / "adapter_model.safetensors").symlink_to(adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAError) as raised:
        LoRAAdapter.load("bad", str(tmp_path), model)
    assert raised.value.field == field


def test_a_folder_without_an_adapter_or_of_another_shape_is_refused(tiny_and_adapter, tmp_path):
    model, adapter = tiny_and_adapter
    with pytest.raises(LoRAError, match="adapter_config.json: not found"):
        LoRAAdapter.load("none", str(tmp_path), model)
    config = json.loads((adapter / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**config, "r": 8}))  # the tensors are rank 4
    (tmp_path / "adapter_model.safetensors").symlink_to(adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="do not fit a rank-8 update"):
        LoRAAdapter.load("wrong", str(tmp_path), model)
