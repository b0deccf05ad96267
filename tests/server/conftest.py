"""Real uvicorn servers on free loopback ports, driven by the official openai client and httpx.

The server for the real model runs in a thread of the test process so it reuses the model the
session already loaded; expectations computed offline must be taken before it starts, since
from then on only the engine's loop thread may touch the engine.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from brisk.config import EngineConfig, ServerConfig
from brisk.transport.async_engine import AsyncEngine
from brisk.transport.client import EngineClient
from brisk.transport.core_process import ProcessEngine
from brisk.server.app import build_app
from tests.conftest import build_tiny_checkpoint


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(engine: EngineClient, embedder=None, embedding_config=None, response_cache=None,
                   cache_config=None, **server_options):
    """Serves `engine` (and `embedder` at /v1/embeddings, and `response_cache`) on a free port
    until the block ends (ServerConfig fields as keywords); yields the base URL."""
    app = build_app(engine, ServerConfig(**server_options), owns_engine=False, embedder=embedder,
                    embedding_config=embedding_config, response_cache=response_cache, cache_config=cache_config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def serve_tiny(folder: str, *flags: str, **popen) -> tuple[subprocess.Popen, str]:
    """`brisk serve` of the tiny model in `folder` as a process, with these flags; returns it and
    its base URL once /health answers (Popen keywords: where its output goes)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "brisk.cli", "serve", "--model", folder, "--port", str(port), "--dtype", "float32",
         "--num-kv-blocks", "64", "--max-model-len", "256", *flags], **popen)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


@pytest.fixture(params=["thread", "process"])
def engine_kind(request) -> type[EngineClient]:
    """Each EngineClient a server can run on: a test taking this runs once with each, and
    builds its engine with `engine_kind(EngineConfig(...))`."""
    return {"thread": AsyncEngine, "process": ProcessEngine}[request.param]


@pytest.fixture(scope="module")
def real_async_engine(real_llm, offline_expectations):
    """The session's engine behind a loop thread, for this module only."""
    engine = AsyncEngine(engine=real_llm.engine)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline_expectations():
    """Overridden by modules that need offline results computed before the loop starts."""
    return None


@pytest.fixture(scope="module")
def base_url(real_async_engine):
    with running_server(real_async_engine, served_model_name="smollm2") as url:
        yield url


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """A tiny random Llama behind a loop thread: 4 seats, a 256-token context."""
    folder = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")
    engine = AsyncEngine(EngineConfig(model=folder, dtype="float32", num_kv_blocks=256, max_model_len=256,
                                      max_num_seqs=4))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tiny_url(tiny_engine):
    with running_server(tiny_engine, served_model_name="tiny") as url:
        yield url
