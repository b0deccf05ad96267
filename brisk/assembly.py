"""Builds an engine with the techniques its config asks for plugged in.

The one place that knows both the engine's core (brisk.engine, which never imports a technique)
and the plug-ins that act through its seams (brisk.spec through the step hook). Everything that
starts an engine (the offline LLM, the engine loop on a thread or in a process, the CLI, the
benchmarks) starts it here.
"""

from __future__ import annotations

from brisk.config import EngineConfig
from brisk.engine.engine import LLMEngine
from brisk.spec.speculator import Speculator


def build_engine(config: EngineConfig) -> LLMEngine:
    return LLMEngine(config, Speculator.build if config.speculative_config is not None else None)
