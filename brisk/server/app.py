"""The HTTP server: OpenAI-compatible endpoints, brisk's service endpoints, and vLLM's tokenizer ones.

    POST /v1/chat/completions, /v1/completions      OpenAI shapes, streaming as SSE  (openai_api.py)
    POST /v1/embeddings                              OpenAI's shape, the embedding model (embedding_api.py)
    GET  /v1/models, /v1/models/{id}                 every served name (aliases), or one of them
    POST /v1/generate, /v1/generate/batch            brisk's simple generation API   (service_api.py)
    GET  /v1/cache/stats, DELETE /v1/cache           KV, prefix and response cache figures / clearing
    GET  /v1/model/info                              what is being served, and how
    POST /tokenize, /detokenize                      vLLM's shapes: text or messages  (tokenizer_api.py)
    GET  /tokenizer_info, /version                   the tokenizer's configuration; brisk's version
    GET  /health                                     200 while the engine loop is alive and stepping
    GET  /metrics                                    Prometheus text format
    GET  /metrics.json                               the last minute, second by second (live.py)
    GET  /dashboard                                  a page drawing /metrics.json live (dashboard.html)

The app talks to the engine through the EngineClient interface only; handlers queue requests
and await outputs, so the event loop stays free to accept connections while the model computes.
With a response cache, the generation routes look requests up before the engine sees them
(caching.py), in the caller's tenant (middleware.py).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from brisk.cache.response_cache import ResponseCache
from brisk.config import ConfigError, EmbeddingConfig, ResponseCacheConfig, ServerConfig
from brisk.embed.embedder import Embedder
from brisk.transport.client import EngineClient
from brisk.server.embedding_api import EmbeddingServing, embedding_router
from brisk.server.errors import ErrorResponse, UnexpectedErrorMiddleware, error_body, install_error_handlers
from brisk.server.live import LiveStats
from brisk.server.metrics import PrometheusStatLogger
from brisk.server.caching import ResponseCaching, model_scope
from brisk.server.middleware import (DEFAULT_TENANT, APIKeyMiddleware, APIKeys, BodySizeLimitMiddleware,
                                    read_api_keys)
from brisk.server.openai_api import openai_router
from brisk.server.service_api import service_router
from brisk.server.serving import Serving
from brisk.server.tokenizer_api import tokenizer_router

# Reachable without the API key: probes, scrapers, and the dashboard (a browser opening a page
# sends no bearer token). They show the server's aggregate figures, never a request's content.
OPEN_PATHS = {"/health", "/metrics", "/metrics.json", "/dashboard"}
DASHBOARD = resources.files("brisk.server").joinpath("dashboard.html").read_text(encoding="utf-8")


def build_app(engine: EngineClient, config: ServerConfig | None = None, *, owns_engine: bool = True,
              embedder: Embedder | None = None, embedding_config: EmbeddingConfig | None = None,
              response_cache: ResponseCache | None = None, cache_config: ResponseCacheConfig | None = None) -> FastAPI:
    """An app serving `engine`, `embedder` at /v1/embeddings when given, and answering from
    `response_cache` when given (semantically too, with an embedder). With owns_engine,
    shutting the app down stops the engine; the app always closes the response cache."""
    config = config or ServerConfig()
    model_names = config.served_model_name or [engine.model_info.name]
    metrics = PrometheusStatLogger(model_names[0], engine.model_info.max_loras)
    engine.add_stat_logger(metrics)
    live = LiveStats()
    engine.add_stat_logger(live)
    embeddings = None
    if embedder is not None:
        embeddings = EmbeddingServing(embedder, embedding_config or EmbeddingConfig(), metrics.record_embedding_batch,
                                      generating=lambda: serving.tenants.busy)  # `serving` is made below
        metrics.embedding_queue_depth.set_function(lambda: embeddings.batcher.queue_depth)
    caching = None
    if response_cache is not None:
        hit_latency = metrics.watch_response_cache(lambda: caching.stats())

        def on_hit(kind: str, seconds: float, tenant: str) -> None:
            hit_latency(kind, seconds)
            serving.tenants.count(tenant, response_cache_hits=1)  # `serving` is made below

        caching = ResponseCaching(response_cache, cache_config or ResponseCacheConfig(),
                                  model_scope(model_names[0], engine.model_info.identity), embedder, on_hit,
                                  engine.model_info.verifies_drafts)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            engine.remove_stat_logger(metrics)
            engine.remove_stat_logger(live)
            if embeddings is not None:
                await embeddings.batcher.close()
            if caching is not None:
                await caching.close()
            if owns_engine:
                engine.shutdown()

    app = FastAPI(title="brisk", lifespan=lifespan)
    install_error_handlers(app)
    api_keys = read_api_keys(config.api_keys_file) if config.api_keys_file else APIKeys({}, {})
    keys = dict(api_keys.tenants)
    if config.api_key:
        if config.api_key in keys:
            raise ConfigError(f"api_key is also a key of {config.api_keys_file} "
                              f"(with the tenant {keys[config.api_key]})")
        keys[config.api_key] = DEFAULT_TENANT
    app.add_middleware(APIKeyMiddleware, keys=keys, admin_api_key=config.admin_api_key or config.api_key,
                       open_paths=OPEN_PATHS)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(UnexpectedErrorMiddleware)  # added last: the outermost of the app's own
    serving = Serving(engine, config, model_names, api_keys.limits)
    named_tenants = {DEFAULT_TENANT, *api_keys.limits}
    metrics.watch_tenants(lambda: serving.tenants.usage(named_tenants))
    app.include_router(openai_router(serving, embeddings, caching))
    if embeddings is not None:
        app.include_router(embedding_router(embeddings))
    app.include_router(service_router(serving, caching))
    app.include_router(tokenizer_router(serving))

    @app.get("/health", response_class=PlainTextResponse,
             responses={503: {"model": ErrorResponse, "description": "The engine loop is not running."}})
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        if engine.is_healthy():
            return PlainTextResponse("ok")
        return JSONResponse(error_body("The engine loop is not running.", "server_error"), status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics.json")
    async def live_metrics() -> dict:
        """The dashboard's figures: the last minute per second, the response cache's counts, and
        each tenant's (named as /metrics names them)."""
        responses = {"enabled": False}
        if caching is not None:
            try:
                responses = await asyncio.to_thread(caching.stats)
            except Exception:  # noqa: BLE001 - a store that cannot answer leaves its figures out
                responses = {"enabled": True, "error": "the response cache's figures could not be read"}
        return {"model": model_names[0], **live.snapshot(), "response_cache": responses,
                "tenants": serving.tenants.usage(named_tenants)}

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD)

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, corrected to what the server answers: invalid bodies get 400 (not 422),
    and every operation may answer an error in the OpenAI shape."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
                          .pop("$defs", {}))
        components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        error = {"description": "An error in the OpenAI shape (400 invalid request, 401 API key, 404 unknown model "
                                "or route, 413 body too large, 429 busy, 503 engine down).",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses.setdefault("default", error)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
