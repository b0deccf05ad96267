"""Logits -> next tokens for a whole batch at once, each row with its own sampling params.

Order of operations (as in vLLM): raw logprobs are taken first (what `logprobs` reports),
then penalties and min_tokens bans, then greedy rows take the argmax, and the others go
through temperature, min_p, top-k and top-p before sampling.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly, and
the noise for a seeded request comes from that request's own generator, one draw per step, so
its output does not depend on what else is in the batch.

The package knows nothing of the engine: a row is a `SamplingRow`, which the model runner
fills from its requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.sample.logprobs import RankedLogprobs, rank_targets
from brisk.sample.penalties import Penalties, uses_penalties
from brisk.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample the next token of: its parameters and every token it has so far.

    `token_ids` is the prompt followed by the output, shared with the caller rather than split
    into two copies every step; the slices are taken only when penalties need them.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None  # the sequence's own RNG when params.seed is set

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


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
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingBatch":
        params = [r.params for r in rows]

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
            penalties=Penalties.from_tokens(params, [r.prompt_token_ids for r in rows],
                                            [r.output_token_ids for r in rows], vocab_size, device)
            if any(uses_penalties(p) for p in params) else None,
            banned=_min_tokens_bans(rows, vocab_size, device),
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    # Only when some row asked for logprobs: the chosen tokens ranked on the raw model logprobs,
    # with the top num_logprobs of every row (rows that asked for fewer slice theirs).
    logprobs: RankedLogprobs | None = None


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
        if raw_logprobs is None:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, rank_targets(raw_logprobs, tokens, batch.num_logprobs))

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
        # The draw can be exactly 0; a masked token (p = 0) would then score 0/0 = NaN, which argmax picks.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
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


def _min_tokens_bans(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    short = [(i, r) for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
    if not short:
        return None
    banned = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, r in short:
        ids = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
        banned[i, ids] = True
    return banned.to(device)
