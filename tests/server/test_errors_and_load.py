"""Bad input, auth, backpressure and client disconnects: the server answers in OpenAI's error
shape, keeps serving, and gives every KV block back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from brisk.config import EngineConfig
from brisk.transport.client import EngineClient, EngineDeadError
from brisk.transport.core_process import ProcessEngine
from brisk.sample.params import SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.helpers import metric_values
from tests.server.conftest import running_server

pytestmark = pytest.mark.real_model

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ({"messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ({"messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"max_tokens": 5}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 2100}]}, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
])
def test_invalid_chat_requests_get_400(http, body, param):
    _error(http.post("/v1/chat/completions", json=body), 400, param)


def test_prompt_longer_than_the_context_is_rejected_for_completions(http):
    error = _error(http.post("/v1/completions", json={"prompt": [5] * 2048, "max_tokens": 1}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"


def test_malformed_json_gets_400(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    error = _error(r, 400)
    assert "JSON" in error["message"] and error["param"] is None  # not the character offset


def test_unknown_model_gets_404(http):
    error = _error(http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": MESSAGES}), 404, "model")
    assert error["code"] == "model_not_found"


def test_unknown_route_gets_404_in_the_same_shape(http):
    _error(http.get("/v1/nothing-here"), 404)


def test_the_engine_keeps_serving_after_errors(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 200 and http.get("/health").status_code == 200


def test_an_unexpected_error_is_a_500_in_the_same_shape_and_the_connection_stays(tiny_engine, monkeypatch):
    """A bug met while answering (here the engine client raising) is a 500 in OpenAI's error
    shape, and the kept-alive connection serves the next request: Starlette's own catch-all
    closed it after answering."""
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    body = {"prompt": "hello", "max_tokens": 2}
    with running_server(tiny_engine, served_model_name="tiny") as url, httpx.Client(base_url=url, timeout=60) as c:
        before = c.get("/v1/models")
        monkeypatch.setattr(tiny_engine, "generate", broken)
        failed = c.post("/v1/completions", json=body)
        monkeypatch.undo()
        after = c.post("/v1/completions", json=body)
        connections = {r.extensions["network_stream"].get_extra_info("client_addr") for r in (before, failed, after)}
    assert _error(failed, 500)["type"] == "server_error" and "RuntimeError" in failed.json()["error"]["message"]
    assert after.status_code == 200
    assert len(connections) == 1


def test_api_key(real_async_engine):
    with running_server(real_async_engine, served_model_name="smollm2", api_key="s3cret") as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            _error(client.get("/v1/models"), 401)
            _error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert client.get("/health").status_code == 200
            assert client.get("/metrics").status_code == 200


def test_a_full_waiting_queue_answers_429_with_retry_after(tmp_path, engine_kind):
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    engine = engine_kind(EngineConfig(model=folder, dtype="float32", max_num_seqs=1, num_kv_blocks=64,
                                      max_model_len=256))
    try:
        with running_server(engine, max_waiting_seqs=2) as url:
            async def flood():
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    body = {"prompt": "w3 w4 w5", "max_tokens": 200, "ignore_eos": True}
                    return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

            responses = asyncio.run(flood())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.headers["retry-after"] == "1" and rejected.json()["error"]["type"] == "rate_limit_exceeded"
        snapshot = asyncio.run(engine.stats())
    finally:
        engine.shutdown()
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks


def test_forty_streams_half_disconnecting_leave_nothing_behind(base_url, real_async_engine):
    before = metric_values(httpx.get(f"{base_url}/metrics").text)

    async def stream(client, i, leave_early):
        body = {"messages": [{"role": "user", "content": f"Tell a long story number {i}."}], "max_tokens": 48,
                "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
        events = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if leave_early and events == 3:
                        return events  # leaving the block closes the connection mid-stream
        return events

    async def main():
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(stream(client, i, leave_early=i % 2 == 0) for i in range(40)))

    events = asyncio.run(main())
    assert all(e == 3 for e in events[0::2]) and all(e > 3 for e in events[1::2])
    engine = real_async_engine.engine
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    after = metric_values(httpx.get(f"{base_url}/metrics").text)
    assert after["brisk:num_requests_running"] == 0 and after["brisk:kv_cache_usage_perc"] == 0.0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta('brisk:request_success_total{finished_reason="abort"}') == 20
    assert delta('brisk:request_success_total{finished_reason="length"}') == 20
    assert delta("brisk:e2e_request_latency_seconds_count") == 40
    assert delta("brisk:time_to_first_token_seconds_count") == 40
    assert delta("brisk:generation_tokens_total") >= 20 * 48 + 20


def test_clients_leaving_unstreamed_requests_abort_them_without_an_error_logged(base_url, real_async_engine, caplog):
    """A client that gives up on a non-streamed answer aborts its request (its blocks go back);
    that is routine, so nothing is logged as an error (asyncio's "exception was never
    retrieved" for the cancelled gathering of the request's streams was, once each)."""
    import gc

    engine = real_async_engine.engine
    key = 'brisk:request_success_total{finished_reason="abort"}'
    before = metric_values(httpx.get(f"{base_url}/metrics").text).get(key, 0.0)

    async def main():
        # Each client leaves once every request is in the engine, not after a clock runs out
        # (a 0.5 s timeout once expired while connecting to a busy host).
        async with httpx.AsyncClient(base_url=base_url, timeout=None) as client:
            bodies = [{"prompt": f"Tell a long story number {i}.", "max_tokens": 400, "ignore_eos": True, "n": 2}
                      for i in range(6)]
            posts = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            deadline = time.monotonic() + 120
            while len(engine.scheduler.requests) < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert len(engine.scheduler.requests) >= 6
            for post in posts:
                post.cancel()
            results = await asyncio.gather(*posts, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results

    asyncio.run(main())
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert metric_values(httpx.get(f"{base_url}/metrics").text).get(key, 0.0) - before == 6
    gc.collect()
    time.sleep(0.2)  # the server's loop runs the exception handler of what was collected
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


def test_health_and_requests_answer_503_once_the_engine_loop_stopped(tmp_path, engine_kind):
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    engine = engine_kind(EngineConfig(model=folder, dtype="float32", num_kv_blocks=16, max_model_len=64))
    with running_server(engine) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        engine.shutdown()
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w3 w4", "max_tokens": 2})
        assert _error(r, 503)["type"] == "server_error"
        # Routes that ask the loop thread for something answer too, instead of waiting forever.
        assert _error(httpx.get(f"{url}/v1/cache/stats", timeout=10), 503)["type"] == "server_error"
        assert _error(httpx.delete(f"{url}/v1/cache", timeout=10), 503)["type"] == "server_error"
    # The client side of a stopped engine: commands are refused at once, aborts are a no-op.
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.stats())
    with pytest.raises(EngineDeadError):
        asyncio.run(_first_output(engine))
    engine.abort("anything")


def test_a_killed_engine_process_ends_streams_with_an_error_event_then_answers_503(tmp_path):
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    engine = ProcessEngine(EngineConfig(model=folder, dtype="float32", num_kv_blocks=64, max_model_len=256))
    events = []
    try:
        with running_server(engine) as url:
            body = {"prompt": "w3 w4", "max_tokens": 250, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        if len(events) == 1:
                            os.kill(engine.pid, signal.SIGKILL)
            assert _error(httpx.get(f"{url}/health"), 503)["type"] == "server_error"
            error = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "w3", "max_tokens": 2}), 503)
    finally:
        engine.shutdown()
    assert "SIGKILL" in error["message"]
    assert events[-1] == "[DONE]" and "SIGKILL" in json.loads(events[-2])["error"]["message"]


async def _first_output(engine: EngineClient):
    async for output in engine.generate([3, 4], SamplingParams(max_tokens=2), "after-shutdown"):
        return output
