"""Scheduler on its own (no model): budgets, chunked prefill, admission limits, preemption."""

from __future__ import annotations

from brisk.engine.kv_cache import KVCacheManager
from brisk.engine.request import Request, RequestStatus
from brisk.engine.scheduler import Scheduler
from brisk.sampling_params import SamplingParams


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
    sampled = {c.request.request_id: token for c in out.chunks if c.completes_sequence}
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
