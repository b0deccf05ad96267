"""Sampler and penalties on hand-made logits: each parameter's exact effect."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.sample.penalties import Penalties
from brisk.sample.sampler import Sampler, SamplingBatch, SamplingRow
from brisk.sampling_params import SamplingError, SamplingParams

CPU = torch.device("cpu")


def _rows(*params: SamplingParams, prompt=(1, 2, 3), output=()) -> list[SamplingRow]:
    """One row per params, all with the same tokens; EOS is token 0."""
    return [SamplingRow(p, [*prompt, *output], len(prompt), eos_token_ids=(0,),
                        generator=torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
            for p in params]


def _penalties(params: SamplingParams, prompt, output) -> Penalties:
    return Penalties.from_tokens([params], [list(prompt)], [list(output)], 4, CPU)


def _sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0):
    batch = SamplingBatch.from_rows(rows, logits.shape[-1], CPU)
    return Sampler(seed, CPU)(logits.clone(), batch)


def _counts(logits_row: list[float], params: SamplingParams, draws: int = 400) -> torch.Tensor:
    logits = torch.tensor([logits_row] * draws)
    tokens = _sample(logits, _rows(*[params] * draws)).token_ids
    return torch.bincount(tokens, minlength=len(logits_row))


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    out = _sample(logits, _rows(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)))
    assert out.token_ids.tolist() == [1, 0]


def test_top_k_1_is_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    out = _sample(logits, _rows(*[SamplingParams(temperature=1.5, top_k=1)] * 64))
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
    alone = [_sample(row, _rows(seeded)).token_ids.item() for _ in range(3)]
    crowd = torch.cat([torch.randn(5, 100), row])
    in_batch = _sample(crowd, _rows(*[SamplingParams()] * 5, seeded), seed=7).token_ids[-1].item()
    assert alone == [alone[0]] * 3 and in_batch == alone[0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 0.0, 8.0, 1.0]])  # EOS (0) best, stop id 2 next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert _sample(logits, _rows(params, output=[3])).token_ids.item() == 3
    assert _sample(logits, _rows(params, output=[3, 3])).token_ids.item() == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    penalties = _penalties(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    assert penalties.apply(logits).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    penalties = _penalties(params, prompt=(3, 3), output=(1, 1, 2))
    assert penalties.apply(logits).tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_penalty_tensors_only_when_some_row_uses_them():
    plain = SamplingBatch.from_rows(_rows(SamplingParams(), SamplingParams()), 4, CPU)
    mixed = SamplingBatch.from_rows(_rows(SamplingParams(), SamplingParams(presence_penalty=0.5)), 4, CPU)
    assert plain.penalties is None
    assert mixed.penalties.presence.flatten().tolist() == [0.0, 0.5]


def test_logprobs_are_raw_model_logprobs_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = _sample(logits, _rows(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)))
    expected = torch.log_softmax(logits, -1)
    assert out.token_ids.item() == 1 and out.logprobs.target_ranks.item() == 1
    assert torch.allclose(out.logprobs.target_logprobs, expected[:, 1])
    assert out.logprobs.top_token_ids.tolist() == [[1, 2]]
    assert torch.allclose(out.logprobs.top_logprobs, expected[:, [1, 2]])


def test_no_logprob_tensors_unless_a_row_asks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 2)
    assert _sample(logits, _rows(SamplingParams(), SamplingParams(temperature=0.0))).logprobs is None
    asked = _sample(logits, _rows(SamplingParams(), SamplingParams(logprobs=0))).logprobs
    assert asked.target_ranks.shape == (2,) and asked.top_token_ids is None


def test_zero_noise_never_picks_a_masked_token(monkeypatch):
    """Exp(1) draws can be exactly 0; unclamped, a masked token scores 0/0 = NaN and wins the argmax."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *args, **kwargs: self.zero_())
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]] * 3)
    rows = _rows(SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(top_k=2, seed=1))
    assert _sample(logits, rows).token_ids.tolist() == [1, 1, 1]


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
