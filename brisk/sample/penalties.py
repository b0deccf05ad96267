"""Repetition, presence and frequency penalties, over the tokens each row has seen.

Semantics follow the APIs users know: repetition_penalty as in transformers / vLLM (divide a
positive logit, multiply a negative one, for every token seen in prompt or output);
presence and frequency penalties as in OpenAI (over generated tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from brisk.sample.params import SamplingParams


@dataclass
class Penalties:
    """The entries of a step's logits that penalties change: one per (row, token) the row has
    seen, so applying them costs what the rows have seen, not the vocabulary. (Dense [rows, V]
    counts and masks took eight passes over the logits per step: on Gemma 3's 262,144-token
    vocabulary, +26% on a decode step of 4 sequences; `brisk bench vocab`.)"""

    rows: torch.Tensor  # [N] int64: the batch row of each entry
    token_ids: torch.Tensor  # [N] int64: (row, token) pairs, each once
    repetition: torch.Tensor  # [N] float32: the row's penalties
    presence: torch.Tensor  # [N]
    frequency: torch.Tensor  # [N]
    output_counts: torch.Tensor  # [N] float32: how often the row generated the token (0: prompt only)

    @classmethod
    def from_tokens(cls, rows: list[int], params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> "Penalties":
        """Batch row rows[i] from params[i] and that sequence's tokens."""
        def flat(sequences: list[list[int]]) -> torch.Tensor:
            """Each token as local row * vocab_size + id."""
            ids = torch.tensor(list(chain.from_iterable(sequences)), dtype=torch.long)
            local = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([len(s) for s in sequences]))
            return local * vocab_size + ids

        generated, counts = torch.unique(flat(output_token_ids), return_counts=True)
        keys = torch.unique(torch.cat([flat(prompt_token_ids), generated]))  # sorted, as `generated` is
        at = torch.searchsorted(generated, keys).clamp(max=max(len(generated) - 1, 0))
        output_counts = (torch.where(generated[at] == keys, counts[at], 0) if len(generated)
                         else torch.zeros_like(keys)).float()
        local = keys // vocab_size

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype)[local].to(device)

        return cls(rows=column(rows, torch.long), token_ids=(keys % vocab_size).to(device),
                   repetition=column([p.repetition_penalty for p in params]),
                   presence=column([p.presence_penalty for p in params]),
                   frequency=column([p.frequency_penalty for p in params]), output_counts=output_counts.to(device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalizes [B, V] logits in place (and returns them): each seen token's logit divided by
        the repetition penalty when positive, multiplied when not, then less frequency x its
        output count and presence if generated at all."""
        values = logits[self.rows, self.token_ids]
        values = torch.where(values > 0, values / self.repetition, values * self.repetition)
        logits[self.rows, self.token_ids] = (values - self.frequency * self.output_counts
                                             - self.presence * (self.output_counts > 0).float())
        return logits
