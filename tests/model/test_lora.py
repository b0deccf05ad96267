"""LoRA adapters read from PEFT's format (brisk/model/lora.py) against PEFT itself: a random
adapter on every linear layer of a tiny float32 model, saved by PEFT, read onto our fused
projections, adds exactly what PEFT's merge_and_unload adds to each weight (plain and rsLoRA
scaling, and a family whose checkpoint fuses q/k/v itself); what brisk does not implement is a
LoRAError naming the field."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from brisk import LLM
from brisk.model.lora import CONFIG_FILE, PROJECTIONS, LoRAAdapter, LoRAError, projection_shape
from tests.conftest import build_lora_adapter, build_tiny_checkpoint
from tests.helpers import require

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
                                          ("target_modules", ["q_proj", "embed_tokens"]), ("lora_alpha", "big"),
                                          ("target_modules", 5), ("lora_alpha", float("nan")),
                                          ("lora_alpha", float("inf"))])
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


def test_damaged_adapter_files_are_refused_naming_what_is_wrong(tiny_and_adapter, tmp_path):
    """Each a LoRAError (the server's 400), never another exception (a 500)."""
    from safetensors.torch import load_file, save_file

    model, adapter = tiny_and_adapter
    config = (adapter / CONFIG_FILE).read_text()

    def folder(name: str, weights: bytes | None = None, config_text: str = config):
        (tmp_path / name).mkdir()
        (tmp_path / name / CONFIG_FILE).write_text(config_text)
        if weights is not None:
            (tmp_path / name / "adapter_model.safetensors").write_bytes(weights)
        return str(tmp_path / name)

    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))  # a tensor and a field promised
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = next(iter(tensors))
    save_file({**tensors, key: torch.full_like(tensors[key], float("nan"))}, str(tmp_path / "nan.safetensors"))
    cases = {str(tmp_path / "notes.txt"): ("lora_path", "neither a PEFT adapter's folder"),
             str(adapter / CONFIG_FILE): ("lora_path", "neither a PEFT adapter's folder"),
             str(tmp_path / "cut.gguf"): ("lora_path", "could not be read as a GGUF file"),
             folder("empty", b""): ("adapter_model.safetensors", "could not be read as safetensors"),
             folder("random", bytes(range(256)) * 4): ("adapter_model.safetensors", "could not be read"),
             folder("latin", b"", "\xff\xfe{"): (CONFIG_FILE, "is not JSON"),
             folder("nan", (tmp_path / "nan.safetensors").read_bytes()): ("adapter_model.safetensors", "not finite")}
    for path, (field, message) in cases.items():
        with pytest.raises(LoRAError, match=message) as raised:
            LoRAAdapter.load("bad", path, model)
        assert raised.value.field == field, path


# llama.cpp's LoRA GGUF files (convert_lora_to_gguf.py): the same adapter as the PEFT folder it
# was converted from, q and k's B rows in llama.cpp's rotary order in the file.
_GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down"}


def _write_gguf_lora(peft_folder, path: str, heads: int, kv_heads: int) -> None:
    """The PEFT adapter written as convert_lora_to_gguf.py writes it, with gguf's own writer."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((peft_folder / CONFIG_FILE).read_text())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key, tensor in sorted(load_file(str(peft_folder / "adapter_model.safetensors")).items()):
        module, half = key.removeprefix("base_model.model.model.").rsplit(".lora_", 1)
        layer, name = module.split(".", 2)[1:]
        if half.startswith("B") and name in ("self_attn.q_proj", "self_attn.k_proj"):
            n = heads if "q_proj" in name else kv_heads  # llama.cpp's permute: each head's halves interleaved
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).transpose(1, 2).reshape(tensor.shape)
        writer.add_tensor(f"blk.{layer}.{_GGUF_LAYER_NAMES[name]}.weight.lora_{half[0].lower()}",
                          tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _same_updates(model, first: LoRAAdapter, second: LoRAAdapter) -> None:
    for layer in range(model.hparams.num_layers):
        for projection in PROJECTIONS:
            shape = projection_shape(model, projection)
            torch.testing.assert_close(first.delta(layer, projection, *shape), second.delta(layer, projection, *shape),
                                       rtol=0, atol=0)


def test_a_llama_cpp_lora_gguf_is_the_adapter_it_was_converted_from(tiny_and_adapter, tmp_path):
    model, adapter = tiny_and_adapter
    path = str(tmp_path / "adapter.gguf")
    _write_gguf_lora(adapter, path, model.hparams.num_heads, model.hparams.num_kv_heads)
    converted = LoRAAdapter.load("gguf", path, model)
    assert converted.config.scaling == pytest.approx(8 / 4)
    _same_updates(model, LoRAAdapter.load("peft", str(adapter), model), converted)


def test_a_gguf_that_is_not_a_lora_adapter_is_refused(tiny_and_adapter, real_model_path):
    model, _ = tiny_and_adapter
    with pytest.raises(LoRAError, match="not a LoRA adapter") as raised:
        LoRAAdapter.load("model", real_model_path, model)
    assert raised.value.field == "lora_path"


@pytest.mark.llama_cpp
def test_llama_cpps_own_converter_writes_what_brisk_reads_as_the_peft_adapter(tiny_and_adapter, tmp_path):
    """convert_lora_to_gguf.py from the llama.cpp sources `make llama-cpp` unpacks."""
    import subprocess
    import sys
    from pathlib import Path

    model, adapter = tiny_and_adapter
    converter = Path(__file__).resolve().parents[2] / "build" / "llama.cpp-src" / "convert_lora_to_gguf.py"
    require(converter.exists(), "llama.cpp's sources (make llama-cpp)")
    path = str(tmp_path / "adapter.gguf")
    subprocess.run([sys.executable, str(converter), "--base", str(adapter.parent / "base"), "--outfile", path,
                    "--outtype", "f32", str(adapter)], check=True, capture_output=True)
    _same_updates(model, LoRAAdapter.load("peft", str(adapter), model), LoRAAdapter.load("gguf", path, model))
