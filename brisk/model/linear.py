"""Linear layers that pick the faster kernel for the batch at hand.

A decode step feeds a linear layer one row per sequence; with a few rows the layer is a stream
over its weights, and the C `linear_rows` kernel reads them twice as fast as BLAS on our CPUs.
Larger batches (prefill chunks, big decode batches) go to BLAS as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brisk.kernels import cpu as cpu_kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if cpu_kernels.linear_available(x, weight):
        return cpu_kernels.linear_rows(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def kernel_weight(self) -> cpu_kernels.KernelWeight:
        """The weight as the fused decode step reads it (quantized layers have the same method)."""
        return cpu_kernels.KernelWeight.dense(self.weight, self.bias)
