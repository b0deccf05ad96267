"""`brisk batch INPUT.jsonl OUTPUT.jsonl`: an OpenAI batch file run through the engine.

Each input line is one request in OpenAI's batch format, `{"custom_id", "method": "POST",
"url", "body"}`, for /v1/chat/completions, /v1/completions or /v1/embeddings. Each is answered
by the code that answers it over HTTP: the server's app runs in this process, reached through
an in-memory ASGI transport (no socket), with the engine on a thread. So a line's output body
is exactly what the endpoint would answer, a 400 included, and every request in flight shares
the continuous batch (and the embedding batcher).

Output lines are OpenAI's: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`; a line that could not be sent at all (not JSON, no custom_id, another
method or URL, a custom_id seen before, `stream: true`) gets `"response": null` and an `error`,
and never stops the run.

Resumable: a line is written (and flushed) only once its answer is complete, so a killed run
loses at most the requests in flight; a rerun with the same output file skips every custom_id
already there, after dropping a last line the kill cut short.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, replace

from brisk.config import EmbeddingConfig, EngineConfig, ServerConfig

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_RETRY_SECONDS = 0.05  # after a 429 (more in flight than the server queues): try again shortly


@dataclass(frozen=True)
class BatchLine:
    """One input line, understood: a request to send, or why it cannot be sent."""

    custom_id: str
    url: str | None = None
    body: dict | None = None
    error: str | None = None  # set: the line becomes an error record


@dataclass(frozen=True)
class BatchReport:
    lines: int
    skipped: int  # custom_ids already in the output
    answered: int  # sent, with a response (any status)
    failed: int  # answered with a status other than 200, or not sent at all
    seconds: float

    def summary(self) -> str:
        return (f"{self.lines} lines: {self.skipped} already done, {self.answered} answered "
                f"({self.failed} failed or refused) in {self.seconds:.1f} s")


def read_lines(path: str) -> list[BatchLine]:
    """Every non-empty line of the input, numbered from 1 where it names no custom_id."""
    out, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                line = _parse(text, number)
                if line.custom_id in seen and line.error is None:
                    line = replace(line, error=f"custom_id {line.custom_id!r} appears more than once; only its "
                                              f"first line is run", custom_id=f"{line.custom_id}#line-{number}")
                seen.add(line.custom_id)
                out.append(line)
    return out


def _parse(text: str, number: int) -> BatchLine:
    fallback = f"line-{number}"
    try:
        request = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(fallback, error=f"line {number} is not JSON: {e}")
    if not isinstance(request, dict):
        return BatchLine(fallback, error=f"line {number} is not a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(fallback, error=f"line {number} has no custom_id (a non-empty string)")
    url, body = request.get("url"), request.get("body")
    if request.get("method", "POST") != "POST":
        return BatchLine(custom_id, error=f"method must be POST, got {request.get('method')!r}")
    if url not in BATCH_URLS:
        return BatchLine(custom_id, error=f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return BatchLine(custom_id, error="body must be a JSON object")
    if body.get("stream"):
        return BatchLine(custom_id, error="stream is not available in a batch: each line gets one whole answer")
    return BatchLine(custom_id, url, body)


def done_ids(path: str) -> set[str]:
    """custom_ids already answered in an output file. A last line cut short by a kill is
    removed from the file, so its request runs again."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return {json.loads(line)["custom_id"] for line in complete.decode("utf-8").splitlines() if line.strip()}


def run_batch_file(input_path: str, output_path: str, engine_config: EngineConfig,
                   embedding_config: EmbeddingConfig | None = None, max_in_flight: int = 256,
                   progress: bool = False, batching: str = "continuous", batch_size: int = 16) -> BatchReport:
    """Answers every line of input_path not yet in output_path, appending each answer there.
    batching: continuous (up to max_in_flight lines at once, the engine batching them), static
    (groups of batch_size lines in file order, each group done before the next starts) or
    sorted (the same, grouped by the length of each body's prompt, messages or input)."""
    from brisk.llm import BATCHING_MODES

    if batching not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {batching!r}")
    from tqdm import tqdm

    from brisk.embed.embedder import load_embedder
    from brisk.transport.async_engine import AsyncEngine
    from brisk.server.app import build_app

    clock = time.perf_counter()
    lines = read_lines(input_path)
    done = done_ids(output_path)
    pending = [line for line in lines if line.custom_id not in done]
    needs_embeddings = any(line.url == "/v1/embeddings" for line in pending)
    embedder = load_embedder(embedding_config or EmbeddingConfig()) if needs_embeddings else None
    engine = AsyncEngine(engine_config)
    app = build_app(engine, ServerConfig(max_waiting_seqs=max_in_flight * 128, max_waiting_tokens=2**40),
                    embedder=embedder, embedding_config=embedding_config)
    failed = 0
    try:
        with open(output_path, "a", encoding="utf-8") as out, \
                tqdm(total=len(pending), disable=not progress, unit="req", desc="batch") as bar:
            def write(record: dict) -> None:
                nonlocal failed
                failed += record["error"] is not None or record["response"]["status_code"] != 200
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                bar.update(1)

            if batching == "sorted":
                pending.sort(key=_body_length)
            groups = [pending] if batching == "continuous" else [pending[i:i + batch_size]
                                                                 for i in range(0, len(pending), batch_size)]
            asyncio.run(_answer_all(app, groups, max_in_flight, write))
    finally:
        engine.shutdown()
    return BatchReport(len(lines), len(lines) - len(pending), len(pending), failed, time.perf_counter() - clock)


def _body_length(line: BatchLine) -> int:
    """How long a line's request is, in characters of what the model reads (sorted batching)."""
    if line.body is None:
        return 0
    return len(json.dumps(line.body.get("messages") or line.body.get("prompt") or line.body.get("input") or ""))


async def _answer_all(app, groups: list[list[BatchLine]], max_in_flight: int, write) -> None:
    """Each group's lines concurrently (at most max_in_flight at once), one group after another."""
    import httpx

    slots = asyncio.Semaphore(max_in_flight)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                 timeout=None) as client:
        async def answer(line: BatchLine) -> None:
            async with slots:
                write(await _answer(client, line))

        # (The app's lifespan does not run behind an ASGI transport: the engine is shut down by
        # the caller, and the embedding batcher's task ends with this event loop.)
        for lines in groups:
            await asyncio.gather(*(answer(line) for line in lines))


async def _answer(client, line: BatchLine) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None, "error": None}
    if line.error is not None:
        record["error"] = {"code": "invalid_request", "message": line.error}
        return record
    while True:
        response = await client.post(line.url, json=line.body)
        if response.status_code != 429:
            break
        await asyncio.sleep(_RETRY_SECONDS)
    body = response.json()
    record["response"] = {"status_code": response.status_code, "request_id": body.get("id") or record["id"],
                          "body": body}
    return record
