"""AsyncEngine: streamed deltas add up to the offline result, many requests interleave, leaving
a stream early aborts its request, and the event loop stays free while the model runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from brisk import SamplingParams
from brisk.transport.async_engine import AsyncEngine
from brisk.sample.params import OutputKind, SamplingError
from tests.conftest import assert_no_leaks

pytestmark = pytest.mark.real_model

STREAM = SamplingParams(temperature=0.0, max_tokens=24, output_kind=OutputKind.DELTA)


@pytest.fixture
def async_engine(real_llm):
    engine = AsyncEngine(engine=real_llm.engine)
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()


def _prompt(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


async def _collect(engine: AsyncEngine, prompt, request_id: str, params=STREAM):
    pieces, tokens, outputs = [], [], 0
    async for output in engine.generate(prompt, params, request_id):
        outputs += 1
        for c in output.outputs:
            pieces.append(c.text)
            tokens += c.token_ids
    return "".join(pieces), tokens, outputs, output


@pytest.fixture
def offline_fruit(real_llm):
    """Computed before `async_engine` starts its loop thread: after that, only the loop may touch the engine."""
    prompt = _prompt(real_llm, "Name a fruit.")
    return prompt, real_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]


def test_streamed_deltas_add_up_to_the_offline_result(offline_fruit, async_engine):
    prompt, offline = offline_fruit
    offline = offline.outputs[0]
    text, tokens, count, last = asyncio.run(_collect(async_engine, prompt, "stream-1"))
    assert (text, tokens) == (offline.text, offline.token_ids)
    assert count == len(tokens) and last.finished and last.outputs[0].finish_reason == offline.finish_reason


REASONS = [f"Give me {i} reasons to learn Python." for i in range(2, 8)]


@pytest.fixture
def offline_reasons(real_llm):
    """Prompts and their offline greedy results, taken before `async_engine` starts its loop."""
    prompts = [_prompt(real_llm, text) for text in REASONS]
    outputs = real_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    return prompts, [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]


def test_concurrent_streams_interleave(offline_reasons, async_engine):
    prompts, expected = offline_reasons
    arrivals: list[str] = []  # request id of every output, in the order the event loop received them

    async def collect(prompt, request_id):
        pieces, tokens = [], []
        async for output in async_engine.generate(prompt, STREAM, request_id):
            arrivals.append(request_id)
            for c in output.outputs:
                pieces.append(c.text)
                tokens += c.token_ids
        return "".join(pieces), tokens

    async def main():
        return await asyncio.gather(*(collect(p, f"c{i}") for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == expected
    for request_id in {f"c{i}" for i in range(len(prompts))}:
        first = arrivals.index(request_id)
        last = len(arrivals) - 1 - arrivals[::-1].index(request_id)
        others = set(arrivals[first:last + 1]) - {request_id}
        assert others, f"{request_id}'s outputs arrived in one run: {arrivals}"
    assert_no_leaks(async_engine.engine)


async def _finish_a_probe(engine: AsyncEngine, real_llm) -> None:
    """Runs one more request to its end. Commands reach the loop thread in the order they were
    posted, so once this request has finished, an abort posted before it has been applied."""
    async for _ in engine.generate(_prompt(real_llm, "Hi."), SamplingParams(max_tokens=1), "probe"):
        pass


def test_leaving_a_stream_early_aborts_the_request(real_llm, async_engine):
    async def main():
        stream = async_engine.generate(_prompt(real_llm, "Write a long essay about rivers."),
                                       SamplingParams(max_tokens=500, output_kind=OutputKind.DELTA), "leaver")
        async for _ in stream:  # the request is running: it has produced a token
            break
        await stream.aclose()
        await _finish_a_probe(async_engine, real_llm)

    asyncio.run(main())
    assert_no_leaks(async_engine.engine)  # 500 tokens were asked for: only the abort can have ended it


def test_invalid_requests_fail_before_reaching_the_engine(async_engine):
    async def main():
        async for _ in async_engine.generate([5] * 5000, STREAM, "too-long"):
            pass

    with pytest.raises(SamplingError, match="prompt"):
        asyncio.run(main())
    assert async_engine.is_alive


def test_event_loop_keeps_running_while_the_model_steps(real_llm, async_engine):
    """Every model step holds until the event loop has run a callback the step posted to it: a
    loop blocked by model steps could never run it, and the step would give up after 10 s."""
    engine, answered = real_llm.engine, []
    step = engine.step

    async def main():
        loop = asyncio.get_running_loop()

        def held_step():
            ran = threading.Event()
            loop.call_soon_threadsafe(ran.set)
            answered.append(ran.wait(10))
            return step()

        engine.step = held_step  # only the loop thread calls step, and only while a request runs
        try:
            return await _collect(async_engine, _prompt(real_llm, "Describe the moon."), "busy",
                                  SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 output_kind=OutputKind.DELTA))
        finally:
            del engine.step

    _, tokens, _, last = asyncio.run(main())
    assert len(tokens) == 8 and last.finished
    assert len(answered) >= 8 and all(answered), answered


def test_closing_a_stream_that_never_started_aborts_its_request(real_llm, async_engine):
    async def main():
        unread = async_engine.generate(_prompt(real_llm, "Write a long poem."),
                                       SamplingParams(max_tokens=400, ignore_eos=True), "never-read")
        witness = async_engine.generate(_prompt(real_llm, "Write a short poem."),
                                        SamplingParams(max_tokens=400, ignore_eos=True), "witness")
        # Admission is first come, first served: once the later request has a token, the unread one runs too.
        await anext(witness)
        await unread.aclose()
        await witness.aclose()
        await _finish_a_probe(async_engine, real_llm)
        # Its id is free again: nothing of the closed request is left on the async side either.
        again = async_engine.generate(_prompt(real_llm, "Hi."), SamplingParams(max_tokens=1), "never-read")
        return [output async for output in again]

    outputs = asyncio.run(main())
    assert len(outputs) == 1 and outputs[0].finished
    assert_no_leaks(async_engine.engine)
