"""Prometheus metrics, named as vLLM names them with a `brisk:` prefix.

A StatLogger on the engine: it is fed after every step (and every abort) with what the engine
counted, so each figure comes from the event itself. The registry is per server, not global.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from brisk.embed.batcher import BatchRecord
from brisk.engine.stats import EngineSnapshot, IterationStats

logger = logging.getLogger("brisk.server")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9)


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_loras: int | None = None):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"brisk:{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(f"brisk:{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(f"brisk:{name}", doc, labelnames=list(labels), buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self._success = Counter("brisk:request_success", "Finished requests by finish reason.",
                                labelnames=[*labels, "finished_reason"], registry=r)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify passes that carried draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_position = Counter("brisk:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft (0 = first).",
                                          labelnames=[*labels, "position"], registry=r)
        by_source = {name: Counter(f"brisk:spec_decode_source_{name}", doc, labelnames=[*labels, "source"], registry=r)
                     for name, doc in (("num_drafts", "Verify passes with drafts, by where the drafts came from "
                                                      "(own: the sequence's tokens; past: other requests' outputs; "
                                                      "supplied: the request's draft, e.g. a response-cache candidate)."),
                                       ("num_draft_tokens", "Draft tokens verified, by source."),
                                       ("num_accepted_tokens", "Draft tokens accepted, by source."))}
        self._spec_by_source = [by_source[n] for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")]
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.batch_size = histogram("iteration_batch_size", "Sequences advanced per engine step.", _BATCH_BUCKETS)
        # LoRA adapters (vLLM's lora_requests_info: the adapters of the running and waiting requests
        # as labels, the time of the update as the value), and each adapter's own counts
        self._max_loras = max_loras
        self._lora_info = Gauge("brisk:lora_requests_info", "LoRA adapters of the running and waiting requests "
                                "(labels); the value is when they were last updated.",
                                labelnames=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                                registry=r) if max_loras is not None else None
        self._lora_adapters: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._lora_tokens = Counter("brisk:lora_generation_tokens", "Tokens generated, by LoRA adapter.",
                                    labelnames=[*labels, "lora_name"], registry=r)
        self._lora_success = Counter("brisk:lora_request_success", "Finished requests by LoRA adapter and finish "
                                     "reason.", labelnames=[*labels, "lora_name", "finished_reason"], registry=r)
        self._prefix_seen = (0, 0)  # cumulative (queries, hits) at the last record
        # The embedding model's dynamic batcher (record_embedding_batch)
        self.embedding_inputs = counter("embedding_inputs", "Embedding inputs answered (failed ones included).")
        self.embedding_failed = counter("embedding_failed_inputs", "Embedding inputs answered with an error.")
        self.embedding_tokens = counter("embedding_tokens", "Tokens of embedding inputs.")
        self.embedding_padded_tokens = counter(
            "embedding_padded_tokens", "Positions the embedding batches ran: inputs x each batch's longest.")
        self.embedding_batch_size = histogram("embedding_batch_size", "Inputs per embedding batch.", _BATCH_BUCKETS)
        self.embedding_padding = histogram("embedding_padding_ratio", "Share of each embedding batch's positions that "
                                           "were padding.", _RATIO_BUCKETS)
        self.embedding_queue_time = histogram("embedding_queue_time_seconds", "Arrival of an embedding input to "
                                              "the start of its batch.", _WAIT_BUCKETS)
        self.embedding_batch_time = histogram("embedding_batch_seconds", "Wall time of one embedding batch.",
                                              _WAIT_BUCKETS)
        self.embedding_queue_depth = gauge("embedding_queue_depth", "Embedding inputs waiting for a batch.")

    def watch_response_cache(self, stats: Callable[[], dict]) -> Callable[[str, float], None]:
        """Exposes the response cache's figures (`stats`: ResponseCaching.stats) at each scrape;
        returns the callback that records each hit's latency."""
        labels = self._labels
        hit_seconds = Histogram("brisk:response_cache_hit_seconds", "Time to find a response-cache hit, embedding "
                                "included.", labelnames=[*labels, "kind"], buckets=_WAIT_BUCKETS,
                                registry=self.registry)

        class Collector:
            def collect(self):
                try:
                    s = stats()
                except Exception:  # noqa: BLE001 - a store that cannot answer leaves its figures out, not /metrics
                    logger.exception("the response cache's figures could not be read")
                    return []
                families = []
                for name, doc, by_kind in (("hits", "Requests answered from the response cache.", s["hits"]),
                                           ("misses", "Response-cache lookups that found nothing.", s["misses"])):
                    family = CounterMetricFamily(f"brisk:response_cache_{name}", doc, labels=[*labels, "kind"])
                    for kind, count in by_kind.items():
                        family.add_metric([*labels.values(), kind], count)
                    families.append(family)
                for name, doc, value, kind in (
                        ("guard_rejections", "Semantic candidates over the threshold that the guard refused.",
                         s["guard_rejections"], CounterMetricFamily),
                        ("evictions", "Cached responses dropped by TTL or the size cap.", s["evictions"],
                         CounterMetricFamily),
                        ("errors", "Response-store calls that failed, answered as misses or not stored.",
                         s["errors"], CounterMetricFamily),
                        ("entries", "Cached responses in the store.", s["entries"], GaugeMetricFamily),
                        ("bytes", "Bytes of cached responses in the store.", s["bytes"], GaugeMetricFamily)):
                    if value is None:  # a store that could not say: no figure rather than a made-up one
                        continue
                    family = kind(f"brisk:response_cache_{name}", doc, labels=list(labels))
                    family.add_metric(list(labels.values()), value)
                    families.append(family)
                return families

        self.registry.register(Collector())
        return lambda kind, seconds: hit_seconds.labels(**labels, kind=kind).observe(seconds)

    def watch_tenants(self, usage: Callable[[], dict[str, dict[str, int]]]) -> None:
        """Exposes each tenant's counts at each scrape (`usage`: TenantLedger.usage, tenant ->
        requests, prompt_tokens, generation_tokens, response_cache_hits; its tenants a bounded set)."""
        labels = self._labels
        docs = {"requests": "Generation requests accepted (one per prompt), by tenant.",
                "prompt_tokens": "Prompt tokens of accepted requests (each sequence counted), by tenant.",
                "generation_tokens": "Tokens generated, by tenant.",
                "response_cache_hits": "Requests answered from the response cache, by tenant."}

        class Collector:
            def collect(self):
                counts = usage()
                for name, doc in docs.items():
                    family = CounterMetricFamily(f"brisk:tenant_{name}", doc, labels=[*labels, "tenant"])
                    for tenant, of_tenant in counts.items():
                        family.add_metric([*labels.values(), tenant], of_tenant[name])
                    yield family

        self.registry.register(Collector())

    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.kv_usage.set(snapshot.kv_cache_usage)
        queries, hits = snapshot.prefix_cache_queries, snapshot.prefix_cache_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        self.preemptions.inc(iteration.num_preemptions)
        if iteration.num_sequences:
            self.batch_size.observe(iteration.num_sequences)
        spec = iteration.spec
        if spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted.inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self._spec_per_position.labels(**self._labels, position=str(position)).inc(count)
            for source, counts in spec.by_source.items():
                for metric, value in zip(self._spec_by_source, (counts.num_drafts, counts.num_draft_tokens,
                                                                counts.num_accepted_tokens)):
                    metric.labels(**self._labels, source=source).inc(value)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        self._record_adapters(snapshot, iteration)
        for finished in iteration.finished:
            self._success.labels(**self._labels, finished_reason=finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue.observe(finished.queue_time)

    def _record_adapters(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        for adapter, tokens in iteration.generation_tokens_by_adapter.items():
            self._lora_tokens.labels(**self._labels, lora_name=adapter).inc(tokens)
        for finished in iteration.finished:
            if finished.adapter is not None:
                self._lora_success.labels(**self._labels, lora_name=finished.adapter,
                                          finished_reason=finished.finish_reason).inc()
        adapters = (snapshot.running_adapters, snapshot.waiting_adapters)
        if self._lora_info is not None and adapters != self._lora_adapters:
            if self._lora_adapters is not None:  # one series: the latest sets of adapters
                self._lora_info.remove(*self._labels.values(), str(self._max_loras), *map(",".join, self._lora_adapters))
            self._lora_info.labels(**self._labels, max_lora=str(self._max_loras), running_lora_adapters=",".join(adapters[0]),
                                   waiting_lora_adapters=",".join(adapters[1])).set(time.time())
            self._lora_adapters = adapters

    def record_embedding_batch(self, batch: BatchRecord) -> None:
        self.embedding_inputs.inc(batch.size)
        self.embedding_failed.inc(batch.failed)
        self.embedding_tokens.inc(batch.tokens)
        self.embedding_padded_tokens.inc(batch.padded_tokens)
        self.embedding_batch_size.observe(batch.size)
        self.embedding_padding.observe(1 - batch.tokens / batch.padded_tokens)
        for wait in batch.queue_waits:
            self.embedding_queue_time.observe(wait)
        self.embedding_batch_time.observe(batch.seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
