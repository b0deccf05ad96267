"""The load generator (brisk/bench/load.py) against real brisk servers: its figures must be
consistent with each other and with what the server says it did."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest

from brisk.bench.load import (Goodput, LoadReport, LoadRequest, LoadSettings, arrival_times, mtbench_requests,
                              run_load, with_repeats)
from brisk.config import ConfigError

pytestmark = pytest.mark.real_model


def _check_consistent(report: LoadReport, requests: list[LoadRequest]) -> None:
    assert report.completed + report.failed == report.num_requests == len(requests)
    done = [r for r in report.records if r.ok]
    assert len(done) == report.completed
    assert report.output_tokens == sum(r.output_tokens for r in done)
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = report.latency_ms[name]
        assert s is not None, name
        assert 0 <= s.p50 <= s.p90 <= s.p95 <= s.p99, (name, s)
    for r in done:
        assert 0 < r.ttft <= r.e2e
        assert r.tpot is None or r.tpot * (r.output_tokens - 1) <= r.e2e - r.ttft + 1e-9
    assert math.isclose(report.request_throughput, report.completed / report.duration_s)
    assert math.isclose(report.output_throughput, report.output_tokens / report.duration_s)
    if report.input_tokens is not None:  # the server reported usage
        assert report.total_token_throughput == pytest.approx((report.input_tokens + report.output_tokens)
                                                              / report.duration_s)
    if report.goodput is not None:
        assert 0 <= report.goodput <= report.request_throughput
    # the load generator's own CPU time: some (it parsed every chunk), at most all of this host's cores
    assert 0 < report.client_cpu_s <= report.duration_s * os.cpu_count()


def test_figures_add_up_on_the_real_model(base_url):
    requests = mtbench_requests(8, 12)
    report = asyncio.run(run_load(base_url, requests, LoadSettings(request_rate=20.0, seed=3, goodput=Goodput(
        ttft=60_000, tpot=60_000)), progress=False))
    _check_consistent(report, requests)
    assert report.failed == 0 and report.model == "smollm2" and report.input_tokens > 8 * 10
    # ignore_eos: every request generated exactly its max_tokens, as the server's usage says
    assert [r.output_tokens for r in report.records] == [12] * 8
    assert all(r.prompt_tokens > 10 for r in report.records)
    # brisk streams one chunk per token without speculative decoding: an ITL per token after the first
    assert len([gap for r in report.records for gap in r.itls]) == 8 * 11
    assert report.goodput == report.request_throughput  # targets nobody misses
    # a request is sent no earlier than its Poisson arrival
    due = arrival_times(8, 20.0, seed=3)
    assert all(r.sent >= at - 0.01 for r, at in zip(report.records, due))


def test_goodput_counts_only_requests_meeting_every_target(tiny_url):
    requests = [LoadRequest("w5 w6 w7", 4)] * 6
    strict = asyncio.run(run_load(tiny_url, requests, LoadSettings(goodput=Goodput(ttft=0.001)), progress=False))
    _check_consistent(strict, requests)
    assert strict.goodput == 0.0 and strict.goodput_targets == "ttft:0.001"
    loose = asyncio.run(run_load(tiny_url, requests, LoadSettings(goodput=Goodput(ttft=60_000, e2el=60_000)),
                                progress=False))
    assert loose.goodput == loose.request_throughput > 0


def test_max_concurrency_caps_requests_in_flight(tiny_url):
    requests = [LoadRequest("w5 w6", 16)] * 8
    report = asyncio.run(run_load(tiny_url, requests, LoadSettings(max_concurrency=2), progress=False))
    _check_consistent(report, requests)
    events = sorted([(r.sent, 1) for r in report.records] + [(r.sent + r.e2e, -1) for r in report.records])
    in_flight, most = 0, 0
    for _, change in events:
        in_flight += change
        most = max(most, in_flight)
    assert most <= 2


def test_a_failing_request_is_counted_with_its_error(tiny_url, tmp_path):
    path = tmp_path / "load.jsonl"
    path.write_text(json.dumps({"prompt": "w5 w6", "max_tokens": 4}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "w7"}], "max_tokens": 100_000}) + "\n")
    from brisk.bench.load import jsonl_requests

    requests = jsonl_requests(str(path), 4, 8)
    assert [r.max_tokens for r in requests] == [4, 100_000, 4, 100_000]
    report = asyncio.run(run_load(tiny_url, requests, LoadSettings(endpoint="completions"), progress=False))
    assert (report.completed, report.failed) == (2, 2)
    assert report.errors and report.errors[0].startswith("HTTP 400")
    assert report.output_tokens == 8


def test_bad_workload_and_arrival_settings_are_refused(tmp_path):
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    gaps = [b - a for a, b in zip(*(lambda t: (t, t[1:]))(arrival_times(4001, 50.0, seed=1)))]
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002  # exponential gaps of mean 1 / rate
    assert arrival_times(5, 2.0, seed=7) == arrival_times(5, 2.0, seed=7)
    distinct = [LoadRequest(f"q{i}", 4) for i in range(400)]
    repeated = with_repeats(distinct, 0.25, seed=2)
    assert repeated[0] == distinct[0] and len(repeated) == 400
    assert 70 <= sum(r != d for r, d in zip(repeated, distinct)) <= 130  # about a quarter repeat
    assert all(r in repeated[:i] for i, (r, d) in enumerate(zip(repeated, distinct)) if r != d)  # an earlier one
    with pytest.raises(ConfigError, match="repeat fraction"):
        with_repeats(distinct, 1.0)
    with pytest.raises(ConfigError, match="goodput targets"):
        Goodput.parse(["latency:100"])
    with pytest.raises(ConfigError, match="milliseconds"):
        Goodput.parse(["ttft:fast"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    from brisk.bench.load import jsonl_requests

    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        jsonl_requests(str(bad), 1, 8)
    with pytest.raises(ConfigError, match="request rate"):
        LoadSettings(request_rate=0.0)
    with pytest.raises(ConfigError, match="endpoint"):
        LoadSettings(endpoint="embeddings")


def test_bench_serve_sweeps_rates_into_json_and_a_plot(tiny_engine, tiny_url, tmp_path):
    """The command end to end: two rates, random prompts sized by the model's tokenizer."""
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    result = subprocess.run(
        [sys.executable, "-m", "brisk.cli", "bench", "serve", "--base-url", tiny_url, "--dataset", "random",
         "--tokenizer", tiny_engine.engine.config.model, "--random-input-len", "12", "--random-range-ratio", "0.5",
         "--num-prompts", "6", "--output-len", "5", "--sweep-rates", "40", "inf", "--goodput", "ttft:60000",
         "--output-json", str(out), "--plot", str(plot), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    runs = next(iter(data["runs"].values()))
    assert [r["request_rate"] for r in runs] == [40.0, None]  # inf is written as null
    assert [(r["completed"], r["failed"]) for r in runs] == [(6, 0)] * 2, runs
    # the same seeded workload at both rates; output lengths 5 +- 50% each (EOS ignored)
    assert runs[0]["output_tokens"] == runs[1]["output_tokens"]
    assert 6 * 3 <= runs[0]["output_tokens"] <= 6 * 7 and runs[0]["output_tokens"] != 30
    assert data["machine"].startswith("CPU: ")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
