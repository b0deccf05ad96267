"""LLM: the offline API, shaped like vLLM's so scripts can switch with an import change.

    from brisk import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    vectors = llm.embed(["Hello"])                # all-MiniLM-L6-v2, loaded at the first call
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Sequence

from tqdm import tqdm

from brisk.config import EngineConfig
from brisk.embed.embedder import Embedder, Embedding
from brisk.engine.engine import LLMEngine, Prompt
from brisk.engine.output import RequestOutput
from brisk.model.tokenizer import Message
from brisk.sampling_params import OutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, embedding_model: str | None = None, **engine_options):
        """model: the generation model; embedding_model: the sentence-transformers folder
        `embed` uses (default all-MiniLM-L6-v2); engine_options: EngineConfig's fields."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_options) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.embedding_model = embedding_model
        self._embedder: Embedder | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls(**{f.name: getattr(config, f.name) for f in fields(EngineConfig)})

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        ids = [self.engine.add_request(p, replace(sp, output_kind=OutputKind.FINAL_ONLY))
               for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": self.tokenizer.apply_chat_template(c, add_generation_prompt),
                    "prompt_token_ids": self.tokenizer.encode_chat(c, add_generation_prompt)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], truncate: bool = True) -> list[Embedding]:
        """Sentence embeddings of texts (or token-id lists), in order: Embedder.embed on the
        embedding model, loaded at the first call."""
        if self._embedder is None:
            self._embedder = Embedder(self.embedding_model)
        return self._embedder.embed(inputs, truncate)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in done:
                    self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in request_ids]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
