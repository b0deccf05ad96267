"""Scheduler on its own (no model): budgets, chunked prefill, admission limits, preemption."""

from __future__ import annotations

import pytest

from brisk.engine.kv_cache import KVCacheManager
from brisk.engine.request import Request, RequestStatus
from brisk.engine.scheduler import Scheduler, StepCost
from brisk.engine.step_hook import VerifyPlan
from brisk.sample.params import SamplingParams


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True, prefix=True,
               attention_cost_context=0) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, prefix), max_num_seqs, budget, chunked,
                     attention_cost_context)


def _request(rid: str, prompt_len: int, max_tokens: int = 4, first_token: int = 0) -> Request:
    return Request(rid, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens=max_tokens))


def _step(s: Scheduler, token: int = 7):
    """Schedules, then pretends the model ran and sampled `token` wherever a sample is due."""
    out = s.schedule()
    plan = [(c.request.request_id, c.num_new_tokens) for c in out.chunks]
    sampled = {c.request.request_id: [token] for c in out.chunks if c.completes_sequence}
    s.update(out, sampled)
    return plan, out


def test_long_prompt_is_chunked_and_decodes_keep_flowing():
    s = _scheduler(budget=10)
    s.add(_request("short", 3))
    assert _step(s)[0] == [("short", 3)]
    s.add(_request("long", 25))
    assert _step(s)[0] == [("short", 1), ("long", 9)]
    assert _step(s)[0] == [("short", 1), ("long", 9)]
    assert _step(s)[0] == [("short", 1), ("long", 7)]  # prompt done: sampled
    assert _step(s)[0] == [("long", 1)]  # short hit max_tokens=4 and left
    assert s.requests["long"].num_output_tokens == 2


def test_without_chunking_a_prompt_waits_for_a_budget_that_fits_it():
    s = _scheduler(budget=10, chunked=False)
    s.add(_request("a", 6))
    s.add(_request("b", 6, first_token=100))
    assert _step(s)[0] == [("a", 6)]
    assert _step(s)[0] == [("a", 1), ("b", 6)]


def test_max_num_seqs_limits_running_requests():
    s = _scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(_request(f"r{i}", 2))
    assert [rid for rid, _ in _step(s)[0]] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_newest_request_is_preempted_and_recomputed_when_blocks_run_out():
    s = _scheduler(num_blocks=4, block_size=4, budget=64, prefix=False)
    s.add(_request("old", 7, max_tokens=8))
    s.add(_request("new", 7, max_tokens=8, first_token=100))
    assert _step(s)[0] == [("old", 7), ("new", 7)]  # 2 blocks each: pool full
    assert _step(s)[0] == [("old", 1), ("new", 1)]  # position 7 still fits in block 2
    plan, out = _step(s)  # old's position 8 needs a 3rd block: new gives its blocks back
    assert [r.request_id for r in out.preempted] == ["new"]
    assert plan == [("old", 1)]
    new = s.requests["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.token_ids == list(range(100, 107)) + [7, 7]  # its sampled tokens are kept and recomputed
    while "old" in s.requests:
        _step(s)
    plan, _ = _step(s)
    assert plan == [("new", 9)]  # prompt + its earlier output, recomputed in one chunk
    while s.has_unfinished_requests:
        _step(s)
    assert s.kv.num_free_blocks == 4


def test_a_request_that_preempts_itself_waits_at_the_head():
    s = _scheduler(num_blocks=2, block_size=4, budget=64, prefix=False)
    s.add(_request("a", 8, max_tokens=4))
    _step(s)
    plan, out = _step(s)  # a needs a third block that does not exist... and is alone
    assert plan == [] and [r.request_id for r in out.preempted] == ["a"]
    assert list(s.waiting)[0].request_id == "a"


def test_finish_frees_blocks_of_running_and_waiting_requests():
    s = _scheduler(max_num_seqs=1)
    s.add(_request("a", 5))
    s.add(_request("b", 5))
    _step(s)
    assert s.finish("a", RequestStatus.FINISHED_ABORTED).status is RequestStatus.FINISHED_ABORTED
    assert s.finish("b", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("missing", RequestStatus.FINISHED_ABORTED) is None
    assert not s.has_unfinished_requests and s.kv.num_free_blocks == s.kv.num_blocks


def test_prefix_hit_skips_cached_tokens():
    s = _scheduler(block_size=4)
    s.add(_request("a", 10))
    _step(s)
    s.add(_request("b", 10))
    plan, _ = _step(s)
    assert ("b", 2) in plan  # 8 of 10 prompt tokens came from a's blocks
    assert s.requests["b"].num_cached_tokens == 8


# ----- cost-aware budget and fair prefill ---------------------------------------------------------
def test_step_cost_prices_attention_and_inverts_exactly():
    cost = StepCost(attention_cost_context=100)
    assert cost(1, 0) == pytest.approx(1.01)  # one token attending to itself
    assert cost(10, 90) == pytest.approx(10 * (1 + 95.5 / 100))
    assert StepCost(0)(10, 5000) == 10.0
    for budget in (0.5, 1.0, 7.3, 32, 500):
        for computed in (0, 17, 1000, 7500):
            n = cost.max_tokens(budget, computed, limit=10**6)
            assert cost(n, computed) <= budget < cost(n + 1, computed)
    assert cost.max_tokens(500, 0, limit=3) == 3 and cost.max_tokens(0, 0, limit=3) == 0


def test_a_short_request_behind_a_long_prefill_runs_at_the_next_step():
    s = _scheduler(num_blocks=128, budget=32)
    s.add(_request("long", 300))
    assert _step(s)[0] == [("long", 32)]
    s.add(_request("short", 5, first_token=1000))
    # The short prompt finishes within this step; the long one gets the rest of the budget.
    assert _step(s)[0] == [("short", 5), ("long", 27)]
    assert s.requests["short"].num_output_tokens == 1  # its first token, while the long prompt still prefills
    assert _step(s)[0] == [("short", 1), ("long", 31)]


def test_long_prefill_chunks_shrink_as_their_context_grows():
    s = _scheduler(num_blocks=256, budget=64, attention_cost_context=128)
    s.add(_request("long", 900))
    sizes, computed = [], 0
    while s.requests["long"].num_output_tokens == 0:
        (plan, out) = _step(s)
        [(_, n)] = plan
        assert s.cost(n, computed) <= 64 < s.cost(n + 1, computed) or computed + n == 900
        sizes.append(n)
        computed += n
    assert sum(sizes) == 900 and sizes[0] > 3 * sizes[-2]
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True)


def test_short_arrivals_slow_a_long_prompt_down_but_never_stop_it():
    s = _scheduler(num_blocks=256, budget=32, max_num_seqs=4)
    s.add(_request("long", 400))
    for i in range(8):
        s.add(_request(f"short{i}", 20, max_tokens=1, first_token=1000 + 20 * i))
        plan, _ = _step(s)
        assert plan == [(f"short{i}", 20), ("long", 12)]  # a quarter of the budget is kept back for it


def test_a_decode_preempted_later_in_the_same_step_is_not_scheduled():
    """Decodes are scheduled before prefills, so a prefill that needs memory can preempt a newer
    request whose decode was already planned for this step: that decode must leave the plan."""
    s = _scheduler(num_blocks=5, block_size=4, budget=8, prefix=False)
    s.add(_request("old", 20))
    assert _step(s)[0] == [("old", 8)]
    s.add(_request("new", 3, max_tokens=8, first_token=100))
    assert _step(s)[0] == [("new", 3), ("old", 5)]  # 4 + 1 blocks: the pool is full
    plan, out = _step(s)  # new's decode is planned first; old's last 7 prompt tokens need a 5th block
    assert [r.request_id for r in out.preempted] == ["new"]
    assert plan == [("old", 7)]
    assert s.requests["new"].status is RequestStatus.WAITING and s.requests["new"].num_computed_tokens == 0


def test_a_prefix_hit_evicted_earlier_in_the_same_step_is_looked_up_again():
    """w1's new blocks evict p's cached blocks, which w2 had counted as its hit when the step began."""
    s = _scheduler(num_blocks=6, block_size=4, budget=64)
    s.add(_request("p", 9, max_tokens=1))
    _step(s)
    assert s.kv.num_cached_blocks == 2
    s.add(_request("w1", 20, first_token=100))
    s.add(_request("w2", 9))  # p's prompt again
    plan, _ = _step(s)
    assert plan == [("w1", 20)]  # w2 waits: its hit is gone and the pool is full
    while "w1" in s.requests:
        _step(s)
    assert _step(s)[0] == [("w2", 9)] and s.requests["w2"].num_cached_tokens == 0


def test_a_preempted_long_prompt_is_not_preempted_again_for_newer_requests():
    s = _scheduler(num_blocks=24, block_size=4, budget=32, max_num_seqs=16, prefix=False)
    long = _request("long", 80, max_tokens=2, first_token=1000)
    s.add(long)
    for step in range(300):
        if step % 2 == 0:
            s.add(_request(f"s{step}", 16, max_tokens=8, first_token=step))
        _step(s)
        if "long" not in s.requests:
            break
    assert long.is_finished and long.num_preemptions <= 1


def test_without_chunking_a_long_prompt_is_not_overtaken_forever():
    s = _scheduler(num_blocks=256, block_size=16, budget=64, chunked=False, attention_cost_context=100)
    s.add(_request("long", 60))  # costs more than the budget at this attention price: it runs alone
    for step in range(3):
        s.add(_request(f"s{step}", 4, max_tokens=1, first_token=100 + 4 * step))
        plan, _ = _step(s)
        if ("long", 60) in plan:
            break
    assert plan == [("long", 60)] and step == 0


def test_a_prefill_advances_even_when_one_token_costs_more_than_the_budget():
    s = _scheduler(num_blocks=64, block_size=16, budget=16, attention_cost_context=10)
    s.add(_request("r", 399))
    for _ in range(400):
        if s.requests["r"].num_output_tokens:
            break
        _step(s)
    assert s.requests["r"].num_output_tokens == 1


def test_drafts_are_scheduled_with_the_last_token_and_rejected_ones_give_their_blocks_back():
    s = _scheduler(num_blocks=8, block_size=4)
    s.add(_request("r", 3, max_tokens=20))
    _step(s)  # the prompt; token 7 sampled
    request = s.requests["r"]
    request.verify = _chain([1, 2, 3, 4, 5])
    out = s.schedule()
    [chunk] = out.chunks
    assert (chunk.num_new_tokens, chunk.verify.token_ids, chunk.completes_sequence) == (6, [1, 2, 3, 4, 5], True)
    assert len(s.kv.block_ids("r")) == 3  # positions 0-8
    progressed = s.update(out, {"r": [1, 2, 9]})  # two drafts accepted, then the model's own token
    assert (progressed[0].num_new_tokens, progressed[0].num_draft_tokens, progressed[0].num_accepted_tokens) == (3, 5, 2)
    assert request.token_ids == [0, 1, 2, 7, 1, 2, 9] and request.num_computed_tokens == 6
    assert request.verify is None and len(s.kv.block_ids("r")) == 2  # the block of positions 8-11 is free
    assert s.kv.num_free_blocks == 6


def test_without_room_for_its_drafts_a_request_decodes_plainly_instead_of_preempting():
    s = _scheduler(num_blocks=3, block_size=4)
    s.add(_request("a", 3, max_tokens=20))
    s.add(_request("b", 3, max_tokens=20, first_token=50))
    _step(s)
    s.requests["a"].verify = _chain([1, 2, 3, 4, 5, 6])  # would need 2 more blocks; 1 is free
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens, c.verify) for c in out.chunks] == [
        ("a", 1, None), ("b", 1, None)]
    assert not out.preempted


def _chain(token_ids: list[int]) -> VerifyPlan:
    return VerifyPlan(token_ids, list(range(1, len(token_ids) + 1)), [token_ids[:i + 1] for i in range(len(token_ids))])
