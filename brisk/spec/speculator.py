"""The speculator: speculative decoding as the engine's step hook (engine/step_hook.py).

Before each step it gives the running sequences that decode next a draft to verify, as a
VerifyPlan; after the step it turns each plan's row samples into the tokens accepted
(spec/verify.py) and names the K/V slots to keep.

It owns a drafter (spec/drafter.py: the seam every drafting method plugs into) and the policy
around it:

- a sequence that brought a draft of its own (EngineRequest.draft: an edited file, a retrieved
  passage) verifies it, hundreds of tokens at a time, for as long as its output follows it;
  the drafter drafts for the others, and for it once the output has left its draft;
- a sequence drafts no further than the last token it may generate;
- sequences under a grammar do not draft (their drafts would have to walk the grammar too);
- past `disable_by_batch_size` running sequences the drafter does not draft: the batch alone then
  keeps the step busy computing, so verify rows are no longer nearly free (measured in
  docs/benchmark-notes.md). A sequence's own draft is verified all the same: it may be a whole
  answer (a response-cache candidate), whose verify rows save it every step of that answer.

Turning speculation off changes which positions are verified together, never what is sampled
at a position (spec/verify.py): with exactly reproducible logits, outputs do not depend on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from brisk.config import EngineConfig, SpeculativeConfig
from brisk.engine.request import Request, RequestStatus
from brisk.engine.runner import RunnerOutput
from brisk.engine.scheduler import SchedulerOutput
from brisk.engine.step_hook import SlotMove
from brisk.spec.draft_model import DraftModelDrafter
from brisk.spec.drafter import Drafter
from brisk.spec.medusa_drafter import MedusaDrafter
from brisk.spec.ngram import NgramDrafter
from brisk.spec.suffix import SuffixDrafter
from brisk.spec.verify import Draft, accepted_path, verify_plan

if TYPE_CHECKING:
    from brisk.engine.engine import LLMEngine

# Running sequences past which speculation is off by default, per method (docs/benchmark-notes.md, CPU):
# prompt lookup costs only the verify rows, and on copying prompts still paid 1.74x at 2
# sequences and 1.2x at 3, but lost at 4 (0.9x; chat prompts 0.93-0.95x at 2-4); a draft model
# costs a pass of its own per draft token, which already lost at 2 sequences (0.6x plain
# decoding); Medusa a tree of verify rows and the heads' pass through the LM head.
# The suffix drafter's verify rows cost what prompt lookup's do; its own limit is not measured yet.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 2, "suffix": 2, "draft_model": 1, "medusa": 1}


def drafting_limit(config: SpeculativeConfig) -> int:
    """Running sequences past which nobody drafts: the config's own limit, else the method's
    measured default. `brisk optimize` reads it to tell whether a drafter can act on a workload."""
    return config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[config.method]


class Speculator:
    verifies_supplied_drafts = True

    def __init__(self, config: SpeculativeConfig, drafter: Drafter):
        self.config = config
        self.drafter = drafter
        self.disable_by_batch_size = drafting_limit(config)
        self._drafts: dict[str, Draft] = {}  # the drafts of the step under way, by request id
        self._running: dict[str, Request] = {}  # as release() last saw them
        self._hidden: dict[str, torch.Tensor] = {}  # the last step's hidden states, for the drafter

    @classmethod
    def build(cls, engine: LLMEngine, config: EngineConfig | None = None) -> "Speculator":
        """The speculator of the speculative_config of `config` (by default the engine's), for
        the model the engine runs; a draft model gets a KV pool as large as the model's."""
        config = config or engine.config
        spec = config.speculative_config
        if spec.method == "ngram":
            return cls(spec, NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max))
        if spec.method == "suffix":
            return cls(spec, SuffixDrafter(spec))
        if spec.method == "medusa":
            return cls(spec, MedusaDrafter.load(spec, engine.checkpoint.path, engine.runner))
        # the pool in blocks of every layer: the target's, whatever groups its layers keep K/V in
        full_blocks = engine.kv.num_blocks * engine.kv_layout.positions // engine.hparams.num_layers
        return cls(spec, DraftModelDrafter.load(config, engine.checkpoint, engine.max_model_len, full_blocks))

    # ----- StepHook ---------------------------------------------------------------------------
    def release(self, running: list[Request]) -> None:
        """Shows the drafter the sequences that finished since the last call, and drops its
        state (a draft model's KV blocks) of those no longer running."""
        live = {r.request_id for r in running}
        finished = [r for rid, r in self._running.items() if rid not in live and r.status.finished]
        self._running = {r.request_id: r for r in running}
        if finished:
            self.drafter.learn(finished)
        self.drafter.forget(live)

    def propose(self, running: list[Request]) -> None:
        """Gives the running sequences that decode next step their drafts, as verify plans."""
        self.release(running)
        hidden, self._hidden = self._hidden, {}
        for request in running:  # a plan the last step did not schedule (its sequence was preempted)
            request.verify = None
        decoding = [r for r in running if r.status is RequestStatus.RUNNING
                    and r.num_tokens - r.num_computed_tokens == 1]
        drafts = {r.request_id: Draft(tokens, source="supplied") for r in decoding if (tokens := _supplied(r))}
        drafting = [r for r in decoding if r.request_id not in drafts]
        if drafting and len(running) <= self.disable_by_batch_size:
            budgets = [self._budget(r) for r in drafting]
            drafts.update((r.request_id, d) for r, d in zip(drafting, self.drafter.propose(drafting, budgets, hidden)))
        for request in decoding:
            draft = drafts.get(request.request_id)
            if draft is not None and draft.token_ids:
                self._drafts[request.request_id] = draft
                request.verify = verify_plan(draft)

    def verify(self, sched: SchedulerOutput, out: RunnerOutput) -> list[SlotMove]:
        """Keeps, per verified sequence, the drafts the model's samples accept and the sample
        after them; the K/V of kept rows off the main branch moves next to the known tokens."""
        drafts, self._drafts = self._drafts, {}
        moves = []
        for chunk in sched.chunks:
            rid = chunk.request.request_id
            samples = out.sampled.get(rid)
            if samples is None:
                continue
            used = [0]  # the rows whose samples are kept: root, then accepted drafts
            if chunk.verify is not None:
                draft = drafts[rid]
                path = accepted_path(draft.token_ids, draft.parents, samples)
                used += [i + 1 for i in path]
                out.sampled[rid] = [draft.token_ids[i] for i in path] + [samples[used[-1]]]
                if rid in out.logprobs:
                    out.logprobs[rid] = [out.logprobs[rid][row] for row in used]
                last = chunk.request.num_computed_tokens  # the slot of the sequence's last token
                moves.extend(SlotMove(rid, last + row, last + depth) for depth, row in enumerate(used) if row != depth)
            if self.drafter.reads_hidden_states and rid in out.first_row:  # not after a multi-pass step
                self._hidden[rid] = out.hidden[out.first_row[rid] + used[-1]]
        return moves

    def _budget(self, request: Request) -> int:
        if request.grammar is not None:
            return 0
        return max(0, min(self.config.num_speculative_tokens, request.max_total_tokens - request.num_tokens - 1))


def _supplied(request: Request) -> list[int]:
    """The rest of the request's own draft while its output has followed it, up to the last
    token it may generate (no num_speculative_tokens cap: nothing was spent drafting it)."""
    draft, start = request.supplied_draft, request.num_prompt_tokens
    generated = request.num_output_tokens
    if request.grammar is not None or generated >= len(draft) or tuple(request.token_ids[start:]) != draft[:generated]:
        return []
    return list(draft[generated:generated + request.max_total_tokens - request.num_tokens - 1])
