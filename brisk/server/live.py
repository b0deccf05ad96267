"""The server's own figures of the last minute, second by second: what /metrics.json answers and
the dashboard (dashboard.html) draws.

A StatLogger beside the Prometheus one, fed after every engine step with the same records.
Prometheus keeps cumulative counters and histograms for a scraper to difference; a page polled
every second wants the recent past instead, so this keeps one bucket per wall-clock second:
tokens, finished requests, steps and their batch sizes, prefix-cache lookups, the gauges as the
second's last step left them, and every TTFT and inter-token latency observed. A snapshot
covers the last WINDOW whole seconds (the second under way is left out until it is whole);
seconds in which no step ran (an idle server) count zero work, and the gauges carry over from
the last step before them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from brisk.engine.stats import EngineSnapshot, IterationStats, percentiles

WINDOW = 60  # whole seconds in a snapshot
LATENCY_WINDOW = 10  # seconds of samples behind each point of a latency series (fewer at the window's start)


@dataclass
class _Second:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    steps: int = 0
    sequences: int = 0  # summed over the steps: / steps = mean batch size
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache during the second
    prefix_hits: int = 0
    draft_tokens: int = 0  # speculative drafts verified during the second
    accepted_tokens: int = 0  # of those, accepted
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    gauges: EngineSnapshot | None = None  # the second's last


class LiveStats:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._seconds: deque[tuple[int, _Second]] = deque()
        self._expired: EngineSnapshot | None = None  # the gauges of the newest bucket dropped from the deque
        self._last: EngineSnapshot | None = None
        self._lock = threading.Lock()  # record runs on the engine's thread, snapshot on the event loop
        self._cached: tuple[int, dict] | None = None  # one snapshot per second, however many pages poll
        self._drafted = self._accepted = 0  # speculative decoding's draft tokens since start, and accepted
        self.started = clock()

    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        second = int(self._clock())
        with self._lock:
            if not self._seconds or self._seconds[-1][0] != second:
                self._seconds.append((second, _Second()))
                while self._seconds[0][0] <= second - WINDOW - 1:
                    self._expired = self._seconds.popleft()[1].gauges or self._expired
            bucket = self._seconds[-1][1]
            bucket.prompt_tokens += iteration.num_prompt_tokens
            bucket.generation_tokens += iteration.num_generation_tokens
            bucket.finished += len(iteration.finished)
            if iteration.num_sequences:
                bucket.steps += 1
                bucket.sequences += iteration.num_sequences
            if self._last is not None:  # the snapshot's prefix figures are cumulative
                bucket.prefix_queries += snapshot.prefix_cache_queries - self._last.prefix_cache_queries
                bucket.prefix_hits += snapshot.prefix_cache_hits - self._last.prefix_cache_hits
            bucket.draft_tokens += iteration.spec.num_draft_tokens
            bucket.accepted_tokens += iteration.spec.num_accepted_tokens
            self._drafted += iteration.spec.num_draft_tokens
            self._accepted += iteration.spec.num_accepted_tokens
            bucket.ttfts.extend(iteration.time_to_first_tokens)
            bucket.itls.extend(iteration.inter_token_latencies)
            bucket.gauges = self._last = snapshot

    def snapshot(self) -> dict:
        """The last WINDOW whole seconds as series (oldest first; `t`: seconds before the
        current one), the gauges now, and latency percentiles over the window."""
        now = int(self._clock())
        if self._cached is not None and self._cached[0] == now:
            return self._cached[1]
        with self._lock:  # copies: record() goes on filling the current bucket meanwhile
            by_second = {s: replace(b, ttfts=list(b.ttfts), itls=list(b.itls)) for s, b in self._seconds}
            carried, last, drafted, accepted = self._expired, self._last, self._drafted, self._accepted
        first = now - WINDOW
        for second, bucket in by_second.items():  # the gauges standing when the window opens
            if second < first and bucket.gauges is not None:
                carried = bucket.gauges
        series: dict[str, list] = {name: [] for name in (
            "t", "output_tokens_per_s", "prompt_tokens_per_s", "requests_finished_per_s", "mean_batch_size",
            "running", "waiting", "kv_cache_usage", "prefix_cache_hit_rate", "spec_acceptance_rate", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
        recent: deque[_Second] = deque(maxlen=LATENCY_WINDOW)
        for second in range(first, now):
            bucket = by_second.get(second, _Second())
            carried = bucket.gauges or carried
            recent.append(bucket)
            series["t"].append(second - now)
            series["output_tokens_per_s"].append(bucket.generation_tokens)
            series["prompt_tokens_per_s"].append(bucket.prompt_tokens)
            series["requests_finished_per_s"].append(bucket.finished)
            series["mean_batch_size"].append(bucket.sequences / bucket.steps if bucket.steps else 0.0)
            series["running"].append(carried.num_running if carried else 0)
            series["waiting"].append(carried.num_waiting if carried else 0)
            series["kv_cache_usage"].append(carried.kv_cache_usage if carried else 0.0)
            series["prefix_cache_hit_rate"].append(
                bucket.prefix_hits / bucket.prefix_queries if bucket.prefix_queries else None)
            series["spec_acceptance_rate"].append(
                bucket.accepted_tokens / bucket.draft_tokens if bucket.draft_tokens else None)
            for name in ("ttft", "itl"):
                p50, p99 = _ms([v for b in recent for v in getattr(b, name + "s")], (0.5, 0.99))
                series[f"{name}_p50_ms"].append(p50)
                series[f"{name}_p99_ms"].append(p99)
        window = [b for s, b in by_second.items() if first <= s < now]
        snap = {
            "window_s": WINDOW,
            "uptime_s": self._clock() - self.started,
            "now": {"running": last.num_running if last else 0, "waiting": last.num_waiting if last else 0,
                    "kv_cache_usage": last.kv_cache_usage if last else 0.0,
                    "prefix_cache_hit_rate": (last.prefix_cache_hits / last.prefix_cache_queries
                                              if last and last.prefix_cache_queries else 0.0),
                    # draft tokens accepted over verified, since start (None: nothing drafted yet)
                    "spec_acceptance_rate": accepted / drafted if drafted else None},
            "latency_ms": {name: _summary([v for b in window for v in getattr(b, name + "s")])
                           for name in ("ttft", "itl")},
            "series": series,
        }
        self._cached = (now, snap)
        return snap


def _ms(seconds: list[float], qs: tuple[float, ...]) -> list[float | None]:
    """The qs-quantiles of `seconds` in ms; None each where there are none."""
    if not seconds:
        return [None] * len(qs)
    return [v * 1000 for v in percentiles(seconds, qs)]


def _summary(seconds: list[float]) -> dict:
    p50, p90, p99 = _ms(seconds, (0.5, 0.9, 0.99))
    return {"count": len(seconds), "p50": p50, "p90": p90, "p99": p99}
