"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over one flat token batch.

Differences from transformers' modules, all for speed: q/k/v and gate/up are fused into one
matmul each, RoPE cos/sin are looked up once per step (not per layer), and attention reads K/V
through block tables (see attention.py). Weights keep Hugging Face names on the way in, so any
HF checkpoint or a GGUF file renamed to HF names loads through `load_weights`.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from brisk.kernels import cpu as cpu_kernels
from brisk.model.attention import AttentionMetadata, paged_attention
from brisk.model.linear import Linear, linear
from brisk.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = spec.rope_scaling_dict
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short kept."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, indexed by each token's position."""

    def __init__(self, spec: ModelSpec, max_len: int):
        super().__init__()
        self.spec, self.max_len = spec, max_len
        self.cos = self.signed_sin = None

    def build(self, device: torch.device) -> None:
        """Computes the fp32 tables; separate from __init__ so modules built on `meta` get real ones."""
        inv_freq = rope_inverse_frequencies(self.spec)
        freqs = torch.outer(torch.arange(self.max_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        half = self.spec.head_dim // 2
        # rotate_half(x) * sin == cat(x2, x1) * signed_sin with the sign folded into the table.
        signed_sin = torch.cat((-angles[:, :half].sin(), angles[:, half:].sin()), dim=-1)
        self.cos = angles.cos().float().to(device)
        self.signed_sin = signed_sin.float().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, signed sin of shape [T, 1, D], shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF checkpoint names that land in a slice of one of our fused parameters: (fused name, shard index).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_len: int):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states (logits are taken only where needed)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32. Past a few rows computed as (W @ h^T)^T: for the tall
        vocabulary matrix BLAS runs that orientation 1.2-3x faster on CPU than h @ W^T."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if cpu_kernels.linear_available(hidden, weight):
            return linear(hidden, weight).float()
        return torch.mm(weight, hidden.t()).t().float().contiguous()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into our (partly fused) parameters; every one must be filled."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            target, rows = self._locate(hf_name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param = params[target]
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
            dest.copy_(tensor)
            rows_filled[target] += dest.shape[0]
        missing = [name for name, rows in rows_filled.items() if rows < params[name].shape[0]]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")

    def _locate(self, hf_name: str) -> tuple[str | None, tuple[int, int] | None]:
        """HF name -> (our parameter name, (first row, row count) inside it or None for all of it)."""
        if "rotary_emb" in hf_name:
            return None, None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None  # tied: some checkpoints store the copy anyway
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED_SHARDS:
                fused, shard = _FUSED_SHARDS[part]
                parts[i] = fused
                return ".".join(parts), self._shard_rows(fused, shard)
        return name, None

    def _shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        s = self.spec
        if fused == "qkv_proj":
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return (shard * s.intermediate_size, s.intermediate_size)
