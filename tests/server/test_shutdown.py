"""`brisk serve` as a process: SIGTERM stops it cleanly (exit 0) while a request is streaming."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import free_port


def test_sigterm_finishes_in_flight_work_and_exits_zero(tmp_path):
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "brisk.cli", "serve", "--model", folder, "--port", str(port), "--dtype", "float32",
         "--num-kv-blocks", "64", "--max-model-len", "256", "--shutdown-grace-seconds", "5", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)

        events, first_event = [], threading.Event()

        def stream():
            body = {"prompt": "w3 w4", "max_tokens": 150, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line)
                            first_event.set()
            except httpx.HTTPError:
                events.append("cut")
            first_event.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_event.wait(60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stdout.read()
        reader.join(timeout=30)
        assert events[-1] in ("data: [DONE]", "cut")  # finished within the grace period, or cut after it
        try:
            httpx.get(f"{base}/health", timeout=2)
            raise AssertionError("server still answering after SIGTERM")
        except httpx.TransportError:
            pass
    finally:
        if process.poll() is None:
            process.kill()
