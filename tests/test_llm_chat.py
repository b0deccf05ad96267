"""The offline API on a tiny Llama whose tokenizer has an <end_of_turn> special token its files do
not name as EOS, and no chat template: where generation stops, and what LLM.chat renders."""

from __future__ import annotations

import json
import os

import pytest

from brisk import LLM, SamplingParams
from brisk.model.loader import open_checkpoint
from brisk.model.tokenizer import NoChatTemplateError
from brisk.sample.params import SamplingError
from tests.conftest import build_tiny_checkpoint
from tests.helpers import drop_chat_template

END_OF_TURN = 5  # the id "w5" has in the tiny vocabulary, renamed
TURNS = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} <end_of_turn> {% endfor %}"
         "{% if add_generation_prompt %}<s> assistant{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    folder = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-chat")), "llama")
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    vocab["<end_of_turn>"] = vocab.pop(f"w{END_OF_TURN}")
    tokenizer["added_tokens"].append({"id": END_OF_TURN, "content": "<end_of_turn>", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    return drop_chat_template(folder)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(folder, dtype="float32", num_kv_blocks=64, max_model_len=128)


def test_a_folders_stop_tokens_are_its_eos_and_its_end_of_turn_token(folder):
    assert open_checkpoint(folder).tokenizer.eos_token_ids == [2, END_OF_TURN]


@pytest.mark.parametrize("ignore_eos, expected, finish_reason", [(False, [END_OF_TURN], "stop"),
                                                                  (True, [END_OF_TURN] * 6, "length")])
def test_generation_stops_at_the_end_of_turn_token_unless_told_to_ignore_eos(llm, ignore_eos, expected,
                                                                            finish_reason):
    params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={END_OF_TURN: 100.0}, ignore_eos=ignore_eos)
    [completion] = llm.generate("w10 w11", params, use_tqdm=False)[0].outputs
    assert (completion.token_ids, completion.finish_reason) == (expected, finish_reason)


def test_a_chat_with_a_model_without_a_template_names_the_option(llm):
    with pytest.raises(NoChatTemplateError, match=r"no chat template: give one with --chat-template "
                                                  r"\(chat_template= in Python\)"):
        llm.chat([{"role": "user", "content": "w7"}], use_tqdm=False)


def test_a_chat_template_given_to_llm_renders_the_chat(folder):
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_model_len=128, chat_template=TURNS)
    [output] = llm.chat([{"role": "user", "content": "w7 w8"}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert output.prompt == "<s> user w7 w8 <end_of_turn> <s> assistant"
    assert output.prompt_token_ids == [1, 0, 7, 8, END_OF_TURN, 1, 0]  # "user" and "assistant": <unk>


def test_llm_chat_takes_and_refuses_messages_as_the_server_does(folder):
    """OpenAI's text parts are joined and None is empty (the server's chat route does the same);
    a message without a known role, or content of another shape, is a SamplingError naming
    `messages`, not a template's error or a bare TypeError."""
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_model_len=128, chat_template=TURNS)
    params = SamplingParams(max_tokens=1)
    parts = [{"type": "text", "text": "w7 "}, {"type": "text", "text": "w8"}]
    assert llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0].prompt == \
        "<s> user w7 w8 <end_of_turn> <s> assistant"
    assert llm.chat([{"role": "user", "content": None}], params, use_tqdm=False)[0].prompt == \
        "<s> user  <end_of_turn> <s> assistant"
    for bad in ([{"content": "w7"}], [{"role": "wizard", "content": "w7"}], "w7", [],
                [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(SamplingError, match="messages: ") as raised:
            llm.chat(bad, params, use_tqdm=False)
        assert raised.value.param == "messages"
