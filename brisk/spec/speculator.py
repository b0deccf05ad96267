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
- a drafted token costs a row of the verify pass, and pays only if it is accepted often
  enough: StepCost fits this engine's decode steps as a fixed part, a part per row and a part
  per key attended, and a sequence drafts while its own drafts have been accepted at the
  break-even rate for its context in the step at hand (after a probe of PROBE_TOKENS drafted
  tokens, and again now and then where rows are cheap). On a CPU, where a row costs about
  half a step's fixed part, that is about a third at one sequence and 0.8 at eight: copying
  requests keep gaining under load, chat stops paying for drafts it would mostly lose. On a
  GPU, where rows are nearly free, everyone drafts. Methods whose drafts cost more than their
  rows (a draft model's own pass, Medusa's heads through the LM head) stop past
  `disable_by_batch_size` running sequences instead, as does every method when the config
  sets that limit. A sequence's own draft is verified all the same: it may be a whole answer
  (a response-cache candidate), whose verify rows save it every step of that answer.

Turning speculation off changes which positions are verified together, never what is sampled
at a position (spec/verify.py): with exactly reproducible logits, outputs do not depend on it.
"""

from __future__ import annotations

import time
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

# Methods whose drafts cost only their verify rows (the drafter is a lookup): they follow the
# step-cost rule at any batch size. The others stop past DEFAULT_DISABLE_BY_BATCH_SIZE running
# sequences (docs/training.md, "Students do not pay as draft models"): a draft model costs a
# pass of its own per draft token, which already lost at 2 sequences; Medusa a tree of verify
# rows and the heads' pass through the LM head.
ROW_COST_METHODS = ("ngram", "suffix")
DEFAULT_DISABLE_BY_BATCH_SIZE = {"draft_model": 1, "medusa": 1}
PROBE_TOKENS = 4  # drafted tokens a sequence tries before its acceptance rate decides
# Where the break-even rate is under REPROBE_BELOW (a few sequences: rows are cheap), a sequence
# below it drafts again at every REPROBE_EVERY-th token: answers that start in their own words
# and copy later (most copy prompts' answers) would otherwise never draft again.
REPROBE_EVERY = 16
REPROBE_BELOW = 0.5


def drafting_limit(config: SpeculativeConfig) -> int | None:
    """Running sequences past which nobody drafts: the config's own limit, else the method's
    measured default (None: no limit, the step-cost rule decides per sequence). `brisk
    optimize` reads it to tell whether a drafter can act on a workload."""
    return config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE.get(config.method)


class StepCost:
    """A decode step's seconds as F + c rows + a keys, fitted by weighted least squares to the
    pure decode steps the engine ran: F what a step costs whatever it holds (reading the
    weights, the engine's per-step work), c what a row adds (its products, its LM head), a what
    each key a row attends adds (keys: the context lengths summed over the rows). Without the
    keys, a fit over a batch that drains as its answers end (fewer rows, longer contexts) took
    the growing attention for fixed cost and put F at 11 rows' worth at 32 sequences.

    Each step is timed from its proposal to the next one, so all the engine's per-step work
    counts; its weight decays by DECAY per step after it, so the fit follows the machine's load.
    A prior of a few light steps on the prior's plane keeps the fit defined before the steps
    vary. The prior is the default model on a 2-core AMD EPYC (Zen 4): one sequence with k
    rejected drafts at ~500 tokens of context took 3.70, 4.72, 6.45, 8.39 and 14.83 ms at k = 0,
    1, 2, 4 and 8; 1, 4, 8 and 16 sequences of ~130 tokens 3.58, 6.78, 14.38 and 24.97 ms
    (docs/speculative.md, "A verify row costs a quarter of a decode step")."""

    PRIOR = (2.4e-3, 1.0e-3, 0.5e-6)  # F, c, a in seconds
    PRIOR_STEPS = ((1, 500), (4, 2000), (16, 2000), (16, 16000))  # (rows, keys) of its steps
    PRIOR_WEIGHT = 0.05  # each: a few steps outweigh it
    DECAY = 0.995

    def __init__(self):
        self._prior = [0.0] * 9  # weighted sums of x x^T (6: the upper triangle) and x t (3), x = (1, rows, keys)
        for rows, keys in self.PRIOR_STEPS:
            self._add(self._prior, rows, keys, self.seconds(rows, keys, self.PRIOR), self.PRIOR_WEIGHT)
        self._steps = [0.0] * 9
        self._fit: tuple[float, float, float] | None = self.PRIOR

    def observe(self, rows: int, keys: int, seconds: float) -> None:
        self._steps = [self.DECAY * v for v in self._steps]
        self._add(self._steps, rows, keys, seconds, 1.0)
        self._fit = None  # solved when next asked

    @staticmethod
    def _add(sums: list[float], rows: int, keys: int, seconds: float, weight: float) -> None:
        for i, v in enumerate((1.0, rows, keys, rows * rows, rows * keys, keys * keys, seconds, rows * seconds,
                               keys * seconds)):
            sums[i] += weight * v

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(F, c, a), each at least 0: the normal equations solved (by Cramer's rule: 3 x 3, in
        plain floats, a few microseconds a step)."""
        if self._fit is None:
            n, r, k, rr, rk, kk, t, rt, kt = (p + s for p, s in zip(self._prior, self._steps))
            a, b = [[n, r, k], [r, rr, rk], [k, rk, kk]], [t, rt, kt]
            whole = _det3(a)
            solved = [_det3([[b[i] if j == col else a[i][j] for j in range(3)] for i in range(3)]) / whole
                      for col in range(3)]
            self._fit = (max(solved[0], 0.0), max(solved[1], 0.0), max(solved[2], 0.0))
        return self._fit

    @staticmethod
    def seconds(rows: int, keys: int, coefficients: tuple[float, float, float]) -> float:
        fixed, per_row, per_key = coefficients
        return fixed + per_row * rows + per_key * keys

    def break_even(self, context: int, batch: int, keys: int) -> float:
        """The acceptance rate at which a drafted token of a sequence with `context` tokens pays
        for its row in a step of `batch` rows attending `keys` keys: the row costs c + a
        context, an accepted token saves the sequence's share of the step, seconds / batch."""
        _, per_row, per_key = self.coefficients
        step = self.seconds(batch, keys, self.coefficients)
        return (per_row + per_key * context) * batch / step if step > 0 else 0.0


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


class Speculator:
    verifies_supplied_drafts = True

    def __init__(self, config: SpeculativeConfig, drafter: Drafter):
        self.config = config
        self.drafter = drafter
        self.cost = StepCost()
        self.force_drafting(False)
        self._proposed = 0.0  # when the step under way was proposed: its start
        # the last step's rows, keys attended, start and sequences, were it pure decode
        self._step: tuple[int, int, float, set[str]] | None = None
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

    def force_drafting(self, forced: bool) -> None:
        """forced: every sequence drafts, past any limit or cost (benchmarks show what the policy
        avoids; tests of verification draft at every step); else the policy decides again."""
        self.disable_by_batch_size = None if forced else drafting_limit(self.config)
        self.by_cost = not forced and self.config.method in ROW_COST_METHODS

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
        now = time.perf_counter()
        if self._step is not None:  # a step's time is from its proposal to the next one: all its work,
            rows, keys, start, ids = self._step  # when the next came right after it (a sequence of it goes on)
            if any(r.request_id in ids for r in running):
                self.cost.observe(rows, keys, now - start)
            self._step = None
        self.release(running)
        hidden, self._hidden = self._hidden, {}
        for request in running:  # a plan the last step did not schedule (its sequence was preempted)
            request.verify = None
        decoding = [r for r in running if r.status is RequestStatus.RUNNING
                    and r.num_tokens - r.num_computed_tokens == 1]
        drafts = {r.request_id: Draft(tokens, source="supplied") for r in decoding if (tokens := _supplied(r))}
        keys = sum(r.num_tokens for r in decoding)  # the step's keys if no one drafted
        limited = self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size
        drafting = [] if limited else [r for r in decoding if r.request_id not in drafts
                                       and self._pays(r, len(decoding), keys)]
        if drafting:
            budgets = [self._budget(r) for r in drafting]
            drafts.update((r.request_id, d) for r, d in zip(drafting, self.drafter.propose(drafting, budgets, hidden)))
        for request in decoding:
            draft = drafts.get(request.request_id)
            if draft is not None and draft.token_ids:
                self._drafts[request.request_id] = draft
                request.verify = verify_plan(draft)
        self._proposed = now

    def verify(self, sched: SchedulerOutput, out: RunnerOutput) -> list[SlotMove]:
        """Keeps, per verified sequence, the drafts the model's samples accept and the sample
        after them; the K/V of kept rows off the main branch moves next to the known tokens."""
        drafts, self._drafts = self._drafts, {}
        if sched.decode_passes == 1 and all(c.num_new_tokens - c.num_verify_rows == 1 for c in sched.chunks):
            keys = sum(c.num_new_tokens * (c.request.num_computed_tokens + c.num_new_tokens) for c in sched.chunks)
            self._step = (sched.num_batched_tokens, keys, self._proposed, {c.request.request_id for c in sched.chunks})
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

    def _pays(self, request: Request, batch: int, keys: int) -> bool:
        """Whether a sequence's drafts pay in a step of `batch` decoding sequences attending `keys`
        keys: while it probes, and while its drafts are accepted at the break-even rate (where
        the method follows the step-cost rule), and again now and then where rows are cheap."""
        stats = request.spec_stats
        if not self.by_cost or stats.num_draft_tokens < PROBE_TOKENS:
            return True
        rate = self.cost.break_even(request.num_tokens, batch, keys)
        return (stats.num_accepted_tokens >= rate * stats.num_draft_tokens
                or rate < REPROBE_BELOW and request.num_output_tokens % REPROBE_EVERY == 0)

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
