"""`brisk batch` on a tiny model: every line gets the answer its endpoint gives, bad lines
become error records, a killed run resumes without redoing or losing a line, and a rerun sends
again exactly the lines the server failed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi.responses import JSONResponse

from brisk import LLM, SamplingParams
from brisk.batch import BatchLine, Outcome, read_output, run_batch_file
from brisk.config import EmbeddingConfig, EngineConfig
from tests.conftest import build_tiny_checkpoint
from tests.embed.test_encoder import _tiny_bert

CHATS = [[{"role": "user", "content": f"w{5 + i} w{9 + i} w{12 + i}"}] for i in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("bert") / "bert")
    _tiny_bert(folder, "mean", normalize=True)
    return folder


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", num_kv_blocks=256, max_model_len=256, max_num_seqs=4)


def _request(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _input(tmp_path) -> str:
    lines = [_request(f"chat-{i}", "/v1/chat/completions", {"messages": m, "max_tokens": 8, "temperature": 0})
             for i, m in enumerate(CHATS)]
    lines += [
        _request("completion", "/v1/completions", {"prompt": "w3 w4", "max_tokens": 4, "temperature": 0}),
        _request("embedding", "/v1/embeddings", {"input": ["w1 w2", "w3"]}),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        _request("elsewhere", "/v1/images", {}),
        _request("chat-0", "/v1/chat/completions", {"messages": CHATS[0]}),  # a second chat-0
        _request("streamed", "/v1/completions", {"prompt": "w3", "stream": True}),
        _request("invalid", "/v1/chat/completions", {"messages": CHATS[0], "temperature": -1}),
        "",
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _records(path: str) -> dict[str, dict]:
    """The last record of each custom_id; malformed lines' records under "line N"."""
    with open(path) as f:
        return {r["custom_id"] or f"line {r['error']['line']}": r for r in map(json.loads, f)}


def _completions(tmp_path, count: int) -> str:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_request(f"c{i}", "/v1/completions", {"prompt": f"w{i + 3}", "max_tokens": 3,
                                                                      "temperature": 0}) for i in range(count)) + "\n")
    return str(path)


def test_every_line_is_answered_or_refused(tiny, bert, tmp_path):
    out = str(tmp_path / "out.jsonl")
    report = run_batch_file(_input(tmp_path), out, _config(tiny), EmbeddingConfig(embedding_model=bert))
    records = _records(out)
    assert (report.lines, report.skipped, report.answered) == (14, 0, 14) and len(records) == 14
    expected = [o.outputs[0].text for o in LLM.from_config(_config(tiny)).chat(
        CHATS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    for i, text in enumerate(expected):
        response = records[f"chat-{i}"]["response"]
        assert response["status_code"] == 200 and response["body"]["choices"][0]["message"]["content"] == text
        assert response["request_id"] == response["body"]["id"] and records[f"chat-{i}"]["error"] is None
    assert records["completion"]["response"]["body"]["object"] == "text_completion"
    vectors = records["embedding"]["response"]["body"]["data"]
    assert len(vectors) == 2 and len(vectors[0]["embedding"]) == 32
    assert records["invalid"]["response"]["status_code"] == 400  # the endpoint's own answer
    assert records["invalid"]["response"]["body"]["error"]["param"] == "temperature"
    refused = {cid: r["error"] for cid, r in records.items() if r["response"] is None}
    assert set(refused) == {"line 9", "line 10", "elsewhere", "line 12", "streamed"}
    assert refused["line 9"]["code"] == "invalid_json_line" and "not JSON" in refused["line 9"]["message"]
    assert refused["line 10"]["param"] == "custom_id" and "no custom_id" in refused["line 10"]["message"]
    assert refused["line 12"]["code"] == "duplicate_custom_id" and refused["streamed"]["param"] == "body.stream"
    assert refused["elsewhere"]["line"] == 11 and records["line 12"]["custom_id"] is None
    assert (report.succeeded, report.failed, report.retriable, report.malformed) == (8, 3, 0, 3)
    assert not report.complete

def test_a_killed_run_resumes_without_redoing_or_losing_a_line(tiny, tmp_path, monkeypatch):
    import brisk.batch

    path = _completions(tmp_path, 8)
    out = str(tmp_path / "out.jsonl")
    answer, answered = brisk.batch._answer, []

    async def dies_after_three(client, line):
        if len(answered) == 3:
            raise KeyboardInterrupt  # the kill: requests in flight are lost, written lines are not
        record = await answer(client, line)
        answered.append(record)
        return record

    monkeypatch.setattr(brisk.batch, "_answer", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_batch_file(path, out, _config(tiny), max_in_flight=1)
    assert len(read_output(out).outcomes) == 3
    with open(out, "a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "c7", "resp')  # a line the kill cut short
    monkeypatch.setattr(brisk.batch, "_answer", answer)
    report = run_batch_file(path, out, _config(tiny))
    assert (report.skipped, report.answered, report.succeeded) == (3, 5, 8) and report.complete
    with open(out) as f:
        ids = [json.loads(line)["custom_id"] for line in f]
    assert sorted(ids) == [f"c{i}" for i in range(8)]  # each once: nothing redone, nothing lost


class _Failing:
    """The real app behind a layer that fails the requests for some prompts, as a server in
    trouble does: 503 (overloaded), or an exception before any answer (which the transport
    turns into an empty 500)."""

    def __init__(self, app, unavailable: set[str], crashing: set[str]):
        self.app, self.unavailable, self.crashing = app, unavailable, crashing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        prompt = json.loads(body).get("prompt")
        if prompt in self.crashing:
            raise RuntimeError("the worker died")
        if prompt in self.unavailable:
            error = {"message": "overloaded", "type": "server_error", "param": None, "code": None}
            return await JSONResponse({"error": error}, status_code=503)(scope, receive, send)
        first = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)


def test_a_rerun_sends_again_exactly_the_lines_the_server_failed(tiny, tmp_path, monkeypatch):
    import brisk.server.app

    path = _completions(tmp_path, 8)
    with open(path, "a") as f:  # a 400: final, never sent again
        f.write(_request("bad", "/v1/completions", {"prompt": "w3", "temperature": -1}) + "\n")
    out = str(tmp_path / "out.jsonl")
    build_app = brisk.server.app.build_app
    monkeypatch.setattr(brisk.server.app, "build_app", lambda *a, **k: _Failing(build_app(*a, **k), {"w4", "w7"},
                                                                                 {"w9"}))
    report = run_batch_file(path, out, _config(tiny))
    assert (report.answered, report.succeeded, report.failed, report.retriable, report.malformed) == (9, 5, 1, 3, 0)
    first = _records(out)
    assert {cid: first[cid]["response"]["status_code"] for cid in ("c1", "c4", "c6", "bad")} == \
        {"c1": 503, "c4": 503, "c6": 500, "bad": 400}
    assert first["c6"]["response"]["body"]["error"]["type"] == "server_error"

    monkeypatch.setattr(brisk.server.app, "build_app", build_app)  # the server recovered
    report = run_batch_file(path, out, _config(tiny))
    assert (report.skipped, report.answered, report.succeeded, report.failed, report.retriable) == (6, 3, 8, 1, 0)
    with open(out) as f:
        ids = [json.loads(line)["custom_id"] for line in f]
    assert len(ids) == 12 and sorted(ids[9:]) == ["c1", "c4", "c6"]
    last = _records(out)
    assert all(last[f"c{i}"]["response"]["status_code"] == 200 for i in range(8))


def test_only_server_and_transport_failures_are_left_to_retry(tmp_path):
    statuses = {"ok": 200, "bad": 400, "missing": 404, "timeout": 408, "busy": 429, "crashed": 500, "down": 503,
                "recovered": 503}
    records = [{"id": f"batch_req_{cid}", "custom_id": cid, "error": None,
                "response": {"status_code": status, "request_id": "r", "body": {}}} for cid, status in statuses.items()]
    records += [
        {"id": "batch_req_r", "custom_id": "recovered", "error": None,
         "response": {"status_code": 200, "request_id": "r", "body": {}}},  # its last record counts
        {"id": "batch_req_u", "custom_id": "unreachable", "response": None,
         "error": {"code": "connection_error", "message": "ConnectError", "param": None, "line": 9}},
        {"id": "batch_req_s", "custom_id": "unsendable", "response": None,
         "error": {"code": "invalid_url", "message": "url must be", "param": "url", "line": 10}},
        {"id": "batch_req_m", "custom_id": None, "response": None,
         "error": {"code": "invalid_json_line", "message": "not JSON", "param": None, "line": 11}},
    ]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_output(str(out))
    ids = [*statuses, "unreachable", "unsendable"]
    assert {cid for cid in ids if not log.is_done(BatchLine(1, cid))} == {"timeout", "busy", "crashed", "down",
                                                                          "unreachable"}
    assert log.outcomes["recovered"] is Outcome.SUCCEEDED and log.outcomes["unsendable"] is Outcome.FAILED
    assert log.is_done(BatchLine(11, None)) and not log.is_done(BatchLine(12, None))  # malformed: by line


def test_a_malformed_line_takes_no_custom_id_from_a_real_line(tiny, tmp_path):
    body = {"prompt": "w3 w4", "max_tokens": 2, "temperature": 0}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_request("a", "/v1/completions", body), _request("b", "/v1/completions", body),
                               "{not json", _request("line-3", "/v1/completions", body)]) + "\n")
    out = str(tmp_path / "out.jsonl")
    report = run_batch_file(str(path), out, _config(tiny))
    records = _records(out)
    assert records["line-3"]["response"]["status_code"] == 200 and records["line-3"]["error"] is None
    assert records["line 3"]["custom_id"] is None and records["line 3"]["error"]["code"] == "invalid_json_line"
    assert (report.succeeded, report.malformed) == (3, 1)
    report = run_batch_file(str(path), out, _config(tiny))  # nothing left, the malformed line reported once
    assert (report.skipped, report.answered) == (4, 0) and len(open(out).readlines()) == 4


def test_the_command_exits_non_zero_until_every_line_succeeded(tiny, tmp_path):
    body = {"prompt": "w3 w4", "max_tokens": 2, "temperature": 0}
    path, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")

    def brisk_batch(*lines: str) -> subprocess.CompletedProcess:
        path.write_text("\n".join(lines) + "\n")
        return subprocess.run([sys.executable, "-m", "brisk.cli", "batch", str(path), out, "--model", tiny,
                               "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128"],
                              capture_output=True, text=True, timeout=300)

    a, b = _request("a", "/v1/completions", body), _request("b", "/v1/completions", body)
    result = brisk_batch(a, json.dumps({"method": "POST", "url": "/v1/completions", "body": body}), b)
    assert result.returncode == 1, result.stderr
    assert "2 succeeded, 0 failed, 0 retriable left" in result.stderr and "1 malformed" in result.stderr
    result = brisk_batch(a, _request("c", "/v1/completions", body), b)  # the line given its custom_id
    assert result.returncode == 0, result.stderr
    assert "1 answered" in result.stderr and "3 succeeded, 0 failed, 0 retriable left" in result.stderr


def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path):
    """A missing folder for the answers: a one-line error and a failing exit at once, not a traceback
    after loading the model (no model is named here: loading one would be the failure)."""
    path = tmp_path / "in.jsonl"
    path.write_text(_request("a", "/v1/completions", {"prompt": "w3", "max_tokens": 1}) + "\n")
    for out, message in ((tmp_path / "missing" / "out.jsonl", "no folder"), (tmp_path, "it is a folder")):
        result = subprocess.run([sys.executable, "-m", "brisk.cli", "batch", str(path), str(out), "--model",
                                 str(tmp_path / "no-model")], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
