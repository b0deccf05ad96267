"""OutputProcessor on hand-made requests: cumulative, delta and final-only outputs, stop strings
split across tokens (held back while they might still match), finish reasons, n > 1 folding,
and state dropped once a request finishes or is aborted.

The tokenizer's pieces are whole strings, concatenated on decode, so every text below is exact.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from brisk.engine.output import OutputProcessor, RequestOutput
from brisk.sample.logprobs import Logprob
from brisk.engine.request import Request
from brisk.model.tokenizer import Tokenizer
from brisk.sample.params import OutputKind, SamplingParams

PIECES = ["<unk>", "</s>", "The", " cat", " S", "TO", "P", "P!!", " sat", "."]
ID = {p: i for i, p in enumerate(PIECES)}
EOS = ID["</s>"]
PROMPT = [ID["The"]]


@pytest.fixture
def processor() -> OutputProcessor:
    backend = Backend(models.WordLevel(dict(ID), unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["</s>"])
    return OutputProcessor(Tokenizer(backend, eos_token_ids=[EOS]))


def _add(processor: OutputProcessor, request_id: str, n: int = 1, **params) -> list[Request]:
    """Registers a request as the engine does: n children, each with n=1 params."""
    params = SamplingParams(max_tokens=params.pop("max_tokens", 16), **params)
    child_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
    children = [Request(cid, PROMPT, params, eos_token_ids=(EOS,), child_index=i) for i, cid in enumerate(child_ids)]
    processor.add(request_id, "The", children)
    return children


def _feed(processor: OutputProcessor, request: Request, piece: str,
          logprob: float | None = None) -> tuple[list[RequestOutput], list[str]]:
    """One engine step in which `request` sampled `piece`."""
    request.append_token(ID[piece])
    logprobs = {} if logprob is None else {request.request_id: [{ID[piece]: Logprob(logprob, rank=1)}]}
    return processor.process([request], logprobs, now=100.0)


def _run(processor: OutputProcessor, request: Request, pieces: list[str]) -> list[RequestOutput]:
    outputs = []
    for piece in pieces:
        outputs += _feed(processor, request, piece)[0]
    return outputs


STOP_SPLIT = [" cat", " S", "TO", "P"]  # "The cat STOP": the stop string starts in " S", ends in "P"


def test_cumulative_outputs_carry_everything_so_far(processor):
    (r,) = _add(processor, "r", max_tokens=3)
    outputs = _run(processor, r, [" cat", " sat", "."])
    assert [o.outputs[0].text for o in outputs] == [" cat", " cat sat", " cat sat."]
    assert [o.outputs[0].token_ids for o in outputs] == [[3], [3, 8], [3, 8, 9]]
    assert [o.finished for o in outputs] == [False, False, True]
    assert [o.outputs[0].finish_reason for o in outputs] == [None, None, "length"]
    assert [o.metrics.finished_time for o in outputs] == [None, None, 100.0]
    assert outputs[-1].prompt == "The" and outputs[-1].prompt_token_ids == PROMPT


def test_delta_outputs_carry_only_what_is_new(processor):
    (r,) = _add(processor, "r", max_tokens=3, output_kind=OutputKind.DELTA)
    outputs = _run(processor, r, [" cat", " sat", "."])
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs] == [
        (" cat", [3]), (" sat", [8]), (".", [9])]
    assert [o.outputs[0].finish_reason for o in outputs] == [None, None, "length"]


def test_final_only_gives_one_output_at_the_end(processor):
    (r,) = _add(processor, "r", max_tokens=3, output_kind=OutputKind.FINAL_ONLY)
    assert _run(processor, r, [" cat", " sat"]) == []
    (final,) = _run(processor, r, ["."])
    assert final.finished and final.outputs[0].text == " cat sat." and final.outputs[0].token_ids == [3, 8, 9]


def test_stop_string_split_across_tokens_is_held_back_and_cut(processor):
    (r,) = _add(processor, "r", stop="STOP")
    outputs, stopped = [], []
    for piece in STOP_SPLIT:
        out, ids = _feed(processor, r, piece)
        outputs += out
        stopped.append(ids)
    # Texts so far: " cat", " cat S", " cat STO", " cat STOP"; the last len("STOP") - 1 chars wait.
    assert [o.outputs[0].text for o in outputs] == [" ", " ca", " cat ", " cat "]
    assert stopped == [[], [], [], ["r"]]  # the engine must tell the scheduler: it only knows token stops
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP")
    assert final.token_ids == [ID[p] for p in STOP_SPLIT]
    assert outputs[-1].finished


def test_streamed_text_is_never_retracted(processor):
    """Every running output is a prefix of the final text: no stop-string prefix shown, then cut."""
    (r,) = _add(processor, "r", stop=["STOP", "sat."], output_kind=OutputKind.DELTA)
    outputs = _run(processor, r, [" S", "TO", " cat", " sat", " S", "TO", "P"])
    deltas = [o.outputs[0].text for o in outputs]
    final_text = "".join(deltas)
    assert final_text == " STO cat sat "
    shown = ""
    for delta in deltas:
        shown += delta
        assert final_text.startswith(shown)
    assert deltas == ["", " ", "STO ", "cat ", "sa", "t ", ""]  # "sat" waits: it might have become "sat."


def test_include_stop_str_in_output_keeps_the_stop_string(processor):
    (r,) = _add(processor, "r", stop="STOP", include_stop_str_in_output=True, output_kind=OutputKind.DELTA)
    outputs = _run(processor, r, STOP_SPLIT)
    assert [o.outputs[0].text for o in outputs] == [" ", "ca", "t ", "STOP"]
    assert outputs[-1].outputs[0].stop_reason == "STOP"


@pytest.mark.parametrize("include, expected", [(False, " cat "), (True, " cat STOP")])
def test_text_after_a_stop_string_in_the_same_token_is_dropped(processor, include, expected):
    (r,) = _add(processor, "r", stop="STOP", include_stop_str_in_output=include)
    outputs = _run(processor, r, [" cat", " S", "TO", "P!!"])
    assert outputs[-1].outputs[0].text == expected and outputs[-1].finished


def test_the_stop_string_that_completes_first_wins(processor):
    (r,) = _add(processor, "r", stop=["STOP", "cat S"])
    outputs = _run(processor, r, [" cat", " S"])
    final = outputs[-1].outputs[0]
    assert (final.text, final.stop_reason, final.finish_reason) == (" ", "cat S", "stop")


def test_without_stop_strings_nothing_is_held_back(processor):
    (r,) = _add(processor, "r", output_kind=OutputKind.DELTA)
    assert [o.outputs[0].text for o in _run(processor, r, [" S", "TO"])] == [" S", "TO"]


def test_eos_finishes_with_stop_and_no_stop_reason(processor):
    (r,) = _add(processor, "r")
    outputs = _run(processor, r, [" cat", "</s>"])
    final = outputs[-1].outputs[0]
    assert (final.text, final.token_ids) == (" cat", [3, EOS])  # the special token is not shown
    assert (final.finish_reason, final.stop_reason) == ("stop", None)


def test_eos_text_is_shown_when_special_tokens_are_kept(processor):
    (r,) = _add(processor, "r", skip_special_tokens=False)
    assert _run(processor, r, [" cat", "</s>"])[-1].outputs[0].text == " cat</s>"


def test_stop_token_id_is_the_stop_reason(processor):
    (r,) = _add(processor, "r", stop_token_ids=[ID[" sat"]])
    final = _run(processor, r, [" cat", " sat"])[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (" cat sat", "stop", ID[" sat"])


def test_logprobs_accumulate_and_deltas_carry_only_new_ones(processor):
    (r,) = _add(processor, "r", max_tokens=2, logprobs=0, output_kind=OutputKind.DELTA)
    (first,), _ = _feed(processor, r, " cat", logprob=-0.5)
    (second,), _ = _feed(processor, r, " sat", logprob=-0.25)
    assert [list(e) for e in first.outputs[0].logprobs] == [[ID[" cat"]]]
    assert first.outputs[0].logprobs[0][ID[" cat"]].decoded_token == " cat"
    assert [list(e) for e in second.outputs[0].logprobs] == [[ID[" sat"]]]
    assert (first.outputs[0].cumulative_logprob, second.outputs[0].cumulative_logprob) == (-0.5, -0.75)


def test_prompt_logprobs_are_sent_once_when_streaming(processor):
    (r,) = _add(processor, "r", max_tokens=2, prompt_logprobs=0, output_kind=OutputKind.DELTA)
    processor.add_prompt_logprobs("r", 1, [])  # a one-token prompt: nothing before its first position
    outputs = _run(processor, r, [" cat", " sat"])
    assert [o.prompt_logprobs for o in outputs] == [[None], None]


def test_n_completions_fold_into_one_output(processor):
    a, b = _add(processor, "r", n=2, max_tokens=2)
    assert processor.child_ids("r") == ["0_r", "1_r"]
    (out,), _ = _feed(processor, b, " sat")
    assert out.request_id == "r" and [(c.index, c.text) for c in out.outputs] == [(0, ""), (1, " sat")]
    (out,), _ = _feed(processor, a, " cat")
    assert [(c.index, c.text) for c in out.outputs] == [(0, " cat"), (1, " sat")]
    (out,), _ = _feed(processor, a, ".")
    assert not out.finished and [c.finish_reason for c in out.outputs] == ["length", None]
    (out,), _ = _feed(processor, b, ".")
    assert out.finished and [c.text for c in out.outputs] == [" cat.", " sat."]
    assert processor.child_ids("r") == []  # finished: its state is gone


def test_n_completions_stream_only_the_ones_that_moved(processor):
    a, b = _add(processor, "r", n=2, max_tokens=2, stop="STOP", output_kind=OutputKind.DELTA)
    (out,), stopped = _feed(processor, a, " S")
    assert [(c.index, c.text) for c in out.outputs] == [(0, "")] and stopped == []
    (out,), _ = _feed(processor, b, " sat")
    assert [(c.index, c.text) for c in out.outputs] == [(1, " ")]
    (out,), stopped = _feed(processor, a, "TO")  # max_tokens reached: "STO" is no stop, so it shows
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(0, " STO", "length")] and stopped == []
    (out,), _ = _feed(processor, b, ".")
    assert out.finished and [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(1, "sat.", "length")]


def test_n_completions_final_only_waits_for_all(processor):
    a, b = _add(processor, "r", n=2, max_tokens=1, output_kind=OutputKind.FINAL_ONLY)
    assert _feed(processor, a, " cat") == ([], [])
    (out,), _ = _feed(processor, b, " sat")
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(" cat", "length"), (" sat", "length")]


def test_abort_ends_every_completion_then_forgets_the_request(processor):
    (r,) = _add(processor, "r", output_kind=OutputKind.DELTA, stop=["sat on"])
    sent = _run(processor, r, [" cat", " sat"])
    assert "".join(o.outputs[0].text for o in sent) == " ca"  # 5 characters held back for "sat on"
    last = processor.abort("r", now=5.0)
    # The last delta carries what was held back, and the finish reason.
    assert [(c.text, c.finish_reason) for c in last.outputs] == [("t sat", "abort")]
    assert last.finished and last.metrics.finished_time == 5.0
    assert processor.abort("r", now=6.0) is None
    assert processor.child_ids("r") == []
    with pytest.raises(KeyError):  # an output for it can no longer be produced
        _feed(processor, r, ".")
    (again,) = _add(processor, "r", output_kind=OutputKind.DELTA)  # the id can be reused from scratch
    assert [o.outputs[0].text for o in _run(processor, again, ["."])] == ["."]
