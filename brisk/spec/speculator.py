"""The speculator: after each step, which running sequences get drafts, and how many.

It owns a drafter (the seam every drafting method plugs into: `propose(requests, num_tokens,
step)` returns a Draft for each of requests, a chain or a tree of tokens no deeper than
num_tokens[i], given the step that just ran; `forget(live)` drops state of sequences no longer
running) and the policy around it:

- a sequence drafts no further than the last token it may generate;
- sequences under a grammar do not draft (their drafts would have to walk the grammar too);
- past `disable_by_batch_size` running sequences nobody drafts: the batch alone then keeps the
  step busy computing, so verify rows are no longer nearly free (measured in docs/benchmark-notes.md).

Turning speculation off changes which positions are verified together, never what is sampled
at a position (spec/verify.py): with exactly reproducible logits, outputs do not depend on it.
"""

from __future__ import annotations

from typing import Protocol

from brisk.config import EngineConfig, SpeculativeConfig
from brisk.engine.request import Request, RequestStatus
from brisk.engine.runner import ModelRunner, RunnerOutput
from brisk.model.loader import Checkpoint
from brisk.spec.draft_model import DraftModelDrafter
from brisk.spec.medusa_drafter import MedusaDrafter
from brisk.spec.ngram import NgramDrafter
from brisk.spec.verify import Draft

# Running sequences past which speculation is off by default, per method (docs/benchmark-notes.md, CPU):
# prompt lookup costs only the verify rows, and on copying prompts still paid 1.74x at 2
# sequences and 1.2x at 3, but lost at 4 (0.9x; chat prompts 0.93-0.95x at 2-4); a draft model
# costs a pass of its own per draft token, which already lost at 2 sequences (0.6x plain
# decoding); Medusa a tree of verify rows and the heads' pass through the LM head.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 2, "draft_model": 1, "medusa": 1}


def drafting_limit(config: SpeculativeConfig) -> int:
    """Running sequences past which nobody drafts: the config's own limit, else the method's
    measured default. `brisk optimize` reads it to tell whether a drafter can act on a workload."""
    return config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[config.method]


class Drafter(Protocol):
    def propose(self, requests: list[Request], num_tokens: list[int], step: RunnerOutput) -> list[Draft]: ...

    def forget(self, live: set[str]) -> None: ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter):
        self.config = config
        self.drafter = drafter
        self.disable_by_batch_size = drafting_limit(config)

    @classmethod
    def build(cls, config: EngineConfig, target: Checkpoint, runner: ModelRunner, max_model_len: int,
              num_kv_blocks: int) -> "Speculator":
        """The speculator of config.speculative_config for the model `runner` runs; a draft
        model gets a KV pool as large as the model's."""
        spec = config.speculative_config
        if spec.method == "ngram":
            return cls(spec, NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max))
        if spec.method == "medusa":
            return cls(spec, MedusaDrafter.load(spec, target.path, runner))
        return cls(spec, DraftModelDrafter.load(config, target, max_model_len, num_kv_blocks))

    def forget(self, running: list[Request]) -> None:
        """Drops the drafter's state (a draft model's KV blocks) of sequences no longer running."""
        self.drafter.forget({r.request_id for r in running})

    def propose(self, running: list[Request], step: RunnerOutput) -> None:
        """Sets the drafts of the running sequences that decode next step, after `step`."""
        self.forget(running)
        decoding = [r for r in running if r.status is RequestStatus.RUNNING
                    and r.num_tokens - r.num_computed_tokens == 1]
        if not decoding or len(running) > self.disable_by_batch_size:
            return
        budgets = [self._budget(r) for r in decoding]
        for request, draft in zip(decoding, self.drafter.propose(decoding, budgets, step)):
            request.draft_token_ids, request.draft_parents = draft.token_ids, draft.parents

    def _budget(self, request: Request) -> int:
        if request.grammar is not None:
            return 0
        return max(0, min(self.config.num_speculative_tokens, request.max_total_tokens - request.num_tokens - 1))
