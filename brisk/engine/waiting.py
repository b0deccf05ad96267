"""The waiting queue and its policy: which waiting request the scheduler admits next, and which
running one gives up its seat.

The scheduler asks a WaitingQueue two things each step: the order in which to try admitting
waiting requests (`admission_order`), and, when every seat of the batch is taken, which running
requests to preempt so that a waiting one that ranks above them can start (`seat_victims`). A
preempted request loses its KV blocks and is recomputed later, as under memory pressure (its full
blocks usually survive in the prefix cache, so the recompute is cheap). Three policies, vLLM's
`--scheduling-policy` names and one more:

  fcfs      arrival order; a preempted request goes back to the head of the queue; nobody is
            preempted for a seat (only for memory, by the scheduler).
  priority  by `priority` (lower first, as vLLM's), then arrival. A waiting request whose
            priority is lower than that of the worst running request takes its seat.
  fair      by tenant, in proportion to weights. A tenant's share of the batch's seats is its
            weight over the weights of the tenants with work (running or waiting). Waiting
            requests are admitted in turns, the tenant furthest below its share first, so one
            tenant's burst queues behind its own requests, not everyone's; within a tenant, by
            priority, then arrival. When every seat is taken, a waiting tenant below its share
            takes a seat from the tenant furthest above its share (its worst-ranked running request).

The fair policy's bound: a request of a tenant below its share is given a seat in the first
step after it arrives (the step preempts for it), and its prompt is then scheduled like any
other (a short prompt finishes in that step: the scheduler runs prefills that can finish before
chunks of long ones). It is a bound in seats. KV memory is shared out by weight where it runs
short: when the pool cannot hold a running request's next tokens, the request preempted to make
room (`memory_victim`) belongs to the tenant holding the most blocks for its weight, so one
tenant's long contexts cost that tenant, not the others. Under fcfs the newest request gives its
blocks back (vLLM's rule), under priority the worst-ranked one (vLLM's too).
"""

from __future__ import annotations

import abc
import bisect
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator

from brisk.config import SCHEDULING_POLICIES
from brisk.engine.request import Request


class WaitingQueue(abc.ABC):
    """The requests that wait for a seat in the batch, and the policy that orders them."""

    @abc.abstractmethod
    def push(self, request: Request, preempted: bool = False) -> None:
        """Adds a new request, or one just preempted (which has waited longest)."""

    @abc.abstractmethod
    def remove(self, request: Request) -> None: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no promised order."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def admission_order(self, running: list[Request]) -> Iterator[Request]:
        """The order in which the scheduler tries to admit waiting requests this step."""
        return iter(self)

    def seat_victims(self, running: list[Request], seats: int) -> list[Request]:
        """Running requests to preempt so that waiting ones ranked above them get seats, with
        `seats` seats in the batch in all; none by default."""
        return []

    def memory_victim(self, running: list[Request], held: Callable[[Request], int]) -> Request:
        """The running request that gives its KV blocks back when the pool cannot hold a running
        request's next tokens (`running` in arrival order, `held` the blocks a request holds; the
        request that needs the room may be the one named). The newest by default, as vLLM does
        under fcfs: the oldest request always advances, so every request finishes."""
        return running[-1]


class FcfsQueue(WaitingQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request, preempted: bool = False) -> None:
        if preempted:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def _rank(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class _Ranked:
    """Requests kept sorted by priority, then arrival (a preempted request arrived before those
    that waited behind it, so it is back ahead of them)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def push(self, request: Request) -> None:
        bisect.insort(self.requests, request, key=_rank)

    def remove(self, request: Request) -> None:
        self.requests.remove(request)


class PriorityQueue(WaitingQueue):
    def __init__(self) -> None:
        self._ranked = _Ranked()

    def push(self, request: Request, preempted: bool = False) -> None:
        self._ranked.push(request)

    def remove(self, request: Request) -> None:
        self._ranked.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._ranked.requests)

    def __len__(self) -> int:
        return len(self._ranked.requests)

    def seat_victims(self, running: list[Request], seats: int) -> list[Request]:
        """The worst-ranked running requests, while the best waiting ones rank strictly above
        them (a tie keeps its seat: no churn between equals)."""
        free = seats - len(running)
        worst_first = sorted(running, key=_rank, reverse=True)
        victims = []
        for request in self._ranked.requests[max(free, 0):]:
            if len(victims) == len(worst_first) or not request.priority < worst_first[len(victims)].priority:
                break
            victims.append(worst_first[len(victims)])
        return victims

    def memory_victim(self, running: list[Request], held: Callable[[Request], int]) -> Request:
        """The worst-ranked running request (highest priority value, then newest), as vLLM
        preempts under its priority policy: memory pressure never costs a better request its
        blocks while a worse one keeps them."""
        return max(running, key=_rank)


class FairQueue(WaitingQueue):
    """Waiting requests per tenant, admitted by weighted shares of the batch's seats."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self._tenants: dict[str, _Ranked] = {}
        self._count = 0

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def push(self, request: Request, preempted: bool = False) -> None:
        self._tenants.setdefault(request.tenant, _Ranked()).push(request)
        self._count += 1

    def remove(self, request: Request) -> None:
        queue = self._tenants[request.tenant]
        queue.remove(request)
        self._count -= 1
        if not queue.requests:
            del self._tenants[request.tenant]

    def __iter__(self) -> Iterator[Request]:
        return (r for queue in self._tenants.values() for r in queue.requests)

    def __len__(self) -> int:
        return self._count

    def admission_order(self, running: list[Request]) -> Iterator[Request]:
        """Turns: each time, the head of the tenant whose running requests (counting those
        already given a turn) are fewest for its weight; ties to the earliest arrival."""
        seated = Counter(r.tenant for r in running)
        heads = {tenant: 0 for tenant in self._tenants}
        while heads:
            tenant = min(heads, key=lambda t: ((seated[t] + 1) / self.weight(t),
                                               self._tenants[t].requests[heads[t]].arrival_time))
            yield self._tenants[tenant].requests[heads[tenant]]
            seated[tenant] += 1
            heads[tenant] += 1
            if heads[tenant] == len(self._tenants[tenant].requests):
                del heads[tenant]

    def shares(self, running: Iterable[Request], seats: int) -> dict[str, float]:
        """Each tenant with work's share of the seats: its weight over the active weights."""
        active = set(self._tenants) | {r.tenant for r in running}
        total = sum(self.weight(t) for t in active)
        return {t: seats * self.weight(t) / total for t in active}

    def seat_victims(self, running: list[Request], seats: int) -> list[Request]:
        """With every seat taken, a waiting tenant below its share (by at least a whole seat)
        takes one from the tenant furthest above its share, its worst-ranked running request (by
        priority, then the newest), until it reaches its share, has nobody waiting, or no tenant
        is above its share."""
        if len(running) < seats or not self._tenants:
            return []
        share = self.shares(running, seats)
        seated = Counter(r.tenant for r in running)
        waiting = {t: len(q.requests) for t, q in self._tenants.items()}
        best_first = {t: sorted((r for r in running if r.tenant == t), key=_rank) for t in seated}
        victims = []
        while True:
            needy = [t for t in waiting if waiting[t] and seated[t] + 1 <= share[t]]
            rich = [t for t in seated if seated[t] - 1 >= share[t]]
            if not needy or not rich:
                return victims
            taker = min(needy, key=lambda t: seated[t] / self.weight(t))
            giver = max(rich, key=lambda t: seated[t] / self.weight(t))
            victims.append(best_first[giver].pop())
            seated[giver] -= 1
            seated[taker] += 1
            waiting[taker] -= 1

    def memory_victim(self, running: list[Request], held: Callable[[Request], int]) -> Request:
        """KV memory shared out by weight, as the seats are: the worst-ranked running request of
        the tenant that holds the most blocks for its weight (ties: the tenant whose newest
        request is newest), so a tenant whose long contexts fill the pool gives its own blocks
        back before it costs a lighter tenant theirs; with one tenant, the newest request goes.
        The oldest running request is never named while another runs: it always advances, so a
        request whose context needs more than its tenant's share still finishes once it is the
        oldest, however busy the other tenants keep the pool."""
        blocks: Counter[str] = Counter()
        for request in running:
            blocks[request.tenant] += held(request)
        candidates = running[1:] or running
        newest = {r.tenant: r.arrival_time for r in candidates}
        tenant = max(newest, key=lambda t: (blocks[t] / self.weight(t), newest[t]))
        return max((r for r in candidates if r.tenant == tenant), key=_rank)


def waiting_queue(policy: str, tenant_weights: dict[str, float] | None = None) -> WaitingQueue:
    """The queue of EngineConfig.scheduling_policy; "auto" is fair when weights name tenants."""
    if policy == "auto":
        policy = "fair" if tenant_weights else "fcfs"
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "fair":
        return FairQueue(tenant_weights)
    raise ValueError(f"unknown scheduling policy {policy!r}: choose one of {', '.join(SCHEDULING_POLICIES)}")
