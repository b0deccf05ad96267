"""ProcessEngine: the engine in a child process answers as the in-thread engine does, and either
side dying ends in a clear error with no process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import brisk
from brisk.config import ConfigError, EngineConfig
from brisk.transport.async_engine import AsyncEngine
from brisk.transport.client import EngineDeadError, QueueLoad
from brisk.transport.core_process import ProcessEngine
from brisk.sample.params import OutputKind, SamplingError, SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.helpers import break_the_runner

TINY = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, output_kind=OutputKind.DELTA)
LONG = SamplingParams(max_tokens=240, ignore_eos=True, output_kind=OutputKind.DELTA)  # ends only if aborted
PROMPTS = [[3, 4, 5], [10] * 20, [7, 8, 9, 10, 11], [50, 40, 30, 20, 10, 5]]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture(scope="module")
def process_engine(tiny_folder):
    engine = ProcessEngine(EngineConfig(model=tiny_folder, **TINY))
    yield engine
    engine.shutdown()


@pytest.fixture
def own_process_engine(tiny_folder):
    """A core of its own, for tests that kill or break it."""
    engine = ProcessEngine(EngineConfig(model=tiny_folder, **TINY))
    yield engine
    engine.shutdown()


async def _run(engine, prompt: list[int], request_id: str, params: SamplingParams = GREEDY):
    """(token ids, their logprobs, finish reason) of one streamed request."""
    tokens, logprobs = [], []
    async for output in engine.generate(prompt, params, request_id):
        tokens += output.outputs[0].token_ids
        logprobs += [{t: lp.logprob for t, lp in entry.items()} for entry in output.outputs[0].logprobs or []]
    return tokens, logprobs, output.outputs[0].finish_reason


async def _run_concurrently(engine, prompts: list[list[int]]):
    return await asyncio.gather(*(_run(engine, p, f"r{i}") for i, p in enumerate(prompts)))


def test_greedy_tokens_and_logprobs_equal_the_in_thread_engine(tiny_folder, process_engine):
    in_thread = AsyncEngine(EngineConfig(model=tiny_folder, **TINY))
    try:
        expected = asyncio.run(_run_concurrently(in_thread, PROMPTS))
    finally:
        in_thread.shutdown()
    got = asyncio.run(_run_concurrently(process_engine, PROMPTS))
    assert all(len(tokens) == 12 and reason == "length" for tokens, _, reason in expected)
    assert [(tokens, reason) for tokens, _, reason in got] == [(tokens, reason) for tokens, _, reason in expected]
    # Logprobs match to float noise: how requests share a batch depends on when they arrive.
    for (_, logprobs, _), (_, expected_logprobs, _) in zip(got, expected):
        assert [sorted(entry) for entry in logprobs] == [sorted(entry) for entry in expected_logprobs]
        assert [v for entry in logprobs for v in entry.values()] == pytest.approx(
            [v for entry in expected_logprobs for v in entry.values()], abs=1e-4)


def test_abort_ends_a_running_stream_with_abort(process_engine):
    async def main():
        stream = process_engine.generate([3, 4, 5], LONG, "to-abort")
        await anext(stream)
        process_engine.abort("to-abort")
        return [output async for output in stream], await process_engine.stats()

    outputs, snapshot = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert snapshot.num_running == 0 and snapshot.num_free_kv_blocks == snapshot.num_kv_blocks


def test_abort_all_ends_every_stream_with_abort(process_engine):
    async def main():
        streams = [process_engine.generate(p, LONG, f"all-{i}") for i, p in enumerate(PROMPTS[:3])]
        for stream in streams:
            await anext(stream)
        process_engine.abort_all()
        return [[output async for output in stream][-1] for stream in streams]

    finals = asyncio.run(main())
    assert [f.outputs[0].finish_reason for f in finals] == ["abort"] * 3


def test_a_bad_request_raises_before_anything_is_queued(process_engine):
    async def main():
        with pytest.raises(SamplingError, match="prompt"):
            process_engine.generate([5] * 300, GREEDY, "bad")
        with pytest.raises(SamplingError, match="vocabulary"):
            process_engine.generate([3, 10_000], GREEDY, "bad")
        load = process_engine.queue_load()
        return load, await _run(process_engine, [3, 4], "bad")  # its id was never taken

    load, (_, _, reason) = asyncio.run(main())
    assert load == QueueLoad(0, 0) and reason == "length"


def test_stats_clear_prefix_cache_and_stat_loggers_cross_the_socket(process_engine):
    records = []

    class Recorder:
        def record(self, snapshot, iteration):
            records.append((snapshot, iteration))

    recorder = Recorder()
    process_engine.add_stat_logger(recorder)

    async def main():
        await _run(process_engine, list(range(3, 43)), "cache-me", SamplingParams(max_tokens=5, ignore_eos=True))
        return await process_engine.stats(), await process_engine.clear_prefix_cache(), await process_engine.stats()

    try:
        before, evicted, after = asyncio.run(main())
    finally:
        process_engine.remove_stat_logger(recorder)
    assert before.num_cached_blocks >= 2  # the 40-token prompt filled two blocks of 16
    assert evicted == before.num_cached_blocks and after.num_cached_blocks == 0
    assert sum(iteration.num_generation_tokens for _, iteration in records) == 5
    assert [f.finish_reason for _, iteration in records for f in iteration.finished] == ["length"]


def test_killing_the_core_ends_open_streams_and_later_calls_with_engine_dead_error(own_process_engine):
    engine = own_process_engine

    async def main():
        stream = engine.generate([3, 4, 5], LONG, "victim")
        await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            engine.generate([3, 4], GREEDY, "later")
        with pytest.raises(EngineDeadError):
            await engine.stats()

    asyncio.run(main())
    assert not engine.is_healthy()


def test_an_error_in_a_step_ends_streams_with_it_and_the_core_exits(own_process_engine):
    engine = own_process_engine

    async def main():
        await engine.call(break_the_runner)
        with pytest.raises(EngineDeadError, match="broken on purpose"):
            await _run(engine, [3, 4], "doomed")

    asyncio.run(main())
    assert engine.process.wait(timeout=30) == 1 and not engine.is_healthy()


def test_shutdown_ends_open_streams_and_the_core_exits_cleanly(own_process_engine):
    engine = own_process_engine

    async def main():
        stream = engine.generate([3, 4, 5], LONG, "open")
        await anext(stream)
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="stopped"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert engine.process.returncode == 0


def test_a_core_that_cannot_build_its_engine_raises_its_error(tiny_folder):
    config = EngineConfig(model=tiny_folder, dtype="float32", num_kv_blocks=2, max_model_len=256)
    children_before = set(psutil.Process().children())
    with pytest.raises(ConfigError, match="max_model_len"):
        ProcessEngine(config)
    assert set(psutil.Process().children()) == children_before


_PARENT = """
import sys, time
from brisk.config import EngineConfig
from brisk.transport.core_process import ProcessEngine
engine = ProcessEngine(EngineConfig(model=sys.argv[1], dtype="float32", num_kv_blocks=64, max_model_len=256))
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_killing_the_api_process_leaves_no_orphan(tiny_folder):
    root = Path(brisk.__file__).resolve().parent.parent
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, tiny_folder], stdout=subprocess.PIPE, text=True,
                              cwd=root)
    try:
        core = psutil.Process(int(parent.stdout.readline()))
        assert core.ppid() == parent.pid and core.is_running()
        parent.kill()
        parent.wait()
        assert _gone(core, timeout=10)
    finally:
        parent.kill()


def _gone(process: psutil.Process, timeout: float) -> bool:
    """Exited within timeout (a zombie waiting for its new parent to reap it counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.real_model
def test_structured_outputs_cross_the_socket(real_model_path):
    """The constraint is pickled to the core, which compiles it there: the answer is one choice."""
    engine = ProcessEngine(EngineConfig(model=real_model_path, dtype="float32", kv_cache_memory_gib=0.25,
                                        max_model_len=512))
    try:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Is the sky blue?"}])
        params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=8, output_kind=OutputKind.FINAL_ONLY,
                                structured_outputs=brisk.StructuredOutputs(choice=["yes", "no"]))

        async def final():
            return [output async for output in engine.generate(ids, params, "choice")][-1]

        output = asyncio.run(final())
        assert [(c.text, c.finish_reason) for c in output.outputs] in \
            [[(a, "stop"), (b, "stop")] for a in ("yes", "no") for b in ("yes", "no")]
    finally:
        engine.shutdown()
