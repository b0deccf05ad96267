"""The step hook: how a technique acts around every step without the core knowing it.

    before the step   propose(running)     may give running sequences a VerifyPlan (request.verify)
    the step          the runner computes every planned row and samples each of them
    after the step    verify(sched, out)   turns each plan's row samples into the tokens gained,
                                           and names the K/V slots to keep (SlotMove)
    as sequences go   release(running)     drops what it kept for sequences that finished or were aborted

Speculative decoding (brisk/spec/) is what plugs in here: its drafters propose, its acceptance
rule verifies. The engine holds one hook, NoStepHook unless `brisk.assembly.build_engine` plugs
another in, and never imports the techniques.

A plan is what the runner needs and no more: the tokens fed after the sequence's last one, the
position of each, which earlier rows each may attend to, and which tokens each row's sampler
counts as output before it. Whether the rows form a chain or a tree of alternatives is the
hook's business; the runner only computes rows (see engine/runner.py for the layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from brisk.engine.request import Request
    from brisk.engine.runner import RunnerOutput
    from brisk.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class VerifyPlan:
    """Rows a sequence's next step computes after its last token, each sampled as plain decoding
    would sample at its position (brisk/spec/verify.py says why that makes verification exact).

    Row 0 is the sequence's last token; row i + 1 feeds token_ids[i] at position
    last + depths[i] and samples with output_before[i] (tokens among token_ids, in order)
    counted as generated after the sequence's tokens. ancestor_masks, one per row i + 1, says
    which of the 63 keys before it the row sees (attention.h's bit layout); None: all of them,
    as in a chain, which has no length limit.
    """

    token_ids: list[int]
    depths: list[int]
    output_before: list[list[int]]
    ancestor_masks: list[int] | None = None
    source: str = ""  # where the hook's drafts came from: a label for the metrics only

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SlotMove:
    """K/V of one token moved within a sequence's slots, after verification kept its row."""

    request_id: str
    src: int
    dst: int


class StepHook(Protocol):
    # whether proposals include the drafts requests bring (EngineRequest.draft); an engine whose
    # hook does not refuses such requests rather than drop their drafts
    verifies_supplied_drafts: bool

    def propose(self, running: list[Request]) -> None:
        """Before a step: sets request.verify on the running sequences that should verify rows."""

    def verify(self, sched: SchedulerOutput, out: RunnerOutput) -> list[SlotMove]:
        """After it: rewrites out.sampled (and out.logprobs) of planned sequences to the tokens
        they gain; returns the K/V moves that put the kept rows right after the known tokens."""

    def release(self, running: list[Request]) -> None:
        """Drops state kept for sequences no longer running (called when some finished or were
        aborted, and before each proposal)."""


class NoStepHook:
    """The engine's hook when no technique plugs in: every step is plain decoding."""

    verifies_supplied_drafts = False

    def propose(self, running: list[Request]) -> None:
        pass

    def verify(self, sched: SchedulerOutput, out: RunnerOutput) -> list[SlotMove]:
        return []

    def release(self, running: list[Request]) -> None:
        pass
