"""Chat templates at the server: a chat for a model without one is a 400 naming --chat-template
(as vLLM answers), never a made-up format; `brisk serve --chat-template` replaces a model's own,
in the API process that renders chats."""

from __future__ import annotations

import httpx
import openai
import pytest

from brisk.config import EngineConfig
from brisk.model.loader import default_model_path
from brisk.model.tokenizer import NoChatTemplateError
from tests.conftest import build_tiny_checkpoint
from tests.helpers import GEMMA_TURNS, drop_chat_template
from tests.server.conftest import running_server, serve_tiny

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory) -> str:
    return drop_chat_template(build_tiny_checkpoint(str(tmp_path_factory.mktemp("untemplated")), "llama"))


def test_a_chat_for_a_model_without_a_template_is_a_400_naming_the_flag(untemplated, engine_kind):
    engine = engine_kind(EngineConfig(model=untemplated, dtype="float32", num_kv_blocks=64, max_model_len=256))
    try:
        with running_server(engine, served_model_name="tiny") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as raised:
                client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
            assert raised.value.body == {"message": str(NoChatTemplateError()), "type": "invalid_request_error",
                                         "param": "messages", "code": None}
            assert "--chat-template" in raised.value.body["message"]
            counted = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": CHAT}, timeout=60)
            assert counted.status_code == 400 and counted.json()["error"]["message"] == str(NoChatTemplateError())
            completion = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=2)  # a prompt still goes
            assert completion.choices[0].finish_reason in ("stop", "length")
    finally:
        engine.shutdown()


@pytest.mark.real_model
def test_the_chat_template_flag_replaces_the_models_own(tmp_path):
    """The default model (SmolLM2, a ChatML template of its own) served with Gemma's turn format
    from a file: /tokenize renders a chat with it, and a chat completion is prompted with it."""
    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_TURNS, encoding="utf-8")
    process, url = serve_tiny(default_model_path(), "--chat-template", str(template), "--embedding-model", "none",
                              "--no-response-cache", "--served-model-name", "smollm2")
    try:
        counted = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "messages": CHAT}, timeout=60)
        assert counted.status_code == 200, counted.text
        text = httpx.post(f"{url}/detokenize", json={"model": "smollm2", "tokens": counted.json()["tokens"]},
                          timeout=60).json()["prompt"]
        assert text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0)
        assert reply.usage.prompt_tokens == counted.json()["count"]
    finally:
        process.terminate()
        process.wait(timeout=60)
