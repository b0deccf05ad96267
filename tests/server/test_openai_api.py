"""The OpenAI-compatible endpoints on the real model, through the official `openai` client."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

from brisk import SamplingParams
from tests.helpers import metric_values

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNTS = [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]
BLOCK = 16  # the engine's default block size: prefix hits come in whole blocks


@pytest.fixture(scope="module")
def offline_expectations(real_llm):
    """Greedy answers and prompt token ids from the offline API, taken before the server's loop
    thread starts (from then on only that thread may touch the engine)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    # A fresh id up front: no block of this system prompt can be cached yet.
    astronomy = {"role": "system",
                 "content": f"[{uuid.uuid4().hex}] " + "You answer questions about astronomy in one sentence. " * 8}
    return {
        "chat": real_llm.chat(QUESTION, greedy, use_tqdm=False)[0].outputs[0].text,
        "chat_prompt_tokens": len(real_llm.tokenizer.encode_chat(QUESTION)),
        "chat_8_tokens": real_llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0],
        "completion": real_llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].text,
        "counts": [o.outputs[0].text for o in real_llm.chat(COUNTS, SamplingParams(temperature=0.0, max_tokens=12),
                                                            use_tqdm=False)],
        "astronomy": [[astronomy, {"role": "user", "content": q}] for q in ("Mars?", "Venus?")],
        "astronomy_ids": [real_llm.tokenizer.encode_chat([astronomy, {"role": "user", "content": q}])
                          for q in ("Mars?", "Venus?")],
    }


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _async_client(base_url) -> openai.AsyncOpenAI:
    """Made inside each test's event loop: an async client's connections belong to one loop."""
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_chat_completion_equals_the_offline_api(client, offline_expectations):
    response = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16)
    choice = response.choices[0]
    assert choice.message.content == offline_expectations["chat"]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens == offline_expectations["chat_prompt_tokens"]
    assert usage.completion_tokens <= 16 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # offline_expectations ran this very prompt just before: every full block is a hit, except
    # the one holding the last prompt token, which is always computed (its logits give the reply).
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_streamed_chat_adds_up_and_reports_usage(client, offline_expectations):
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline_expectations["chat"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    reference = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16).usage
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (reference.prompt_tokens, reference.completion_tokens)


def test_max_completion_tokens_and_n(client):
    response = client.chat.completions.create(model="smollm2", messages=QUESTION, max_completion_tokens=5, n=2,
                                              temperature=1.0, seed=3)
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 10


def test_chat_logprobs(client):
    response = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=4,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token  # greedy picks the top
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob) and item.logprob <= 0


def test_completions_with_text_batch_and_token_ids(client, offline_expectations):
    one = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=16)
    assert one.choices[0].text == offline_expectations["completion"]
    ids = client.completions.create(model="smollm2", prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=4)
    assert ids.usage.prompt_tokens == 5
    batch = client.completions.create(model="smollm2", prompt=["The capital of France is", "1, 2, 3,"], n=2,
                                      temperature=0, max_tokens=6, logprobs=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text.startswith(offline_expectations["completion"][:10])
    assert len(batch.choices[0].logprobs.tokens) == 6 and len(batch.choices[0].logprobs.top_logprobs[0]) == 2


def test_streamed_completion(client, offline_expectations):
    stream = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                       max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in stream) == offline_expectations["completion"]


def _batch_size_histogram(base_url) -> tuple[float, float]:
    """(engine steps so far, of which steps that advanced a single sequence)."""
    values = metric_values(httpx.get(f"{base_url}/metrics").text)
    return values["brisk:iteration_batch_size_count"], values['brisk:iteration_batch_size_bucket{le="1.0"}']


def test_async_client_runs_requests_concurrently(base_url, offline_expectations):
    async def one(client, conversation):
        r = await client.chat.completions.create(model="smollm2", messages=conversation, max_tokens=12,
                                                 temperature=0)
        return r.choices[0].message.content

    async def main():
        async with _async_client(base_url) as client:
            return await asyncio.gather(*(one(client, c) for c in COUNTS))

    steps_before, single_before = _batch_size_histogram(base_url)
    answers = asyncio.run(main())
    steps_after, single_after = _batch_size_histogram(base_url)
    assert answers == offline_expectations["counts"]
    # The requests shared engine steps: served one after another, every step would advance a
    # single sequence. Six at once, nearly all do (the first arrival may get a step to itself).
    single = single_after - single_before
    batched = (steps_after - steps_before) - single
    assert batched > single


def test_async_streaming(base_url, offline_expectations):
    async def main():
        async with _async_client(base_url) as client:
            stream = await client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                                          temperature=0, stream=True)
            return [c async for c in stream]

    chunks = asyncio.run(main())
    offline = offline_expectations["chat_8_tokens"].outputs[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == offline.finish_reason


def test_cached_tokens_of_a_fresh_prompt_and_of_its_repeat(client):
    prompt = f"{uuid.uuid4().hex} is a code name. Spell it backwards, then tell me a story about it."
    fresh = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0).usage
    repeat = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0).usage
    assert fresh.prompt_tokens == repeat.prompt_tokens > 2 * BLOCK
    assert fresh.prompt_tokens_details.cached_tokens == 0  # its first block is unlike any before it
    assert repeat.prompt_tokens_details.cached_tokens == (repeat.prompt_tokens - 1) // BLOCK * BLOCK


def test_usage_reports_prefix_cache_hits(client, base_url, offline_expectations):
    mars, venus = offline_expectations["astronomy"]
    mars_ids, venus_ids = offline_expectations["astronomy_ids"]
    common = next(i for i, (a, b) in enumerate(zip(mars_ids, venus_ids)) if a != b)
    before = metric_values(httpx.get(f"{base_url}/metrics").text)
    first = client.chat.completions.create(model="smollm2", messages=mars, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model="smollm2", messages=venus, max_tokens=2, temperature=0)
    after = metric_values(httpx.get(f"{base_url}/metrics").text)
    assert (first.usage.prompt_tokens, second.usage.prompt_tokens) == (len(mars_ids), len(venus_ids))
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # the system prompt starts with a fresh id
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == common // BLOCK * BLOCK and cached >= 4 * BLOCK  # the shared system prompt's full blocks
    hits = after["brisk:prefix_cache_hits_total"] - before["brisk:prefix_cache_hits_total"]
    queries = after["brisk:prefix_cache_queries_total"] - before["brisk:prefix_cache_queries_total"]
    assert hits == cached
    assert queries == first.usage.prompt_tokens + second.usage.prompt_tokens
