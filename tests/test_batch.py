"""`brisk batch` on a tiny model: every line gets the answer its endpoint gives, bad lines
become error records, and a killed run resumes without redoing or losing a line."""

from __future__ import annotations

import json

import pytest

from brisk import LLM, SamplingParams
from brisk.batch import done_ids, run_batch_file
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
    with open(path) as f:
        return {r["custom_id"]: r for r in map(json.loads, f)}


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
    refused = {cid: r["error"]["message"] for cid, r in records.items() if r["response"] is None}
    assert set(refused) == {"line-9", "line-10", "elsewhere", "chat-0#line-12", "streamed"}
    assert "not JSON" in refused["line-9"] and "no custom_id" in refused["line-10"]
    assert "appears more than once" in refused["chat-0#line-12"] and "stream" in refused["streamed"]
    assert report.failed == 6  # the five refused lines and the 400


def test_a_killed_run_resumes_without_redoing_or_losing_a_line(tiny, tmp_path, monkeypatch):
    import brisk.batch

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_request(f"c{i}", "/v1/completions", {"prompt": f"w{i + 3}", "max_tokens": 3,
                                                                      "temperature": 0}) for i in range(8)) + "\n")
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
        run_batch_file(str(path), out, _config(tiny), max_in_flight=1)
    assert len(done_ids(out)) == 3
    with open(out, "a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "c7", "resp')  # a line the kill cut short
    monkeypatch.setattr(brisk.batch, "_answer", answer)
    report = run_batch_file(str(path), out, _config(tiny))
    assert (report.skipped, report.answered, report.failed) == (3, 5, 0)
    with open(out) as f:
        ids = [json.loads(line)["custom_id"] for line in f]
    assert sorted(ids) == [f"c{i}" for i in range(8)]  # each once: nothing redone, nothing lost
