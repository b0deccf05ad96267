"""The waiting queue's policies (engine/waiting.py) driving the scheduler (no model): who is
admitted first, who gives up a seat when the batch is full, and who gives its KV blocks back
when the pool runs out."""

from __future__ import annotations

import itertools

import pytest

from brisk.engine.kv_cache import KVCacheManager
from brisk.engine.request import Request, RequestStatus
from brisk.engine.scheduler import Scheduler
from brisk.engine.waiting import FairQueue, FcfsQueue, PriorityQueue, waiting_queue
from brisk.sample.params import SamplingParams

_arrivals = itertools.count()


def _scheduler(queue, max_num_seqs=4, budget=64, num_blocks=256) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, False), max_num_seqs, budget, True, 0, 1, queue)


def _request(rid: str, tenant: str = "default", priority: int = 0, prompt_len: int = 3,
             max_tokens: int = 1000) -> Request:
    # arrival times that order the requests as they are made, whatever the clock's resolution
    return Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival_time=next(_arrivals),
                   tenant=tenant, priority=priority)


def _step(s: Scheduler) -> tuple[list[str], list[str]]:
    """One step as the engine runs it, every due sample a token: (scheduled ids, preempted ids)."""
    out = s.schedule()
    s.update(out, {c.request.request_id: [7] for c in out.chunks if c.completes_sequence})
    return [c.request.request_id for c in out.chunks], [r.request_id for r in out.preempted]


def _running(s: Scheduler) -> list[str]:
    return sorted(r.request_id for r in s.running)


def test_fcfs_admits_in_arrival_order_and_never_preempts_for_a_seat():
    s = _scheduler(FcfsQueue(), max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add(_request(rid, priority={"c": -5}.get(rid, 0)))
    assert _step(s) == (["a", "b"], [])
    for _ in range(3):
        assert _step(s)[1] == []  # c's better priority means nothing under fcfs
    assert _running(s) == ["a", "b"]


def test_priority_admits_lower_values_first_and_takes_the_worst_seat():
    s = _scheduler(PriorityQueue(), max_num_seqs=2)
    s.add(_request("late", priority=5))
    s.add(_request("soon", priority=-1))
    s.add(_request("mid", priority=1))
    assert sorted(_step(s)[0]) == ["mid", "soon"]
    s.add(_request("urgent", priority=0))  # better than mid (1): mid gives up its seat
    scheduled, preempted = _step(s)
    assert preempted == ["mid"] and "urgent" in scheduled and "mid" not in scheduled
    assert _running(s) == ["soon", "urgent"]
    s.add(_request("equal", priority=0))  # a tie with the worst running one keeps the seat
    assert _step(s)[1] == []
    assert [r.request_id for r in s.waiting.admission_order(s.running)] == ["equal", "mid", "late"]


def test_fair_share_queues_a_burst_behind_its_own_tenant():
    """Tenant a floods the batch; b's requests arriving later are seated in the next step, each
    taking the seat of a's newest request, until b holds its share (half, equal weights)."""
    s = _scheduler(FairQueue(), max_num_seqs=4)
    for i in range(10):
        s.add(_request(f"a{i}", "a"))
    _step(s)
    assert _running(s) == ["a0", "a1", "a2", "a3"]
    for i in range(3):
        s.add(_request(f"b{i}", "b"))
    scheduled, preempted = _step(s)
    assert preempted == ["a3", "a2"]  # a's newest first; two seats: b's share of 4
    assert {"b0", "b1"} <= set(scheduled)
    assert _running(s) == ["a0", "a1", "b0", "b1"]
    for _ in range(3):  # b2 waits for one of b's own seats; nobody churns
        assert _step(s)[1] == []
    # both at their share: the next seat goes by arrival (a2, preempted, arrived before b2)
    assert [r.request_id for r in s.waiting.admission_order(s.running)][:3] == ["a2", "b2", "a3"]


def test_fair_share_follows_weights_and_frees_seats_to_the_tenant_that_is_left():
    s = _scheduler(FairQueue({"big": 3, "small": 1}), max_num_seqs=4)
    for i in range(6):
        s.add(_request(f"s{i}", "small", max_tokens=3))
        s.add(_request(f"b{i}", "big", max_tokens=3))
    _step(s)
    seated = [r.tenant for r in s.running]
    assert seated.count("big") == 3 and seated.count("small") == 1
    while s.has_unfinished_requests:  # every request finishes; nobody waits for ever
        _step(s)
    assert not s.waiting and not s.running


def test_fair_priority_orders_within_a_tenant_only():
    s = _scheduler(FairQueue(), max_num_seqs=2)
    s.add(_request("a-low", "a", priority=9))
    s.add(_request("a-high", "a", priority=-9))
    s.add(_request("b-any", "b", priority=50))
    assert sorted(_step(s)[0]) == ["a-high", "b-any"]  # b's bad priority does not cost it its turn


def test_fair_takes_a_seat_from_the_givers_worst_ranked_request():
    s = _scheduler(FairQueue(), max_num_seqs=2)
    s.add(_request("a-low", "a", priority=5))
    s.add(_request("a-high", "a", priority=-5))  # the newest, but a's best
    _step(s)
    s.add(_request("b0", "b"))
    assert _step(s)[1] == ["a-low"]


def test_a_preempted_request_is_recomputed_and_finishes():
    s = _scheduler(FairQueue(), max_num_seqs=2)
    s.add(_request("a0", "a", max_tokens=6))
    s.add(_request("a1", "a", max_tokens=6))
    _step(s)
    _step(s)
    s.add(_request("b0", "b", max_tokens=2))
    assert _step(s)[1] == ["a1"]
    a1 = s.requests["a1"]
    assert a1.status is RequestStatus.WAITING and a1.num_computed_tokens == 0 and a1.num_output_tokens == 2
    while s.has_unfinished_requests:
        _step(s)
    assert a1.num_output_tokens == 6 and a1.status is RequestStatus.FINISHED_LENGTH


def _fill_pool(queue, requests: list[tuple[str, str, int, int]]) -> Scheduler:
    """A pool of blocks of 4 tokens with exactly the blocks these (id, tenant, priority, prompt
    length) prompts take, all admitted in one step, in this arrival order: the next block any
    of them needs costs somebody else theirs. Each asks for 4 tokens, so any one fits alone."""
    s = _scheduler(queue, max_num_seqs=len(requests), budget=1024,
                   num_blocks=sum(-(-n // 4) for *_, n in requests))
    for rid, tenant, priority, prompt_len in requests:
        s.add(_request(rid, tenant, priority, prompt_len, max_tokens=4))
    assert sorted(_step(s)[0]) == sorted(r[0] for r in requests) and s.kv.num_free_blocks == 0
    return s


def _first_preempted(s: Scheduler) -> list[str]:
    """Who gives blocks back in the first step that preempts, in the order they were named."""
    for _ in range(8):
        preempted = _step(s)[1]
        if preempted:
            return preempted
    raise AssertionError("nobody was preempted")


def test_memory_pressure_preempts_the_newest_under_fcfs_and_the_worst_ranked_under_priority():
    """Three prompts of one block each: every decode needs a block more. fcfs: bad (the oldest)
    takes mid's, good's own go back. priority: bad gives its own back, good takes mid's."""
    requests = [("bad", "t", 9, 4), ("good", "t", 0, 4), ("mid", "t", 5, 4)]
    assert _first_preempted(_fill_pool(FcfsQueue(), requests)) == ["mid", "good"]
    s = _fill_pool(PriorityQueue(), requests)
    assert _first_preempted(s) == ["bad", "mid"]
    assert s.requests["good"].status is RequestStatus.RUNNING
    while s.has_unfinished_requests and s.requests["bad"].status is RequestStatus.WAITING:
        assert "good" not in _step(s)[1]


def test_fair_memory_goes_from_the_tenant_holding_most_blocks_for_its_weight():
    """a's second prompt holds 6 blocks, b's two hold 1 each: when the pool runs out, a gives
    back, not the newest request (b1, which fcfs would preempt); a0, the oldest running
    request, is never the one named, so the victim is a1."""
    requests = [("a0", "a", 0, 4), ("b0", "b", 0, 4), ("a1", "a", 0, 24), ("b1", "b", 0, 4)]
    assert _first_preempted(_fill_pool(FcfsQueue(), requests))[0] == "b1"
    assert _first_preempted(_fill_pool(FairQueue(), requests))[0] == "a1"
    # weights divide the blocks: a (7 blocks) over weight 8 holds less for its weight than b (2 over 1)
    assert _first_preempted(_fill_pool(FairQueue({"a": 8}), requests))[0] == "b1"


def test_fair_memory_pressure_never_preempts_the_oldest_request():
    """a's one request holds 6 of 8 blocks: over its share, but the oldest: b's newest gives
    back, and every request still finishes."""
    s = _fill_pool(FairQueue(), [("a0", "a", 0, 24), ("b0", "b", 0, 4), ("b1", "b", 0, 4)])
    assert _first_preempted(s)[0] == "b1"
    while s.has_unfinished_requests:
        assert "a0" not in _step(s)[1]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_waiting_queue_resolves_auto_and_refuses_unknown_policies():
    assert isinstance(waiting_queue("auto"), FcfsQueue)
    assert isinstance(waiting_queue("auto", {"a": 2.0}), FairQueue)
    with pytest.raises(ValueError, match="scheduling policy"):
        waiting_queue("lottery")
