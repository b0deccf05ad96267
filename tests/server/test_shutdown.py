"""`brisk serve` as a process (its engine on a thread or in a process of its own): SIGTERM ends
every response cleanly and exits 0.

Within the grace period a running stream finishes as usual; past it the engine ends it with a
final `finish_reason: "abort"` chunk and `[DONE]`, never a cut connection, and no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import httpx
import psutil
import pytest

from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import serve_tiny


def _start(folder: str, grace: float, engine_flag: str) -> tuple[subprocess.Popen, str]:
    return serve_tiny(folder, "--shutdown-grace-seconds", str(grace), "--log-level", "info", "--no-response-cache",
                      "--max-model-len", "8192", "--num-kv-blocks", "1024", engine_flag, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _stream(base: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"prompt": "w3 w4", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.mark.parametrize("engine_flag", ["--no-engine-process", "--engine-process"])
# The stream cut short is long enough to outlast the signal's handling on a fast host; the one
# that finishes is short enough to end well within its grace period on a slow one.
@pytest.mark.parametrize("grace, max_tokens, finish_reason", [(0, 8000, "abort"), (60, 250, "length")])
def test_sigterm_ends_streams_with_a_final_chunk_and_exits_zero(tiny_folder, grace, max_tokens, finish_reason,
                                                                engine_flag):
    process, base = _start(tiny_folder, grace, engine_flag)
    children = [c for c in psutil.Process(process.pid).children() if "core_process" in " ".join(c.cmdline())]
    assert len(children) == (engine_flag == "--engine-process")
    try:
        events, started = [], threading.Event()
        reader = threading.Thread(target=_stream, args=(base, max_tokens, events, started))
        reader.start()
        assert started.wait(60)
        process.send_signal(signal.SIGTERM)
        reader.join(timeout=90)
        assert process.wait(timeout=90) == 0
        log = process.stdout.read()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == finish_reason
        assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1
        assert "Traceback" not in log and "ERROR" not in log, log
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=2)
        assert not [child for child in children if child.is_running()]  # the engine process stopped with it
    finally:
        if process.poll() is None:
            process.kill()
