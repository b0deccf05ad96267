"""Output processing: token ids -> text, stop strings, finish reasons, and what callers receive.

A user request with n > 1 runs as n sequences in the engine (sharing their prompt's blocks);
this module folds them back into one RequestOutput with n completions.

Streaming never shows text that might turn out to be the start of a stop string: while a
sequence runs, the last (longest stop string - 1) characters are held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from brisk.engine.request import Request, RequestStatus
from brisk.engine.stats import SpecDecodeStats
from brisk.model.tokenizer import IncrementalDetokenizer, Tokenizer
from brisk.sample.logprobs import TokenLogprobs
from brisk.sample.params import OutputKind, SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (RequestStatus)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counts, summed over the n sequences


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    adapter: str | None = None  # the LoRA adapter it ran with


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Folds one DELTA output into those before it: after the last, the result is what a
    FINAL_ONLY request would have returned (the response cache stores a streamed answer so)."""
    if total is None:
        total = replace(delta, outputs=[])
    completions = {c.index: c for c in total.outputs}
    for c in delta.outputs:
        if c.index not in completions:
            completions[c.index] = replace(c, token_ids=list(c.token_ids),
                                           logprobs=None if c.logprobs is None else list(c.logprobs))
            continue
        done = completions[c.index]
        done.text += c.text
        done.token_ids += c.token_ids
        if c.logprobs is not None:
            done.logprobs = (done.logprobs or []) + c.logprobs
        done.cumulative_logprob, done.finish_reason, done.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                         c.stop_reason)
    prompt_logprobs = total.prompt_logprobs if total.prompt_logprobs is not None else delta.prompt_logprobs
    return replace(total, outputs=sorted(completions.values(), key=lambda c: c.index), finished=delta.finished,
                   metrics=delta.metrics, num_cached_tokens=delta.num_cached_tokens, prompt_logprobs=prompt_logprobs)


@dataclass
class _Sequence:
    """What has been produced for one of a request's n completions."""

    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_chars: int = 0  # for DELTA outputs: how much has been handed out
    sent_tokens: int = 0
    sent_finish: bool = False


class _RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sequences = [_Sequence(i, tokenizer.detokenizer(params.skip_special_tokens)) for i in range(params.n)]
        for s in self.sequences:
            s.logprobs = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        self.children: dict[str, Request] = {}
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._parent_of: dict[str, tuple[_RequestState, int]] = {}  # child request id -> (state, index)

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        first = children[0]
        params = first.params if len(children) == 1 else _parent_params(first.params, len(children))
        state = _RequestState(request_id, prompt, first.prompt_token_ids, params, self.tokenizer)
        self._states[request_id] = state
        for index, child in enumerate(children):
            state.children[child.request_id] = child
            self._parent_of[child.request_id] = (state, index)

    def child_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        return list(state.children) if state else []

    def add_prompt_logprobs(self, child_id: str, first_position: int, chunk: list[TokenLogprobs]) -> None:
        """Entries for prompt positions first_position onwards. A request preempted and computed
        again from its start sends positions it sent before: only the new ones are kept."""
        state, _ = self._parent_of[child_id]
        known = len(state.prompt_logprobs) - first_position  # position 0 is the leading None
        state.prompt_logprobs.extend(self._with_text(entry) for entry in chunk[max(known, 0):])

    def _with_text(self, entry: TokenLogprobs) -> TokenLogprobs:
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.id_to_token(token_id)
        return entry

    def process(self, progressed: list[Request], logprobs: dict[str, list[TokenLogprobs]],
                now: float) -> tuple[list[RequestOutput], list[str]]:
        """Detokenizes each progressed sequence's new tokens (several after accepted drafts).

        Returns the outputs to hand out and the ids of sequences a stop string has ended (the
        engine must tell the scheduler, which only knows token-level stops).
        """
        touched: dict[str, _RequestState] = {}
        stopped = []
        for request in progressed:
            state, index = self._parent_of[request.request_id]
            if self._advance(state, state.sequences[index], request, logprobs.get(request.request_id)):
                stopped.append(request.request_id)
            touched[state.request_id] = state
        outputs = [o for o in (self._output(s, now) for s in touched.values()) if o is not None]
        for state in touched.values():
            if state.finished:
                self._forget(state)
        return outputs, stopped

    @property
    def request_ids(self) -> list[str]:
        return list(self._states)

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        """Finishes every unfinished completion of the request with "abort"; returns the final output."""
        state = self._states.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = RequestStatus.FINISHED_ABORTED.value
        output = self._output(state, now)
        self._forget(state)
        return output

    def _advance(self, state: _RequestState, seq: _Sequence, request: Request,
                 logprobs: list[TokenLogprobs] | None) -> bool:
        """Takes the request's tokens this sequence has not seen; True if a stop string ended it
        (tokens after the one that completed the stop string are dropped)."""
        new_tokens = request.token_ids[request.num_prompt_tokens + len(seq.token_ids):]
        for i, token in enumerate(new_tokens):
            seq.token_ids.append(token)
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(self._with_text(logprobs[i]))
                seq.cumulative_logprob += logprobs[i][token].logprob
            previous = len(seq.text)
            seq.text += seq.detokenizer.step(token)
            if self._find_stop_string(state.params, seq, previous):
                return True
        if request.is_finished and seq.finish_reason is None:
            seq.finish_reason = request.status.value
            seq.stop_reason = request.stop_reason
        return False

    def _find_stop_string(self, params: SamplingParams, seq: _Sequence, previous_len: int) -> bool:
        if not params.stop_strings or seq.finish_reason is not None:
            return False
        for stop in params.stop_strings:
            start = max(0, previous_len - len(stop) + 1)  # a match must end in the new text
            at = seq.text.find(stop, start)
            if at != -1:
                seq.text = seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
                seq.finish_reason, seq.stop_reason = RequestStatus.FINISHED_STOPPED.value, stop
                return True
        return False

    def _output(self, state: _RequestState, now: float) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not state.finished:
            return None
        completions = [self._completion(state, s, delta=kind is OutputKind.DELTA) for s in state.sequences]
        completions = [c for c in completions if c is not None]
        if kind is OutputKind.DELTA and not completions:
            return None
        first = next(iter(state.children.values()))
        times = first.times
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not (kind is OutputKind.DELTA and state.prompt_logprobs_sent):
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=state.finished,
            metrics=RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.last_token,
                                   now if state.finished else None, _spec_stats(state.children.values())),
            num_cached_tokens=first.num_cached_tokens,
            adapter=first.adapter,
        )

    def _completion(self, state: _RequestState, seq: _Sequence, delta: bool) -> CompletionOutput | None:
        visible = len(seq.text) if seq.finish_reason is not None else max(len(seq.text) - state.holdback, 0)
        if not delta:
            return CompletionOutput(seq.index, seq.text[:visible], list(seq.token_ids),
                                    seq.cumulative_logprob if seq.logprobs is not None else None,
                                    seq.logprobs and list(seq.logprobs), seq.finish_reason, seq.stop_reason)
        new_tokens = seq.token_ids[seq.sent_tokens:]
        finishing = seq.finish_reason is not None and not seq.sent_finish
        if not new_tokens and visible <= seq.sent_chars and not finishing:
            return None
        text = seq.text[seq.sent_chars:visible]
        logprobs = seq.logprobs[seq.sent_tokens:] if seq.logprobs is not None else None
        seq.sent_chars, seq.sent_tokens = max(visible, seq.sent_chars), len(seq.token_ids)
        seq.sent_finish = seq.finish_reason is not None
        return CompletionOutput(seq.index, text, new_tokens,
                                seq.cumulative_logprob if seq.logprobs is not None else None,
                                logprobs, seq.finish_reason, seq.stop_reason)

    def _forget(self, state: _RequestState) -> None:
        self._states.pop(state.request_id, None)
        for child_id in state.children:
            self._parent_of.pop(child_id, None)


def _spec_stats(children) -> SpecDecodeStats | None:
    """None for a request that never had drafts."""
    total = SpecDecodeStats()
    for child in children:
        total.add(child.spec_stats)
    return total if total.num_drafts else None


def _parent_params(first_child_params: SamplingParams, n: int) -> SamplingParams:
    """The user's params as the output side sees them: n completions (the first child is the
    one that keeps prompt_logprobs)."""
    return replace(first_child_params, n=n)
