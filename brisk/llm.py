"""LLM: the offline API, shaped like vLLM's so scripts can switch with an import change.

    from brisk import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    vectors = llm.embed(["Hello"])                # all-MiniLM-L6-v2, loaded at the first call
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from typing import Sequence

from tqdm import tqdm

from brisk.assembly import build_engine
from brisk.config import EngineConfig
from brisk.engine.adapters import LoRARequest
from brisk.embed.embedder import Embedder, Embedding
from brisk.engine.engine import LLMEngine, Prompt
from brisk.engine.output import RequestOutput
from brisk.engine.stats import BatchMetrics, StepSizes
from brisk.model.tokenizer import Message, chat_messages
from brisk.sample.params import OutputKind, SamplingError, SamplingParams


BATCHING_MODES = ("continuous", "static", "sorted")


class LLM:
    def __init__(self, model: str | None = None, *, embedding_model: str | None = None, **engine_options):
        """model: the generation model; embedding_model: the sentence-transformers folder
        `embed` uses (default all-MiniLM-L6-v2); engine_options: EngineConfig's fields."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_options) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.engine: LLMEngine = build_engine(EngineConfig(model=model, **engine_options))
        self.embedding_model = embedding_model
        self._embedder: Embedder | None = None
        self.batch_metrics: BatchMetrics | None = None  # of the last generate / chat call

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls(**{f.name: getattr(config, f.name) for f in fields(EngineConfig)})

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, batching: str = "continuous", batch_size: int = 16,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order. lora_request: the adapter every
        prompt runs with, or one (or None, the base model) per prompt; the engine needs
        enable_lora (as vLLM's). priority: one per prompt, lower first, acted on under
        scheduling_policy "priority" (or within a tenant under "fair"), as vLLM's. batching: `continuous` (the
        engine's scheduler refills a finished sequence's slot at once), `static` (groups of
        batch_size in prompt order, each finishing before the next starts, as a padded batch
        runs), or `sorted` (the same groups, formed by prompt length). Afterwards
        `self.batch_metrics` describes the run."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (anything else than a list is refused naming `prompt`)
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {batching!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        params = _per_prompt(sampling_params, len(prompts))
        adapters = _per_prompt(lora_request, len(prompts), LoRARequest)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts) or not all(type(p) is int for p in priorities):
            raise ValueError(f"priority must be one int per prompt ({len(prompts)}), got {priority!r}")
        order = list(range(len(prompts)))
        if batching == "sorted":
            order.sort(key=lambda i: self._prompt_len(prompts[i]))
        groups = [order] if batching == "continuous" else [order[i:i + batch_size] for i in range(0, len(order),
                                                                                                   batch_size)]
        steps = StepSizes()
        self.engine.stat_loggers.append(steps)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm or len(prompts) < 2)
        start, done = time.monotonic(), {}
        try:
            for group in groups:
                ids: list[str] = []
                try:
                    for i in group:
                        ids.append(self.engine.add_request(prompts[i], replace(params[i],
                                                                               output_kind=OutputKind.FINAL_ONLY),
                                                           lora_request=adapters[i], priority=priorities[i]))
                except BaseException:  # a refused prompt takes back those added before it: none runs later
                    for request_id in ids:
                        self.engine.abort_request(request_id)
                    raise
                done.update(zip(group, self._run(ids, bar)))
        finally:
            bar.close()
            self.engine.stat_loggers.remove(steps)
        outputs = [done[i] for i in range(len(prompts))]
        slots = self.engine.config.max_num_seqs if batching == "continuous" else batch_size
        self.batch_metrics = _batch_metrics(batching, outputs, [] if batching == "continuous" else groups,
                                            steps.sizes, slots, start)
        return outputs

    def _prompt_len(self, prompt: Prompt) -> int:
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            return len(ids) if ids is not None else len(self.tokenizer.encode(prompt["prompt"]))
        return len(prompt)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, batching: str = "continuous",
             batch_size: int = 16, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered with the chat template
        (batching, batch_size and lora_request: as in generate)."""
        one = not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        try:  # checked as the server checks a chat's JSON: a 400 there, a SamplingError here
            conversations = [chat_messages(c) for c in conversations]
        except (TypeError, ValueError) as exc:
            raise SamplingError("messages", str(exc)) from None
        prompts = [{"prompt": self.tokenizer.apply_chat_template(c, add_generation_prompt),
                    "prompt_token_ids": self.tokenizer.encode_chat(c, add_generation_prompt)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, batching, batch_size, lora_request)

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], truncate: bool = True) -> list[Embedding]:
        """Sentence embeddings of texts (or token-id lists), in order: Embedder.embed on the
        embedding model, loaded at the first call."""
        if self._embedder is None:
            self._embedder = Embedder(self.embedding_model)
        return self._embedder.embed(inputs, truncate)

    def _run(self, request_ids: list[str], bar: tqdm) -> list[RequestOutput]:
        """Steps the engine until it has nothing left; these requests' outputs, in order."""
        done: dict[str, RequestOutput] = {}
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
        return [done[i] for i in request_ids]


def _batch_metrics(batching: str, outputs: list[RequestOutput], groups: list[list[int]], step_sizes: list[int],
                   slots: int, start: float) -> BatchMetrics:
    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    padded = real = 0
    for group in groups:
        prompt_lens = [len(outputs[i].prompt_token_ids) for i in group]
        padded += len(group) * (max(prompt_lens) + max(output_lens[i] for i in group))
        real += sum(prompt_lens) + sum(output_lens[i] for i in group)
    finished = [o.metrics.finished_time for o in outputs if o.metrics.finished_time is not None]
    mean_batch = sum(step_sizes) / max(1, len(step_sizes))
    return BatchMetrics(batching, len(outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs),
                        time.monotonic() - start, len(step_sizes), mean_batch, mean_batch / slots,
                        1 - real / padded if padded else 0.0, sum(f - start for f in finished) / max(1, len(finished)))


def _per_prompt(values, count: int, kind: type = SamplingParams) -> list:
    """One value of `kind` per prompt: the default (SamplingParams(), or None for another kind),
    one for all, or a sequence of `count`."""
    if values is None:
        return [SamplingParams() if kind is SamplingParams else None] * count
    if isinstance(values, kind):
        return [values] * count
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, kind) or (v is None and kind is not SamplingParams) for v in values):
        raise TypeError(f"expected a {kind.__name__} or a list of them, one per prompt; got {values!r:.80}")
    if len(values) != count:
        raise ValueError(f"got {len(values)} {kind.__name__} values for {count} prompts")
    return list(values)
