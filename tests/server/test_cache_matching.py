"""What the response cache may match, over real HTTP (the tiny model, the real embedder, a real
SQLite file): requests about their own tokens match exactly or not at all, a temperature the
sampler runs greedy is cached as greedy, and a text is keyed as sent."""

from __future__ import annotations

import unicodedata

import httpx
import pytest

from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore
from brisk.config import ResponseCacheConfig
from brisk.sample.params import GREEDY_TEMPERATURE
from tests.server.conftest import running_server

QUESTION, PARAPHRASE = "How do I cancel my order?", "How can I cancel my order?"  # cosine 0.95+, the guard agrees


@pytest.fixture
def client(tiny_engine, real_embedder, tmp_path):
    cache = ResponseCache(SQLiteStore(str(tmp_path / "cache.sqlite3"), 1000, real_embedder.dimensions), 3600)
    with running_server(tiny_engine, embedder=real_embedder, response_cache=cache, cache_config=ResponseCacheConfig(),
                        served_model_name="tiny") as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def chat(client: httpx.Client, question: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": 0, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def complete(client: httpx.Client, prompt: str, **fields) -> httpx.Response:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("ask, fields", [
    (chat, {"logprobs": True}),
    (chat, {"logprobs": True, "top_logprobs": 2}),
    (complete, {"logprobs": 0}),  # 0: the chosen tokens' logprobs, still about the tokens
    (complete, {"echo": True}),
    (complete, {"prompt_logprobs": 1}),
])
def test_requests_about_their_own_tokens_match_exactly_only(client, ask, fields):
    ask(client, QUESTION)
    assert ask(client, PARAPHRASE).headers["x-brisk-cache"] == "semantic"  # without the fields it would hit
    first = ask(client, QUESTION, **fields)
    assert first.headers["x-brisk-cache"] == "miss"
    assert ask(client, PARAPHRASE, **fields).headers["x-brisk-cache"] == "miss"
    again = ask(client, QUESTION, **fields)
    assert again.headers["x-brisk-cache"] == "exact" and again.json()["choices"] == first.json()["choices"]


def test_a_temperature_the_sampler_runs_greedy_is_cached_as_greedy(client):
    near_zero = chat(client, QUESTION, temperature=GREEDY_TEMPERATURE / 10)
    assert near_zero.headers["x-brisk-cache"] == "miss"  # cached, where it used to bypass
    zero = chat(client, QUESTION, temperature=0)
    assert zero.headers["x-brisk-cache"] == "exact"  # one key: the sampler runs both alike
    fresh = client.post("/v1/chat/completions", headers={"Cache-Control": "no-store"},
                        json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6, "temperature": 0})
    assert fresh.headers["x-brisk-cache"] == "bypass"
    assert zero.json()["choices"] == near_zero.json()["choices"] == fresh.json()["choices"]
    assert chat(client, QUESTION, temperature=GREEDY_TEMPERATURE * 10).headers["x-brisk-cache"] == "bypass"


def test_a_text_is_keyed_as_sent(client):
    chat(client, "How do you pronounce café?")
    decomposed = chat(client, unicodedata.normalize("NFD", "How do you pronounce café?"))
    assert decomposed.headers["x-brisk-cache"] == "semantic"  # the same question, but not the same text


@pytest.mark.parametrize("ask", [chat, complete])
def test_a_semantic_hit_counts_its_own_prompt(client, ask):
    """The answer was stored for another wording; the usage is this request's, as a model run
    would count it (the same request with no-store)."""
    stored = ask(client, QUESTION).json()["usage"]
    hit = ask(client, "Can you tell me how to cancel my order?")
    assert hit.headers["x-brisk-cache"] == "semantic"
    run = client.post(hit.request.url.path, content=hit.request.content, headers={"Cache-Control": "no-store",
                                                                                 "Content-Type": "application/json"})
    assert run.headers["x-brisk-cache"] == "bypass"
    usage, ran = hit.json()["usage"], run.json()["usage"]
    assert usage["prompt_tokens"] == ran["prompt_tokens"] != stored["prompt_tokens"]
    assert usage["completion_tokens"] == stored["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_generate_caches_a_greedy_temperature_too(client):
    body = {"prompt": QUESTION, "max_tokens": 5, "optimization": "full"}
    near_zero = client.post("/v1/generate", json={**body, "temperature": GREEDY_TEMPERATURE / 10})
    assert near_zero.headers["x-brisk-cache"] == "miss"
    zero = client.post("/v1/generate", json={**body, "temperature": 0})
    assert zero.headers["x-brisk-cache"] == "exact" and zero.json()["text"] == near_zero.json()["text"]
