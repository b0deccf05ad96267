"""Model runner: a SchedulerOutput in, one model forward, sampled tokens out.

It owns the KV cache tensors and builds, once per step, everything the layers share: the flat
token batch, positions, the slot of each token in the block pool, padded block tables for the
decodes and masks for prefill chunks that continue an earlier context. Logits are computed
only for rows that are sampled (and for prompt positions whose logprobs were asked for):
the vocabulary projection is 20% of the model's FLOPs per token.

A verify plan (engine/step_hook.py: a request's last token followed by k proposed tokens)
runs as that many decode rows of the one sequence, row i attending to the context up to its own
position:

    rows:      [ last | d0 | d1 | d2 ]          context lens  c+1, c+2, c+3, c+4
    samples:   [  t0  | t1 | t2 | t3 ]          t_i drawn as plain decoding would draw it

so the verify pass computes what plain decoding would, row for row (and small batches run in
the same fused decode kernel). The runner returns every row's sample; the step hook decides
which are kept.

Rows may also be alternatives for the same positions (a tree): they take slots c+1..c+k all
the same, each at the position the plan gives it and seeing only the rows its ancestor mask
lets it (AttentionMetadata.decode_ancestor_masks). Once the hook has picked the kept rows, their
K/V moves into the slots right after the context, where plain decoding would have put it
(move_slots):

    rows:     a   b   c   d         (two branches: a-b, c-d)
    slots:    c+1 c+2 c+3 c+4       positions: c+1 c+2 c+1 c+2
    kept c, d: K/V of slots c+3, c+4 -> c+1, c+2

On a GPU, a step of plain decode rows replays a CUDA graph of the forward (engine/cuda_graphs.py),
and the step's inputs cross in one pinned copy. A step whose sequences all decode greedily with
nothing else asked of their logits may run several passes, each fed the last one's tokens on
the device (the scheduler's `decode_passes`): the host then schedules and reads tokens once per
several passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brisk.engine.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture
from brisk.engine.kv_cache import KVCacheManager, KVLayout
from brisk.kernels.gpu import to_device, to_device_many
from brisk.kernels.kv_cache import KVCacheLayer
from brisk.engine.request import Request
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.engine.step_hook import SlotMove
from brisk.kernels.attention import AttentionMetadata, PrefillSpan
from brisk.kernels.lora import LoRABatch
from brisk.model.llama import LlamaForCausalLM
from brisk.sample.logprobs import TokenLogprobs, prompt_logprobs, token_logprobs
from brisk.sample.sampler import SamplingBatch, SamplingRow, sample


@dataclass
class RunnerOutput:
    # request id -> the tokens it gains: one per sampled row (the step hook narrows a verify
    # plan's rows to the tokens kept), or one per pass of a multi-pass step
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one entry per token of `sampled`
    # request id -> (the prompt position the first entry predicts, the entries of this step's chunk)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # the final hidden states of the sampled rows, in row order, and each request's first row
    # there (Medusa heads draft from them)
    hidden: torch.Tensor | None = None
    first_row: dict[str, int] = field(default_factory=dict)


@dataclass
class _PromptLogprobRows:
    request: Request
    rows: slice  # rows of the hidden states whose next token is a prompt token
    targets: list[int]  # those prompt tokens
    first_position: int  # the prompt position of targets[0]


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor
    sample_chunks: list[ScheduledChunk]  # each samples 1 + num_verify_rows consecutive rows
    prompt_logprob_rows: list[_PromptLogprobRows]
    lora: LoRABatch | None = None  # the rows' adapters, where any row has one


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCacheManager, kv_cache_dtype: str, device: torch.device):
        hp = model.hparams
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.vocab_size = hp.vocab_size
        # One per position in a group of layers (engine/kv_cache.py's KVLayout: one per layer for
        # most models), in the storage kind of kernels/kv_cache.py; see kernels/attention.py for the
        # layout. kv_caches[l] is layer l's. The pool has one block more than the manager hands
        # out: the padding rows of a CUDA graph write there (engine/cuda_graphs.py).
        self.layout = kv.layout or KVLayout.of((), hp.num_layers)
        tensors = [KVCacheLayer.allocate(kv_cache_dtype, kv.num_blocks + 1, hp.num_kv_heads, kv.block_size,
                                         hp.head_dim, device) for _ in range(self.layout.positions)]
        self.kv_caches = [tensors[p] for p in self.layout.position_of]
        self._layer_groups = self.layout.group_of if len(self.layout.groups) > 1 else None
        self.graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def capture_graphs(self, sizes: list[int], max_model_len: int, capture: GraphCapture | None = None) -> None:
        """Records the decode forward for these batch sizes (CUDA graphs unless `capture` says
        otherwise); later plain decode steps of up to max(sizes) sequences replay them."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, sizes, -(-max_model_len // self.block_size),
                                   scratch_block=self.kv.num_blocks, capture=capture or CudaGraphCapture(self.device),
                                   layer_groups=self._layer_groups)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        batch = self._prepare(sched)
        if sched.decode_passes > 1:
            return self._execute_decode_steps(batch, sched.decode_passes)
        hidden = self._forward(batch.input_ids, batch.positions, batch.attn, batch.lora)
        out = RunnerOutput()
        if batch.sample_chunks:
            self._sample(hidden[batch.sample_rows], batch.sample_chunks, out)
        for rows in batch.prompt_logprob_rows:
            entries = []
            for first in range(rows.rows.start, rows.rows.stop, PROMPT_LOGPROB_ROWS):
                last = min(first + PROMPT_LOGPROB_ROWS, rows.rows.stop)
                targets = rows.targets[first - rows.rows.start:last - rows.rows.start]
                entries += prompt_logprobs(self.model.compute_logits(hidden[first:last]), targets,
                                           rows.request.params.prompt_logprobs, self.model.kernels)
            out.prompt_logprobs[rows.request.request_id] = (rows.first_position, entries)
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                 lora: LoRABatch | None) -> torch.Tensor:
        if lora is None and self.graphs is not None and self.graphs.serves(attn):
            return self.graphs.run(input_ids, positions, attn)
        return self.model(input_ids, positions, self.kv_caches, attn, lora)

    def _execute_decode_steps(self, batch: _Batch, steps: int) -> RunnerOutput:
        """`steps` greedy decode passes, each fed the tokens the one before chose, on the device."""
        attn, input_ids, positions = batch.attn, batch.input_ids, batch.positions
        tokens = []
        for step in range(steps):
            input_ids = self.model.compute_logits(self._forward(input_ids, positions, attn, batch.lora)).argmax(dim=-1)
            tokens.append(input_ids)
            if step + 1 < steps:
                positions = positions + 1
                attn = AttentionMetadata.grouped([AttentionMetadata(
                    slot_blocks=g.decode_block_tables.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1),
                    slot_offsets=positions % self.block_size, num_decodes=attn.num_decodes,
                    decode_block_tables=g.decode_block_tables, decode_context_lens=attn.decode_context_lens + 1)
                    for g in attn.groups or [attn]], self._layer_groups)
        rows = torch.stack(tokens, dim=1).tolist()
        return RunnerOutput(sampled={c.request.request_id: row for c, row in zip(batch.sample_chunks, rows)})

    def _sample(self, hidden: torch.Tensor, chunks: list[ScheduledChunk], out: RunnerOutput) -> None:
        logits = self.model.compute_logits(hidden)
        rows = [row for c in chunks for row in _sampling_rows(c)]
        sampled = sample(logits, SamplingBatch.from_rows(rows, self.vocab_size, self.device), self.model.kernels)
        tokens = sampled.token_ids.tolist()
        entries = None
        if sampled.logprobs is not None:
            entries = token_logprobs(sampled.logprobs, tokens, [r.params.logprobs for r in rows])
        out.hidden = hidden
        first = 0
        for chunk in chunks:
            rid, end = chunk.request.request_id, first + 1 + chunk.num_verify_rows
            out.sampled[rid] = tokens[first:end]
            if entries is not None and entries[first] is not None:
                out.logprobs[rid] = entries[first:end]
            out.first_row[rid] = first
            first = end

    @torch.inference_mode()
    def move_slots(self, moves: list[SlotMove]) -> None:
        """Moves K/V between slots of the same sequences (a step hook's verdict on verified rows)."""
        if not moves:
            return
        def locate(tables: dict[str, list[int]], slots: list[tuple[str, int]]) -> torch.Tensor:
            """[2, moves]: the slots' block ids in `tables`, and their offsets."""
            return torch.tensor([[tables[rid][slot // self.block_size], slot % self.block_size] for rid, slot in slots],
                                dtype=torch.long, device=self.device).t()

        for group, layers in enumerate(self.layout.groups):  # each group's layers through its own tables
            tables = {m.request_id: self.kv.block_ids(m.request_id, group) for m in moves}
            src = locate(tables, [(m.request_id, m.src) for m in moves])
            dst = locate(tables, [(m.request_id, m.dst) for m in moves])
            for layer in layers:
                self.kv_caches[layer].copy_slots(src[0], src[1], dst[0], dst[1])

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        decodes = [c for c in sched.chunks if _as_decode_rows(c)]
        prefills = [c for c in sched.chunks if not _as_decode_rows(c)]
        ids, positions, slots = [], [], []
        num_groups = len(self.layout.groups)
        tables = [{c.request.request_id: self.kv.block_ids(c.request.request_id, g) for c in sched.chunks}
                  for g in range(num_groups)]
        blocks: list[list[int]] = [[] for _ in range(num_groups)]  # per group, each new token's block
        for chunk in decodes + prefills:
            r, start = chunk.request, chunk.request.num_computed_tokens
            num_known = chunk.num_new_tokens - chunk.num_verify_rows
            ids.extend(r.token_ids[start:start + num_known])
            span = range(start, start + chunk.num_new_tokens)  # the slots its tokens' K/V go to
            slots.extend(span)
            for g in range(num_groups):
                blocks[g].extend(tables[g][r.request_id][s // self.block_size] for s in span)
            positions.extend(range(start, start + num_known))
            if chunk.verify is not None:  # each row at the position the plan gives it
                ids.extend(chunk.verify.token_ids)
                positions.extend(start + num_known - 1 + d for d in chunk.verify.depths)
        num_decodes = sum(c.num_new_tokens for c in decodes)
        tree = any(c.verify is not None and c.verify.ancestor_masks is not None for c in decodes)
        decode_tables = [self._decode_tables(decodes, t) for t in tables] if decodes else [[] for _ in tables]
        context_lens = [c.request.num_computed_tokens + 1 + i for c in decodes for i in range(c.num_new_tokens)]
        masks = [m for c in decodes for m in _ancestor_masks(c)] if tree else []
        sample_rows, sample_chunks, prompt_rows, prefill_chunks = [], [], [], []
        row = 0
        for chunk in decodes + prefills:
            r, n = chunk.request, chunk.num_new_tokens
            if not _as_decode_rows(chunk):
                prefill_chunks.append((chunk, row))
            if chunk.completes_sequence:
                first = row + n - 1 - chunk.num_verify_rows
                sample_rows.extend(range(first, row + n))
                sample_chunks.append(chunk)
            if r.params.prompt_logprobs is not None:
                prompt_rows.extend(self._prompt_logprob_rows(chunk, row))
            row += n
        input_ids, positions, slot_offsets, sample_rows, context_lens, masks, *per_group = to_device_many(
            [ids, positions, [s % self.block_size for s in slots], sample_rows, context_lens, masks,
             *blocks, *([b for row in t for b in row] for t in decode_tables)], self.device)
        groups = []
        for g in range(num_groups):
            attn = AttentionMetadata(slot_blocks=per_group[g], slot_offsets=slot_offsets, num_decodes=num_decodes)
            if decodes:
                attn.decode_block_tables = per_group[num_groups + g].view(num_decodes, -1)
                attn.decode_context_lens = context_lens
                attn.decode_ancestor_masks = masks if tree else None
            attn.prefills = [self._prefill_span(chunk, row, tables[g][chunk.request.request_id])
                             for chunk, row in prefill_chunks]
            groups.append(attn)
        lora = LoRABatch.of([c.request.lora_use for c in decodes + prefills for _ in range(c.num_new_tokens)],
                            self.device)
        return _Batch(input_ids=input_ids, positions=positions,
                      attn=AttentionMetadata.grouped(groups, self._layer_groups), sample_rows=sample_rows,
                      sample_chunks=sample_chunks, prompt_logprob_rows=prompt_rows, lora=lora)

    @staticmethod
    def _decode_tables(decodes: list[ScheduledChunk], block_ids: dict[str, list[int]]) -> list[list[int]]:
        """A block table per decode row, padded to the longest (padding is never read: the
        context lengths bound it). A verify pass's rows share the table."""
        width = max(len(block_ids[c.request.request_id]) for c in decodes)
        tables = []
        for c in decodes:
            table = block_ids[c.request.request_id]
            tables.extend([table + [0] * (width - len(table))] * c.num_new_tokens)
        return tables

    def _prefill_span(self, chunk: ScheduledChunk, row: int, block_ids: list[int]) -> PrefillSpan:
        start, n = chunk.request.num_computed_tokens, chunk.num_new_tokens
        context_len = start + n
        num_blocks = -(-context_len // self.block_size)
        table = to_device(block_ids[:num_blocks], torch.long, self.device)
        return PrefillSpan(row, row + n, context_len, table)

    @staticmethod
    def _prompt_logprob_rows(chunk: ScheduledChunk, row: int) -> list[_PromptLogprobRows]:
        r, start = chunk.request, chunk.request.num_computed_tokens
        count = min(start + chunk.num_new_tokens, r.num_prompt_tokens - 1) - start
        if count <= 0:
            return []
        return [_PromptLogprobRows(r, slice(row, row + count), r.token_ids[start + 1:start + 1 + count], start + 1)]


# Prompt positions whose logprobs are computed at a time: the logits of a 256-token chunk over
# Gemma 3's 262,144-token vocabulary would be 268 MB at once; 32 rows are 34 MB.
PROMPT_LOGPROB_ROWS = 32

# Chunks of up to this many tokens run as decode rows even without drafts: a step of only decode
# rows goes through the fused decode kernel, where a prefill span takes the layer-by-layer path
# (a draft model's 2-4-token catch-up passes took 21 ms that way, 14 ms as decode rows; CPU, int4).
DECODE_ROWS_MAX_CHUNK = 4


def _as_decode_rows(chunk: ScheduledChunk) -> bool:
    """A decode, a verify pass or a short chunk: one query per token, each attending to the
    cache up to its own position (the same attention a prefill span computes, row by row)."""
    return chunk.num_new_tokens <= DECODE_ROWS_MAX_CHUNK or chunk.verify is not None


def _sampling_rows(chunk: ScheduledChunk) -> list[SamplingRow]:
    """The rows a chunk samples: the next token, then, for each verified row, the token after it
    with the tokens the plan counts before it taken as output (penalties, min_tokens and the
    random stream see them so)."""
    r, plan = chunk.request, chunk.verify
    assert r.grammar is None or plan is None, "rows of a constrained sequence would be sampled unconstrained"
    first = SamplingRow(r.params, r.token_ids, r.num_prompt_tokens, r.eos_token_ids, r.sampling_seed, r.grammar)
    if plan is None:
        return [first]
    return [first] + [SamplingRow(r.params, r.token_ids + before, r.num_prompt_tokens, r.eos_token_ids,
                                  r.sampling_seed) for before in plan.output_before]


def _ancestor_masks(chunk: ScheduledChunk) -> list[int]:
    """Per row of a decode chunk, the keys it sees among the 63 before its own (attention.h):
    every one (-1) but where the chunk's plan says otherwise."""
    masks = [-1] * (chunk.num_new_tokens - chunk.num_verify_rows)
    plan = chunk.verify
    if plan is not None:
        masks.extend(plan.ancestor_masks if plan.ancestor_masks is not None else [-1] * len(plan))
    return masks
