"""A draft model: a smaller model with the target's tokenizer proposes k tokens, one forward
pass each, batched over the sequences that draft.

It keeps its own paged KV cache (the same block manager and runner as the target, its own
pool), one shadow sequence per target sequence. Each round starts by rolling the shadow back
to what the target kept: the shadow's tokens are the target's up to the first draft the target
rejected, its K/V is kept for exactly those, and the target's newer tokens are computed as one
chunk by the first of the k passes::

    target:  p p p a b X            (drafts a b c, c rejected; X the target's own token)
    shadow:  p p p a b c            computed up to b
    next:    p p p a b X -> d0 ... d(k-1)   (first pass computes X, samples d0)

"self-int8" / "self-int4" load the target's own checkpoint a second time with its linear
layers in 8 or 4 bits (brisk.quant): same tokenizer by construction, agreeing with the target
on most tokens, and reading 4x / 8x fewer weight bytes than a float32 target.

Drafts are the draft model's greedy choices: a one-point draft distribution, for which the
verify rule of spec/verify.py is exact at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.config import SELF_DRAFTS, ConfigError, EngineConfig
from brisk.engine.kv_cache import KVCacheManager, KVLayout
from brisk.engine.request import Request
from brisk.engine.runner import ModelRunner
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.model.loader import Checkpoint, load_model, open_checkpoint, resolve_precision, resolve_weight_mode
from brisk.sample.params import SamplingParams
from brisk.spec.drafter import Drafter
from brisk.spec.verify import Draft

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@dataclass(eq=False)
class _Shadow:
    request: Request  # the draft model's copy of the sequence
    num_synced: int  # leading tokens known to be the target's (the rest are this drafter's drafts)


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv
        self._shadows: dict[str, _Shadow] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: Checkpoint, max_model_len: int, num_kv_blocks: int) -> "DraftModelDrafter":
        name = config.speculative_config.model
        quantization = SELF_DRAFTS.get(name)
        device = config.torch_device
        precision = resolve_precision(config, target, device)  # the target's, which a draft shares
        if quantization is not None:
            target_mode = resolve_weight_mode(config, target, device, precision.dtype)
            if target_mode.quantization is not None:
                raise ConfigError(f"speculative_config.model {name!r} drafts for a float target; this one already runs "
                                  f"{target_mode.name} weights (quantization {config.quantization}), so its own "
                                  f"low-bit copy would save nothing")
        checkpoint = target if quantization is not None else open_checkpoint(name)
        if checkpoint.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
            raise ConfigError(f"speculative_config.model {name!r} has another tokenizer than the model: "
                              f"a draft model must share it")
        model = load_model(checkpoint, precision.dtype, device, max_model_len, quantization)
        if model.hparams.vocab_size != target.hparams.vocab_size:
            raise ConfigError(f"speculative_config.model {name!r} has {model.hparams.vocab_size} logits, the model "
                              f"{target.hparams.vocab_size}")
        # num_kv_blocks: blocks of every layer; the draft's own window layers keep K/V in groups too
        layout = KVLayout.of(model.hparams.layer_windows, model.hparams.num_layers)
        kv = KVCacheManager(num_kv_blocks * model.hparams.num_layers // layout.positions, config.block_size,
                            enable_prefix_caching=False, layout=layout)
        return cls(ModelRunner(model, kv, precision.kv_cache, config.torch_device), kv)

    def propose(self, requests: list[Request], num_tokens: list[int], hidden: dict[str, torch.Tensor]) -> list[Draft]:
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        wanted = {r.request_id: k for r, k in zip(requests, num_tokens)}
        active = [self._sync(r) for r, k in zip(requests, num_tokens) if k]
        while active:
            chunks = []
            for shadow in active:
                s = shadow.request
                n = s.num_tokens - s.num_computed_tokens
                if self.kv.allocate(s, n):
                    chunks.append(ScheduledChunk(s, n))
                else:  # its pool is full: this sequence drafts no further this round
                    self._drop(s.request_id)
            if not chunks:
                break
            sampled = self.runner.execute(SchedulerOutput(chunks)).sampled
            active = []
            for chunk in chunks:
                s = chunk.request
                s.num_computed_tokens += chunk.num_new_tokens
                token = sampled[s.request_id][0]
                s.token_ids.append(token)
                drafts[s.request_id].append(token)
                if len(drafts[s.request_id]) < wanted[s.request_id]:
                    active.append(self._shadows[s.request_id])
        return [Draft(drafts[r.request_id], source="model") for r in requests]

    def forget(self, live: set[str]) -> None:
        for request_id in [i for i in self._shadows if i not in live]:
            self._drop(request_id)

    def _sync(self, target: Request) -> _Shadow:
        """The request's shadow, rolled back to the target's tokens (see the module docstring)."""
        shadow = self._shadows.get(target.request_id)
        if shadow is None:
            shadow = _Shadow(Request(target.request_id, list(target.token_ids), _GREEDY), target.num_tokens)
            self._shadows[target.request_id] = shadow
            return shadow
        s, synced = shadow.request, shadow.num_synced
        common = synced
        while common < min(s.num_tokens, target.num_tokens) and s.token_ids[common] == target.token_ids[common]:
            common += 1
        del s.token_ids[common:]
        s.token_ids.extend(target.token_ids[common:])
        # At least the last token is computed again: its logits give the first draft (the shadow
        # may have computed it already, as a draft the target then decoded without verifying).
        s.num_computed_tokens = min(s.num_computed_tokens, common, target.num_tokens - 1)
        self.kv.trim(s, s.num_computed_tokens)
        shadow.num_synced = target.num_tokens
        return shadow

    def _drop(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow.request)
