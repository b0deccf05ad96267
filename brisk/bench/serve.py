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
from contextlib import contextmanager, nullcontext
from typing import Iterator

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.load import (Goodput, LoadReport, LoadRequest, jsonl_requests, mtbench_requests, random_requests,
                              run_load)
from brisk.config import ConfigError, ServerConfig
from brisk.model.loader import open_checkpoint


def workload(args) -> list[LoadRequest]:
    """The requests `--dataset` names, `--num-prompts` of them."""
    if args.dataset == "mtbench":
        return mtbench_requests(args.num_prompts, args.output_len, args.dataset_path)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ConfigError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_requests(args.dataset_path, args.num_prompts, args.output_len)
    tokenizer = open_checkpoint(args.tokenizer or args.model).tokenizer
    return random_requests(args.num_prompts, args.random_input_len, args.output_len, args.random_range_ratio,
                           tokenizer, args.workload_seed)


@contextmanager
def target(args) -> Iterator[str]:
    """The base URL to load: --base-url, or a `brisk serve` of these engine flags for the block."""
    if args.base_url:
        with nullcontext(args.base_url.rstrip("/")) as url:
            yield url
        return
    server = ServerConfig(port=free_port(), log_level="warning")
    with brisk_serve([*config_flags(engine_config_from_args(args)), *config_flags(server)], server,
                     args.startup_timeout) as url:
        yield url


def measure(base_url: str, requests: list[LoadRequest], args, label: str, rate: float,
            progress: bool = False) -> LoadReport:
    """A warm-up of `--warmup` short requests (first-call allocations and compilation, outside
    the figures), then the workload at `rate` with the load flags of `args`."""
    options = dict(model=getattr(args, "model_name", None), endpoint=getattr(args, "endpoint", "chat"),
                   max_concurrency=args.max_concurrency, seed=args.workload_seed, temperature=args.temperature,
                   ignore_eos=args.ignore_eos, api_key=getattr(args, "api_key", None))
    if args.warmup:
        warm = [LoadRequest(r.content, min(r.max_tokens, 8)) for r in requests[:args.warmup]]
        asyncio.run(run_load(base_url, warm, **options, label="warm-up", progress=False))
    return asyncio.run(run_load(base_url, requests, **options, request_rate=rate, label=label, progress=progress,
                                goodput=Goodput.parse(args.goodput or ())))


def load_runs(base_url: str, requests: list[LoadRequest], rates: list[float], args, label: str) -> list[LoadReport]:
    """One run of the workload per rate, each printed as it ends."""
    reports = []
    for rate in rates:
        report = measure(base_url, requests, args, label, rate, progress=not args.no_progress)
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
    print(machine())
    print(f"workload: {len(requests)} {args.dataset} requests, {args.output_len} output tokens "
          f"({'EOS ignored' if args.ignore_eos else 'EOS honoured'}), temperature {args.temperature}")
    label = args.label or ("brisk serve" if not args.base_url else args.base_url)
    with target(args) as base_url:
        reports = load_runs(base_url, requests, rates, args, label)
    if args.output_json:
        write_json(args.output_json, {label: reports})
        print(f"wrote {args.output_json}")
    if args.sweep_rates:
        from brisk.bench.plots import plot_sweep

        shown = ", ".join("inf" if math.isinf(r) else f"{r:g}" for r in rates)
        plot_sweep({label: reports}, args.plot, f"{label}: {len(requests)} {args.dataset} requests at {shown} "
                                                 f"req/s\n{machine()}")
        print(f"wrote {args.plot}")
