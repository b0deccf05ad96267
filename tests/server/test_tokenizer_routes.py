"""/v1/models/{id}, /tokenize, /detokenize, /tokenizer_info and /version on the real model, and
served-name aliases: answers equal to the offline tokenizer's, errors in the OpenAI shape."""

from __future__ import annotations

from importlib.metadata import version

import httpx
import openai
import pytest

from tests.helpers import import_or_require
from tests.server.conftest import running_server

pytestmark = pytest.mark.real_model

TEXTS = ["The capital of France is", "Hello,  world! It's a test .", "héllo 😀\n\n<|im_start|>user", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how"}]
ROOT = "SmolLM2-135M-Instruct.Q4_1"  # the checkpoint's file name
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]


@pytest.fixture(scope="module")
def offline_expectations(real_llm):
    """The tokenizer's own answers, taken before the server's loop thread starts."""
    tok = real_llm.tokenizer
    with_specials = [tok.encode(t) for t in TEXTS]
    return {
        "ids": with_specials, "ids_plain": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        "strs": [tok.token_strs(tok.encode(t, add_special_tokens=False)) for t in TEXTS],
        "texts_back": [tok.decode(ids, skip_special_tokens=False) for ids in with_specials],
        "chat": tok.encode_chat(CHAT[:2]), "chat_closed": tok.encode_chat(CHAT, add_generation_prompt=False),
        # continuing the assistant's message: the prompt for a reply, then the message's own tokens, unclosed
        "chat_continued": tok.encode_chat(CHAT[:2]) + tok.encode(CHAT[2]["content"], add_special_tokens=False),
        "chat_template": tok.chat_template, "chat_text": tok.apply_chat_template(CHAT[:2]),
        "eos_id": tok.eos_token_id, "bos_id": tok.bos_token_id,
    }


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


# ----- /v1/models/{id} ----------------------------------------------------------------------------
def test_models_retrieve_returns_the_model_as_listed(client):
    [listed] = client.models.list().data
    retrieved = client.models.retrieve("smollm2")
    assert retrieved.model_dump() == listed.model_dump()
    assert retrieved.id == "smollm2" and retrieved.object == "model" and retrieved.owned_by == "brisk"
    assert retrieved.model_extra == {"root": ROOT, "parent": None, "max_model_len": 2048}


@pytest.mark.parametrize("name", ["gpt-4o", ROOT, "smollm2/extra"])
def test_retrieving_any_other_model_gets_404(client, http, name):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)
    error = _error(http.get(f"/v1/models/{name}"), 404, "model")
    assert error["type"] == "not_found_error" and error["code"] == "model_not_found" and name in error["message"]


# ----- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_a_prompt_equals_the_tokenizer(http, offline_expectations):
    expected = offline_expectations
    for i, text in enumerate(TEXTS):
        body = http.post("/tokenize", json={"prompt": text}).json()
        assert body == {"count": len(expected["ids"][i]), "max_model_len": 2048, "tokens": expected["ids"][i],
                        "token_strs": None}
        plain = http.post("/tokenize", json={"model": "smollm2", "prompt": text, "add_special_tokens": False,
                                             "return_token_strs": True}).json()
        assert plain["tokens"] == expected["ids_plain"][i] and plain["token_strs"] == expected["strs"][i]
    assert http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"] \
        == ["Hello", "Ġworld"]  # vocabulary entries, as transformers' convert_ids_to_tokens gives them


def test_tokenize_messages_renders_the_chat_template(http, offline_expectations):
    expected = offline_expectations
    prompt = http.post("/tokenize", json={"messages": CHAT[:2]}).json()
    assert prompt["tokens"] == expected["chat"] and prompt["count"] == len(expected["chat"])
    closed = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert closed["tokens"] == expected["chat_closed"]
    continued = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()
    assert continued["tokens"] == expected["chat_continued"]
    assert len(closed["tokens"]) > len(continued["tokens"])  # the closing <|im_end|>\n is left off


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_tokenize_counts_the_prompt_chat_completions_builds(http, client, tools):
    """Tools and tool turns included: /tokenize's count is the usage's prompt_tokens."""
    extra = {"tools": tools} if tools else {}
    count = http.post("/tokenize", json={"messages": TOOL_TURNS, **extra}).json()["count"]
    usage = client.chat.completions.create(model="smollm2", messages=TOOL_TURNS, max_tokens=1, **extra).usage
    assert count == usage.prompt_tokens
    if tools:  # the definitions are in the prompt
        assert count > http.post("/tokenize", json={"messages": TOOL_TURNS}).json()["count"] + 20


def test_detokenize_gives_the_text_back_special_tokens_included(http, offline_expectations):
    for ids, text in zip(offline_expectations["ids"], offline_expectations["texts_back"]):
        assert http.post("/detokenize", json={"model": "smollm2", "tokens": ids}).json() == {"prompt": text}
    chat = http.post("/detokenize", json={"tokens": offline_expectations["chat"]}).json()["prompt"]
    assert chat.startswith("<|im_start|>system\nBe brief.<|im_end|>") and chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("token", [-1, 49152, 2**70])
def test_detokenize_rejects_ids_outside_the_vocabulary(http, token):
    error = _error(http.post("/detokenize", json={"tokens": [1, token]}), 400, "tokens")
    assert str(token) in error["message"] and "49151" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "messages": CHAT}, "prompt"),  # one form or the other
    ({"add_special_tokens": True}, "prompt"),
    ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),  # a chat field on a prompt
    ({"prompt": "hi", "tools": [WEATHER]}, "tools"),
    ({"messages": CHAT, "chat_template_kwargs": {}}, "chat_template_kwargs"),  # vLLM's, not brisk's
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": "maybe"}, "add_special_tokens"),
])
def test_invalid_tokenize_requests_get_400_naming_the_field(http, body, param):
    _error(http.post("/tokenize", json=body), 400, param)


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_tokenizer_routes_naming_another_model_get_404(http, path, body):
    error = _error(http.post(path, json={**body, "model": "gpt-4o"}), 404, "model")
    assert error["code"] == "model_not_found"


# ----- /tokenizer_info and /version ---------------------------------------------------------------
def test_tokenizer_info_has_the_tokenizer_config(http, offline_expectations):
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["name_or_path"] == "smollm2"
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert info["chat_template"] == offline_expectations["chat_template"] and info["model_max_length"] == 2048
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>" and len(info["added_tokens_decoder"]) == 17


def test_lm_eval_tokenizes_through_the_server(base_url, offline_expectations):
    """lm-evaluation-harness's local-completions chooses its tokenizer itself: when /tokenizer_info
    has `eos_token` and /tokenize {prompt, add_special_tokens: false} answers `tokens`, it uses the
    server's (lm_eval.utils.RemoteTokenizer: /tokenize, /detokenize, and the eos and bos tokens and
    the chat template read from /tokenizer_info), so it needs no tokenizer of its own."""
    import_or_require("lm_eval", "lm-eval (the test extra)")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    expected = offline_expectations
    lm = LocalCompletionsAPI(model="smollm2", base_url=f"{base_url}/v1/completions")
    assert lm.tokenizer_backend == "remote"
    assert [lm.tok_encode(text) for text in TEXTS] == expected["ids_plain"]
    assert lm.decode_batch(expected["ids_plain"]) == TEXTS
    assert (lm.eot_token_id, lm.prefix_token_id) == (expected["eos_id"], expected["bos_id"])
    assert lm.tokenizer.apply_chat_template(CHAT[:2]) == expected["chat_text"]


def test_version_is_the_installed_package_version(http):
    assert http.get("/version").json() == {"version": version("brisk")}


# ----- aliases ------------------------------------------------------------------------------------
def test_every_alias_is_served_and_responses_name_the_first(real_async_engine):
    names = ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "default"]
    with running_server(real_async_engine, served_model_name=names) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == names
        assert client.models.retrieve(names[1]).id == names[1]  # sent as .../HuggingFaceTB%2FSmolLM2-...
        for name in names:
            completion = client.completions.create(model=name, prompt="The sky is", max_tokens=1, temperature=0)
            assert completion.model == "smollm2"
        assert httpx.post(f"{url}/tokenize", json={"model": names[2], "prompt": "hi"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="SmolLM2", prompt="The sky is", max_tokens=1)
