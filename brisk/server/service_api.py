"""brisk's own service endpoints, in the shapes the project's seed documents asked for:

    POST   /v1/generate          {prompt, max_tokens, temperature, stream, optimization}
    POST   /v1/generate/batch    {prompts, max_tokens, temperature}, run concurrently
    GET    /v1/cache/stats       KV blocks, prefix-cache and response-cache figures
    DELETE /v1/cache[?tenant=T]  clears cached responses (and, for all tenants, every cached prefix
                                 block no request holds); callers who are not admin clear their own tenant's
    GET    /v1/model/info        what is served, and how

/v1/generate's optimization levels: none (no prefix sharing), basic (prefix caching), full
(prefix caching and the response cache). Sampling defaults here are brisk's (BRISK_DEFAULTS,
shared with the CLI), not OpenAI's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from brisk.engine.output import RequestOutput, accumulate
from brisk.engine.request import RequestOptions
from brisk.sample.params import BRISK_DEFAULTS, OutputKind, SamplingParams
from brisk.server.caching import Cacheable, ResponseCaching, caller, greedy, lookup, worth_storing
from brisk.server.errors import APIError
from brisk.server.protocol import GenerateBatchRequest, GenerateRequest
from brisk.server.serving import STREAMING_RESPONSES, Serving, sse


def service_router(serving: Serving, caching: ResponseCaching | None = None) -> APIRouter:
    router = APIRouter()
    api = ServiceAPI(serving, caching)
    router.add_api_route("/v1/generate", api.generate, methods=["POST"], responses=STREAMING_RESPONSES)
    router.add_api_route("/v1/generate/batch", api.generate_batch, methods=["POST"])
    router.add_api_route("/v1/cache/stats", api.cache_stats, methods=["GET"])
    router.add_api_route("/v1/cache", api.clear_cache, methods=["DELETE"])
    router.add_api_route("/v1/model/info", api.model_info, methods=["GET"])
    return router


class ServiceAPI:
    def __init__(self, serving: Serving, caching: ResponseCaching | None):
        self.serving, self.caching = serving, caching
        self.engine = serving.engine

    def _params(self, max_tokens: int, temperature: float, prompt_len: int, param: str,
                kind: OutputKind) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=BRISK_DEFAULTS.top_p, output_kind=kind,
                              max_tokens=self.serving.max_tokens(max_tokens, prompt_len, param))

    async def generate(self, body: GenerateRequest, http: Request) -> Response:
        start = time.monotonic()
        request = None if body.optimization != "full" else Cacheable(
            route="generate", params={"max_tokens": body.max_tokens, "temperature": body.temperature}, context=None,
            text=body.prompt, semantic=True, deterministic=greedy(body.temperature), opt=body.cache,
            threshold=body.cache_similarity_threshold, verify=False)  # verified hits: the OpenAI routes
        cached = await lookup(self.caching, http, request)
        if cached.served:
            answer = {**cached.hit.response, "latency_ms": (time.monotonic() - start) * 1000}
            if not body.stream:
                return JSONResponse(answer, headers=cached.headers)

            async def replay():
                yield {"text": answer["text"]}
                yield {**answer, "done": True}

            return sse(replay(), cached.headers)
        [prompt_ids] = await self.serving.tokenize([body.prompt], "prompt")
        params = self._params(body.max_tokens, body.temperature, len(prompt_ids), "prompt",
                              OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
        # optimization=none: a private cache salt, so the prompt reuses no cached blocks and shares none.
        salt = uuid.uuid4().hex if body.optimization == "none" else None
        [stream] = await self.serving.submit([prompt_ids], [params], f"gen-{uuid.uuid4().hex}",
                                             RequestOptions(cache_salt=salt, tenant=caller(http).tenant))

        def result(text: str, tokens: int) -> dict:
            return {"text": text, "tokens_generated": tokens, "latency_ms": (time.monotonic() - start) * 1000,
                    "optimization_used": body.optimization}

        if body.stream:
            async def events(outputs: AsyncIterator[RequestOutput]):
                final = None
                async for out in outputs:
                    final = accumulate(final, out)
                    yield {"text": out.outputs[0].text}
                answer = result(final.outputs[0].text, len(final.outputs[0].token_ids))
                if worth_storing([final]):
                    await cached.save(answer)
                yield {**answer, "done": True}

            return sse(events(stream), cached.headers)
        finals = await self.serving.collect(http, [stream])
        if finals is None:
            return Response(status_code=499)
        completion = finals[0].outputs[0]
        answer = result(completion.text, len(completion.token_ids))
        if worth_storing(finals):
            await cached.save(answer)
        return JSONResponse(answer, headers=cached.headers)

    async def generate_batch(self, body: GenerateBatchRequest, http: Request) -> Response:
        start = time.monotonic()
        prompts = await self.serving.tokenize(body.prompts, "prompts")
        params = [self._params(body.max_tokens, body.temperature, len(ids), f"prompts[{i}]", OutputKind.FINAL_ONLY)
                  for i, ids in enumerate(prompts)]
        streams = await self.serving.submit(prompts, params, f"batch-{uuid.uuid4().hex}",
                                            RequestOptions(tenant=caller(http).tenant))
        finals = await self.serving.collect(http, streams)
        if finals is None:
            return Response(status_code=499)
        seconds = time.monotonic() - start
        results = [{"text": f.outputs[0].text, "tokens_generated": len(f.outputs[0].token_ids),
                    "finish_reason": f.outputs[0].finish_reason} for f in finals]
        total = sum(r["tokens_generated"] for r in results)
        return JSONResponse({"results": results, "total_latency_ms": seconds * 1000,
                             "throughput_tokens_per_sec": total / seconds if seconds > 0 else 0.0})

    async def cache_stats(self) -> dict:
        s = await self.engine.stats()
        info = self.engine.model_info
        responses = await asyncio.to_thread(self.caching.stats) if self.caching is not None else {"enabled": False}
        return {
            "response_cache": responses,
            "kv_cache": {"block_size": info.block_size, "total_blocks": s.num_kv_blocks,
                         "used_blocks": s.num_kv_blocks - s.num_free_kv_blocks, "free_blocks": s.num_free_kv_blocks,
                         "usage": s.kv_cache_usage},
            "prefix_cache": {"enabled": info.enable_prefix_caching,
                             "cached_blocks": s.num_cached_blocks, "queries_tokens": s.prefix_cache_queries,
                             "hits_tokens": s.prefix_cache_hits,
                             "hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
                             "evictions": s.prefix_cache_evictions},
        }

    async def clear_cache(self, http: Request, tenant: str | None = None) -> dict:
        """An admin clears one tenant's responses, or every response and the prefix cache; any
        other caller clears its own tenant's responses (the prefix cache is everyone's)."""
        who = caller(http)
        if not who.admin:
            if tenant is not None and tenant != who.tenant:
                raise APIError(403, "Only the admin API key may clear another tenant's cached responses.",
                               type="permission_error", param="tenant")
            tenant = who.tenant
        removed = await asyncio.to_thread(self.caching.cache.clear, tenant) if self.caching is not None else 0
        blocks = await self.engine.clear_prefix_cache() if tenant is None else 0
        return {"evicted_blocks": blocks, "removed_responses": removed, "tenant": tenant}

    async def model_info(self) -> dict:
        info = self.engine.model_info
        return {
            "name": self.serving.model_name, "file": info.name, "format": info.format,
            "architecture": info.architecture, "parameters": info.parameters, "dtype": info.dtype,
            "device": info.device,
            "quantization": info.quantization and f"{info.quantization} in the file, "
                            + (f"run as {info.weight_mode}" if info.runtime_quantization
                               else f"dequantized to {info.dtype}"),
            "runtime_quantization": info.runtime_quantization,
            "weight_mode": info.weight_mode, "weights": info.weights, "kernels": info.kernels,
            "max_model_len": info.max_model_len, "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "kv_block_size": info.block_size, "num_kv_blocks": info.num_kv_blocks, "kv_cache_dtype": info.kv_cache_dtype,
            "enable_prefix_caching": info.enable_prefix_caching,
            "layers": info.num_layers, "hidden_size": info.hidden_size, "num_heads": info.num_heads,
            "num_kv_heads": info.num_kv_heads, "vocab_size": info.vocab_size,
            "identity": info.identity,
        }
