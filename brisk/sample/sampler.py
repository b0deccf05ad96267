"""Logits -> next tokens for a whole batch at once, each row with its own sampling params.

Order of operations (as in vLLM): raw logprobs are taken first (what `logprobs` reports),
then logit biases, penalties, min_tokens bans and grammar masks (each only on the rows that
have it; sample/grammar.py makes the masks), then one call samples
every row: greedy rows take the argmax, the others go through temperature, min_p, top-k and
top-p, then an inverse-CDF draw with one uniform per row.

The uniform of a row is a pure function of its sequence's seed and the output position being
sampled (sample/random.py), so a seeded request's tokens do not depend on what else is in the
batch, on preemption, or on the order requests arrived in. Sequences without a seed get one
drawn by the engine when they are added.

The rule (threshold semantics: a token tied with the k-th best or with the nucleus edge stays in):
    w_i   = exp((z_i - max z) / T)                 z: the adjusted logits; the best token's w is 1
    min_p:  drop w_i < min_p
    top_k:  drop w_i < the k-th largest w
    top_p:  drop w_i < w_(c), c the fewest best tokens holding p of the remaining mass
    token = the smallest id i with  sum_{j <= i} w_j > u * sum_j w_j

The kernel backend runs it (`kernels.sample_rows`): on CPU one C kernel (kernels/sampling.c)
without sorting the vocabulary; `KernelBackend.sample_rows` (kernels/backend.py) is the same rule
as tensor ops, for other devices and as the kernel's reference in the tests.

The package knows nothing of the engine: a row is a `SamplingRow`, which the model runner
fills from its requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.kernels.backend import KernelBackend
from brisk.kernels.transfer import to_device
from brisk.sample.grammar import Grammar, apply_bitmask, fill_bitmask
from brisk.sample.logprobs import RankedLogprobs, rank_targets
from brisk.sample.penalties import Penalties
from brisk.sample.random import to_int64, uniforms
from brisk.sample.params import SamplingParams


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
    seed: int = 0  # the sequence's random stream: params.seed, or one the engine drew for it
    grammar: Grammar | None = None  # structured outputs: the tokens allowed next come from here

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
    """Per-row parameters of one step's sampling, as tensors on the model's device.

    Every column is always present (a neutral value where a row does not use the feature), so
    one kernel call serves any mix of rows; what is built per row only for some rows
    (penalties, bans) covers just those rows.
    """

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_k: torch.Tensor  # [B] int64; 0 where off
    top_p: torch.Tensor  # [B] float32; 1 where off
    min_p: torch.Tensor  # [B] float32; 0 where off
    uniforms: torch.Tensor | None  # [B] float64, one draw per row; None when every row is greedy
    penalties: Penalties | None  # the entries of the rows with penalties
    bans: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids): EOS/stop ids held back until min_tokens
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values): logit_bias
    grammar_rows: torch.Tensor | None  # [G] int64: the rows with a grammar
    bitmask: torch.Tensor | None  # [G, ceil(V/32)] int32: their allowed tokens
    num_logprobs: int | None  # most top logprobs any row asked for; None if none asked

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingBatch":
        params = [r.params for r in rows]

        def column(values, dtype=torch.float32):
            return to_device(values, dtype, device)

        penalized = [i for i, p in enumerate(params) if p.penalized]
        all_greedy = all(p.greedy for p in params)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        return cls(
            temperature=column([0.0 if p.greedy else p.temperature for p in params]),
            top_k=column([p.top_k for p in params], torch.long),
            top_p=column([p.top_p for p in params]),
            min_p=column([p.min_p for p in params]),
            uniforms=None if all_greedy else uniforms(column([to_int64(r.seed) for r in rows], torch.long),
                                                      column([r.num_output_tokens for r in rows], torch.long)),
            penalties=Penalties.from_tokens(penalized, [params[i] for i in penalized],
                                            [rows[i].prompt_token_ids for i in penalized],
                                            [rows[i].output_token_ids for i in penalized], vocab_size, device)
            if penalized else None,
            bans=_min_tokens_bans(rows, device),
            biases=_logit_biases(params, device),
            grammar_rows=column(constrained, torch.long) if constrained else None,
            bitmask=fill_bitmask([rows[i].grammar for i in constrained], vocab_size) if constrained else None,
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )

    @property
    def all_greedy(self) -> bool:
        return self.uniforms is None

    def adjust(self, logits: torch.Tensor, kernels: KernelBackend) -> torch.Tensor:
        """Biases, penalties, bans and grammar masks, in place on the rows that have them."""
        if self.biases is not None:
            rows, token_ids, values = self.biases
            logits.index_put_((rows, token_ids), values, accumulate=True)
        if self.penalties is not None:
            self.penalties.apply(logits)
        if self.bans is not None:
            logits[self.bans] = float("-inf")
        if self.grammar_rows is not None:
            apply_bitmask(logits, self.grammar_rows, self.bitmask, kernels)
        return logits


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    # Only when some row asked for logprobs: the chosen tokens ranked on the raw model logprobs,
    # with the top num_logprobs of every row (rows that asked for fewer slice theirs).
    logprobs: RankedLogprobs | None = None


def sample(logits: torch.Tensor, batch: SamplingBatch, kernels: KernelBackend) -> SamplerOutput:
    """[B, V] float32 logits (modified in place) -> one token per row, in the model's backend."""
    raw_logits = logits.clone() if batch.num_logprobs is not None else None  # adjust() works in place
    logits = batch.adjust(logits, kernels)
    tokens = kernels.sample_rows(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.uniforms)
    if raw_logits is None:
        return SamplerOutput(tokens)
    return SamplerOutput(tokens, rank_targets(raw_logits, tokens, batch.num_logprobs, kernels))


def _logit_biases(params: list[SamplingParams],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    triples = [(i, token, bias) for i, p in enumerate(params) for token, bias in (p.logit_bias or {}).items()]
    if not triples:
        return None
    rows, token_ids, values = zip(*triples)
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _min_tokens_bans(rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) pairs of the EOS and stop ids each row may not yet produce."""
    pairs = [(i, token) for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens
             for token in (*r.params.stop_token_ids, *(() if r.params.ignore_eos else r.eos_token_ids))]
    if not pairs:
        return None
    row_ids, token_ids = zip(*pairs)
    return (torch.tensor(row_ids, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device))
