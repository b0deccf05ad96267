"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over one flat token batch.

Differences from transformers' modules, all for speed: q/k/v and gate/up are fused into one
matmul each, RoPE tables are shared by every layer, attention reads K/V through block tables
(see attention.py), and on CPU the work between the matmuls runs in fused C kernels: residual
add + RMSNorm in place, RoPE + the K/V cache write, SiLU-and-multiply (kernels/layer_ops.h,
kernels/attention.h; the torch code beside each call is their reference), and on GPUs in their
Triton counterparts (kernels/triton_layer_ops.py). Decode steps of up to
8 sequences run every layer in one C call (kernels/decode_layers.c). Weights keep
Hugging Face names on the way in, so any HF checkpoint or a GGUF file renamed to HF names loads
through `load_weights`.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels import gpu as gpu_kernels
from brisk.model.attention import AttentionMetadata, paged_attention, write_kv
from brisk.model.linear import Linear, linear
from brisk.model.rope import Rope, RotaryEmbedding
from brisk.model.hparams import HParams
from brisk.quant.formats import QuantizedTensor
from brisk.kernels.kv_cache import KVCacheLayer
from brisk.quant.modules import QuantizedWeight, install_quantized


class RMSNorm(nn.Module):
    """RMSNorm that can take the residual stream along, as vLLM's does: `norm(x)` normalizes;
    `norm(x, residual)` first adds x into the residual and returns (normalized, residual). On CPU
    the fused kernel does both in place, in one pass, with no temporaries."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if cpu_kernels.layer_ops_available(x, self.weight):
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if gpu_kernels.available(x, self.weight):
            if residual is None:
                return gpu_kernels.rms_norm(x, self.weight, self.eps)
            gpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = residual + x
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    if cpu_kernels.layer_ops_available(gate_up):
        return cpu_kernels.silu_mul(gate_up)
    if gpu_kernels.available(gate_up):
        return gpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, spec: HParams):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        q = self._rotate_and_cache(self.qkv_proj(x), rope, kv_cache, meta)
        out = paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.view(x.shape[0], self.q_size))

    def _rotate_and_cache(self, qkv: torch.Tensor, rope: Rope, kv_cache: KVCacheLayer,
                          meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q + 2 kv] -> rotated q [T, H, D]; this step's rotated K and V go into the cache."""
        norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if cpu_kernels.available(qkv, kv_cache):
            return cpu_kernels.rope_write_kv(qkv, rope.positions, rope.cos, rope.signed_sin, kv_cache,
                                             meta.slot_blocks, meta.slot_offsets, self.num_heads, *norms)
        if gpu_kernels.attention_available(qkv, kv_cache):
            return gpu_kernels.rope_write_kv(qkv, rope.positions, rope.cos, rope.signed_sin, kv_cache,
                                             meta.slot_blocks, meta.slot_offsets, self.num_heads, *norms)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        write_kv(kv_cache, rope.apply(k), v.reshape(t, self.num_kv_heads, self.head_dim), meta)
        return rope.apply(q)


class MLP(nn.Module):
    def __init__(self, spec: HParams):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: HParams):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: KVCacheLayer, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's input, the residual stream before it) -> the same for the next layer.
        The first layer gets the embeddings as x and no residual."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# HF checkpoint names that land in a slice of one of our fused parameters: (fused name, shard index).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_SHARDS_OF = {fused: [hf for hf, (f, _) in _FUSED_SHARDS.items() if f == fused] for fused, _ in _FUSED_SHARDS.values()}


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: HParams, max_len: int):
        super().__init__()
        self.hparams = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec, max_len)
        self._decode_layers: cpu_kernels.DecodeLayers | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCacheLayer], meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states (logits are taken only where needed)."""
        x, residual = self.embed_tokens(input_ids), None
        if self._fused_decode_serves(meta, kv_caches):
            hidden = self._fused_decode()(x.float(), positions, meta.slot_blocks, meta.slot_offsets,
                                          meta.decode_block_tables, meta.decode_context_lens, kv_caches,
                                          meta.decode_ancestor_masks)
            return hidden.to(x.dtype)
        rope = self.rotary.at(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def _apply(self, fn, *args, **kwargs):
        """Moving or casting the weights (Module.to and friends) swaps their storage: the fused
        step's pointer tables are rebuilt on the next decode step."""
        self._decode_layers = None
        return super()._apply(fn, *args, **kwargs)

    def _fused_decode_serves(self, meta: AttentionMetadata, kv_caches: list[KVCacheLayer]) -> bool:
        """Small pure-decode steps on CPU run every layer in one C call (kernels/decode_layers.c):
        at batch 1, Python's ~160 us per layer of dispatch was more than the layer's own work
        outside the matmuls. Larger batches, where BLAS beats the matvec, and steps with prefill
        chunks run layer by layer."""
        return (0 < meta.num_decodes <= cpu_kernels.SMALL_BATCH_ROWS and not meta.prefills
                and cpu_kernels.decode_layers_available(self.norm.weight, kv_caches[0]))

    def _fused_decode(self) -> cpu_kernels.DecodeLayers:
        """The layers' weights as the fused kernel reads them; built on the first decode step,
        once the weights are loaded and the RoPE tables built."""
        if self._decode_layers is None:
            layers = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                layers.append(cpu_kernels.DecodeLayerWeights(
                    layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                    attn.qkv_proj.kernel_weight(), attn.o_proj.kernel_weight(), mlp.gate_up_proj.kernel_weight(),
                    mlp.down_proj.kernel_weight(),
                    *((attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else ())))
            self._decode_layers = cpu_kernels.DecodeLayers(
                layers, self.norm.weight, self.rotary.cos, self.rotary.signed_sin, self.hparams.num_heads,
                self.hparams.num_kv_heads, self.hparams.rms_norm_eps)
        return self._decode_layers

    @property
    def output_head(self) -> nn.Module:
        """The LM head: its own layer, or the embedding table when the two are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32. Past a few rows computed as (W @ h^T)^T: for the tall
        vocabulary matrix BLAS runs that orientation 1.2-3x faster on CPU than h @ W^T."""
        head = self.output_head
        if isinstance(head, QuantizedWeight):
            return head.linear(hidden).float()
        weight = head.weight
        if cpu_kernels.linear_available(hidden, weight):
            return linear(hidden, weight).float()
        return torch.mm(weight, hidden.t()).t().float().contiguous()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copies HF-named tensors into our (partly fused) parameters; every one must be filled.
        A weight that arrives quantized (GGUF blocks kept as they are) replaces its layer with
        the quantized kind; the shards of a fused one are stacked in row order first."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        quantized: dict[str, list[tuple[int, QuantizedTensor]]] = {}
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
            if isinstance(tensor, QuantizedTensor):
                quantized.setdefault(target, []).append((0 if rows is None else rows[0], tensor))
            else:
                dest.copy_(tensor)
            rows_filled[target] += dest.shape[0]
        missing = [name for name, rows in rows_filled.items() if rows < params[name].shape[0]]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")
        for target, shards in quantized.items():
            if rows_filled[target] != sum(t.shape[0] for _, t in shards):
                raise ValueError(f"{target}: some shards are quantized and some are not")
            install_quantized(self, target, QuantizedTensor.cat([t for _, t in sorted(shards, key=lambda s: s[0])]))

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Our weights under their Hugging Face names, fused ones split back into their shards:
        what load_weights reads, so a model written out this way loads back as it is."""
        tensors: list[tuple[str, torch.Tensor | QuantizedTensor]] = list(self.named_parameters())
        for name, module in self.named_modules():
            if isinstance(module, QuantizedWeight):
                tensors.append((f"{name}.weight", module.qweight))
                if module.bias is not None:
                    tensors.append((f"{name}.bias", module.bias))
        for name, tensor in tensors:
            hf_name = name if name.startswith("lm_head.") else f"model.{name}"
            fused = next((part for part in name.split(".") if part in _SHARDS_OF), None)
            if fused is None:
                yield hf_name, tensor
                continue
            for shard, part in enumerate(_SHARDS_OF[fused]):
                start, count = self._shard_rows(fused, shard)
                rows = torch.arange(start, start + count)
                yield (hf_name.replace(fused, part),
                       tensor.rows(rows) if isinstance(tensor, QuantizedTensor) else tensor[start:start + count])

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
        s = self.hparams
        if fused == "qkv_proj":
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return (shard * s.intermediate_size, s.intermediate_size)
