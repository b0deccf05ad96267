"""LoRA adapters served by the engine (engine/adapters.py, kernels/lora.py) against PEFT: on a
float32 tiny Llama, a step with an adapter computes the logits of the base model with that
adapter merged into its weights (PEFT's merge_and_unload, run in transformers) within 1e-4, in
the fused decode step, layer by layer and in torch; a batch mixing three adapters and the base
model generates, row for row, what each merged model generates alone. Then what serving needs:
no prefix blocks shared across adapters, the cap on adapters per batch, memory's LRU that never
drops an adapter in use, unloading that lets running requests finish, and the errors."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from brisk import LLM, LoRARequest, SamplingParams
from brisk.engine.adapters import AdapterNotFound
from brisk.engine.request import EngineRequest, Request, RequestOptions
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.kernels.backend import KernelBackend
from brisk.kernels.cpu import CBackend
from brisk.model.lora import LoRAError
from brisk.sample.params import SamplingError
from tests.conftest import (TINY_VOCAB, assert_no_leaks, build_lora_adapter, build_tiny_checkpoint, hf_greedy,
                            load_hf_reference)
from tests.helpers import hf_logits

ATOL = 1e-4
# Three adapters unlike each other: attention only, every linear layer with rsLoRA, the MLP only
ADAPTERS = {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "all": dict(r=8, lora_alpha=16, use_rslora=True,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            "mlp": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base folder, {adapter name: folder}, {adapter name: the merged HF model}, the base HF model)."""
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_checkpoint(str(root / "base"), "llama")
    folders = {name: str(root / name) for name in ADAPTERS}
    merged = {name: build_lora_adapter(base, folders[name], seed, **options)
              for seed, (name, options) in enumerate(ADAPTERS.items())}
    return base, folders, merged, load_hf_reference(base)


def _llm(served, **options) -> LLM:
    base, folders, _, _ = served
    modules = [f"{name}={folder}" for name, folder in folders.items()]
    return LLM(base, **{"dtype": "float32", "quantization": "none", "num_kv_blocks": 96, "block_size": 4,
                        "max_model_len": 256, "lora_modules": modules, **options})


@pytest.fixture(scope="module")
def llm(served) -> LLM:
    return _llm(served)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(length)]


@torch.inference_mode()
def _adapter_logits(engine, name: str, token_ids: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    """Logits at every position with adapter `name`, computed in these chunks (1: a decode step)."""
    request = Request("lora-probe", token_ids, SamplingParams(max_tokens=1), adapter=name,
                      lora=engine.adapters.get(name))
    assert engine.kv.allocate(request, len(token_ids))
    chunks = []
    try:
        for n in chunk_sizes:
            batch = engine.runner._prepare(SchedulerOutput([ScheduledChunk(request, n)]))
            assert batch.lora is not None
            hidden = engine.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.attn, batch.lora)
            chunks.append(engine.model.compute_logits(hidden))
            request.num_computed_tokens += n
    finally:
        engine.kv.free(request)
    return torch.cat(chunks)


@pytest.mark.parametrize("backend", ["kernels", "layered", "torch"])
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_logits_with_an_adapter_match_the_merged_model(served, llm, backend, name):
    model = llm.engine.model
    chosen = model.kernels
    model.use_kernels({"kernels": CBackend(), "layered": CBackend(fuse_decode=False),
                       "torch": KernelBackend()}[backend])
    try:
        prompt = _prompt(37, seed=3)
        ours = _adapter_logits(llm.engine, name, prompt, [5, 1, 1, 14, 1, 15])
    finally:
        model.use_kernels(chosen)
    merged = served[2][name]
    assert (ours - hf_logits(merged, prompt)).abs().max().item() < ATOL
    # and the adapter changes them: the test would notice an adapter left out
    assert (ours - hf_logits(served[3], prompt)).abs().max().item() > 100 * ATOL


def test_a_batch_mixing_three_adapters_and_the_base_model_generates_what_each_alone_does(served, llm):
    _, _, merged, base = served
    names = [None, "qv", "all", "mlp", "all", None, "mlp", "qv"]
    prompts = [_prompt(5 + 7 * i, seed=10 + i) for i in range(len(names))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False,
                           lora_request=[LoRARequest(n) if n else None for n in names])
    for name, prompt, output in zip(names, prompts, outputs):
        expected = hf_greedy(merged[name] if name else base, prompt, 12)
        assert list(output.outputs[0].token_ids) == expected, name
    assert_no_leaks(llm.engine)


def test_adapters_never_share_prefix_blocks(llm):
    prompt = _prompt(40, seed=99)
    params = SamplingParams(max_tokens=2, temperature=0)
    cached = [llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest(n) if n else None)[0]
              .num_cached_tokens for n in ("qv", "all", None, "qv", "all", None)]
    assert cached[:3] == [0, 0, 0]  # a prompt seen under one adapter is new to every other and to the base
    assert all(c >= 36 for c in cached[3:])  # and cached for its own


def test_a_batch_holds_at_most_max_loras_adapters(served):
    llm = _llm(served, max_loras=2)
    engine = llm.engine
    names = ["qv", "all", "mlp", "qv", "mlp", "all"]
    for i, name in enumerate(names):
        engine.add_request(_prompt(6, seed=i), SamplingParams(max_tokens=6, ignore_eos=True),
                           lora_request=LoRARequest(name))
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.adapter for r in engine.scheduler.running}
        assert len(running) <= 2
        seen |= running
    assert seen == set(ADAPTERS)  # every adapter got its turn
    assert_no_leaks(engine)


def test_memory_keeps_max_cpu_loras_and_never_drops_one_in_use(served):
    llm = _llm(served, max_loras=1, max_cpu_loras=1)
    engine, adapters = llm.engine, llm.engine.adapters
    assert adapters.resident == ["mlp"]  # the last of three loaded at start
    prompt = _prompt(9, seed=5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("qv"))[0]
    assert adapters.resident == ["qv"]  # read again from its folder, "mlp" dropped
    engine.add_request(prompt, params, "busy", lora_request=LoRARequest("qv"))
    adapters.get("all")  # a new one while "qv" has a request: both stay
    assert adapters.resident == ["qv", "all"]
    while engine.has_unfinished_requests():
        engine.step()
    again = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("qv"))[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert adapters.resident == ["qv"]  # past the capacity once "qv" no longer ran


def test_a_dropped_adapter_whose_files_are_gone_is_refused_by_name(served, tmp_path):
    """Dropped from memory, then its folder deleted: a request for it is a LoRAError (the
    server's 400) saying so, and the engine serves the others on."""
    import shutil

    _, folders, _, _ = served
    llm = _llm(served, max_loras=1, max_cpu_loras=1, lora_modules=[], enable_lora=True)
    engine = llm.engine
    copy = shutil.copytree(folders["qv"], tmp_path / "qv")
    engine.load_adapter("gone", str(copy))
    engine.load_adapter("kept", folders["mlp"])  # drops "gone" from memory
    shutil.rmtree(copy)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(LoRAError, match="'gone' was dropped from memory .* can no longer be read") as raised:
        engine.add_request(_prompt(5, seed=6), params, "gone-request", lora_request=LoRARequest("gone"))
    assert raised.value.field == "model"
    output = llm.generate([_prompt(5, seed=6)], params, use_tqdm=False, lora_request=LoRARequest("kept"))[0]
    assert len(output.outputs[0].token_ids) == 3
    assert_no_leaks(engine)


def test_unloading_lets_running_requests_finish_and_refuses_new_ones(served):
    llm = _llm(served)
    engine = llm.engine
    prompt = _prompt(11, seed=7)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = hf_greedy(served[2]["all"], prompt, 8)
    engine.add_request(prompt, params, "running", lora_request=LoRARequest("all"))
    engine.step()
    engine.unload_adapter("all")
    with pytest.raises(AdapterNotFound) as raised:
        engine.add_request(prompt, params, lora_request=LoRARequest("all"))
    assert raised.value.field == "model"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert list(outputs[0].outputs[0].token_ids) == expected
    engine.load_adapter("all", served[1]["all"])  # and back
    assert "all" in engine.adapters.resident


def test_errors_name_the_problem(served, llm, tmp_path):
    engine = llm.engine
    with pytest.raises(AdapterNotFound, match="no adapter named 'nope'"):
        engine.add_request([5, 6], SamplingParams(), lora_request=LoRARequest("nope"))
    with pytest.raises(LoRAError) as raised:
        engine.load_adapter("qv", served[1]["all"])  # the name is taken
    assert raised.value.field == "lora_name"
    with pytest.raises(LoRAError, match="above max_lora_rank=4"):
        _llm(served, max_lora_rank=4)  # "all" has rank 8
    plain = LLM(served[0], dtype="float32", quantization="none", num_kv_blocks=32, block_size=4, max_model_len=64)
    with pytest.raises(SamplingError, match="not enabled"):
        plain.engine.add_request([5, 6], SamplingParams(), lora_request=LoRARequest("qv", 1, served[1]["qv"]))
    with pytest.raises(LoRAError, match="not found"):
        engine.load_adapter("empty", str(tmp_path))
    with pytest.raises(LoRAError):  # not a FileNotFoundError (a server's 500): a 400 naming the path
        engine.load_adapter("gone", str(tmp_path / "gone"))
    assert_no_leaks(engine)


def test_a_lora_request_with_a_path_loads_the_adapter_offline(served):
    base, folders, merged, _ = served
    llm = LLM(base, dtype="float32", quantization="none", num_kv_blocks=64, block_size=4, max_model_len=128,
              enable_lora=True)
    prompt = _prompt(13, seed=8)
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False,
                       lora_request=LoRARequest("tuned", 1, folders["qv"]))[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(merged["qv"], prompt, 6)


def test_a_requests_scale_scales_its_adapter_and_keys_its_prefix_blocks(served, llm, tmp_path):
    """LoRARequest(scale=s) (llama.cpp's per-request scale): the merged model of the same adapter
    with B times s; the same adapter at two scales in one batch; and no prefix blocks shared
    between scales."""
    base = served[0]
    half = build_lora_adapter(base, str(tmp_path / "half"), 1, b_scale=0.5, **ADAPTERS["all"])  # "all"'s seed
    prompts = [_prompt(9, seed=21), _prompt(23, seed=22)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts * 2, params, use_tqdm=False,
                           lora_request=[LoRARequest("all", scale=0.5)] * 2 + [LoRARequest("all")] * 2)
    for prompt, output in zip(prompts, outputs[:2]):
        assert list(output.outputs[0].token_ids) == hf_greedy(half, prompt, 10)
    for prompt, output in zip(prompts, outputs[2:]):
        assert list(output.outputs[0].token_ids) == hf_greedy(served[2]["all"], prompt, 10)
    prompt = _prompt(40, seed=23)
    cached = [llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("all", scale=s))[0]
              .num_cached_tokens for s in (1.0, 0.5, 0.5)]
    assert cached[:2] == [0, 0] and cached[2] >= 36
    with pytest.raises(SamplingError, match="lora_scale"):
        llm.engine.add(EngineRequest.checked("x", [5, 6], SamplingParams(), TINY_VOCAB, 256,
                                             RequestOptions(lora_scale=0.5)))
    for scale in (float("nan"), float("inf"), 1e308, -3.5e38):  # 1e308 is a finite double, inf as a float32
        with pytest.raises(SamplingError, match="lora_scale: must be a finite number"):
            EngineRequest.checked("x", [5, 6], SamplingParams(), TINY_VOCAB, 256,
                                  RequestOptions(adapter="all", lora_scale=scale))
    assert_no_leaks(llm.engine)


def test_an_adapter_loaded_again_from_other_files_reuses_none_of_the_old_ones_blocks(served, llm):
    """The prefix cache keys on the adapter's files, not its name: after unloading an adapter and
    loading other files under its name (or loading them in place), the same prompt is computed
    again, with the new weights."""
    engine, folders, merged = llm.engine, served[1], served[2]
    prompt = _prompt(40, seed=31)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run():
        return llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("swap"))[0]

    engine.load_adapter("swap", folders["qv"])
    assert list(run().outputs[0].token_ids) == hf_greedy(merged["qv"], prompt, 6)
    assert run().num_cached_tokens >= 36
    engine.unload_adapter("swap")
    engine.load_adapter("swap", folders["mlp"])
    first = run()
    assert first.num_cached_tokens == 0 and list(first.outputs[0].token_ids) == hf_greedy(merged["mlp"], prompt, 6)
    engine.load_adapter("swap", folders["all"], replace=True)
    again = run()
    assert again.num_cached_tokens == 0 and list(again.outputs[0].token_ids) == hf_greedy(merged["all"], prompt, 6)
    engine.unload_adapter("swap")
    assert_no_leaks(engine)


def test_requests_of_many_adapters_all_finish_while_adapters_are_evicted_loaded_and_unloaded(served):
    """Under load: one adapter a batch and one in memory, so the engine drops and rereads adapters
    as their turns come; an adapter is loaded and another unloaded while requests of every adapter
    wait or run. Every request finishes, with its own adapter's answer."""
    _, folders, merged, base = served
    llm = _llm(served, max_loras=1, max_cpu_loras=1, max_num_seqs=4)
    engine = llm.engine
    names = ["qv", "all", "mlp", None] * 3
    prompts = [_prompt(6 + i, seed=40 + i) for i in range(len(names))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        engine.add_request(prompt, params, str(i), lora_request=LoRARequest(name) if name else None)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == 2:
            engine.unload_adapter("mlp")  # its waiting requests finish with it all the same
            engine.load_adapter("late", folders["qv"])
    assert len(finished) == len(names)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        assert list(finished[str(i)].outputs[0].token_ids) == hf_greedy(merged[name] if name else base, prompt, 5)
    assert_no_leaks(engine)


def test_the_cap_takes_no_seat_for_a_request_it_would_not_admit():
    """Under the priority policy a better request takes a worse one's seat, but not when its
    adapter cannot join the batch (max_loras): the seat would only go back to the victim, whose
    context would be recomputed every step."""
    from brisk.engine.adapters import AdapterCap
    from brisk.engine.waiting import PriorityQueue

    def request(rid: str, adapter: str | None, priority: int) -> Request:
        return Request(rid, [1, 2], SamplingParams(), adapter=adapter, priority=priority)

    running = [request("a1", "sql", 5), request("a2", "sql", 5)]
    cap = AdapterCap(PriorityQueue(), max_loras=1)
    cap.push(request("b", "law", 0))
    assert PriorityQueue.seat_victims(cap.queue, running, seats=2)  # the policy alone would preempt
    assert cap.seat_victims(running, seats=2) == []  # but "law" has no room while "sql" runs
    cap.push(request("c", "sql", 0))
    assert [r.request_id for r in cap.seat_victims(running, seats=2)] == ["a2"]  # "c" takes the newer one's seat


def test_the_cap_leaves_memory_victims_to_its_policy():
    """With LoRA on, the cap wraps the policy: under memory pressure the policy's victim goes
    (here priority's worst-ranked, the oldest), not the newest."""
    from brisk.engine.adapters import AdapterCap
    from brisk.engine.waiting import PriorityQueue

    running = [Request(rid, [1, 2], SamplingParams(), arrival_time=t, priority=p)
               for rid, t, p in (("worst", 0.0, 9), ("best", 1.0, 0))]
    assert AdapterCap(PriorityQueue(), max_loras=1).memory_victim(running, lambda r: 1).request_id == "worst"


def test_drafts_are_verified_with_the_adapter_applied(served):
    """Speculative decoding (prompt lookup) on requests of an adapter: the output is the merged
    model's greedy output, drafts and all."""
    _, _, merged, _ = served
    llm = _llm(served, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    prompt = _prompt(12, seed=50) * 3  # repeats: prompt lookup finds drafts
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("all"))[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(merged["all"], prompt, 16)
    assert output.metrics.spec_decode.num_draft_tokens > 0


def test_a_bf16_model_applies_adapters_as_the_reference_does(served):
    """bf16 activations (a bf16 model layer by layer; the fused decode step widens them): the C
    kernels' float32 update, rounded once, against the torch reference, and both near the
    merged float32 model."""
    llm = _llm(served, dtype="bfloat16")
    model, prompt = llm.engine.model, _prompt(21, seed=60)
    assert llm.engine.adapters.dtype == torch.bfloat16
    chosen = model.kernels
    logits = {}
    try:
        for name, kernels in (("kernels", CBackend()), ("layered", CBackend(fuse_decode=False)),
                              ("torch", KernelBackend())):
            model.use_kernels(kernels)
            logits[name] = _adapter_logits(llm.engine, "all", prompt, [9, 1, 1, 10])
    finally:
        model.use_kernels(chosen)
    exact = hf_logits(served[2]["all"], prompt)
    scale = exact.abs().max().item()
    errors = {name: (values.float() - exact).abs().max().item() for name, values in logits.items()}
    # bf16 rounds activations and the adapter itself (this one's B is large: its update is half
    # the logits' size); the fused step keeps activations in float32, the reference rounds them
    # between ops: both within a tenth of the logits' range of the exact ones (the base model
    # alone: 2%), the C paths at least as close as the reference
    assert all(error < 0.1 * scale for error in errors.values()), errors
    assert max(errors["kernels"], errors["layered"]) <= errors["torch"] + 0.01 * scale, errors
    assert (logits["kernels"].float() - logits["layered"].float()).abs().max().item() < 0.02 * scale


def test_streams_go_on_while_an_adapters_files_are_read(served, monkeypatch):
    """A server reads an adapter's files off the engine's loop (core_loop.Prepare): a request
    streaming meanwhile gets its tokens, and the adapter serves once it is read. The read waits
    until the stream has advanced 20 tokens, so it finishes only if the loop went on without it
    (a loop waiting for the files would leave the read to give up after a minute)."""
    from brisk.engine.adapters import Adapters
    from brisk.transport.async_engine import AsyncEngine

    base, folders, merged, _ = served
    read, streamed, released = Adapters._read, threading.Event(), []

    def slow_read(self, name, path):
        released.append(streamed.wait(timeout=60))  # a large adapter on a slow disk
        return read(self, name, path)

    monkeypatch.setattr(Adapters, "_read", slow_read)
    engine = AsyncEngine(engine=_llm(served, lora_modules=[], enable_lora=True).engine)
    prompt = _prompt(8, seed=70)

    async def scenario() -> list[int]:
        params = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
        outputs = aiter(engine.generate(_prompt(5, seed=71), params, "streaming"))
        before = len((await anext(outputs)).outputs[0].token_ids)  # the stream runs before the load begins
        loading = asyncio.create_task(engine.load_adapter("late", folders["qv"]))
        async for output in outputs:
            if len(output.outputs[0].token_ids) - before >= 20:
                streamed.set()
                break
        await loading
        await outputs.aclose()
        late = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), "late",
                               RequestOptions(adapter="late"))
        answer = [o async for o in late][-1]
        return list(answer.outputs[0].token_ids)

    try:
        tokens = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert released == [True]  # 20 tokens streamed while the files were being read
    assert tokens == hf_greedy(merged["qv"], prompt, 5)


def test_streams_go_on_while_a_dropped_adapter_is_read_again(served, monkeypatch):
    """max_cpu_loras=1: the second adapter asked for drops the first; a request for the first
    then waits while a thread of the loop reads its files again (core_loop.EngineLoop), a stream
    gets its tokens meanwhile (the read waits for 20 of them, as above), and two requests for it
    share the one read; then they answer as the merged model does."""
    from brisk.engine.adapters import Adapters
    from brisk.transport.async_engine import AsyncEngine

    _, _, merged, _ = served
    read, reads, streamed, released = Adapters._read, [], threading.Event(), []

    def slow_read(self, name, path):
        reads.append(name)
        released.append(streamed.wait(timeout=60))  # a large adapter on a slow disk
        return read(self, name, path)

    engine = AsyncEngine(engine=_llm(served, max_loras=1, max_cpu_loras=1).engine)
    prompt = _prompt(8, seed=72)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def answer(adapter: str, request_id: str) -> list[int]:
        outputs = [o async for o in engine.generate(prompt, params, request_id, RequestOptions(adapter=adapter))]
        return list(outputs[-1].outputs[0].token_ids)

    async def scenario() -> list[list[int]]:
        await answer("qv", "first")
        await answer("all", "second")  # drops qv from memory
        monkeypatch.setattr(Adapters, "_read", slow_read)
        streaming = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
        outputs = aiter(engine.generate(_prompt(5, seed=73), streaming, "streaming"))
        before = len((await anext(outputs)).outputs[0].token_ids)
        again = asyncio.gather(answer("qv", "again"), answer("qv", "again-2"))
        async for output in outputs:
            if len(output.outputs[0].token_ids) - before >= 20:
                streamed.set()
                break
        await outputs.aclose()
        return await again

    try:
        answers = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert reads == ["qv"] and released == [True]  # read again once, for both requests, while the stream went on
    assert answers == [hf_greedy(merged["qv"], prompt, 5)] * 2


def test_a_request_naming_an_unknown_adapters_files_loads_it_off_the_loop(served, monkeypatch):
    """An engine that does not serve an adapter (a Ray replica started after a run-time load)
    gets requests that name it with its files (RequestOptions.adapter_path, set by the Ray
    ingress): they wait, parked, while a thread reads it once, then answer as the merged model
    does; the adapter is served from then on. A request naming files that are not an adapter
    is a 404 of its own; one naming an adapter without files is refused as before."""
    from brisk.engine.adapters import Adapters, AdapterNotFound
    from brisk.transport.async_engine import AsyncEngine

    base, folders, merged, _ = served
    read, reads = Adapters._read, []

    def slow_read(self, name, path):
        reads.append(name)
        time.sleep(0.3)
        return read(self, name, path)

    monkeypatch.setattr(Adapters, "_read", slow_read)
    llm = _llm(served, lora_modules=[], enable_lora=True)
    engine = AsyncEngine(engine=llm.engine)
    prompt = _prompt(8, seed=76)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def answer(request_id: str, options: RequestOptions) -> list[int]:
        outputs = [o async for o in engine.generate(prompt, params, request_id, options)]
        return list(outputs[-1].outputs[0].token_ids)

    async def scenario() -> list:
        sourced = RequestOptions(adapter="qv", adapter_path=folders["qv"])
        first = await asyncio.gather(answer("a", sourced), answer("b", sourced))
        results = [first, await answer("c", RequestOptions(adapter="qv"))]
        for options in (RequestOptions(adapter="bad", adapter_path=base), RequestOptions(adapter="nameless")):
            try:
                await answer(f"refused-{options.adapter}", options)
            except AdapterNotFound as exc:
                results.append(str(exc))
        return results

    try:
        first, later, *refused = asyncio.run(scenario())
    finally:
        engine.shutdown()
    expected = hf_greedy(merged["qv"], prompt, 5)
    assert first == [expected] * 2 and later == expected
    assert reads == ["qv", "bad"]  # one read for both parked requests; none for the request without files
    assert llm.engine.adapters.infos["qv"].path == folders["qv"] and "bad" not in llm.engine.adapters.infos
    assert len(refused) == 2 and "no adapter named 'bad'" in refused[0] and "'nameless'" in refused[1]
    assert_no_leaks(llm.engine)


def test_a_request_aborted_while_its_adapter_is_read_again_never_runs(served, monkeypatch):
    """Aborted while parked for a read (its client gone), a request is dropped where it waits:
    once the adapter is read, nothing runs, and every block is back."""
    from brisk.engine.adapters import Adapters
    from brisk.transport.async_engine import AsyncEngine

    read = Adapters._read
    llm = _llm(served, max_loras=1, max_cpu_loras=1)
    added, add = [], llm.engine.add
    monkeypatch.setattr(llm.engine, "add", lambda request: added.append(request.request_id) or add(request))
    engine = AsyncEngine(engine=llm.engine)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def run(adapter: str, request_id: str) -> None:
        async for _ in engine.generate(_prompt(6, seed=74), params, request_id, RequestOptions(adapter=adapter)):
            pass

    reading, release = threading.Event(), threading.Event()

    def slow_read(self, name, path):
        reading.set()
        release.wait(timeout=60)
        return read(self, name, path)

    async def scenario() -> None:
        await run("qv", "first")
        await run("all", "second")  # drops qv from memory
        monkeypatch.setattr(Adapters, "_read", slow_read)
        stream = aiter(engine.generate(_prompt(6, seed=75), params, "parked", RequestOptions(adapter="qv")))
        waiting = asyncio.ensure_future(anext(stream))
        assert await asyncio.to_thread(reading.wait, 60)  # posted and parked: its adapter's read began
        waiting.cancel()
        await stream.aclose()
        release.set()
        deadline = time.monotonic() + 60  # the read ends, and the loop keeps what it read
        while llm.engine.adapters.resident != ["qv"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert added == ["first", "second"] and llm.engine.adapters.resident == ["qv"]  # read and kept, not run
    assert_no_leaks(llm.engine)
