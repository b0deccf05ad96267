"""`brisk batch INPUT.jsonl OUTPUT.jsonl`: an OpenAI batch file run through the engine.

Each input line is one request in OpenAI's batch format, `{"custom_id", "method": "POST",
"url", "body"}`, for /v1/chat/completions, /v1/completions or /v1/embeddings. Each is answered
by the code that answers it over HTTP: the server's app runs in this process, reached through
an in-memory ASGI transport (no socket), with the engine on a thread. So a line's output body
is exactly what the endpoint would answer, a 400 or a 500 included, and every request in flight
shares the continuous batch (and the embedding batcher).

Output lines are OpenAI's: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`, or `"response": null` and an `error` where a line could not be sent
or got no answer. Errors take the shape of OpenAI's batch errors, `{"code", "message", "param",
"line"}`, `line` counting input lines from 1. Each line ends in one of four states:

- succeeded: answered 2xx;
- failed, for good: answered another 4xx than 408 and 429 (the request itself is wrong, and
  sending it again gets the same answer), or not sendable (another method or URL, a body that
  is not an object, `stream: true`);
- retriable: answered 5xx, 408 or 429, or no answer at all (`error.code` "connection_error"):
  the server or the transport failed, not the request. (A 429 is first retried within the run:
  it says the in-process queue is full, and that queue drains.)
- malformed: no custom_id of its own to answer under (not JSON, not an object, no custom_id,
  or a custom_id an earlier line already took). OpenAI reports such lines by line number in the
  batch's `errors`, never under an invented id; here they are records with `"custom_id": null`
  and the line in `error.line`. So no made-up id can take a custom_id a real line uses.

Resumable: a line is written (and flushed) only once its answer is complete, so a killed run
loses at most the requests in flight. A rerun with the same output file (after dropping a last
line a kill cut short) skips every custom_id whose last record is succeeded or failed, and each
malformed line already reported; it sends the retriable ones again and appends their new
records, so a retried custom_id appears more than once and its last record is its answer. The
report counts the four states over the whole file, earlier runs included; `brisk batch` exits 1
unless every line succeeded.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from brisk.config import EmbeddingConfig, EngineConfig, ServerConfig

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
CONNECTION_ERROR = "connection_error"  # error.code of a request that got no answer
_RETRIABLE_STATUSES = (408, 429)  # and every 5xx
_RETRY_SECONDS = 0.05  # after a 429 (more in flight than the server queues): try again shortly


class Outcome(Enum):
    """Where a custom_id stands after its last record (see the module docstring)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RETRIABLE = "retriable"


def _error(line: int, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class BatchLine:
    """One input line, understood: a request to send, or why it cannot be sent."""

    number: int  # from 1
    custom_id: str | None  # None: malformed
    url: str | None = None
    body: dict | None = None
    error: dict | None = None  # set: the line becomes an error record


@dataclass(frozen=True)
class BatchRecord:
    """One output line."""

    custom_id: str | None  # None: a malformed line, named by error["line"]
    response: dict | None = None  # {"status_code", "request_id", "body"}
    error: dict | None = None  # {"code", "message", "param", "line"}
    id: str = field(default_factory=_record_id)

    @property
    def outcome(self) -> Outcome:
        if self.response is None:
            return Outcome.RETRIABLE if self.error["code"] == CONNECTION_ERROR else Outcome.FAILED
        status = self.response["status_code"]
        if 200 <= status < 300:
            return Outcome.SUCCEEDED
        return Outcome.RETRIABLE if status >= 500 or status in _RETRIABLE_STATUSES else Outcome.FAILED

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "custom_id": self.custom_id, "response": self.response,
                           "error": self.error}, ensure_ascii=False)


@dataclass
class OutputLog:
    """What an output file holds: each custom_id's outcome by its last record, and the input
    lines already reported malformed."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)
    malformed_lines: set[int] = field(default_factory=set)

    def add(self, record: BatchRecord) -> None:
        if record.custom_id is None:
            self.malformed_lines.add(record.error["line"])
        else:
            self.outcomes[record.custom_id] = record.outcome

    def is_done(self, line: BatchLine) -> bool:
        if line.custom_id is None:
            return line.number in self.malformed_lines
        return self.outcomes.get(line.custom_id, Outcome.RETRIABLE) is not Outcome.RETRIABLE


@dataclass(frozen=True)
class BatchReport:
    """A run: what it skipped and answered, then every input line's state, earlier runs' answers
    included (succeeded + failed + retriable + malformed == lines)."""

    lines: int
    skipped: int  # done in an earlier run
    answered: int  # records written by this run
    succeeded: int
    failed: int
    retriable: int  # left for a rerun
    malformed: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.succeeded == self.lines

    def summary(self) -> str:
        return (f"{self.lines} lines: {self.skipped} already done, {self.answered} answered in {self.seconds:.1f} s; "
                f"{self.succeeded} succeeded, {self.failed} failed, {self.retriable} retriable left (run again "
                f"with the same output to retry them), {self.malformed} malformed")


def read_lines(path: str) -> list[BatchLine]:
    """Every non-empty line of the input; a custom_id an earlier line took makes a line malformed."""
    out, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                line = _parse(text, number)
                if line.custom_id in seen:
                    line = BatchLine(number, None, error=_error(
                        number, "duplicate_custom_id", f"custom_id {line.custom_id!r} appears more than once; only "
                                                       f"its first line is run", "custom_id"))
                elif line.custom_id is not None:
                    seen.add(line.custom_id)
                out.append(line)
    return out


def _parse(text: str, number: int) -> BatchLine:
    def invalid(custom_id: str | None, code: str, message: str, param: str | None = None) -> BatchLine:
        return BatchLine(number, custom_id, error=_error(number, code, message, param))

    try:
        request = json.loads(text)
    except json.JSONDecodeError as e:
        return invalid(None, "invalid_json_line", f"line {number} is not JSON: {e}")
    if not isinstance(request, dict):
        return invalid(None, "invalid_json_line", f"line {number} is not a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return invalid(None, "missing_required_parameter", f"line {number} has no custom_id (a non-empty string)",
                       "custom_id")
    url, body = request.get("url"), request.get("body")
    if request.get("method", "POST") != "POST":
        return invalid(custom_id, "invalid_method", f"method must be POST, got {request.get('method')!r}", "method")
    if url not in BATCH_URLS:
        return invalid(custom_id, "invalid_url", f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}", "url")
    if not isinstance(body, dict):
        return invalid(custom_id, "invalid_body", "body must be a JSON object", "body")
    if body.get("stream"):
        return invalid(custom_id, "invalid_body", "stream is not available in a batch: each line gets one whole "
                                                  "answer", "body.stream")
    return BatchLine(number, custom_id, url, body)


def read_output(path: str) -> OutputLog:
    """What an output file already holds. A last line cut short by a kill is removed from the
    file, so its request runs again."""
    log = OutputLog()
    if not os.path.exists(path):
        return log
    with open(path, "rb") as f:
        data = f.read()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    for text in complete.decode("utf-8").splitlines():
        if text.strip():
            record = json.loads(text)
            log.add(BatchRecord(record["custom_id"], record["response"], record["error"], record["id"]))
    return log


def run_batch_file(input_path: str, output_path: str, engine_config: EngineConfig,
                   embedding_config: EmbeddingConfig | None = None, max_in_flight: int = 256,
                   progress: bool = False, batching: str = "continuous", batch_size: int = 16) -> BatchReport:
    """Answers every line of input_path not yet done in output_path, appending each answer there.
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
    log = read_output(output_path)
    pending = [line for line in lines if not log.is_done(line)]
    needs_embeddings = any(line.url == "/v1/embeddings" for line in pending)
    embedder = load_embedder(embedding_config or EmbeddingConfig()) if needs_embeddings else None
    engine = AsyncEngine(engine_config)
    app = build_app(engine, ServerConfig(max_waiting_seqs=max_in_flight * 128, max_waiting_tokens=2**40),
                    embedder=embedder, embedding_config=embedding_config)
    try:
        with open(output_path, "a", encoding="utf-8") as out, \
                tqdm(total=len(pending), disable=not progress, unit="req", desc="batch") as bar:
            def write(record: BatchRecord) -> None:
                out.write(record.to_json() + "\n")
                out.flush()
                log.add(record)
                bar.update(1)

            if batching == "sorted":
                pending.sort(key=_body_length)
            groups = [pending] if batching == "continuous" else [pending[i:i + batch_size]
                                                                 for i in range(0, len(pending), batch_size)]
            asyncio.run(_answer_all(app, groups, max_in_flight, write))
    finally:
        engine.shutdown()
    outcomes = Counter(log.outcomes[line.custom_id] for line in lines if line.custom_id is not None)
    return BatchReport(len(lines), len(lines) - len(pending), len(pending), outcomes[Outcome.SUCCEEDED],
                       outcomes[Outcome.FAILED], outcomes[Outcome.RETRIABLE],
                       sum(line.custom_id is None for line in lines), time.perf_counter() - clock)


def _body_length(line: BatchLine) -> int:
    """How long a line's request is, in characters of what the model reads (sorted batching)."""
    if line.body is None:
        return 0
    return len(json.dumps(line.body.get("messages") or line.body.get("prompt") or line.body.get("input") or ""))


async def _answer_all(app, groups: list[list[BatchLine]], max_in_flight: int, write) -> None:
    """Each group's lines concurrently (at most max_in_flight at once), one group after another."""
    import httpx

    slots = asyncio.Semaphore(max_in_flight)
    # raise_app_exceptions=False: an exception answering one line is that line's 500, as over
    # HTTP, instead of ending the run and the requests in flight with it.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://batch", timeout=None) as client:
        async def answer(line: BatchLine) -> None:
            async with slots:
                write(await _answer(client, line))

        # (The app's lifespan does not run behind an ASGI transport: the engine is shut down by
        # the caller, and the embedding batcher's task ends with this event loop.)
        for lines in groups:
            await asyncio.gather(*(answer(line) for line in lines))


async def _answer(client, line: BatchLine) -> BatchRecord:
    import httpx

    if line.error is not None:
        return BatchRecord(line.custom_id, error=line.error)
    try:
        while True:
            response = await client.post(line.url, json=line.body)
            if response.status_code != 429:
                break
            await asyncio.sleep(_RETRY_SECONDS)
    except httpx.TransportError as e:
        return BatchRecord(line.custom_id, error=_error(line.number, CONNECTION_ERROR, f"{type(e).__name__}: {e}"))
    body = _json_body(response)
    record_id = _record_id()
    return BatchRecord(line.custom_id, {"status_code": response.status_code,
                                        "request_id": body.get("id") or record_id, "body": body}, id=record_id)


def _json_body(response) -> dict:
    """The answer's JSON body; an app that failed before it answered leaves an empty 500, given
    here the body the server's own errors have."""
    try:
        return response.json()
    except ValueError:
        return {"error": {"message": response.text or f"HTTP {response.status_code} with no body",
                          "type": "server_error", "param": None, "code": None}}
