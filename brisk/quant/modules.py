"""Layers whose weight is a QuantizedTensor, and the conversion of a model's layers to them.

A quantized layer keeps its format's tensors as buffers (so Module.to moves them) and runs its
product in the model's kernel backend: the C kernels read a `KernelWeight` built once from the
buffers; on GPUs int8 and int4 (GGUF's Q4 blocks too) run in Triton (kernels/triton_quant.py),
reading the codes as stored. Elsewhere (fp8, nf4, int5 and GGUF's Q8_0 and K-quant blocks on a
GPU, mixed weights there, no C compiler) the backend multiplies by the dequantized matrix in torch.
A mixed weight (a fused projection whose shards a GGUF file stores in different formats) keeps
each part's tensors as buffers of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend
from brisk.kernels.lora import LoRAUpdate
from brisk.quant.formats import MixedTensor, QuantizedTensor, quantize, stack

# `quantization` values that convert a floating-point model after loading, and "gguf", which
# keeps a GGUF file's own blocks.
LOAD_TIME_METHODS = ("int8", "fp8", "int4", "nf4")
METHODS = (*LOAD_TIME_METHODS, "gguf", "w8a8")  # w8a8: int8 weights, int8 activations
OUTLIER_THRESHOLD = 6.0  # LLM.int8()'s: activations above it are rare, and they matter


class QuantizedWeight(nn.Module):
    """The buffers of one QuantizedTensor, and its kernel view. kernels: the model's backend."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None, *, kernels: KernelBackend):
        super().__init__()
        self.kernels = kernels
        self._kernel_weight: cpu_kernels.KernelWeight | None = None
        self._hold(weight)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.int8_activations = False  # see set_int8_activations

    def _hold(self, weight: QuantizedTensor) -> None:
        """Keeps `weight`'s tensors as this layer's buffers, in place of any it held (the kernel
        view, which points into the old ones, is dropped)."""
        if hasattr(self, "_layouts"):
            for i in range(len(self._layouts)):
                for name in self._buffer_names(i):
                    delattr(self, name)
        self.format, self.shape, self.group_size = weight.format, weight.shape, weight.group_size
        parts = weight.parts if isinstance(weight, MixedTensor) else (weight,)
        self._layouts = [(part.format, part.shape, part.group_size) for part in parts]  # the parts' own
        for i, part in enumerate(parts):
            for name, tensor in zip(self._buffer_names(i), (part.data, part.scales, part.mins)):
                self.register_buffer(name, tensor)
        self._kernel_weight = None

    def _buffer_names(self, part: int) -> tuple[str, str, str]:
        """codes, scales, mins; a mixed weight's part i: part{i}_codes, ..."""
        prefix = f"part{part}_" if self.format == "mixed" else ""
        return f"{prefix}codes", f"{prefix}scales", f"{prefix}mins"

    @property
    def qweight(self) -> QuantizedTensor:
        parts = [QuantizedTensor(fmt, shape, *(getattr(self, name) for name in self._buffer_names(i)), group)
                 for i, (fmt, shape, group) in enumerate(self._layouts)]
        return MixedTensor.of(parts) if self.format == "mixed" else parts[0]

    def kernel_weight(self) -> cpu_kernels.KernelWeight:
        """The weight as kernels/quant.h reads it; built on first use."""
        if self._kernel_weight is None:
            self._kernel_weight = cpu_kernels.KernelWeight.quantized(self.qweight, self.bias, self.int8_activations)
        return self._kernel_weight

    def _apply(self, fn, *args, **kwargs):
        self._kernel_weight = None  # the buffers move: the kernel view points at the old ones
        return super()._apply(fn, *args, **kwargs)

    def linear(self, x: torch.Tensor, lora: LoRAUpdate | None = None) -> torch.Tensor:
        """x [T, cols] @ W^T (+ bias) -> [T, rows], in x's dtype, plus `lora`'s update."""
        if (self.int8_activations and self.format == "int8" and x.device.type == "cpu"
                and x.shape[0] > cpu_kernels.QUANT_MATVEC_MAX_ROWS):
            return self.kernels.adapted(self._integer_gemm(x), x, lora)
        return self.kernels.quant_linear(x, self, lora)

    def _integer_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """More than 8 rows (prefill chunks, big decode batches) of int8 weights with int8
        activations: each row of x rounded to int8 with its own scale, and one int8 x int8 ->
        int32 product by oneDNN (`torch._int_mm`), whose kernels use AVX512-VNNI / AMX where the CPU
        has them. Up to 8 rows, kernels/quant.h's matvec reads each weight block once for all rows,
        scaling activations per block of 32 (finer; the integer GEMM needs one scale per row).

        A row's scale is set by its largest value, and a few feature columns carry values far
        above the rest: rounded with them, the others lose most of their bits. As in LLM.int8(),
        columns holding any value above OUTLIER_THRESHOLD are taken out and multiplied in float.
        Measured on the default model (4,096 tokens of text): perplexity +3.3% over int8 weights
        alone with every column rounded, +0.56% with the outliers in float (27 columns per
        product on average). The rounding and the scaling of the result run in C (quant_linear.c),
        one pass each, in the C backend: in torch they took longer than the product."""
        x32 = x.float().contiguous()
        codes, row_scales, outliers = self.kernels.quantize_rows_int8(x32, OUTLIER_THRESHOLD)
        acc = torch._int_mm(codes, self.codes.t())
        out = self.kernels.scale_int32(acc, row_scales, self.scales, self.bias)
        if len(outliers):
            out.addmm_(x32[:, outliers], self.codes[:, outliers].t().float().mul_(self.scales))
        return out.to(x.dtype)


class QuantizedLinear(QuantizedWeight):
    def forward(self, x: torch.Tensor, lora: LoRAUpdate | None = None) -> torch.Tensor:
        return self.linear(x, lora)


class QuantizedEmbedding(QuantizedWeight):
    """An embedding table in a low-bit format: a lookup dequantizes just the rows it reads. With
    tied embeddings it doubles as the LM head (`linear`)."""

    def __init__(self, weight: QuantizedTensor, dtype: torch.dtype, *, kernels: KernelBackend):
        super().__init__(weight, kernels=kernels)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids).dequantize().to(self.dtype)


def head_method(method: str) -> str:
    """The format of the embedding table and LM head: 8 bits whatever the layers get. The head
    is a fifth of this model's weights and decides every token; 4 bits there costs the most
    quality per byte saved (as llama.cpp, which keeps it at 6 or 8 bits)."""
    return "fp8" if method == "fp8" else "int8"


def quantize_model(model: nn.Module, method: str, group_size: int = 32) -> None:
    """Converts a loaded model in place: every nn.Linear to `method`, the embedding table (and
    with it a tied LM head) and an untied LM head to `head_method(method)`. The new layers run
    in the model's backend (`model.kernels`)."""
    kernels = model.kernels
    if method not in LOAD_TIME_METHODS:
        raise ValueError(f"unknown quantization {method!r}: choose one of {', '.join(LOAD_TIME_METHODS)}")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            fmt = head_method(method) if name == "lm_head" else method
            _replace(model, name, QuantizedLinear(quantize(module.weight, fmt, group_size), module.bias,
                                                  kernels=kernels))
        elif isinstance(module, nn.Embedding):
            qweight = quantize(module.weight, head_method(method), group_size)
            _replace(model, name, QuantizedEmbedding(qweight, module.weight.dtype, kernels=kernels))


def set_int8_activations(model: nn.Module) -> None:
    """Makes every quantized layer whose format has an integer product (int8, int4, GGUF blocks)
    round its input to int8 per block of 32 and multiply in integers (kernels/quant.h): faster on
    CPUs, at the cost of the activation's rounding. Layers in fp8 or nf4 keep float inputs. Each
    layer then keeps its weight in the layout the backend's integer products read (on CPU, GGUF's
    blocks in tiles of 16 rows: packed.py's TILED), in place of the one it had: the same bytes,
    once."""
    for module in model.modules():
        if isinstance(module, QuantizedWeight) and cpu_kernels.takes_int8_activations(module.qweight):
            module.int8_activations = True
            module._hold(module.kernels.weight_layout(module.qweight, True))


def weight_footprint(model: nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of a model's weights, quantized layers counted by the matrix they
    stand for and the bytes they store."""
    count = size = 0
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            count += module.shape[0] * module.shape[1]
            size += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
        for p in module.parameters(recurse=False):
            count, size = count + p.numel(), size + p.numel() * p.element_size()
    return count, size


def install_quantized(model: nn.Module, param_name: str, shards: list[QuantizedTensor]) -> None:
    """Puts a weight loaded already quantized (GGUF blocks) in place of the float parameter
    `param_name` ("...weight"), whose layer becomes the quantized kind, in the model's backend.
    shards: the weight's row blocks in order (q, k and v of a fused projection), stacked here:
    into one tensor where they share a format, else a MixedTensor of one part per format run."""
    weight = stack(shards)
    name = param_name.removesuffix(".weight")
    module = model.get_submodule(name)
    if isinstance(module, nn.Embedding):
        _replace(model, name, QuantizedEmbedding(weight, module.weight.dtype, kernels=model.kernels))
    else:
        _replace(model, name, QuantizedLinear(weight, module.bias, kernels=model.kernels))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
