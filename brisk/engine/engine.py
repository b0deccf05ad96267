"""LLMEngine: requests in, outputs out, one `step()` at a time.

A step is: schedule (which tokens to compute), execute (one model forward + sampling),
update (append tokens, finish, free blocks, detokenize). Everything else hangs off those three,
and techniques that act around a step (speculative decoding) through the step hook
(engine/step_hook.py), which `brisk.assembly.build_engine` plugs in.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from brisk.config import ConfigError, EngineConfig
from brisk.engine.adapters import AdapterCap, AdapterInfo, Adapters, LoRARequest, ReadAdapter, adapter_dtype
from brisk.engine.cuda_graphs import capture_sizes
from brisk.engine.kv_cache import KVCacheManager, KVLayout
from brisk.kernels.kv_cache import kv_bytes_per_token
from brisk.engine.output import OutputProcessor, RequestOutput
from brisk.engine.request import EngineRequest, Request, RequestOptions, RequestStatus
from brisk.engine.runner import ModelRunner, RunnerOutput
from brisk.engine.scheduler import Progress, Scheduler, SchedulerOutput
from brisk.engine.stats import EngineSnapshot, FinishedRequestStats, IterationStats, StatLogger
from brisk.engine.step_hook import NoStepHook, StepHook
from brisk.engine.waiting import waiting_queue
from brisk.model.loader import kernels_name, load_model, open_checkpoint, resolve_precision, resolve_weight_mode
from brisk.sample.grammar import Grammar, GrammarCompiler
from brisk.sample.params import SamplingError, SamplingParams, is_int

Prompt = str | list[int] | dict
DEFAULT_CPU_KV_CACHE_GIB = 1.0

logger = logging.getLogger("brisk.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, step_hook: Callable[[LLMEngine], StepHook] | None = None):
        """step_hook builds the engine's hook from the engine once it is up (brisk.assembly
        builds speculative decoding's); without one a speculative_config is refused rather
        than silently ignored."""
        if config.speculative_config is not None and step_hook is None:
            raise ConfigError("speculative_config needs the speculation step hook: build the engine with "
                              "brisk.assembly.build_engine")
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        self.checkpoint = open_checkpoint(config.model)
        precision = resolve_precision(config, self.checkpoint, self.device)
        self.dtype, self.kv_cache_kind = precision.dtype, precision.kv_cache
        self.hparams = self.checkpoint.hparams
        self.tokenizer = self.checkpoint.tokenizer.with_chat_template(config.chat_template)
        self.max_model_len = config.max_model_len or self.hparams.max_position_embeddings
        mode = self.weight_mode = resolve_weight_mode(config, self.checkpoint, self.device, self.dtype)
        self.model = load_model(self.checkpoint, self.dtype, self.device, self.max_model_len, mode.quantization,
                                mode.group_size, mode.int8_activations)
        logger.info("loaded %s (%s): weights %s: %s; dtype %s; kernels %s",
                    os.path.basename(self.checkpoint.path.rstrip("/")), self.hparams.architecture, mode.name,
                    mode.weights, str(self.dtype).removeprefix("torch."), kernels_name(self.model.kernels, self.device))
        # Sliding-window layers keep their K/V in groups of their own (engine/kv_cache.py)
        self.kv_layout = KVLayout.of(self.hparams.layer_windows, self.hparams.num_layers)
        num_blocks = self._num_kv_blocks()  # after loading: on a GPU the cache gets what the weights leave
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_layout)
        # A speculative step already gains several tokens; its drafters keep state per step.
        passes = 1 if config.speculative_config is not None else config.num_scheduler_steps
        waiting = waiting_queue(config.scheduling_policy, config.tenant_weights)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.attention_cost_context, passes,
                                   AdapterCap(waiting, config.max_loras) if config.enable_lora else waiting)
        self.adapters: Adapters | None = None
        if config.enable_lora:
            self.adapters = Adapters(self.model, adapter_dtype(config.lora_dtype, self.dtype, mode.quantization is not None),
                                     config.max_lora_rank, config.max_cpu_loras, self._adapters_in_use)
            for name, path in config.lora_module_paths().items():
                self.adapters.load(name, path)
        self.runner = ModelRunner(self.model, self.kv, self.kv_cache_kind, self.device)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs(capture_sizes(config.max_num_seqs), self.max_model_len)
        self.step_hook: StepHook = step_hook(self) if step_hook is not None else NoStepHook()
        self._seeds = random.Random(config.seed)  # streams of the sequences that bring no seed
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer.backend, self.hparams.vocab_size, self.tokenizer.eos_token_ids)
        self.stat_loggers: list[StatLogger] = []
        self._ids = itertools.count()

    def _num_kv_blocks(self) -> int:
        """The pool's size in blocks, stated in the log in tokens and bytes. Where it cannot hold
        one sequence of the model's own context and max_model_len was not set, max_model_len is
        lowered to what it holds, with a warning naming both (a configuration that sets only the
        pool's size, or nothing, starts on every host whatever its KV dtype); a max_model_len the
        user set that does not fit is an error."""
        c, s = self.config, self.hparams
        # a block holds its tokens for one group's layers (KVLayout.positions of them)
        bytes_per_token = kv_bytes_per_token(self.kv_cache_kind, self.kv_layout.positions, s.num_kv_heads, s.head_dim)
        if c.num_kv_blocks is not None:  # blocks of every layer; the pool's blocks hold one group's layers
            num_blocks = c.num_kv_blocks * s.num_layers // self.kv_layout.positions
        else:  # less one: the pool's scratch block (engine/runner.py) comes out of the same budget
            num_blocks = int(self._kv_cache_bytes() // (bytes_per_token * c.block_size)) - 1
        needed = self._blocks_for(self.max_model_len)
        if num_blocks < needed:
            fits = self._longest_fitting(num_blocks)
            if c.max_model_len is not None or fits == 0:
                raise ConfigError(
                    f"the KV cache holds {max(num_blocks, 0)} blocks of {c.block_size} tokens, fewer than one sequence "
                    f"of max_model_len={self.max_model_len} needs ({needed}): raise kv_cache_memory_gib / "
                    f"gpu_memory_utilization / num_kv_blocks or lower max_model_len")
            logger.warning("the KV cache (%d blocks of %d tokens, %s) cannot hold one sequence of the model's context "
                           "of %d tokens: max_model_len lowered to %d; raise kv_cache_memory_gib for more",
                           num_blocks, c.block_size, self.kv_cache_kind, self.max_model_len, fits)
            self.max_model_len = fits
        logger.info("KV cache: %d blocks of %d tokens (%d tokens of every layer), %s, %.2f GiB; max_model_len %d",
                    num_blocks, c.block_size, num_blocks * c.block_size * self.kv_layout.positions // s.num_layers,
                    self.kv_cache_kind, num_blocks * c.block_size * bytes_per_token / 2**30, self.max_model_len)
        return num_blocks

    def _blocks_for(self, max_len: int) -> int:
        """Blocks one sequence of up to max_len tokens can hold at once (KVLayout.max_blocks)."""
        c = self.config
        chunk = c.max_num_batched_tokens if c.enable_chunked_prefill else max_len  # a prompt's widest step
        return self.kv_layout.max_blocks(max_len, chunk, c.block_size)

    def _longest_fitting(self, num_blocks: int) -> int:
        """The longest max_model_len whose sequence fits in num_blocks, a whole number of blocks
        (0 where none does)."""
        low, high = 0, self.max_model_len // self.config.block_size  # in blocks: needs grow with the length
        while low < high:
            mid = (low + high + 1) // 2
            if self._blocks_for(mid * self.config.block_size) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low * self.config.block_size

    def _kv_cache_bytes(self) -> float:
        """kv_cache_memory_gib; by default 1 GiB on CPU, and on a GPU its gpu_memory_utilization
        share less what is already taken (the weights just loaded, the CUDA context, other
        processes) and what a step's activations and the CUDA graphs will take."""
        c = self.config
        if c.kv_cache_memory_gib is not None:
            return c.kv_cache_memory_gib * 2**30
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_GIB * 2**30
        free, total = torch.cuda.mem_get_info(self.device)
        return total * c.gpu_memory_utilization - (total - free) - self._activation_bytes()

    def _activation_bytes(self) -> int:
        """A bound on a step's transient memory: the widest step's layer activations in float32
        (the fused q/k/v, the MLP's gate and up, a few of the hidden size), the logits of every
        sampled row with the sampler's copies of them, and a fixed allowance for cuBLAS'
        workspaces, Triton and the graphs' pool."""
        s, c = self.hparams, self.config
        per_token = 6 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 3 * s.intermediate_size
        logits = 4 * c.max_num_seqs * s.vocab_size
        return 4 * c.max_num_batched_tokens * per_token + logits + 2**30

    def _adapters_in_use(self) -> set[str]:
        return set(_adapters_of(self.scheduler.requests.values()))

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> str:
        """Queues a prompt (text, token ids or {"prompt_token_ids": [...]}); returns its id.
        The offline edge: tokenizes and validates, then hands the core an EngineRequest.
        lora_request: the adapter it runs with, loaded from its path the first time its name
        is seen (as vLLM's LLM.generate(lora_request=...)); priority: lower first (as vLLM's)."""
        text, token_ids = self.tokenize(prompt)
        if lora_request is not None and lora_request.lora_path is not None:
            self.load_adapter(lora_request.lora_name, lora_request.lora_path)
        options = RequestOptions(prompt=text, cache_salt=cache_salt, priority=priority)
        if lora_request is not None:
            options = replace(options, adapter=lora_request.lora_name, lora_scale=lora_request.scale)
        request = EngineRequest.checked(request_id if request_id is not None else str(next(self._ids)), token_ids,
                                        params, self.hparams.vocab_size, self.max_model_len, options, arrival_time)
        return self.add(request)

    def load_adapter(self, name: str, path: str, replace: bool = False, read: ReadAdapter | None = None) -> AdapterInfo:
        """Serves the adapter in `path` (a PEFT folder or a llama.cpp LoRA GGUF file) as `name` from
        now on; replace: in place of an adapter of that name; read: its files as read_adapter read
        them, else they are read now (engine/adapters.py)."""
        return self._enabled_adapters("lora_name").load(name, path, replace, read)

    def read_adapter(self, name: str, path: str) -> ReadAdapter:
        """Reads an adapter's files for load_adapter without touching what steps use: callable
        from another thread while the engine steps."""
        return self._enabled_adapters("lora_name").read(name, path)

    def adapter_to_read(self, request: EngineRequest) -> tuple[str, str] | None:
        """The adapter (name, files) `request` needs read before it is added, if any: one dropped
        from memory (max_cpu_loras), or one this engine does not know whose files the request
        names (RequestOptions.adapter_path). A loop reads it off its thread (read_adapter), then
        restore_adapter, then add."""
        name = request.options.adapter
        if self.adapters is None or name is None:
            return None
        dropped = self.adapters.dropped(name)
        if dropped is not None:
            return dropped.name, dropped.path
        if name not in self.adapters.infos and request.options.adapter_path is not None:
            return name, request.options.adapter_path
        return None

    def restore_adapter(self, read: ReadAdapter) -> None:
        self._enabled_adapters("model").restore(read)

    def unload_adapter(self, name: str) -> None:
        """Stops serving adapter `name`; its requests in the engine finish with it."""
        self._enabled_adapters("lora_name").unload(name)

    def _enabled_adapters(self, field: str) -> Adapters:
        if self.adapters is None:
            raise SamplingError(field, "LoRA adapters are not enabled: start the engine with enable_lora (or "
                                       "lora_modules)")
        return self.adapters

    def add(self, request: EngineRequest) -> str:
        """Queues a request checked at the edge (EngineRequest.checked); returns its id."""
        options = request.options
        if options.draft and not self.step_hook.verifies_supplied_drafts:
            raise SamplingError("draft", "needs speculative decoding: start the engine with a speculative_config")
        lora, identity = None, None
        if options.adapter is not None:
            adapters = self._enabled_adapters("model")
            lora, identity = adapters.get(options.adapter), adapters.infos[options.adapter].identity
        params, children = request.params, []
        for i in range(params.n):
            child_params = self._child_params(params, i)
            seed = child_params.seed if child_params.seed is not None else self._seeds.getrandbits(64)
            children.append(Request(
                request_id=request.request_id if params.n == 1 else f"{i}_{request.request_id}",
                prompt_token_ids=request.prompt_token_ids,
                params=child_params,
                eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                max_model_len=self.max_model_len,
                arrival_time=request.arrival_time,
                cache_salt=options.cache_salt,
                adapter=options.adapter,
                adapter_identity=identity,
                lora=lora,
                lora_scale=options.lora_scale,
                tenant=options.tenant or "default",
                priority=options.priority,
                child_index=i,
                sampling_seed=seed,
                grammar=self._grammar(params),
                supplied_draft=options.draft,
            ))
        self.output_processor.add(request.request_id, options.prompt, children)
        for child in children:
            self.scheduler.add(child)
        return request.request_id

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (if any) and ids; a SamplingError naming `prompt` for anything that is
        not a text, a list of token ids or a dict of either (token ids are checked later)."""
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if ids is not None:
                if isinstance(ids, (list, tuple)) and all(is_int(t) for t in ids):
                    return text, list(ids)
            elif isinstance(text, str):
                return text, self.tokenizer.encode(text)
        elif isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return None, list(prompt)
        raise SamplingError("prompt", "must be a text, a list of token ids, or a dict with `prompt` (a text) or "
                                      f"`prompt_token_ids`; got {type(prompt).__name__} {str(prompt)[:60]!r}")

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """Each sequence walks its own copy of the request's compiled grammar."""
        if params.structured_outputs is None:
            return None
        try:
            return self.grammars.grammar(params.structured_outputs)
        except ValueError as exc:
            raise SamplingError("structured_outputs", str(exc)) from exc

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Each of n completions is its own sequence: distinct seeds, prompt logprobs only once."""
        if params.n == 1:
            return params
        return replace(params, n=1, seed=params.child_seed(index),
                       prompt_logprobs=params.prompt_logprobs if index == 0 else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request wherever it is; returns its last output (finish_reason "abort"), or None
        if it had already finished or never existed."""
        children = [self.scheduler.finish(child_id, RequestStatus.FINISHED_ABORTED)
                    for child_id in self.output_processor.child_ids(request_id)]
        self.step_hook.release(self.scheduler.running)
        now = time.monotonic()
        output = self.output_processor.abort(request_id, now)
        first = next((c for c in children if c is not None), None)
        if first is not None:
            t = first.times
            self._log(IterationStats(finished=[FinishedRequestStats.at(
                "abort", now, t.arrival, t.first_scheduled, first.num_prompt_tokens, first.adapter)]))
        return output

    @property
    def request_ids(self) -> list[str]:
        """Ids of the user requests still in the engine."""
        return self.output_processor.request_ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[RequestOutput]:
        self.step_hook.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched)
        self.runner.move_slots(self.step_hook.verify(sched, result))
        return self._update(sched, result)

    def _update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        iteration = IterationStats(num_sequences=len(sched.chunks), num_batched_tokens=sched.num_batched_tokens,
                                   num_preemptions=len(sched.preempted))
        for child_id, (first_position, chunk_logprobs) in result.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(child_id, first_position, chunk_logprobs)
        progressed = self.scheduler.update(sched, result.sampled)
        for progress in progressed:
            _record_progress(progress, now, iteration)
        outputs, stopped = self.output_processor.process([p.request for p in progressed], result.logprobs, now)
        for child_id in stopped:
            self.scheduler.finish(child_id, RequestStatus.FINISHED_STOPPED)
        iteration.finished = [_finished_stats(o) for o in outputs if o.finished]
        if iteration.finished:  # what the hook kept for them (a draft model's blocks) goes now, not next step
            self.step_hook.release(self.scheduler.running)
        self._log(iteration)
        return outputs

    def snapshot(self) -> EngineSnapshot:
        kv = self.kv
        return EngineSnapshot(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage, num_kv_blocks=kv.num_blocks, num_free_kv_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks, prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits, prefix_cache_evictions=kv.stats.evictions,
            running_adapters=_adapters_of(self.scheduler.running) if self.adapters is not None else (),
            waiting_adapters=_adapters_of(self.scheduler.waiting) if self.adapters is not None else (),
        )

    def _log(self, iteration: IterationStats) -> None:
        if self.stat_loggers:
            snapshot = self.snapshot()
            for logger in self.stat_loggers:
                logger.record(snapshot, iteration)


def _adapters_of(requests) -> tuple[str, ...]:
    return tuple(sorted({r.adapter for r in requests if r.adapter is not None}))


def _record_progress(progress: Progress, now: float, iteration: IterationStats) -> None:
    request, times = progress.request, progress.request.times
    iteration.num_generation_tokens += progress.num_new_tokens
    if request.adapter is not None:
        by_adapter = iteration.generation_tokens_by_adapter
        by_adapter[request.adapter] = by_adapter.get(request.adapter, 0) + progress.num_new_tokens
    if progress.num_draft_tokens:
        iteration.spec.observe(progress.num_draft_tokens, progress.num_accepted_tokens, progress.draft_source)
    if times.first_token is None:
        times.first_token = now
        if request.child_index == 0:  # once per user request, whatever n is
            iteration.time_to_first_tokens.append(now - times.arrival)
            iteration.num_prompt_tokens += request.num_prompt_tokens
    else:
        iteration.inter_token_latencies.append(now - times.last_token)
    times.last_token = now


def _finished_stats(output: RequestOutput) -> FinishedRequestStats:
    m = output.metrics
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
    return FinishedRequestStats.at(reasons[0] if reasons else "stop", m.finished_time, m.arrival_time,
                                   m.first_scheduled_time, len(output.prompt_token_ids), output.adapter)
