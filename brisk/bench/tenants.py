"""`brisk bench tenants`: one tenant floods the server while another sends a steady trickle of
chats; what the steady one waits for its first token under each scheduling policy.

Per policy (`--policies`, fcfs and fair), a `brisk serve` of the engine flags is started with
an API keys file of two tenants and loaded by two clients at once, each with its own key:

  steady  `--steady-prompts` MT-Bench first turns (`--steady-output-len` tokens each), Poisson
          at `--steady-rate` req/s;
  flood   MT-Bench first turns (`--output-len` tokens each), Poisson at `--flood-factor` times
          the rate a server of the same flags completes them when saturated, for as long as
          the steady run lasts. That rate is measured first (under fcfs, on the first server):
          `--saturation-prompts` of the flood's requests sent all at once.

Reported per policy: the steady tenant's TTFT p50/p99 and how many of its requests completed,
the flood's completed and refused (429: the server's waiting queue is bounded), and the load
generator's CPU seconds (it shares the server's cores). The target of issue 41: the steady
tenant's TTFT p99 under 3 s with `fair`.

Then one-shot work beside generation (`--embedding-clients`, 0 to skip): on a server with the
embedding model, an 8-token chat's latency alone, then while that many clients each send two
requests of `--embedding-inputs` texts to /v1/embeddings (the embedding batcher's share of the
cores while generation runs: EmbeddingConfig). Target: at most 3x the latency alone.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import tempfile
import time
from dataclasses import replace

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.load import LoadReport, LoadSettings, mtbench_requests, run_load
from brisk.bench.serve import WARMUP
from brisk.config import ServerConfig

KEYS = {"flood": "key-flood", "steady": "key-steady"}


def saturated_rate(base_url: str, args) -> float:
    """Requests/s the server completes with the flood's requests all at once."""
    requests = mtbench_requests(args.saturation_prompts, args.output_len)
    report = asyncio.run(run_load(base_url, requests, LoadSettings(api_key=KEYS["flood"]), "saturation",
                                  progress=False))
    print(f"saturated: {report.request_throughput:.2f} req/s ({report.output_throughput:.0f} output tok/s, "
          f"{report.completed} of {report.num_requests} completed)", flush=True)
    return report.request_throughput


async def two_tenants(base_url: str, flood_rate: float, args) -> tuple[LoadReport, LoadReport]:
    steady = mtbench_requests(args.steady_prompts, args.steady_output_len)
    seconds = args.steady_prompts / args.steady_rate
    flood = mtbench_requests(max(1, math.ceil(flood_rate * seconds)), args.output_len)
    return await asyncio.gather(
        run_load(base_url, steady, LoadSettings(request_rate=args.steady_rate, api_key=KEYS["steady"], seed=1),
                 "steady", progress=False),
        run_load(base_url, flood, LoadSettings(request_rate=flood_rate, api_key=KEYS["flood"], seed=2), "flood",
                 progress=False))


CHAT = {"messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 8, "ignore_eos": True}
EMBED_TEXT = "The quick brown fox jumps over the lazy dog near the riverbank at dawn."


async def chat_latencies(session, base_url: str, count: int) -> list[float]:
    """`count` 8-token chats one after another: seconds each, sent -> whole answer."""
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        async with session.post(f"{base_url}/v1/chat/completions", json=CHAT,
                                headers={"Authorization": f"Bearer {KEYS['steady']}"}) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"the chat failed: HTTP {response.status}")
        seconds.append(time.perf_counter() - start)
    return seconds


async def embedding_flood(base_url: str, args) -> str:
    """The chat's latency alone, then under the flood; the line that reports both."""
    import aiohttp

    headers = {"Authorization": f"Bearer {KEYS['flood']}"}
    body = {"input": [EMBED_TEXT] * args.embedding_inputs}
    statuses = []

    async def client(session):
        for _ in range(2):
            async with session.post(f"{base_url}/v1/embeddings", json=body, headers=headers) as response:
                await response.read()
                statuses.append(response.status)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        alone = await chat_latencies(session, base_url, args.chats)
        flood = asyncio.gather(*(client(session) for _ in range(args.embedding_clients)))
        await asyncio.sleep(1.0)  # the flood's first batches are running
        beside = await chat_latencies(session, base_url, args.chats)
        await flood
    ratio = statistics.median(beside) / statistics.median(alone)
    return (f"an 8-token chat alone: median {statistics.median(alone):.2f} s; beside {args.embedding_clients} clients "
            f"x 2 requests of {args.embedding_inputs} embedding inputs: median {statistics.median(beside):.2f} s, "
            f"max {max(beside):.2f} s ({ratio:.1f}x; target 3x); embedding requests: "
            f"{statuses.count(200)} answered, {statuses.count(429)} refused (429)")


def main(args) -> None:
    print(machine())
    engine_flags = config_flags(replace(engine_config_from_args(args), scheduling_policy="auto"))
    flood_rate = None
    with tempfile.TemporaryDirectory() as folder:
        keys = os.path.join(folder, "keys")
        with open(keys, "w") as f:
            f.writelines(f"{key} {tenant}\n" for tenant, key in KEYS.items())
        for policy in args.policies:
            server = ServerConfig(port=free_port(), log_level="warning", api_keys_file=keys)
            flags = [*engine_flags, "--scheduling-policy", policy, *config_flags(server), "--embedding-model", "none"]
            with brisk_serve(flags, server, args.startup_timeout) as url:
                asyncio.run(run_load(url, [WARMUP] * 2, LoadSettings(api_key=KEYS["steady"]), "warm-up",
                                     progress=False))
                if flood_rate is None:
                    flood_rate = args.flood_factor * saturated_rate(url, args)
                steady, flood = asyncio.run(two_tenants(url, flood_rate, args))
            print(f"{policy}: {summary(steady, flood, flood_rate)}", flush=True)
        if args.embedding_clients:
            server = ServerConfig(port=free_port(), log_level="warning", api_keys_file=keys)
            with brisk_serve([*engine_flags, *config_flags(server)], server, args.startup_timeout) as url:
                print(asyncio.run(embedding_flood(url, args)), flush=True)


def refused(report: LoadReport) -> int:
    return sum(1 for r in report.records if r.error and r.error.startswith("HTTP 429"))


def summary(steady: LoadReport, flood: LoadReport, flood_rate: float) -> str:
    ttft = steady.latency_ms["ttft"]
    waits = "no steady request completed" if ttft is None else (
        f"steady TTFT p50 {ttft.p50 / 1000:.2f} s, p99 {ttft.p99 / 1000:.2f} s")
    # the two loads run in one process at once: each one's CPU figure is the whole process's
    failures = "; ".join(e for e in steady.errors)  # the first few distinct ones
    waits += f" [steady failures: {failures}]" if failures else ""
    return (f"{waits} ({steady.completed} of {steady.num_requests} completed); flood at {flood_rate:.2f} req/s: "
            f"{flood.completed} completed, {refused(flood)} refused (429), {flood.output_throughput:.0f} output tok/s; "
            f"load generator {max(steady.client_cpu_s, flood.client_cpu_s):.0f} CPU s over "
            f"{max(steady.duration_s, flood.duration_s):.0f} s")
