"""What every benchmark shares: a `brisk serve` subprocess to measure, a free port for it, and the
machine the figures were taken on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import contextlib
from contextlib import contextmanager
from typing import IO, Iterator

import torch
from prometheus_client.parser import text_string_to_metric_families

from brisk.config import ServerConfig
from brisk.kernels import isa

# The instruction-set flags that decide which kernels run (DESIGN.md: detect, never assume).
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


@contextmanager
def brisk_serve(flags: list[str], server: ServerConfig, startup_timeout: float,
                response_cache: bool = False) -> Iterator[str]:
    """A `brisk serve` subprocess with these flags (the server's among them) until the block
    ends; yields its base URL once /health answers. Its response cache is off unless asked
    for: a benchmark that repeats requests measures the engine, not the cache."""
    command = [sys.executable, "-m", "brisk.cli", "serve", *flags,
               *(() if response_cache else ("--no-response-cache",))]
    with server_process(command, f"http://{server.host}:{server.port}", startup_timeout) as base_url:
        yield base_url


@contextmanager
def server_process(command: list[str], base_url: str, startup_timeout: float, health_path: str = "/health",
                   env: dict[str, str] | None = None, log: IO[str] | None = None) -> Iterator[str]:
    """`command` as a subprocess (in `env`, else this process's environment) serving at base_url
    until the block ends (SIGTERM, then SIGKILL after a minute); yields the URL once GET
    health_path answers. Its output goes to `log` (a text file open for reading too), else to a
    file of its own, and is shown if it exits before answering."""
    with contextlib.nullcontext(log) if log is not None else tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until_healthy(base_url, startup_timeout, process, log, health_path)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_until_healthy(base_url: str, timeout: float, process: subprocess.Popen | None = None, log=None,
                       path: str = "/health") -> None:
    """Polls GET `path` until it answers 200; a `process` that exits first fails at once, with
    the end of its `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = log.read()[-4000:]
            raise RuntimeError(f"{' '.join(map(str, process.args[:4]))} ... exited with code {process.returncode}:"
                               f"\n{tail}")
        try:
            with urllib.request.urlopen(base_url + path, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or not healthy yet
        time.sleep(0.2)
    raise RuntimeError(f"{base_url} did not become healthy within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    """The machine a benchmark ran on, as BENCHMARKS.md states it: CPU model, cores, the vector
    flags that pick kernels, and torch's view of them."""
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    present = " ".join(f for f in _FLAGS if f in flags) or "none of " + " ".join(_FLAGS)
    return (f"CPU: {cpu.get('model name', 'unknown')}{_generation(cpu)}, {os.cpu_count()} cores; flags: {present}; "
            f"brisk's instruction set: {isa.chosen().describe()}; "
            f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")


def _generation(cpu: dict[str, str]) -> str:
    """" (family 25, model 17: Zen 4)": a cloud CPU's model name is often just "AMD EPYC", the same
    words for Zen 3, 4 and 5, whose figures differ several-fold; family and model tell them apart."""
    try:
        family, model = int(cpu["cpu family"]), int(cpu["model"])
    except (KeyError, ValueError):
        return ""
    zen = None
    if cpu.get("vendor_id") == "AuthenticAMD":
        zen = {23: "Zen 2" if model >= 0x30 else "Zen", 26: "Zen 5"}.get(family)
        if family == 25:
            zen = "Zen 3" if model < 0x10 or 0x20 <= model < 0x60 else "Zen 4"
    return f" (family {family}, model {model}" + (f": {zen})" if zen else ")")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def prometheus_samples(text: str) -> dict[str, float]:
    """Prometheus text (a server's /metrics) -> {sample name: value}, histogram buckets left out."""
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if "le" not in sample.labels}
