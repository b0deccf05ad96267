"""`brisk bench compare` beside llama.cpp: the flags llama-server gets, the tokens each side
writes, and the tables. A fake llama-server (an OpenAI-compatible streaming server that counts
what it writes) and a fake llama-bench stand in for the real programs in the suite; the same
run against the real ones (`make llama-cpp`) is marked llama_cpp and runs when asked for
(`make test-llama-cpp`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from brisk.bench.compare import LLAMA_BATCH, LLAMA_UBATCH, LLAMA_CPP_BUILD, Row, print_tables
from brisk.model.loader import default_model_path


def _compare(bin_dir: Path | None, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "brisk.cli", "bench", "compare", "--no-transformers", "--num-prompts", "3",
         "--max-concurrency", "2", "--output-len", "8", "--single-stream-tokens", "8", "--warmup", "0",
         "--kv-cache-memory-gib", "0.25", "--startup-timeout", "300",
         *(["--llama-cpp-bin", str(bin_dir)] if bin_dir else []), *extra],
        capture_output=True, text=True, timeout=900)


def _args(path: Path) -> dict[str, str]:
    args = json.loads(path.read_text())
    return {a: (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
            for i, a in enumerate(args) if a.startswith("--")}


@pytest.mark.real_model
def test_compare_runs_llama_server_with_a_slot_per_request_in_flight_and_counts_every_token(fake_llama_cpp):
    run = _compare(fake_llama_cpp)
    assert run.returncode == 0, run.stderr[-3000:]
    server = _args(fake_llama_cpp / "server-args.json")
    assert server["--model"] == default_model_path()
    assert server["--parallel"] == "2"  # at most two requests in flight: a slot each
    slot = int(server["--ctx-size"]) // 2  # a slot holds -c / -np tokens
    assert slot % 256 == 0 and slot >= 8 + 20  # the longest request: its prompt and 8 output tokens
    assert "--no-kv-unified" in server and "--cont-batching" in server
    assert (server["--threads"], server["--batch-size"], server["--ubatch-size"]) == (
        server["--threads-batch"], str(LLAMA_BATCH), str(LLAMA_UBATCH))
    assert json.loads((fake_llama_cpp / "written.json").read_text()) == [8, 8, 8]  # EOS ignored: every token
    assert "peer: llama.cpp's C++ server, llama-server (version: 42 (fake)" in run.stdout
    assert "| llama.cpp | llama-server, 2 slots, same GGUF | 3 (0) | 24 (24) |" in run.stdout
    assert "| brisk | brisk serve | 3 (0) | 24 (24) |" in run.stdout
    assert "WARNING" not in run.stdout
    bench = _args(fake_llama_cpp / "bench-args.json")
    assert (bench["--n-prompt"], bench["--n-gen"], bench["--threads"]) == ("0", "8", server["--threads"])
    single = next(line for line in run.stdout.splitlines() if line.startswith("| llama.cpp | llama-bench tg8"))
    assert "| 123.4 |" in single and "/ 123.4 = " in single  # both figures of the ratio, from this run


def test_a_side_that_writes_fewer_tokens_than_asked_is_flagged(capsys):
    rows = [Row("brisk", "brisk serve", 3, 24, 1.0, asked_tokens=24),
            Row("llama.cpp", "llama-server, 2 slots, same GGUF", 3, 6, 1.0, asked_tokens=24)]
    print_tables(rows, [])
    out = capsys.readouterr().out
    assert "| llama.cpp | llama-server, 2 slots, same GGUF | 3 (0) | 6 (24) | 1.0 | 6.0 | 24.0 / 6.0 = 4.00x |" in out
    assert "WARNING: llama.cpp (llama-server, 2 slots, same GGUF) wrote 6 of the 24 tokens asked for" in out
    assert "WARNING: brisk" not in out


@pytest.mark.llama_cpp
@pytest.mark.real_model
def test_compare_against_the_real_llama_server():
    assert (LLAMA_CPP_BUILD / "llama-server").exists(), "run make llama-cpp first (make test-llama-cpp does)"
    run = _compare(None)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "peer: llama.cpp's C++ server, llama-server (version: " in run.stdout
    assert "| llama.cpp | llama-server, 2 slots, same GGUF | 3 (0) | 24 (24) |" in run.stdout
    assert "WARNING" not in run.stdout
    assert "| llama.cpp | llama-bench tg8" in run.stdout
