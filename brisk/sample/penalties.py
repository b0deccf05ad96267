"""Repetition, presence and frequency penalties, vectorized over the batch.

Semantics follow the APIs users know: repetition_penalty as in transformers / vLLM (divide a
positive logit, multiply a negative one, for every token seen in prompt or output);
presence and frequency penalties as in OpenAI (over generated tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.sampling_params import SamplingParams


@dataclass
class Penalties:
    repetition: torch.Tensor  # [B, 1]
    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    output_counts: torch.Tensor  # [B, V] how often each token was generated
    seen: torch.Tensor  # [B, V] bool: in the prompt or the output

    @classmethod
    def from_tokens(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> "Penalties":
        """Row i from params[i] and that sequence's tokens. The counts are [B, V], so callers build
        this only when some row is `penalized`."""
        output_counts = _token_counts(output_token_ids, vocab_size, device)
        prompt_counts = _token_counts(prompt_token_ids, vocab_size, device)

        def column(values):
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        return cls(
            repetition=column([p.repetition_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            output_counts=output_counts,
            seen=(output_counts + prompt_counts) > 0,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, penalized, logits)
        return logits - self.frequency * self.output_counts - self.presence * (self.output_counts > 0).float()


def _token_counts(sequences: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] counts, built with one scatter over a padded id matrix (pad id = V, then dropped)."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), max(width, 1)), vocab_size, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    counts = torch.zeros(len(sequences), vocab_size + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size].to(device)
