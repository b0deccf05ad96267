"""vLLM's tokenizer routes, in vLLM's shapes, so clients that count or score tokens
(lm-evaluation-harness's remote tokenizer, guidellm, ...) use the served model's own tokenizer:

    POST /tokenize         {prompt} or {messages} -> {count, max_model_len, tokens, token_strs}
    POST /detokenize       {tokens} -> {prompt}
    GET  /tokenizer_info   tokenizer_config.json's fields: class, special tokens, chat template, ...
    GET  /version          {version}

Text is tokenized and detokenized on a worker thread, with the batch calls that release the GIL,
as generation prompts are (serving.py), so a long text leaves the event loop running.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field

from brisk.server.caching import caller
from brisk.server.errors import APIError
from brisk.server.protocol import ChatCompletionRequest, ChatMessage, Text, Tool, _Body
from brisk.server.serving import Serving

BRISK_VERSION = version("brisk")
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools")


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest ({prompt}) and TokenizeChatRequest ({messages}) in one body:
    exactly one of the two is sent."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # with messages: rendered into the prompt as /v1/chat/completions does
    # Default: true for a prompt; false for messages, whose template writes the special tokens itself.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[int]


def tokenizer_router(serving: Serving) -> APIRouter:
    router = APIRouter()
    api = TokenizerAPI(serving)
    router.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    router.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    router.add_api_route("/tokenizer_info", api.tokenizer_info, methods=["GET"])
    router.add_api_route("/version", api.version, methods=["GET"])
    return router


class TokenizerAPI:
    def __init__(self, serving: Serving):
        self.serving = serving
        self.tokenizer = serving.engine.tokenizer

    async def tokenize(self, body: TokenizeRequest, http: Request) -> dict:
        """No length limit: counting a prompt before sending it, too long or not, is what this is for."""
        self.serving.check_model(body.model, caller(http).tenant)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Send either `prompt` (a text) or `messages` (a conversation), not "
                                f"{'both' if body.prompt is not None else 'neither'}.", param="prompt")
        if body.prompt is not None:
            misplaced = next((f for f in _CHAT_ONLY if f in body.model_fields_set), None)
            if misplaced:
                raise APIError(400, f"{misplaced} applies to `messages` only.", param=misplaced)
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            [ids] = await asyncio.to_thread(self.tokenizer.encode_batch, [body.prompt], add_special)
        else:
            ids = await self._render_chat(body)
        strs = await asyncio.to_thread(self.tokenizer.token_strs, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.serving.engine.model_info.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def _render_chat(self, body: TokenizeRequest) -> list[int]:
        if body.add_generation_prompt and body.continue_final_message:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: send "
                                "add_generation_prompt: false to continue the final message.",
                           param="continue_final_message")
        conversation = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                             add_generation_prompt=body.add_generation_prompt)
        return await self.serving.render_chat(conversation, body.continue_final_message,
                                              bool(body.add_special_tokens))

    async def detokenize(self, body: DetokenizeRequest, http: Request) -> dict:
        """The text of the ids, special tokens included (as vLLM and transformers decode), so a
        rendered chat comes back whole."""
        self.serving.check_model(body.model, caller(http).tenant)
        vocab, tokens = self.tokenizer.vocab_size, body.tokens
        if tokens and not (min(tokens) >= 0 and max(tokens) < vocab):  # min and max run in C: long lists are cheap
            unknown = next(t for t in tokens if not 0 <= t < vocab)
            raise APIError(400, f"tokens: {unknown} is not a token id of this model (0 to {vocab - 1}).",
                           param="tokens")
        [text] = await asyncio.to_thread(self.tokenizer.decode_batch, [tokens], False)
        return {"prompt": text}

    async def tokenizer_info(self) -> dict:
        """What vLLM answers: the tokenizer's configuration (the fields of tokenizer_config.json, the
        limit the server enforces as model_max_length) and its added tokens by id."""
        tokenizer = self.tokenizer
        return {**tokenizer.config(model_max_length=self.serving.engine.model_info.max_model_len),
                "name_or_path": self.serving.model_name,
                "added_tokens_decoder": {str(i): token for i, token in tokenizer.added_tokens().items()}}

    async def version(self) -> dict:
        return {"version": BRISK_VERSION}
