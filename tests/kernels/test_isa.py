"""BRISK_ISA=avx2: a process on any AVX2 host behaves as on a CPU with AVX2, FMA and F16C and
nothing newer. Every run-time decision that reads the CPU follows it, and the kernels it builds
hold no AVX-512 instruction (read back from the libraries with objdump). The processes run in
subprocesses: torch fixes its capability at its first operation, which this one has long passed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels import isa
from tests.helpers import require_c_compiler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DECISIONS = r'''
import json, os, subprocess, sys, torch
from brisk import LLM, SamplingParams
from brisk.kernels import cpu, isa
from brisk.kernels.backend import fast_dtype
from brisk.model.loader import default_model_path, open_checkpoint, resolve_precision
from brisk.config import EngineConfig

llm = LLM(default_model_path(), max_model_len=256, kv_cache_memory_gib=0.05)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
precision = resolve_precision(EngineConfig(), open_checkpoint(default_model_path()), torch.device("cpu"))
a = torch.randint(-128, 128, (17, 256), dtype=torch.int8)
b = torch.randint(-128, 128, (256, 64), dtype=torch.int8)
int_mm_exact = bool((torch._int_mm(a, b).long() == a.long() @ b.long()).all())
print(json.dumps({
    "isa": isa.chosen().name, "march": isa.chosen().march, "capability": torch.backends.cpu.get_cpu_capability(),
    "int_mm_exact": int_mm_exact, "native_bf16": cpu.native_bf16(),
    "fast_dtype": str(fast_dtype(torch.device("cpu"))), "kv_cache": precision.kv_cache,
    "lora_bf16_products": cpu.lora_bf16_products(), "kernels": llm.engine.model.kernels.__class__.__name__,
    "tokens": out[0].outputs[0].token_ids,
    "libraries": sorted({line.split()[-1] for line in open("/proc/self/maps") if str(cpu._cache_dir()) in line})}))
'''


def _decisions(isa_name: str | None) -> dict:
    """What a fresh process decides under BRISK_ISA=isa_name (its "libraries": the kernel
    libraries it mapped), in an environment without this run's instruction-set variables."""
    env = {k: v for k, v in os.environ.items() if k not in (isa.ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    if isa_name is not None:
        env[isa.ENV] = isa_name
    result = subprocess.run([sys.executable, "-c", DECISIONS], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def _evex(library) -> list[str]:
    """The instructions of a library that only AVX-512 runs: EVEX-encoded (first byte 0x62, which
    64-bit mode gives no other meaning), or naming a zmm or mask register."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                             check=True).stdout
    raw = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    found = [line for line in listing.splitlines() if re.search(r"%zmm|%k[0-7]\b", line)]
    found += [line for line in raw.splitlines() if re.match(r"\s*[0-9a-f]+:\s+(67 )?62 ", line)]
    return found


@pytest.fixture(scope="module")
def objdump():
    require_c_compiler()
    if shutil.which("objdump") is None:
        pytest.fail("objdump (binutils) is needed to read the built kernels back")


@pytest.mark.skipif("avx2" not in isa.host_flags(), reason="needs an x86-64 CPU with AVX2")
def test_avx2_reaches_every_decision_and_builds_no_avx512_instruction(objdump):
    avx2 = _decisions("avx2")
    assert avx2["isa"] == "avx2" and avx2["march"] == "x86-64-v3" and avx2["capability"] == "AVX2"
    assert avx2["int_mm_exact"]  # oneDNN left uncapped: capped at AVX2 its int8 product saturates
    assert (avx2["native_bf16"], avx2["fast_dtype"], avx2["kv_cache"]) == (False, "torch.float32", "float16")
    assert avx2["lora_bf16_products"] is False and avx2["kernels"] == "CBackend"
    assert len(avx2["tokens"]) == 4
    assert len(avx2["libraries"]) >= 5  # the products, attention, the layer ops, the sampler, LoRA
    for library in avx2["libraries"]:
        assert _evex(library) == [], f"{library} holds AVX-512 instructions"


def test_the_check_finds_avx512_instructions_where_they_are(fresh_cache, objdump):
    """The control: the same reading finds EVEX code in a library built for x86-64-v4 (built,
    never run, so any x86-64 host can hold it)."""
    library = cpu_kernels._library.__wrapped__("linear.c", march="x86-64-v4")
    assert _evex(library._name)


@pytest.mark.skipif("avx512_bf16" not in isa.host_flags(), reason="the host has no AVX-512 BF16 to hide")
def test_native_keeps_what_the_host_has(objdump):
    native = _decisions(None)
    assert native["isa"] == "native" and native["capability"].startswith("AVX512")
    assert (native["native_bf16"], native["fast_dtype"], native["kv_cache"]) == (True, "torch.bfloat16", "bfloat16")
    assert native["lora_bf16_products"] is True and native["int_mm_exact"]
    assert any(_evex(library) for library in native["libraries"])


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_a_name_it_does_not_know_or_a_cpu_without_avx2_is_refused(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx512")
    with pytest.raises(isa.InstructionSetError, match="BRISK_ISA='avx512' is not an instruction set"):
        isa.chosen()
    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setattr(isa, "host_flags", lambda: frozenset({"sse2", "avx"}))
    with pytest.raises(isa.InstructionSetError, match="needs a CPU with avx2, f16c, fma; this one .* lacks avx2, f16c, fma"):
        isa.chosen()


def test_avx2_hides_what_is_newer_and_keeps_the_rest(monkeypatch):
    monkeypatch.setattr(isa, "host_flags", lambda: frozenset(
        "sse2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512_vnni avx512_bf16 avx_vnni amx_int8 amx_tile".split()))
    monkeypatch.setenv(isa.ENV, "avx2")
    assert isa.cpu_flags() == {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}
    assert not cpu_kernels.native_bf16()
    monkeypatch.setenv(isa.ENV, "native")
    assert cpu_kernels.native_bf16() and "avx512_vnni" in isa.cpu_flags()


def test_the_command_line_option_sets_the_variable_for_the_processes_it_starts():
    """`brisk --isa avx2 COMMAND`: the command runs with BRISK_ISA set (its children inherit it)
    and torch capped, though brisk and torch were imported before the option was read."""
    probe = ("import os, subprocess, sys, torch; from brisk import cli; "
             "cli.cmd_generate = lambda args: print(subprocess.run([sys.executable, '-c', "
             "'import os; print(os.environ[\"BRISK_ISA\"])'], capture_output=True, text=True).stdout.strip(), "
             "torch.backends.cpu.get_cpu_capability()); "
             "sys.exit(cli.main(['--isa', 'avx2', 'generate', 'hello']))")
    env = {k: v for k, v in os.environ.items() if k != isa.ENV}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["avx2", "AVX2"]
