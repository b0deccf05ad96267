"""Continuous batching: which requests advance by how many tokens in the next step.

Every step has a budget (max_num_batched_tokens) counted in token-equivalents, not tokens: a
token attending to c cached tokens costs 1 + c / attention_cost_context (StepCost). On a CPU a
512-token chunk at 7,500 tokens of context takes several times as long as one at the start of a
prompt, so a fixed token cap would make a long prompt's late chunks take seconds each; priced
this way, a long prompt's chunks shrink as its context grows and every step takes about as long.

Order within a step (no phases: every request just has tokens left to compute):
  1. decodes of running requests (one token each; what keeps streams flowing);
  2. prefills that can finish in this step, running ones first, then waiting ones in arrival
     order: a short request that arrives behind a long prompt is admitted at the next step and
     gets its first token from it, instead of waiting out the long prefill;
  3. what budget is left goes to the prefills that cannot finish, oldest first, as chunks (the
     oldest one advances by at least a token even when decodes took the whole budget).
While some prefill cannot finish in one step, step 2 keeps a quarter of the budget back for
step 3, so a stream of short arrivals can slow a long prompt down but not stop it. Without
chunked prefill, prompts are admitted in arrival order, and one over the budget runs as the
step's only prefill.

Speculative decoding adds no phase either: a running request that carries k rows to verify
(request.verify, a step hook's proposal) is scheduled for 1 + k tokens, its last token and the
drafts, priced like any chunk. The step verifies them (the step hook keeps the accepted drafts'
K/V); update() returns the blocks that held only rejected ones. When
memory is short a request drops its drafts before anyone is preempted.

A step of nothing but plain greedy decodes may run several forward passes (num_scheduler_steps,
multi-step scheduling): each sequence gets slots for all of them up front, or the step runs one
pass (_decode_passes). update() then appends each sequence's tokens until one stops it.

When the block pool cannot hold a running request's next tokens, a running request is
preempted, the one the waiting queue's policy names (memory_victim: the newest under fcfs, the
worst-ranked under priority, under fair the tenant's that holds the most blocks for its weight):
its blocks go back to the pool and it returns to the waiting queue (at its head, under fcfs), to
be recomputed later (its full blocks usually survive in the prefix cache, so
the recompute is cheap). A request therefore never fails for lack of KV memory; it only waits.

Which waiting request is tried first, and whether one may take a running request's seat when
the batch is full, is the waiting queue's policy (engine/waiting.py: fcfs, priority, fair by
tenant); the steps above take waiting requests in the order it gives. Seats are given up at the
start of a step, before decodes are scheduled, so the preempted requests' decodes are not run.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field

from brisk.engine.kv_cache import KVCacheManager
from brisk.engine.request import Request, RequestStatus
from brisk.engine.step_hook import VerifyPlan
from brisk.engine.waiting import FcfsQueue, WaitingQueue


@dataclass(frozen=True)
class StepCost:
    """The price of computing tokens, in token-equivalents (see the module docstring).
    attention_cost_context = 0 prices every token at 1: a plain token budget."""

    attention_cost_context: int

    def __call__(self, num_new_tokens: int, num_computed_tokens: int) -> float:
        if not self.attention_cost_context:
            return float(num_new_tokens)
        # Token i of the chunk attends to num_computed + i + 1 keys; their mean is below.
        mean_context = num_computed_tokens + (num_new_tokens + 1) / 2
        return num_new_tokens * (1.0 + mean_context / self.attention_cost_context)

    def max_tokens(self, budget: float, num_computed_tokens: int, limit: int) -> int:
        """The most tokens (at most limit) whose cost fits in budget: the positive root of
        n^2 / 2K + n (1 + (c + 1/2) / K) = budget, in the form that does not cancel for large K."""
        if budget <= 0:
            return 0
        k = self.attention_cost_context
        if not k:
            return min(int(budget), limit)
        a, b = 1 / (2 * k), 1 + (num_computed_tokens + 0.5) / k
        n = int(2 * budget / (b + math.sqrt(b * b + 4 * a * budget)) + 1e-9)
        while n > 0 and self(n, num_computed_tokens) > budget:  # float rounding at the boundary
            n -= 1
        return min(n, limit)


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # the verified rows included
    verify: VerifyPlan | None = None  # rows verified in this step, after the last token

    @property
    def num_verify_rows(self) -> int:
        return len(self.verify) if self.verify is not None else 0

    @property
    def completes_sequence(self) -> bool:
        """True when, after this chunk, every known token has K/V, so the next one is sampled."""
        num_known = self.num_new_tokens - self.num_verify_rows
        return self.request.num_computed_tokens + num_known == self.request.num_tokens


@dataclass
class Progress:
    """A request that gained tokens in a step."""

    request: Request
    num_new_tokens: int  # several when drafts were accepted
    num_draft_tokens: int = 0  # drafts verified in the step
    num_accepted_tokens: int = 0  # of those, accepted
    draft_source: str = ""  # where they came from (VerifyPlan.source)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Forward passes the step runs: more than one only for a step of plain greedy decodes, with
    # slots allocated for every pass (Scheduler._decode_passes).
    decode_passes: int = 1

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
                 enable_chunked_prefill: bool = True, attention_cost_context: int = 2048, num_scheduler_steps: int = 1,
                 waiting: WaitingQueue | None = None):
        self.kv = kv
        self.num_scheduler_steps = num_scheduler_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.cost = StepCost(attention_cost_context)
        self.waiting = waiting if waiting is not None else FcfsQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.num_waiting_tokens = 0  # prompt tokens of the waiting requests, for admission control

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        seat_victims = self.waiting.seat_victims(self.running, self.max_num_seqs)
        for victim in seat_victims:
            self.running.remove(victim)
            self._preempt(victim)
        budget = self.max_num_batched_tokens - self._schedule_decodes(out)
        if not out.preempted:  # memory is short: admitting more would only preempt again
            self._schedule_prefills(out, budget)
        out.preempted[:0] = seat_victims
        if out.chunks:
            out.decode_passes = self._decode_passes(out)
            self.stats.num_steps += 1
            self.stats.num_batched_tokens += out.num_batched_tokens
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> float:
        """Schedules every running request that has one token left to compute, with its drafts
        if the pool has room for them; returns their cost."""
        cost = 0.0
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.num_tokens - request.num_computed_tokens != 1:
                continue  # preempted a moment ago, or a prefill
            plan = request.verify
            if plan is not None and not self.kv.allocate(request, 1 + len(plan)):
                plan = None
            if plan is not None or self._allocate_running(request, 1, out):
                n = 1 + (len(plan) if plan is not None else 0)
                out.chunks.append(ScheduledChunk(request, n, plan))
                cost += self.cost(n, request.num_computed_tokens)
        return cost

    def _decode_passes(self, out: SchedulerOutput) -> int:
        """How many forward passes this step runs: up to num_scheduler_steps when every chunk is
        one plain greedy decode whose next tokens depend on nothing but the argmax (no logprobs,
        penalties, biases, grammar, pending min_tokens or stop strings), fewer when a sequence
        may gain fewer tokens, and 1 when the pool cannot give every sequence room for them
        (what it did give stays with the sequence, for its next tokens).

        Several passes per step keep a GPU busy while the host would otherwise schedule, build
        inputs and process outputs between every two of them (vLLM's multi-step scheduling): the
        runner feeds each pass the previous one's tokens on the device and reads them all once.
        """
        passes = self.num_scheduler_steps
        if passes == 1:
            return 1
        for chunk in out.chunks:
            if not (chunk.num_new_tokens == 1 and chunk.completes_sequence and chunk.request.next_token_is_argmax):
                return 1
            passes = min(passes, chunk.request.max_total_tokens - chunk.request.num_tokens)
        if passes > 1 and all(self.kv.allocate(c.request, passes) for c in out.chunks):
            return passes
        return 1

    def _allocate_running(self, request: Request, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Allocates for a running request, preempting running ones (as the waiting queue's policy
        names them) until it fits; False if the request itself had to go."""
        while not self.kv.allocate(request, num_new_tokens):
            victim = self.waiting.memory_victim(self.running, self.kv.num_held_blocks)
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            out.chunks = [c for c in out.chunks if c.request is not victim]  # a decode scheduled above
            if victim is request:
                return False
        return True

    def _schedule_prefills(self, out: SchedulerOutput, budget: float) -> None:
        candidates = [_Prefill(r, r.num_computed_tokens) for r in self.running
                      if r.num_tokens - r.num_computed_tokens > 1]
        seats = self.max_num_seqs - len(self.running)
        for request in itertools.islice(self.waiting.admission_order(self.running), max(seats, 0)):
            candidates.append(_Prefill(request, self.kv.find_cached_prefix(request).num_tokens))
        chunked = self.enable_chunked_prefill
        long = any(self.cost(c.remaining, c.num_computed) > budget for c in candidates)
        reserve = budget / 4 if long and chunked else 0.0
        admitting = True  # waiting requests are admitted in arrival order until one cannot be
        for c in candidates:  # prefills that finish in this step
            if not (c.running or admitting):
                continue
            cost = self.cost(c.remaining, c.num_computed)
            alone = not chunked and not any(x.scheduled for x in candidates)
            if cost > budget - reserve and not alone:  # without chunking, an over-budget prompt runs alone
                admitting = admitting and chunked  # without chunking, nobody overtakes it
                continue
            if self._start_prefill(c, c.remaining, out):
                budget -= cost
            elif not c.running:
                admitting = False
            if out.preempted:  # memory is short: stop here
                return
        if not chunked:
            return
        for c in candidates:  # chunks of the rest, oldest first
            if c.scheduled or not (c.running or admitting):
                continue
            n = self.cost.max_tokens(budget, c.num_computed, c.remaining)
            if n == 0 and not any(x.scheduled for x in candidates):
                n = 1  # decodes took the whole budget: the oldest prefill still advances
            if n == 0:
                return
            started = self._start_prefill(c, n, out)
            if out.preempted or not (started or c.running):
                return
            budget -= self.cost(n, c.num_computed)

    def _start_prefill(self, c: "_Prefill", n: int, out: SchedulerOutput) -> bool:
        request = c.request
        if c.running:
            if not self._allocate_running(request, n, out):
                return False
        else:
            if len(self.running) >= self.max_num_seqs:
                return False
            # Looked up again: blocks this step allocated may have evicted part of the hit.
            hit = self.kv.find_cached_prefix(request)
            if hit.num_tokens != c.num_computed or not self.kv.allocate(request, n, hit):
                return False
            self._admit(request, c.num_computed)
        c.scheduled = True
        out.chunks.append(ScheduledChunk(request, n))
        return True

    def _admit(self, request: Request, num_cached: int) -> None:
        self.waiting.remove(request)
        self.num_waiting_tokens -= request.num_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            request.times.first_scheduled = time.monotonic()
        # Kept in arrival order, so fcfs preempts the newest request for memory, whatever order the
        # step admitted them in (a preempted long prompt re-admitted after short ones stays older).
        bisect.insort(self.running, request, key=lambda r: r.arrival_time)

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        self.waiting.push(request, preempted)
        self.num_waiting_tokens += request.num_tokens

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(request, preempted=True)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Progress]:
        """Records a finished step: computed tokens, new tokens, finished requests.

        `sampled` holds, per request that reached the end of its known tokens, the tokens it
        gains: the drafts the model accepted, then one of its own. Returns the requests that
        gained tokens, finished or not.
        """
        progressed = []
        for chunk in out.chunks:
            request = chunk.request
            tokens = sampled.get(request.request_id)
            if tokens is None:  # a prompt chunk that is not the last one
                request.num_computed_tokens += chunk.num_new_tokens
                self.kv.cache_full_blocks(request)
                continue
            num_drafts, source = chunk.num_verify_rows, chunk.verify.source if chunk.verify is not None else ""
            progressed.append(Progress(request, self._append(request, chunk, tokens), num_drafts,
                                       len(tokens) - 1 if num_drafts else 0, source))
            if request.is_finished:
                self._remove(request)
        return progressed

    def _append(self, request: Request, chunk: ScheduledChunk, tokens: list[int]) -> int:
        """Appends the step's tokens (up to one that finishes the request); returns how many.

        The chunk computed K/V for the known tokens and every draft; the step hook's slot moves
        have put the accepted drafts' K/V right after the known tokens (tree branches leave
        gaps), and the blocks beyond them go back to the pool.
        """
        num_drafts = chunk.num_verify_rows
        num_accepted = len(tokens) - 1
        appended = 0
        for token in tokens:
            request.append_token(token)
            appended += 1
            if request.is_finished:
                break
        request.num_computed_tokens += chunk.num_new_tokens - num_drafts + min(num_accepted, appended)
        request.verify = None
        if num_drafts:
            request.spec_stats.observe(num_drafts, num_accepted, chunk.verify.source)
            self.kv.trim(request, request.num_computed_tokens)
        self.kv.cache_full_blocks(request)
        return appended

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request early (abort, or a stop string found after detokenizing)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        was_waiting = request.status is RequestStatus.WAITING
        request.status = status
        self._remove(request, was_waiting)
        return request

    def _remove(self, request: Request, was_waiting: bool = False) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        if was_waiting:
            self.waiting.remove(request)
            self.num_waiting_tokens -= request.num_tokens
        else:
            self.running.remove(request)


@dataclass(eq=False)
class _Prefill:
    """A request with prompt tokens left to compute, as step 2 and 3 of schedule() see it."""

    request: Request
    num_computed: int  # tokens with K/V once it runs (a waiting request's prefix-cache hit)
    scheduled: bool = False

    @property
    def running(self) -> bool:
        return self.request.status is RequestStatus.RUNNING

    @property
    def remaining(self) -> int:
        return self.request.num_tokens - self.num_computed

