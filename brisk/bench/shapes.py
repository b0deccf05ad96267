"""Models of the sizes users run, without a hub: GGUF files with the default model's tokenizer and
a random body at a real model's shape.

Users pick an engine on the 1-8B models they run; the real files here are 135M and 270M. Speed
and memory depend on a model's shape and block formats, not on what its weights learned, so a
body of random weights at SmolLM2-1.7B's or Llama 3 8B's shape, quantized by llama.cpp's own
`llama-quantize`, runs at the speed the trained model runs (correctness stays proven on the
real small files). The tokenizer is the default file's (49,152 tokens, its chat template), so
prompts tokenize as they do for the default model and both engines read the same ids.

`write_f16` writes the float16 file (norms float32, as llama.cpp's converter writes them),
tensor by tensor, so an 8B body (15 GB) never sits in memory whole; `shape_file` caches it and
its quantized forms under data/shapes/, keyed by shape, seed and block type.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from brisk.config import DEFAULT_TEXT

SHAPES_DIR = DEFAULT_TEXT.parent / "shapes"
QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q8_0")  # what `brisk bench scale` asks llama-quantize for
STD = 0.02  # the weights' spread: a usual initialisation's, so activations stay in range over depth


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    tied: bool  # the LM head is the embedding table (no output.weight)
    context: int = 8192
    vocab: int = 49152  # the default file's tokenizer

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape: rows x columns) of every tensor, in llama.cpp's order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        names = [("token_embd.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            names += [(f"blk.{i}.attn_norm.weight", (self.hidden,)), (f"blk.{i}.attn_q.weight", (q, self.hidden)),
                      (f"blk.{i}.attn_k.weight", (kv, self.hidden)), (f"blk.{i}.attn_v.weight", (kv, self.hidden)),
                      (f"blk.{i}.attn_output.weight", (self.hidden, q)), (f"blk.{i}.ffn_norm.weight", (self.hidden,)),
                      (f"blk.{i}.ffn_gate.weight", (self.ffn, self.hidden)),
                      (f"blk.{i}.ffn_up.weight", (self.ffn, self.hidden)),
                      (f"blk.{i}.ffn_down.weight", (self.hidden, self.ffn))]
        names.append(("output_norm.weight", (self.hidden,)))
        if not self.tied:
            names.append(("output.weight", (self.vocab, self.hidden)))
        return names

    @property
    def parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())


SHAPES = {s.name: s for s in (
    # SmolLM2-1.7B's body: its config.json (tied embeddings, rope theta 130,000)
    Shape("1.7b", hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, rope_theta=130_000.0, tied=True),
    # Llama 3 8B's body (7.38B parameters with this vocabulary: 8.03B less 79,104 rows of embedding and head)
    Shape("8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_theta=500_000.0, tied=False),
)}


@cache
def _tokenizer_fields(source: str) -> tuple[tuple[str, object, list], ...]:
    """The default file's tokenizer metadata: (key, value, GGUF types) of every tokenizer.* field
    (read once: its 49,152 tokens and 48,900 merges take seconds to decode)."""
    import gguf

    reader = gguf.GGUFReader(source)
    return tuple((key, field.contents(), field.types) for key, field in reader.fields.items()
                 if key.startswith("tokenizer."))


def write_f16(shape: Shape, path: Path, tokenizer_source: str, seed: int = 0) -> None:
    """The float16 GGUF of `shape` at `path`: the tokenizer of `tokenizer_source` (a GGUF file),
    weights drawn from N(0, STD) by a generator seeded `seed`, norms 1. Written to a temporary
    name and moved into place, so a file at `path` is always whole."""
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random {shape.name} body (brisk bench scale, seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    for key, value, types in _tokenizer_fields(tokenizer_source):
        writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    tensors = shape.tensors()
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:  # a row block at a time: a 14336 x 4096 product drawn whole would be 235 MB of float32
            data = np.empty(dims, np.float16)
            for start in range(0, dims[0], 1024):
                rows = rng.standard_normal((min(1024, dims[0] - start), dims[1]), dtype=np.float32)
                data[start:start + len(rows)] = rows * STD
            writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, path)


def shape_file(shape: Shape, quant_type: str, tokenizer_source: str, llama_quantize: str | None,
               directory: Path = SHAPES_DIR, seed: int = 0, threads: int | None = None) -> Path:
    """The GGUF of `shape` in `quant_type` ("F16", or a llama-quantize type such as Q4_K_M),
    written (and quantized by `llama_quantize`) the first time, read from the cache after."""
    directory.mkdir(parents=True, exist_ok=True)
    f16 = directory / f"random-{shape.name}-seed{seed}-F16.gguf"
    if not f16.exists():
        write_f16(shape, f16, tokenizer_source, seed)
    if quant_type == "F16":
        return f16
    out = directory / f"random-{shape.name}-seed{seed}-{quant_type}.gguf"
    if not out.exists():
        if llama_quantize is None:
            raise FileNotFoundError(f"{out.name} needs llama.cpp's llama-quantize: run `make llama-cpp`")
        tmp = out.with_name(out.name + ".tmp")
        result = subprocess.run([llama_quantize, str(f16), str(tmp), quant_type, str(threads or os.cpu_count())],
                                capture_output=True, text=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama-quantize {quant_type} failed (exit code {result.returncode}):\n"
                               f"{result.stderr[-3000:]}")
        os.replace(tmp, out)
    return out
