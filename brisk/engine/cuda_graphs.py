"""Decode steps replayed from CUDA graphs: the model's forward captured once per batch size.

A decode step of a 135M-parameter model is some 300 small kernels whose work takes microseconds;
launched one by one from Python it is bound by the launches (tens of microseconds of Python and
driver time each). A CUDA graph records the whole forward once and replays it with one launch.

A graph replays fixed addresses and shapes, so a step's inputs are copied into static buffers
sized for the largest captured batch, and a batch of n runs in the graph of the smallest
captured size >= n (vLLM's padding). The padding rows' K/V writes go to a scratch block of
the pool that no sequence is given (ModelRunner allocates it), and their queries read that
block, so they can touch no sequence's cache. Block tables are as wide as the longest
sequence the engine admits, so any step's tables fit; the attention kernels stop at each
row's context length, so the graph's cost follows the real contexts, not the width.

Only plain decode steps replay: a step with prefill chunks, or a draft tree's masked rows,
runs eagerly (its shapes vary with the prompts, and prefill is bound by compute, not launches).

The capture itself is behind `GraphCapture`, so the tests drive the padding and buffers on CPU
through `EagerCapture`, which reruns the function where a graph would replay it.
"""

from __future__ import annotations

import bisect
from typing import Callable, Protocol

import torch

from brisk.kernels.attention import AttentionMetadata
from brisk.model.llama import LlamaForCausalLM
from brisk.kernels.kv_cache import KVCacheLayer


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every 8 up to max_num_seqs (which is always among
    them), as vLLM's defaults; padding wastes at most 7 rows."""
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s < max_num_seqs]
    return [*sizes, max_num_seqs]


class GraphCapture(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Records forward(); returns what replays it and the tensor each replay refills."""


class CudaGraphCapture:
    """torch.cuda.graph, every graph in one memory pool: they never run at once, so their
    intermediates can share memory, as vLLM's do."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream(self.device)  # warm up off the capture (Triton compiles, cuBLAS picks)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return graph.replay, out


class EagerCapture:
    """A stand-in for CPU tests: 'replay' runs the function again into the same output."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = forward()
        return lambda: out.copy_(forward()), out


class DecodeGraphs:
    """A model's decode forward, captured for each of `sizes` batch sizes."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCacheLayer], sizes: list[int],
                 max_blocks_per_seq: int, scratch_block: int, capture: GraphCapture,
                 layer_groups: tuple[int, ...] | None = None):
        """layer_groups: each layer's group of block tables, where the layers keep K/V in groups
        (AttentionMetadata.layer_groups); every group gets its own static slots and tables."""
        device = kv_caches[0].v.device
        self.sizes = sorted(sizes)
        self.scratch_block = scratch_block
        self.layer_groups = layer_groups
        largest, groups = self.sizes[-1], 1 + max(layer_groups or (0,))
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_blocks = torch.full((groups, largest), scratch_block, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(largest, dtype=torch.long, device=device)
        self.block_tables = torch.full((groups, largest, max_blocks_per_seq), scratch_block, dtype=torch.long,
                                       device=device)
        self.context_lens = torch.ones(largest, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        for size in reversed(self.sizes):  # largest first: the pool is sized once, smaller graphs fit in it
            self._graphs[size] = capture.capture(
                lambda size=size: model(self.input_ids[:size], self.positions[:size], kv_caches, self._metadata(size)))

    def _metadata(self, size: int) -> AttentionMetadata:
        """Fresh for each call: what a layer derives from it (the torch path's masks) is built on
        first use and kept, and a graph must record building it, not a copy made in the warm-up."""
        groups = [AttentionMetadata(slot_blocks[:size], self.slot_offsets[:size], num_decodes=size,
                                    decode_block_tables=tables[:size], decode_context_lens=self.context_lens[:size])
                  for slot_blocks, tables in zip(self.slot_blocks, self.block_tables)]
        return AttentionMetadata.grouped(groups, self.layer_groups)

    def serves(self, meta: AttentionMetadata) -> bool:
        """Whether this step replays: plain decode rows only, no more than the largest size."""
        return (0 < meta.num_decodes <= self.sizes[-1] and not meta.prefills and meta.decode_ancestor_masks is None
                and meta.decode_block_tables.shape[1] <= self.block_tables.shape[2])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [n, hidden], as model(input_ids, positions, ..., meta)."""
        n = meta.num_decodes
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        for g, group in enumerate(meta.groups or [meta]):
            self.slot_blocks[g, :n].copy_(group.slot_blocks, non_blocking=True)
            self.block_tables[g, :n, :group.decode_block_tables.shape[1]].copy_(group.decode_block_tables,
                                                                               non_blocking=True)
        self.slot_offsets[:n].copy_(meta.slot_offsets, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        if n < size:  # rows padded in hold an earlier step's table and length: only their writes must move
            self.slot_blocks[:, n:size].fill_(self.scratch_block)
        replay, out = self._graphs[size]
        replay()
        return out[:n]
