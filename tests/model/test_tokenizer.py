"""Tokenizer built from GGUF metadata against transformers' tokenizer for the same file; chat
templates rendered as transformers renders them; streaming detokenization never splits UTF-8."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "Numbers: 1234567 and 3.14159, dates 2026-11-21.",
    "def f(x):\n    return x ** 2  # square",
    "Unicode: héllo wörld, 日本語, emoji 🙂🚀, Ελληνικά",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "don't won't I'm you're they've we'll it's",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "Tell me more 🙂"}],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(real_llm, real_hf_tokenizer, text):
    assert real_llm.tokenizer.encode(text) == real_hf_tokenizer(text).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(real_llm, real_hf_tokenizer, text):
    ids = real_llm.tokenizer.encode(text)
    assert real_llm.tokenizer.decode(ids, skip_special_tokens=False) == real_hf_tokenizer.decode(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(real_llm, real_hf_tokenizer, conversation, add_generation_prompt):
    ours = real_llm.tokenizer.apply_chat_template(conversation, add_generation_prompt)
    theirs = real_hf_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert real_llm.tokenizer.encode_chat(conversation, add_generation_prompt) == real_hf_tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_special_tokens_and_eos(real_llm):
    tok = real_llm.tokenizer
    assert tok.encode("<|im_end|>") == [2]
    # the file's EOS first, then the special tokens llama.cpp also stops at: <|endoftext|> and the
    # fill-in-the-middle repo-name token
    assert tok.eos_token_ids == [2, 0, 4]
    assert tok.decode([1, 28120, 2]) == tok.decode([28120])  # specials skipped by default


def test_incremental_detokenization_never_emits_partial_characters(real_llm):
    tok = real_llm.tokenizer
    text = "Emoji 🙂🚀 and 日本語 mixed with ascii, then ünïcödé."
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some emoji span several byte tokens: held back, not emitted half
