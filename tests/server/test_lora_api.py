"""LoRA adapters through the OpenAI API, as vLLM serves them: each adapter a model of its own in
/v1/models (its `parent` the base model), picked by a request's `model` field and answering what
the engine answers offline with that adapter; vLLM's admin routes load and unload adapters at run
time; an adapter's responses are never another's (or the base model's) in the response cache.
On a real server, through the official openai client and httpx, with the engine in a thread and
in a process of its own."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from brisk import LLM, LoRARequest, SamplingParams
from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore
from brisk.config import EngineConfig, ResponseCacheConfig
from tests.conftest import build_lora_adapter, build_tiny_checkpoint
from tests.helpers import metric_values
from tests.server.conftest import running_server

PROMPT = [5, 17, 33, 9, 41, 12, 7]
ADMIN, USER = "admin-key", "user-key"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-api")
    base = build_tiny_checkpoint(str(root / "base"), "llama")
    adapters = {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "mlp": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])}
    for seed, (name, options) in enumerate(adapters.items()):
        build_lora_adapter(base, str(root / name), seed, **options)
    return {"base": base, **{name: str(root / name) for name in adapters}}


def _config(folders, **options) -> EngineConfig:
    return EngineConfig(**{"model": folders["base"], "dtype": "float32", "quantization": "none", "num_kv_blocks": 128,
                           "max_model_len": 256, "lora_modules": [f"qv={folders['qv']}"], **options})


@pytest.fixture(scope="module")
def expected(folders) -> dict[str | None, str]:
    """Each model's greedy answer to PROMPT, offline; they differ from each other."""
    llm = LLM.from_config(_config(folders))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    answers = {name: llm.generate([PROMPT], params, use_tqdm=False,
                                  lora_request=LoRARequest(name, 0, folders[name]) if name else None)[0].outputs[0].text
               for name in (None, "qv", "mlp")}
    assert len(set(answers.values())) == 3
    return answers


def _answer(client: openai.OpenAI, model: str, **extra) -> str:
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True, **extra})
    assert completion.model == model
    return completion.choices[0].text


def test_adapters_are_models_picked_by_the_model_field(folders, expected, engine_kind):
    engine = engine_kind(_config(folders))
    try:
        with running_server(engine, served_model_name="tiny", api_key=USER, admin_api_key=ADMIN) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=USER, max_retries=0)
            admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
            cards = {m.id: m for m in client.models.list().data}
            assert set(cards) == {"tiny", "qv"}
            assert cards["qv"].parent == "tiny" and cards["qv"].root == folders["qv"]
            assert client.models.retrieve("qv").parent == "tiny"
            for model, name in (("tiny", None), ("qv", "qv")):
                assert _answer(client, model) == expected[name]
            with pytest.raises(openai.NotFoundError, match="mlp"):
                _answer(client, "mlp")
            # llama.cpp's per-request scale: 0 leaves the base model; without an adapter it is a 400
            assert _answer(client, "qv", lora_scale=0.0) == expected[None]
            with pytest.raises(openai.BadRequestError, match="lora_scale"):
                _answer(client, "tiny", lora_scale=0.5)

            user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {USER}"}, timeout=60)
            refused = user.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": folders["mlp"]})
            assert refused.status_code == 403
            loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": folders["mlp"]})
            assert loaded.status_code == 200, loaded.text
            assert {m.id for m in client.models.list().data} == {"tiny", "qv", "mlp"}
            assert _answer(client, "mlp") == expected["mlp"]

            bad = admin.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": folders["base"]})
            assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
            taken = admin.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": folders["mlp"]})
            assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
            assert admin.post("/v1/load_lora_adapter",
                              json={"lora_name": "tiny", "lora_path": folders["mlp"]}).status_code == 400
            control = admin.post("/v1/load_lora_adapter", json={"lora_name": "a\x00b", "lora_path": folders["mlp"]})
            assert control.status_code == 400 and control.json()["error"]["param"] == "lora_name"

            metrics = admin.get("/metrics").text
            assert metric_values(metrics)['brisk:lora_generation_tokens_total{lora_name="mlp"}'] == 8
            assert metric_values(metrics)['brisk:lora_request_success_total{finished_reason="length",lora_name="qv"}'] == 2
            assert 'max_lora="16"' in metrics and "brisk:lora_requests_info" in metrics
            assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
            with pytest.raises(openai.NotFoundError):
                _answer(client, "mlp")
            gone = admin.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    finally:
        engine.shutdown()


def test_an_adapters_cached_responses_are_its_own(folders, expected, real_embedder, tmp_path):
    from brisk.transport.async_engine import AsyncEngine

    engine = AsyncEngine(_config(folders, lora_modules=[f"qv={folders['qv']}", f"twin={folders['qv']}"]))
    cache = ResponseCache(SQLiteStore(str(tmp_path / "cache.sqlite3"), 1000, real_embedder.dimensions), 3600)
    try:
        with running_server(engine, embedder=real_embedder, response_cache=cache, cache_config=ResponseCacheConfig(),
                            served_model_name="tiny") as url:
            client = httpx.Client(base_url=url, timeout=60)
            body = {"prompt": "tell me a story", "max_tokens": 6, "temperature": 0}
            answers = {}
            for model in ("qv", "tiny", "qv", "tiny"):
                response = client.post("/v1/completions", json={**body, "model": model})
                assert response.status_code == 200, response.text
                answers.setdefault(model, []).append((response.headers["X-Brisk-Cache"],
                                                      response.json()["choices"][0]["text"]))
            assert [status for status, _ in answers["qv"]] == ["miss", "exact"]
            assert [status for status, _ in answers["tiny"]] == ["miss", "exact"]  # not qv's answer
            assert answers["qv"][0][1] == answers["qv"][1][1] and answers["tiny"][0][1] == answers["tiny"][1][1]
            assert answers["qv"][0][1] != answers["tiny"][0][1]
            # the same files under another name share the entries, and the answer names the model asked
            twin = client.post("/v1/completions", json={**body, "model": "twin"})
            assert twin.headers["X-Brisk-Cache"] == "exact" and twin.json()["choices"][0]["text"] == answers["qv"][0][1]
            assert twin.json()["model"] == "twin"
            with client.stream("POST", "/v1/completions", json={**body, "model": "twin", "stream": True}) as streamed:
                chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert chunks and {c["model"] for c in chunks} == {"twin"}
    finally:
        engine.shutdown()


def test_a_tenant_sees_and_uses_only_the_adapters_its_keys_file_line_names(folders, tmp_path):
    from brisk.transport.async_engine import AsyncEngine

    keys = tmp_path / "keys.txt"
    keys.write_text("key-a team_a adapters=qv\nkey-b team_b\n")
    engine = AsyncEngine(_config(folders, lora_modules=[f"qv={folders['qv']}", f"mlp={folders['mlp']}"]))
    try:
        with running_server(engine, served_model_name="tiny", api_keys_file=str(keys)) as url:
            restricted = openai.OpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0)
            everyone = openai.OpenAI(base_url=f"{url}/v1", api_key="key-b", max_retries=0)
            assert {m.id for m in restricted.models.list().data} == {"tiny", "qv"}
            assert {m.id for m in everyone.models.list().data} == {"tiny", "qv", "mlp"}
            assert _answer(restricted, "qv") == _answer(everyone, "qv")
            with pytest.raises(openai.NotFoundError):
                _answer(restricted, "mlp")
            with pytest.raises(openai.NotFoundError):
                restricted.models.retrieve("mlp")
            assert everyone.models.retrieve("mlp").parent == "tiny"
    finally:
        engine.shutdown()
