"""The response cache in the request path (brisk/cache/ does the caching itself).

A route describes its request as a Cacheable (what must match exactly, what may match by
meaning, whether the output is deterministic), asks `lookup`, and either answers from the hit
or runs the model and hands the answer to `CacheLookup.save`, which commits it before the
response goes out: an answer a client received is in the store, even if the server is killed
right after (SIGKILL), unless the store failed (that is logged, and the client still gets its
answer).

Who may be served from the cache:
  - deterministic requests (a temperature the sampler runs greedy, top_k 1 or a seed), or any
    request with "cache": true;
  - not with "cache": false or `Cache-Control: no-store` (neither read nor stored), and not read
    with `Cache-Control: no-cache` (the fresh answer replaces the cached one).
Requests that ask about their own tokens (logprobs, top_logprobs, echo, prompt_logprobs) match
exactly or not at all: an answer stored for another wording holds that wording's tokens.
The response header X-Brisk-Cache says what happened: exact, semantic (with
X-Brisk-Cache-Similarity), verified, miss, or bypass.

Verified semantic hits (`--cache-verify`, or a request's "cache_verify"): a semantic candidate
is not served but handed to the model as a draft of the answer. The model checks it in one
verify pass, keeps the longest prefix it agrees with and decodes on from there (speculative
decoding's exact rule, brisk/spec/verify.py), so the answer is the model's own to the new
question, however alike the two questions only look; the lexical guard, which refuses
candidates to keep unverified hits safe, stands aside. A request about its own tokens
(logprobs) may then match by meaning too: the model computes them. Such a request runs as a miss
would (its answer is stored for its own wording), with X-Brisk-Cache: verified and, when it does
not stream, X-Brisk-Cache-Accepted: the share of the draft the model kept. Only one completion
of a single prompt without an output constraint is verified; others miss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from fastapi import Request

from brisk.cache.keys import CacheQuery, canonical
from brisk.cache.response_cache import Hit, ResponseCache
from brisk.config import ConfigError, ResponseCacheConfig
from brisk.embed.embedder import Embedder
from brisk.engine.output import RequestOutput
from brisk.engine.stats import percentiles
from brisk.sample.params import GREEDY_TEMPERATURE
from brisk.server.errors import APIError
from brisk.server.middleware import DEFAULT_TENANT, Caller
from brisk.server.protocol import SamplingFields

logger = logging.getLogger("brisk.server")

CACHE_HEADER = "X-Brisk-Cache"
SIMILARITY_HEADER = "X-Brisk-Cache-Similarity"
ACCEPTED_HEADER = "X-Brisk-Cache-Accepted"
# Request fields that change neither the output nor its shape once streaming is undone (a
# cached answer is re-streamed), or that are the cache's own controls.
NOT_IN_KEY = frozenset({"model", "stream", "stream_options", "user", "metadata", "store", "service_tier", "cache",
                        "cache_similarity_threshold", "cache_verify"})
# Request fields that ask about the request's own tokens: set, they make it exact-only.
TOKEN_FIELDS = ("logprobs", "top_logprobs", "echo", "prompt_logprobs")


@dataclass(frozen=True)
class Cacheable:
    """A request as the cache sees it (see keys.CacheQuery)."""

    route: str
    params: dict[str, Any]  # every field that changes the output
    context: Any  # what comes before `text` and must match exactly (earlier turns)
    text: str  # what may match by meaning
    semantic: bool  # whether `text` may be matched by meaning (a user message or a text prompt)
    deterministic: bool
    opt: bool | None  # the request's "cache" field
    threshold: float | None  # the request's own similarity threshold
    verify: bool | None = None  # its "cache_verify" (None: the server's); False where it cannot be one draft
    adapter: str = ""  # the LoRA adapter's identity (AdapterInfo.identity), "" for the base model


def caller(http: Request) -> Caller:
    return getattr(http.state, "caller", None) or Caller(DEFAULT_TENANT, admin=True)


@dataclass(frozen=True)
class CacheLookup:
    status: str  # "exact", "semantic", "verified", "miss", "bypass", or "off" (no cache on this server)
    hit: Hit | None = None
    query: CacheQuery | None = None
    vector: np.ndarray | None = None  # the query's, stored with the answer
    save_to: ResponseCaching | None = None  # set when the answer is to be stored

    @property
    def headers(self) -> dict[str, str]:
        if self.status == "off":
            return {}
        headers = {CACHE_HEADER: self.status}
        if self.hit is not None and self.hit.kind == "semantic":
            headers[SIMILARITY_HEADER] = f"{self.hit.similarity:.4f}"
        return headers

    @property
    def served(self) -> bool:
        """Whether the response is the cached one (a verified hit runs the model)."""
        return self.hit is not None and self.status != "verified"

    def accepted_headers(self, draft: tuple[int, ...], output: list[int]) -> dict[str, str]:
        """The headers with, for a verified hit, the share of its draft the model's output kept."""
        if self.status != "verified" or not draft:
            return self.headers
        kept = next((i for i, (a, b) in enumerate(zip(draft, output)) if a != b), min(len(draft), len(output)))
        return {**self.headers, ACCEPTED_HEADER: f"{kept / len(draft):.2f}"}

    async def save(self, response: dict) -> None:
        """Stores the answer; a failure is logged, and the client gets its answer all the same."""
        if self.save_to is None:
            return
        try:
            await asyncio.to_thread(self.save_to.cache.save, self.query, self.vector, response)
        except Exception:  # noqa: BLE001 - a cache that cannot store costs hits, not answers
            logger.exception("could not store a response in the response cache")


BYPASS, OFF = CacheLookup("bypass"), CacheLookup("off")


def worth_storing(finals: list[RequestOutput]) -> bool:
    """Every completion ended by itself (not aborted, not cut off by a departed client, not a
    broken output constraint)."""
    return all(f.finished and all(c.finish_reason not in (None, "abort", "error") for c in f.outputs) for f in finals)


async def lookup(caching: ResponseCaching | None, http: Request, request: Cacheable | None) -> CacheLookup:
    """The route's lookup, on a server with or without a response cache."""
    return OFF if caching is None else await caching.lookup(http, request)


def model_scope(served_name: str, identity: str) -> dict[str, str]:
    """What every key of a server shares: a cached answer is this model's (ModelInfo.identity),
    under the name its responses report."""
    return {"served": served_name, "identity": identity}


def cache_query(model: dict[str, str], tenant: str, request: Cacheable, threshold: float,
                space: str = "", verify: bool = False) -> CacheQuery:
    """The query `request` is looked up and stored under (threshold: the server's default;
    space: the embedder's identity; verify: a semantic hit is to be verified). Its params are
    keyed as the sampler runs them (a greedy temperature as 0), and a request about its own
    tokens is matched exactly only, unless its hits are verified."""
    params = request.params
    if greedy(params.get("temperature")):
        params = {**params, "temperature": 0.0}
    about_tokens = any(params.get(name) is not None and params.get(name) is not False  # logprobs 0 asks too
                       for name in TOKEN_FIELDS)
    if request.adapter:  # an adapter is another model: its answers are its own
        model = {**model, "adapter": request.adapter}
    return CacheQuery(tenant=tenant, scope=canonical([model, request.route, params, request.context]),
                      text=request.text, semantic=request.semantic and (verify or not about_tokens),
                      threshold=request.threshold or threshold, space=space, verify=verify)


class ResponseCaching:
    """The cache, the scope every key shares (model_scope), and the embedder for semantic lookups."""

    def __init__(self, cache: ResponseCache, config: ResponseCacheConfig, model: dict[str, Any],
                 embedder: Embedder | None,
                 on_hit: Callable[[str, float, str], None] = lambda kind, seconds, tenant: None,
                 verifies_drafts: bool = False):
        """on_hit(kind, seconds, tenant): each hit, for the metrics; verifies_drafts: whether the
        engine verifies a request's draft (speculative decoding is on), which verified hits need."""
        if config.cache_verify and not verifies_drafts:
            raise ConfigError("cache_verify needs speculative decoding to verify cached answers: start with "
                              "--speculative-config '{\"method\": \"suffix\"}' (or another method)")
        self.cache, self.config, self.model, self.on_hit = cache, config, model, on_hit
        self.verifies_drafts = verifies_drafts
        self.embedder = embedder if config.cache_semantic else None
        self.space = self.embedder.identity if self.embedder is not None else ""

    async def lookup(self, http: Request, request: Cacheable | None) -> CacheLookup:
        start = time.perf_counter()
        no_cache = {d.strip().lower() for d in http.headers.get("cache-control", "").split(",")}
        if request is None or request.opt is False or "no-store" in no_cache \
                or not (request.deterministic or request.opt):
            return BYPASS
        tenant = caller(http).tenant
        if request.verify and not self.verifies_drafts:
            raise APIError(400, "cache_verify needs a server started with speculative decoding (--speculative-config).",
                           param="cache_verify")
        verify = self.config.cache_verify if request.verify is None else request.verify
        query = cache_query(self.model, tenant, request, self.config.cache_similarity_threshold, self.space, verify)
        try:
            hit, vector = await self._find(query, read="no-cache" not in no_cache)
        except Exception:  # noqa: BLE001 - a store or embedder that fails costs a model run, not the request
            logger.exception("the response cache lookup failed; answering without it")
            return CacheLookup("miss", query=query, save_to=self)
        if hit is None:
            return CacheLookup("miss", query=query, vector=vector, save_to=self)
        seconds = time.perf_counter() - start
        self.on_hit(hit.kind, seconds, tenant)
        asyncio.get_running_loop().run_in_executor(None, self._served, hit, seconds)  # the LRU write, off the path
        if verify and hit.kind == "semantic":  # the model runs, and its answer is stored for this wording
            return CacheLookup("verified", hit=hit, query=query, vector=vector, save_to=self)
        return CacheLookup(hit.kind, hit=hit, query=query)

    async def _find(self, query: CacheQuery, read: bool) -> tuple[Hit | None, np.ndarray | None]:
        """The hit (None without `read`, i.e. Cache-Control: no-cache), and the query's vector
        when it was embedded. A local store's exact lookup runs here, on the event loop: one
        indexed read, where the hop to a worker thread and back took longer than the read and
        put this machine's exact hits at 8 ms p99 instead of 5. A network store's, and the
        semantic lookup (it embeds), run on a worker thread."""
        if read:
            hit = self.cache.lookup_exact(query) if self.cache.store.local else \
                await asyncio.to_thread(self.cache.lookup_exact, query)
            if hit is not None:
                return hit, None
        embed = self._embed if self.embedder is not None else None
        if not read:
            return None, (await asyncio.to_thread(embed, query.text) if embed and query.semantic else None)
        return await asyncio.to_thread(self.cache.lookup_by_meaning, query, embed)

    def _served(self, hit: Hit, seconds: float) -> None:
        try:
            self.cache.served(hit, seconds)
        except Exception:  # noqa: BLE001 - the LRU order is a hint; losing one update is harmless
            logger.exception("could not mark a response-cache entry as used")

    def _embed(self, text: str) -> np.ndarray | None:
        """The text's unit vector; None when it is longer than the embedder reads (a vector of
        its start would match other texts with the same start). Normalized here whether or not
        the model's own pipeline normalizes: the index compares by dot product."""
        [ids] = self.embedder.tokenize([text], True)
        if len(ids) >= self.embedder.max_length:
            return None
        vector = self.embedder.encode([ids])[0].numpy()
        return vector / np.linalg.norm(vector)

    def stats(self) -> dict:
        """/v1/cache/stats' response_cache: the store's contents and this process's counts."""
        store, c = self.cache.store.stats(), self.cache.counters
        return {"enabled": True, "store": self.config.url.split(":", 1)[0], "semantic": self.embedder is not None,
                "similarity_threshold": self.config.cache_similarity_threshold,
                "ttl_seconds": self.config.cache_ttl_seconds, "max_entries": self.config.cache_max_entries,
                "entries": store.entries, "bytes": store.bytes,
                "hits": {"exact": c.exact_hits, "semantic": c.semantic_hits},
                "misses": {"exact": c.exact_misses, "semantic": c.semantic_misses},
                "guard_rejections": c.guard_rejections, "stores": c.stores, "evictions": c.evictions,
                "errors": c.errors,
                "hit_latency_ms": {kind: _percentiles(samples) for kind, samples in c.hit_seconds.items()}}

    async def close(self) -> None:
        await asyncio.to_thread(self.cache.close)


def _percentiles(seconds) -> dict[str, float | None]:
    if not seconds:
        return {"p50": None, "p99": None, "count": 0}
    p50, p99 = percentiles(seconds, (0.5, 0.99))
    return {"p50": round(p50 * 1000, 3), "p99": round(p99 * 1000, 3), "count": len(seconds)}


def greedy(temperature: float | None) -> bool:
    """Whether the sampler runs `temperature` greedy: SamplingParams turns one under
    GREEDY_TEMPERATURE into 0 (a negative one is refused there, never served from here)."""
    return temperature is not None and 0.0 <= temperature < GREEDY_TEMPERATURE


def deterministic(body: SamplingFields) -> bool:
    return greedy(body.temperature) or body.top_k == 1 or body.seed is not None


def fields(body: SamplingFields, *exclude: str) -> dict[str, Any]:
    """The body's fields that go into the key: all but NOT_IN_KEY and `exclude`."""
    return body.model_dump(exclude=NOT_IN_KEY | set(exclude), by_alias=True)
