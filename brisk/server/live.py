"""The server's own figures of the last minute, second by second: what /metrics.json answers and
the dashboard (dashboard.html) draws.

A StatLogger beside the Prometheus one, fed after every engine step with the same records.
Prometheus keeps cumulative counters and histograms for a scraper to difference; a page polled
every second wants the recent past instead, so this keeps one bucket per wall-clock second for
the last WINDOW seconds: tokens, finished requests, steps and their batch sizes, the gauges as
the second's last step left them, and every TTFT and inter-token latency observed. A snapshot
fills the seconds no step ran (an idle server) with zero work and the gauges carried forward.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from brisk.engine.stats import EngineSnapshot, IterationStats, percentile

WINDOW = 60  # seconds of history in a snapshot
LATENCY_WINDOW = 10  # seconds of samples behind each point of a latency series


@dataclass
class _Second:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    steps: int = 0
    sequences: int = 0  # summed over the steps: / steps = mean batch size
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    gauges: EngineSnapshot | None = None  # the second's last


class LiveStats:
    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._seconds: deque[tuple[int, _Second]] = deque()
        self._last: EngineSnapshot | None = None
        self._lock = threading.Lock()  # record runs on the engine's thread, snapshot on the event loop
        self.started = clock()

    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        second = int(self._clock())
        with self._lock:
            if not self._seconds or self._seconds[-1][0] != second:
                self._seconds.append((second, _Second()))
                while self._seconds[0][0] <= second - WINDOW:
                    self._seconds.popleft()
            bucket = self._seconds[-1][1]
            bucket.prompt_tokens += iteration.num_prompt_tokens
            bucket.generation_tokens += iteration.num_generation_tokens
            bucket.finished += len(iteration.finished)
            if iteration.num_sequences:
                bucket.steps += 1
                bucket.sequences += iteration.num_sequences
            bucket.ttfts.extend(iteration.time_to_first_tokens)
            bucket.itls.extend(iteration.inter_token_latencies)
            bucket.gauges = self._last = snapshot

    def snapshot(self) -> dict:
        """The last WINDOW whole seconds as series (oldest first, `t` in seconds before now),
        the gauges now, and the latency percentiles over the whole window."""
        now = int(self._clock())
        with self._lock:
            by_second = dict(self._seconds)
            last = self._last
        # The seconds before the first bucket in the window inherit the gauges of nothing: zeros.
        carried = None
        first = now - WINDOW
        for second, bucket in by_second.items():
            if second <= first and bucket.gauges is not None:
                carried = bucket.gauges
        series: dict[str, list] = {name: [] for name in (
            "t", "output_tokens_per_s", "prompt_tokens_per_s", "requests_finished_per_s", "mean_batch_size",
            "running", "waiting", "kv_cache_usage", "prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms")}
        recent: deque[_Second] = deque(maxlen=LATENCY_WINDOW)
        for second in range(first + 1, now + 1):  # the current second is partial; it is shown as it stands
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
            series["prefix_cache_hit_rate"].append(_hit_rate(carried))
            for name, samples in (("ttft", [v for b in recent for v in b.ttfts]),
                                  ("itl", [v for b in recent for v in b.itls])):
                for q in (50, 99):
                    series[f"{name}_p{q}_ms"].append(percentile(samples, q / 100) * 1000 if samples else None)
        window = [b for s, b in by_second.items() if s > first]
        return {
            "window_s": WINDOW,
            "uptime_s": self._clock() - self.started,
            "now": {"running": last.num_running if last else 0, "waiting": last.num_waiting if last else 0,
                    "kv_cache_usage": last.kv_cache_usage if last else 0.0,
                    "prefix_cache_hit_rate": _hit_rate(last)},
            "latency_ms": {name: _summary([v for b in window for v in getattr(b, name + "s")])
                           for name in ("ttft", "itl")},
            "series": series,
        }


def _hit_rate(snapshot: EngineSnapshot | None) -> float:
    """Prompt tokens served from the prefix cache over those looked up, since the start."""
    if snapshot is None or not snapshot.prefix_cache_queries:
        return 0.0
    return snapshot.prefix_cache_hits / snapshot.prefix_cache_queries


def _summary(seconds: list[float]) -> dict:
    if not seconds:
        return {"count": 0, "p50": None, "p90": None, "p99": None}
    return {"count": len(seconds), **{f"p{q}": percentile(seconds, q / 100) * 1000 for q in (50, 90, 99)}}

