"""`brisk optimize`: measure what each technique does on this machine, and pick the cheapest
configuration that meets latency targets within a quality budget.

The plain configuration is the reference: float32 weights and KV cache, no prefix caching, no
speculative decoding, no response cache, the engine's default batch limits. Each technique
(TECHNIQUES) changes a few knobs of it. The search, within `--budget-minutes`:

1. plain, then every technique that applies here on its own: the technique-impact table (what
   it does to latency, throughput, cost and quality against plain);
2. a greedy stack: techniques in order of how much they cut the cost alone, each kept if the
   stack with it scores better (below) and stays within the quality budget.

Each configuration is a real `brisk serve` loaded with the same workload (brisk/bench/load.py);
its quality is the perplexity of the weight and KV formats it runs, over the first tokens of
Pride and Prejudice, compared with plain's (techniques that leave the logits as they are, such
as prefix caching or speculative decoding verified against the model, share plain's figure).
A configuration meets the targets when every `--target` holds and its perplexity rises by at
most `--max-quality-drop` percent. Among those the cheapest wins: the lowest cost per million
output tokens at `--price-per-hour`, which is the highest throughput. When none meets them, the
report says so and names the one that came closest.

Measurements are kept in OUT/measurements.json, keyed by the configuration, the workload, the
model file and the machine, and reused by a later run with the same keys: a second run with a
larger budget goes on where the first stopped.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.load import THROUGHPUTS, LoadReport, LoadRequest, latency_figure
from brisk.bench.serve import load_settings, measure, workload
from brisk.bench.perplexity import DEFAULT_TEXT, perplexity
from brisk.config import ConfigError, EngineConfig, ServerConfig, knobs
from brisk.kernels import cpu as cpu_kernels

# The plain configuration's values of every knob a technique touches.
PLAIN = {"dtype": "float32", "quantization": None, "int8_activations": False, "kv_cache_dtype": "auto",
         "enable_prefix_caching": False, "speculative_config": None}
# The knobs that change the logits, and so the perplexity.
QUALITY_KNOBS = ("dtype", "quantization", "quantization_group_size", "int8_activations", "kv_cache_dtype")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


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


def not_applicable(t: Technique, base: EngineConfig, model_path: str) -> str | None:
    """Why technique t cannot run here, or None."""
    if t.name == "bf16" and base.torch_device.type == "cpu" and not cpu_kernels.native_bf16():
        return "this CPU has no native bf16 (emulated bf16 matmuls are several times slower than fp32)"
    if t.name == "gguf" and not model_path.endswith(".gguf"):
        return "the model is not a GGUF file"
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

    def excess(self, report: LoadReport) -> float:
        """How far the run misses the target, relative to it (0 when met; inf without a figure)."""
        value = report.metric(self.metric)
        if value is None:
            return math.inf
        missed = value - self.value if self.upper_bound else self.value - value
        return max(0.0, missed) / self.value

    def __str__(self) -> str:
        return f"{self.metric} {'<=' if self.upper_bound else '>='} {self.value:g}"


@dataclass(frozen=True)
class Candidate:
    techniques: tuple[str, ...]  # in the order applied; () is plain
    repeat: int = 0  # > 0: the same configuration measured again, for the run-to-run noise

    @property
    def name(self) -> str:
        return (" + ".join(self.techniques) or "plain") + (f" (again, #{self.repeat + 1})" if self.repeat else "")

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


@dataclass
class Measurement:
    candidate: str
    report: LoadReport
    perplexity: float
    seconds: float  # what measuring it cost
    reused: bool = False

    def to_json(self) -> dict:
        return {"candidate": self.candidate, "report": self.report.to_json(), "perplexity": self.perplexity,
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict) -> "Measurement":
        return cls(data["candidate"], LoadReport.from_json(data["report"]), data["perplexity"], data["seconds"],
                   reused=True)


class Optimizer:
    def __init__(self, base: EngineConfig, requests: list[LoadRequest], args, targets: list[Target],
                 out: Path, skip: tuple[str, ...] = (), log=print):
        self.base, self.requests, self.args, self.targets, self.out, self.log = base, requests, args, targets, out, log
        self.settings = load_settings(args, args.request_rate)
        self.model_path = _model_path(base)
        self.store_path = out / "measurements.json"
        self.stored: dict[str, dict] = json.loads(self.store_path.read_text()) if self.store_path.exists() else {}
        self.measured: dict[Candidate, Measurement] = {}
        self.perplexities: dict[str, float] = {}
        self.skipped: dict[str, str] = {technique(name).name: "left out (--skip)" for name in skip}
        self.started = time.monotonic()
        self.budget = args.budget_minutes * 60

    # --- keys, so that measurements carry over between runs
    def _key(self, candidate: Candidate) -> str:
        config = candidate.engine(self.base)
        workload = {k: getattr(self.args, k) for k in ("dataset", "dataset_path", "num_prompts", "output_len",
                                                       "ignore_eos", "random_input_len", "random_range_ratio",
                                                       "repeat_fraction",
                                                       "temperature", "max_concurrency", "request_rate",
                                                       "workload_seed", "warmup", "goodput", "text",
                                                       "perplexity_tokens", "perplexity_context_len")}
        identity = {"engine": config_flags(config), "response_cache": candidate.response_cache,
                    "repeat": candidate.repeat,
                    "workload": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in workload.items()},
                    "model": [self.model_path, os.path.getsize(self.model_path)], "machine": machine()}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def _save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.store_path.write_text(json.dumps(self.stored, indent=1))

    # --- measuring
    def measure(self, candidate: Candidate) -> Measurement | None:
        """The candidate's figures, measured now or reused; None when the budget cannot cover it."""
        if candidate in self.measured:
            return self.measured[candidate]
        key = self._key(candidate)
        if key in self.stored:
            m = Measurement.from_json(self.stored[key])
        else:
            if not self._affordable():
                return None
            start = time.monotonic()
            quality = self._perplexity(candidate.engine(self.base))
            report = self._load(candidate)
            m = Measurement(candidate.name, report, quality, time.monotonic() - start)
            self.stored[key] = m.to_json()
            self._save()
        self.measured[candidate] = m
        self.log(f"  {candidate.name}: {_line(m, self.plain)}" + (" (reused)" if m.reused else ""))
        return m

    def _affordable(self) -> bool:
        """Whether one more measurement fits the budget, by the mean of those made so far."""
        spent = time.monotonic() - self.started
        fresh = [m.seconds for m in self.measured.values() if not m.reused]
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

    # --- judging
    @property
    def plain(self) -> Measurement | None:
        return self.measured.get(Candidate(()))

    def quality_drop(self, m: Measurement) -> float:
        """Perplexity increase over plain, in percent."""
        return (m.perplexity / self.plain.perplexity - 1) * 100

    def shortfall(self, m: Measurement) -> float:
        """0 when m meets every target and the quality budget; else how far it misses (relative)."""
        latency = sum(t.excess(m.report) for t in self.targets)
        quality = max(0.0, self.quality_drop(m) - self.args.max_quality_drop) / 100
        return latency + quality + (math.inf if m.report.failed else 0.0)

    def score(self, m: Measurement) -> tuple[float, float]:
        """Smaller is better: first how far from meeting the targets, then the cost."""
        return self.shortfall(m), cost_per_million(m.report, self.args.price_per_hour)

    # --- the search
    def run(self) -> Candidate | None:
        candidates = [Candidate(())] + [Candidate((t.name,)) for t in TECHNIQUES if self._applies(t)]
        bar = tqdm(total=len(candidates) * 2, desc="optimize", unit="config", disable=self.args.no_progress)
        self.log(f"measuring plain and {len(candidates) - 1} techniques on their own:")
        for i, candidate in enumerate(candidates):
            if self.measure(candidate) is None:
                self.log("  the time budget is spent")
                for left in candidates[max(i, 1):]:  # candidates[0] is plain
                    self.skipped[left.techniques[0]] = "the time budget ran out"
                break
            bar.update()
        if self.plain is None:
            bar.close()
            raise ConfigError(f"--budget-minutes {self.args.budget_minutes:g} did not cover the plain configuration")
        single = sorted((c for c in candidates[1:] if c in self.measured),
                        key=lambda c: cost_per_million(self.measured[c].report, self.args.price_per_hour))
        best = min(self.measured, key=lambda c: self.score(self.measured[c]))  # plain or one technique
        self.log(f"stacking techniques greedily from {best.name}:")
        for c in single:
            name = c.techniques[0]
            if name in best.techniques or self.quality_drop(self.measured[c]) > self.args.max_quality_drop:
                bar.update()
                continue
            trial = best.with_(name)
            m = self.measure(trial)
            bar.update()
            if m is None:
                self.log("  the time budget is spent")
                break
            if self.score(m) < self.score(self.measured[best]):
                best = trial
        if self.measure(Candidate((), repeat=1)) is not None:  # the noise floor the differences stand on
            self.log(f"  plain measured twice: output throughput differs by {self.noise:.1f}%")
        bar.close()
        return best if self.shortfall(self.measured[best]) == 0 else None

    @property
    def noise(self) -> float | None:
        """How much plain's two runs differ in output throughput, in percent (None: measured once)."""
        again = self.measured.get(Candidate((), repeat=1))
        if again is None or self.plain is None:
            return None
        a, b = self.plain.report.output_throughput, again.report.output_throughput
        return abs(a - b) / min(a, b) * 100

    def _applies(self, t: Technique) -> bool:
        if t.name in self.skipped:
            return False
        why = not_applicable(t, self.base, self.model_path)
        if why:
            self.skipped[t.name] = why
        return why is None

    @property
    def closest(self) -> Candidate:
        return min((c for c in self.measured if not c.repeat), key=lambda c: self.score(self.measured[c]))


def cost_per_million(report: LoadReport, price_per_hour: float) -> float:
    """What a million output tokens cost at this throughput, on a machine at price_per_hour."""
    if report.output_throughput <= 0:
        return math.inf
    return price_per_hour / (report.output_throughput * 3600) * 1e6


def _model_path(config: EngineConfig) -> str:
    from brisk.model.loader import default_model_path

    return config.model or default_model_path()


def _line(m: Measurement, plain: Measurement | None) -> str:
    r = m.report
    ttft, tpot = r.latency_ms["ttft"], r.latency_ms["tpot"]
    quality = f", perplexity {m.perplexity:.3f}" + (
        f" ({(m.perplexity / plain.perplexity - 1) * 100:+.2f}%)" if plain else "")
    return (f"{r.output_throughput:.1f} output tok/s, TTFT p50/p95 {ttft.p50:.0f}/{ttft.p95:.0f} ms, "
            f"TPOT p50/p95 {tpot.p50:.1f}/{tpot.p95:.1f} ms{quality}, {r.failed} failed"
            if ttft and tpot else f"no completed request ({r.errors[:1]})")


@dataclass(frozen=True)
class Figures:
    """A measurement as the report shows it."""

    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    throughput: float  # output tokens/s
    cost: float  # $ per million output tokens
    quality_drop: float  # perplexity increase over plain, %

    @classmethod
    def of(cls, m: Measurement, opt: Optimizer) -> "Figures":
        r = m.report
        return cls(r.metric("ttft_p50_ms"), r.metric("ttft_p95_ms"), r.metric("tpot_p50_ms"), r.metric("tpot_p95_ms"),
                   r.output_throughput, cost_per_million(r, opt.args.price_per_hour), opt.quality_drop(m))


def write_outputs(opt: Optimizer, chosen: Candidate | None, out: Path) -> None:
    """report.md, impact.png and configs.png, and best.yaml for the chosen (or closest) configuration."""
    from brisk.bench.plots import plot_bars

    out.mkdir(parents=True, exist_ok=True)
    figures = {c: Figures.of(m, opt) for c, m in opt.measured.items()}
    pick = chosen or opt.closest
    lines = _summary(opt, chosen, pick, out)
    table, impact = _impact_table(opt, figures)
    lines += table
    lines += ["", "## Every configuration measured", "",
              "| configuration | TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) | output tok/s | $ per M tokens "
              "| perplexity change | meets targets |", "|---|---:|---:|---:|---:|---:|---|"]
    for candidate, f in sorted(figures.items(), key=lambda item: item[1].cost):
        m = opt.measured[candidate]
        lines.append(f"| {candidate.name}{' (reused)' if m.reused else ''} | {_ms(f.ttft_p50)} / {_ms(f.ttft_p95)} "
                     f"| {_ms(f.tpot_p50)} / {_ms(f.tpot_p95)} | {f.throughput:.1f} | {f.cost:.3f} "
                     f"| {f.quality_drop:+.2f}% | {'yes' if opt.shortfall(m) == 0 else 'no'} |")
    lines += ["", "Percent changes are against plain; for latency, negative is faster. Prefix caching and the "
                  "response cache help only as far as requests share prefixes or repeat (--repeat-fraction); on "
                  "distinct questions they cost their bookkeeping and gain little.", "",
              "![technique impact](impact.png)", "", "![configurations](configs.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    if impact:
        plot_bars(impact, str(out / "impact.png"), f"technique impact against plain\n{machine()}")
    plot_bars([(c.name, {"output tok/s": f.throughput, "TTFT p95 (ms)": f.ttft_p95 or 0,
                         "TPOT p95 (ms)": f.tpot_p95 or 0}) for c, f in figures.items()],
              str(out / "configs.png"), f"configurations measured\n{machine()}")
    write_config(pick, opt, out / "best.yaml", chosen is not None)


def _summary(opt: Optimizer, chosen: Candidate | None, pick: Candidate, out: Path) -> list[str]:
    """The report's head: how it was measured, and what was chosen."""
    a = opt.args
    arrivals = (f"Poisson arrivals at {a.request_rate:g} req/s" if not math.isinf(a.request_rate)
                else "all sent at once") + (f", at most {a.max_concurrency} in flight" if a.max_concurrency else "")
    noise = (f"plain, measured twice, differed by {opt.noise:.1f}% in output throughput; differences smaller than "
             f"that are not told apart." if opt.noise is not None
             else "not measured (the budget ran out before plain's second run).")
    lines = ["# brisk optimize", "", f"Command: `{shlex.join(['brisk', *sys.argv[1:]])}`", "",
             f"Machine: {machine()}", "", f"Model: {os.path.basename(opt.model_path)}", "",
             f"Workload: {len(opt.requests)} {a.dataset} requests, {a.output_len} output tokens each "
             f"({'EOS ignored' if a.ignore_eos else 'EOS honoured'}), temperature {a.temperature}, "
             f"{a.repeat_fraction:.0%} of them repeating an earlier one; {arrivals}.", "",
             f"Quality: perplexity over the first {a.perplexity_tokens} tokens of {Path(a.text or DEFAULT_TEXT).name}, "
             f"against plain (float32 weights and KV cache).", "",
             f"Targets: {', '.join(map(str, opt.targets)) or 'none'}; perplexity at most +{a.max_quality_drop:g}%. "
             f"Cost: ${a.price_per_hour:g} per machine-hour.", "", f"Run-to-run noise: {noise}", ""]
    m = opt.measured[pick]
    if chosen is not None:
        lines.append(f"**Chosen: {chosen.name}**, the cheapest configuration measured that meets the targets: "
                     f"{_line(m, opt.plain)}; ${cost_per_million(m.report, a.price_per_hour):.3f} per million output "
                     f"tokens. `best.yaml` serves it: `brisk serve --config {out / 'best.yaml'}`.")
    else:
        lines.append(f"**No configuration measured meets the targets.** The closest is {pick.name}: "
                     f"{_line(m, opt.plain)}. `best.yaml` holds it, for reference.")
    return lines


def _impact_table(opt: Optimizer, figures: dict[Candidate, Figures]) -> tuple[list[str], list[tuple[str, dict]]]:
    """The technique-impact table's markdown, and its rows for the plot."""
    lines = ["", "## Technique impact (each alone, against plain)", "",
              "| technique | what | TTFT p50 | TPOT p50 | output tok/s | $ per M tokens | perplexity |",
              "|---|---|---:|---:|---:|---:|---:|"]
    base = figures[Candidate(())]
    impact = []
    for candidate, f in figures.items():
        if len(candidate.techniques) > 1 or candidate.repeat:
            continue
        t = technique(candidate.techniques[0]) if candidate.techniques else None
        lines.append(f"| {candidate.name} | {t.what if t else 'float32, nothing else'} "
                     f"| {_rel(f.ttft_p50, base.ttft_p50)} | {_rel(f.tpot_p50, base.tpot_p50)} "
                     f"| {f.throughput:.1f} ({_pct(f.throughput, base.throughput)}) | {f.cost:.3f} "
                     f"| {opt.measured[candidate].perplexity:.3f} ({f.quality_drop:+.2f}%) |")
        if t is not None:
            impact.append((candidate.name, {
                "TTFT p50 change (%)": _change(f.ttft_p50, base.ttft_p50),
                "TPOT p50 change (%)": _change(f.tpot_p50, base.tpot_p50),
                "throughput change (%)": _change(f.throughput, base.throughput),
                "perplexity change (%)": f.quality_drop}))
    for name, why in opt.skipped.items():
        lines.append(f"| {name} | {technique(name).what} | not run: {why} | | | | |")
    return lines, impact


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
    m = opt.measured[candidate]
    header = [f"# brisk optimize: {candidate.name}"
              + ("" if meets else " (closest; it does NOT meet the targets)"),
              f"# measured: {_line(m, opt.plain)}",
              f"# targets: {', '.join(map(str, opt.targets)) or 'none'}; perplexity +{opt.args.max_quality_drop:g}% "
              f"at most", f"# {machine()}", "# serve with: brisk serve --config " + str(path)]
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(values, sort_keys=False))


def _change(value: float | None, base: float | None) -> float:
    return 0.0 if value is None or not base else (value / base - 1) * 100


def _rel(value: float | None, base: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms ({_pct(value, base)})"


def _pct(value: float, base: float | None) -> str:
    return f"{_change(value, base):+.0f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(args) -> None:
    targets = [Target.parse(t) for t in args.target]
    if not args.max_quality_drop >= 0:
        raise ConfigError(f"--max-quality-drop must be >= 0 (percent), got {args.max_quality_drop}")
    if not args.budget_minutes > 0:
        raise ConfigError(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    out = Path(args.out)
    opt = Optimizer(engine_config_from_args(args), workload(args), args, targets, out, tuple(args.skip))
    print(machine())
    print(f"targets: {', '.join(map(str, targets)) or 'none'}; perplexity at most +{args.max_quality_drop:g}%; "
          f"budget {args.budget_minutes:g} min")
    chosen = opt.run()
    write_outputs(opt, chosen, out)
    if chosen is None:
        print(f"no configuration measured meets the targets; the closest is {opt.closest.name} "
              f"({out / 'report.md'})")
    else:
        print(f"chosen: {chosen.name} ({out / 'report.md'}); serve it with: brisk serve --config {out / 'best.yaml'}")

