"""Logprob entries from hand-made logits: exact values, ranks, and the target token first."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.kernels.backend import KernelBackend
from brisk.sample.logprobs import Logprob, prompt_logprobs, rank_targets, token_logprobs
from tests.helpers import require_c_compiler

# Logits are log-probabilities already, so log_softmax returns them (up to rounding).
PROBS = [[0.1, 0.6, 0.3, 0.0], [0.5, 0.2, 0.3, 0.0], [0.4, 0.4, 0.2, 0.0]]
LOGITS = torch.tensor(PROBS, dtype=torch.float64).log()
EXPECTED = torch.log_softmax(LOGITS, dim=-1)


def _lp(row: int, token: int) -> float:
    return EXPECTED[row, token].item()


def _same(entry, expected) -> bool:
    """Same tokens in the same order, same ranks, logprobs within float64 rounding (logits minus
    their log-sum-exp and log_softmax may differ in the last bit)."""
    return list(entry) == list(expected) and all(
        entry[t].rank == expected[t].rank and entry[t].logprob == pytest.approx(expected[t].logprob, rel=1e-15)
        for t in expected)


def test_prompt_logprobs_put_the_target_first_then_the_top_k_with_their_ranks():
    entries = prompt_logprobs(LOGITS, [2, 1, 1], 2, KernelBackend())
    assert _same(entries[0], {2: Logprob(_lp(0, 2), 2), 1: Logprob(_lp(0, 1), 1)})
    assert list(entries[0]) == [2, 1]  # the target keeps its own rank when it is also in the top-k
    assert _same(entries[1], {1: Logprob(_lp(1, 1), 3), 0: Logprob(_lp(1, 0), 1), 2: Logprob(_lp(1, 2), 2)})
    assert list(entries[1]) == [1, 0, 2]
    assert entries[0][2].logprob == pytest.approx(math.log(0.3), abs=1e-12)


def test_rank_counts_only_strictly_better_tokens():
    entries = prompt_logprobs(LOGITS, [1, 3, 0], 0, KernelBackend())
    assert _same(entries[0], {1: Logprob(_lp(0, 1), 1)})
    assert _same(entries[1], {3: Logprob(-math.inf, 4)})  # probability 0: behind every other token
    assert _same(entries[2], {0: Logprob(_lp(2, 0), 1)})  # tied for best


def test_token_logprobs_give_each_row_the_top_k_it_asked_for():
    ranked = rank_targets(EXPECTED, torch.tensor([0, 2, 1]), 2, KernelBackend())
    bare, two, none = token_logprobs(ranked, [0, 2, 1], [0, 2, None])
    assert _same(bare, {0: Logprob(_lp(0, 0), 3)})
    assert _same(two, {2: Logprob(_lp(1, 2), 2), 0: Logprob(_lp(1, 0), 1)}) and list(two) == [2, 0]
    assert none is None


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_float32_logprobs_rank_as_log_softmax_does(path):
    """The C pass (CPU) and the torch formulation (elsewhere) against float64 log_softmax, with
    banned (-inf) logits, a -inf target and a tie."""
    from brisk.kernels.cpu import CBackend

    if path == "kernel":
        require_c_compiler()
    kernels = CBackend() if path == "kernel" else KernelBackend()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=g) * 4
    targets = torch.randint(0, 5000, (64,), generator=g)
    logits[5, :100] = -math.inf
    logits[3, 17], targets[3] = -math.inf, 17
    logits[7, 9], targets[7] = logits[7, 10], 9
    ranked = rank_targets(logits, targets, 5, kernels)

    exact = torch.log_softmax(logits.double(), dim=-1)
    chosen = exact.gather(1, targets.unsqueeze(1)).squeeze(1)
    assert torch.equal(ranked.target_ranks, (exact > chosen.unsqueeze(1)).sum(dim=-1) + 1)
    finite = chosen.isfinite()
    assert (ranked.target_logprobs.double()[finite] - chosen[finite]).abs().max().item() < 1e-5
    assert ranked.target_logprobs[3].item() == -math.inf
    best = exact.topk(5, dim=-1)
    assert torch.equal(ranked.top_token_ids, best.indices)
    assert (ranked.top_logprobs.double() - best.values).abs().max().item() < 1e-5


@pytest.mark.parametrize("k", [3, 20, 64])
def test_the_c_passs_top_k_is_torchs(k):
    """The C pass's top k (up to cpu.TOP_LOGPROBS_MAX; more go to torch.topk) against torch.topk,
    on rows that fill the top in every order (ascending, descending, a tie at the k-th) and one
    with fewer finite logits than k (the rest -inf, as torch gives them)."""
    require_c_compiler()
    from brisk.kernels.cpu import CBackend

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3000, generator=g)
    logits[1] = torch.arange(3000.0)
    logits[2] = -torch.arange(3000.0)
    logits[3, 100:100 + k + 3] = 50.0  # more ties than k
    logits[4, 3:] = -math.inf
    targets = torch.zeros(6, dtype=torch.long)
    ours = CBackend().target_logprobs(logits, targets, k)
    theirs = KernelBackend().target_logprobs(logits, targets, k)
    assert torch.equal(ours.top_logits, theirs.top_logits)
    assert torch.equal(logits.gather(1, ours.top_ids), ours.top_logits)
    assert torch.equal(ours.top_ids[[0, 1, 2]], theirs.top_ids[[0, 1, 2]])
    assert torch.equal(ours.top_ids[3], torch.arange(100, 100 + k))  # ties: the lower ids first
    assert ours.top_ids[4].unique().numel() == k
