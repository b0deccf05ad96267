"""GGUF parsing: files written by the `gguf` package's own GGUFWriter, read back by brisk's parser.

Metadata must come back with exact values and types, tensors in HF orientation with exact values
(quantized ones equal to `gguf.quants`' dequantization, and close to what was quantized), and
the hparams must carry the same per-family flags as the Hugging Face path.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from brisk.model.gguf_file import GGUFCheckpoint, GGUFFile, dequantize
from brisk.model.hparams import ARCHITECTURES, HParams

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def _write(path, arch: str = "llama", fields: dict | None = None, tensors: dict | None = None,
           alignment: int | None = None) -> str:
    """fields: key -> (value, GGUFValueType[, element type]); tensors: name -> (float32 array, type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, *types) in (fields or {}).items():
        writer.add_key_value(key, value, *types)
    for name, (array, qtype) in (tensors or {}).items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(array, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_metadata_of_every_value_type_round_trips(tmp_path):
    fields = {
        "t.u8": (200, V.UINT8), "t.i8": (-100, V.INT8), "t.u16": (60000, V.UINT16), "t.i16": (-30000, V.INT16),
        "t.u32": (4_000_000_000, V.UINT32), "t.i32": (-2_000_000_000, V.INT32), "t.f32": (0.375, V.FLOAT32),
        "t.bool": (True, V.BOOL), "t.u64": (2**63 + 5, V.UINT64), "t.i64": (-(2**62), V.INT64),
        "t.f64": (1e-300, V.FLOAT64), "t.str": ("héllo wörld", V.STRING),
        "t.ints": ([3, -1, 7], V.ARRAY, V.INT32), "t.floats": ([0.5, -2.25], V.ARRAY, V.FLOAT32),
        "t.strs": (["a", "", "ünï"], V.ARRAY, V.STRING), "t.bools": ([True, False], V.ARRAY, V.BOOL),
        "t.nested": ([[1, 2], [3]], V.ARRAY, V.ARRAY),
    }
    path = _write(tmp_path / "meta.gguf", "qwen2", fields)
    got = GGUFFile(path).fields
    assert got == {"general.architecture": "qwen2"} | {k: v[0] for k, v in fields.items()}
    assert type(got["t.f32"]) is float and type(got["t.bool"]) is bool and type(got["t.ints"][0]) is int


def test_float_tensors_come_back_exactly_in_hf_orientation(tmp_path):
    embedding = np.arange(6 * 32, dtype=np.float32).reshape(6, 32)  # rows x cols, as HF stores it
    half = _random(4, 32)
    norm = _random(32, seed=1)
    path = _write(tmp_path / "f.gguf", tensors={"token_embd.weight": (embedding, Q.F32),
                                               "blk.0.attn_q.weight": (half, Q.F16),
                                               "output_norm.weight": (norm, Q.F32)})
    tensors = GGUFFile(path).tensors
    assert {n: (t.kind, t.shape) for n, t in tensors.items()} == {
        "token_embd.weight": (Q.F32, (6, 32)), "blk.0.attn_q.weight": (Q.F16, (4, 32)),
        "output_norm.weight": (Q.F32, (32,))}
    assert torch.equal(dequantize(tensors["token_embd.weight"]), torch.from_numpy(embedding))
    assert torch.equal(dequantize(tensors["blk.0.attn_q.weight"]), torch.from_numpy(half.astype(np.float16)).float())
    assert torch.equal(dequantize(tensors["output_norm.weight"]), torch.from_numpy(norm))


@pytest.mark.parametrize("qtype, tolerance", [(Q.Q8_0, 1 / 100), (Q.Q4_0, 1 / 8), (Q.Q4_1, 1 / 8)])
def test_quantized_tensors_dequantize_like_the_gguf_package(tmp_path, qtype, tolerance):
    weight = _random(8, 96)
    path = _write(tmp_path / "q.gguf", tensors={"blk.0.ffn_up.weight": (weight, qtype)})
    tensor = GGUFFile(path).tensors["blk.0.ffn_up.weight"]
    assert (tensor.kind, tensor.shape) == (qtype, (8, 96))
    ours = dequantize(tensor)
    reference = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
    assert torch.equal(ours, torch.from_numpy(reference))
    # and the reference is what was quantized, up to one quantization step
    assert (ours - torch.from_numpy(weight)).abs().max() <= tolerance * np.abs(weight).max()


def test_tensor_data_follows_a_custom_alignment(tmp_path):
    a, b = _random(2, 32, seed=2), _random(3, 64, seed=3)
    path = _write(tmp_path / "aligned.gguf", fields={"general.name": ("odd-length name!", V.STRING)},
                  tensors={"output_norm.weight": (a, Q.F32), "output.weight": (b, Q.Q8_0)}, alignment=256)
    file = GGUFFile(path)
    assert file.fields["general.alignment"] == 256
    assert torch.equal(dequantize(file.tensors["output_norm.weight"]), torch.from_numpy(a))
    assert torch.equal(dequantize(file.tensors["output.weight"]),
                       torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(b, Q.Q8_0), Q.Q8_0)))


def _model_fields(arch: str, **extra) -> dict:
    fields = {
        f"{arch}.vocab_size": (96, V.UINT32), f"{arch}.embedding_length": (64, V.UINT32),
        f"{arch}.feed_forward_length": (96, V.UINT32), f"{arch}.block_count": (2, V.UINT32),
        f"{arch}.attention.head_count": (4, V.UINT32), f"{arch}.attention.head_count_kv": (2, V.UINT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (0.5, V.FLOAT32), f"{arch}.rope.freq_base": (50000.0, V.FLOAT32),
        f"{arch}.context_length": (512, V.UINT32), "general.name": ("tiny", V.STRING),
    }
    return fields | extra


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a.gguf_name], ids=lambda a: a.family)
def test_spec_from_metadata_carries_the_family_flags_of_the_hf_path(tmp_path, architecture):
    name = architecture.gguf_name
    path = _write(tmp_path / "m.gguf", name, _model_fields(name),
                  tensors={"token_embd.weight": (_random(96, 64), Q.F32)})
    hparams = GGUFCheckpoint(path).hparams()
    # llama.cpp scales Gemma 3's queries by head_dim^-1/2 where the file is silent (no window here)
    gemma = {"query_pre_attn_scalar": 16} if name == "gemma3" else {}
    assert hparams == HParams(architecture=architecture.family, vocab_size=96, hidden_size=64, intermediate_size=96,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=0.5,
                             rope_theta=50000.0, max_position_embeddings=512, tie_word_embeddings=True,
                             attention_bias=architecture.attention_bias, qk_norm=architecture.qk_norm, name="tiny",
                             **gemma)
    hf = HParams.from_hf_config({"architectures": list(architecture.hf_classes), "vocab_size": 96,
                                   "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2})
    assert (hf.architecture, hf.attention_bias, hf.qk_norm) == (hparams.architecture, hparams.attention_bias, hparams.qk_norm)


def test_family_flags_are_those_of_the_models():
    flags = {a.family: (a.attention_bias, a.qk_norm, a.gguf_name) for a in ARCHITECTURES}
    assert flags == {"llama": (False, False, "llama"), "mistral": (False, False, None),
                     "qwen2": (True, False, "qwen2"), "qwen3": (False, True, "qwen3"),
                     "gemma3": (False, True, "gemma3"), "phi3": (False, False, "phi3")}


def test_an_hf_config_may_override_the_family_bias():
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": True}
    assert HParams.from_hf_config(config).attention_bias


def test_linear_rope_scaling_is_read_and_others_refused(tmp_path):
    linear = _write(tmp_path / "linear.gguf", "llama", _model_fields(
        "llama", **{"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (4.0, V.FLOAT32)}))
    assert GGUFCheckpoint(linear).hparams().rope_scaling_dict == {"factor": 4.0, "rope_type": "linear"}
    yarn = _write(tmp_path / "yarn.gguf", "llama", _model_fields(
        "llama", **{"llama.rope.scaling.type": ("yarn", V.STRING)}))
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        GGUFCheckpoint(yarn).hparams()


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("arch, permuted", [("llama", True), ("qwen2", False)])
def test_weights_get_hf_names_and_llama_rotary_rows_restored(tmp_path, arch, permuted):
    q, k, v = _random(64, 64, seed=4), _random(32, 64, seed=5), _random(32, 64, seed=6)
    stored_q, stored_k = (_llama_cpp_permute(q, 4), _llama_cpp_permute(k, 2)) if permuted else (q, k)
    path = _write(tmp_path / "w.gguf", arch, _model_fields(arch), tensors={
        "blk.1.attn_q.weight": (stored_q, Q.F32), "blk.1.attn_k.weight": (stored_k, Q.F32),
        "blk.1.attn_v.weight": (v, Q.F32), "output.weight": (_random(96, 64), Q.F32)})
    weights = dict(GGUFCheckpoint(path).weights(torch.float32, torch.device("cpu")))
    assert sorted(weights) == ["lm_head.weight", "model.layers.1.self_attn.k_proj.weight",
                               "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(weights["model.layers.1.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(weights["model.layers.1.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(weights["model.layers.1.self_attn.v_proj.weight"], torch.from_numpy(v))


def test_unsupported_architecture_is_named(tmp_path):
    path = _write(tmp_path / "falcon.gguf", "falcon")
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' is not supported \(supported: "
                                         r"\['gemma3', 'llama', 'phi3', 'qwen2', 'qwen3'\]\)"):
        GGUFCheckpoint(path)


def test_tensor_type_without_a_dequantizer_is_named(tmp_path):
    path = str(tmp_path / "ints.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.int32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFFile(path).tensors["blk.0.attn_q.weight"]
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' is stored as I32, which brisk cannot load"):
        dequantize(tensor)


def test_unknown_tensor_type_id_is_named(tmp_path):
    path = _write(tmp_path / "future.gguf", tensors={"output_norm.weight": (_random(32), Q.F32)})
    with open(path, "rb") as f:
        data = bytearray(f.read())
    name = b"output_norm.weight"
    at = data.index(name) + len(name)  # then: n_dims (u32), dims (u64 each), type (u32), offset (u64)
    type_at = at + 4 + 8 * int.from_bytes(data[at:at + 4], "little")
    assert int.from_bytes(data[type_at:type_at + 4], "little") == Q.F32
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match="'output_norm.weight' has tensor type 99, unknown to the installed gguf"):
        GGUFFile(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        GGUFFile(str(path))


def test_phi3_files_keep_their_fused_projections_and_longrope_is_refused(tmp_path):
    """Phi-3's GGUF stores q/k/v as one attn_qkv and gate/up as one ffn_up, as brisk runs them;
    its 128k variants' rope_factors (longrope) are refused by name, as is a partial rotary."""
    qkv, gate_up = _random(128, 64, seed=7), _random(192, 64, seed=8)
    path = _write(tmp_path / "phi3.gguf", "phi3", _model_fields("phi3"), tensors={
        "blk.0.attn_qkv.weight": (qkv, Q.F32), "blk.0.ffn_up.weight": (gate_up, Q.F32)})
    weights = dict(GGUFCheckpoint(path).weights(torch.float32, torch.device("cpu")))
    assert torch.equal(weights["model.layers.0.self_attn.qkv_proj.weight"], torch.from_numpy(qkv))
    assert torch.equal(weights["model.layers.0.mlp.gate_up_proj.weight"], torch.from_numpy(gate_up))
    long = _write(tmp_path / "long.gguf", "phi3", _model_fields("phi3"), tensors={
        "rope_factors_long.weight": (_random(8, seed=9), Q.F32)})
    with pytest.raises(ValueError, match="rope_factors tensors"):
        GGUFCheckpoint(long)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported"):
        HParams.from_hf_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
                                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "partial_rotary_factor": 0.75})
