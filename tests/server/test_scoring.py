"""Scoring requests as lm-evaluation-harness sends them: echo with logprobs (also with
max_tokens=0), and vLLM's prompt_logprobs, on the real model, equal to the offline API."""

from __future__ import annotations

import math

import openai
import pytest

from brisk import SamplingParams

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def offline_expectations(real_llm):
    """Prompt logprobs (top 2) from the offline API, taken before the server's loop starts."""
    out = real_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    return {"ids": out.prompt_token_ids, "prompt_logprobs": out.prompt_logprobs}


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _expected(offline):
    return [None] + [entry[token].logprob for token, entry in zip(offline["ids"][1:], offline["prompt_logprobs"][1:])]


@pytest.mark.parametrize("prompt_kind", ["text", "token ids"])
def test_echo_with_max_tokens_zero_scores_the_prompt_as_the_offline_api(client, offline_expectations, prompt_kind):
    prompt = PROMPT if prompt_kind == "text" else offline_expectations["ids"]
    response = client.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = response.choices[0]
    assert choice.text == PROMPT
    lp = choice.logprobs
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(offline_expectations["ids"])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(_expected(offline_expectations)[1:], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for entry, chosen in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]):  # top 1: the best, at least the target
        assert len(entry) == 1 and max(entry.values()) >= chosen - 1e-6
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(lp.tokens)


def test_echo_with_a_completion_and_streamed(client, offline_expectations):
    response = client.completions.create(model="smollm2", prompt=PROMPT, echo=True, logprobs=0, max_tokens=3,
                                         temperature=0)
    lp = response.choices[0].logprobs
    n_prompt = len(offline_expectations["ids"])
    assert len(lp.tokens) == n_prompt + 3 and response.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(_expected(offline_expectations)[1:], abs=1e-4)
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs[n_prompt:])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=PROMPT, echo=True, max_tokens=3, temperature=0, stream=True))
    assert streamed == response.choices[0].text


def test_prompt_logprobs_extra_on_both_endpoints(client, offline_expectations):
    completion = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1,
                                           extra_body={"prompt_logprobs": 2})
    entries = completion.model_extra["choices"][0]["prompt_logprobs"] if "choices" in (completion.model_extra or {}) \
        else completion.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(offline_expectations["ids"])
    for token, entry, offline in zip(offline_expectations["ids"][1:], entries[1:],
                                     offline_expectations["prompt_logprobs"][1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(offline[token].logprob, abs=1e-4)
        assert {int(k) for k in entry} == set(offline)  # the prompt token and the top 2
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_scoring_and_bias_limits(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="smollm2", prompt=PROMPT, extra_body=body)
    assert error.value.body["param"] == param
