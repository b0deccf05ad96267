"""brisk's own endpoints: generate, batch, cache stats and eviction, model info, health, metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from brisk.kernels import isa
from brisk.transport.async_engine import AsyncEngine
from tests.helpers import metric_values
from tests.server.conftest import running_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


def test_generate(http):
    r = http.post("/v1/generate", json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "tokens_generated", "latency_ms", "optimization_used"}
    assert body["optimization_used"] == "basic"
    assert 0 < body["latency_ms"] <= r.elapsed.total_seconds() * 1000  # measured inside this round trip
    # the same greedy text and token count as /v1/completions gives
    completion = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                    "temperature": 0}).json()
    assert body["text"] == completion["choices"][0]["text"]
    assert body["tokens_generated"] == completion["usage"]["completion_tokens"]
    none = http.post("/v1/generate", json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                                           "optimization": "none"}).json()
    assert none["text"] == body["text"] and none["optimization_used"] == "none"


def test_generate_streams_deltas_then_the_result(http):
    with http.stream("POST", "/v1/generate", json={"prompt": "Once upon a time", "max_tokens": 10,
                                                   "temperature": 0, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    final = payloads[-1]
    assert final["done"] and final["text"] == "".join(p["text"] for p in payloads[:-1])
    assert final["tokens_generated"] == 10


def test_generate_batch(http):
    r = http.post("/v1/generate/batch", json={"prompts": ["One", "Two", "Three"], "max_tokens": 6, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and len(body["results"]) == 3
    assert all(x["tokens_generated"] == 6 or x["finish_reason"] == "stop" for x in body["results"])
    total = sum(x["tokens_generated"] for x in body["results"])
    assert body["throughput_tokens_per_sec"] == pytest.approx(total / (body["total_latency_ms"] / 1000), rel=1e-6)


def test_cache_stats_reflect_reuse_and_delete_drops_unused_blocks(http):
    system = "You are a meticulous assistant. " * 12  # several full blocks shared by both requests
    for question in ("Who are you?", "What can you do?"):
        http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": system},
                                                             {"role": "user", "content": question}],
                                                "max_tokens": 2, "temperature": 0})
    stats = http.get("/v1/cache/stats").json()
    kv, prefix = stats["kv_cache"], stats["prefix_cache"]
    assert kv["used_blocks"] == 0 and kv["free_blocks"] == kv["total_blocks"] and kv["usage"] == 0.0
    assert prefix["enabled"] and prefix["cached_blocks"] > 0 and prefix["hits_tokens"] >= 64
    assert prefix["hit_rate"] == pytest.approx(prefix["hits_tokens"] / prefix["queries_tokens"])
    dropped = http.delete("/v1/cache").json()["evicted_blocks"]
    assert dropped == prefix["cached_blocks"]
    assert http.get("/v1/cache/stats").json()["prefix_cache"]["cached_blocks"] == 0


def test_model_info(http):
    info = http.get("/v1/model/info").json()
    assert info["name"] == "smollm2" and info["architecture"] == "llama"
    assert info["parameters"] == 134_515_008 and info["dtype"] == "float32"
    assert info["quantization"] == "Q4_1+Q8_0 in the file, dequantized to float32" and info["kv_block_size"] == 16
    assert (info["runtime_quantization"], info["weight_mode"]) == (None, "float32 (dequantized)")  # quantization none
    assert info["kernels"].startswith(tuple(f"{backend} (instruction set {isa.chosen().describe()}, torch "
                                            for backend in ("CBackend", "KernelBackend")))
    assert info["kv_cache_dtype"] == info["dtype"]  # auto: the model's dtype
    assert info["max_model_len"] == 2048 and info["num_kv_blocks"] > 0 and info["max_num_seqs"] == 64


def test_model_info_names_the_mode_auto_chose(default_llm):
    engine = AsyncEngine(engine=default_llm.engine)
    try:
        with running_server(engine) as url:
            info = httpx.get(f"{url}/v1/model/info").json()
    finally:
        engine.shutdown()
    assert (info["runtime_quantization"], info["weight_mode"]) == ("gguf", "gguf+a8")
    assert info["quantization"] == "Q4_1+Q8_0 in the file, run as gguf+a8"
    assert info["weights"] == "the file's Q4_1+Q8_0 blocks, int8 activations"
    assert info["parameters"] == 134_515_008  # the quantized layers counted by the matrices they stand for


def test_health(http):
    assert http.get("/health").status_code == 200


def test_metrics_expose_measured_values(http):
    http.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    text = http.get("/metrics").text
    values = metric_values(text)
    for name in ("brisk:num_requests_running", "brisk:num_requests_waiting", "brisk:kv_cache_usage_perc",
                 "brisk:prompt_tokens_total", "brisk:generation_tokens_total", "brisk:num_preemptions_total",
                 "brisk:time_to_first_token_seconds_count", "brisk:inter_token_latency_seconds_count",
                 "brisk:e2e_request_latency_seconds_count", "brisk:request_queue_time_seconds_count",
                 "brisk:iteration_batch_size_count", "brisk:prefix_cache_queries_total",
                 "brisk:prefix_cache_hits_total"):
        assert name in values, name
    assert values["brisk:generation_tokens_total"] >= 3 and values["brisk:prompt_tokens_total"] >= 1
    assert values["brisk:time_to_first_token_seconds_count"] >= 1
    assert values['brisk:request_success_total{finished_reason="length"}'] >= 1
