"""EngineConfig: the one place every engine knob lives.

The CLI, the offline `LLM` API and (later) the server all build an EngineConfig; command-line
flags are generated from these fields, so a knob is added here once and appears everywhere.
Names follow vLLM's where vLLM has the same knob.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _knob(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class EngineConfig:
    model: str | None = _knob(
        None, "Local Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)."
    )
    dtype: str = _knob("auto", "Weight and activation dtype: auto, float32, bfloat16 or float16.")
    device: str = _knob("auto", "Torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    max_model_len: int | None = _knob(
        None, "Longest prompt + completion in tokens; default: the model's context length."
    )
    block_size: int = _knob(16, "Tokens per KV cache block.")
    kv_cache_memory_gib: float = _knob(1.0, "Memory budget of the KV cache in GiB.")
    num_kv_blocks: int | None = _knob(
        None, "Exact number of KV blocks, overriding kv_cache_memory_gib (for tests and tuning)."
    )
    max_num_seqs: int = _knob(64, "Most sequences in one batch.")
    max_num_batched_tokens: int = _knob(512, "Token budget of one engine step (prefill chunks + decodes).")
    enable_chunked_prefill: bool = _knob(True, "Split long prompts across steps so decodes keep flowing.")
    enable_prefix_caching: bool = _knob(True, "Reuse KV blocks of prompts that share a prefix.")
    seed: int = _knob(0, "Seed of the sampler's random generator for requests without a seed.")
    num_threads: int | None = _knob(None, "CPU threads for torch; default: all cores.")

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.model is not None and not os.path.exists(self.model):
            raise ConfigError(f"model path does not exist: {self.model!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """fp32 on CPU by default (exact parity with the reference); bf16 on accelerators."""
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype]

    @classmethod
    def knobs(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))
