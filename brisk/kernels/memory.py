"""Host memory for what the kernels stream every step: weights and the KV cache, in huge pages.

A decode step reads every weight once, and a 4 KiB page holds 4,096 of those bytes: the int4
model's 125 MB is 30,000 pages per step, and the core's TLB holds a few thousand entries, so
the stream walks page tables as it goes. A 2 MiB page covers 512 times as much. Measured on
the default model's shapes (Cascade Lake, 2 threads, huge and 4 KiB copies alternating in one
process): the 120 int4 layer products 4-7% faster, the Q8_0 head 5-10%; whole decode steps
1.5-4% faster at fp32, int4 and gguf alike (docs/architecture.md, "Weights and KV cache in huge pages").

Linux hands out transparent huge pages to memory that asks for them (`madvise`, the usual
setting of /sys/kernel/mm/transparent_hugepage/enabled) or to all of it (`always`), and only
in 2 MiB-aligned stretches of a private mapping: torch's allocator asks only when
THP_MEM_ALLOC_ENABLE is set, before its first allocation, and a model's layers are separate
tensors well under 2 MiB each. So the model's tensors are copied into one mapping of our own,
advised and aligned. Where the kernel says no (THP `never`, another OS), the same mapping of
4 KiB pages is used: nothing else changes.

The KV cache is allocated here too (kernels/kv_cache.py): decode attention streams it as the
products stream the weights.
"""

from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: every tensor starts on one, as the vector loads like
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
# Where each weight_buffer starts: move_to_huge_pages leaves a tensor there where it is. An
# address freed and reused by another mapping could be taken for one: that tensor would stay in
# 4 KiB pages, nothing worse.
_WEIGHT_BUFFERS: set[int] = set()


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros, starting on a 2 MiB boundary of a private anonymous mapping
    advised for huge pages. Pages are given on first touch; the tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _ADVICE is not None:
        try:
            mapping.madvise(_ADVICE)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages it is
            pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def weight_buffer(nbytes: int) -> torch.Tensor:
    """A huge_page_buffer for a large weight written once at load (kernels/cpu.py's tiles), which
    move_to_huge_pages then leaves where it is instead of copying it into its arena."""
    buffer = huge_page_buffer(nbytes)
    _WEIGHT_BUFFERS.add(buffer.untyped_storage().data_ptr())
    return buffer


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in huge pages when it spans one. Written
    through once, as torch.zeros is: the memory is taken now, not page by page mid-step."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_buffer(nbytes).zero_().view(dtype).view(shape)


def move_to_huge_pages(module: nn.Module) -> None:
    """Copies every CPU parameter and buffer of `module` into one huge-page mapping, each on a
    cache line (contiguous, values unchanged), but those in a weight_buffer already. Through Module._apply, as `.to()` moves tensors:
    modules that cache pointers to their tensors drop them there. A tensor reached twice (tied
    weights) is copied once. The old storage is freed tensor by tensor as it is replaced, so the
    peak is the model plus its largest tensor, not two models."""
    # sizes by id, not the tensors: a reference here would keep every old storage to the end
    sizes = {id(t): _padded(t) for t in [*module.parameters(), *module.buffers()] if _moves(t)}
    arena = huge_page_buffer(sum(sizes.values()))
    placed: dict[int, torch.Tensor] = {}
    offset = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        if id(t) not in sizes:
            return t
        if id(t) not in placed:
            copy = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            placed[id(t)] = copy.copy_(t)
            offset += sizes[id(t)]
        return placed[id(t)]

    module._apply(place)
    _return_freed_heap()


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors laid one after another, each on a cache line, in one huge-page
    mapping: what a step streams in this order reads one run of memory (a LoRA adapter's many
    small matrices: kernels/lora.py)."""
    arena = huge_page_buffer(sum(_padded(t) for t in tensors))
    copies, offset = [], 0
    for t in tensors:
        copies.append(arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t))
        offset += _padded(t)
    return copies


def _return_freed_heap() -> None:
    """The replaced tensors went back to glibc's heap, which keeps freed memory below its mmap
    threshold (up to 32 MiB a chunk) mapped: without a trim the move raised the int4 model's
    RSS by 90 MB; with it the RSS ends 140 MB under the unmoved model's."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def _moves(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.numel() > 0 and t.untyped_storage().data_ptr() not in _WEIGHT_BUFFERS


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
