"""PrefixAffinityRouter: Ray Serve's request router for the engine replicas, placing by prefix.

Ray Serve calls `choose_replicas` for each request a DeploymentHandle sends, and tries the ranks
it returns in order (a replica at its max_ongoing_requests refuses and the next is tried). The
ranking is PrefixAffinity's; this class only feeds it the request's prompt tokens (the first
argument of EngineReplica.generate) and each replica's load.

Load is this router's own count of requests it sent to a replica that have not completed
(`on_request_routed` to `on_request_completed`): exact and free with one ingress, which sends
all the traffic, where Ray Serve's queue-length probes would cost a round trip per request or
be up to seconds stale. With several ingress replicas each balances its own share. A burst is
ranked before any of it is routed, so a request also counts on the replica it was ranked first
for until it is routed (then it counts where it went), or for a few seconds if it never is.
"""

from __future__ import annotations

import time
from typing import Iterable, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from brisk.cluster.affinity import PrefixAffinity

_TENTATIVE_SECONDS = 5.0


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, max_blocks: int = 64, max_imbalance: int = 8) -> None:
        self.affinity = PrefixAffinity(block_size, max_blocks, max_imbalance)
        self.in_flight: dict[ReplicaID, int] = {}
        self.routed: dict[str, ReplicaID] = {}  # internal request id -> its replica, until completed
        # Ranked, not yet routed: internal request id -> (first choice, when, the prompt's key)
        self.tentative: dict[str, tuple[ReplicaID, float, list[int]]] = {}

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        loads = self._loads(r.replica_id for r in candidate_replicas)
        if pending_request is None or not pending_request.args:  # a call without a prompt: least loaded
            return [[r] for r in sorted(candidate_replicas, key=lambda r: loads[r.replica_id])]
        pending_request.routing_context.should_backoff = True  # all full: back off, don't spin
        by_id = {r.replica_id: r for r in candidate_replicas}
        options = pending_request.kwargs.get("options")
        key = self.affinity.key(pending_request.args[0], options.prefix_salt if options is not None else None)
        ranked = self.affinity.rank(key, loads)
        if ranked:
            self.tentative[pending_request.metadata.internal_request_id] = (ranked[0], time.monotonic(), key)
        return [[by_id[replica_id]] for replica_id in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Called once per request, for the replica that accepted it (a refusal is not routed)."""
        request_id = pending_request.metadata.internal_request_id
        ranked = self.tentative.pop(request_id, None)
        if ranked is not None:
            self.affinity.record(replica_id, ranked[2])
        self.routed[request_id] = replica_id
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Also called for an attempt a full replica refused, naming that replica: only the
        replica the request was routed to gives its count back."""
        self.tentative.pop(internal_request_id, None)
        if self.routed.get(internal_request_id) != replica_id:
            return
        del self.routed[internal_request_id]
        if replica_id in self.in_flight:
            self.in_flight[replica_id] -= 1

    def _loads(self, replica_ids: Iterable[ReplicaID]) -> dict[ReplicaID, int]:
        """Each replica's requests in flight, plus those ranked first for it and not yet routed."""
        loads = {r: self.in_flight.get(r, 0) for r in replica_ids}
        expired = time.monotonic() - _TENTATIVE_SECONDS
        for request_id, (replica_id, when, _) in list(self.tentative.items()):
            if when < expired:
                del self.tentative[request_id]
            elif replica_id in loads:
                loads[replica_id] += 1
        return loads

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._retain(r.replica_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._retain(r for r in self._replica_id_set if r != replica_id)

    def _retain(self, replica_ids: Iterable[ReplicaID]) -> None:
        keep = set(replica_ids)
        self.affinity.retain(keep)
        self.in_flight = {r: n for r, n in self.in_flight.items() if r in keep}
        self.routed = {request_id: r for request_id, r in self.routed.items() if r in keep}
