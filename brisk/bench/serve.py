"""Serving vs offline: the same chat prompts through `LLM` and through a real `brisk serve`.

Workload: N short chat prompts, each generating exactly `--output-len` tokens (EOS ignored, so
every run does the same work), sampled with the same params and seed. First offline, in this
process (the ceiling); then, per engine kind, a `brisk serve` subprocess with the same engine
options, driven by N concurrent streaming requests from the official openai async client. The
load generator runs in this process, on the same machine: on 2 cores it competes with the
server for CPU, as a client on the same box would.

Printed per run: output tok/s and its ratio to offline; for served runs TTFT p50/p99 (request
sent -> first token's chunk received) and ITL p50 (gaps between token chunks, one per step).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import httpx
import torch

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.workloads import chat_prompts
from brisk.config import EngineConfig, ServerConfig
from brisk.llm import LLM
from brisk.model.tokenizer import Message
from brisk.sampling_params import SamplingParams

ENGINE_KINDS = {"thread": "in-thread engine", "process": "engine-core process"}


@dataclass
class RunResult:
    name: str
    requests: int
    output_tokens: int
    seconds: float
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_offline(config: EngineConfig, prompts: list[list[Message]], params: SamplingParams) -> RunResult:
    llm = LLM.from_config(config)
    llm.chat(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up: first-call allocations
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return RunResult("offline LLM.chat", len(prompts), sum(len(o.outputs[0].token_ids) for o in outputs), elapsed)


@contextmanager
def brisk_serve(flags: list[str], server: ServerConfig, startup_timeout: float,
                response_cache: bool = False) -> Iterator[str]:
    """A `brisk serve` subprocess with these flags (the server's among them) until the block
    ends; yields its base URL once /health answers. Its response cache is off unless asked
    for: a benchmark that repeats requests measures the engine, not the cache."""
    command = [sys.executable, "-m", "brisk.cli", "serve", *flags,
               *(() if response_cache else ("--no-response-cache",))]
    base_url = f"http://{server.host}:{server.port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_until_healthy(process, base_url, startup_timeout, log)
            yield base_url
        finally:
            process.terminate()
            process.wait(timeout=60)


def run_served(kind: str, config: EngineConfig, server: ServerConfig, prompts: list[list[Message]],
               params: SamplingParams, startup_timeout: float) -> RunResult:
    """Starts `brisk serve` with this engine config, runs the prompts against it, stops it."""
    with brisk_serve([*config_flags(config), *config_flags(server)], server, startup_timeout) as base_url:
        model = server.served_model_name[0]
        asyncio.run(_load(base_url, model, prompts[:2], SamplingParams(max_tokens=2)))  # warm-up
        start = time.perf_counter()
        streams = asyncio.run(_load(base_url, model, prompts, params))
        elapsed = time.perf_counter() - start
    return RunResult(f"brisk serve, {ENGINE_KINDS[kind]}", len(prompts), sum(s.tokens for s in streams), elapsed,
                     ttfts=[s.ttft for s in streams], itls=[gap for s in streams for gap in s.itls])


@dataclass
class _Stream:
    tokens: int
    ttft: float
    itls: list[float]


async def _load(base_url: str, model: str, prompts: list[list[Message]], params: SamplingParams) -> list[_Stream]:
    """Every prompt at once, each as one streaming chat request."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=3600) as client:
        return await asyncio.gather(*(_stream(client, model, messages, params) for messages in prompts))


async def _stream(client, model: str, messages: list[Message], params: SamplingParams) -> _Stream:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=params.max_tokens, temperature=params.temperature,
        top_p=params.top_p, seed=params.seed, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": params.ignore_eos})
    arrivals, tokens = [], 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.role is None:  # the first chunk only names the role
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return _Stream(tokens, arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])])


def _wait_until_healthy(process: subprocess.Popen, base_url: str, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"brisk serve exited with code {process.returncode}:\n{log.read()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"brisk serve did not become healthy within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main(args) -> None:
    config = engine_config_from_args(args)
    prompts = chat_prompts(args.num_prompts)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed, ignore_eos=True)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores, torch capability {torch.backends.cpu.get_cpu_capability()}); "
          f"engine threads: {config.num_threads or 'all cores'}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"engine process: {args.engine_omp_wait_policy or 'inherited'}")
    print(f"workload: {len(prompts)} chat prompts, {args.output_len} output tokens each, temperature "
          f"{args.temperature}, top_p {args.top_p}, seed {args.sampling_seed}; served: all {len(prompts)} streams at once")

    results = [run_offline(config, prompts, params)]
    for kind in args.engines:
        server = ServerConfig(port=free_port(), served_model_name="bench", log_level="warning",
                              engine_process=kind == "process",
                              engine_omp_wait_policy=args.engine_omp_wait_policy if kind == "process" else None)
        results.append(run_served(kind, config, server, prompts, params, args.startup_timeout))

    offline = results[0].tokens_per_second
    print("\n| run | requests | output tokens | seconds | output tok/s | vs offline | TTFT p50 (s) | TTFT p99 (s) "
          "| ITL p50 (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        latency = " | ".join(f"{percentile(values, q) * scale:.{digits}f}" if values else "-" for values, q, scale, digits
                             in ((r.ttfts, 0.5, 1, 3), (r.ttfts, 0.99, 1, 3), (r.itls, 0.5, 1000, 1)))
        print(f"| {r.name} | {r.requests} | {r.output_tokens} | {r.seconds:.2f} | {r.tokens_per_second:.1f} "
              f"| {r.tokens_per_second / offline:.0%} | {latency} |")
