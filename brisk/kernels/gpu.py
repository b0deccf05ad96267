"""Where the Triton kernels serve, and their entry points: the GPU's counterpart of kernels/cpu.py.

Triton is imported on first use, so a CPU-only install needs none. The kernels serve CUDA
tensors. With `serve_cpu_tensors` set and TRITON_INTERPRET=1 (set before Triton loads) they
also serve CPU tensors, run by Triton's interpreter: that is how the tests run the model
through them on machines without a GPU. It is a switch of its own, not the environment
variable, so a test that sets the variable does not send every other test's torch path
through the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

from brisk.kernels.cpu import _wants_grad
from brisk.kernels.kv_cache import KVCacheLayer

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


serve_cpu_tensors = False


def available(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the Triton kernels serve activations like x (and tensors like others)."""
    device = x.device.type
    on_cpu = device == "cpu" and serve_cpu_tensors and os.environ.get("TRITON_INTERPRET") == "1"
    return ((device == "cuda" or on_cpu) and x.dtype in _DTYPES and not _wants_grad(x, *others)
            and _has_triton())


def attention_available(x: torch.Tensor, cache_layer: KVCacheLayer) -> bool:
    """Whether the attention and cache-write kernels serve activations like x with this cache."""
    if not available(x) or cache_layer.v.device != x.device:
        return False
    from brisk.kernels import triton_attention

    return triton_attention.serves(cache_layer)


def quant_available(x: torch.Tensor, weight_format: str) -> bool:
    """Whether the low-bit matmul kernels multiply activations like x by weights in this format."""
    if not available(x):
        return False
    from brisk.kernels.triton_quant import FORMATS

    return weight_format in FORMATS


def quant_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    from brisk.kernels import triton_quant

    return triton_quant.quant_linear(x, weight, bias)


def decode_attention(*args, **kwargs) -> None:
    from brisk.kernels import triton_attention

    triton_attention.decode_attention(*args, **kwargs)


def prefill_attention(*args, **kwargs) -> None:
    from brisk.kernels import triton_attention

    triton_attention.prefill_attention(*args, **kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from brisk.kernels import triton_layer_ops

    return triton_layer_ops.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    from brisk.kernels import triton_layer_ops

    triton_layer_ops.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from brisk.kernels import triton_layer_ops

    return triton_layer_ops.silu_mul(gate_up)


def rope_write_kv(*args, **kwargs) -> torch.Tensor:
    from brisk.kernels import triton_layer_ops

    return triton_layer_ops.rope_write_kv(*args, **kwargs)


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step's small host-made input as a tensor on device. To an accelerator it goes through
    pinned memory with a non-blocking copy: a copy from pageable memory makes the host wait for
    the GPU's queue, which would serialize building the next inputs with the step before it."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_many(columns: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Several int64 lists as tensors on device, in one transfer: each copy to a GPU costs some
    microseconds of launch whatever its size, and a step has about eight such inputs."""
    if device.type == "cpu":
        return [torch.tensor(column, dtype=torch.long) for column in columns]
    flat = to_device([value for column in columns for value in column], torch.long, device)
    return list(flat.split([len(column) for column in columns]))
