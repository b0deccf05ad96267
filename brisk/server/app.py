"""The HTTP server: OpenAI-compatible endpoints plus brisk's service endpoints.

    POST /v1/chat/completions, /v1/completions      OpenAI shapes, streaming as SSE
    GET  /v1/models
    POST /v1/generate, /v1/generate/batch            brisk's simple generation API
    GET  /v1/cache/stats, DELETE /v1/cache           KV and prefix cache figures / eviction
    GET  /v1/model/info                              what is being served, and how
    GET  /health                                     200 while the engine loop is alive and stepping
    GET  /metrics                                    Prometheus text format

The engine runs on its own thread (AsyncEngine); handlers only queue requests and await
outputs, so the event loop stays free to accept connections while the model computes.
"""

from __future__ import annotations

import hmac
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from brisk.engine.async_engine import AsyncEngine
from brisk.engine.engine import LLMEngine
from brisk.server.errors import error_body, install_error_handlers
from brisk.server.metrics import PrometheusStatLogger
from brisk.server.openai_api import OpenAIServing, _final_outputs, _sse
from brisk.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateBatchRequest, GenerateRequest
from brisk.sampling_params import OutputKind, SamplingParams

OPEN_PATHS = {"/health", "/metrics"}  # reachable without the API key, for probes and scrapers


def default_model_name(engine: LLMEngine) -> str:
    path = engine.checkpoint.path.rstrip("/")
    name = os.path.basename(path)
    return name.removesuffix(".gguf")


def build_app(engine: AsyncEngine, *, model_name: str | None = None, api_key: str | None = None,
              max_waiting_requests: int = 256, owns_engine: bool = True) -> FastAPI:
    """An app serving `engine`. With owns_engine, shutting the app down stops the engine loop."""
    model_name = model_name or default_model_name(engine.engine)
    metrics = PrometheusStatLogger(model_name)
    engine.engine.stat_loggers.append(metrics)
    openai = OpenAIServing(engine, model_name, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            engine.engine.stat_loggers.remove(metrics)
            if owns_engine:
                engine.shutdown()

    app = FastAPI(title="brisk", lifespan=lifespan)
    install_error_handlers(app)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path not in OPEN_PATHS and not hmac.compare_digest(given, expected):
                return JSONResponse(error_body("Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                               "invalid_request_error", code="invalid_api_key"), status_code=401)
            return await call_next(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await openai.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await openai.completions(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "brisk", "max_model_len": engine.engine.max_model_len}]}

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        prompt_ids = engine.engine.tokenizer.encode(body.prompt)
        max_tokens = openai.max_tokens(body.max_tokens, len(prompt_ids), "prompt")
        params = SamplingParams(temperature=body.temperature, max_tokens=max_tokens,
                                output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
        openai.admit()
        start = time.monotonic()
        # optimization=none: a private cache salt, so the prompt reuses no cached blocks and shares none.
        salt = uuid.uuid4().hex if body.optimization == "none" else None
        outputs = engine.generate({"prompt_token_ids": prompt_ids}, params, f"gen-{uuid.uuid4().hex}", salt)

        def result(text: str, tokens: int) -> dict:
            return {"text": text, "tokens_generated": tokens, "latency_ms": (time.monotonic() - start) * 1000,
                    "optimization_used": body.optimization}

        if body.stream:
            async def events():
                text, tokens = [], 0
                async for out in outputs:
                    delta = out.outputs[0]
                    text.append(delta.text)
                    tokens += len(delta.token_ids)
                    yield {"text": delta.text}
                yield {**result("".join(text), tokens), "done": True}

            return _sse(events())
        finals = await _final_outputs(request, [outputs])
        if finals is None:
            return Response(status_code=499)
        completion = finals[0].outputs[0]
        return JSONResponse(result(completion.text, len(completion.token_ids)))

    @app.post("/v1/generate/batch")
    async def generate_batch(body: GenerateBatchRequest, request: Request) -> Response:
        start = time.monotonic()
        streams = []
        for i, prompt in enumerate(body.prompts):
            prompt_ids = engine.engine.tokenizer.encode(prompt)
            params = SamplingParams(temperature=body.temperature,
                                    max_tokens=openai.max_tokens(body.max_tokens, len(prompt_ids), f"prompts[{i}]"),
                                    output_kind=OutputKind.FINAL_ONLY)
            openai.admit()
            streams.append(engine.generate({"prompt_token_ids": prompt_ids}, params, f"batch-{uuid.uuid4().hex}"))
        finals = await _final_outputs(request, streams)
        if finals is None:
            return Response(status_code=499)
        seconds = time.monotonic() - start
        results = [{"text": f.outputs[0].text, "tokens_generated": len(f.outputs[0].token_ids),
                    "finish_reason": f.outputs[0].finish_reason} for f in finals]
        total = sum(r["tokens_generated"] for r in results)
        return JSONResponse({"results": results, "total_latency_ms": seconds * 1000,
                             "throughput_tokens_per_sec": total / seconds if seconds > 0 else 0.0})

    @app.get("/v1/cache/stats")
    async def cache_stats() -> dict:
        s = await engine.call(lambda e: e.snapshot())
        return {
            "kv_cache": {"block_size": engine.engine.config.block_size, "total_blocks": s.num_kv_blocks,
                         "used_blocks": s.num_kv_blocks - s.num_free_kv_blocks, "free_blocks": s.num_free_kv_blocks,
                         "usage": s.kv_cache_usage},
            "prefix_cache": {"enabled": engine.engine.config.enable_prefix_caching,
                             "cached_blocks": s.num_cached_blocks, "queries_tokens": s.prefix_cache_queries,
                             "hits_tokens": s.prefix_cache_hits,
                             "hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
                             "evictions": s.prefix_cache_evictions},
        }

    @app.delete("/v1/cache")
    async def clear_cache() -> dict:
        dropped = await engine.call(lambda e: e.kv.evict_unused_cached_blocks())
        return {"evicted_blocks": dropped}

    @app.get("/v1/model/info")
    async def model_info() -> dict:
        e = engine.engine
        spec = e.spec
        return {
            "name": model_name, "path": e.checkpoint.path, "format": e.checkpoint.format,
            "architecture": spec.architecture,
            "parameters": sum(p.numel() for p in e.model.parameters()),
            "dtype": str(e.dtype).removeprefix("torch."), "device": str(e.device),
            "quantization": e.checkpoint.quantization and f"{e.checkpoint.quantization} in the file, dequantized "
                                                          f"to {str(e.dtype).removeprefix('torch.')}",
            "max_model_len": e.max_model_len, "max_num_seqs": e.config.max_num_seqs,
            "max_num_batched_tokens": e.config.max_num_batched_tokens,
            "kv_block_size": e.config.block_size, "num_kv_blocks": e.kv.num_blocks,
            "enable_prefix_caching": e.config.enable_prefix_caching,
            "layers": spec.num_layers, "hidden_size": spec.hidden_size, "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads, "vocab_size": spec.vocab_size,
        }

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy():
            return PlainTextResponse("ok")
        return JSONResponse(error_body("The engine loop is not running.", "server_error"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app

