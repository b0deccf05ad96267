"""brisk on Ray Serve: a local Ray cluster started here, 2 replicas of a tiny model behind the
ingress, driven by the official openai client as a user would (`brisk serve --replicas 2`,
docs/deployment.md, runs this same `start`)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from tests.helpers import import_or_require

ray = import_or_require("ray", "Ray Serve (the optional extra: pip install 'brisk[ray]')")
serve = import_or_require("ray.serve", "Ray Serve (the optional extra: pip install 'brisk[ray]')")

from brisk import LLM  # noqa: E402
from brisk.cluster.app import APP_NAME, ENGINE_DEPLOYMENT, engine_deployment, start  # noqa: E402
from brisk.config import ClusterConfig, EngineConfig, ServerConfig  # noqa: E402
from brisk.sample.params import SamplingParams  # noqa: E402
from brisk.identity import content_digest  # noqa: E402
from tests.conftest import build_lora_adapter, build_tiny_checkpoint  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

ENGINE = dict(dtype="float32", num_kv_blocks=512, max_model_len=2048, max_num_seqs=8, num_threads=1, enable_lora=True)
PROMPTS = ["w5 w6 w7 w8", "w40 w41 w9", "w3 w3 w3 w90 w17"]
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture(scope="module")
def cluster(tiny_folder):
    """The base URL of 2 replicas behind the ingress; the Ray cluster has room for 2 more."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    start(EngineConfig(model=tiny_folder, **ENGINE), ServerConfig(port=port, served_model_name=["tiny"]),
          ClusterConfig(replicas=2))
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=60)


def engines():
    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME)


def reports() -> list:
    return engines().broadcast("report").results(timeout_s=30)


def live_reports() -> list:
    """The reports of the replicas that answer (a killed one may still be on the handle's list)."""
    answers = engines().broadcast("report").results(timeout_s=30, return_exceptions=True)
    return [a for a in answers if not isinstance(a, BaseException)]


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        time.sleep(0.2)
    return value


def test_answers_as_one_engine_does(client, tiny_folder):
    llm = LLM(model=tiny_folder, **ENGINE)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0),
                                                       use_tqdm=False)]
    got = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == expected


def test_streaming_chat_matches_the_whole_answer(client):
    messages = [{"role": "user", "content": "w9 w10 w11"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 16


def test_bad_requests_are_answered_by_the_ingress(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="w5", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="w5", max_tokens=2)


def snapshots() -> dict:
    """replica id -> its engine's snapshot"""
    return dict(engines().broadcast("snapshot").results(timeout_s=30))


def _prefix_hits() -> dict[str, int]:
    return {replica_id: s.prefix_cache_hits for replica_id, s in snapshots().items()}


def _metric(base: str, name: str) -> float:
    line = next(x for x in httpx.get(f"{base}/metrics").text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_requests_sharing_a_prefix_land_on_the_replica_holding_it(cluster, client):
    groups = {name: " ".join(f"w{3 + (i * step) % 90}" for i in range(4 * BLOCK)) for name, step in
              (("a", 1), ("b", 7))}  # 64 tokens each: 4 whole blocks (the tiny tokenizer: a word is a token)
    hits_before, metric_before = _prefix_hits(), _metric(cluster, "brisk:prefix_cache_hits_total")
    for prefix in groups.values():
        for i in range(4):
            client.completions.create(model="tiny", prompt=f"{prefix} w{10 + i} w{20 + i}", max_tokens=2)
    hits_after = _prefix_hits()
    gained = [hits_after[r] - hits_before[r] for r in hits_before]
    # Each group's first request computes its prefix, the 3 after it find all 4 blocks cached:
    # only if all 4 went to the same replica (round robin would have found 2 blocks' worth per group).
    assert sum(gained) == 2 * 3 * 4 * BLOCK
    assert all(g % (3 * 4 * BLOCK) == 0 for g in gained)
    # /metrics counts the replicas' hits together (replayed from their step records by the ingress)
    wait_for(lambda: _metric(cluster, "brisk:prefix_cache_hits_total") - metric_before == sum(gained), 60,
             "the aggregated prefix-hit counter")


def test_a_client_leaving_frees_its_blocks_on_the_replica(client):
    stream = client.completions.create(model="tiny", prompt="w7 w8", max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    wait_for(lambda: all(s.num_running == 0 and s.kv_cache_usage == 0 for s in snapshots().values()), 60,
             "the aborted request's blocks to be freed")


def test_killing_a_replica_fails_its_requests_and_the_service_goes_on(cluster):
    victim = reports()[0].pid

    async def stream_one(client: openai.AsyncOpenAI, i: int, started: asyncio.Event) -> str:
        try:
            stream = await client.completions.create(model="tiny", prompt=f"w{3 + i} w5 w6", max_tokens=1800,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                started.set()
            return "finished"
        except openai.APIError as exc:
            assert "replica" in str(exc)  # names what failed
            return "failed"

    async def load() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=60)
        events = [asyncio.Event() for _ in range(6)]
        tasks = [asyncio.create_task(stream_one(client, i, e)) for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        os.kill(victim, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)  # none hangs

    outcomes = asyncio.run(load())
    assert "failed" in outcomes and "finished" in outcomes, outcomes
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(4):
        assert client.completions.create(model="tiny", prompt=f"w{i + 3}", max_tokens=3).usage.completion_tokens == 3
    assert httpx.get(f"{cluster}/health").status_code == 200
    wait_for(lambda: len({r.pid for r in reports()} - {victim}) == 2, 240, "Ray Serve to replace the replica")


def test_adapters_loaded_at_run_time_reach_a_replica_started_later(cluster, client, tiny_folder, tmp_path):
    """An adapter loaded through the ingress at run time is served by a replica Ray Serve starts
    afterwards (here the replacement of one killed), as by the others, from the first request
    it gets (which names the adapter's files), whether or not the ingress's resync reached it
    first; unloading reaches all."""
    build_lora_adapter(tiny_folder, str(tmp_path / "tuned"), 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    answer = httpx.post(f"{cluster}/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(tmp_path / "tuned")})
    assert answer.status_code == 200, answer.text
    served = {"tuned": content_digest(str(tmp_path / "tuned"))}
    assert all(r.adapters == served for r in reports())
    prompts = [f"w{i} w5 w6 w7" for i in range(3, 9)]  # the router spreads them over both replicas
    expected = [client.completions.create(model="tuned", prompt=p, max_tokens=6, temperature=0).choices[0].text
                for p in prompts]
    victim = reports()[0].pid
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len({r.pid for r in live_reports()} - {victim}) == 2, 240, "Ray Serve to replace the replica")
    for prompt, text in zip(prompts, expected):  # at once: no 404 from a replica the resync has not reached
        assert client.completions.create(model="tuned", prompt=prompt, max_tokens=6, temperature=0).choices[0].text == text
    wait_for(lambda: all(r.adapters == served for r in live_reports()), 30, "the new replica to serve the adapter")
    assert httpx.post(f"{cluster}/v1/unload_lora_adapter", json={"lora_name": "tuned"}).status_code == 200
    assert all(r.adapters == {} for r in reports())
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tuned", prompt=prompts[0], max_tokens=2)


def test_autoscaling_adds_replicas_under_load(tiny_folder, cluster):
    """Ray Serve's autoscaler on the replicas' ongoing requests: 1 replica, 2 under load."""
    config = EngineConfig(model=tiny_folder, **ENGINE)
    deployment = engine_deployment(config, ServerConfig(), ClusterConfig(min_replicas=1, max_replicas=2,
                                                                         target_ongoing_requests=1))
    # Ray's defaults report load every 10 s: the tiny model can finish the load before a report.
    fast = dict(deployment._deployment_config.autoscaling_config.model_dump(), upscale_delay_s=0.5,
                look_back_period_s=1.0, metrics_interval_s=0.5)
    serve.run(deployment.options(autoscaling_config=fast).bind(config), name="autoscaled", route_prefix=None)
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, "autoscaled").options(stream=True)

    def running_replicas() -> int:
        status = serve.status().applications["autoscaled"].deployments[ENGINE_DEPLOYMENT]
        return status.replica_states.get("RUNNING", 0)

    assert running_replicas() == 1
    long = SamplingParams(max_tokens=2000, ignore_eos=True)
    streams = [handle.generate.remote([5, 6, 7], long, f"load-{i}") for i in range(6)]
    try:
        wait_for(lambda: running_replicas() == 2, 240, "a second replica")
    finally:
        for s in streams:
            s.cancel()
        serve.delete("autoscaled")
