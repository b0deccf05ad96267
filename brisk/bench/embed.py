"""Embeddings: dynamic batching vs one input at a time, in process and over HTTP.

Workload: N one-sentence requests (10-40 words each, cut from Pride and Prejudice at seeded
places) from C concurrent callers, each sending its next request as soon as the last is
answered. In process, the callers are asyncio tasks awaiting a DynamicBatcher over the
Embedder; over HTTP, they are aiohttp clients posting to /v1/embeddings of a `brisk serve`
subprocess on this machine (so client and server share its cores, as a local client would).
"One at a time" is the same batcher with max_batch_size 1: the same code, no batching. In
process, dynamic batching runs once per backend (torch, onnx, onnx-int8), each checked against
the torch encoder's vectors by cosine similarity.

Printed per run: requests/s and its ratio to one at a time, latency p50/p99 (request sent ->
answer), and what the batches were: mean size and padding (the share of padded positions).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import torch

from brisk.config import DEFAULT_TEXT
from brisk.bench.harness import brisk_serve, free_port, machine, prometheus_samples
from brisk.engine.stats import percentiles
from brisk.bench.workloads import sentences
from brisk.config import EmbeddingConfig, ServerConfig
from brisk.embed.batcher import BatchRecord
from brisk.embed.embedder import Embedder


AGREEMENT_SENTENCES = 200


@dataclass
class Run:
    name: str
    where: str
    seconds: float
    latencies: list[float]
    batches: int
    tokens: int
    padded_tokens: int
    every_round: list[float] = field(default_factory=list)  # requests/s of each round

    @property
    def requests_per_second(self) -> float:
        return len(self.latencies) / self.seconds


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
        batcher = embedder.batcher(config, records.append)
        try:
            await _callers(texts[:concurrency], concurrency, lambda t: batcher.submit(embedder.tokenize([t])[0]))
            records.clear()  # the warm-up's
            return await _callers(texts, concurrency, lambda t: batcher.submit(embedder.tokenize([t])[0]))
        finally:
            await batcher.close()

    seconds, latencies = asyncio.run(main())
    return Run(name, "in process", seconds, latencies, len(records), sum(r.tokens for r in records),
               sum(r.padded_tokens for r in records))


def run_over_http(texts: list[str], concurrency: int, config: EmbeddingConfig, name: str, rounds: int,
                  startup_timeout: float) -> list[Run]:
    """`rounds` passes over the texts against one `brisk serve` with this batching."""
    server = ServerConfig(port=free_port(), log_level="warning")
    flags = [f"--port={server.port}", "--log-level=warning",
             f"--embedding-max-batch-size={config.embedding_max_batch_size}",
             f"--embedding-max-wait-ms={config.embedding_max_wait_ms}",
             f"--embedding-max-batch-tokens={config.embedding_max_batch_tokens}",
             f"--embedding-max-queue-size={config.embedding_max_queue_size}"]
    with brisk_serve(flags, server, startup_timeout) as base_url:
        async def main() -> list[Run]:
            # aiohttp, not httpx: httpx's connection pool crawls at 64 connections (75 requests/s
            # against a trivial endpoint on this machine, where aiohttp does 1,770).
            connector = aiohttp.TCPConnector(limit=concurrency)
            async with aiohttp.ClientSession(base_url, connector=connector) as http:
                async def request(text: str) -> None:
                    async with http.post("/v1/embeddings", json={"input": text}) as response:
                        response.raise_for_status()
                        await response.read()

                async def metrics() -> dict[str, float]:
                    async with http.get("/metrics") as response:
                        return prometheus_samples(await response.text())

                await _callers(texts[:concurrency], concurrency, request)  # warm-up
                runs = []
                for _ in range(rounds):
                    before = await metrics()
                    seconds, latencies = await _callers(texts, concurrency, request)
                    after = await metrics()
                    counts = [int(after.get(f"brisk:{m}", 0) - before.get(f"brisk:{m}", 0)) for m in
                              ("embedding_batch_size_count", "embedding_tokens_total", "embedding_padded_tokens_total")]
                    runs.append(Run(name, "over HTTP", seconds, latencies, *counts))
                return runs

        return asyncio.run(main())


def _median(rounds: list[Run]) -> Run:
    """The round with the median requests/s, carrying every round's figure."""
    ordered = sorted(rounds, key=lambda r: r.requests_per_second)
    middle = ordered[len(ordered) // 2]
    middle.every_round = [r.requests_per_second for r in rounds]
    return middle


def main(args) -> None:
    texts = sentences(args.num_requests, args.text or str(DEFAULT_TEXT))
    dynamic = EmbeddingConfig(embedding_max_batch_size=args.max_batch_size, embedding_max_wait_ms=args.max_wait_ms)
    single = EmbeddingConfig(embedding_max_batch_size=1, embedding_max_wait_ms=0.0)
    print(machine())
    print(f"workload: {len(texts)} requests of one sentence (10-40 words) from {args.concurrency} concurrent callers; "
          f"dynamic batching: up to {args.max_batch_size} inputs, {args.max_wait_ms:g} ms wait")
    agreement, rounds_of = {}, {}
    if "process" in args.where:
        embedders = {backend: Embedder(args.model, backend=backend) for backend in args.backends}
        reference = embedders["torch"] if "torch" in embedders else Embedder(args.model)
        configs = [("one at a time, torch", reference, single)] + [
            (f"dynamic batching, {backend}", embedder, dynamic) for backend, embedder in embedders.items()]
        for _ in range(args.rounds):  # interleaved, so a slow spell of the machine hits every run alike
            for name, embedder, config in configs:
                rounds_of.setdefault(("in process", name), []).append(
                    run_in_process(embedder, texts, args.concurrency, config, name))
        expected = torch.tensor([r.embedding for r in reference.embed(texts[:AGREEMENT_SENTENCES])])
        for backend, embedder in embedders.items():
            got = torch.tensor([r.embedding for r in embedder.embed(texts[:AGREEMENT_SENTENCES])])
            agreement[backend] = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
        del embedders, reference, configs
    if "http" in args.where:
        for name, config in (("one at a time, torch", single), ("dynamic batching, torch", dynamic)):
            rounds_of[("over HTTP", name)] = run_over_http(texts, args.concurrency, config, name, args.rounds,
                                                           args.startup_timeout)
    runs = [_median(rounds) for rounds in rounds_of.values()]
    print(f"\nmedian of {args.rounds} rounds (the round with the median requests/s; every round's in the last "
          f"column)")
    print("\n| where | batching | requests | seconds | requests/s | vs one at a time | latency p50 (ms) "
          "| latency p99 (ms) | batches | mean batch | padding | every round (requests/s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    baseline = {}
    for run in runs:
        base = baseline.setdefault(run.where, run.requests_per_second)
        padding = 1 - run.tokens / run.padded_tokens if run.padded_tokens else 0.0
        p50, p99 = percentiles(run.latencies, (0.5, 0.99))
        print(f"| {run.where} | {run.name} | {len(run.latencies)} | {run.seconds:.2f} | {run.requests_per_second:.1f} "
              f"| {run.requests_per_second / base:.2f}x | {p50 * 1000:.1f} | {p99 * 1000:.1f} | {run.batches} "
              f"| {len(run.latencies) / max(1, run.batches):.1f} | {padding:.1%} "
              f"| {', '.join(f'{v:.1f}' for v in run.every_round)} |")
    if agreement:
        print(f"\ncosine similarity to the torch encoder's vectors, {AGREEMENT_SENTENCES} of the sentences:\n")
        print("| backend | mean | min |\n|---|---:|---:|")
        for backend, cosines in agreement.items():
            print(f"| {backend} | {cosines.mean().item():.6f} | {cosines.min().item():.6f} |")
