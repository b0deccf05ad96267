"""Model runner: a SchedulerOutput in, one model forward, sampled tokens out.

It owns the KV cache tensors and builds, once per step, everything the layers share: the flat
token batch, positions, the slot of each token in the block pool, padded block tables for the
decodes and masks for prefill chunks that continue an earlier context. Logits are computed
only for rows that are sampled (and for prompt positions whose logprobs were asked for):
the vocabulary projection is 20% of the model's FLOPs per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brisk.engine.kv_cache import KVCacheManager
from brisk.quant.kv_cache import KVCacheLayer
from brisk.engine.request import Request
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.model.attention import AttentionMetadata, PrefillSpan
from brisk.model.llama import LlamaForCausalLM
from brisk.sample.logprobs import TokenLogprobs, prompt_logprobs, token_logprobs
from brisk.sample.sampler import SamplingBatch, SamplingRow, sample


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> next token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> (the prompt position the first entry predicts, the entries of this step's chunk)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


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
    sample_requests: list[Request]
    prompt_logprob_rows: list[_PromptLogprobRows]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCacheManager, kv_cache_dtype: str, device: torch.device):
        spec = model.spec
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.vocab_size = spec.vocab_size
        # One per layer, in the storage kind of quant/kv_cache.py; see model/attention.py for the layout.
        self.kv_caches = [KVCacheLayer.allocate(kv_cache_dtype, kv.num_blocks, spec.num_kv_heads, kv.block_size,
                                                spec.head_dim, device) for _ in range(spec.num_layers)]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        batch = self._prepare(sched)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        out = RunnerOutput()
        if batch.sample_requests:
            self._sample(hidden[batch.sample_rows], batch.sample_requests, out)
        for rows in batch.prompt_logprob_rows:
            logits = self.model.compute_logits(hidden[rows.rows])
            out.prompt_logprobs[rows.request.request_id] = (rows.first_position, prompt_logprobs(
                logits, rows.targets, rows.request.params.prompt_logprobs))
        return out

    def _sample(self, hidden: torch.Tensor, requests: list[Request], out: RunnerOutput) -> None:
        logits = self.model.compute_logits(hidden)
        rows = [_sampling_row(r) for r in requests]
        sampled = sample(logits, SamplingBatch.from_rows(rows, self.vocab_size, self.device))
        tokens = sampled.token_ids.tolist()
        out.sampled = {r.request_id: token for r, token in zip(requests, tokens)}
        if sampled.logprobs is not None:
            entries = token_logprobs(sampled.logprobs, tokens, [r.params.logprobs for r in requests])
            out.logprobs = {r.request_id: e for r, e in zip(requests, entries) if e is not None}

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        decodes = [c for c in sched.chunks if c.num_new_tokens == 1]
        prefills = [c for c in sched.chunks if c.num_new_tokens > 1]
        ids, positions, blocks = [], [], []
        tables = {c.request.request_id: self.kv.block_ids(c.request.request_id) for c in sched.chunks}
        for chunk in decodes + prefills:
            r, start = chunk.request, chunk.request.num_computed_tokens
            table = tables[r.request_id]
            span = range(start, start + chunk.num_new_tokens)
            ids.extend(r.token_ids[start:start + chunk.num_new_tokens])
            positions.extend(span)
            blocks.extend(table[p // self.block_size] for p in span)
        positions_t = torch.tensor(positions, dtype=torch.long)
        attn = AttentionMetadata(
            slot_blocks=torch.tensor(blocks, dtype=torch.long, device=self.device),
            slot_offsets=(positions_t % self.block_size).to(self.device),
            num_decodes=len(decodes),
        )
        if decodes:
            attn.decode_block_tables, attn.decode_context_lens = self._decode_tables(decodes, tables)
        sample_rows, sample_requests, prompt_rows = [], [], []
        row = 0
        for chunk in decodes + prefills:
            r, n = chunk.request, chunk.num_new_tokens
            if n > 1:
                attn.prefills.append(self._prefill_span(chunk, row, tables[r.request_id]))
            if chunk.completes_sequence:
                sample_rows.append(row + n - 1)
                sample_requests.append(r)
            if r.params.prompt_logprobs is not None:
                prompt_rows.extend(self._prompt_logprob_rows(chunk, row))
            row += n
        return _Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=positions_t.to(self.device),
            attn=attn,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            sample_requests=sample_requests,
            prompt_logprob_rows=prompt_rows,
        )

    def _decode_tables(self, decodes: list[ScheduledChunk],
                       block_ids: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables padded to the longest (padding is never read: context_lens bound it)."""
        tables = [block_ids[c.request.request_id] for c in decodes]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        context_lens = torch.tensor([c.request.num_computed_tokens + 1 for c in decodes], dtype=torch.long)
        return padded.to(self.device), context_lens.to(self.device)

    def _prefill_span(self, chunk: ScheduledChunk, row: int, block_ids: list[int]) -> PrefillSpan:
        start, n = chunk.request.num_computed_tokens, chunk.num_new_tokens
        context_len = start + n
        num_blocks = -(-context_len // self.block_size)
        table = torch.tensor(block_ids[:num_blocks], dtype=torch.long, device=self.device)
        return PrefillSpan(row, row + n, context_len, table)

    @staticmethod
    def _prompt_logprob_rows(chunk: ScheduledChunk, row: int) -> list[_PromptLogprobRows]:
        r, start = chunk.request, chunk.request.num_computed_tokens
        count = min(start + chunk.num_new_tokens, r.num_prompt_tokens - 1) - start
        if count <= 0:
            return []
        return [_PromptLogprobRows(r, slice(row, row + count), r.token_ids[start + 1:start + 1 + count], start + 1)]


def _sampling_row(request: Request) -> SamplingRow:
    return SamplingRow(request.params, request.token_ids, request.num_prompt_tokens, request.eos_token_ids,
                       request.sampling_seed, request.grammar)
