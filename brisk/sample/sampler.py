"""Logits -> next tokens for a whole batch at once, each row with its own sampling params.

Order of operations (as in vLLM): raw logprobs are taken first (what `logprobs` reports),
then penalties and min_tokens bans, then greedy rows take the argmax, and the others go
through temperature, min_p, top-k and top-p before sampling.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly, and
the noise for a seeded request comes from that request's own generator, one draw per step, so
its output does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.engine.request import Request
from brisk.sample.penalties import Penalties


@dataclass
class SamplingBatch:
    """Per-row parameters of one step's sampling, as tensors on the model's device."""

    temperature: torch.Tensor  # [B]; greedy rows hold 1.0 so division is safe
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, vocab_size where off
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    penalties: Penalties | None
    banned: torch.Tensor | None  # [B, V] bool: EOS/stop ids held back until min_tokens are out
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    num_logprobs: int | None  # most top logprobs any row asked for; None if none asked

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device) -> "SamplingBatch":
        params = [r.params for r in requests]

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        return cls(
            temperature=column([1.0 if p.greedy else p.temperature for p in params]),
            greedy=column(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=column([p.top_k or vocab_size for p in params], torch.long)
            if any(p.top_k for p in params) else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
            penalties=Penalties.from_requests(requests, vocab_size, device),
            banned=_min_tokens_bans(requests, vocab_size, device),
            generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None},
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    # Only when some row asked for logprobs:
    sampled_logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token
    sampled_ranks: torch.Tensor | None = None  # [B] its rank (1 = most likely)
    top_logprobs: torch.Tensor | None = None  # [B, K]
    top_token_ids: torch.Tensor | None = None  # [B, K]


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
        if batch.penalties is not None:
            logits = batch.penalties.apply(logits)
        if batch.banned is not None:
            logits = logits.masked_fill(batch.banned, float("-inf"))
        tokens = logits.argmax(dim=-1)
        if not batch.all_greedy:
            sampled = self._sample(logits, batch)
            tokens = torch.where(batch.greedy, tokens, sampled)
        out = SamplerOutput(tokens)
        if raw_logprobs is not None:
            _fill_logprobs(out, raw_logprobs, batch.num_logprobs)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if batch.top_k is not None or batch.top_p is not None:
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in batch.generators.items():
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks everything outside each row's top-k and its smallest top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of all better tokens
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def _fill_logprobs(out: SamplerOutput, logprobs: torch.Tensor, k: int) -> None:
    chosen = logprobs.gather(1, out.token_ids.unsqueeze(1))
    out.sampled_logprobs = chosen.squeeze(1)
    out.sampled_ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        out.top_logprobs, out.top_token_ids = logprobs.topk(k, dim=-1)


def _min_tokens_bans(requests: list[Request], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    rows = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
    if not rows:
        return None
    banned = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
    for i, r in rows:
        ids = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
        banned[i, ids] = True
    return banned.to(device)
