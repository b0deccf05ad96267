"""Logprobs as callers receive them: per position, the target token's logprob and rank, then
the top-k alternatives (vLLM's layout).

Two kinds go through the same ranking: those of sampled tokens (the sampler ranks them on the
raw model distribution, before penalties and temperature) and those of prompt tokens (how the
model predicted each next prompt token). Tensors become Python values with one `.tolist()` per
field for the whole batch, not one per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.kernels.backend import KernelBackend


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # token id -> its logprob, for one position


@dataclass
class RankedLogprobs:
    """Logprobs of one target token per row, with the rows' top-k, still as tensors."""

    target_logprobs: torch.Tensor  # [B]
    target_ranks: torch.Tensor  # [B] 1 = most likely
    top_logprobs: torch.Tensor | None  # [B, K], best first; None when K = 0
    top_token_ids: torch.Tensor | None  # [B, K]


def rank_targets(logits: torch.Tensor, targets: torch.Tensor, k: int, kernels: KernelBackend) -> RankedLogprobs:
    """Ranks each row's target token under log_softmax of that row's [B, V] `logits` and takes
    its k best. The [B, V] log-softmax is never built: a row's logprobs are its logits minus its
    log-sum-exp, and ranks and the top k are the same on either (on CPU two C passes per row)."""
    ranked = kernels.target_logprobs(logits, targets, k)
    if k == 0:
        return RankedLogprobs(ranked.logprobs, ranked.ranks, None, None)
    return RankedLogprobs(ranked.logprobs, ranked.ranks, ranked.top_logits - ranked.lse.unsqueeze(1), ranked.top_ids)


def token_logprobs(ranked: RankedLogprobs, targets: list[int], num_top: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row: None where `num_top` is None (the row asked for no logprobs), else the target
    first, then the row's `num_top` best tokens (at most the K that `ranked` holds)."""
    logprobs, ranks = ranked.target_logprobs.tolist(), ranked.target_ranks.tolist()
    has_top = ranked.top_token_ids is not None
    top_ids = ranked.top_token_ids.tolist() if has_top else None
    top_lps = ranked.top_logprobs.tolist() if has_top else None
    entries: list[TokenLogprobs | None] = []
    for i, (token, k) in enumerate(zip(targets, num_top)):
        if k is None:
            entries.append(None)
            continue
        entry = {token: Logprob(logprobs[i], ranks[i])}
        top = zip(top_ids[i][:k], top_lps[i][:k]) if k else ()
        for rank, (tid, lp) in enumerate(top, start=1):
            entry.setdefault(tid, Logprob(lp, rank))
        entries.append(entry)
    return entries


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int, kernels: KernelBackend) -> list[TokenLogprobs]:
    """Row i of `logits` predicts prompt token `targets[i]`: its logprob, rank and the k best."""
    ranked = rank_targets(logits, torch.tensor(targets, device=logits.device), k, kernels)
    return token_logprobs(ranked, targets, [k] * len(targets))
