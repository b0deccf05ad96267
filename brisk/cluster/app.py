"""The Ray Serve application of `brisk serve --replicas N`: an ingress and N engine replicas.

    Ray Serve's HTTP proxy (HOST:PORT)
        -> "ingress" deployment: build_app(RayEngineClient)  -- the single server's app, unchanged
            -> "engine" deployment: EngineReplica x N, placed by PrefixAffinityRouter (or Ray's own)

Ray Serve places the replicas (on this machine, or anywhere in the cluster named by
--ray-address), restarts those that die or fail their health check, and, given
--min-replicas/--max-replicas, scales their number on ongoing requests per replica. The ingress
holds the API layer, the embedding model and the response cache (in Redis with
--cache-url redis://..., which any number of ingresses would share); it reserves no CPU, since
on a small machine the cores belong to the engines.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from ray import serve
from ray.serve.config import AutoscalingConfig, HTTPOptions, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from brisk.cache.response_cache import open_response_cache
from brisk.cluster.client import RayEngineClient
from brisk.cluster.replica import EngineReplica
from brisk.config import (EMBEDDING_DISABLED, ClusterConfig, EmbeddingConfig, EngineConfig, ResponseCacheConfig,
                          ServerConfig)
from brisk.embed.embedder import load_embedder
from brisk.server.app import build_app

logger = logging.getLogger("brisk.cluster")

APP_NAME = "brisk"
ENGINE_DEPLOYMENT = "engine"
INGRESS_DEPLOYMENT = "ingress"
# Admission control is the app's (429 past max_waiting_seqs), not Ray Serve's: the ingress takes all.
_INGRESS_MAX_ONGOING_REQUESTS = 100_000
# ClusterConfig.routing -> the request router class; least_loaded is Ray Serve's default router.
_ROUTERS = {
    "prefix": "brisk.cluster.router.PrefixAffinityRouter",
    "round_robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
    "least_loaded": None,
}
# Once the engines have ended every request, how long responses get to send their last bytes.
_FLUSH_SECONDS = 5.0


@serve.ingress()
class ClusterIngress:
    async def __init__(self, engine: DeploymentHandle, server_config: ServerConfig,
                       embedding_config: EmbeddingConfig, cache_config: ResponseCacheConfig):
        self._client = client = await RayEngineClient.connect(engine)
        embedder = load_embedder(embedding_config)
        response_cache = open_response_cache(cache_config, embedder.dimensions if embedder else None)
        self._app = build_app(client, server_config, embedder=embedder, embedding_config=embedding_config,
                              response_cache=response_cache, cache_config=cache_config)

    def __serve_build_asgi_app__(self):
        return self._app

    def drain(self) -> None:
        """Stopping: new requests get 503, those running go on."""
        self._client.drain()


def engine_deployment(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig):
    """The engine replicas' deployment (bind it to engine_config): their number or autoscaling,
    their CPUs, how many requests each accepts, and the router that places requests on them."""
    max_num_seqs = engine_config.max_num_seqs
    if cluster.replicas is not None:
        scaling = {"num_replicas": cluster.replicas}
    else:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=cluster.min_replicas, max_replicas=cluster.max_replicas, initial_replicas=cluster.min_replicas,
            target_ongoing_requests=cluster.target_ongoing_requests or max_num_seqs)}
    if cluster.routing == "prefix":
        router = RequestRouterConfig(request_router_class=_ROUTERS["prefix"], request_router_kwargs={
            "block_size": engine_config.block_size, "max_imbalance": cluster.affinity_max_imbalance})
    else:
        router = RequestRouterConfig(**{"request_router_class": _ROUTERS[cluster.routing]}
                                     if _ROUTERS[cluster.routing] else {})
    num_cpus = cluster.replica_num_cpus if cluster.replica_num_cpus is not None else engine_config.num_threads or 1
    return serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        **scaling, max_ongoing_requests=cluster.replica_max_ongoing_requests or 4 * max_num_seqs,
        ray_actor_options={"num_cpus": num_cpus}, request_router_config=router,
        health_check_period_s=5, graceful_shutdown_timeout_s=_grace(server_config))


def application(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                embedding_config: EmbeddingConfig | None = None, cache_config: ResponseCacheConfig | None = None):
    """The bound application (serve.run it); every replica builds its engine from engine_config."""
    ingress = serve.deployment(ClusterIngress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1, max_ongoing_requests=_INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=_grace(server_config))
    return ingress.bind(engine_deployment(engine_config, server_config, cluster).bind(engine_config), server_config,
                        embedding_config or EmbeddingConfig(embedding_model=EMBEDDING_DISABLED),
                        cache_config or ResponseCacheConfig(response_cache=False))


def start(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
          embedding_config: EmbeddingConfig | None = None, cache_config: ResponseCacheConfig | None = None) -> None:
    """Joins (or starts) the Ray cluster and runs the application, its proxy on server_config's
    host and port; returns once every replica is up."""
    connect(cluster)
    run(engine_config, server_config, cluster, embedding_config, cache_config)


def connect(cluster: ClusterConfig) -> None:
    import ray

    ray.init(address=cluster.ray_address, include_dashboard=False, ignore_reinit_error=True)


def run(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
        embedding_config: EmbeddingConfig | None = None, cache_config: ResponseCacheConfig | None = None) -> None:
    serve.start(http_options=HTTPOptions(host=server_config.host, port=server_config.port))
    serve.run(application(engine_config, server_config, cluster, embedding_config, cache_config),
              name=APP_NAME, route_prefix="/")


def serve_cluster(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                  embedding_config: EmbeddingConfig, cache_config: ResponseCacheConfig) -> None:
    """`brisk serve --replicas N`: runs until SIGINT or SIGTERM, then stops as the single server
    does: running requests get shutdown_grace_seconds to finish, then the engines end those
    left with finish_reason "abort" (each stream sends its last chunk), then the application
    is deleted, and on a cluster of our own, Serve and Ray stopped with it."""
    connect(cluster)
    # After ray.init, which installs handlers of its own that would kill this process at once.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run(engine_config, server_config, cluster, embedding_config, cache_config)
    print(f"brisk: serving on http://{server_config.host}:{server_config.port} with Ray Serve", flush=True)
    stop.wait()
    _drain(server_config.shutdown_grace_seconds)
    serve.delete(APP_NAME)
    if cluster.ray_address is None:
        serve.shutdown()


def _drain(grace_seconds: float) -> None:
    """The single server's graceful stop, across the replicas: the ingress refuses new requests
    (503), running ones get grace_seconds to finish, then the engines end the rest with
    finish_reason "abort" and their responses get _FLUSH_SECONDS to send their last chunk.
    (Deleting the application at once would refuse calls to the replicas, abort included.)"""
    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP_NAME)
    engines = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME)
    try:
        ingress.broadcast("drain").results(timeout_s=_FLUSH_SECONDS)
        if not _idle_within(engines, grace_seconds):
            engines.broadcast("abort_all").results(timeout_s=_FLUSH_SECONDS)
            _idle_within(engines, _FLUSH_SECONDS)
    except Exception as exc:  # noqa: BLE001 - replicas gone already: nothing is left to end
        logger.warning("draining the replicas before stopping failed: %r", exc)


def _idle_within(engines: DeploymentHandle, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        answers = engines.broadcast("snapshot").results(timeout_s=_FLUSH_SECONDS, return_exceptions=True)
        if all(s.num_running + s.num_waiting == 0 for _, s in (a for a in answers if isinstance(a, tuple))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _grace(server_config: ServerConfig) -> float:
    return server_config.shutdown_grace_seconds + _FLUSH_SECONDS
