"""Logprob entries from hand-made logits: exact values, ranks, and the target token first."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.sample.logprobs import Logprob, prompt_logprobs, rank_targets, token_logprobs

# Logits are log-probabilities already, so log_softmax returns them (up to rounding).
PROBS = [[0.1, 0.6, 0.3, 0.0], [0.5, 0.2, 0.3, 0.0], [0.4, 0.4, 0.2, 0.0]]
LOGITS = torch.tensor(PROBS, dtype=torch.float64).log()
EXPECTED = torch.log_softmax(LOGITS, dim=-1)


def _lp(row: int, token: int) -> float:
    return EXPECTED[row, token].item()


def test_prompt_logprobs_put_the_target_first_then_the_top_k_with_their_ranks():
    entries = prompt_logprobs(LOGITS, [2, 1, 1], k=2)
    assert entries[0] == {2: Logprob(_lp(0, 2), 2), 1: Logprob(_lp(0, 1), 1)}
    assert list(entries[0]) == [2, 1]  # the target keeps its own rank when it is also in the top-k
    assert entries[1] == {1: Logprob(_lp(1, 1), 3), 0: Logprob(_lp(1, 0), 1), 2: Logprob(_lp(1, 2), 2)}
    assert list(entries[1]) == [1, 0, 2]
    assert entries[0][2].logprob == pytest.approx(math.log(0.3), abs=1e-12)


def test_rank_counts_only_strictly_better_tokens():
    entries = prompt_logprobs(LOGITS, [1, 3, 0], k=0)
    assert entries[0] == {1: Logprob(_lp(0, 1), 1)}
    assert entries[1] == {3: Logprob(-math.inf, 4)}  # probability 0: behind every other token
    assert entries[2] == {0: Logprob(_lp(2, 0), 1)}  # tied for best


def test_token_logprobs_give_each_row_the_top_k_it_asked_for():
    ranked = rank_targets(EXPECTED, torch.tensor([0, 2, 1]), k=2)
    bare, two, none = token_logprobs(ranked, [0, 2, 1], [0, 2, None])
    assert bare == {0: Logprob(_lp(0, 0), 3)}
    assert two == {2: Logprob(_lp(1, 2), 2), 0: Logprob(_lp(1, 0), 1)} and list(two) == [2, 0]
    assert none is None
