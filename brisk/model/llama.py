"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3) over one flat token batch.

Gemma 3 is Llama with a few switches, each an HParams/Architecture field read here once: GELU
instead of SiLU in the gated MLP, norms on the attention's and the MLP's outputs (sandwich
norms), embeddings scaled by sqrt(hidden), a query scale of its own, and sliding-window layers
with their own RoPE base.

Differences from transformers' modules, all for speed: q/k/v and gate/up are fused into one
matmul each, RoPE tables are shared by every layer, attention reads K/V through block tables
(kernels/attention.py). Every op runs in the model's kernel backend (`kernels`, chosen once
when the model loads: kernels/backend.py), which every layer holds: on CPU the work between the
matmuls runs in fused C kernels (residual add + RMSNorm in place, RoPE + the K/V cache write,
SiLU-and-multiply: kernels/layer_ops.h, kernels/attention.h), on GPUs in their Triton
counterparts (kernels/triton_layer_ops.py), elsewhere in torch (KernelBackend, their reference).
Small decode steps on CPU run every layer in one C call (kernels/decode_layers.c). A step with
LoRA adapters (a kernels/lora.py LoRABatch: which rows are whose) adds each adapter's update to
its own rows after each of a layer's four projections, in every path. Weights keep
Hugging Face names on the way in, so any HF checkpoint or a GGUF file renamed to HF names loads
through `load_weights`.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.attention import AttentionMetadata
from brisk.kernels.backend import KernelBackend
from brisk.kernels.kv_cache import KVCacheLayer
from brisk.kernels.lora import LoRABatch, LoRAUpdate
from brisk.kernels.packed import QuantizedTensor
from brisk.model.hparams import HParams
from brisk.model.linear import Linear
from brisk.model.rope import Rope, RotaryEmbedding
from brisk.quant.modules import QuantizedWeight, install_quantized


class RMSNorm(nn.Module):
    """RMSNorm that can take the residual stream along, as vLLM's does: `norm(x)` normalizes;
    `norm(x, residual)` first adds x into the residual and returns (normalized, residual). On CPU
    the fused kernel does both in place, in one pass, with no temporaries."""

    def __init__(self, dim: int, eps: float, kernels: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


def project(linear: nn.Module, x: torch.Tensor, lora: LoRABatch | None, layer: int, name: str) -> torch.Tensor:
    """linear(x), plus the step's adapters' updates of projection `name` of `layer` on their rows
    (the linear layer adds them: the C kernels in the product's own call)."""
    return linear(x) if lora is None else linear(x, LoRAUpdate(lora, layer, name))


class Attention(nn.Module):
    """window: positions each query sees (its own included), 0 for all of them; index: the layer's."""

    def __init__(self, hparams: HParams, kernels: KernelBackend, window: int = 0, index: int = 0):
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = hparams.num_heads, hparams.num_kv_heads, hparams.head_dim
        self.q_size = hparams.num_heads * hparams.head_dim
        self.kv_size = hparams.num_kv_heads * hparams.head_dim
        self.scale = hparams.attention_scale
        self.window = window
        self.kernels = kernels
        self.qkv_proj = Linear(hparams.hidden_size, self.q_size + 2 * self.kv_size, hparams.attention_bias, kernels)
        self.o_proj = Linear(self.q_size, hparams.hidden_size, False, kernels)
        self.q_norm = RMSNorm(hparams.head_dim, hparams.rms_norm_eps, kernels) if hparams.qk_norm else None
        self.k_norm = RMSNorm(hparams.head_dim, hparams.rms_norm_eps, kernels) if hparams.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCacheLayer, meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; this step's rotated K and V go into the cache first."""
        norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        qkv = project(self.qkv_proj, x, lora, self.index, "qkv")
        q = self.kernels.rope_write_kv(qkv, rope, kv_cache, meta, self.num_heads, *norms)
        out = self.kernels.paged_attention(q, kv_cache, meta, self.scale, self.window, rope.positions)
        return project(self.o_proj, out.view(x.shape[0], self.q_size), lora, self.index, "o")


class MLP(nn.Module):
    def __init__(self, hparams: HParams, kernels: KernelBackend, index: int = 0):
        super().__init__()
        self.index = index
        self.kernels = kernels
        self.gate_up_proj = Linear(hparams.hidden_size, 2 * hparams.intermediate_size, False, kernels)
        self.down_proj = Linear(hparams.intermediate_size, hparams.hidden_size, False, kernels)
        self.activation = hparams.family.hidden_act

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        hidden = self.kernels.act_mul(project(self.gate_up_proj, x, lora, self.index, "gate_up"), self.activation)
        return project(self.down_proj, hidden, lora, self.index, "down")


class DecoderLayer(nn.Module):
    """Llama's layer; with sandwich norms (Gemma) the attention's and the MLP's outputs are
    normalized before they join the residual stream. `post_attention_layernorm` is the norm
    before the MLP in every family (Gemma's checkpoints call it pre_feedforward_layernorm)."""

    def __init__(self, hparams: HParams, kernels: KernelBackend, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hparams.hidden_size, hparams.rms_norm_eps, kernels)
        self.self_attn = Attention(hparams, kernels, hparams.window(index), index)
        self.post_attention_layernorm = RMSNorm(hparams.hidden_size, hparams.rms_norm_eps, kernels)
        self.mlp = MLP(hparams, kernels, index)
        sandwich = hparams.family.sandwich_norms
        self.attention_output_norm = RMSNorm(hparams.hidden_size, hparams.rms_norm_eps, kernels) if sandwich else None
        self.mlp_output_norm = RMSNorm(hparams.hidden_size, hparams.rms_norm_eps, kernels) if sandwich else None
        self.local_rope = hparams.local_rope_theta is not None and hparams.window(index) > 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: KVCacheLayer,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's input, the residual stream before it) -> the same for the next layer.
        The first layer gets the embeddings as x and no residual."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta, lora)
        if self.attention_output_norm is not None:
            x = self.attention_output_norm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x, lora)
        if self.mlp_output_norm is not None:
            x = self.mlp_output_norm(x)
        return x, residual


def is_norm(hf_name: str) -> bool:
    """Whether a checkpoint tensor is a norm's weight (every family names them ...norm.weight)."""
    return hf_name.endswith("norm.weight")


# HF checkpoint names that land in a slice of one of our fused parameters: (fused name, shard index).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_SHARDS_OF = {fused: [hf for hf, (f, _) in _FUSED_SHARDS.items() if f == fused] for fused, _ in _FUSED_SHARDS.values()}


class LlamaForCausalLM(nn.Module):
    """kernels: the backend every layer runs its ops in (the loader's `choose_backend`); a
    model's backend changes only through `use_kernels`, which hands the new one to every layer."""

    def __init__(self, hparams: HParams, max_len: int, kernels: KernelBackend):
        super().__init__()
        self.hparams = hparams
        self.kernels = kernels
        # Uninitialized, as every weight here: the loader fills it from the file (and normal_, the
        # random init, imports sympy on the meta device: see model/loader.py's load_model).
        self.embed_tokens = nn.Embedding(hparams.vocab_size, hparams.hidden_size,
                                         _weight=torch.empty(hparams.vocab_size, hparams.hidden_size))
        # Gemma scales embeddings in the model's dtype, as transformers does (sqrt(640) is 25.25 in bf16)
        self.embed_scale = hparams.hidden_size ** 0.5 if hparams.family.scaled_embeddings else None
        self.layers = nn.ModuleList(DecoderLayer(hparams, kernels, i) for i in range(hparams.num_layers))
        self.norm = RMSNorm(hparams.hidden_size, hparams.rms_norm_eps, kernels)
        self.lm_head = None if hparams.tie_word_embeddings else Linear(hparams.hidden_size, hparams.vocab_size, False, kernels)
        self.rotary = RotaryEmbedding(hparams, max_len)
        self.local_rotary = RotaryEmbedding(hparams, max_len, local=True) if hparams.local_rope_theta is not None else None
        self._decode_layers = None  # the fused decode step, built on first use
        self._decode_groups: tuple[int, ...] | None = None  # the layer grouping it was built for

    def build_rope(self, device: torch.device) -> None:
        """The RoPE tables, once the module is off the meta device (model/rope.py)."""
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.build(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]: the first layer's input."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def use_kernels(self, kernels: KernelBackend) -> None:
        """Runs the model in another backend from now on (tests compare backends on one model)."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels
        self._decode_layers = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states (logits are taken only where needed);
        lora: the step's rows' adapters, or None.
        Small pure-decode steps run every layer in one call where the backend fuses them (the
        C kernels: kernels/decode_layers.c); at batch 1, Python's dispatch per layer was more
        than the layer's own work outside the matmuls."""
        x, residual = self.embed(input_ids), None
        if self.kernels.fuses_decode(meta.num_decodes, len(meta.prefills), self.norm.weight, kv_caches[0]):
            return self._fused_decode(meta.layer_groups)(x.float(), positions, meta, kv_caches, lora=lora).to(x.dtype)
        rope = self.rotary.at(positions)
        local_rope = self.local_rotary.at(positions) if self.local_rotary is not None else rope
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, local_rope if layer.local_rope else rope, kv_cache, meta.for_layer(i), lora)
        return self.norm(x, residual)[0]

    def _apply(self, fn, *args, **kwargs):
        """Moving or casting the weights (Module.to and friends) swaps their storage: the fused
        step's pointer tables are rebuilt on the next decode step."""
        self._decode_layers = None
        return super()._apply(fn, *args, **kwargs)

    def _fused_decode(self, layer_groups: tuple[int, ...] | None):
        """The layers' weights as the fused kernel reads them; built on the first decode step,
        once the weights are loaded and the RoPE tables built, and again for another grouping
        of the layers' block tables (AttentionMetadata.layer_groups)."""
        if self._decode_layers is None or self._decode_groups != layer_groups:
            self._decode_groups = layer_groups
            layers = []
            weight = lambda norm: None if norm is None else norm.weight  # noqa: E731
            for i, layer in enumerate(self.layers):
                attn, mlp = layer.self_attn, layer.mlp
                rotary = self.local_rotary if layer.local_rope else self.rotary
                layers.append(cpu_kernels.DecodeLayerWeights(
                    layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                    attn.qkv_proj.kernel_weight(), attn.o_proj.kernel_weight(), mlp.gate_up_proj.kernel_weight(),
                    mlp.down_proj.kernel_weight(), rotary.cos, rotary.signed_sin, attn.window,
                    layer_groups[i] if layer_groups else 0, weight(attn.q_norm), weight(attn.k_norm), weight(layer.attention_output_norm),
                    weight(layer.mlp_output_norm)))
            self._decode_layers = self.kernels.decode_layers(
                layers, self.norm.weight, self.hparams.num_heads, self.hparams.num_kv_heads, self.hparams.rms_norm_eps,
                self.hparams.attention_scale, self.hparams.family.hidden_act)
        return self._decode_layers

    @property
    def output_head(self) -> nn.Module:
        """The LM head: its own layer, or the embedding table when the two are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 (kernels.lm_head: past a few rows as (W @ h^T)^T, the
        orientation BLAS runs faster for the tall vocabulary matrix)."""
        head = self.output_head
        if isinstance(head, QuantizedWeight):
            return head.linear(hidden).float()
        return self.kernels.lm_head(hidden, head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copies HF-named tensors into our (partly fused) parameters; every one must be filled.
        A weight that arrives quantized (GGUF blocks kept as they are) replaces its layer with
        the quantized kind; the shards of a fused one are stacked in row order first."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        quantized: dict[str, list[tuple[int, QuantizedTensor]]] = {}
        for hf_name, tensor in weights:
            target, rows = self.locate(hf_name)
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
            install_quantized(self, target, [t for _, t in sorted(shards, key=lambda s: s[0])])

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Our weights under their Hugging Face names and values (a Gemma norm's 1 + w back to w,
        see Architecture.hf_norm_offset), fused ones split back into their shards: what an HF
        folder holds, so a model written out this way loads back as it is."""
        tensors: list[tuple[str, torch.Tensor | QuantizedTensor]] = list(self.named_parameters())
        for name, module in self.named_modules():
            if isinstance(module, QuantizedWeight):
                tensors.append((f"{name}.weight", module.qweight))
                if module.bias is not None:
                    tensors.append((f"{name}.bias", module.bias))
        renames = {ours: theirs for theirs, ours in self.hparams.family.hf_module_names}
        for name, tensor in tensors:
            name = ".".join(renames.get(part, part) for part in name.split("."))
            hf_name = name if name.startswith("lm_head.") else f"model.{name}"
            fused = next((part for part in name.split(".") if part in _SHARDS_OF), None)
            if fused is None or self.hparams.family.hf_fused_projections:
                yield hf_name, tensor - self.hparams.family.hf_norm_offset if is_norm(hf_name) else tensor
                continue
            for shard, part in enumerate(_SHARDS_OF[fused]):
                start, count = self._shard_rows(fused, shard)
                rows = torch.arange(start, start + count)
                yield (hf_name.replace(fused, part),
                       tensor.rows(rows) if isinstance(tensor, QuantizedTensor) else tensor[start:start + count])

    def locate(self, hf_name: str) -> tuple[str | None, tuple[int, int] | None]:
        """HF name -> (our parameter name, (first row, row count) inside it or None for all of it)."""
        if "rotary_emb" in hf_name:
            return None, None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None  # tied: some checkpoints store the copy anyway
        renames = dict(self.hparams.family.hf_module_names)
        parts = [renames.get(part, part) for part in name.split(".")]
        for i, part in enumerate(parts):
            if part in _FUSED_SHARDS:
                fused, shard = _FUSED_SHARDS[part]
                parts[i] = fused
                return ".".join(parts), self._shard_rows(fused, shard)
        return ".".join(parts), None

    def _shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        s = self.hparams
        if fused == "qkv_proj":
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return (shard * s.intermediate_size, s.intermediate_size)
