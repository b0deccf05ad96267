"""`brisk bench cluster`: brisk on Ray Serve against one process, on a shared-prefix chat workload.

The same machine, the same cores, the same requests, side by side:
  - one `brisk serve` process whose engine has all the threads (2 here);
  - `brisk serve --replicas 2`, each replica an engine of 1 thread, routed by prefix;
  - the same, routed round robin (and any other --routings asked for).
The workload is chat requests each opening with one of --groups system prompts (a product's
assistants, each with its long instructions) followed by an MT-Bench question, in shuffled order,
arriving Poisson at --request-rate, then all at once (the prefix caches emptied between). For
each: throughput, TTFT p50/p99, and the prefix-cache hit rate (tokens found cached over tokens
looked up, from the server's /metrics, the replicas' counts summed). Prefix routing should keep
the hit rate near the single process's, which has every prefix in one cache; round robin computes
each prefix once per replica.
"""

from __future__ import annotations

import math
import random
import time
import urllib.request
from dataclasses import dataclass, replace

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, prometheus_samples
from brisk.bench.load import LoadReport, LoadRequest
from brisk.bench.serve import WARMUP, load_settings, measure, write_json
from brisk.bench.workloads import mt_bench_first_turns
from brisk.config import ClusterConfig, ServerConfig

THREADS = 2  # the machine's cores: the single process gets them all, each of the 2 replicas one


def shared_prefix_requests(groups: int, num_requests: int, system_questions: int, output_len: int,
                           seed: int) -> list[LoadRequest]:
    """num_requests chat requests, group g's system prompt (a preamble and `system_questions`
    MT-Bench questions as the assistant's remit) before an MT-Bench question, shuffled."""
    questions = mt_bench_first_turns()
    systems = [f"You are assistant number {g} of the help desk. You answer only within your remit, which "
               f"is the kind of question below, in at most five sentences.\n\n" +
               "\n\n".join(questions[(g * system_questions + i) % len(questions)] for i in range(system_questions))
               for g in range(groups)]
    rng = random.Random(seed)
    requests = [LoadRequest(questions[rng.randrange(len(questions))], output_len, systems[i % groups])
                for i in range(num_requests)]
    rng.shuffle(requests)
    return requests


@dataclass(frozen=True)
class ClusterRun:
    label: str
    report: LoadReport
    prefix_queries: int  # prompt tokens looked up in the prefix cache(s) during the run
    prefix_hits: int  # of them, found there

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def prefix_counters(base_url: str) -> tuple[int, int]:
    """brisk:prefix_cache_queries_total and _hits_total from the server's /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        samples = prometheus_samples(response.read().decode())
    return int(samples["brisk:prefix_cache_queries_total"]), int(samples["brisk:prefix_cache_hits_total"])


def run_one(label: str, flags: list[str], requests: list[LoadRequest], args) -> list[ClusterRun]:
    """The workload at --request-rate, then (the prefix caches emptied) all at once: the
    server's latency under a given load, then its throughput."""
    server = ServerConfig(port=free_port(), log_level="warning")
    runs = []
    with brisk_serve([*flags, *config_flags(server), "--embedding-model", "none"], server,
                     args.startup_timeout) as url:
        measure(url, [WARMUP] * args.warmup, load_settings(args, math.inf), "warm-up", warmup=0)
        for rate in (args.request_rate, math.inf):
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/cache", method="DELETE"), timeout=30).close()
            before = _settled(lambda: prefix_counters(url))
            report = measure(url, requests, load_settings(args, rate), label, warmup=0, progress=not args.no_progress)
            after = _settled(lambda: prefix_counters(url))
            print("\n".join(report.lines()), flush=True)
            runs.append(ClusterRun(label, report, after[0] - before[0], after[1] - before[1]))
    return runs


def _settled(read, seconds: float = 10.0):
    """read() once it stops changing: the ingress replays the replicas' counts twice a second."""
    value, deadline = read(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(1.0)
        newer = read()
        if newer == value:
            break
        value = newer
    return value


def main(args) -> None:
    engine = engine_config_from_args(args)
    requests = shared_prefix_requests(args.groups, args.num_prompts, args.system_questions, args.output_len,
                                      args.workload_seed)
    runs = run_one(f"one process, {THREADS} threads", config_flags(replace(engine, num_threads=THREADS)),
                   requests, args)
    for routing in args.routings:
        flags = [*config_flags(replace(engine, num_threads=1)),
                 *config_flags(ClusterConfig(replicas=THREADS, routing=routing))]
        runs += run_one(f"{THREADS} replicas x 1 thread, {routing.replace('_', ' ')}", flags, requests, args)
    print(f"\n{len(requests)} chat requests, {args.groups} system prompts, {args.output_len} output tokens\n")
    print("| server | arrivals | output tok/s | requests/s | TTFT p50 (ms) | TTFT p99 (ms) | prefix hit rate "
          "| failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        r = run.report
        arrivals = "all at once" if math.isinf(r.request_rate) else f"Poisson {r.request_rate:g}/s"
        print(f"| {run.label} | {arrivals} | {r.output_throughput:.1f} | {r.request_throughput:.2f} | "
              f"{r.metric('ttft_p50_ms'):.0f} | {r.metric('ttft_p99_ms'):.0f} | {run.hit_rate:.1%} | {r.failed} |")
    if args.output_json:
        write_json(args.output_json, {label: [r.report for r in runs if r.label == label]
                                      for label in dict.fromkeys(r.label for r in runs)})
