"""Real clients against a real brisk server on the real model.

- LangChain's ChatOpenAI: with_structured_output (json_schema, function_calling, json_mode) and
  bind_tools (every tool_choice, parallel_tool_calls, streaming, a tool-call history);
- lm-evaluation-harness's `local-completions` on a 10-question multiple-choice task read from
  tests/server/data (no hub download), with the HF tokenizer of the model saved to a folder;
- the echo + logprobs responses lm-eval reads, in OpenAI's legacy-completions / vLLM shape;
- the request bodies LangChain, litellm, lm-eval and guidellm were recorded sending
  (tests/server/data/client_requests.json), which the strict field check must accept.

What the clients need back (checked against langchain-openai 1.7.3 / openai 3.52, lm-eval 0.4.13):
- tool calls: `message.tool_calls[i] = {"id", "type": "function", "function": {"name", "arguments"}}`
  with `arguments` a JSON *string* (an object fails pydantic in LangChain); `id` is what the next
  turn's tool message quotes, so it must be there and unique. Streamed: the id and name only in a
  call's first delta (LangChain concatenates a name repeated in later deltas), each delta with
  `index`.
- json_schema: the openai SDK's `parse()` reads `message.content` as JSON (a server-side
  `parsed` is ignored); `finish_reason: "length"` raises LengthFinishReasonError, a non-null
  `refusal` raises OpenAIRefusalError, null content without refusal raises ValueError.
- lm-eval loglikelihood: `choices` sorted by `index` in prompt order;
  `logprobs.token_logprobs[ctxlen:-1]` summed, so the echo must hold one entry per prompt token
  plus exactly one for the generated token (also when that token is EOS); `top_logprobs[i]` a
  {token: logprob} dict whose max equals `token_logprobs[i]` exactly when the token is greedy.

The optional clients' tests skip where they are not installed, and fail under CI
(tests/helpers.require).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from brisk import SamplingParams
from tests.helpers import import_or_require

pytestmark = pytest.mark.real_model

DATA = Path(__file__).parent / "data"
MODEL = "smollm2"
ECHO_TEXT = "The capital of France is"
EOS_QUESTION = [{"role": "user", "content": "Reply with one word: what is the capital of France?"}]
EOS_REPLY = "Paris."  # greedy SmolLM2-135M-Instruct follows this with <|im_end|>, its EOS
IGNORED_FIELDS = {"user": "someone", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# ----- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tokenizer_dir(real_hf_tokenizer, tmp_path_factory) -> str:
    """The model's tokenizer as an HF folder, for lm-eval's tokenizer_backend=huggingface."""
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    real_hf_tokenizer.save_pretrained(folder)
    return str(folder)


def _mc_docs() -> list[dict]:
    return [json.loads(line) for line in (DATA / "brisk_mc.jsonl").read_text().splitlines() if line.strip()]


def _lm_eval_requests(tokenizer_dir: str) -> dict[tuple[str, str], tuple[list[int], int]]:
    """(context, continuation) -> (token ids lm-eval sends, ctxlen), tokenized by lm-eval itself."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # An explicit tokenizer_backend: the constructor contacts no server.
    lm = LocalCompletionsAPI(model=MODEL, base_url="http://127.0.0.1:9/v1/completions",
                             tokenizer_backend="huggingface", tokenizer=tokenizer_dir)
    requests = {}
    for doc in _mc_docs():
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            context_ids, continuation_ids = lm._encode_pair(context, " " + choice)
            requests[(context, " " + choice)] = (context_ids + continuation_ids, len(context_ids))
    return requests


@pytest.fixture(scope="module")
def offline_expectations(real_llm, request):
    """Prompt logprobs and greedy tokens from the offline API, taken before the server's loop
    thread starts (from then on only that thread may touch the engine)."""
    tok = real_llm.tokenizer
    probe = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1)

    def run(ids: list[int]):
        return real_llm.generate({"prompt_token_ids": ids}, probe, use_tqdm=False)[0]

    echo_ids = tok.encode(ECHO_TEXT)
    eos_ids = tok.encode(tok.apply_chat_template(EOS_QUESTION, True) + EOS_REPLY, add_special_tokens=False)
    batch = [tok.encode(t) for t in ("Once upon a time", "One, two, three, four, five,", "Hello")]
    expectations = {
        "echo_ids": echo_ids, "echo": run(echo_ids),
        "eos_ids": eos_ids, "eos": run(eos_ids), "eos_token_ids": tok.eos_token_ids,
        "batch_ids": batch, "batch": [run(ids) for ids in batch],
        "lm_eval": None,
    }
    if _have("lm_eval"):
        tokenizer_dir = request.getfixturevalue("hf_tokenizer_dir")
        lm_requests = _lm_eval_requests(tokenizer_dir)
        keys = list(lm_requests)
        outs = real_llm.generate([{"prompt_token_ids": lm_requests[k][0]} for k in keys],
                                 [probe] * len(keys), use_tqdm=False)
        loglikelihoods = {}
        for key, out in zip(keys, outs):
            ids, ctxlen = lm_requests[key]
            entries = [out.prompt_logprobs[i] for i in range(ctxlen, len(ids))]
            loglikelihoods[key] = (sum(e[ids[ctxlen + j]].logprob for j, e in enumerate(entries)),
                                   all(e[ids[ctxlen + j]].rank == 1 for j, e in enumerate(entries)))
        expectations["lm_eval"] = {"tokenizer_dir": tokenizer_dir, "loglikelihoods": loglikelihoods}
    return expectations


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


# ----- what lm-eval reads: echo + logprobs on /v1/completions -------------------------------------
def _lm_eval_body(prompt, max_tokens: int = 1) -> dict:
    """Exactly what lm-eval 0.4.13's local-completions sends for loglikelihood requests."""
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}


def _prompt_logprob(out, i: int) -> float:
    return out.prompt_logprobs[i][out.prompt_token_ids[i]].logprob


def _check_echo(choice: dict, ids: list[int], offline, generated: int) -> None:
    lp = choice["logprobs"]
    n = len(ids) + generated
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(_prompt_logprob(offline, i), abs=1e-4)
        top = lp["top_logprobs"][i]
        # OpenAI: the top `logprobs` tokens, plus the chosen one (so up to logprobs + 1); vLLM the same.
        assert isinstance(top, dict) and 1 <= len(top) <= 2
        best = max(e.logprob for e in offline.prompt_logprobs[i].values())
        assert max(top.values()) == pytest.approx(best, abs=1e-4)
        if offline.prompt_logprobs[i][ids[i]].rank == 1:  # lm-eval's is_greedy compares these exactly
            assert lp["token_logprobs"][i] == max(top.values())
    # text_offset: where each token starts in the choice's text (prompt + completion)
    assert lp["text_offset"][0] == 0
    for i in range(1, n):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])


def test_echo_gives_every_prompt_token_and_the_generated_one(http, offline_expectations):
    ids, offline = offline_expectations["echo_ids"], offline_expectations["echo"]
    r = http.post("/v1/completions", json=_lm_eval_body([ids]))
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    _check_echo(choice, ids, offline, generated=1)
    completion = offline.outputs[0]
    assert choice["text"] == ECHO_TEXT + completion.text  # vLLM: prompt text + completion text
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(
        completion.logprobs[0][completion.token_ids[0]].logprob, abs=1e-4)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1


def test_echo_with_max_tokens_zero_scores_the_prompt_only(http, offline_expectations):
    ids, offline = offline_expectations["echo_ids"], offline_expectations["echo"]
    r = http.post("/v1/completions", json=_lm_eval_body(ids, max_tokens=0))
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    _check_echo(choice, ids, offline, generated=0)
    assert choice["text"] == ECHO_TEXT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    # without logprobs: the prompt's text alone
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ECHO_TEXT, "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ECHO_TEXT and r.json()["choices"][0]["logprobs"] is None


def test_echo_keeps_a_generated_eos_token(http, offline_expectations):
    """lm-eval drops the last entry as the generated token: an EOS left out of the logprobs would
    shift every loglikelihood by one token, silently."""
    ids, offline = offline_expectations["eos_ids"], offline_expectations["eos"]
    # the prompt is chosen so that the pinned model's greedy answer is EOS at once
    assert offline.outputs[0].token_ids[0] in offline_expectations["eos_token_ids"]
    r = http.post("/v1/completions", json=_lm_eval_body([ids]))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "stop"
    _check_echo(choice, ids, offline, generated=1)
    assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(
        offline.outputs[0].logprobs[0][offline.outputs[0].token_ids[0]].logprob, abs=1e-4)


def test_batched_echo_answers_in_prompt_order(http, offline_expectations):
    """lm-eval's batch_size > 1 sends several token-id prompts and zips choices (sorted by index)
    with its context lengths."""
    batch = offline_expectations["batch_ids"]
    r = http.post("/v1/completions", json=_lm_eval_body(batch))
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(batch)))
    for choice, ids, offline in zip(choices, batch, offline_expectations["batch"]):
        _check_echo(choice, ids, offline, generated=1)


def test_echo_of_a_text_prompt(http, offline_expectations):
    """lm-eval's tokenized_requests=False sends the text; the server tokenizes it the same way."""
    ids, offline = offline_expectations["echo_ids"], offline_expectations["echo"]
    r = http.post("/v1/completions", json=_lm_eval_body(ECHO_TEXT))
    assert r.status_code == 200, r.text
    _check_echo(r.json()["choices"][0], ids, offline, generated=1)


def test_prompt_logprobs_in_vllm_shape(http, offline_expectations):
    """vLLM's `prompt_logprobs` extension: per choice on /v1/completions, one entry per prompt token,
    the first null, each {token id: {"logprob", "rank", "decoded_token"}} with the prompt token and
    the top k."""
    ids, offline = offline_expectations["echo_ids"], offline_expectations["echo"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    prompt_logprobs = r.json()["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        assert str(ids[i]) in entry and 1 <= len(entry) <= 2
        assert set(entry[str(ids[i])]) >= {"logprob", "rank", "decoded_token"}
        assert entry[str(ids[i])]["logprob"] == pytest.approx(_prompt_logprob(offline, i), abs=1e-4)
        assert entry[str(ids[i])]["rank"] == offline.prompt_logprobs[i][ids[i]].rank


# ----- lm-evaluation-harness ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory) -> str:
    """The task YAMLs with their data paths made absolute: datasets resolves a relative data_files
    path against the current directory."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name in ("brisk_mc", "brisk_gen"):
        text = (DATA / f"{name}.yaml").read_text()
        text = text.replace(f"tests/server/data/{name}.jsonl", str(DATA / f"{name}.jsonl"))
        text = text.replace("  data_files:", f"  cache_dir: {folder / 'datasets-cache'}\n  data_files:")
        (folder / f"{name}.yaml").write_text(text)
    return str(folder)


@pytest.mark.parametrize("client_options", [{}, {"batch_size": 4}, {"num_concurrent": 2}],
                         ids=["one prompt a request", "four prompts a request", "two concurrent requests"])
def test_lm_eval_local_completions_multiple_choice(base_url, offline_expectations, lm_eval_tasks, client_options,
                                                   monkeypatch):
    """The equivalent command, from the repository root, against a running `brisk serve`:
    lm-eval run --model local-completions --tasks brisk_mc --include_path tests/server/data \\
      --model_args model=smollm2,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=DIR
    """
    import_or_require("lm_eval", "lm-eval (the test extra)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    expected = offline_expectations["lm_eval"]
    lm = LocalCompletionsAPI(model=MODEL, base_url=f"{base_url}/v1/completions", tokenizer_backend="huggingface",
                             tokenizer=expected["tokenizer_dir"], max_retries=1, **client_options)
    results = lm_eval.simple_evaluate(model=lm, tasks=["brisk_mc"], bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=lm_eval_tasks, include_defaults=False))
    samples = results["samples"]["brisk_mc"]
    docs = _mc_docs()
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))
    correct, correct_norm = 0, 0
    for sample in samples:
        doc = docs[sample["doc_id"]]
        lls = []
        for (context, continuation), (ll, greedy) in zip(sample["arguments"], sample["filtered_resps"]):
            want_ll, want_greedy = expected["loglikelihoods"][(context, continuation)]
            assert ll == pytest.approx(want_ll, abs=1e-3) and greedy == want_greedy
            lls.append(want_ll)
        correct += max(range(len(lls)), key=lambda i: lls[i]) == doc["answer"]
        normed = [ll / len(choice) for ll, choice in zip(lls, doc["choices"])]
        correct_norm += max(range(len(normed)), key=lambda i: normed[i]) == doc["answer"]
    metrics = results["results"]["brisk_mc"]
    assert metrics["acc,none"] == pytest.approx(correct / len(docs))
    assert metrics["acc_norm,none"] == pytest.approx(correct_norm / len(docs))


def _gen_docs() -> list[dict]:
    return [json.loads(line) for line in (DATA / "brisk_gen.jsonl").read_text().splitlines() if line.strip()]


def _gen_context(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"  # brisk_gen.yaml's doc_to_text


GEN_TOKENS = 16  # brisk_gen.yaml's max_gen_toks


def test_lm_eval_local_completions_generation(base_url, http, offline_expectations, lm_eval_tasks, monkeypatch):
    """generate_until through local-completions: token-id prompts, stop = ["\\n", EOS text], seed."""
    import_or_require("lm_eval", "lm-eval (the test extra)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(model=MODEL, base_url=f"{base_url}/v1/completions", tokenizer_backend="huggingface",
                             tokenizer=offline_expectations["lm_eval"]["tokenizer_dir"], max_retries=1)
    results = lm_eval.simple_evaluate(model=lm, tasks=["brisk_gen"], bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=lm_eval_tasks, include_defaults=False))
    samples = results["samples"]["brisk_gen"]
    assert sorted(s["doc"]["question"] for s in samples) == sorted(d["question"] for d in _gen_docs())
    for sample in samples:  # what the server answers the same token ids, greedy, stopping at a line end
        context = _gen_context(sample["doc"])
        body = {"model": MODEL, "prompt": lm.tok_encode(context), "max_tokens": GEN_TOKENS, "temperature": 0,
                "stop": ["\n"]}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert sample["resps"][0][0] == r.json()["choices"][0]["text"], context


def test_lm_eval_local_chat_completions_generation(base_url, http, lm_eval_tasks, monkeypatch):
    """local-chat-completions (needs apply_chat_template): messages, max_tokens, stop, seed."""
    import_or_require("lm_eval", "lm-eval (the test extra)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-chat-completions", model_args={"model": MODEL, "base_url": f"{base_url}/v1/chat/completions",
                                                    "max_retries": 1},
        tasks=["brisk_gen"], apply_chat_template=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=lm_eval_tasks, include_defaults=False))
    samples = results["samples"]["brisk_gen"]
    assert sorted(s["doc"]["question"] for s in samples) == sorted(d["question"] for d in _gen_docs())
    for sample in samples:  # what the server answers the question as a user message, greedy
        messages = [{"role": "user", "content": _gen_context(sample["doc"])}]
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": GEN_TOKENS,
                                                    "temperature": 0, "stop": ["\n"]})
        assert r.status_code == 200, r.text
        assert sample["resps"][0][0] == r.json()["choices"][0]["message"]["content"], messages


# ----- LangChain ---------------------------------------------------------------------------------
class CityAnswer(BaseModel):
    """The answer to a question about a city."""

    city: Literal["Paris", "London", "Berlin"]
    is_capital: bool


QUESTION = "Which of Paris, London and Berlin is in France, and is it the capital?"
WEATHER = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def sent() -> list[dict]:
    """What the LangChain client posted and, unless streamed, what the server answered, as
    {"body", "answer"}, the latest last."""
    return []


@pytest.fixture(scope="module")
def chat(base_url, sent):
    langchain_openai = import_or_require("langchain_openai", "langchain-openai (the test extra)")

    def request(r: httpx.Request) -> None:
        sent.append({"body": json.loads(r.read()), "answer": None})

    def response(r: httpx.Response) -> None:
        if not sent[-1]["body"].get("stream"):
            sent[-1]["answer"] = json.loads(r.read())

    recording = httpx.Client(timeout=120, event_hooks={"request": [request], "response": [response]})
    yield langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", temperature=0,
                                      max_tokens=96, max_retries=0, http_client=recording)
    recording.close()


def _served(http, exchange: dict) -> tuple[dict, dict]:
    """The server's answer to a body a client sent: the one it received, or for a stream, the
    body posted again unstreamed (greedy, so the same answer). (its choice, its usage)"""
    body, answer = exchange["body"], exchange["answer"]
    if answer is None:
        r = http.post("/v1/chat/completions", json={k: v for k, v in body.items()
                                                    if k not in ("stream", "stream_options")})
        assert r.status_code == 200, r.text
        answer = r.json()
    choice, usage = answer["choices"][0], answer["usage"]
    # usage agrees with the answer: a "length" finish used the whole budget, any other fewer
    budget = body.get("max_completion_tokens") or body["max_tokens"]
    assert usage["completion_tokens"] == budget if choice["finish_reason"] == "length" else \
        0 < usage["completion_tokens"] <= budget
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return choice, usage


def _assert_as_served(message, http, exchange: dict) -> dict:
    """LangChain's message says what the server answered: the same text, the same tool calls
    (names and parsed arguments), finish reason and token counts. Returns the choice."""
    choice, usage = _served(http, exchange)
    assert message.content == (choice["message"]["content"] or "")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"].get("tool_calls") or []]
    assert [(c["name"], c["args"]) for c in message.tool_calls] == calls
    if "finish_reason" in message.response_metadata:  # a streamed message carries it too
        assert message.response_metadata["finish_reason"] == choice["finish_reason"]
    if message.usage_metadata:
        assert (message.usage_metadata["input_tokens"], message.usage_metadata["output_tokens"]) == (
            usage["prompt_tokens"], usage["completion_tokens"])
    return choice


@pytest.fixture(scope="module")
def tools():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return [get_weather, add]


def _check_tool_calls(message, tool_names: set[str]) -> None:
    assert message.tool_calls and not message.invalid_tool_calls
    ids = [c["id"] for c in message.tool_calls]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
    for call in message.tool_calls:
        assert call["name"] in tool_names
        if call["name"] == "get_weather":
            assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
        elif call["name"] == "add":
            assert set(call["args"]) == {"a", "b"} and all(type(v) is int for v in call["args"].values())


def test_langchain_structured_output_json_schema(chat, http, sent):
    """The default method: response_format json_schema with strict: true."""
    result = chat.with_structured_output(CityAnswer, include_raw=True).invoke(QUESTION)
    assert result["parsing_error"] is None
    raw = result["raw"]
    assert sent[-1]["body"]["response_format"]["json_schema"]["strict"] is True
    _assert_as_served(raw, http, sent[-1])
    assert raw.response_metadata["finish_reason"] == "stop"
    assert result["parsed"] == CityAnswer.model_validate_json(raw.content)
    assert raw.additional_kwargs.get("refusal") is None


def test_langchain_structured_output_json_schema_streamed(chat, http, sent):
    chunks = list(chat.with_structured_output(CityAnswer).stream(QUESTION))
    assert sent[-1]["body"]["stream"] is True
    choice, _ = _served(http, sent[-1])
    assert chunks[-1] == CityAnswer.model_validate_json(choice["message"]["content"])


def test_langchain_structured_output_function_calling(chat, http, sent):
    """A forced named tool (tool_choice {"type": "function", ...}) with parallel_tool_calls false."""
    result = chat.with_structured_output(CityAnswer, method="function_calling", include_raw=True).invoke(QUESTION)
    assert result["parsing_error"] is None
    raw = result["raw"]
    _assert_as_served(raw, http, sent[-1])
    assert len(raw.tool_calls) == 1 and raw.tool_calls[0]["name"] == "CityAnswer"
    assert result["parsed"] == CityAnswer(**raw.tool_calls[0]["args"])
    assert isinstance(raw.tool_calls[0]["id"], str) and raw.tool_calls[0]["id"]
    # OpenAI answers "stop" for a named tool_choice; vLLM "stop" or "tool_calls"
    assert raw.response_metadata["finish_reason"] in ("stop", "tool_calls")


def test_langchain_structured_output_json_mode(chat, http, sent):
    """response_format json_object: any JSON object (a schema given as a dict comes back as a dict)."""
    schema = {"title": "CityAnswer", "type": "object", "properties": {"city": {"type": "string"}}}
    result = chat.with_structured_output(schema, method="json_mode").invoke(
        QUESTION + " Answer in JSON with a key 'city'.")
    assert sent[-1]["body"]["response_format"] == {"type": "json_object"}
    choice, _ = _served(http, sent[-1])
    assert result == json.loads(choice["message"]["content"]) and isinstance(result, dict)


def test_langchain_tools_required(chat, tools, http, sent):
    """LangChain's tool_choice="any" is sent as "required"."""
    message = chat.bind_tools(tools, tool_choice="any").invoke(WEATHER)
    _assert_as_served(message, http, sent[-1])
    _check_tool_calls(message, {"get_weather", "add"})
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_tools_named(chat, tools, http, sent):
    message = chat.bind_tools(tools, tool_choice="add").invoke("What is 2 plus 3?")
    _assert_as_served(message, http, sent[-1])
    _check_tool_calls(message, {"add"})
    assert len(message.tool_calls) == 1


def test_langchain_tools_none(chat, tools, http, sent):
    message = chat.bind_tools(tools, tool_choice="none").invoke(WEATHER)
    _assert_as_served(message, http, sent[-1])
    assert not message.tool_calls and message.content
    assert message.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_tools_auto(chat, tools, http, sent):
    """No tool_choice (auto): either text or well-formed calls, with the matching finish_reason."""
    message = chat.bind_tools(tools).invoke(WEATHER)
    _assert_as_served(message, http, sent[-1])
    if message.tool_calls:
        _check_tool_calls(message, {"get_weather", "add"})
        assert message.response_metadata["finish_reason"] == "tool_calls"
    else:
        assert not message.invalid_tool_calls and message.content
        assert message.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_tools_not_parallel(chat, tools, http, sent):
    message = chat.bind_tools(tools, tool_choice="any", parallel_tool_calls=False).invoke(WEATHER)
    _assert_as_served(message, http, sent[-1])
    _check_tool_calls(message, {"get_weather", "add"})
    assert len(message.tool_calls) == 1


def test_langchain_tools_streamed(chat, tools, http, sent):
    """delta.tool_calls: id and name once per call (LangChain concatenates names), arguments in pieces."""
    message = None
    chunks = 0
    for chunk in chat.bind_tools(tools, tool_choice="get_weather").stream(WEATHER):
        message = chunk if message is None else message + chunk
        chunks += 1
    assert chunks > 1 and sent[-1]["body"]["stream"] is True
    _assert_as_served(message, http, sent[-1])
    assert all(c.get("index") is not None for c in message.tool_call_chunks)
    _check_tool_calls(message, {"get_weather"})
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]


def test_langchain_tool_call_history(chat, tools, http, sent):
    """A second turn carrying the assistant's tool_calls (content null) and the tool's answer."""
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat.bind_tools(tools, tool_choice="get_weather")
    first = bound.invoke(WEATHER)
    _assert_as_served(first, http, sent[-1])
    _check_tool_calls(first, {"get_weather"})
    history = [HumanMessage(WEATHER), first,
               *[ToolMessage(content="sunny, 24 C", tool_call_id=c["id"]) for c in first.tool_calls]]
    second = chat.bind_tools(tools).invoke(history)
    body = sent[-1]["body"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] + ["tool"] * len(first.tool_calls)
    assert body["messages"][1]["tool_calls"][0]["id"] == first.tool_calls[0]["id"]
    assert body["messages"][2]["tool_call_id"] == first.tool_calls[0]["id"]
    _assert_as_served(second, http, sent[-1])
    assert second.content or second.tool_calls


# ----- the bodies the clients send ---------------------------------------------------------------
CLIENT_REQUESTS = json.loads((DATA / "client_requests.json").read_text())


def _bounded(body: dict) -> dict:
    """The recorded body, with a token budget where the client set none (the server's default is
    the rest of the context): enough for a tool call or a small JSON object."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        budget = 64 if body.get("tools") or body.get("response_format") else 8
        body = {**body, "max_tokens": budget}
    return body


@pytest.mark.parametrize("recorded", CLIENT_REQUESTS, ids=[f"{r['client']}: {r['use']}" for r in CLIENT_REQUESTS])
def test_recorded_client_bodies_are_accepted(http, recorded):
    body = _bounded(recorded["body"])
    if body.get("stream"):
        with http.stream("POST", recorded["path"], json=body) as r:
            text = r.read().decode()
        assert r.status_code == 200, text
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any("error" in json.loads(e) for e in events[:-1])
    else:
        r = http.post(recorded["path"], json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_unknown_fields_are_rejected_by_name(http, path, body):
    r = http.post(path, json={"model": MODEL, "max_tokens": 2, **body, "frobnicate": 1})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error.get("param") == "frobnicate" or "frobnicate" in error["message"]


def test_routinely_sent_fields_are_ignored(http):
    """Ignored: the answer is the one to the same body without them."""
    for path, body, extra in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, IGNORED_FIELDS),
        ("/v1/completions", {"prompt": "Hi"}, {"user": "someone"}),
    ]:
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0, **body}
        plain, with_extra = http.post(path, json=body), http.post(path, json={**body, **extra})
        assert plain.status_code == with_extra.status_code == 200, with_extra.text
        assert with_extra.json()["choices"] == plain.json()["choices"]
        assert with_extra.json()["usage"] == plain.json()["usage"]


def test_client_requests_file_covers_every_client():
    assert {r["client"] for r in CLIENT_REQUESTS} == {"langchain-openai", "litellm", "lm-eval", "guidellm"}
    assert all(r["path"] in ("/v1/chat/completions", "/v1/completions") for r in CLIENT_REQUESTS)
