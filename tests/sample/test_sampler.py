"""Sampler and penalties on hand-made logits: each parameter's exact effect."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.engine.request import Request
from brisk.sample.penalties import Penalties
from brisk.sample.sampler import Sampler, SamplingBatch
from brisk.sampling_params import SamplingError, SamplingParams

CPU = torch.device("cpu")


def _requests(*params: SamplingParams, prompt=(1, 2, 3), output=()) -> list[Request]:
    requests = []
    for i, p in enumerate(params):
        r = Request(str(i), list(prompt), p, eos_token_ids=(0,))
        r.token_ids += list(output)
        if p.seed is not None:
            r.generator = torch.Generator().manual_seed(p.seed)
        requests.append(r)
    return requests


def _sample(logits: torch.Tensor, requests: list[Request], seed: int = 0):
    batch = SamplingBatch.from_requests(requests, logits.shape[-1], CPU)
    return Sampler(seed, CPU)(logits.clone(), batch)


def _counts(logits_row: list[float], params: SamplingParams, draws: int = 400) -> torch.Tensor:
    logits = torch.tensor([logits_row] * draws)
    tokens = _sample(logits, _requests(*[params] * draws)).token_ids
    return torch.bincount(tokens, minlength=len(logits_row))


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    out = _sample(logits, _requests(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)))
    assert out.token_ids.tolist() == [1, 0]


def test_top_k_1_is_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    out = _sample(logits, _requests(*[SamplingParams(temperature=1.5, top_k=1)] * 64))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_p_keeps_the_smallest_nucleus():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = _counts([math.log(p) for p in probs], SamplingParams(top_p=0.75))
    assert counts[2] == 0 and counts[3] == 0 and counts[0] > 0 and counts[1] > 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    counts = _counts([math.log(p) for p in (0.6, 0.3, 0.1)], SamplingParams(min_p=0.5))
    assert counts[2] == 0 and counts[1] > 0


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    counts = _counts(probs.log().tolist(), SamplingParams(temperature=1.0), draws=4000)
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    row = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [_sample(row, _requests(seeded)).token_ids.item() for _ in range(3)]
    crowd = torch.cat([torch.randn(5, 100), row])
    in_batch = _sample(crowd, _requests(*[SamplingParams()] * 5, seeded), seed=7).token_ids[-1].item()
    assert alone == [alone[0]] * 3 and in_batch == alone[0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 0.0, 8.0, 1.0]])  # EOS (0) best, stop id 2 next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert _sample(logits, _requests(params, output=[3])).token_ids.item() == 3
    assert _sample(logits, _requests(params, output=[3, 3])).token_ids.item() == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    penalties = Penalties.from_requests(_requests(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,)), 4, CPU)
    assert penalties.apply(logits).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    penalties = Penalties.from_requests(_requests(params, prompt=(3, 3), output=(1, 1, 2)), 4, CPU)
    assert penalties.apply(logits).tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_no_penalty_tensors_when_no_row_uses_them():
    assert Penalties.from_requests(_requests(SamplingParams()), 4, CPU) is None


def test_logprobs_are_raw_model_logprobs_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = _sample(logits, _requests(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)))
    expected = torch.log_softmax(logits, -1)
    assert out.token_ids.item() == 1 and out.sampled_ranks.item() == 1
    assert torch.allclose(out.sampled_logprobs, expected[:, 1])
    assert out.top_token_ids.tolist() == [[1, 2]]
    assert torch.allclose(out.top_logprobs, expected[:, [1, 2]])


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", -1), ("stop", [""]),
])
def test_invalid_params_raise_an_error_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
