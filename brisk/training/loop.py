"""What every training run here shares: the learning-rate schedule and the loop around its steps.

A run gets a step count or a time budget. Under a budget it times its first steps (after the first
one, which allocates and warms caches: about twice as slow), then fixes its step count, so the
schedule decays fully within the budget and a rerun with `--steps` set to that count repeats it
exactly. Every checkpoint_minutes, and when it stops (finished, failed or interrupted), it saves,
so the same command with the same output folder resumes where it stopped.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import torch

from brisk.config import ConfigError

TIMED_STEPS = 3  # a budgeted run times this many steps, after a first one


def check_knobs(config, own: tuple[tuple[str, bool, str], ...]) -> None:
    """A run's flags checked: its own checks, then the schedule's every run shares; the first that
    fails is a ConfigError naming the flag."""
    shared = (("budget_minutes", config.budget_minutes is None or config.budget_minutes > 0, "must be > 0"),
              ("steps", config.steps is None or config.steps >= 1, "must be >= 1"),
              ("steps", config.steps is not None or config.budget_minutes is not None, "or --budget-minutes is needed"),
              ("batch_size", config.batch_size >= 1, "must be >= 1"),
              ("seq_len", config.seq_len >= 8, "must be >= 8"),
              ("lr", 0 < config.lr < 1, "must be in (0, 1)"),
              ("warmup_steps", config.warmup_steps >= 0, "must be >= 0"),
              ("weight_decay", config.weight_decay >= 0, "must be >= 0"),
              ("max_grad_norm", config.max_grad_norm > 0, "must be > 0"),
              ("checkpoint_minutes", config.checkpoint_minutes > 0, "must be > 0"))
    for name, ok, rule in (*own, *shared):
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')} {rule}, got {getattr(config, name)!r}")


def resumes(out: str, state_path: str) -> bool:
    """Whether a run writing to `out` resumes an earlier one (its state at state_path); a
    ConfigError where `out` exists and holds something else."""
    resuming = os.path.exists(state_path)
    if os.path.exists(out) and not resuming and not (os.path.isdir(out) and not os.listdir(out)):
        raise ConfigError(f"--out {out!r} exists and holds no run to resume: choose a new or empty folder")
    return resuming


def save_state(state: dict[str, Any], config, path: str) -> None:
    """A run's state and its settings, written atomically (an interrupted write leaves the last one)."""
    torch.save({"config": asdict(config), **state}, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_state(path: str, config, weights_only: bool = True) -> dict[str, Any]:
    """The state save_state wrote, refused (ConfigError) if the run had other settings than
    `config` (the time budget and the checkpoint interval may change between sessions)."""
    saved = torch.load(path, weights_only=weights_only)
    ours, theirs = asdict(config), saved["config"]
    changed = [k for k in ours if k not in ("budget_minutes", "checkpoint_minutes") and ours[k] != theirs[k]]
    if changed:
        raise ConfigError(f"{path} is a run with other settings ({', '.join(f'{k}={theirs[k]!r}' for k in changed)}):"
                          f" resume with the same ones, or choose a new --out")
    return saved


def warmup_cosine(step: int, peak: float, warmup: int, total: int | None) -> float:
    """Linear warmup to `peak`, then a cosine decay to zero at the last step (the full peak while
    the step count of a budgeted run is still unknown)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None:
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Progress:
    """Where a run is: what the loop keeps and a resumed run restores."""

    step: int = 0
    total_steps: int | None = None  # None until a budgeted run has timed its first steps
    losses: list[tuple[float, ...]] = field(default_factory=list)  # each step's values, as step() named them
    train_seconds: float = 0.0


class Steps(Protocol):
    state: Progress

    def step(self) -> dict[str, float]:
        """One optimizer step: its loss (and parts), by name."""

    def learning_rate(self, step: int) -> float: ...


def run(trainer: Steps, budget_minutes: float | None, checkpoint_minutes: float, save: Callable[[], None],
        log: Callable[[str], None], progress: bool) -> None:
    """Steps until the step count (fixed from the first steps' pace under a budget), with a
    progress bar, saving every checkpoint_minutes and when it stops, finished or not."""
    from tqdm import tqdm

    state = trainer.state
    bar = tqdm(total=state.total_steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True)
    last_save, first_step = time.perf_counter(), 0.0
    try:
        while state.total_steps is None or state.step < state.total_steps:
            clock = time.perf_counter()
            values = trainer.step()
            state.step += 1
            state.losses.append(tuple(values.values()))
            state.train_seconds += time.perf_counter() - clock
            if state.step == 1:
                first_step = state.train_seconds
            if state.total_steps is None and state.step >= TIMED_STEPS + 1:
                pace = (state.train_seconds - first_step) / (state.step - 1)
                state.total_steps = max(state.step, int(budget_minutes * 60 / pace))
                bar.reset(total=state.total_steps)
                bar.update(state.step)
                log(f"{pace:.1f} s a step: {state.total_steps} steps fit {budget_minutes:g} minutes")
            else:
                bar.update(1)
            bar.set_postfix(**{name: f"{value:.3f}" for name, value in values.items()},
                            lr=f"{trainer.learning_rate(state.step):.1e}")
            if time.perf_counter() - last_save > checkpoint_minutes * 60:
                save()
                last_save = time.perf_counter()
    finally:  # Ctrl-C included: the next run with the same output folder resumes from here
        bar.close()
        save()
