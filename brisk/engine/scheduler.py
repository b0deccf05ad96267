"""Continuous batching: which requests advance by how many tokens in the next step.

Every step has a token budget (max_num_batched_tokens). Running requests are served first, in
admission order: a decode needs one token, an unfinished prompt takes as much of the budget as
is left (chunked prefill). Waiting requests are admitted with what remains, up to max_num_seqs.

When the block pool cannot hold a running request's next tokens, the newest running request
is preempted: its blocks go back to the pool and it returns to the head of the waiting queue,
to be recomputed later (its full blocks usually survive in the prefix cache, so the recompute
is cheap). A request therefore never fails for lack of KV memory; it only waits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from brisk.engine.kv_cache import KVCacheManager
from brisk.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """True when, after this chunk, every known token has K/V, so the next one is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0  # summed over steps


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # memory is short: admitting more would only preempt again
            self._admit_waiting(out, budget)
        if out.chunks:
            self.stats.num_steps += 1
            self.stats.num_batched_tokens += out.num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            n = request.num_tokens - num_cached
            if n > budget:
                if not self.enable_chunked_prefill:
                    return
                n = budget
            if not self.kv.allocate(request, n, cached):
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                request.times.first_scheduled = time.monotonic()
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Records a finished step: computed tokens, newly sampled tokens, finished requests.

        Returns the requests that gained a token this step, finished or not.
        """
        progressed = []
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            self.kv.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prompt chunk that is not the last one
            request.append_token(token)
            progressed.append(request)
            if request.is_finished:
                self._remove(request)
        return progressed

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request early (abort, or a stop string found after detokenizing)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.status = status
        self._remove(request)
        return request

    def _remove(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
