"""The response cache over real HTTP: a tiny random model generates, the real embedder
(all-MiniLM-L6-v2) matches by meaning, a real SQLite file (and, in the process test, a real
`brisk serve` killed with SIGKILL) stores.

What is checked: a hit is the stored answer and runs no model; streamed requests are served
from the cache as streams and stored from streams; only deterministic requests are cached
unless they opt in; the bypass controls; tenants never see each other's answers (with keys,
whatever header they send); clearing; /v1/generate's levels; the figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest

from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore
from brisk.config import ResponseCacheConfig
from tests.conftest import build_tiny_checkpoint
from tests.helpers import metric_values
from tests.server.conftest import running_server, serve_tiny

CHAT = {"messages": [{"role": "user", "content": "How do I reset my password?"}], "max_tokens": 8,
        "temperature": 0}


@pytest.fixture
def cache_server(tiny_engine, real_embedder, tmp_path):
    """A server on the tiny engine with a fresh SQLite response cache; yields (url, options) ->
    a context manager, so a test can start one with API keys."""

    def start(**options):
        cache = ResponseCache(SQLiteStore(str(tmp_path / "cache.sqlite3"), 1000, real_embedder.dimensions), 3600)
        return running_server(tiny_engine, embedder=real_embedder, response_cache=cache,
                              cache_config=ResponseCacheConfig(), served_model_name="tiny", **options)

    return start


def chat(client: httpx.Client, body: dict = CHAT, **headers) -> httpx.Response:
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response


def content(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Headers, list[dict]]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        headers = r.headers
    assert lines[-1] == "[DONE]"
    return headers, [json.loads(line) for line in lines[:-1]]


def stats(client: httpx.Client) -> dict:
    return client.get("/v1/cache/stats").json()["response_cache"]


def test_an_exact_hit_is_the_stored_answer_and_runs_no_model(cache_server):
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        first = chat(c)
        assert first.headers["x-brisk-cache"] == "miss"
        tokens = _generated_tokens(c)
        second = chat(c)
        assert second.headers["x-brisk-cache"] == "exact"
        assert content(second) == content(first) and second.json()["usage"] == first.json()["usage"]
        assert second.json()["id"] != first.json()["id"]
        assert _generated_tokens(c) == tokens  # the engine made nothing for it
        s = stats(c)
        assert (s["hits"], s["entries"], s["stores"]) == ({"exact": 1, "semantic": 0}, 1, 1)
        assert s["hit_latency_ms"]["exact"]["count"] == 1 and s["bytes"] > 0
        metrics = c.get("/metrics").text
        assert 'brisk:response_cache_hits_total{kind="exact",model_name="tiny"} 1.0' in metrics
        assert 'brisk:response_cache_entries{model_name="tiny"} 1.0' in metrics
        assert 'brisk:response_cache_hit_seconds_count{kind="exact",model_name="tiny"} 1.0' in metrics


def _generated_tokens(client: httpx.Client) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("brisk:generation_tokens_total"))
    return float(line.split()[-1])


def test_streams_are_stored_and_served_as_streams(cache_server):
    body = {**CHAT, "stream_options": {"include_usage": True}}
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        headers, live = streamed(c, "/v1/chat/completions", body)
        assert headers["x-brisk-cache"] == "miss"
        live_text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in live if ch["choices"])
        whole = chat(c, CHAT)  # the streamed answer was stored whole
        assert whole.headers["x-brisk-cache"] == "exact" and content(whole) == live_text
        headers, replayed = streamed(c, "/v1/chat/completions", body)
        assert headers["x-brisk-cache"] == "exact"
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in replayed if ch["choices"]) == live_text
        assert replayed[0]["choices"][0]["delta"]["role"] == "assistant"
        assert replayed[-1]["usage"] == live[-1]["usage"]
        assert {ch["object"] for ch in replayed} == {"chat.completion.chunk"}
        finish = [ch["choices"][0]["finish_reason"] for ch in replayed if ch["choices"]]
        assert finish[-1] == whole.json()["choices"][0]["finish_reason"]


def test_completions_exact_hits_and_streams(cache_server):
    body = {"prompt": "w3 w4 w5", "max_tokens": 6, "temperature": 0}
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        first = c.post("/v1/completions", json=body)
        second = c.post("/v1/completions", json=body)
        assert (first.headers["x-brisk-cache"], second.headers["x-brisk-cache"]) == ("miss", "exact")
        assert second.json()["choices"] == first.json()["choices"]
        _, chunks = streamed(c, "/v1/completions", body)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == first.json()["choices"][0]["text"]
        several = c.post("/v1/completions", json={**body, "prompt": ["w3", "w4"]})
        assert several.headers["x-brisk-cache"] == "bypass"  # batches of prompts are not cached


def test_only_deterministic_requests_are_cached_unless_they_opt_in(cache_server):
    sampled = {**CHAT, "temperature": 1.0}
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        assert chat(c, sampled).headers["x-brisk-cache"] == "bypass"
        assert chat(c, sampled).headers["x-brisk-cache"] == "bypass"
        assert chat(c, {**sampled, "seed": 7}).headers["x-brisk-cache"] == "miss"
        assert chat(c, {**sampled, "seed": 7}).headers["x-brisk-cache"] == "exact"
        assert chat(c, {**sampled, "cache": True}).headers["x-brisk-cache"] == "miss"
        assert chat(c, {**sampled, "cache": True}).headers["x-brisk-cache"] == "exact"
        assert chat(c, {**sampled, "temperature": 0.5, "cache": True}).headers["x-brisk-cache"] == "miss"


def test_bypass_controls(cache_server):
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        stored = content(chat(c))
        assert chat(c, {**CHAT, "cache": False}).headers["x-brisk-cache"] == "bypass"
        assert chat(c, **{"Cache-Control": "no-store"}).headers["x-brisk-cache"] == "bypass"
        refreshed = chat(c, **{"Cache-Control": "no-cache"})
        assert refreshed.headers["x-brisk-cache"] == "miss" and content(refreshed) == stored
        assert stats(c)["stores"] == 2  # the no-cache answer replaced the first
        assert stats(c)["entries"] == 1
        other_params = {**CHAT, "max_tokens": 5}
        assert chat(c, other_params).headers["x-brisk-cache"] == "miss"  # a parameter is part of the key


def test_paraphrases_hit_and_lookalikes_miss(cache_server):
    def ask(c, question, **extra):
        return chat(c, {**CHAT, "messages": [{"role": "user", "content": question}], **extra})

    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        stored = content(ask(c, "How do I cancel my order?"))
        paraphrase = ask(c, "How can I cancel my order?")
        assert paraphrase.headers["x-brisk-cache"] == "semantic" and content(paraphrase) == stored
        assert float(paraphrase.headers["x-brisk-cache-similarity"]) >= 0.95
        assert ask(c, "How do I track my order?").headers["x-brisk-cache"] == "miss"
        assert ask(c, "How can I not cancel my order?").headers["x-brisk-cache"] == "miss"
        strict = ask(c, "How can I cancel my order, please?", cache_similarity_threshold=0.999)
        assert strict.headers["x-brisk-cache"] == "miss"  # the request's own threshold
        # "track" is far below the threshold (cosine 0.52); the negated question is over it (0.97),
        # and the guard refused it
        s = stats(c)
        assert s["hits"]["semantic"] == 1 and s["guard_rejections"] == 1


def test_earlier_turns_must_match_exactly(cache_server):
    def turns(system: str, question: str) -> dict:
        return {**CHAT, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}

    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        chat(c, turns("You are a bank's assistant.", "How do I cancel my order?"))
        assert chat(c, turns("You are a bank's assistant.", "How can I cancel my order?")
                    ).headers["x-brisk-cache"] == "semantic"
        assert chat(c, turns("You are a shop's assistant.", "How can I cancel my order?")
                    ).headers["x-brisk-cache"] == "miss"


def test_tenants_by_header_without_keys(cache_server):
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        assert chat(c, **{"X-Tenant": "a"}).headers["x-brisk-cache"] == "miss"
        assert chat(c, **{"X-Tenant": "b"}).headers["x-brisk-cache"] == "miss"
        assert chat(c, **{"X-Tenant": "a"}).headers["x-brisk-cache"] == "exact"
        assert chat(c).headers["x-brisk-cache"] == "miss"  # "default" is a tenant too
        bad = c.post("/v1/chat/completions", json=CHAT, headers={"X-Tenant": "no spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_with_keys_the_tenant_is_the_keys_and_clearing_is_scoped(cache_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nkey-a alice\nkey-b bob\n")
    with cache_server(api_keys_file=str(keys), admin_api_key="adm") as url, httpx.Client(base_url=url,
                                                                                       timeout=60) as c:
        alice, bob = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
        assert chat(c, **alice).headers["x-brisk-cache"] == "miss"
        # bob claiming alice's tenant by header still gets bob's (empty) partition
        assert chat(c, **bob, **{"X-Tenant": "alice"}).headers["x-brisk-cache"] == "miss"
        assert chat(c, **alice).headers["x-brisk-cache"] == "exact"
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 401
        refused = c.delete("/v1/cache", params={"tenant": "alice"}, headers=bob)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        cleared = c.delete("/v1/cache", headers=bob).json()
        assert (cleared["tenant"], cleared["removed_responses"], cleared["evicted_blocks"]) == ("bob", 1, 0)
        assert chat(c, **alice).headers["x-brisk-cache"] == "exact"  # alice's answer is still there
        assert c.delete("/v1/cache", headers={"Authorization": "Bearer adm"}).json()["removed_responses"] == 1
        assert chat(c, **alice).headers["x-brisk-cache"] == "miss"
        # per tenant: alice's two hits and two model runs, bob's one run
        metrics = metric_values(c.get("/metrics").text)
        hits = {t: metrics.get(f'brisk:tenant_response_cache_hits_total{{tenant="{t}"}}') for t in ("alice", "bob")}
        runs = {t: metrics.get(f'brisk:tenant_requests_total{{tenant="{t}"}}') for t in ("alice", "bob")}
        assert (hits, runs) == ({"alice": 2, "bob": 0}, {"alice": 2, "bob": 1})


def test_generate_uses_the_cache_only_at_full(cache_server):
    body = {"prompt": "w3 w4", "max_tokens": 5, "temperature": 0}
    with cache_server() as url, httpx.Client(base_url=url, timeout=60) as c:
        basic = c.post("/v1/generate", json=body)
        assert basic.headers["x-brisk-cache"] == "bypass"
        full = [c.post("/v1/generate", json={**body, "optimization": "full"}) for _ in range(2)]
        assert [r.headers["x-brisk-cache"] for r in full] == ["miss", "exact"]
        assert full[1].json()["text"] == full[0].json()["text"] == basic.json()["text"]
        headers, events = streamed(c, "/v1/generate", {**body, "optimization": "full"})
        assert headers["x-brisk-cache"] == "exact"
        assert events[0]["text"] == basic.json()["text"] and events[-1]["done"] is True


def test_an_answer_sent_survives_sigkill_and_a_restart(tmp_path):
    """`brisk serve` answers, is killed with SIGKILL at once, and a new server on the same data
    directory answers the same request from the cache."""
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    body = {"prompt": "w3 w4 w5", "max_tokens": 6, "temperature": 0}

    def start():
        return serve_tiny(folder, "--no-engine-process", "--embedding-model", "none", "--data-dir",
                          str(tmp_path / "data"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    process, base = start()
    first = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert first.headers["x-brisk-cache"] == "miss"
    assert os.path.exists(tmp_path / "data" / "response_cache.sqlite3")
    process, base = start()
    try:
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert again.headers["x-brisk-cache"] == "exact"
        assert again.json()["choices"] == first.json()["choices"]
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_a_failing_store_costs_hits_not_answers(tiny_engine, real_embedder, tmp_path):
    store = SQLiteStore(str(tmp_path / "cache.sqlite3"), 1000, real_embedder.dimensions)
    with running_server(tiny_engine, embedder=real_embedder, response_cache=ResponseCache(store, 3600),
                        cache_config=ResponseCacheConfig(), served_model_name="tiny") as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        chat(c)
        store.close()  # every read and write now raises
        broken = chat(c)
        assert broken.headers["x-brisk-cache"] == "miss" and content(broken)
        assert c.get("/metrics").status_code == 200


def test_api_keys_file_is_checked(tmp_path):
    from brisk.server.middleware import TenantLimits, read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("k1 alice  # a comment\n\nk2 bob weight=2 max_concurrent=4\nk3 bob max_queued_tokens=900\n")
    read = read_api_keys(str(keys))
    assert read.tenants == {"k1": "alice", "k2": "bob", "k3": "bob"}
    assert read.limits == {"alice": TenantLimits(), "bob": TenantLimits(2.0, 4, 900)}
    assert read.weights == {"alice": 1.0, "bob": 2.0}
    for text, problem in (("k1 default\n", "reserved"), ("k1 alice\nk1 bob\n", "twice"), ("k1\n", "KEY TENANT"),
                          ("k1 two words\n", "weight=W"), ("k1 bad/tenant\n", "KEY TENANT"),
                          ("k1 a weight=0\n", "weight must be"), ("k1 a max_concurrent=1.5\n", "whole number"),
                          ("k1 a weight=1\nk2 a weight=2\n", "earlier line")):
        keys.write_text(text)
        with pytest.raises(ValueError, match=problem):
            read_api_keys(str(keys))
