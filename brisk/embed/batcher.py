"""DynamicBatcher: one-shot work (an embedding, a classification) from many callers, run in batches.

Callers `await batcher.submit(item)` one item at a time; the batcher holds waiting items until
a batch is due (max_batch_size items, or max_tokens_per_batch padded tokens, or the oldest item
has waited max_wait_ms), then runs one call over the batch on a worker thread, so the event
loop keeps accepting callers while the model computes, and items that arrive meanwhile form
the next batch: under load, batches fill by themselves and max_wait_ms is never waited.

Which items: the oldest waiting item always goes (so no item waits behind a stream of
better-fitting ones), with the items nearest its length: among every window of the waiting
items sorted by length that holds it, the one with the most items, then the least padding.
Padding is what a batch pays for its longest row: padded tokens = items x longest.

Each caller gets its own result or its own exception. If the batched call fails as a whole,
its items run again one by one, so one bad input fails only itself. A caller cancelled while
waiting leaves the queue; one cancelled while its batch runs just drops its result. A full
queue refuses new items with QueueFull (the server's 429).

Sharing the cores (SharedCores): the server's batcher runs beside the generation engine on the
same few cores, and a flood of embedding inputs run back to back took them from it (six clients
sending 2,048 inputs each raised an 8-token chat's latency from 0.1 s to 2-4 s). So while
generation has work, batches are kept short (`max_tokens` padded tokens) and each is followed
by a pause that holds the batcher to `share` of the wall time; the queue then fills, and
QueueFull answers the excess with 429. With generation idle, batches run back to back as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

logger = logging.getLogger("brisk.embed")

T = TypeVar("T")
R = TypeVar("R")


class QueueFull(RuntimeError):
    """The batcher's queue is at max_queue_size: try again later."""


@dataclass(frozen=True)
class BatchRecord:
    """One batch as it ran: what a metrics sink (Prometheus, a benchmark) is given."""

    size: int
    tokens: int  # the items' own sizes, summed
    padded_tokens: int  # size x the longest item
    queue_waits: list[float]  # seconds each item waited, arrival to the batch's start
    seconds: float  # the batched call's wall time
    failed: int  # items answered with an exception


@dataclass(frozen=True)
class SharedCores:
    """How the batcher yields the cores while `busy()` (other work, generation, is running):
    batches of at most `max_tokens` padded tokens, each followed by a pause that keeps the
    batcher's share of the wall time at most `share` (0 < share <= 1)."""

    busy: Callable[[], bool]
    share: float
    max_tokens: int

    def pause(self, batch_seconds: float) -> float:
        return batch_seconds * (1 - self.share) / self.share


@dataclass(eq=False)  # compared by identity: queue membership, not equal items
class _Waiting:
    item: object
    size: int
    arrival: float
    future: asyncio.Future


class DynamicBatcher(Generic[T, R]):
    """Groups items submitted from many coroutines into batched calls (see the module docstring)."""

    def __init__(self, run: Callable[[list[T]], Sequence[R | BaseException]], size: Callable[[T], int] = lambda _: 1,
                 *, max_batch_size: int = 64, max_wait_ms: float = 5.0, max_tokens_per_batch: int | None = None,
                 max_queue_size: int = 4096, on_batch: Callable[[BatchRecord], None] = lambda _: None,
                 clock: Callable[[], float] = time.monotonic, shared: SharedCores | None = None):
        """run: a batch of items -> one result (or exception) per item, in order. size: an
        item's length in tokens (what padding and the token budget count)."""
        if max_batch_size < 1 or max_wait_ms < 0 or max_queue_size < 1:
            raise ValueError("max_batch_size and max_queue_size must be >= 1 and max_wait_ms >= 0")
        if max_tokens_per_batch is not None and max_tokens_per_batch < 1:
            raise ValueError("max_tokens_per_batch must be >= 1")
        if shared is not None and not (0 < shared.share <= 1 and shared.max_tokens >= 1):
            raise ValueError("a SharedCores share must be in (0, 1] and its max_tokens >= 1")
        self._shared = shared
        self._run, self._size, self._on_batch, self._clock = run, size, on_batch, clock
        self.max_batch_size, self.max_wait = max_batch_size, max_wait_ms / 1000
        self.max_tokens_per_batch, self.max_queue_size = max_tokens_per_batch, max_queue_size
        self._waiting: list[_Waiting] = []
        self._running: list[_Waiting] = []
        self._closed = False
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="brisk-batcher")

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    async def submit(self, item: T) -> R:
        """This item's result, once its batch has run; its own exception if it failed."""
        return (await self.submit_many([item]))[0]

    async def submit_many(self, items: list[T]) -> list[R]:
        """The results of several items, queued together (all or none: QueueFull if they do not
        all fit). If one fails, the others leave the queue and its exception is raised."""
        if self._closed:
            raise RuntimeError("the batcher was closed")
        if len(self._waiting) + len(items) > self.max_queue_size:
            raise QueueFull(f"{len(self._waiting)} items are waiting, and {len(items)} more would pass the "
                            f"{self.max_queue_size} this batcher queues")
        self._start()
        loop = asyncio.get_running_loop()
        entries = [_Waiting(item, self._size(item), self._clock(), loop.create_future()) for item in items]
        self._waiting.extend(entries)
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(e.future for e in entries)))
        except BaseException:  # cancelled, or one item failed: the rest are not waited for
            for entry in entries:
                entry.future.cancel()
            self._waiting = [e for e in self._waiting if not e.future.done()]
            raise

    async def close(self) -> None:
        """Stops the batcher: every caller still waiting for a result gets RuntimeError, and
        later submits are refused."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for entry in self._waiting + self._running:
            if not entry.future.done():
                entry.future.set_exception(RuntimeError("the batcher was closed"))
        self._waiting, self._running = [], []
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    def _start(self) -> None:
        if self._task is None:
            self._arrived = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="brisk-dynamic-batcher")
            self._task.add_done_callback(self._stopped)

    def _stopped(self, task: asyncio.Task) -> None:
        """The loop ended: on close (cancelled), or by a bug; then nobody may wait forever."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("the dynamic batcher's loop failed", exc_info=task.exception())
        self._closed = True
        for entry in self._waiting + self._running:
            if not entry.future.done():
                entry.future.set_exception(RuntimeError(f"the batcher failed: {task.exception()!r}"))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            while not self._due():
                self._arrived.clear()
                timeout = self._waiting[0].arrival + self.max_wait - self._clock()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except TimeoutError:
                    pass
            batch = self._running = self._take()
            if not batch:
                continue
            start = self._clock()
            outcomes = await loop.run_in_executor(self._executor, self._run_each, [e.item for e in batch])
            seconds = self._clock() - start
            self._running = []
            for entry, outcome in zip(batch, outcomes):
                if entry.future.done():  # the caller was cancelled while its batch ran
                    continue
                if isinstance(outcome, BaseException):
                    entry.future.set_exception(outcome)
                else:
                    entry.future.set_result(outcome)
            if self._shared is not None and self._shared.busy():  # give the cores back for a while
                await asyncio.sleep(self._shared.pause(seconds))
            sizes = [e.size for e in batch]
            try:
                self._on_batch(BatchRecord(len(batch), sum(sizes), self._padded(sorted(sizes)),
                                           [start - e.arrival for e in batch], seconds,
                                           sum(isinstance(o, BaseException) for o in outcomes)))
            except Exception:  # a broken metrics sink must not stop the batcher
                logger.exception("on_batch failed")

    def _due(self) -> bool:
        """Whether a batch should start now: the oldest item has waited long enough, or a full
        batch is waiting."""
        if not self._waiting:
            return True  # its callers were cancelled meanwhile: _take returns no batch, the loop sleeps again
        if self._clock() - self._waiting[0].arrival >= self.max_wait or len(self._waiting) >= self.max_batch_size:
            return True
        budget = self._token_budget()
        return budget is not None and self._padded(sorted(e.size for e in self._waiting)) >= budget

    def _token_budget(self) -> int | None:
        """Padded tokens a batch may hold now: fewer while the cores are shared."""
        if self._shared is None or not self._shared.busy():
            return self.max_tokens_per_batch
        return min(self.max_tokens_per_batch or self._shared.max_tokens, self._shared.max_tokens)

    @staticmethod
    def _padded(sorted_sizes: list[int]) -> int:
        return len(sorted_sizes) * sorted_sizes[-1]

    def _take(self) -> list[_Waiting]:
        """Removes the next batch from the queue (see the module docstring) and returns it; the
        items in order of length."""
        self._waiting = [e for e in self._waiting if not e.future.done()]  # cancelled callers
        if not self._waiting:
            return []
        by_size = sorted(self._waiting, key=lambda e: e.size)
        oldest = by_size.index(self._waiting[0])
        budget = self._token_budget()
        best, best_key = (oldest, oldest + 1), None
        for start in range(max(0, oldest - self.max_batch_size + 1), oldest + 1):
            if budget is not None and (oldest + 1 - start) * by_size[oldest].size > budget:
                continue  # even ending at the oldest, this window's padded batch is over the budget
            end = min(len(by_size), start + self.max_batch_size)
            # Shrink from the long end until the padded batch fits the budget (the oldest stays).
            while end > oldest + 1 and budget is not None and (end - start) * by_size[end - 1].size > budget:
                end -= 1
            count = end - start
            padding = count * by_size[end - 1].size - sum(e.size for e in by_size[start:end])
            key = (count, -padding)
            if best_key is None or key > best_key:
                best, best_key = (start, end), key
        batch = by_size[best[0]:best[1]]
        chosen = set(map(id, batch))
        self._waiting = [e for e in self._waiting if id(e) not in chosen]
        return batch

    def _run_each(self, items: list[T]) -> list[R | BaseException]:
        """The batched call; if it fails as a whole, each item alone, so only the bad ones fail."""
        try:
            outcomes = list(self._run(items))
            if len(outcomes) != len(items):
                raise RuntimeError(f"the batch function returned {len(outcomes)} results for {len(items)} items")
            return outcomes
        except Exception as e:
            if len(items) == 1:
                return [e]
        return [self._run_each([item])[0] for item in items]
