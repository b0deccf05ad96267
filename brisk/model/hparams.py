"""HParams: what a checkpoint is (shapes, RoPE, norms), read from config.json or GGUF metadata.

This is a description of the weights, not a knob: EngineConfig says how to run, HParams says
what is being run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Architecture:
    """One model family served by the Llama-style implementation: how each checkpoint format
    names it, and what it changes in the shared layers. Both loaders read ARCHITECTURES."""

    family: str  # HParams.architecture
    hf_classes: tuple[str, ...]  # entries of config.json's `architectures`
    gguf_name: str | None  # `general.architecture` of GGUF files; None: llama.cpp writes it as another family
    attention_bias: bool = False  # biases on the q/k/v projections (an HF config may say otherwise)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    gguf_interleaved_rope: bool = False  # llama.cpp permuted q/k rows into its rotary layout; undone at load


ARCHITECTURES = (
    Architecture("llama", ("LlamaForCausalLM",), gguf_name="llama", gguf_interleaved_rope=True),
    Architecture("mistral", ("MistralForCausalLM",), gguf_name=None),  # llama.cpp converts Mistral to "llama"
    Architecture("qwen2", ("Qwen2ForCausalLM",), gguf_name="qwen2", attention_bias=True),
    Architecture("qwen3", ("Qwen3ForCausalLM",), gguf_name="qwen3", qk_norm=True),
)
_BY_HF_CLASS = {cls: a for a in ARCHITECTURES for cls in a.hf_classes}
_BY_GGUF_NAME = {a.gguf_name: a for a in ARCHITECTURES if a.gguf_name}


def hf_architecture(hf_classes: list[str]) -> Architecture:
    """The family of the first supported entry of config.json's `architectures`."""
    found = next((_BY_HF_CLASS[c] for c in hf_classes if c in _BY_HF_CLASS), None)
    if found is None:
        raise ValueError(f"unsupported architecture {hf_classes}; brisk serves {sorted(_BY_HF_CLASS)}")
    return found


def gguf_architecture(name: str) -> Architecture:
    found = _BY_GGUF_NAME.get(name)
    if found is None:
        raise ValueError(f"GGUF architecture {name!r} is not supported (supported: {sorted(_BY_GGUF_NAME)})")
    return found


@dataclass(frozen=True)
class HParams:
    architecture: str  # an Architecture's family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # biases on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    name: str = ""

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "HParams":
        arch = hf_architecture(config.get("architectures") or [])
        num_heads = config["num_attention_heads"]
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
        rope_theta = config.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            rope_scaling = None
        return cls(
            architecture=arch.family,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", arch.attention_bias)),
            qk_norm=arch.qk_norm,
            rope_scaling=_freeze(rope_scaling),
            name=config.get("_name_or_path", ""),
        )


    def hf_config(self) -> dict[str, Any]:
        """The config.json that from_hf_config reads back as this spec (a `brisk quantize`
        output needs one whatever the source was, GGUF included)."""
        arch = next(a for a in ARCHITECTURES if a.family == self.architecture)
        return {
            "architectures": [arch.hf_classes[0]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "_name_or_path": self.name,
        }


def _freeze(rope_scaling: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not rope_scaling:
        return None
    return tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict))))
