"""The kernel backend: every operation the layers and the sampler call, chosen once per model.

`choose_backend(device)` picks one when a model loads: the C kernels on a CPU with a C compiler
(kernels/cpu.py: `CBackend`), the Triton kernels on a CUDA GPU with Triton (kernels/gpu.py:
`TritonBackend`), and this class, the torch formulation of every operation, where neither
exists. The model carries it (`LlamaForCausalLM.kernels`) and hands it to its layers; the
sampler takes it as an argument. No layer asks which kernels exist: a layer calls
`kernels.rms_norm(...)` and the backend runs it.

`KernelBackend` itself is the reference the other two are tested against, and what they fall
back to (`super()`) for inputs their kernels do not take: a dtype they lack, a shape past their
limits, tensors that want a gradient (training runs the model under autograd, and no kernel
has a backward). Those are cheap checks of the inputs, made inside the backend.

Nothing here imports the rest of brisk: the kernels are the ground floor. Arguments that come
from the model (a step's `AttentionMetadata` is kernels/attention.py's; `rope` is
model/rope.py's Rope; a quantized `layer` is quant/modules.py's QuantizedWeight) are read
through the few attributes named where they are used.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from brisk.kernels.attention import AttentionMetadata, PrefillSpan, decode_attention_torch, prefill_attention_torch
from brisk.kernels.kv_cache import KVCacheLayer
from brisk.kernels.lora import LoRABatch, LoRAUpdate, lora_add_torch


# The gated MLPs' activations: SiLU (Llama, Qwen, Mistral), GELU with the tanh approximation
# (Gemma's gelu_pytorch_tanh). The C kernels number them in this order (layer_ops.h).
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see this op: no kernel has a backward, so training (Medusa heads,
    distillation) takes the torch formulation of every op whose inputs want a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class TargetLogprobs(NamedTuple):
    """What `target_logprobs` gives per row of logits: sample/logprobs.py makes logprobs of it."""

    lse: torch.Tensor  # [B] the row's log-sum-exp
    logprobs: torch.Tensor  # [B] the target's logprob
    ranks: torch.Tensor  # [B] the target's rank, 1 = most likely
    top_logits: torch.Tensor | None  # [B, k] the k largest logits, best first; None for k = 0
    top_ids: torch.Tensor | None  # [B, k] their token ids


class KernelBackend:
    """Every operation in torch: the reference, and the backend of hosts with neither a C
    compiler nor a GPU with Triton."""

    name = "torch"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # --- dense layers -------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ weight [n, k]^T (+ bias)."""
        return F.linear(x, weight, bias)

    def lm_head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[N, hidden] @ the vocabulary matrix^T -> float32 [N, vocab], computed as (W @ h^T)^T:
        for the tall vocabulary matrix BLAS runs that orientation 1.2-3x faster on CPU."""
        return torch.mm(weight, hidden.t()).t().float().contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * weight over the last dim of x, a new tensor."""
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, then its norm -> (normalized, the new residual). Kernels work in place,
        in x and residual; callers use the returned pair either way."""
        residual = residual + x
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """[T, 2I] (gate, then up) -> act(gate) * up [T, I]; activation one of ACTIVATIONS."""
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[activation](gate) * up

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, lora: LoRABatch, layer: int, projection: str) -> None:
        """In place on y [T, n], a projection's output for x [T, k]: each adapter of the step adds
        its update of that projection of that layer to its own rows (kernels/lora.py)."""
        lora_add_torch(y, x, lora, layer, projection)

    def adapted(self, y: torch.Tensor, x: torch.Tensor, lora: LoRAUpdate | None) -> torch.Tensor:
        """y, a projection's output for x, with `lora`'s update added in place where there is one."""
        if lora is not None:
            self.lora_add(y, x, *lora)
        return y

    # --- attention ----------------------------------------------------------------------------

    def rope_write_kv(self, qkv: torch.Tensor, rope, cache: KVCacheLayer, meta: AttentionMetadata, num_heads: int,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        """qkv [T, (H_q + 2 H_kv) * D] -> rotated q [T, H_q, D]; the rotated keys and the values
        go to each token's cache slot (meta.slot_blocks, meta.slot_offsets). q_norm, k_norm:
        Qwen3's per-head norm weights (or None), applied before the rotation. rope: the step's
        model/rope.py Rope (`apply` rotates [T, heads, D] by each token's position)."""
        t, (_, num_kv_heads, _, head_dim) = qkv.shape[0], cache.v.shape
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(t, num_heads, head_dim)
        k = k.view(t, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        cache.write(rope.apply(k), v.reshape(t, num_kv_heads, head_dim), meta.slot_blocks, meta.slot_offsets)
        return rope.apply(q)

    def paged_attention(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float,
                        window: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H_q, D] (contiguous) of this step's tokens, whose K/V are already in the cache
        -> [T, H_q, D]: the decode rows first, then the prefill spans (kernels/attention.py).
        window: each query sees the keys of its last `window` positions only (0: all); the decode
        rows' positions (positions[:num_decodes]) place it, since a speculative tree's row sits
        at a position below its slot."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            self.decode_attention(q[:nd], cache, meta, scale, out[:nd], window, positions)
        if meta.prefills:
            self.prefill_attention(q, cache, meta, scale, out, window)
        return out

    def decode_attention(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float,
                         out: torch.Tensor, window: int = 0, positions: torch.Tensor | None = None) -> None:
        """The step's decode rows q [num_decodes, H_q, D] -> out, one query per sequence."""
        out.copy_(decode_attention_torch(q, cache, meta, scale, window, positions))

    def prefill_attention(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float,
                          out: torch.Tensor, window: int = 0) -> None:
        """Every prefill span of the step (q and out: the whole step's rows), span by span."""
        for span in meta.prefills:
            self.span_attention(q[span.start:span.end], cache, span, scale, out[span.start:span.end], window)

    def span_attention(self, q: torch.Tensor, cache: KVCacheLayer, span: PrefillSpan, scale: float,
                       out: torch.Tensor, window: int = 0) -> None:
        """One span's queries q [L, H_q, D] -> out, causal by absolute position."""
        out.copy_(prefill_attention_torch(q, cache, span, scale, window))

    # --- a whole decode step ------------------------------------------------------------------

    def fuses_decode(self, num_decodes: int, num_prefills: int, weight: torch.Tensor, cache: KVCacheLayer) -> bool:
        """Whether a step of num_decodes decode rows and num_prefills prefill spans runs every
        layer in one call (`decode_layers`), for a model whose weights are like `weight` (a
        norm's: the model's dtype) with caches like `cache`."""
        return False

    def decode_layers(self, layers: list, final_norm: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float,
                      scale: float, activation: str):
        """The model's layers as one callable decode step; only where `fuses_decode` says yes."""
        raise NotImplementedError(f"the {self.name} backend has no fused decode step")

    # --- quantized weights --------------------------------------------------------------------

    def quant_linear(self, x: torch.Tensor, layer, lora: LoRAUpdate | None = None) -> torch.Tensor:
        """x [T, cols] @ W^T (+ bias) -> [T, rows] in x's dtype, for a quantized layer (its
        `qweight`, `bias`, `format` and `kernel_weight()`), plus `lora`'s update where there is
        one: here by the dequantized matrix."""
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return self.adapted(F.linear(x, layer.qweight.dequantize().to(x.dtype), bias), x, lora)

    def weight_layout(self, weight, int8_activations: bool):
        """The QuantizedTensor `weight` in the layout this backend's products read fastest (with
        int8 activations if asked), which a layer then keeps in place of its own: here as it is."""
        return weight

    def quantize_rows_int8(self, x: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [m, k] float32 -> (codes int8 [m, k], scales [m, 1], outlier columns): the columns
        holding any |value| above `threshold` are outliers (their codes 0); each row is rounded to
        the nearest of 255 levels spanning its own largest remaining magnitude, x ~ codes * scales
        off the outliers (a row with none left gets scale 1)."""
        outliers = (x.abs() > threshold).any(dim=0).nonzero().squeeze(1)
        inliers = x.index_fill(1, outliers, 0.0) if len(outliers) else x
        amax = inliers.abs().amax(dim=1, keepdim=True)
        inverse = torch.where(amax > 0, 127.0 / amax, 1.0)
        scales = torch.where(amax > 0, amax / 127.0, 1.0)
        return torch.round(inliers * inverse).to(torch.int8), scales, outliers

    def scale_int32(self, acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """acc int32 [m, n] * row_scales [m, 1] * col_scales [n] (+ bias [n]) -> float32."""
        out = acc.float().mul_(row_scales).mul_(col_scales)
        if bias is not None:
            out += bias
        return out

    # --- sampling -----------------------------------------------------------------------------

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
        """One token id per row of logits [B, V], by sample/sampler.py's rule (sorting the
        vocabulary when top-k or top-p is on). Per-row parameters are [B] tensors; uniforms
        float64 [B], or None when every row is greedy (temperature 0)."""
        if uniforms is None:
            return logits.argmax(dim=-1)
        greedy = temperature == 0
        inverse_t = torch.where(greedy, 1.0, temperature).reciprocal().unsqueeze(1)
        finite = logits.isfinite()
        top = logits.masked_fill(~finite, float("-inf")).amax(dim=-1, keepdim=True)
        weights = torch.where(finite, ((logits - top) * inverse_t).exp(), 0.0)
        weights = weights.masked_fill(weights < min_p.unsqueeze(1), 0.0)
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            weights = _top_k_top_p(weights, top_k, top_p)
        cumulative = weights.double().cumsum(dim=-1)
        target = uniforms.unsqueeze(1) * cumulative[:, -1:]
        last = weights.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)  # rounding can leave target >= sum
        tokens = torch.searchsorted(cumulative, target, right=True).squeeze(1).minimum(last)
        return torch.where(greedy, logits.argmax(dim=-1), tokens)

    def target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, k: int = 0) -> TargetLogprobs:
        """Per row of logits [B, V] and targets [B]: the row's log-sum-exp, the target's logprob
        and its rank (1 = most likely), and the row's k largest logits with their ids, with no
        [B, V] log-softmax built."""
        lse = torch.logsumexp(logits, dim=-1)
        target_logits = logits.gather(1, targets.unsqueeze(1))
        chosen = target_logits.squeeze(1) - lse
        ranks = (logits > target_logits).sum(dim=-1) + 1
        if not k:
            return TargetLogprobs(lse, chosen, ranks, None, None)
        top = logits.topk(k, dim=-1)
        return TargetLogprobs(lse, chosen, ranks, top.values, top.indices)

    def mask_rows(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place on logits [B, V]: row rows[g] keeps only the tokens whose bit is set in
        bitmask[g] (int32 [G, ceil(V/32)], llguidance's layout); the rest become -inf."""
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
        forbidden = torch.from_numpy(allowed).to(logits.device) == 0
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))


def _top_k_top_p(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zeroes every weight below each row's k-th largest, then below its nucleus edge."""
    ordered = weights.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, weights.shape[-1]).clamp_max(weights.shape[-1])
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    weights = weights.masked_fill(weights < kth, 0.0)
    ordered = ordered.masked_fill(ordered < kth, 0.0)
    cumulative = ordered.double().cumsum(dim=-1)
    goal = top_p.double().unsqueeze(1) * cumulative[:, -1:]
    edge_index = (cumulative < goal).sum(dim=-1, keepdim=True).clamp_max(weights.shape[-1] - 1)
    edge = torch.where(top_p.unsqueeze(1) < 1, ordered.gather(1, edge_index), 0.0)
    return weights.masked_fill(weights < edge, 0.0)


def choose_backend(device: torch.device) -> KernelBackend:
    """The backend for a model on `device`, chosen once when it loads: the C kernels on a CPU
    with a C compiler, Triton on a CUDA GPU where Triton is installed, torch elsewhere. A
    compiler that is present but fails to build a kernel raises on first use (KernelBuildError),
    never falls back."""
    if device.type == "cpu":
        from brisk.kernels import cpu

        return cpu.CBackend() if cpu._compiler() is not None else KernelBackend()
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from brisk.kernels.gpu import TritonBackend

        return TritonBackend()
    return KernelBackend()


def fast_dtype(device: torch.device) -> torch.dtype:
    """The dtype a model on `device` runs fastest in: bf16 on accelerators and on CPUs that
    multiply bf16 natively (half the bytes per decode step); fp32 on other CPUs, where bf16
    matmuls are emulated and slow."""
    if device.type != "cpu":
        return torch.bfloat16
    from brisk.kernels import cpu

    return torch.bfloat16 if cpu.native_bf16() else torch.float32
