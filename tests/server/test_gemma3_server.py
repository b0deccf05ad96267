"""The real Gemma 3 270M file served, through the official openai client: completions streamed
and with echo + logprobs, a chat under `--chat-template` (Gemma's turn format) and a chat
without one (400: this pretrained file has no template), a JSON-schema answer that validates,
and n-gram speculation whose output equals plain decoding's; then, behind a response cache (a
real SQLite file, the real embedder), repeats served with their logprobs and /tokenize over token
ids past 65,535 (its vocabulary has 262,144)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from brisk import LLM, SamplingParams
from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore
from brisk.config import EngineConfig, ResponseCacheConfig
from brisk.transport.async_engine import AsyncEngine
from tests.helpers import GEMMA_TURNS, gemma_path, metric_values
from tests.server.conftest import running_server

pytestmark = pytest.mark.real_model

COPY = ("Repeat the list exactly.\nList: apples, pears, plums, cherries, figs, dates, limes, lemons, grapes, melons, "
        "kiwis, mangoes, papayas.\nList: apples, pears,")
SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _config(**options) -> EngineConfig:
    return EngineConfig(model=gemma_path(), max_model_len=1024, kv_cache_memory_gib=0.1, **options)


@pytest.fixture(scope="module")
def plain_copy() -> str:
    """Plain greedy decoding of COPY, offline, before any server starts."""
    llm = LLM(gemma_path(), max_model_len=1024, kv_cache_memory_gib=0.1)
    out = llm.generate([COPY], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text


@pytest.fixture(scope="module")
def url(plain_copy):
    """Gemma with a chat template given and n-gram speculation on."""
    engine = AsyncEngine(_config(chat_template=GEMMA_TURNS, speculative_config=SPECULATION))
    try:
        with running_server(engine, served_model_name="gemma") as base:
            yield base
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_streamed_completion_is_the_completion(client):
    args = dict(model="gemma", prompt="The three primary colours are", max_tokens=24, temperature=0)
    whole = client.completions.create(**args)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens > 0


def test_echo_with_logprobs_scores_the_prompt_and_the_answer(client):
    prompt = "Water boils at"
    reply = client.completions.create(model="gemma", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                      logprobs=2)
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    tokens, logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
    assert len(tokens) == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert logprobs[0] is None and all(lp <= 0 for lp in logprobs[1:])  # <bos> has nothing before it
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
    # offsets index into the text, which has no <bos>: it and the prompt's first word are at 0
    offsets = choice.logprobs.text_offset
    assert tokens[0] == "<bos>" and offsets[:2] == [0, 0]
    assert all(choice.text[offset:].startswith(token) for token, offset in zip(tokens[1:], offsets[1:]))


def test_a_chat_is_rendered_with_the_template_given(client, url):
    messages = [{"role": "user", "content": "Name a colour."}]
    counted = httpx.post(f"{url}/tokenize", json={"model": "gemma", "messages": messages}, timeout=60).json()
    rendered = httpx.post(f"{url}/detokenize", json={"model": "gemma", "tokens": counted["tokens"]}, timeout=60)
    assert rendered.json()["prompt"] == "<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n" \
        or rendered.json()["prompt"] == "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    reply = client.chat.completions.create(model="gemma", messages=messages, max_tokens=12, temperature=0)
    assert reply.usage.prompt_tokens == counted["count"] and reply.choices[0].message.role == "assistant"


def test_a_chat_without_a_template_is_a_400():
    engine = AsyncEngine(_config())
    try:
        with running_server(engine, served_model_name="gemma") as base:
            bare = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as raised:
                bare.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert "--chat-template" in raised.value.body["message"]
    finally:
        engine.shutdown()


def test_a_json_schema_answer_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**10}},
              "required": ["city", "population"], "additionalProperties": False}
    reply = client.completions.create(
        model="gemma", prompt="A city and its population, as JSON:", max_tokens=128, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].text
    answer = json.loads(reply.choices[0].text)
    assert set(answer) == {"city", "population"}
    assert isinstance(answer["city"], str) and len(answer["city"]) <= 20
    assert isinstance(answer["population"], int) and 0 <= answer["population"] <= 10**10


def test_ngram_speculation_gives_plain_decodings_tokens(client, url, plain_copy):
    reply = client.completions.create(model="gemma", prompt=COPY, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == plain_copy and reply.usage.completion_tokens == 32
    accepted = metric_values(httpx.get(f"{url}/metrics", timeout=60).text)
    assert accepted["brisk:spec_decode_num_accepted_tokens_total"] > 0  # the drafts did land


@pytest.fixture(scope="module")
def cached(tmp_path_factory, real_embedder):
    """Gemma behind an exact and semantic response cache, over plain HTTP."""
    store = SQLiteStore(str(tmp_path_factory.mktemp("cache") / "cache.sqlite3"), 1000, real_embedder.dimensions)
    engine = AsyncEngine(_config())
    try:
        with running_server(engine, embedder=real_embedder, response_cache=ResponseCache(store, 3600),
                            cache_config=ResponseCacheConfig(), served_model_name="gemma") as base, \
                httpx.Client(base_url=base, timeout=120) as http:
            yield http
    finally:
        engine.shutdown()


def test_the_response_cache_serves_a_repeat_with_its_logprobs(cached):
    body = {"model": "gemma", "prompt": "The tallest mountain in Europe is", "max_tokens": 8, "temperature": 0,
            "logprobs": 3}
    first = cached.post("/v1/completions", json=body)
    again = cached.post("/v1/completions", json=body)
    assert first.status_code == again.status_code == 200, first.text
    assert (first.headers["x-brisk-cache"], again.headers["x-brisk-cache"]) == ("miss", "exact")
    assert again.json()["choices"] == first.json()["choices"]
    assert len(first.json()["choices"][0]["logprobs"]["top_logprobs"]) == 8


def test_tokenize_and_detokenize_carry_ids_past_65535(cached):
    text = "Grüße aus 東京 🦙 — naïve façade, 12345 \n\n  spaces"
    counted = cached.post("/tokenize", json={"model": "gemma", "prompt": text, "add_special_tokens": False})
    assert counted.status_code == 200, counted.text
    ids = counted.json()["tokens"]
    assert counted.json()["count"] == len(ids) and max(ids) > 65535  # no 16-bit id anywhere on the way
    back = cached.post("/detokenize", json={"model": "gemma", "tokens": ids})
    assert back.status_code == 200 and back.json()["prompt"] == text
