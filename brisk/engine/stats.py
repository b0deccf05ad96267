"""Engine statistics, counted where things happen and handed to loggers (e.g. Prometheus).

After every step the engine builds an IterationStats (what this step did) and an EngineSnapshot
(queue and cache state now) and passes both to each registered StatLogger. The engine itself
knows nothing of Prometheus; the server plugs a logger in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import numpy as np


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort" or "error" (RequestStatus)
    e2e_latency: float  # arrival -> finished, seconds
    queue_time: float | None  # arrival -> first scheduled; None if it never ran
    num_prompt_tokens: int
    adapter: str | None = None  # its LoRA adapter

    @classmethod
    def at(cls, finish_reason: str, finished: float, arrival: float, first_scheduled: float | None,
           num_prompt_tokens: int, adapter: str | None = None) -> "FinishedRequestStats":
        return cls(finish_reason, finished - arrival, None if first_scheduled is None else first_scheduled - arrival,
                   num_prompt_tokens, adapter)


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts, for one step or one request (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verify passes that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    # the same counts by where the drafts came from (VerifyPlan.source: "own", "past", "supplied"...)
    by_source: dict[str, "SpecDecodeStats"] = field(default_factory=dict)

    def observe(self, num_draft_tokens: int, num_accepted: int, source: str = "") -> None:
        """One verify pass: its first num_accepted drafts were accepted."""
        one = SpecDecodeStats(1, num_draft_tokens, num_accepted, [1] * num_accepted)
        self.add(one)
        if source:
            self.by_source.setdefault(source, SpecDecodeStats()).add(one)

    def add(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        missing = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(missing, 0))
        for i, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += count
        for source, counts in other.by_source.items():
            self.by_source.setdefault(source, SpecDecodeStats()).add(counts)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify pass: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class IterationStats:
    num_sequences: int = 0  # sequences that advanced in this step (the batch size)
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token this step
    num_generation_tokens: int = 0
    generation_tokens_by_adapter: dict[str, int] = field(default_factory=dict)  # of those, LoRA adapters'
    num_preemptions: int = 0
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class EngineSnapshot:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_blocks: int  # blocks whose content the prefix cache can reuse
    prefix_cache_queries: int  # tokens looked up, cumulative
    prefix_cache_hits: int  # tokens served from cache, cumulative
    prefix_cache_evictions: int
    running_adapters: tuple[str, ...] = ()  # LoRA adapters of the running requests
    waiting_adapters: tuple[str, ...] = ()  # and of the waiting ones


def combined_snapshot(live: Sequence[EngineSnapshot], ever: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """Several engines (replicas) as one: the gauges summed over the `live` ones, the cumulative
    counters over every engine `ever` seen (its last snapshot), so a counter never goes back
    when an engine leaves. The KV cache usage is the fraction of all their blocks held."""
    blocks = sum(s.num_kv_blocks for s in live)
    return EngineSnapshot(
        num_running=sum(s.num_running for s in live), num_waiting=sum(s.num_waiting for s in live),
        kv_cache_usage=sum(s.kv_cache_usage * s.num_kv_blocks for s in live) / blocks if blocks else 0.0,
        num_kv_blocks=blocks, num_free_kv_blocks=sum(s.num_free_kv_blocks for s in live),
        num_cached_blocks=sum(s.num_cached_blocks for s in live),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in ever),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in ever),
        prefix_cache_evictions=sum(s.prefix_cache_evictions for s in ever),
        running_adapters=tuple(sorted({a for s in live for a in s.running_adapters})),
        waiting_adapters=tuple(sorted({a for s in live for a in s.waiting_adapters})))


class StatLogger(Protocol):
    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None: ...


@dataclass(frozen=True)
class BatchMetrics:
    """How an offline run used its batches (`LLM.generate(..., batching=...)`): the seeds'
    BatchMetrics, measured on the engine."""

    batching: str  # continuous, static or sorted
    requests: int
    output_tokens: int
    seconds: float
    steps: int  # engine steps that advanced any sequence
    mean_batch_size: float  # sequences advanced per step
    utilization: float  # mean_batch_size over the slots a step has (the group size, or max_num_seqs)
    # Static and sorted groups: the share of the positions a padded batch computes (each row as
    # long as its group's longest prompt plus longest output) that are padding. brisk packs
    # prompts and drops finished rows, so it computes none of them; what a group costs it is the
    # slots its finished rows leave idle until the longest is done. Continuous: 0.
    padding_ratio: float
    mean_latency: float  # seconds from the start of the run to each request's last token

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


class StepSizes:
    """A StatLogger that keeps how many sequences each step advanced."""

    def __init__(self):
        self.sizes: list[int] = []

    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        if iteration.num_sequences:
            self.sizes.append(iteration.num_sequences)


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float]:
    """The qs-quantiles (each 0-1) of values, by linear interpolation between closest ranks
    (numpy's default) over one sort, so p50 <= p90 <= p99 always holds: every latency figure
    brisk reports (server, dashboard, benchmarks) is computed here."""
    array = np.fromiter(values, dtype=float)
    if not array.size:
        raise ValueError("percentiles of no values")
    return [float(v) for v in np.percentile(array, [q * 100 for q in qs])]
