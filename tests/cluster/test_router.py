"""PrefixAffinityRouter's bookkeeping, driven as Ray Serve drives it, without a cluster: the
hooks are called with the objects Ray passes, reduced to the fields the router reads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests.helpers import import_or_require

import_or_require("ray.serve", "Ray Serve (the optional extra: pip install 'brisk[ray]')")

from brisk.cluster.router import PrefixAffinityRouter  # noqa: E402

BLOCK = 4


def router() -> PrefixAffinityRouter:
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # Ray's constructor wants a running controller
    r.initialize_state(block_size=BLOCK, max_imbalance=2)
    return r


def replica(name: str):
    return SimpleNamespace(replica_id=name)


def request(request_id: str, tokens: list[int]):
    return SimpleNamespace(args=[tokens], kwargs={}, routing_context=SimpleNamespace(should_backoff=False),
                           metadata=SimpleNamespace(internal_request_id=request_id))


def choose(r: PrefixAffinityRouter, pending, replicas) -> list[str]:
    return [rank[0].replica_id for rank in asyncio.run(r.choose_replicas(replicas, pending))]


def test_a_prefix_routed_once_is_ranked_first_for_the_next_request():
    r, replicas = router(), [replica("a"), replica("b")]
    first = request("1", list(range(8)))
    top = choose(r, first, replicas)[0]
    r.on_request_routed(first, top, result=None)
    r.on_request_completed(top, "1")
    assert choose(r, request("2", list(range(8)) + [99]), replicas)[0] == top


def test_a_burst_ranked_before_any_is_routed_is_spread():
    r, replicas = router(), [replica("a"), replica("b")]
    tops = [choose(r, request(str(i), [50 + i] * 8), replicas)[0] for i in range(4)]
    assert sorted(tops) == ["a", "a", "b", "b"]


def test_a_refused_attempt_gives_back_no_count_of_the_replica_that_took_the_request():
    r = router()
    pending = request("1", list(range(8)))
    r.on_request_routed(pending, "b", result=None)  # "a" refused it first; "b" took it
    r.on_request_completed("a", "1")  # the refused attempt's completion
    assert r.in_flight == {"b": 1}
    r.on_request_completed("b", "1")
    assert r.in_flight == {"b": 0} and not r.routed


def test_affinity_breaks_when_the_holder_is_overloaded():
    r, replicas = router(), [replica("a"), replica("b")]
    prompt = list(range(8))
    for i in range(3):  # three of the prefix's requests running on "a"
        pending = request(f"hot-{i}", prompt)
        choose(r, pending, replicas)
        r.on_request_routed(pending, "a", result=None)
    assert choose(r, request("next", prompt), replicas)[0] == "b"  # 3 above b's 0: more than max_imbalance 2


def test_the_prefix_key_includes_the_adapter():
    """Requests of another adapter (or of the base model) hold other blocks: the same prompt under
    another adapter is no reason to go to the replica that ran it."""
    from brisk.engine.request import RequestOptions

    r = router()
    tokens = list(range(8))
    keys = []
    for options in (None, RequestOptions(adapter="sql"), RequestOptions(adapter="sql"), RequestOptions(adapter="law")):
        pending = request("1", tokens)
        pending.kwargs = {} if options is None else {"options": options}
        asyncio.run(r.choose_replicas([replica("a"), replica("b")], pending))
        keys.append(r.tentative.pop("1")[2])
    assert keys[1] == keys[2] and len({tuple(keys[0]), tuple(keys[1]), tuple(keys[3])}) == 3
