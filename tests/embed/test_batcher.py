"""The DynamicBatcher with a fake model: which items share a batch, when a batch starts, and
that every caller gets its own result or its own error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from brisk.embed.batcher import BatchRecord, DynamicBatcher, QueueFull, SharedCores


class Model:
    """Records each batch (item sizes, in the order run) and answers item -> item * 10. The
    first batch can be held until release(), so that what arrives meanwhile queues up."""

    def __init__(self, hold_first: bool = False, bad: set[int] = frozenset()):
        self.batches: list[list[int]] = []
        self.bad = bad
        self._gate = threading.Event()
        if not hold_first:
            self._gate.set()
        self.started = threading.Event()

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.started.set()
        self._gate.wait(10)
        if self.bad & set(items):
            raise ValueError(f"bad items {sorted(self.bad & set(items))}")
        return [item * 10 for item in items]

    def release(self) -> None:
        self._gate.set()


class Clock:
    """A clock that moves only when told: the batcher's waits are then measured in exact steps.
    `reads` counts how often the batcher looked at it."""

    def __init__(self, now: float = 100.0):
        self.now, self.reads = now, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


async def _started(model: Model) -> None:
    await asyncio.get_running_loop().run_in_executor(None, model.started.wait, 10)


async def _queued(batcher: DynamicBatcher, depth: int) -> None:
    """Returns once `depth` items wait in the batcher's queue. Submitting takes no I/O, so each
    pass of the event loop lets every submitting task reach the queue; 1000 passes are plenty."""
    for _ in range(1000):
        if batcher.queue_depth == depth:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{batcher.queue_depth} items are queued, not {depth}")


async def _polled(batcher: DynamicBatcher, clock: Clock, times: int) -> None:
    """Returns once the batcher has looked at the clock `times` more times (each of its polls
    reads it twice), so whatever it decides at this clock reading has been decided; or at once
    if it has emptied its queue (it stops polling then)."""
    target = clock.reads + times
    for _ in range(10_000):
        if clock.reads >= target or not batcher.queue_depth:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the batcher stopped looking at its clock")


def _batcher(model, records=None, **options) -> DynamicBatcher:
    options = dict(max_batch_size=4, max_wait_ms=0.0) | options
    return DynamicBatcher(model, lambda item: item, on_batch=(records if records is not None else []).append, **options)


async def _held(first: int = 1, records=None, bad=frozenset(), **options):
    """A batcher whose first batch ([first]) runs, held until model.release(): whatever is
    submitted next queues behind it. (model, batcher, the first item's future)"""
    model = Model(hold_first=True, bad=bad)
    batcher = _batcher(model, records, **options)
    held = asyncio.ensure_future(batcher.submit(first))
    await _started(model)
    return model, batcher, held


def _behind_a_held_batch(first: int, sizes: tuple[int, ...], **options):
    """Runs `first` alone, held, while `sizes` queue up behind it in that order; then lets it
    go. (batches run, each item's result or exception, batch records)."""
    async def run():
        records = []
        model, batcher, held = await _held(first, records, **options)
        rest = [asyncio.ensure_future(batcher.submit(size)) for size in sizes]
        await _queued(batcher, len(sizes))
        model.release()
        results = await asyncio.gather(held, *rest, return_exceptions=True)
        await batcher.close()
        return model.batches, results, records

    return asyncio.run(run())


def test_the_oldest_item_goes_with_its_nearest_lengths():
    batches, results, _ = _behind_a_held_batch(5, (30, 2, 29, 3, 31, 1, 28))
    # 30 is the oldest waiting: it goes with 28, 29, 31 (padding 6), not 3 (padding 30); then 1, 2, 3.
    assert batches == [[5], [28, 29, 30, 31], [1, 2, 3]]
    assert results == [50, 300, 20, 290, 30, 310, 10, 280]


def test_the_token_budget_caps_the_padded_batch():
    batches, _, records = _behind_a_held_batch(1, (20, 20, 20, 20, 100), max_tokens_per_batch=60)
    assert batches == [[1], [20, 20, 20], [20], [100]]  # 4 x 20 = 80 padded tokens > 60; 100 runs alone
    assert [(r.size, r.tokens, r.padded_tokens) for r in records] == [(1, 1, 1), (3, 60, 60), (1, 20, 20),
                                                                      (1, 100, 100)]


def test_an_oldest_item_over_the_budget_with_others_runs_alone():
    batches, _, _ = _behind_a_held_batch(1, (40, 10, 10, 10), max_tokens_per_batch=60)
    # 40 is the oldest: with any 10 it would pad to 80 > 60, so it goes alone; then the 10s.
    assert batches == [[1], [40], [10, 10, 10]]


def test_submit_many_queues_all_or_nothing_and_a_closed_batcher_refuses():
    async def run():
        model, batcher, first = await _held(max_queue_size=3)
        with pytest.raises(QueueFull, match="4 more would pass the 3"):
            await batcher.submit_many([2, 3, 4, 5])
        assert batcher.queue_depth == 0  # none of them was queued
        many = asyncio.ensure_future(batcher.submit_many([2, 3]))
        await _queued(batcher, 2)
        model.release()
        results = await asyncio.gather(first, many)
        await batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit(6)
        return results

    assert asyncio.run(run()) == [10, [20, 30]]


def test_padding_is_counted_against_the_longest_item():
    _, _, records = _behind_a_held_batch(1, (4, 8))
    assert (records[1].size, records[1].tokens, records[1].padded_tokens) == (2, 12, 16)


def test_a_lone_item_waits_max_wait_and_a_full_batch_does_not():
    """On a clock that moves only when the test moves it: a lone item's batch has not started a
    microsecond before max_wait and starts at max_wait; a full batch starts with the clock
    standing still (a batcher that waited for it would wait forever: wait_for fails it)."""
    max_wait = 2 ** -7  # seconds (7.8125 ms): a binary fraction, so clock sums stay exact

    async def run():
        records, clock, model = [], Clock(), Model()
        batcher = _batcher(model, records, max_wait_ms=max_wait * 1000, max_batch_size=2, clock=clock)
        lone = asyncio.ensure_future(batcher.submit(1))
        await _queued(batcher, 1)
        arrival = clock.now
        clock.now = arrival + max_wait - 2 ** -20
        await _polled(batcher, clock, 4)  # two polls at this reading
        assert not model.started.is_set() and batcher.queue_depth == 1
        clock.now = arrival + max_wait
        assert await asyncio.wait_for(lone, 10) == 10
        full = await asyncio.wait_for(asyncio.gather(batcher.submit(1), batcher.submit(2)), 10)
        await batcher.close()
        return records, full

    records, full = asyncio.run(run())
    assert full == [10, 20]
    assert [r.size for r in records] == [1, 2]
    assert records[0].queue_waits == [max_wait]
    assert records[1].queue_waits == [0.0, 0.0]


def test_each_caller_gets_its_own_error():
    batches, results, _ = _behind_a_held_batch(1, (6, 7, 8), bad={7})
    assert results[:2] == [10, 60] and results[3] == 80
    assert isinstance(results[2], ValueError) and "bad items [7]" in str(results[2])
    # The batch failed as a whole, so its items ran again alone.
    assert batches == [[1], [6, 7, 8], [6], [7], [8]]


def test_per_item_exceptions_from_the_model_reach_only_their_callers():
    def model(items):
        return [ValueError(f"no {i}") if i == 2 else i for i in items]

    async def run():
        batcher = DynamicBatcher(model, max_batch_size=8, max_wait_ms=20.0)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)
        await batcher.close()
        return results

    results = asyncio.run(run())
    assert results[0:2] == [0, 1] and results[3] == 3 and str(results[2]) == "no 2"


def test_a_cancelled_caller_leaves_the_queue():
    async def run():
        model, batcher, first = await _held()
        gone, kept = asyncio.ensure_future(batcher.submit(2)), asyncio.ensure_future(batcher.submit(3))
        await _queued(batcher, 2)
        gone.cancel()
        await _queued(batcher, 1)  # the cancelled caller's item is gone from the queue
        model.release()
        results = await asyncio.gather(first, kept)
        await batcher.close()
        return model.batches, results, gone.cancelled()

    batches, results, cancelled = asyncio.run(run())
    assert batches == [[1], [3]] and results == [10, 30] and cancelled


def test_a_full_queue_refuses_and_close_fails_every_caller():
    async def run():
        model, batcher, running = await _held(max_queue_size=2)
        waiting = [asyncio.ensure_future(batcher.submit(2)), asyncio.ensure_future(batcher.submit(3))]
        await _queued(batcher, 2)
        with pytest.raises(QueueFull, match="2 items are waiting"):
            await batcher.submit(4)
        closing = asyncio.ensure_future(batcher.close())
        results = await asyncio.gather(running, *waiting, return_exceptions=True)
        model.release()  # the held batch ends; close() returns once its thread is done
        await closing
        return results

    results = asyncio.run(run())
    assert [type(r) for r in results] == [RuntimeError] * 3 and all("closed" in str(r) for r in results)


def test_records_describe_each_batch():
    """Times on an injected clock: the items waited from arrival to their batch's start, and the
    batched call's seconds are the time the model itself moved the clock by."""
    clock = Clock(now=100.0)

    def model(items):
        clock.now += 0.25  # the batched call takes a quarter of a second on the batcher's clock
        return [0] * len(items)

    async def run():
        records: list[BatchRecord] = []
        batcher = DynamicBatcher(model, len, max_batch_size=3, max_wait_ms=1e6, on_batch=records.append,
                                 clock=clock)
        first = asyncio.ensure_future(batcher.submit([0] * 2))
        await _queued(batcher, 1)
        clock.now += 0.5  # the second and third items arrive half a second later; then the batch is full
        await asyncio.gather(first, *(batcher.submit([0] * n) for n in (3, 4)))
        await batcher.close()
        return records

    (record,) = asyncio.run(run())
    assert (record.size, record.tokens, record.padded_tokens, record.failed) == (3, 9, 12, 0)
    assert record.queue_waits == [0.5, 0.0, 0.0] and record.seconds == 0.25


def test_while_generation_runs_batches_are_short_and_each_is_followed_by_a_pause(monkeypatch):
    """SharedCores: with generation busy, padded batches of at most max_tokens, each followed by
    a pause of (1 - share) / share times its own duration; once idle, full batches, no pause."""
    clock, busy, pauses = Clock(), [True], []
    real_sleep = asyncio.sleep

    async def sleep(seconds):
        if seconds:
            pauses.append(seconds)
        await real_sleep(0)

    class Timed(Model):
        def __call__(self, items):
            clock.now += 2.0  # each batch takes 2 s on the batcher's clock
            return super().__call__(items)

    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def run():
        model = Timed(hold_first=True)
        batcher = _batcher(model, clock=clock, max_batch_size=4,
                           shared=SharedCores(lambda: busy[0], share=0.25, max_tokens=25))
        held = asyncio.ensure_future(batcher.submit(10))
        await _started(model)
        rest = [asyncio.ensure_future(batcher.submit(10)) for _ in range(4)]
        await _queued(batcher, 4)
        model.release()
        await asyncio.gather(held, *rest)
        busy[0] = False
        idle = [asyncio.ensure_future(batcher.submit(10)) for _ in range(4)]
        await asyncio.gather(*idle)
        await batcher.close()
        return model.batches

    batches = asyncio.run(run())
    assert [len(b) for b in batches] == [1, 2, 2, 4]  # 3 x 10 padded tokens would pass 25
    assert pauses == [6.0, 6.0, 6.0]  # 2 s batches at a quarter share: 6 s off each; none once idle


def test_shared_cores_are_checked():
    for share, tokens in ((0.0, 10), (1.5, 10), (0.5, 0)):
        with pytest.raises(ValueError, match="SharedCores"):
            DynamicBatcher(Model(), shared=SharedCores(lambda: True, share, tokens))
