"""Regressions for what a hostile or careless client found: no 5xx for any input, bounded
admission, no work for departed clients, a responsive event loop, auth edge cases."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from brisk.config import EngineConfig
from brisk.transport.async_engine import AsyncEngine
from tests.conftest import build_tiny_checkpoint
from tests.helpers import metric_values
from tests.server.conftest import running_server

MESSAGES = [{"role": "user", "content": "Hello"}]


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def http(tiny_url):
    with httpx.Client(base_url=tiny_url, timeout=60) as client:
        yield client


def _raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """A body sent byte for byte (json.dumps would refuse NaN or re-escape what we mean to send)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


# ----- values that used to crash or silently misbehave -----------------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**63) - 1])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/completions", {"prompt": "w3 w4"})])
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_seeds_get_400_before_any_stream_starts(http, path, body, seed, stream):
    _error(http.post(path, json={**body, "seed": seed, "max_tokens": 2, "stream": stream}), 400, "seed")


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seeds_at_the_edges_of_the_range_work_also_with_n(http, seed):
    body = {"prompt": "w3 w4", "max_tokens": 4, "seed": seed, "n": 2, "temperature": 1.0}
    first, second = http.post("/v1/completions", json=body), http.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in second.json()["choices"]]


@pytest.mark.parametrize("field, value", [
    ("temperature", "Infinity"), ("temperature", "NaN"), ("temperature", "-Infinity"), ("temperature", "1e9"),
    ("temperature", "100.5"), ("top_p", "NaN"), ("repetition_penalty", "1e-300"), ("repetition_penalty", "Infinity"),
    ("repetition_penalty", "0"), ("presence_penalty", "2.5"), ("frequency_penalty", "NaN"), ("min_p", "NaN"),
    ("n", "129"), ("n", "1e9"), ("top_logprobs", "21"),
])
def test_out_of_range_sampling_values_get_400_naming_the_field(http, field, value):
    r = _raw(http, "/v1/chat/completions", f'{{"messages": {json.dumps(MESSAGES)}, "max_tokens": 2, "{field}": {value}}}')
    _error(r, 400, field)


def test_a_tiny_temperature_is_greedy(http):
    body = {"prompt": "w3 w4 w5", "max_tokens": 12, "ignore_eos": True}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for temperature in (1e-300, 1e-6):
        r = http.post("/v1/completions", json={**body, "temperature": temperature})
        assert r.json()["choices"][0]["text"] == greedy


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "x\\udfff"]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/generate/batch", '{"prompts": ["\\ud800"]}', "prompts"),
    ("/v1/generate", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/chat/completions", '{"model": "x\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
])
def test_lone_surrogates_get_400(http, path, body, param):
    _error(_raw(http, path, body), 400, param)


def test_an_unknown_model_named_with_any_unicode_gets_404(http):
    error = _error(http.post("/v1/completions", json={"model": "ünknown-😀", "prompt": "w3"}), 404, "model")
    assert "ünknown-😀" in error["message"]


def test_an_empty_prompt_starts_from_the_bos_token(http):
    r = http.post("/v1/completions", json={"prompt": "", "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1


# ----- admission: sequences and tokens, body size ----------------------------------------------
def test_n_and_prompt_counts_are_bounded(http):
    _error(http.post("/v1/completions", json={"prompt": "w3", "n": 129}), 400, "n")
    too_many = _error(http.post("/v1/completions", json={"prompt": ["w3"] * 129, "max_tokens": 1}), 400, "prompt")
    assert "at most 128" in too_many["message"]  # the limit, not "should be a valid string"
    _error(http.post("/v1/generate/batch", json={"prompts": ["w3"] * 129, "max_tokens": 1}), 400, "prompts")


def test_a_request_larger_than_the_whole_queue_gets_400_and_a_busy_queue_429(tiny_engine):
    # 4 seats, queue of 8 sequences: n=9 can never be queued; 8 long requests fill the seats and the queue.
    with running_server(tiny_engine, max_waiting_seqs=8) as url, httpx.Client(base_url=url, timeout=120) as client:
        error = _error(client.post("/v1/completions", json={"prompt": "w3", "n": 9, "max_tokens": 1}), 400, "n")
        assert error["code"] == "request_too_large" and "max_waiting_seqs" in error["message"]

        async def flood():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                body = {"prompt": "w3 w4 w5", "max_tokens": 120, "ignore_eos": True, "n": 4}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))

        statuses = sorted(r.status_code for r in asyncio.run(flood()))
    assert statuses.count(200) >= 2 and 429 in statuses and set(statuses) <= {200, 429}


def test_prompt_tokens_in_the_queue_are_bounded(tiny_engine):
    with running_server(tiny_engine, max_waiting_tokens=100) as url, httpx.Client(base_url=url, timeout=60) as c:
        error = _error(c.post("/v1/completions", json={"prompt": [5] * 60, "n": 2, "max_tokens": 1}), 400, "n")
        assert "120 prompt tokens" in error["message"] and "max_waiting_tokens" in error["message"]
        assert c.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 1}).status_code == 200


def test_bodies_over_the_limit_get_413_declared_or_chunked(tiny_engine):
    with running_server(tiny_engine, max_request_body_mb=0.01) as url, httpx.Client(base_url=url, timeout=60) as c:
        big = json.dumps({"prompt": "w3 " * 5000}).encode()
        assert _error(c.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                      413)["code"] == "request_too_large"

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        _error(c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
        small = c.post("/v1/completions", json={"prompt": "w3 w4", "max_tokens": 2})
        assert small.status_code == 200 and c.get("/health").status_code == 200


def test_the_event_loop_answers_while_a_huge_prompt_is_tokenized(http):
    """A multi-megabyte prompt is tokenized on a worker thread without the GIL: /health keeps
    answering meanwhile (it used to wait for the whole tokenization)."""
    result = {}

    def send_huge():
        result["response"] = http.post("/v1/completions", json={"prompt": "w3 w4 w5 w6 " * 1_200_000,
                                                                 "max_tokens": 1}, timeout=300)

    sender = threading.Thread(target=send_huge)
    sender.start()
    answered_during = 0
    with httpx.Client(base_url=str(http.base_url), timeout=60) as probe:
        while sender.is_alive():
            if probe.get("/health").status_code == 200 and sender.is_alive():
                answered_during += 1
            time.sleep(0.02)
    sender.join()
    error = _error(result["response"], 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert answered_during >= 3


# ----- auth --------------------------------------------------------------------------------------
def test_auth_scheme_is_case_insensitive_and_only_the_admin_key_clears_the_prefix_cache(tiny_engine):
    with running_server(tiny_engine, api_key="k1", admin_api_key="adm") as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert c.get("/v1/models", headers={"Authorization": f"{scheme} k1"}).status_code == 200
        _error(c.get("/v1/models", headers={"Authorization": "Basic k1"}), 401)
        c.post("/v1/completions", json={"prompt": "w3 w4 " * 20, "max_tokens": 1},
               headers={"Authorization": "Bearer k1"})
        assert c.get("/v1/cache/stats", headers={"Authorization": "Bearer k1"}).json()["prefix_cache"]["cached_blocks"]
        # a tenant's key clears only its own cached responses; the prefix cache is everyone's
        assert c.delete("/v1/cache", headers={"Authorization": "Bearer k1"}).json()["evicted_blocks"] == 0
        assert c.delete("/v1/cache", headers={"Authorization": "Bearer adm"}).json()["evicted_blocks"] > 0
        assert c.get("/health").status_code == 200 and c.head("/health").status_code == 200


def test_a_departed_non_streaming_client_stops_its_work_also_behind_an_api_key(tmp_path):
    # A long context so the request cannot finish on its own before the server sees the client leave.
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    engine = AsyncEngine(EngineConfig(model=folder, dtype="float32", num_kv_blocks=600, max_model_len=9000))
    try:
        with running_server(engine, api_key="k") as url:
            before = metric_values(httpx.get(f"{url}/metrics").text)
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps({"prompt": "w3 w4", "max_tokens": 8000, "ignore_eos": True}).encode()
            with socket.create_connection((host, int(port))) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                             b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                             b"\r\n\r\n" + body)
                deadline = time.monotonic() + 120  # wait until the request is running, then leave
                while metric_values(httpx.get(f"{url}/metrics").text)["brisk:num_requests_running"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            deadline = time.monotonic() + 120
            key = 'brisk:request_success_total{finished_reason="abort"}'
            while (after := metric_values(httpx.get(f"{url}/metrics").text)).get(key, 0) == before.get(key, 0):
                assert time.monotonic() < deadline, "the departed client's request was not aborted"
                time.sleep(0.05)
    finally:
        engine.shutdown()
    assert after["brisk:generation_tokens_total"] - before.get("brisk:generation_tokens_total", 0) < 8000
    assert engine.engine.kv.num_free_blocks == engine.engine.kv.num_blocks


# ----- small ones ---------------------------------------------------------------------------------
def test_model_info_shows_no_server_path(http):
    info = http.get("/v1/model/info").json()
    assert info["file"] and all("/" not in str(v) for v in info.values())


def test_openapi_documents_400_errors_and_text_endpoints(http):
    schema = http.get("/openapi.json").json()
    operations = [op for ops in schema["paths"].values() for op in ops.values()]
    assert all("422" not in op["responses"] and "default" in op["responses"] for op in operations)
    for path in ("/health", "/metrics"):
        assert list(schema["paths"][path]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "ErrorResponse" in schema["components"]["schemas"]
