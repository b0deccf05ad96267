"""`brisk serve --replicas 2` as a user runs it: a process of its own with its own Ray cluster,
streaming through the ingress, then stopped by SIGTERM as a service manager stops it."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.helpers import import_or_require

import_or_require("ray.serve", "Ray Serve (the optional extra: pip install 'brisk[ray]')")

from tests.conftest import build_tiny_checkpoint  # noqa: E402
from tests.server.conftest import serve_tiny  # noqa: E402


def _stream(base: str, started: threading.Event, finishes: list) -> None:
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                started.set()
    reasons = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-1])
               if c.get("choices") and c["choices"][0].get("finish_reason")]
    finishes.append((reasons, events[-1]))


def test_sigterm_ends_every_stream_with_a_last_chunk_refuses_new_requests_and_exits_zero(tmp_path):
    folder = build_tiny_checkpoint(str(tmp_path), "llama")
    process, base = serve_tiny(folder, "--replicas", "2", "--num-threads", "1", "--max-model-len", "8192",
                               "--num-kv-blocks", "2048", "--shutdown-grace-seconds", "1",
                               "--embedding-model", "none", "--no-response-cache", "--served-model-name", "tiny",
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        finishes: list = []
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(base, e, finishes)) for e in started]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        first = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "w7", "max_tokens": 2},
                           timeout=60)
        assert first.status_code == 200  # served through the ingress while the streams run
        process.send_signal(signal.SIGTERM)
        # A request sent before the ingress hears of the stop is served; once it has heard, one is
        # refused until the application goes, at least the grace period later. Hearing takes a
        # signal handler and a broadcast to the ingress replicas: over a second on a loaded host.
        deadline = time.monotonic() + 30.0
        while (refused := httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "w7", "max_tokens": 2},
                                     timeout=60)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for t in threads:
            t.join(60)
        # Cut at the grace period's end with a last chunk, not mid-body: each stream says why it ended.
        assert len(finishes) == 4 and all(reasons == ["abort"] and done == "[DONE]" for reasons, done in finishes), \
            finishes
        assert process.wait(timeout=90) == 0
        with pytest.raises(httpx.TransportError):  # Ray Serve's proxy went with it
            httpx.get(f"{base}/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
