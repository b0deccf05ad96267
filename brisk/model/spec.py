"""ModelSpec: what a checkpoint is (shapes, RoPE, norms), read from config.json or GGUF metadata.

This is a description of the weights, not a knob: EngineConfig says how to run, ModelSpec says
what is being run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF `architectures` entries served by the Llama-family implementation, and what each adds.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
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
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    name: str = ""

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements per token across all layers, K and V; multiply by the dtype's size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelSpec":
        archs = config.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs}; brisk serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = config["num_attention_heads"]
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
        rope_theta = config.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            rope_scaling = None
        return cls(
            architecture=family,
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
            attention_bias=bool(config.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            rope_scaling=_freeze(rope_scaling),
            name=config.get("_name_or_path", ""),
        )


def _freeze(rope_scaling: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not rope_scaling:
        return None
    return tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict))))
