"""POST /v1/embeddings with the real all-MiniLM-L6-v2, through the official openai client (which
asks for base64 by default) and raw HTTP: the vectors are the offline Embedder's, concurrent
requests share batches, and bad inputs get OpenAI-style 400s without costing anyone else."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from brisk.config import EmbeddingConfig
from tests.helpers import metric_values
from tests.server.conftest import running_server

SENTENCES = ["The cat sat on the mat.", "Batching amortizes the cost of reading the weights.",
             "Mr. Darcy walked into the room.", "Quantum chromodynamics describes the strong force."]


@pytest.fixture(scope="module")
def embed_url(tiny_engine, real_embedder):
    config = EmbeddingConfig(embedding_max_wait_ms=20.0, embedding_max_queue_size=64)
    with running_server(tiny_engine, embedder=real_embedder, embedding_config=config, served_model_name="tiny") as url:
        yield url


@pytest.fixture(scope="module")
def expected(real_embedder) -> torch.Tensor:
    return torch.tensor([r.embedding for r in real_embedder.embed(SENTENCES)])


@pytest.fixture(scope="module")
def client(embed_url):
    return openai.OpenAI(base_url=f"{embed_url}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_gets_the_offline_vectors(client, expected, real_embedder):
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)  # base64 on the wire
    vectors = torch.tensor([d.embedding for d in response.data])
    assert [d.index for d in response.data] == [0, 1, 2, 3]
    assert (vectors - expected).abs().max().item() < 1e-6
    assert response.model == "all-MiniLM-L6-v2"
    tokens = sum(len(ids) for ids in real_embedder.tokenize(SENTENCES))
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[1], encoding_format="float")
    assert (torch.tensor(one.data[0].embedding) - expected[1]).abs().max().item() < 1e-6


def test_token_id_inputs(client, expected, real_embedder):
    ids = real_embedder.tokenize(SENTENCES[:2])
    many = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids, encoding_format="float")
    assert (torch.tensor([d.embedding for d in many.data]) - expected[:2]).abs().max().item() < 1e-6
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[0])


def test_the_model_list_names_both_models(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "all-MiniLM-L6-v2"}
    assert client.models.retrieve("all-MiniLM-L6-v2").id == "all-MiniLM-L6-v2"


@pytest.mark.parametrize("body,status,param,needle", [
    ({"input": []}, 400, "input", "input"),
    ({"input": [[]]}, 400, "input", "input"),
    ({"input": "x", "dimensions": 128}, 400, "dimensions", "384-dimensional"),
    ({"input": "word " * 400, "truncate": False}, 400, "input", "more than 256 tokens"),
    ({"input": [[5, 10**7]]}, 400, "input", "outside the vocabulary"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
    ({"input": "x", "model": "text-embedding-3-small"}, 404, "model", "does not exist"),
    ({"input": "x", "pooling": "cls"}, 400, "pooling", "Unsupported field"),
])
def test_bad_requests_get_openai_errors(embed_url, body, status, param, needle):
    response = httpx.post(f"{embed_url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2"} | body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_long_inputs_are_truncated_by_default(client):
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 400)
    assert response.usage.prompt_tokens == 256


def test_concurrent_requests_share_batches_and_a_bad_one_costs_no_one(embed_url, expected):
    async def run():
        async with httpx.AsyncClient(base_url=embed_url, timeout=60) as http:
            good = [http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": SENTENCES[i % 4]})
                    for i in range(24)]
            bad = http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": [[1, 10**7]]})
            return await asyncio.gather(bad, *good)

    before = metric_values(httpx.get(f"{embed_url}/metrics").text)
    bad, *good = asyncio.run(run())
    assert bad.status_code == 400
    for i, response in enumerate(good):
        assert response.status_code == 200
        vector = torch.tensor(response.json()["data"][0]["embedding"])
        assert (vector - expected[i % 4]).abs().max().item() < 1e-5
    after = metric_values(httpx.get(f"{embed_url}/metrics").text)
    inputs = after["brisk:embedding_inputs_total"] - before.get("brisk:embedding_inputs_total", 0)
    batches = after["brisk:embedding_batch_size_count"] - before.get("brisk:embedding_batch_size_count", 0)
    assert inputs == 24 and batches < 24  # 24 one-input requests ran in fewer batches
    assert after["brisk:embedding_padded_tokens_total"] >= after["brisk:embedding_tokens_total"]
    assert after["brisk:embedding_queue_depth"] == 0


def test_a_full_queue_answers_429_and_too_many_inputs_400(embed_url, real_embedder, monkeypatch):
    import threading

    too_many = httpx.post(f"{embed_url}/v1/embeddings", json={"input": ["x"] * 65}, timeout=30)
    assert too_many.status_code == 400 and "split the request" in too_many.json()["error"]["message"]
    gate, running, encode = threading.Event(), threading.Event(), real_embedder.encode

    def held(batch):  # the model is busy until released: what arrives meanwhile queues
        running.set()
        gate.wait(30)
        return encode(batch)

    monkeypatch.setattr(real_embedder, "encode", held)

    async def queue_depth(http, depth: int) -> None:
        for _ in range(600):
            if metric_values((await http.get("/metrics")).text)["brisk:embedding_queue_depth"] == depth:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the embedding queue never held {depth} inputs")

    async def run():
        async with httpx.AsyncClient(base_url=embed_url, timeout=60) as http:
            busy = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": "x"}))
            assert await asyncio.get_running_loop().run_in_executor(None, running.wait, 30)  # its batch is held
            full = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": ["y"] * 64}))
            await queue_depth(http, 64)  # 64 inputs wait: the queue is full
            refused = await http.post("/v1/embeddings", json={"input": "z"})
            gate.set()
            return refused, await busy, await full

    refused, busy, full = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert busy.status_code == full.status_code == 200 and len(full.json()["data"]) == 64
