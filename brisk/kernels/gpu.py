"""The Triton kernels' backend: the GPU's counterpart of kernels/cpu.py's CBackend.

Triton is imported when the backend is built, so a CPU-only install needs none. The kernels
serve CUDA tensors. Built with `interpret=True` under TRITON_INTERPRET=1 (set before Triton
loads) they also serve CPU tensors, run by Triton's interpreter: that is how the tests run the
model through them on machines without a GPU. It is an argument of its own, not the
environment variable, so a test that sets the variable does not send every other model's torch
path through the interpreter. Inputs the kernels do not take (other dtypes, a cache whose block
size or head dim is not a power of two, formats other than int8 and int4, anything that wants a
gradient) go to the torch formulation.
"""

from __future__ import annotations

import os

import torch

from brisk.kernels.backend import KernelBackend, wants_grad
from brisk.kernels.kv_cache import KVCacheLayer
from brisk.kernels.transfer import to_device, to_device_many  # noqa: F401  (the runner's imports)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonBackend(KernelBackend):
    name = "triton"

    def __init__(self, interpret: bool = False):
        if interpret and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("serving CPU tensors through Triton's interpreter needs TRITON_INTERPRET=1, set "
                             "before Triton is imported")
        from brisk.kernels import triton_attention, triton_layer_ops, triton_quant

        self.interpret = interpret
        self._devices = ("cuda", "cpu") if interpret else ("cuda",)
        self._attention, self._layer_ops, self._quant = triton_attention, triton_layer_ops, triton_quant

    def __repr__(self) -> str:
        return f"TritonBackend(interpret={self.interpret})"

    def _serves(self, x: torch.Tensor, *others: torch.Tensor | None) -> bool:
        return x.device.type in self._devices and x.dtype in _DTYPES and not wants_grad(x, *others)

    def _attends(self, x: torch.Tensor, cache: KVCacheLayer) -> bool:
        return self._serves(x) and cache.v.device == x.device and self._attention.serves(cache)

    def rms_norm(self, x, weight, eps):
        if self._serves(x, weight):  # any shape: the kernel normalizes rows of [T, n]
            return self._layer_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if self._serves(x, weight):
            self._layer_ops.add_rms_norm(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def act_mul(self, gate_up, activation):
        if self._serves(gate_up):
            return self._layer_ops.act_mul(gate_up, activation)
        return super().act_mul(gate_up, activation)

    def rope_write_kv(self, qkv, rope, cache, meta, num_heads, q_norm, k_norm, eps):
        if self._attends(qkv, cache):
            return self._layer_ops.rope_write_kv(qkv, rope.positions, rope.cos, rope.signed_sin, cache,
                                                 meta.slot_blocks, meta.slot_offsets, num_heads, q_norm, k_norm, eps)
        return super().rope_write_kv(qkv, rope, cache, meta, num_heads, q_norm, k_norm, eps)

    def decode_attention(self, q, cache, meta, scale, out, window=0, positions=None):
        if self._attends(q, cache):
            self._attention.decode_attention(q, cache, meta.decode_block_tables, meta.decode_context_lens, scale, out,
                                             meta.decode_ancestor_masks, window, positions)
        else:
            super().decode_attention(q, cache, meta, scale, out, window, positions)

    def prefill_attention(self, q, cache, meta, scale, out, window=0):
        """Every prefill chunk of the step in one launch."""
        if self._attends(q, cache):
            batch = meta.prefill_batch()
            self._attention.prefill_attention(q, cache, batch.starts, batch.lengths, batch.context_lens,
                                              batch.block_tables, batch.max_length, scale, out, window)
        else:
            super().prefill_attention(q, cache, meta, scale, out, window)

    def quant_linear(self, x, layer, lora=None):
        if self._serves(x) and layer.format in self._quant.FORMATS:
            return self.adapted(self._quant.quant_linear(x, layer.qweight, layer.bias), x, lora)
        return super().quant_linear(x, layer, lora)
