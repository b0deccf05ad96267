"""Whole token sequences through the model at once, outside the engine.

Training and offline scoring (Medusa's features, distillation's teacher targets and student
steps) want the final hidden state at every position of many known sequences, with no requests,
scheduler or block manager. Each sequence becomes a fresh prefill span over its own run of blocks
in a scratch paged cache, so this is the engine's own prefill path. Under autograd the C kernels
step aside (they have no backward) and the torch path carries the gradient through the cache
writes and reads; the scratch cache is new on every call so no graph outlives its step.
"""

from __future__ import annotations

import torch

from brisk.kernels.attention import AttentionMetadata, PrefillSpan
from brisk.kernels.lora import LoRABatch
from brisk.model.llama import LlamaForCausalLM
from brisk.kernels.kv_cache import KVCacheLayer

BLOCK_SIZE = 16  # of the scratch cache


def forward_sequences(model: LlamaForCausalLM, token_lists: list[list[int]],
                      lora: LoRABatch | None = None) -> torch.Tensor:
    """[sum of lengths, hidden]: each sequence's final hidden states, in order, from position 0;
    lora: the rows' adapters (training/lora.py trains one through it)."""
    device, hparams = model.norm.weight.device, model.hparams
    input_ids, positions, meta = _prefill_batch(token_lists, device)
    kind = str(model.norm.weight.dtype).removeprefix("torch.")
    blocks = sum(_blocks(len(tokens)) for tokens in token_lists)
    caches = [KVCacheLayer.allocate(kind, blocks, hparams.num_kv_heads, BLOCK_SIZE, hparams.head_dim, device)
              for _ in range(hparams.num_layers)]
    return model(input_ids, positions, caches, meta, lora)


def packs(lengths: list[int], tokens_per_pack: int) -> list[list[int]]:
    """Sequence indices grouped, in order, into packs of about `tokens_per_pack` tokens (a
    longer sequence is a pack of its own)."""
    result, size = [[]], 0
    for i, n in enumerate(lengths):
        if result[-1] and size + n > tokens_per_pack:
            result.append([])
            size = 0
        result[-1].append(i)
        size += n
    return result


def _blocks(length: int) -> int:
    return -(-length // BLOCK_SIZE)


def _prefill_batch(token_lists: list[list[int]], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Whole sequences as fresh prefill spans, each over its own run of scratch blocks."""
    ids, positions, slot_blocks, spans = [], [], [], []
    row, first_block = 0, 0
    for tokens in token_lists:
        n, count = len(tokens), _blocks(len(tokens))
        table = torch.arange(first_block, first_block + count, device=device)
        ids.extend(tokens)
        positions.extend(range(n))
        slot_blocks.extend(first_block + p // BLOCK_SIZE for p in range(n))
        spans.append(PrefillSpan(row, row + n, n, table))
        row, first_block = row + n, first_block + count
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    meta = AttentionMetadata(slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
                             slot_offsets=positions_t % BLOCK_SIZE, prefills=spans)
    return torch.tensor(ids, dtype=torch.long, device=device), positions_t, meta
