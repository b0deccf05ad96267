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
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    # Gemma's norms around each block: the attention's and the MLP's outputs are normalized
    # before they join the residual stream (post_attention_norm, post_feedforward_norm).
    sandwich_norms: bool = False
    scaled_embeddings: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    # What a Hugging Face checkpoint adds to its norm weights: Gemma computes x * (1 + w) and
    # stores w. brisk (like llama.cpp's GGUF files) keeps 1 + w, so every norm is one kernel.
    hf_norm_offset: float = 0.0
    # Per-family renames between Hugging Face's layer module names and brisk's (model/llama.py):
    # Gemma's `post_attention_layernorm` normalizes the attention's output, where Llama's is the
    # norm before the MLP.
    hf_module_names: tuple[tuple[str, str], ...] = ()  # (HF name, brisk name)
    # GGUF layer tensor names whose HF meaning differs from the llama family's (gguf_file.py).
    gguf_layer_names: tuple[tuple[str, str], ...] = ()  # (GGUF name, HF name)
    hf_defaults: tuple[tuple[str, Any], ...] = ()  # what transformers assumes where a config.json is silent
    default_rope_theta: float = 10000.0  # likewise for the RoPE base, which may also sit in rope_parameters
    hf_model_type: str | None = None  # config.json's model_type, where it is not the family's name
    # Which layers a file's `sliding_window` applies to where it does not list them (layer_types):
    # None, none (the family has no windowed layers); 0, every layer (Mistral); N, all but every
    # Nth (Gemma 3: 6, as transformers' Gemma3TextConfig and llama.cpp's swa pattern).
    global_every: int | None = None
    local_rope_theta: float | None = None  # the windowed layers' own RoPE base where a file is silent
    # The checkpoint stores q/k/v and gate/up fused, as brisk runs them (Phi-3): written out so too.
    hf_fused_projections: bool = False


ARCHITECTURES = (
    Architecture("llama", ("LlamaForCausalLM",), gguf_name="llama", gguf_interleaved_rope=True),
    Architecture("mistral", ("MistralForCausalLM",), gguf_name=None,  # llama.cpp converts Mistral to "llama"
                 global_every=0),
    Architecture("qwen2", ("Qwen2ForCausalLM",), gguf_name="qwen2", attention_bias=True),
    Architecture("qwen3", ("Qwen3ForCausalLM",), gguf_name="qwen3", qk_norm=True),
    # Phi-3 mini: fused qkv and gate_up in the checkpoint, a window on every layer (2047 in the 4k model)
    Architecture("phi3", ("Phi3ForCausalLM",), gguf_name="phi3", global_every=0, hf_fused_projections=True,
                 gguf_layer_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
    Architecture("gemma3", ("Gemma3ForCausalLM",), gguf_name="gemma3", qk_norm=True, hidden_act="gelu_tanh",
                 sandwich_norms=True, scaled_embeddings=True, hf_norm_offset=1.0,
                 hf_module_names=(("post_attention_layernorm", "attention_output_norm"),
                                  ("pre_feedforward_layernorm", "post_attention_layernorm"),
                                  ("post_feedforward_layernorm", "mlp_output_norm")),
                 gguf_layer_names=(("ffn_norm", "pre_feedforward_layernorm"),
                                   ("post_attention_norm", "post_attention_layernorm"),
                                   ("post_ffw_norm", "post_feedforward_layernorm")),
                 hf_defaults=(("sliding_window", 4096), ("query_pre_attn_scalar", 256)), default_rope_theta=1_000_000.0,
                 hf_model_type="gemma3_text", global_every=6, local_rope_theta=10000.0),
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
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict (global layers)
    name: str = ""
    # Sliding-window attention: layers whose window is not 0 attend to their last `window`
    # positions only (their own included), as transformers' sliding_window_overlay and
    # llama.cpp's standard SWA mask. Empty: every layer attends to its whole context.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the windowed layers' own RoPE base (Gemma 3); None: the global one
    query_pre_attn_scalar: float | None = None  # queries scaled by its -1/2 power; None: head_dim's

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def family(self) -> Architecture:
        return next(a for a in ARCHITECTURES if a.family == self.architecture)

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends to (0: all of them)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int:
        """The window of the windowed layers (0 where there are none)."""
        return max(self.layer_windows, default=0)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "HParams":
        arch = hf_architecture(config.get("architectures") or [])
        config = dict(arch.hf_defaults) | {k: v for k, v in config.items() if v is not None}
        num_heads = config["num_attention_heads"]
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
        local_rope = None
        if isinstance(rope_scaling, dict) and "full_attention" in rope_scaling:  # per layer type (transformers 5)
            local_rope, rope_scaling = rope_scaling.get("sliding_attention"), rope_scaling["full_attention"]
        partial = config.get("partial_rotary_factor", (rope_scaling or {}).get("partial_rotary_factor", 1.0)
                              if isinstance(rope_scaling, dict) else 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported: brisk rotates every dimension of a head")
        rope_theta = config.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            rope_scaling = None
        windows = _hf_layer_windows(config, arch)
        local_theta = (local_rope or {}).get("rope_theta", config.get("rope_local_base_freq"))
        local_theta = arch.local_rope_theta if local_theta is None else local_theta
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
            rope_theta=float(rope_theta if rope_theta is not None else arch.default_rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", arch.attention_bias)),
            qk_norm=arch.qk_norm,
            rope_scaling=_freeze(rope_scaling),
            name=config.get("_name_or_path", ""),
            layer_windows=windows,
            local_rope_theta=None if local_theta is None or not any(windows) else float(local_theta),
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
        )


    def hf_config(self) -> dict[str, Any]:
        """The config.json that from_hf_config reads back as this spec (a `brisk quantize`
        output needs one whatever the source was, GGUF included)."""
        config = {
            "architectures": [self.family.hf_classes[0]],
            "model_type": self.family.hf_model_type or self.architecture,
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
            "pad_token_id": None,  # a family's default (Phi-3's 32000) may lie past a small vocabulary
        }
        if self.layer_windows:
            config["sliding_window"] = self.sliding_window
            config["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
        if self.local_rope_theta is not None:
            config["rope_local_base_freq"] = self.local_rope_theta
        if self.query_pre_attn_scalar is not None:
            config["query_pre_attn_scalar"] = self.query_pre_attn_scalar
        if self.family.hidden_act == "gelu_tanh":
            config["hidden_activation"] = "gelu_pytorch_tanh"
        return config


def default_layer_windows(arch: Architecture, num_layers: int, window: int) -> tuple[int, ...]:
    """Each layer's window where a file gives only the window (Architecture.global_every)."""
    if not window or arch.global_every is None:
        return ()
    every = arch.global_every
    return tuple(0 if every and (i + 1) % every == 0 else window for i in range(num_layers))


def _hf_layer_windows(config: dict[str, Any], arch: Architecture) -> tuple[int, ...]:
    """Each layer's window from a config.json: `layer_types` where it is written (Gemma 3,
    transformers 5's configs); else Gemma 3's default pattern, or Mistral's window on every layer;
    Qwen2's `use_sliding_window` is refused (its windowed layers are rarely used, never tested here)."""
    window, layers = config.get("sliding_window"), config["num_hidden_layers"]
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window (Qwen2's windowed layers) is not supported")
    types = config.get("layer_types")
    if not window or (arch.global_every is None and types is None):
        return ()
    if types is not None:
        if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types: expected {layers} of full_attention/sliding_attention, got {types}")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else ()
    return default_layer_windows(arch, layers, window)


def _freeze(rope_scaling: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not rope_scaling:
        return None
    return tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict))))
