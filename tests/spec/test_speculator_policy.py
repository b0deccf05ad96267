"""The speculator's policy (spec/speculator.py): a drafted token costs a verify row, so a
sequence drafts while its own drafts are accepted at the break-even rate of the step's cost
(fitted to the engine's steps) for the batch it is in, after a short probe; methods whose
drafts cost more than their rows stop past their batch limit, as everyone does past a limit the
config sets."""

from __future__ import annotations

import pytest

from brisk import SamplingParams
from brisk.config import SpeculativeConfig
from brisk.engine.request import Request, RequestStatus
from brisk.spec.drafter import Drafter
from brisk.spec.speculator import PROBE_TOKENS, Speculator, StepCost
from brisk.spec.verify import Draft


class Always(Drafter):
    def propose(self, requests, num_tokens, hidden):
        return [Draft([7, 8][:k]) for k in num_tokens]


def _decoding(request_id: str, drafted: int = 0, accepted: int = 0) -> Request:
    request = Request(request_id, [1, 2, 3, 4], SamplingParams(max_tokens=64))
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens - 1  # its next step decodes one token
    request.spec_stats.num_drafts = 1 if drafted else 0
    request.spec_stats.num_draft_tokens, request.spec_stats.num_accepted_tokens = drafted, accepted
    return request


def _drafted(speculator: Speculator, running: list[Request]) -> set[str]:
    speculator.propose(running)
    return {r.request_id for r in running if r.verify is not None}


def _cost(fixed_ms: float, row_ms: float, key_us: float, steps: int = 2000) -> StepCost:
    """A fit to `steps` decode steps of 1 to 24 rows of 100 to 1,000 tokens of context each,
    costing fixed_ms + row_ms per row + key_us per key attended."""
    cost = StepCost()
    for i in range(steps):
        rows, context = 1 + i % 24, 100 + 37 * i % 900
        cost.observe(rows, rows * context, (fixed_ms + row_ms * rows) / 1e3 + key_us * rows * context / 1e6)
    return cost


def test_the_step_cost_fit_finds_the_parts_and_keeps_its_prior_without_steps():
    assert StepCost().coefficients == StepCost.PRIOR
    fixed, per_row, per_key = _cost(3.0, 1.0, 0.5).coefficients  # the steps outweigh the prior
    assert fixed == pytest.approx(3e-3, rel=0.03) and per_row == pytest.approx(1e-3, rel=0.03)
    assert per_key == pytest.approx(0.5e-6, rel=0.05)
    cpu = _cost(2.0, 1.0, 0.0)  # break-even: batch / (batch + F / c)
    assert cpu.break_even(500, 1, 500) == pytest.approx(1 / 3, rel=0.03)
    assert cpu.break_even(500, 8, 4000) == pytest.approx(0.8, rel=0.03)
    # attention: a long context's draft row costs more than a short one's
    attending = _cost(2.0, 1.0, 1.0)
    assert attending.break_even(4000, 8, 8 * 1000) > attending.break_even(200, 8, 8 * 1000)
    gpu = _cost(10.0, 0.0, 0.0)  # rows free (a GPU's decode): every draft pays, even at 64 sequences
    assert gpu.break_even(1000, 64, 64000) < 0.05


def test_a_sequence_drafts_while_its_drafts_are_accepted_at_the_batchs_break_even_rate():
    speculator = Speculator(SpeculativeConfig(method="suffix"), Always())
    speculator.cost = _cost(2.0, 1.0, 0.0)  # break-even: 1/3 alone, 2/3 at 4, 0.8 at 8
    new, probing = _decoding("new"), _decoding("probing", drafted=PROBE_TOKENS - 1)
    copying, chatting = _decoding("copying", 100, 90), _decoding("chatting", 100, 70)
    others = [_decoding(str(i), 100, 0) for i in range(4)]  # never accepted: never draft past their probe
    assert _drafted(speculator, [chatting]) == {"chatting"}
    assert _drafted(speculator, [new, probing, copying, chatting]) == {"new", "probing", "copying", "chatting"}
    assert _drafted(speculator, [new, probing, copying, chatting, *others]) == {"new", "probing", "copying"}
    speculator.force_drafting(True)  # as the benchmarks force it
    assert len(_drafted(speculator, [new, probing, copying, chatting, *others])) == 8


def test_a_draft_model_stops_past_its_limit_and_a_configured_limit_binds_every_method():
    speculator = Speculator(SpeculativeConfig(model="self-int8"), Always())
    running = [_decoding("a"), _decoding("b", drafted=100, accepted=100)]
    assert _drafted(speculator, running) == set() and _drafted(speculator, running[:1]) == {"a"}
    capped = Speculator(SpeculativeConfig(method="ngram", disable_by_batch_size=1), Always())
    assert _drafted(capped, running) == set() and _drafted(capped, running[1:]) == {"b"}
