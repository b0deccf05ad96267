"""Quantized checkpoints: `brisk quantize` writes one, the loader reads it back as it was saved.

The output is a Hugging Face folder: config.json with a `quantization_config` naming the format,
the tokenizer's files, and one `model.safetensors`. A quantized weight `W` is stored as the
tensors of its QuantizedTensor (`W.codes`, `W.scales`, and `W.mins` for int4), and the safetensors
header's metadata says which names are quantized and how (format, shape, group size). Weights are
quantized once, at write time, exactly as `--quantization` does at load time, so loading the folder
runs the same numbers without the minutes of rounding and at a fifth of the disk and memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from brisk.quant.formats import GROUP_SIZES, GROUPED_FORMATS, QuantizedTensor

QUANT_METHOD = "brisk"  # config.json's quantization_config.quant_method for folders written here
_METADATA_KEY = "brisk_quantized"
_PARTS = ("codes", "scales", "mins")  # QuantizedTensor's data, scales and mins, in that order


class SavesItsFiles(Protocol):
    """What write_folder needs of a tokenizer (model/tokenizer.py's): its files written to a folder."""

    def save(self, folder: str) -> None: ...


@dataclass(frozen=True)
class QuantizedLayout:
    """What a quantized folder's config.json says about it: the layers' format and group size."""

    method: str
    group_size: int

    @staticmethod
    def of(config: dict) -> QuantizedLayout | None:
        """None for a folder of float weights (or another tool's quantization_config, which
        the loader then rejects by name)."""
        qc = config.get("quantization_config")
        if not qc:
            return None
        if qc.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported: "
                             f"brisk loads float checkpoints, GGUF files and folders written by `brisk quantize`")
        return QuantizedLayout(qc["format"], qc["group_size"])

    def config_entry(self) -> dict:
        return {"quant_method": QUANT_METHOD, "format": self.method, "group_size": self.group_size}

    def __str__(self) -> str:
        return f"{self.method}, groups of {self.group_size}" if self.method in GROUPED_FORMATS else self.method


def write_folder(out: str, config: dict, layout: QuantizedLayout | None, tokenizer: SavesItsFiles,
                 weights: Iterator[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
    """A folder the loader (and transformers, for float weights) opens like any Hugging Face
    checkpoint: config.json (`config`, plus the quantization_config of quantized weights), the
    tokenizer's files and model.safetensors."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config if layout is None else {**config, "quantization_config": layout.config_entry()}, f,
                  indent=2)
    tokenizer.save(out)
    save_weights(os.path.join(out, "model.safetensors"), weights)


def save_weights(path: str, weights: Iterator[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
    """One safetensors file of HF-named weights, float or quantized."""
    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[str, dict] = {}
    for name, weight in weights:
        if isinstance(weight, QuantizedTensor):
            layouts[name] = {"format": weight.format, "shape": list(weight.shape), "group_size": weight.group_size}
            for part, tensor in zip(_PARTS, (weight.data, weight.scales, weight.mins)):
                if tensor is not None:
                    tensors[f"{name}.{part}"] = tensor.contiguous()
        else:
            tensors[name] = weight.detach().contiguous()
    save_file(tensors, path, metadata={_METADATA_KEY: json.dumps(layouts)})


def load_weights(files: list[Path], dtype: torch.dtype, device: torch.device
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """HF-named weights from safetensors files: float ones cast to dtype, the quantized ones
    (named in the header's metadata) rebuilt as QuantizedTensors, as they were saved."""
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            layouts = json.loads((f.metadata() or {}).get(_METADATA_KEY, "{}"))
            parts_of = {f"{name}.{part}" for name in layouts for part in _PARTS}
            names = f.keys()
            stored = set(names)
            for name in names:
                if name not in parts_of:
                    yield name, f.get_tensor(name).to(dtype)
            for name, layout in layouts.items():
                if layout["group_size"] not in GROUP_SIZES:
                    raise ValueError(f"{file.name}: {name} has group size {layout['group_size']}, "
                                     f"not one of {GROUP_SIZES}")
                data, scales, mins = (f.get_tensor(f"{name}.{part}") if f"{name}.{part}" in stored else None
                                      for part in _PARTS)
                if layout["format"] in GROUPED_FORMATS:  # brisk before 2026-11-23 wrote these in f32
                    scales, mins = (None if t is None else t.half() for t in (scales, mins))
                yield name, QuantizedTensor(layout["format"], tuple(layout["shape"]), data, scales, mins,
                                            layout["group_size"])


def folder_bytes(path: str) -> int:
    """The size of a checkpoint on disk: a file, or a folder's weight files."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
