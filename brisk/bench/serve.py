"""`brisk bench serve`: load a server the way its users would, and report what they would feel.

Against `--base-url` (any OpenAI-compatible server), or, without one, against a `brisk serve`
this command starts with the engine flags given (and stops at the end). The workload is the
MT-Bench first turns, a JSONL file, or random prompts of chosen lengths (brisk/bench/load.py);
arrivals are Poisson at `--request-rate`, or all at once, optionally capped by
`--max-concurrency`. `--sweep-rates` runs the workload once per rate and draws latency against
load (`--plot`). Every run is printed and, with `--output-json`, written as JSON with the
machine and the command.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
import urllib.request
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.load import (Goodput, LoadReport, LoadRequest, LoadSettings, jsonl_requests, mtbench_requests,
                              random_requests, run_load, with_repeats)
from brisk.config import ConfigError, ServerConfig
from brisk.model.loader import open_checkpoint


def workload(args) -> list[LoadRequest]:
    """The requests `--dataset` names, `--num-prompts` of them, `--repeat-fraction` of them
    repeating an earlier one."""
    if args.dataset == "mtbench":
        requests = mtbench_requests(args.num_prompts, args.output_len, args.dataset_path)
    elif args.dataset == "jsonl":
        if not args.dataset_path:
            raise ConfigError("--dataset jsonl needs --dataset-path FILE")
        requests = jsonl_requests(args.dataset_path, args.num_prompts, args.output_len)
    else:
        tokenizer = open_checkpoint(args.tokenizer or args.model).tokenizer
        requests = random_requests(args.num_prompts, args.random_input_len, args.output_len, args.random_range_ratio,
                                   tokenizer, args.workload_seed)
    return with_repeats(requests, args.repeat_fraction, args.workload_seed)


def load_settings(args, request_rate: float) -> LoadSettings:
    """The load flags of a `brisk bench ...` or `brisk optimize` command, checked before any
    server starts."""
    return LoadSettings(endpoint=getattr(args, "endpoint", "chat"), model=getattr(args, "model_name", None),
                        request_rate=request_rate, max_concurrency=args.max_concurrency, seed=args.workload_seed,
                        temperature=args.temperature, ignore_eos=args.ignore_eos,
                        goodput=Goodput.parse(args.goodput or ()), api_key=getattr(args, "api_key", None))


@contextmanager
def target(args) -> Iterator[tuple[str, bool]]:
    """The base URL to load, and whether it is a server of this command's own: --base-url, or
    a `brisk serve` of these engine flags for the block (without an embedding model, which
    generation does not use)."""
    if args.base_url:
        yield args.base_url.rstrip("/"), False
        return
    server = ServerConfig(port=free_port(), log_level="warning")
    flags = [*config_flags(engine_config_from_args(args)), *config_flags(server), "--embedding-model", "none"]
    with brisk_serve(flags, server, args.startup_timeout) as url:
        yield url, True


# The warm-up's question shares nothing with a workload's but the chat template, so it leaves
# no prompt of the workload in the prefix cache.
WARMUP = LoadRequest("Count from one to ten.", 8)


def measure(base_url: str, requests: list[LoadRequest], settings: LoadSettings, label: str, warmup: int = 2,
            progress: bool = False) -> LoadReport:
    """`warmup` short requests (first-call allocations and compilation, outside the figures),
    then the workload."""
    if warmup:
        asyncio.run(run_load(base_url, [WARMUP] * warmup, replace(settings, request_rate=math.inf,
                                                                    goodput=Goodput()), "warm-up", progress=False))
    return asyncio.run(run_load(base_url, requests, settings, label, progress=progress))


def load_runs(base_url: str, own_server: bool, requests: list[LoadRequest], rates: list[float], args,
              label: str) -> list[LoadReport]:
    """One run of the workload per rate, each printed as it ends. On a server of this command's
    own the prefix cache is emptied before each rate, so a rate does not find the prompts the
    one before it left there (another server is loaded as it is)."""
    reports = []
    for rate in rates:
        if own_server:
            request = urllib.request.Request(f"{base_url}/v1/cache", method="DELETE")
            urllib.request.urlopen(request, timeout=30).close()
        report = measure(base_url, requests, load_settings(args, rate), label, args.warmup,
                         progress=not args.no_progress)
        print("\n".join(report.lines()), flush=True)
        reports.append(report)
    return reports


def write_json(path: str, runs: dict[str, list[LoadReport]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"machine": machine(), "command": shlex.join(["brisk", *sys.argv[1:]]),
                   "runs": {name: [r.to_json() for r in reports] for name, reports in runs.items()}}, f, indent=2)


def main(args) -> None:
    requests = workload(args)
    rates = args.sweep_rates or [args.request_rate]
    for rate in rates:
        load_settings(args, rate)  # a bad flag fails here, before a server starts
    print(machine())
    print(f"workload: {len(requests)} {args.dataset} requests, {args.output_len} output tokens "
          f"({'EOS ignored' if args.ignore_eos else 'EOS honoured'}), temperature {args.temperature}")
    label = args.label or ("brisk serve" if not args.base_url else args.base_url)
    with target(args) as (base_url, own_server):
        reports = load_runs(base_url, own_server, requests, rates, args, label)
    if args.output_json:
        write_json(args.output_json, {label: reports})
        print(f"wrote {args.output_json}")
    if args.sweep_rates:
        from brisk.bench.plots import plot_sweep

        shown = ", ".join("inf" if math.isinf(r) else f"{r:g}" for r in rates)
        plot_sweep({label: reports}, args.plot, f"{label}: {len(requests)} {args.dataset} requests at {shown} "
                                                 f"req/s\n{machine()}")
        print(f"wrote {args.plot}")
