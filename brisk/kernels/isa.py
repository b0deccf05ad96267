"""The instruction set a brisk process targets: the host's own (native), or AVX2 on any x86-64
host that has it.

Fleets mix CPUs, and a figure taken on an AVX-512 machine says little about the AVX2 machines
most users have (AMD Zen 2 and 3, Intel before Ice Lake servers and Alder Lake). `BRISK_ISA=avx2`
(or `brisk --isa avx2 COMMAND`) makes the process behave as it would on a CPU with AVX2, FMA and
F16C and nothing newer:

- the C kernels are built for `x86-64-v3` instead of `-march=native`;
- every decision that reads the CPU's flags sees none of AVX-512, AVX-VNNI or AMX (`cpu_flags`):
  bf16 as the fast dtype and the 16-bit KV cache kind (kernels/backend.py: fast_dtype), LoRA's
  bf16 products (decided when lora.c is built, so by the target);
- torch's own vectorized ops are capped at AVX2 (ATEN_CPU_CAPABILITY).

oneDNN, which `torch._int_mm` runs (w8a8 products past 8 rows), is left to choose: capped with
ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 host its int8 x int8 product saturates (vpmaddubsw's 16-bit
pair sums; checked: wrong results on full-range int8, where the same tests pass on a real AVX2
Zen 3), so the cap would show an answer no AVX2 machine gives. Under avx2 that one product keeps
the host's speed: a proxy's w8a8 rows are not AVX2 figures.

torch reads ATEN_CPU_CAPABILITY once, at its first operation, not at import; `configure_torch`
sets them and is called where brisk is imported, and by the `brisk` command after it reads
`--isa`. Child processes (the engine process, a benchmark's servers) inherit the environment.
The setting is process-wide by nature (torch's capability cannot change once read), so it
lives in the environment rather than in EngineConfig, whose knobs are per engine.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from functools import cache

log = logging.getLogger(__name__)

ENV = "BRISK_ISA"


@dataclass(frozen=True)
class InstructionSet:
    name: str
    march: str  # gcc's -march for the C kernels
    needs: frozenset[str]  # /proc/cpuinfo flags the host must have
    hidden: tuple[str, ...]  # prefixes of the host's flags this target does not use
    aten: str | None  # ATEN_CPU_CAPABILITY, or None to leave torch's choice

    def describe(self) -> str:
        """How BENCHMARKS.md and the start log name the build."""
        if self.name == "native":
            return f"native (-march=native: {_native_summary()})"
        return f"{self.name} ({ENV}={self.name}: kernels -march={self.march}, torch capped at {self.aten})"


NATIVE = InstructionSet("native", "native", frozenset(), (), None)
AVX2 = InstructionSet("avx2", "x86-64-v3", frozenset({"avx2", "fma", "f16c"}),
                      ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10"), "avx2")
INSTRUCTION_SETS = {s.name: s for s in (NATIVE, AVX2)}


class InstructionSetError(ValueError):
    """BRISK_ISA names no instruction set, or one this CPU cannot run."""


def chosen() -> InstructionSet:
    """The instruction set BRISK_ISA names (native when unset), checked against the host."""
    name = os.environ.get(ENV, "native").strip().lower() or "native"
    target = INSTRUCTION_SETS.get(name)
    if target is None:
        raise InstructionSetError(f"{ENV}={name!r} is not an instruction set brisk targets; "
                                  f"choose one of {', '.join(INSTRUCTION_SETS)}")
    missing = sorted(target.needs - host_flags())
    if missing:
        raise InstructionSetError(f"{ENV}={name} needs a CPU with {', '.join(sorted(target.needs))}; "
                                  f"this one ({platform.machine()}) lacks {', '.join(missing)}")
    return target


def choose(name: str) -> InstructionSet:
    """Sets BRISK_ISA for this process and its children, and caps torch to match (`brisk --isa`)."""
    os.environ[ENV] = name
    target = chosen()
    configure_torch(target)
    return target


def configure_torch(target: InstructionSet | None = None) -> None:
    """Caps torch's own kernels at the target's instruction set. Effective until torch's first
    operation; one that already ran keeps torch at the host's, said once in the log."""
    target = target or chosen()
    if target.aten is not None:
        os.environ["ATEN_CPU_CAPABILITY"] = target.aten
    if target.aten is not None and "torch" in sys.modules:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        if capability.lower() != target.aten:
            log.warning("%s=%s, but torch already chose its %s kernels (an operation ran before brisk was "
                        "imported): set %s in the environment before starting Python", ENV, target.name,
                        capability, ENV)


def cpu_flags() -> frozenset[str]:
    """The host's flags as the chosen target sees them: without those it does not use."""
    hidden = chosen().hidden
    return frozenset(f for f in host_flags() if not f.startswith(hidden)) if hidden else host_flags()


@cache
def host_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux), empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def _native_summary() -> str:
    flags = host_flags()
    widest = ("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE" if "sse2" in flags
              else platform.machine())
    extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx512_bf16", "BF16"),
                                      ("amx_int8", "AMX")) if flag in flags]
    return " + ".join([widest, *extras])
