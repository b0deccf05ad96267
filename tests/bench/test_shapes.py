"""The shape writer of `brisk bench scale` (brisk/bench/shapes.py): a small body written by it is
a model brisk and transformers (and, under the llama_cpp marker, llama.cpp) read alike, with the
default file's tokenizer id for id. No large file here: the pinned shapes are checked by their
parameter counts, the real files only by `brisk bench scale`."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from brisk import LLM
from brisk.bench.shapes import SHAPES, Shape, shape_file, write_f16
from brisk.model.loader import default_model_path, open_checkpoint
from tests.helpers import brisk_logit_chunks

SMALL = Shape("small", hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, rope_theta=10_000.0, tied=False)
TIED = Shape("tied", hidden=64, layers=1, heads=2, kv_heads=1, ffn=128, rope_theta=10_000.0, tied=True)
TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "<|im_start|>user\nHi!<|im_end|>\n",
         "Ünïcödé, emoji 🙂 and digits 12345"]


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("shapes") / "small.gguf"
    write_f16(SMALL, path, default_model_path(), seed=3)
    return str(path)


def test_the_pinned_shapes_are_the_models_they_stand_for():
    small, big = SHAPES["1.7b"], SHAPES["8b"]
    assert (small.hidden, small.layers, small.heads, small.kv_heads, small.ffn, small.tied) == (2048, 24, 32, 32, 8192,
                                                                                                True)
    assert 1.70e9 < small.parameters < 1.72e9  # SmolLM2-1.7B: 1.71B
    assert (big.hidden, big.layers, big.heads, big.kv_heads, big.ffn, big.tied) == (4096, 32, 32, 8, 14336, False)
    assert 7.37e9 < big.parameters < 7.39e9  # Llama 3 8B: 8.03B, less 79,104 rows of its embedding and head
    assert big.context == small.context == 8192


def test_its_tokenizer_is_the_default_files_id_for_id(small_file):
    ours, default = open_checkpoint(small_file).tokenizer, open_checkpoint(default_model_path()).tokenizer
    for text in TEXTS:
        assert ours.encode(text) == default.encode(text)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.encode_chat(messages) == default.encode_chat(messages)
    assert (ours.eos_token_id, ours.bos_token_id) == (default.eos_token_id, default.bos_token_id)


def test_brisk_reads_what_transformers_reads(small_file):
    """The float16 file dequantized by transformers (the reference) and run by brisk in float32:
    the same logits within 1e-3 on a few prompts."""
    from transformers import AutoModelForCausalLM

    checkpoint = open_checkpoint(small_file)
    assert (checkpoint.hparams.num_layers, checkpoint.hparams.hidden_size, checkpoint.hparams.num_kv_heads) == (2, 128,
                                                                                                               2)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(small_file), gguf_file=os.path.basename(small_file),
                                              dtype=torch.float32).eval()
    llm = LLM(small_file, dtype="float32", quantization="none", max_model_len=256, kv_cache_memory_gib=0.02)
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0]
        ours = torch.cat([c.float() for c in brisk_logit_chunks(llm.engine, ids, [len(ids)])])
        assert torch.allclose(ours, theirs, atol=1e-3, rtol=0), (text, float((ours - theirs).abs().max()))
        assert float(theirs.std()) > 0.1  # a body that computes something, not zeros


def test_the_weights_are_seeded_random_and_a_tied_head_has_no_output_tensor(tmp_path):
    import gguf

    for name, seed in (("tied-0", 0), ("again-0", 0), ("tied-1", 1)):
        write_f16(TIED, tmp_path / f"{name}.gguf", default_model_path(), seed=seed)
    read = {seed: gguf.GGUFReader(str(tmp_path / f"tied-{seed}.gguf")) for seed in (0, 1)}
    names = [t.name for t in read[0].tensors]
    assert names == [name for name, _ in TIED.tensors()] and "output.weight" not in names
    q = {seed: np.array(next(t for t in r.tensors if t.name == "blk.0.attn_q.weight").data, np.float32)
         for seed, r in read.items()}
    assert not np.array_equal(q[0], q[1]) and 0.015 < q[0].std() < 0.025
    assert (tmp_path / "tied-0.gguf").read_bytes() == (tmp_path / "again-0.gguf").read_bytes()
    norm = next(t for t in read[0].tensors if t.name == "blk.0.attn_norm.weight")
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(np.array(norm.data) == 1)


def test_a_quantized_form_needs_llama_quantize_and_the_float_file_is_cached(tmp_path):
    f16 = shape_file(TIED, "F16", default_model_path(), None, directory=tmp_path)
    written = f16.stat().st_mtime_ns
    with pytest.raises(FileNotFoundError, match="needs llama.cpp's llama-quantize: run `make llama-cpp`"):
        shape_file(TIED, "Q4_K_M", default_model_path(), None, directory=tmp_path)
    assert shape_file(TIED, "F16", default_model_path(), None, directory=tmp_path).stat().st_mtime_ns == written
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.llama_cpp
def test_llama_cpp_reads_it_as_brisk_does(small_file):
    """llama-cpp-python (make test-llama-cpp builds it) on the float16 file: the same logits as
    brisk's within 1e-3."""
    from llama_cpp import Llama

    theirs_model = Llama(small_file, logits_all=True, n_ctx=256, n_threads=2, verbose=False)
    llm = LLM(small_file, dtype="float32", quantization="none", max_model_len=256, kv_cache_memory_gib=0.02)
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        theirs_model.reset()
        theirs_model.eval(ids)
        theirs = torch.tensor(np.array(theirs_model.scores[:len(ids)]), dtype=torch.float32)
        ours = torch.cat([c.float() for c in brisk_logit_chunks(llm.engine, ids, [len(ids)])])
        assert torch.allclose(ours, theirs, atol=1e-3, rtol=0), (text, float((ours - theirs).abs().max()))


@pytest.mark.llama_cpp
def test_llama_quantize_writes_a_file_brisk_runs_on_its_own_blocks(tmp_path):
    from brisk.bench.compare import LlamaCpp

    quantize = LlamaCpp.find(None).program("llama-quantize")
    path = shape_file(SMALL, "Q4_K_M", default_model_path(), quantize, directory=tmp_path)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_gib=0.02)
    assert llm.engine.weight_mode.name == "gguf+a8"
    assert "Q4_K" in llm.engine.weight_mode.weights
