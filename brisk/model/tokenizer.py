"""Tokenizer: `tokenizers` for the text, jinja2 for chat templates, DecodeStream for streaming.

Chat templates are rendered the way transformers renders them (same jinja environment, filters
and globals), so a prompt built here tokenizes to the ids the model was trained to see. Stop
tokens are found as llama.cpp finds them (end_of_generation_ids), for every checkpoint format.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from typing import Any, Iterable

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from brisk.config import CHAT_TEMPLATE_EXTENSIONS, ConfigError

Message = dict[str, Any]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's (the server's ChatMessage takes these)
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")

# The special tokens generation ends at by their text alone, whatever a checkpoint declares: a
# chat model ends its turn with one its files do not always list as EOS (Gemma's <end_of_turn>).
# llama.cpp's list (llama-vocab.cpp: special_eog_ids, with its fill-in-the-middle pad, repo and
# file-separator tokens). llama.cpp also takes a vocabulary's ordinary token of that text (and
# makes it a control token), which would stop Gemma 3 at its HTML tag "</s>"; only special ones count here.
END_OF_GENERATION_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
)
# llama.cpp's exceptions: a token that does not end generation where the others named are present
# (gpt-oss and Solar Open end a turn's message with <|end|> and the turn with <|return|> or <|call|>;
# Gemma 4 closes tool responses with </s>).
_NOT_END_OF_GENERATION = (("<|end|>", ("<|return|>", "<|call|>")), ("<|end|>", ("<|calls|>", "<|flush|>")),
                          ("</s>", ("<|tool_response>",)))


def message_text(content: str | list | None) -> str:
    """A message's content as the chat templates expect it: a text, or OpenAI's content parts
    ({"type": "text", "text": ...}) joined, or none (empty)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)


def chat_messages(messages: object) -> list[Message]:
    """A Python caller's conversation (OpenAI's message dicts) checked and put as the template
    takes it, as the server takes its JSON: a known role, content a text, text parts or none.
    Raises ValueError naming the message and what is wrong with it."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation is a non-empty list of message dicts, got {messages!r:.60}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ValueError(f"message {i} must be a dict whose role is one of {', '.join(CHAT_ROLES)}; "
                             f"got {message!r:.60}")
        content = message.get("content")
        parts = isinstance(content, (list, tuple)) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
        if not (content is None or isinstance(content, str) or parts):
            raise ValueError(f"message {i}'s content must be a text or a list of text parts, got {content!r:.60}")
        checked.append({**message, "content": message_text(content)})
    return checked


def end_of_generation_ids(backend: tokenizers.Tokenizer, declared: Iterable[int | None]) -> list[int]:
    """The ids generation stops at: the checkpoint's own (`declared`, None where absent, the first
    one first), then the special tokens of END_OF_GENERATION_TOKENS, less llama.cpp's exceptions."""
    found = {token.content: i for i, token in sorted(backend.get_added_tokens_decoder().items())
             if token.special and token.content in END_OF_GENERATION_TOKENS}
    ids = dict.fromkeys(i for i in (*declared, *found.values()) if i is not None)
    for token, beside in _NOT_END_OF_GENERATION:
        if token in found and all(t in found for t in beside):
            ids.pop(found[token], None)
    return list(ids)


class NoChatTemplateError(ConfigError):
    """A chat for a model that has no chat template, and none was given."""

    def __init__(self):
        super().__init__("This model has no chat template: give one with --chat-template (chat_template= in "
                         "Python), a Jinja template or a file holding one, or send a plain prompt instead.")


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, eos_token_ids: list[int] | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self.eos_token_ids = list(eos_token_ids or [])
        if not self.eos_token_ids and "eos_token" in self.special_tokens:
            eos = backend.token_to_id(self.special_tokens["eos_token"])
            self.eos_token_ids = [] if eos is None else [eos]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @cached_property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Like encode, but `tokenizers` releases the GIL for batches (not for single texts): call
        this from a worker thread to keep the event loop running during a long tokenization."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Like decode; releases the GIL as encode_batch does."""
        return self.backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entries themselves ("Ġworld", not " world"), as transformers'
        convert_ids_to_tokens gives them."""
        return [self.backend.id_to_token(i) for i in token_ids]

    def added_tokens(self) -> dict[int, str]:
        """Tokens added on top of the model's vocabulary (special or not), by id."""
        return {i: t.content for i, t in sorted(self.backend.get_added_tokens_decoder().items())}

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself (it reads `tools`)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def with_chat_template(self, template: str | None) -> "Tokenizer":
        """This tokenizer, rendering chats with `template` instead of the model's own (EngineConfig's
        chat_template); itself where template is None."""
        if template is None:
            return self
        return Tokenizer(self.backend, chat_template=template, special_tokens=self.special_tokens,
                         eos_token_ids=self.eos_token_ids)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Raises NoChatTemplateError where the model has no template: a made-up format would
        prompt the model with turns it was never trained on."""
        if self.chat_template is None:
            raise NoChatTemplateError()
        return self._compiled_template.render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens,
        )

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """The template writes any BOS itself, so no special tokens are added on top (as in HF)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def config(self, model_max_length: int | None = None) -> dict[str, Any]:
        """tokenizer_config.json's fields, as transformers reads them: what `save` writes and what
        GET /tokenizer_info answers. Every special-token role is present, null where the model
        has none (clients look for `eos_token`)."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  **{role: self.special_tokens.get(role) for role in SPECIAL_TOKEN_ROLES},
                  "chat_template": self.chat_template,
                  # `tokenizers` decodes without transformers' clean-up of spaces before punctuation;
                  # saying so makes transformers decode to the same text as brisk.
                  "clean_up_tokenization_spaces": False}
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        return config

    def save(self, folder: str, model_max_length: int | None = None) -> None:
        """Writes the files a Hugging Face folder's tokenizer is read from (tokenizer.json,
        tokenizer_config.json, generation_config.json), so a folder brisk writes loads anywhere
        a fast tokenizer does (transformers' AutoTokenizer included), this tokenizer's chat
        template and stop tokens included."""
        self.backend.save(os.path.join(folder, "tokenizer.json"))
        for name, content in (("tokenizer_config.json", self.config(model_max_length)),
                              ("generation_config.json", {"eos_token_id": self.eos_token_ids})):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(content, f, indent=2)

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.backend, skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=list(CHAT_TEMPLATE_EXTENSIONS))
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


class IncrementalDetokenizer:
    """Text of one growing token sequence; never emits half a UTF-8 character."""

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool):
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def continue_final_message(rendered: str, messages: list[Message]) -> str:
    """The rendered conversation cut right after the final message's text, without whatever the
    template closes a message with, so the model goes on with that message (transformers'
    `continue_final_message`, with the same rule for a text whose trailing spaces the template trimmed)."""
    final = messages[-1].get("content") or ""
    location = rendered.rfind(final.strip())
    if location < 0:
        raise ValueError("continue_final_message: the final message's text does not appear in the rendered "
                         "conversation")
    if rendered[location:location + len(final.lstrip())] == final:
        return rendered[:location + len(final.lstrip())]
    return rendered[:location + len(final.strip())]


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)
