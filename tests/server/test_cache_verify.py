"""Verified semantic hits (server/caching.py), over real HTTP: the default model with suffix
speculation, the real embedder and a real SQLite file. A cached answer to a look-alike question
is only a draft: the model checks it and the client gets exactly the model's own answer to its
question, which is then cached under its wording. The server's prefix cache is off, so a
question asked again computes its prompt as the first time did."""

from __future__ import annotations

import httpx
import pytest

from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore
from brisk.config import ConfigError, EngineConfig, ResponseCacheConfig
from brisk.server.caching import ResponseCaching
from brisk.transport.async_engine import AsyncEngine
from tests.helpers import metric_values
from tests.server.conftest import running_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def client(tmp_path_factory, real_embedder):
    store = SQLiteStore(str(tmp_path_factory.mktemp("verify") / "cache.sqlite3"), 1000, real_embedder.dimensions)
    engine = AsyncEngine(EngineConfig(kv_cache_memory_gib=0.25, max_model_len=2048, enable_prefix_caching=False,
                                      speculative_config={"method": "suffix"}))
    try:
        with running_server(engine, embedder=real_embedder, response_cache=ResponseCache(store, 3600),
                            cache_config=ResponseCacheConfig(cache_verify=True), served_model_name="smollm2") as url, \
                httpx.Client(base_url=url, timeout=120) as http:
            yield http
    finally:
        engine.shutdown()


def ask(client: httpx.Client, question: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def answer(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def test_a_look_alikes_cached_answer_is_checked_not_served(client):
    first = ask(client, "What is the capital of France?")
    assert first.headers["x-brisk-cache"] == "miss"
    own = answer(ask(client, "What is the capital of Spain?", cache=False))  # the model's answer, uncached
    # a threshold low enough that France's answer is Spain's candidate (the lexical guard stands aside)
    verified = ask(client, "What is the capital of Spain?", cache_similarity_threshold=0.5)
    assert verified.headers["x-brisk-cache"] == "verified"
    assert answer(verified) == own != answer(first)
    assert 0 <= float(verified.headers["x-brisk-cache-accepted"]) < 1
    again = ask(client, "What is the capital of Spain?")  # stored under its own wording
    assert again.headers["x-brisk-cache"] == "exact" and answer(again) == own


def test_a_paraphrases_answer_is_the_models_own_and_mostly_drafted(client):
    ask(client, "How do I cancel my order?")
    own = answer(ask(client, "How can I cancel my order?", cache=False))
    verified = ask(client, "How can I cancel my order?")
    assert verified.headers["x-brisk-cache"] == "verified" and answer(verified) == own
    assert float(verified.headers["x-brisk-cache-accepted"]) > 0
    checked = metric_values(client.get("/metrics").text)  # the candidates count as the requests' own drafts
    assert checked['brisk:spec_decode_source_num_accepted_tokens_total{source="supplied"}'] > 0


def test_with_verification_a_request_about_its_own_tokens_may_match_by_meaning(client):
    ask(client, "Name three colors of the rainbow.", logprobs=True)
    verified = ask(client, "Name 3 colors of the rainbow.", logprobs=True, cache_similarity_threshold=0.8)
    assert verified.headers["x-brisk-cache"] == "verified"
    logprobs = verified.json()["choices"][0]["logprobs"]["content"]
    assert len(logprobs) == verified.json()["usage"]["completion_tokens"]  # the model's own, one per token


def test_verification_needs_speculative_decoding(tiny_engine, real_embedder, tmp_path):
    store = SQLiteStore(str(tmp_path / "cache.sqlite3"), 10, real_embedder.dimensions)
    with pytest.raises(ConfigError, match="cache_verify needs speculative decoding"):
        ResponseCaching(ResponseCache(store, 60), ResponseCacheConfig(cache_verify=True), {}, real_embedder)
    with running_server(tiny_engine, embedder=real_embedder, response_cache=ResponseCache(store, 60),
                        cache_config=ResponseCacheConfig(), served_model_name="tiny") as url:
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "cache_verify": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_verify"
