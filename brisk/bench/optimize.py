"""`brisk optimize`: measure what each technique does on this machine, and pick the cheapest
configuration that meets latency targets within a quality budget, on evidence.

The plain configuration is the reference: float32 weights and KV cache, no prefix caching, no
speculative decoding, no response cache, the engine's default batch limits. Each technique
(TECHNIQUES) changes a few knobs of it. Each configuration is a real `brisk serve` loaded with
the same workload (brisk/bench/load.py); its quality is the perplexity of the weight and KV
formats it runs over the first tokens of Pride and Prejudice (techniques that leave the logits
as they are share plain's figure).

Why rounds. On a shared 2-core machine two runs of one configuration differ by 5-15% in
latency; a single run per configuration credits noise to whichever technique ran in a quiet
spell. So configurations are measured in rounds (`--rounds`, at least 3): a round runs plain
and every candidate once, in an order shuffled per round, so a slow spell costs each round's
configurations alike. Every figure is the median of its rounds, shown with its range. A
configuration's effect on a figure is the median of its paired differences from the reference
measured in the same round, and it counts only where it exceeds both plain's own range on that
figure and NOISE_FLOOR; otherwise the report says "no measurable effect".

The search, within `--budget-minutes`:

1. plain and every technique that can act on this workload, alone, in rounds. A technique that
   cannot (a batch limit above the load's concurrency, a drafter whose own rule switches it off
   at this concurrency, read from the drafter) is reported as such and not measured.
2. a greedy stack from the technique with the largest credited gain: each other credited
   technique is added and the stack and the stack-plus-one measured in rounds of their own; it
   is kept only if the addition is better beyond the noise.

A configuration is better than another when it meets every `--target` and the quality budget
(by its medians) and, where the other met them too, its output throughput (the cost) is
higher beyond the noise; where the other missed a target, its figure on that target is better
beyond the noise. When the budget ends, what was measured is reported and the rest marked
unmeasured.

Measurements are kept in a store (`--store`; a cache folder, never the report folder) keyed by
the configuration, the round, the workload, the model's content, brisk's code (identity.py) and
the host, and reused by a later run with the same keys (a run with a larger budget goes on
where the last stopped); every output marks reused figures with the date they were taken, and
`--fresh` measures everything anew.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

from tqdm import tqdm

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.load import THROUGHPUTS, LoadReport, LoadRequest, latency_figure
from brisk.bench.perplexity import perplexity
from brisk.config import DEFAULT_TEXT
from brisk.bench.serve import load_settings, measure, workload
from brisk.config import ConfigError, EngineConfig, ServerConfig, SpeculativeConfig, knobs
from brisk.identity import content_digest, source_digest
from brisk.kernels import cpu as cpu_kernels
from brisk.spec.speculator import drafting_limit

# The plain configuration's values of every knob a technique touches.
PLAIN = {"dtype": "float32", "quantization": "none", "int8_activations": False, "kv_cache_dtype": "auto",
         "enable_prefix_caching": False, "speculative_config": None}
# The knobs that change the logits, and so the perplexity.
QUALITY_KNOBS = ("dtype", "quantization", "quantization_group_size", "int8_activations", "kv_cache_dtype")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MIN_ROUNDS = 3
# The smallest effect credited, in percent, however steady plain ran.
NOISE_FLOOR = 3.0
# The figures every configuration is judged on; +1 where higher is better.
JUDGED = {"output_throughput": +1, "ttft_p50_ms": -1, "ttft_p95_ms": -1, "tpot_p50_ms": -1}


@dataclass(frozen=True)
class Technique:
    name: str
    what: str  # one line for the report
    engine: dict = field(default_factory=dict)  # EngineConfig knobs it sets
    response_cache: bool = False
    group: str | None = None  # techniques of one group replace each other (one weight format, ...)


TECHNIQUES = (
    Technique("bf16", "bfloat16 weights and KV cache (where the CPU multiplies bf16 natively)",
              {"dtype": "bfloat16"}, group="dtype"),
    Technique("int8", "int8 weights, float activations", {"quantization": "int8"}, group="weights"),
    Technique("int8-act", "int8 weights and int8 decode activations (integer matmuls)",
              {"quantization": "int8", "int8_activations": True}, group="weights"),
    Technique("int4", "int4 weights, groups of 32", {"quantization": "int4"}, group="weights"),
    Technique("gguf", "the GGUF file's own 4/8-bit blocks, run natively", {"quantization": "gguf"},
              group="weights"),
    Technique("gguf-a8", "the GGUF file's own blocks with int8 activations (quantization auto's choice on CPU)",
              {"quantization": "gguf", "int8_activations": True}, group="weights"),
    Technique("kv-int8", "int8 KV cache (a scale per token and head)", {"kv_cache_dtype": "int8"}),
    Technique("prefix-cache", "prefix caching (shared prompt blocks reused)", {"enable_prefix_caching": True}),
    Technique("ngram", "speculative decoding by prompt lookup, 4 tokens", {"speculative_config": NGRAM}),
    Technique("seqs-16", "at most 16 sequences per batch", {"max_num_seqs": 16}, group="seqs"),
    Technique("chunk-512", "512-token steps (longer prefill chunks)", {"max_num_batched_tokens": 512},
              group="chunk"),
    Technique("response-cache", "the response cache (exact and semantic)", response_cache=True),
)


def technique(name: str) -> Technique:
    for t in TECHNIQUES:
        if t.name == name:
            return t
    raise ConfigError(f"unknown technique {name!r}; techniques: {', '.join(t.name for t in TECHNIQUES)}")


def not_applicable(t: Technique, base: EngineConfig, model_path: str, concurrency: int | None) -> str | None:
    """Why technique t cannot run here, or cannot change this workload's figures; None when it can.
    `concurrency`: the requests in flight once the load runs (None: not bounded by the load)."""
    if t.name == "bf16" and base.torch_device.type == "cpu" and not cpu_kernels.native_bf16():
        return "this CPU has no native bf16 (emulated bf16 matmuls are several times slower than fp32)"
    if t.engine.get("quantization") == "gguf" and not model_path.endswith(".gguf"):
        return "the model is not a GGUF file"
    if concurrency is None:
        return None
    limit = t.engine.get("max_num_seqs")
    if limit is not None and limit >= concurrency:
        return (f"no effect possible: this workload has at most {concurrency} requests in flight, within the "
                f"limit of {limit} sequences")
    if t.engine.get("speculative_config"):
        spec = SpeculativeConfig.parse(t.engine["speculative_config"])
        cap = drafting_limit(spec)
        if cap is not None and concurrency > cap:
            return (f"no effect possible: the {spec.method} drafter drafts only while at most {cap} sequences run "
                    f"(its rule), and this workload keeps {concurrency} in flight")
    return None


@dataclass(frozen=True)
class Target:
    """`METRIC=VALUE`: a latency figure (ms) must not exceed VALUE; a throughput must reach it."""

    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> "Target":
        metric, sep, value = text.partition("=")
        try:
            target = cls(metric.strip(), float(value))
        except ValueError:
            target = None
        if not sep or target is None:
            raise ConfigError(f"--target takes METRIC=VALUE (e.g. ttft_p95_ms=800), got {text!r}")
        if target.metric not in THROUGHPUTS:
            latency_figure(target.metric)  # an unknown name is refused here, before anything is measured
        if not target.value > 0:
            raise ConfigError(f"--target {text!r}: the value must be > 0")
        return target

    @property
    def upper_bound(self) -> bool:
        return self.metric.endswith("_ms")

    def excess(self, value: float | None) -> float:
        """How far a figure misses the target, relative to it (0 when met; inf without a figure)."""
        if value is None:
            return math.inf
        missed = value - self.value if self.upper_bound else self.value - value
        return max(0.0, missed) / self.value

    def __str__(self) -> str:
        return f"{self.metric} {'<=' if self.upper_bound else '>='} {self.value:g}"


@dataclass(frozen=True)
class Candidate:
    techniques: tuple[str, ...]  # in the order applied; () is plain

    @property
    def name(self) -> str:
        return " + ".join(self.techniques) or "plain"

    def engine(self, base: EngineConfig) -> EngineConfig:
        overrides = dict(PLAIN)
        for name in self.techniques:
            overrides.update(technique(name).engine)
        return replace(base, **overrides)

    @property
    def response_cache(self) -> bool:
        return any(technique(name).response_cache for name in self.techniques)

    def with_(self, name: str) -> "Candidate":
        group = technique(name).group
        kept = tuple(t for t in self.techniques if group is None or technique(t).group != group)
        return Candidate((*kept, name))


PLAIN_CANDIDATE = Candidate(())


@dataclass
class Measurement:
    candidate: str
    round: str  # "alone 2/3", "stack int8 + kv-int8 1/3": the round it was measured in
    report: LoadReport
    perplexity: float
    seconds: float  # what measuring it cost
    measured_on: str  # ISO date
    reused: bool = False

    def to_json(self) -> dict:
        return {"candidate": self.candidate, "round": self.round, "report": self.report.to_json(),
                "perplexity": self.perplexity, "seconds": self.seconds, "measured_on": self.measured_on}

    @classmethod
    def from_json(cls, data: dict) -> "Measurement":
        return cls(data["candidate"], data["round"], LoadReport.from_json(data["report"]), data["perplexity"],
                   data["seconds"], data["measured_on"], reused=True)


@dataclass(frozen=True)
class Spread:
    """A figure over rounds: the median and the range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread | None":
        return cls(statistics.median(values), min(values), max(values)) if values else None

    @property
    def range_percent(self) -> float:
        return (self.high - self.low) / self.median * 100 if self.median else math.inf

    def text(self, digits: int = 1) -> str:
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


@dataclass(frozen=True)
class Effect:
    """A configuration against a reference measured in the same rounds, on one figure: the
    median of the paired relative differences, and the noise it must clear."""

    metric: str
    change: float  # percent; + where the figure grew
    threshold: float  # percent: plain's own range on the figure, at least NOISE_FLOOR

    @property
    def verdict(self) -> str:
        """"better", "worse" or "none" (inside the noise)."""
        gain = self.change * JUDGED[self.metric]
        return "better" if gain > self.threshold else "worse" if gain < -self.threshold else "none"

    def __str__(self) -> str:
        if self.verdict == "none":
            return f"{self.change:+.0f}%, no measurable effect (noise {self.threshold:.0f}%)"
        return f"**{self.change:+.0f}%** ({self.verdict})"


@dataclass
class StackTrial:
    base: Candidate
    trial: Candidate
    effects: dict[str, Effect] | None  # None: not measured in every round (budget)
    kept: bool


class Optimizer:
    def __init__(self, base: EngineConfig, requests: list[LoadRequest], args, targets: list[Target],
                 store: Path, skip: tuple[str, ...] = (), log=print):
        self.base, self.requests, self.args, self.targets, self.log = base, requests, args, targets, log
        if args.rounds < MIN_ROUNDS:
            raise ConfigError(f"--rounds must be >= {MIN_ROUNDS} (a range needs several rounds), got {args.rounds}")
        self.rounds = args.rounds
        self.settings = load_settings(args, args.request_rate)
        self.model_path = _model_path(base)
        self.model_digest = content_digest(self.model_path)
        self.store_path = store
        self.stored: dict[str, dict] = {}
        if store.exists() and not args.fresh:
            self.stored = json.loads(store.read_text())
        self.measured: dict[Candidate, dict[str, Measurement]] = {}
        self.perplexities: dict[str, float] = {}
        self.skipped: dict[str, str] = {technique(name).name: "left out (--skip)" for name in skip}
        self.stack: list[StackTrial] = []
        self.concurrency = _concurrency(len(requests), args.max_concurrency, args.request_rate)
        self.started = time.monotonic()
        self.budget = args.budget_minutes * 60
        self.budget_spent = False

    # --- keys, so that measurements carry over between runs
    def _key(self, candidate: Candidate, round_label: str) -> str:
        config = candidate.engine(self.base)
        workload = {k: getattr(self.args, k) for k in ("dataset", "dataset_path", "num_prompts", "output_len",
                                                       "ignore_eos", "random_input_len", "random_range_ratio",
                                                       "repeat_fraction", "temperature", "max_concurrency",
                                                       "request_rate", "workload_seed", "warmup", "goodput", "text",
                                                       "perplexity_tokens", "perplexity_context_len")}
        identity = {"engine": config_flags(config), "response_cache": candidate.response_cache, "round": round_label,
                    "workload": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in workload.items()},
                    "model": self.model_digest, "code": source_digest(), "machine": machine()}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def _save(self) -> None:
        self.store_path.parent.mkdir(parents=True, exist_ok=True)
        self.store_path.write_text(json.dumps(self.stored, indent=1))

    # --- measuring
    def measure(self, candidate: Candidate, round_label: str) -> Measurement | None:
        """The candidate's figures in this round, measured now or reused; None when the budget
        cannot cover it."""
        if round_label in self.measured.get(candidate, {}):
            return self.measured[candidate][round_label]
        key = self._key(candidate, round_label)
        if key in self.stored:
            m = Measurement.from_json(self.stored[key])
        else:
            if not self._affordable():
                self.budget_spent = True
                return None
            start = time.monotonic()
            quality = self._perplexity(candidate.engine(self.base))
            report = self._load(candidate)
            m = Measurement(candidate.name, round_label, report, quality, time.monotonic() - start,
                            date.today().isoformat())
            self.stored[key] = m.to_json()
            self._save()
        self.measured.setdefault(candidate, {})[round_label] = m
        self.log(f"  [{round_label}] {candidate.name}: {_line(m.report)}" + (_reused(m) if m.reused else ""))
        return m

    def run_rounds(self, candidates: list[Candidate], phase: str, bar: tqdm) -> bool:
        """Every candidate once per round, in an order shuffled per round (seeded by the phase and
        round, so a rerun repeats it); False when the budget ended first."""
        for r in range(self.rounds):
            order = list(candidates)
            random.Random(f"{self.args.workload_seed}/{phase}/{r}").shuffle(order)
            for candidate in order:
                if self.measure(candidate, f"{phase} {r + 1}/{self.rounds}") is None:
                    return False
                bar.update()
        return True

    def _affordable(self) -> bool:
        """Whether one more measurement fits the budget, by the mean of those made so far."""
        spent = time.monotonic() - self.started
        fresh = [m.seconds for rounds in self.measured.values() for m in rounds.values() if not m.reused]
        expected = sum(fresh) / len(fresh) if fresh else 0.0
        return spent + expected <= self.budget

    def _perplexity(self, config: EngineConfig) -> float:
        key = json.dumps([str(getattr(config, k)) for k in QUALITY_KNOBS])
        if key not in self.perplexities:
            from brisk.llm import LLM

            llm = LLM.from_config(config)
            text = Path(self.args.text or DEFAULT_TEXT)
            if not text.exists():
                raise ConfigError(f"no text at {text}: run `make install` (it fetches Pride and Prejudice) or "
                                  f"pass --text")
            ids = llm.tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False)
            context = min(self.args.perplexity_context_len, llm.engine.max_model_len)
            result = perplexity(llm, ids[:self.args.perplexity_tokens], context, max(1, context * 3 // 4))
            self.perplexities[key] = result.perplexity
            del llm
            gc.collect()
        return self.perplexities[key]

    def _load(self, candidate: Candidate) -> LoadReport:
        server = ServerConfig(port=free_port(), log_level="warning")
        flags = [*config_flags(candidate.engine(self.base)), *config_flags(server)]
        with tempfile.TemporaryDirectory(prefix="brisk-optimize-") as data_dir:
            if candidate.response_cache:  # an empty store of its own: no answer of an earlier run is reused
                flags += ["--data-dir", data_dir]
            else:  # the embedding model serves only the semantic cache here: not loading it saves seconds
                flags += ["--embedding-model", "none"]
            with brisk_serve(flags, server, self.args.startup_timeout, candidate.response_cache) as url:
                return measure(url, self.requests, self.settings, candidate.name, self.args.warmup)

    # --- figures
    def spread(self, candidate: Candidate, metric: str, phase: str | None = None) -> Spread | None:
        """The candidate's figure over its rounds (of one phase, or all)."""
        values = [m.report.metric(metric) for label, m in self.measured.get(candidate, {}).items()
                  if phase is None or label.startswith(phase + " ")]
        return Spread.of([v for v in values if v is not None])

    def perplexity_of(self, candidate: Candidate) -> float:
        return next(iter(self.measured[candidate].values())).perplexity

    def quality_drop(self, candidate: Candidate) -> float:
        """Perplexity increase over plain, in percent."""
        return (self.perplexity_of(candidate) / self.perplexity_of(PLAIN_CANDIDATE) - 1) * 100

    def threshold(self, metric: str) -> float:
        """The smallest change on `metric` told apart from noise: plain's own range, alone, or the floor."""
        plain = self.spread(PLAIN_CANDIDATE, metric, "alone")
        return max(NOISE_FLOOR, plain.range_percent if plain else math.inf)

    def effect(self, candidate: Candidate, reference: Candidate, metric: str, phase: str) -> Effect | None:
        """Candidate against reference over the rounds of `phase` both ran in; None unless every
        round of the phase has both."""
        ours, theirs = self.measured.get(candidate, {}), self.measured.get(reference, {})
        pairs = [(ours[label].report.metric(metric), theirs[label].report.metric(metric))
                 for label in ours if label.startswith(phase + " ") and label in theirs]
        pairs = [(a, b) for a, b in pairs if a is not None and b]
        if len(pairs) < self.rounds:
            return None
        return Effect(metric, statistics.median((a / b - 1) * 100 for a, b in pairs), self.threshold(metric))

    def complete(self, candidate: Candidate, phase: str) -> bool:
        return sum(label.startswith(phase + " ") for label in self.measured.get(candidate, {})) >= self.rounds

    def shortfall(self, candidate: Candidate) -> float:
        """0 when the candidate's medians meet every target and the quality budget; else how far
        they miss (relative)."""
        latency = sum(t.excess(_median(self.spread(candidate, t.metric))) for t in self.targets)
        quality = max(0.0, self.quality_drop(candidate) - self.args.max_quality_drop) / 100
        failed = any(m.report.failed for m in self.measured[candidate].values())
        return latency + quality + (math.inf if failed else 0.0)

    def better(self, candidate: Candidate, reference: Candidate, phase: str) -> bool:
        """Whether candidate beats reference beyond the noise (module docstring)."""
        if self.shortfall(candidate) > 0:
            return False
        if self.shortfall(reference) == 0:
            effect = self.effect(candidate, reference, "output_throughput", phase)
            return effect is not None and effect.verdict == "better"
        missed = [t.metric for t in self.targets if t.excess(_median(self.spread(reference, t.metric))) > 0]
        effects = [self.effect(candidate, reference, metric, phase) for metric in missed if metric in JUDGED]
        return any(e is not None and e.verdict == "better" for e in effects)

    # --- the search
    def run(self) -> Candidate | None:
        singles = [Candidate((t.name,)) for t in TECHNIQUES if self._applies(t)]
        bar = tqdm(total=(len(singles) + 1) * self.rounds, desc="optimize", unit="run",
                   disable=self.args.no_progress)
        self.log(f"measuring plain and {len(singles)} techniques alone, {self.rounds} rounds:")
        self.run_rounds([PLAIN_CANDIDATE, *singles], "alone", bar)
        if not self.complete(PLAIN_CANDIDATE, "alone"):
            bar.close()
            raise ConfigError(f"--budget-minutes {self.args.budget_minutes:g} did not cover {self.rounds} rounds "
                              f"of the plain configuration")
        for c in singles:
            if not self.complete(c, "alone"):
                self.skipped[c.techniques[0]] = "unmeasured: the time budget ran out"
        credited = [c for c in singles if self.complete(c, "alone") and self.better(c, PLAIN_CANDIDATE, "alone")]
        credited.sort(key=lambda c: -self.effect(c, PLAIN_CANDIDATE, "output_throughput", "alone").change)
        best = credited[0] if credited else PLAIN_CANDIDATE
        if len(credited) > 1:
            self.log(f"stacking onto {best.name}: {', '.join(c.name for c in credited[1:])}")
            bar.total += (len(credited) - 1) * 2 * self.rounds
        for c in credited[1:]:
            trial = best.with_(c.techniques[0])
            phase = f"stack {trial.name}"
            done = self.run_rounds([best, trial], phase, bar)
            effects = {metric: self.effect(trial, best, metric, phase) for metric in JUDGED} if done else None
            kept = done and self.better(trial, best, phase)
            self.stack.append(StackTrial(best, trial, effects, kept))
            if kept:
                best = trial
        bar.close()
        return best if self.shortfall(best) == 0 else None

    def _applies(self, t: Technique) -> bool:
        if t.name in self.skipped:
            return False
        why = not_applicable(t, self.base, self.model_path, self.concurrency)
        if why:
            self.skipped[t.name] = why
        return why is None

    @property
    def closest(self) -> Candidate:
        return min(self.measured, key=lambda c: (self.shortfall(c), -(_median(self.spread(c, "output_throughput"))
                                                                       or 0)))

    def reused(self, candidate: Candidate) -> str:
        """" (reused: measured on DATES)" where any of the candidate's figures came from the store, else ""."""
        dates = sorted({m.measured_on for m in self.measured.get(candidate, {}).values() if m.reused})
        return f" (reused: measured {', '.join(dates)} by the same code on this host)" if dates else ""


def _concurrency(num_requests: int, max_concurrency: int | None, request_rate: float) -> int | None:
    """The requests in flight once the load runs: its cap, or all of them sent at once; None
    for Poisson arrivals without a cap (the load decides, not the knob)."""
    if max_concurrency:
        return min(max_concurrency, num_requests)
    return num_requests if math.isinf(request_rate) else None


def _median(spread: Spread | None) -> float | None:
    return None if spread is None else spread.median


def cost_per_million(throughput: float | None, price_per_hour: float) -> float:
    """What a million output tokens cost at this throughput, on a machine at price_per_hour."""
    if not throughput:
        return math.inf
    return price_per_hour / (throughput * 3600) * 1e6


def _model_path(config: EngineConfig) -> str:
    from brisk.model.loader import default_model_path

    return config.model or default_model_path()


def _line(r: LoadReport) -> str:
    ttft, tpot = r.latency_ms["ttft"], r.latency_ms["tpot"]
    return (f"{r.output_throughput:.1f} output tok/s, TTFT p50/p95 {ttft.p50:.0f}/{ttft.p95:.0f} ms, "
            f"TPOT p50/p95 {tpot.p50:.1f}/{tpot.p95:.1f} ms, {r.failed} failed"
            if ttft and tpot else f"no completed request ({r.errors[:1]})")


def _reused(m: Measurement) -> str:
    return f" (reused, measured {m.measured_on})"


def _summary_line(opt: Optimizer, c: Candidate) -> str:
    """A candidate's medians (ranges) over every round it ran, for the chosen line and best.yaml."""
    def figure(metric: str, digits: int) -> str:
        spread = opt.spread(c, metric)
        return "-" if spread is None else spread.text(digits)

    rounds = len(opt.measured[c])
    return (f"{figure('output_throughput', 1)} output tok/s, TTFT p50 {figure('ttft_p50_ms', 0)} ms, TTFT p95 "
            f"{figure('ttft_p95_ms', 0)} ms, TPOT p50 {figure('tpot_p50_ms', 1)} ms (medians of {rounds} runs, "
            f"ranges in brackets), perplexity {opt.perplexity_of(c):.3f} ({opt.quality_drop(c):+.2f}%)"
            + opt.reused(c))


def write_outputs(opt: Optimizer, chosen: Candidate | None, out: Path) -> None:
    """report.md, impact.png and configs.png, and best.yaml for the chosen (or closest) configuration."""
    from brisk.bench.plots import plot_bars

    out.mkdir(parents=True, exist_ok=True)
    pick = chosen or opt.closest
    table, impact = _impact_table(opt)
    lines = [*_summary(opt, chosen, pick, out), *table, *_stack_table(opt), *_every_configuration(opt),
             "", "Prefix caching and the response cache help only as far as requests share prefixes or repeat "
                 "(--repeat-fraction); on distinct questions they cost their bookkeeping and gain little.", "",
             "![technique impact](impact.png)", "", "![configurations](configs.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    if impact:
        plot_bars(impact, str(out / "impact.png"), f"technique impact against plain (medians of paired rounds)\n"
                                                   f"{machine()}")
    plot_bars([(c.name, {"output tok/s": _median(opt.spread(c, "output_throughput")) or 0,
                         "TTFT p95 (ms)": _median(opt.spread(c, "ttft_p95_ms")) or 0,
                         "TPOT p50 (ms)": _median(opt.spread(c, "tpot_p50_ms")) or 0}) for c in opt.measured],
              str(out / "configs.png"), f"configurations measured (medians)\n{machine()}")
    write_config(pick, opt, out / "best.yaml", chosen is not None)


def _summary(opt: Optimizer, chosen: Candidate | None, pick: Candidate, out: Path) -> list[str]:
    """The report's head: how it was measured, the noise, and what was chosen."""
    a = opt.args
    arrivals = (f"Poisson arrivals at {a.request_rate:g} req/s" if not math.isinf(a.request_rate)
                else "all sent at once") + (f", at most {a.max_concurrency} in flight" if a.max_concurrency else "")
    reused = sum(m.reused for rounds in opt.measured.values() for m in rounds.values())
    total = sum(len(rounds) for rounds in opt.measured.values())
    lines = ["# brisk optimize", "", f"Command: `{shlex.join(['brisk', *sys.argv[1:]])}`", "",
             f"Machine: {machine()}", "",
             f"Model: {os.path.basename(opt.model_path)} (content SHA-256 {opt.model_digest[:12]}); brisk sources "
             f"SHA-256 {source_digest()[:12]}", "",
             f"Workload: {len(opt.requests)} {a.dataset} requests, {a.output_len} output tokens each "
             f"({'EOS ignored' if a.ignore_eos else 'EOS honoured'}), temperature {a.temperature}, "
             f"{a.repeat_fraction:.0%} of them repeating an earlier one; {arrivals}.", "",
             f"Quality: perplexity over the first {a.perplexity_tokens} tokens of {Path(a.text or DEFAULT_TEXT).name}, "
             f"against plain (float32 weights and KV cache).", "",
             f"Targets: {', '.join(map(str, opt.targets)) or 'none'}; perplexity at most +{a.max_quality_drop:g}%. "
             f"Cost: ${a.price_per_hour:g} per machine-hour.", "",
             f"Method: {opt.rounds} rounds, each running plain and every candidate once in a shuffled order. A figure "
             f"is the median of its rounds, its range in brackets. An effect is the median of the paired differences "
             f"from the reference in the same round, credited only where it exceeds both plain's own range on that "
             f"figure and {NOISE_FLOOR:g}%.", "",
             "Plain's own spread (the noise each effect must clear): " + "; ".join(
                 f"{metric} {opt.spread(PLAIN_CANDIDATE, metric, 'alone').text()} (range "
                 f"{opt.spread(PLAIN_CANDIDATE, metric, 'alone').range_percent:.1f}%, threshold "
                 f"{opt.threshold(metric):.1f}%)" for metric in JUDGED if opt.spread(PLAIN_CANDIDATE, metric, 'alone')),
             ""]
    if reused:
        dates = sorted({m.measured_on for rounds in opt.measured.values() for m in rounds.values() if m.reused})
        lines += [f"**Reused figures:** {reused} of {total} runs come from the store ({opt.store_path}), measured "
                  f"{', '.join(dates)} by the same code on the same model and host; `--fresh` measures anew.", ""]
    if opt.budget_spent:
        lines += ["**The time budget ran out** before every run was made: what was not measured in every round is "
                  "marked unmeasured below.", ""]
    if chosen is not None:
        lines.append(f"**Chosen: {chosen.name}**, the cheapest configuration measured that meets the targets "
                     f"beyond the noise: {_summary_line(opt, chosen)}; "
                     f"${cost_per_million(_median(opt.spread(chosen, 'output_throughput')), a.price_per_hour):.3f} "
                     f"per million output tokens. `best.yaml` serves it: `brisk serve --config {out / 'best.yaml'}`.")
    else:
        lines.append(f"**No configuration measured meets the targets.** The closest is {pick.name}: "
                     f"{_summary_line(opt, pick)}. `best.yaml` holds it, for reference.")
    return lines


def _impact_table(opt: Optimizer) -> tuple[list[str], list[tuple[str, dict]]]:
    """The technique-impact table's markdown (each technique alone against plain, paired by
    round), and its rows for the plot."""
    lines = ["", "## Technique impact (each alone, against plain in the same rounds)", "",
             "| technique | what | output tok/s | TTFT p50 | TTFT p95 | TPOT p50 | perplexity |",
             "|---|---|---|---|---|---|---:|"]
    impact = []
    order = [PLAIN_CANDIDATE, *(Candidate((t.name,)) for t in TECHNIQUES)]
    for candidate in order:
        if not opt.complete(candidate, "alone"):
            continue
        t = technique(candidate.techniques[0]) if candidate.techniques else None
        cells = []
        for metric in JUDGED:
            spread = opt.spread(candidate, metric, "alone")
            cell = "-" if spread is None else spread.text()
            if t is not None:
                effect = opt.effect(candidate, PLAIN_CANDIDATE, metric, "alone")
                cell += f": {effect}" if effect else ""
            cells.append(cell)
        lines.append(f"| {candidate.name}{opt.reused(candidate)} | {t.what if t else 'float32, nothing else'} | "
                     + " | ".join(cells) + f" | {opt.perplexity_of(candidate):.3f} ({opt.quality_drop(candidate):+.2f}%) |")
        if t is not None:
            impact.append((candidate.name, {f"{metric} change (%)": opt.effect(candidate, PLAIN_CANDIDATE, metric,
                                                                              "alone").change for metric in JUDGED}
                           | {"perplexity change (%)": opt.quality_drop(candidate)}))
    for name, why in opt.skipped.items():
        lines.append(f"| {name} | {technique(name).what} | not run: {why} | | | | |")
    return lines, impact


def _stack_table(opt: Optimizer) -> list[str]:
    if not opt.stack:
        return []
    lines = ["", "## Stacking (each addition against the stack without it, in rounds of their own)", "",
             "| stack tried | against | output tok/s | TTFT p50 | TTFT p95 | TPOT p50 | kept |", "|---|---|---|---|---|---|---|"]
    for s in opt.stack:
        cells = ["unmeasured: the time budget ran out"] * len(JUDGED) if s.effects is None else [
            str(s.effects[metric]) if s.effects[metric] else "-" for metric in JUDGED]
        lines.append(f"| {s.trial.name}{opt.reused(s.trial)} | {s.base.name} | " + " | ".join(cells)
                     + f" | {'yes' if s.kept else 'no'} |")
    return lines


def _every_configuration(opt: Optimizer) -> list[str]:
    lines = ["", "## Every configuration measured (medians over all its runs, ranges in brackets)", "",
             "| configuration | runs | output tok/s | TTFT p50 (ms) | TTFT p95 (ms) | TPOT p50 (ms) | $ per M tokens "
             "| perplexity change | meets targets |", "|---|---:|---|---|---|---|---:|---:|---|"]
    for c in sorted(opt.measured, key=lambda c: -(_median(opt.spread(c, "output_throughput")) or 0)):
        figures = [opt.spread(c, metric) for metric in JUDGED]
        cost = cost_per_million(_median(figures[0]), opt.args.price_per_hour)
        lines.append(f"| {c.name}{opt.reused(c)} | {len(opt.measured[c])} | "
                     + " | ".join("-" if f is None else f.text() for f in figures)
                     + f" | {cost:.3f} | {opt.quality_drop(c):+.2f}% | {'yes' if opt.shortfall(c) == 0 else 'no'} |")
    return lines


def write_config(candidate: Candidate, opt: Optimizer, path: Path, meets: bool) -> None:
    """The candidate as a `brisk serve --config` file: every engine knob that differs from the
    default, and the response cache's switch."""
    import yaml

    config, default = candidate.engine(opt.base), EngineConfig()
    values = {}
    for f in knobs(EngineConfig):
        value = getattr(config, f.name)
        if value != getattr(default, f.name):
            values[f.name] = json.loads(value.to_json()) if hasattr(value, "to_json") else value
    values["response_cache"] = candidate.response_cache
    header = [f"# brisk optimize: {candidate.name}"
              + ("" if meets else " (closest; it does NOT meet the targets)"),
              f"# measured: {_summary_line(opt, candidate)}",
              f"# targets: {', '.join(map(str, opt.targets)) or 'none'}; perplexity +{opt.args.max_quality_drop:g}% "
              f"at most", f"# {machine()}", "# serve with: brisk serve --config " + str(path)]
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(values, sort_keys=False))


def default_store() -> Path:
    """Where measurements are kept for reuse: the user's cache folder, never a report folder
    (a committed report must not feed a later run's figures)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "brisk" / "optimize" / "measurements.json"


def main(args) -> None:
    targets = [Target.parse(t) for t in args.target]
    if not args.max_quality_drop >= 0:
        raise ConfigError(f"--max-quality-drop must be >= 0 (percent), got {args.max_quality_drop}")
    if not args.budget_minutes > 0:
        raise ConfigError(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    out = Path(args.out)
    store = Path(args.store) if args.store else default_store()
    opt = Optimizer(engine_config_from_args(args), workload(args), args, targets, store, tuple(args.skip))
    print(machine())
    print(f"targets: {', '.join(map(str, targets)) or 'none'}; perplexity at most +{args.max_quality_drop:g}%; "
          f"budget {args.budget_minutes:g} min; {opt.rounds} rounds; measurements kept in {store}"
          + (" (--fresh: none reused)" if args.fresh else ""))
    chosen = opt.run()
    write_outputs(opt, chosen, out)
    if chosen is None:
        print(f"no configuration measured meets the targets; the closest is {opt.closest.name} "
              f"({out / 'report.md'})")
    else:
        print(f"chosen: {chosen.name}{opt.reused(chosen)} ({out / 'report.md'}); serve it with: "
              f"brisk serve --config {out / 'best.yaml'}")
