"""A load generator for any OpenAI-compatible server: brisk, vLLM, SGLang, llama.cpp's server.

Requests are streamed (SSE) from one aiohttp session, the way a fleet of chat clients would
send them. When each one is sent is decided up front: a Poisson process at `request_rate`
(exponential gaps drawn from a seeded generator, so two runs send the same schedule), or all at
once (rate inf); `max_concurrency` caps how many are in flight, and a request waiting for a
slot is timed from when it is sent, not from when it arrived (as vLLM's benchmark does).

Per request the client records when each content chunk arrived; from those:

- TTFT: sent -> first chunk with content;
- ITL: the gaps between content chunks (one per engine step on brisk; a chunk may carry
  several tokens under speculative decoding, and then the gap covers them all);
- TPOT: (end-to-end - TTFT) / (output tokens - 1), the mean time per token after the first;
- E2EL: sent -> the stream's end.

Output tokens are the server's `usage` figure (stream_options.include_usage) where it sends one,
else the count of content chunks. Goodput is the rate of requests that met every given target
(`ttft:MS tpot:MS e2el:MS`), over the same duration as throughput, so it never exceeds it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import aiohttp
from tqdm import tqdm

from brisk.engine.stats import percentiles
from brisk.bench.workloads import mt_bench_first_turns
from brisk.config import ConfigError
from brisk.model.tokenizer import Message, Tokenizer

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
METRICS = ("ttft", "tpot", "itl", "e2el")  # each reported in ms
STATS = ("mean", "p50", "p90", "p95", "p99")
THROUGHPUTS = ("output_throughput", "request_throughput", "total_token_throughput", "goodput")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LoadRequest:
    """One request of a workload: a user message (sent as the prompt to /v1/completions), the
    most tokens it may generate, and optionally a system prompt before it (chat only)."""

    content: str
    max_tokens: int
    system: str | None = None

    @property
    def messages(self) -> list[Message]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": self.content}]


def mtbench_requests(num: int, max_tokens: int, path: str | None = None) -> list[LoadRequest]:
    """The MT-Bench first turns in file order, repeated past 80."""
    questions = mt_bench_first_turns(path)
    return [LoadRequest(questions[i % len(questions)], max_tokens) for i in range(num)]


def jsonl_requests(path: str, num: int, max_tokens: int) -> list[LoadRequest]:
    """One request per line: {"prompt": "..."} or {"messages": [...]} (the last user turn is
    sent), with an optional "max_tokens" of its own; repeated to `num`."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                content = row["prompt"] if "prompt" in row else next(
                    m["content"] for m in reversed(row["messages"]) if m["role"] == "user")
                requests.append(LoadRequest(str(content), int(row.get("max_tokens", max_tokens))))
            except (ValueError, KeyError, TypeError, StopIteration) as exc:
                raise ConfigError(f"{path}:{number}: expected {{\"prompt\": ...}} or {{\"messages\": [...]}} "
                                  f"with a user turn ({exc!r})") from exc
    if not requests:
        raise ConfigError(f"{path} holds no requests")
    return [requests[i % len(requests)] for i in range(num)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, tokenizer: Tokenizer,
                    seed: int = 0) -> list[LoadRequest]:
    """Prompts of random words, each `input_len` tokens of `tokenizer` give or take
    `range_ratio` (uniform), and as many output tokens likewise: a workload of chosen shape."""
    if not 0 <= range_ratio < 1:
        raise ConfigError(f"random range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    special = set(tokenizer.added_tokens().values())
    words = [w for w in (tokenizer.decode([i]).strip() for i in range(min(tokenizer.vocab_size, 20000)))
             if w.isascii() and w.isalnum() and len(w) > 1 and w not in special]
    if not words:
        raise ConfigError("random prompts need a tokenizer with whole-word tokens; this one has none")

    def length(mean: int) -> int:
        return max(1, rng.randint(round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        target, text = length(input_len), ""
        while True:  # grow by words, then cut to the target length in tokens
            text += " " + " ".join(rng.choice(words) for _ in range(max(1, target // 2)))
            ids = tokenizer.encode(text.strip(), add_special_tokens=False)
            if len(ids) >= target:
                break
        requests.append(LoadRequest(tokenizer.decode(ids[:target]).strip(), length(output_len)))
    return requests


def with_repeats(requests: list[LoadRequest], fraction: float, seed: int = 0) -> list[LoadRequest]:
    """The workload with a seeded `fraction` of its requests (never the first) replaced by an
    earlier request of it: repeated questions, as real traffic has, for caches to find."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"repeat fraction must be in [0, 1), got {fraction}")
    rng = random.Random(seed + 1)
    out = list(requests)
    for i in range(1, len(out)):
        if rng.random() < fraction:
            out[i] = out[rng.randrange(i)]
    return out


@dataclass
class RequestRecord:
    """What the client saw of one request; seconds throughout, `sent` from the run's start."""

    sent: float
    prompt_tokens: int = 0  # the server's usage figure; 0 when it sends none
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Goodput:
    """Service-level targets in ms: a request counts towards goodput when it meets all of them."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, items: Iterable[str]) -> "Goodput":
        """["ttft:500", "tpot:50"] -> Goodput(ttft=500, tpot=50)."""
        targets = {}
        for item in items:
            name, _, value = item.partition(":")
            if name not in SLO_METRICS:
                raise ConfigError(f"goodput targets are {', '.join(m + ':MS' for m in SLO_METRICS)}, got {item!r}")
            try:
                targets[name] = float(value)
            except ValueError as exc:
                raise ConfigError(f"goodput target {item!r}: the value must be milliseconds") from exc
            if not targets[name] > 0:
                raise ConfigError(f"goodput target {item!r} must be > 0")
        return cls(**targets)

    @property
    def given(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def met(self, record: RequestRecord) -> bool:
        seconds = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2e}
        return record.ok and all(limit is None or (seconds[name] is not None and seconds[name] * 1000 <= limit)
                                 for name, limit in asdict(self).items())

    def __str__(self) -> str:
        return " ".join(f"{name}:{limit:g}" for name, limit in asdict(self).items() if limit is not None)


@dataclass(frozen=True)
class Summary:
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Summary | None":
        if not values:
            return None
        return cls(sum(values) / len(values), *percentiles(values, (0.5, 0.9, 0.95, 0.99)))


@dataclass
class LoadReport:
    """A run's figures, as printed and as written to JSON (`asdict`)."""

    label: str
    base_url: str
    model: str
    endpoint: str
    request_rate: float  # requests/s of the Poisson arrivals; inf: all at once
    max_concurrency: int | None
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int | None  # None: the server sent no usage, so prompts were not counted
    output_tokens: int
    request_throughput: float
    output_throughput: float  # output tokens/s
    total_token_throughput: float | None  # (input + output) tokens/s
    latency_ms: dict[str, Summary | None]  # METRICS -> summary over completed requests
    # CPU seconds this process (the load generator: its HTTP client, SSE parsing, bookkeeping) spent
    # during the run. On a machine the server shares, they are taken from the server's cores.
    client_cpu_s: float | None = None
    goodput: float | None = None  # requests/s meeting every target
    goodput_targets: str | None = None
    errors: list[str] = field(default_factory=list)  # the first few distinct ones
    records: list[RequestRecord] = field(default_factory=list, repr=False)  # per request; not in to_json

    @classmethod
    def of(cls, records: list[RequestRecord], duration: float, goodput: Goodput, **run) -> "LoadReport":
        done = [r for r in records if r.ok]
        per_metric = {"ttft": [r.ttft for r in done if r.ttft is not None],
                      "tpot": [r.tpot for r in done if r.tpot is not None],
                      "itl": [gap for r in done for gap in r.itls],
                      "e2el": [r.e2e for r in done]}
        outputs = sum(r.output_tokens for r in done)
        inputs = sum(r.prompt_tokens for r in done) if all(r.prompt_tokens for r in done) else None
        errors = list(dict.fromkeys(r.error for r in records if not r.ok))[:5]
        return cls(
            **run, num_requests=len(records), completed=len(done), failed=len(records) - len(done),
            duration_s=duration, input_tokens=inputs, output_tokens=outputs,
            request_throughput=len(done) / duration, output_throughput=outputs / duration,
            total_token_throughput=None if inputs is None else (inputs + outputs) / duration,
            latency_ms={name: Summary.of([v * 1000 for v in values]) for name, values in per_metric.items()},
            goodput=sum(goodput.met(r) for r in done) / duration if goodput.given else None,
            goodput_targets=str(goodput) if goodput.given else None, errors=errors, records=records)

    def to_json(self) -> dict:
        out = asdict(self)
        del out["records"]
        out["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate  # JSON has no inf
        return out

    @classmethod
    def from_json(cls, data: dict) -> "LoadReport":
        latency = {name: None if s is None else Summary(**s) for name, s in data["latency_ms"].items()}
        rate = math.inf if data["request_rate"] is None else data["request_rate"]
        return cls(**{**data, "latency_ms": latency, "request_rate": rate})

    def metric(self, name: str) -> float | None:
        """A figure by name: `ttft_p95_ms` (any of METRICS with mean/p50/p90/p95/p99), or one of
        the throughputs (`output_throughput`, `request_throughput`, `total_token_throughput`,
        `goodput`). None where the run has no such figure (no completed request)."""
        if name in THROUGHPUTS:
            return getattr(self, name)
        metric, stat = latency_figure(name)
        summary = self.latency_ms[metric]
        return None if summary is None else getattr(summary, stat)


    def lines(self) -> list[str]:
        """The report as a terminal would show it."""
        rate = "all at once" if math.isinf(self.request_rate) else f"Poisson, {self.request_rate:g} req/s"
        lines = [f"{self.label}: {self.base_url} ({self.model}, {self.endpoint}); arrivals {rate}"
                 + (f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""),
                 f"  requests: {self.completed} completed, {self.failed} failed, in {self.duration_s:.2f} s",
                 f"  throughput: {self.request_throughput:.2f} req/s, {self.output_throughput:.1f} output tok/s, "
                 + (f"{self.total_token_throughput:.1f} total tok/s" if self.total_token_throughput is not None
                    else "prompt tokens not reported by the server")]
        if self.client_cpu_s is not None:
            lines.append(f"  load generator: {self.client_cpu_s:.1f} CPU s ({self.client_cpu_s / self.duration_s:.0%} of "
                         f"one core over the run)")
        if self.goodput is not None:
            lines.append(f"  goodput ({self.goodput_targets}): {self.goodput:.2f} req/s")
        for name in METRICS:
            s = self.latency_ms[name]
            if s is not None:
                lines.append(f"  {name.upper():5s} ms: mean {s.mean:8.1f}  p50 {s.p50:8.1f}  p90 {s.p90:8.1f}  "
                             f"p95 {s.p95:8.1f}  p99 {s.p99:8.1f}")
        lines += [f"  error: {e}" for e in self.errors]
        return lines


def latency_figure(name: str) -> tuple[str, str]:
    """`ttft_p95_ms` -> ("ttft", "p95"), or a ConfigError naming the figures there are."""
    metric, _, rest = name.partition("_")
    stat = rest.removesuffix("_ms")
    if metric not in METRICS or stat not in STATS or not rest.endswith("_ms"):
        raise ConfigError(f"unknown figure {name!r}: use METRIC_STAT_ms (METRIC: {', '.join(METRICS)}; STAT: "
                          f"{', '.join(STATS)}) or one of {', '.join(THROUGHPUTS)}")
    return metric, stat


def arrival_times(count: int, request_rate: float, seed: int = 0) -> list[float]:
    """When each request is due, in seconds from the start: a Poisson process at request_rate
    (exponential gaps, the first request at 0), or all at 0 for rate inf."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, at = [], 0.0
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(request_rate)
    return times


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists (what a request names when the user names none)."""
    async with session.get(f"{base_url}/v1/models") as response:
        if response.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered {response.status}: {(await response.text())[:200]}")
        return (await response.json())["data"][0]["id"]


@dataclass(frozen=True)
class LoadSettings:
    """How a workload is sent, beside the requests themselves."""

    endpoint: str = "chat"  # ENDPOINTS
    model: str | None = None  # the id requests name; None: the server's first
    request_rate: float = math.inf  # Poisson arrivals per second; inf: all at once
    max_concurrency: int | None = None
    seed: int = 0  # of the arrivals
    temperature: float = 0.0
    ignore_eos: bool = True
    goodput: Goodput = Goodput()
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ConfigError(f"request rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"max concurrency must be >= 1, got {self.max_concurrency}")


async def run_load(base_url: str, requests: list[LoadRequest], settings: LoadSettings = LoadSettings(),
                   label: str = "load", progress: bool = True) -> LoadReport:
    """Sends `requests` to the server at `base_url` on the arrival schedule and returns the figures."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    arrivals = arrival_times(len(requests), settings.request_rate, settings.seed)
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    # No pool limit: concurrency is the schedule's and the semaphore's to decide, not the client's.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = settings.model or await served_model(session, base_url)
        bar = tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False)
        start, cpu_start = time.perf_counter(), time.process_time()

        async def one(request: LoadRequest, arrival: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            if slots is None:
                record = await _send(session, base_url, model, request, settings, start)
            else:
                async with slots:
                    record = await _send(session, base_url, model, request, settings, start)
            bar.update()
            return record

        records = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals)))
        duration, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        bar.close()
    return LoadReport.of(records, duration, settings.goodput, client_cpu_s=client_cpu, label=label, base_url=base_url,
                         model=model, endpoint=settings.endpoint, request_rate=settings.request_rate,
                         max_concurrency=settings.max_concurrency)


async def _send(session: aiohttp.ClientSession, base_url: str, model: str, request: LoadRequest,
                settings: LoadSettings, run_start: float) -> RequestRecord:
    body: dict = {"model": model, "max_tokens": request.max_tokens, "temperature": settings.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, which brisk, SGLang and llama.cpp's server share
    endpoint = settings.endpoint
    if endpoint == "chat":
        body["messages"] = request.messages
    else:
        body["prompt"] = request.content
    sent = time.perf_counter()
    record = RequestRecord(sent=sent - run_start)
    arrivals = []
    try:
        async with session.post(base_url + ENDPOINTS[endpoint], json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return record
                if any(_has_content(choice) for choice in chunk.get("choices") or ()):
                    arrivals.append(time.perf_counter())
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                    record.output_tokens = chunk["usage"].get("completion_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    record.e2e = time.perf_counter() - sent
    if not arrivals:
        record.error = "the stream ended without content"
        return record
    record.ttft = arrivals[0] - sent
    record.itls = [b - a for a, b in zip(arrivals, arrivals[1:])]
    record.output_tokens = record.output_tokens or len(arrivals)
    return record


def _has_content(choice: dict) -> bool:
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
