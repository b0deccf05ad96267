"""Linear layers that run through the model's kernel backend.

A decode step feeds a linear layer one row per sequence; with a few rows the layer is a stream
over its weights, and the C backend's `linear_rows` kernel reads them twice as fast as BLAS on
our CPUs. Larger batches (prefill chunks, big decode batches) go to BLAS as usual: the backend
decides (kernels/cpu.py: CBackend.linear).
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend
from brisk.kernels.lora import LoRAUpdate


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: KernelBackend):
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels

    def forward(self, x: torch.Tensor, lora: LoRAUpdate | None = None) -> torch.Tensor:
        """x @ W^T (+ bias), plus `lora`'s update (the step's adapters' on their rows) where there is one."""
        return self.kernels.adapted(self.kernels.linear(x, self.weight, self.bias), x, lora)

    def kernel_weight(self) -> cpu_kernels.KernelWeight:
        """The weight as the fused decode step reads it (quantized layers have the same method)."""
        return cpu_kernels.KernelWeight.dense(self.weight, self.bias)

