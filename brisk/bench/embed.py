"""Embeddings: dynamic batching vs one input at a time, in process and over HTTP.

Workload: N one-sentence requests (10-40 words each, cut from Pride and Prejudice at seeded
places) from C concurrent callers, each sending its next request as soon as the last is
answered. In process, the callers are asyncio tasks awaiting a DynamicBatcher over the
Embedder; over HTTP, they are aiohttp clients posting to /v1/embeddings of a `brisk serve`
subprocess on this machine (so client and server share its cores, as a local client would).
"One at a time" is the same batcher with max_batch_size 1: the same code, no batching.

Printed per run: requests/s and its ratio to one at a time, latency p50/p99 (request sent ->
answer), and what the batches were: mean size and padding (the share of padded positions).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass

import aiohttp
import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from brisk.bench.perplexity import DEFAULT_TEXT
from brisk.bench.serve import brisk_serve, cpu_name, free_port, percentile
from brisk.config import EmbeddingConfig, ServerConfig
from brisk.embed.batcher import BatchRecord, DynamicBatcher
from brisk.embed.embedder import Embedder


@dataclass
class Run:
    name: str
    where: str
    seconds: float
    latencies: list[float]
    batches: int
    tokens: int
    padded_tokens: int

    @property
    def requests_per_second(self) -> float:
        return len(self.latencies) / self.seconds


def sentences(count: int, text_path: str, seed: int = 0) -> list[str]:
    """`count` runs of 10-40 consecutive words of the text, from seeded places."""
    with open(text_path, encoding="utf-8") as f:
        words = f.read().split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(10, 40)
        start = rng.randrange(len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out


async def _callers(texts: list[str], concurrency: int, request) -> tuple[float, list[float]]:
    """Runs `request(text)` for every text from `concurrency` callers; (wall seconds, latencies)."""
    queue = list(reversed(texts))
    latencies: list[float] = []

    async def caller():
        while queue:
            text = queue.pop()
            start = time.perf_counter()
            await request(text)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


def run_in_process(embedder: Embedder, texts: list[str], concurrency: int, config: EmbeddingConfig,
                   name: str) -> Run:
    records: list[BatchRecord] = []

    async def main() -> tuple[float, list[float]]:
        batcher = DynamicBatcher(lambda batch: list(embedder.encode(batch)), len,
                                 max_batch_size=config.embedding_max_batch_size,
                                 max_wait_ms=config.embedding_max_wait_ms,
                                 max_tokens_per_batch=config.embedding_max_batch_tokens,
                                 max_queue_size=config.embedding_max_queue_size, on_batch=records.append)
        try:
            await _callers(texts[:concurrency], concurrency, lambda t: batcher.submit(embedder.tokenize([t])[0]))
            records.clear()  # the warm-up's
            return await _callers(texts, concurrency, lambda t: batcher.submit(embedder.tokenize([t])[0]))
        finally:
            await batcher.close()

    seconds, latencies = asyncio.run(main())
    return Run(name, "in process", seconds, latencies, len(records), sum(r.tokens for r in records),
               sum(r.padded_tokens for r in records))


def run_over_http(texts: list[str], concurrency: int, config: EmbeddingConfig, name: str,
                  startup_timeout: float) -> Run:
    server = ServerConfig(port=free_port(), log_level="warning")
    flags = [f"--port={server.port}", "--log-level=warning",
             f"--embedding-max-batch-size={config.embedding_max_batch_size}",
             f"--embedding-max-wait-ms={config.embedding_max_wait_ms}",
             f"--embedding-max-batch-tokens={config.embedding_max_batch_tokens}",
             f"--embedding-max-queue-size={config.embedding_max_queue_size}"]
    with brisk_serve(flags, server, startup_timeout) as base_url:
        async def main() -> tuple[float, list[float]]:
            # aiohttp, not httpx: httpx's connection pool crawls at 64 connections (75 requests/s
            # against a trivial endpoint on this machine, where aiohttp does 1,770).
            connector = aiohttp.TCPConnector(limit=concurrency)
            async with aiohttp.ClientSession(base_url, connector=connector) as http:
                async def request(text: str) -> None:
                    async with http.post("/v1/embeddings", json={"input": text}) as response:
                        response.raise_for_status()
                        await response.read()

                await _callers(texts[:concurrency], concurrency, request)  # warm-up
                async with http.get("/metrics") as response:
                    before.update(_metrics(await response.text()))
                return await _callers(texts, concurrency, request)

        before: dict[str, float] = {}
        seconds, latencies = asyncio.run(main())
        after = _metrics(httpx.get(f"{base_url}/metrics").text)

    def delta(name: str) -> int:
        return int(after.get(f"brisk:{name}", 0) - before.get(f"brisk:{name}", 0))


    return Run(name, "over HTTP", seconds, latencies, delta("embedding_batch_size_count"),
               delta("embedding_tokens_total"), delta("embedding_padded_tokens_total"))


def _metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, histogram buckets left out."""
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if "le" not in sample.labels}


def main(args) -> None:
    texts = sentences(args.num_requests, args.text or str(DEFAULT_TEXT))
    dynamic = EmbeddingConfig(embedding_max_batch_size=args.max_batch_size, embedding_max_wait_ms=args.max_wait_ms)
    single = EmbeddingConfig(embedding_max_batch_size=1, embedding_max_wait_ms=0.0)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores, torch capability {torch.backends.cpu.get_cpu_capability()})")
    print(f"workload: {len(texts)} requests of one sentence (10-40 words) from {args.concurrency} concurrent callers; "
          f"dynamic batching: up to {args.max_batch_size} inputs, {args.max_wait_ms:g} ms wait")
    runs = []
    if "process" in args.where:
        embedder = Embedder(args.model)
        runs += [run_in_process(embedder, texts, args.concurrency, single, "one at a time"),
                 run_in_process(embedder, texts, args.concurrency, dynamic, "dynamic batching")]
        del embedder
    if "http" in args.where:
        runs += [run_over_http(texts, args.concurrency, single, "one at a time", args.startup_timeout),
                 run_over_http(texts, args.concurrency, dynamic, "dynamic batching", args.startup_timeout)]
    print("\n| where | batching | requests | seconds | requests/s | vs one at a time | latency p50 (ms) "
          "| latency p99 (ms) | batches | mean batch | padding |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    baseline = {}
    for run in runs:
        base = baseline.setdefault(run.where, run.requests_per_second)
        padding = 1 - run.tokens / run.padded_tokens if run.padded_tokens else 0.0
        print(f"| {run.where} | {run.name} | {len(run.latencies)} | {run.seconds:.2f} | {run.requests_per_second:.1f} "
              f"| {run.requests_per_second / base:.2f}x | {percentile(run.latencies, 0.5) * 1000:.1f} "
              f"| {percentile(run.latencies, 0.99) * 1000:.1f} | {run.batches} "
              f"| {len(run.latencies) / max(1, run.batches):.1f} | {padding:.1%} |")
