"""`brisk optimize` on a tiny model with a tiny budget, and the config file it writes, read back
by `brisk serve --config`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest

from brisk.args import read_config_file
from brisk.bench.load import Goodput, LoadReport, LoadRequest, RequestRecord
from brisk.bench.optimize import (NGRAM, NOISE_FLOOR, TECHNIQUES, Candidate, Optimizer, Target, not_applicable,
                                  technique, write_outputs)
from brisk.cli import build_parser, main
from brisk.config import (ConfigError, EmbeddingConfig, EngineConfig, ResponseCacheConfig, ServerConfig,
                          SpeculativeConfig)
from brisk.spec.speculator import drafting_limit
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import serve_tiny

SERVE_CONFIGS = (ServerConfig, EmbeddingConfig, ResponseCacheConfig, EngineConfig)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-optimize")), "llama")


def _optimize(folder: str, out, text, store, *targets: str) -> subprocess.CompletedProcess:
    kept = {"int8"}  # one technique keeps the run short: plain and int8, three rounds each
    return subprocess.run(
        [sys.executable, "-m", "brisk.cli", "optimize", "--model", folder, "--dtype", "float32",
         "--max-model-len", "256", "--num-kv-blocks", "64", *(f"--target={t}" for t in targets),
         "--max-quality-drop", "100", "--budget-minutes", "10", "--skip",
         *(t.name for t in TECHNIQUES if t.name not in kept), "--dataset", "random", "--random-input-len", "16",
         "--num-prompts", "6", "--output-len", "6", "--perplexity-tokens", "120", "--perplexity-context-len", "64",
         "--text", str(text), "--out", str(out), "--store", str(store), "--no-progress"],
        capture_output=True, text=True, timeout=900)


def test_optimize_picks_a_configuration_meeting_the_targets_then_reuses_its_measurements(tiny_folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{3 + (i * 7) % 60}" for i in range(400)))
    out, store = tmp_path / "opt", tmp_path / "store" / "measurements.json"
    first = _optimize(tiny_folder, out, text, store, "ttft_p95_ms=60000", "output_throughput=0.5")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "chosen:" in first.stdout
    report = (out / "report.md").read_text()
    assert "**Chosen:" in report and "| int8 |" in report and "Plain's own spread" in report
    assert "not run: left out (--skip)" in report  # what was not measured is said
    assert "Reused figures" not in report
    assert (out / "impact.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "measurements.json").exists()  # the store is kept apart from the report
    measured = json.loads(store.read_text())
    runs = sorted((m["candidate"], m["round"]) for m in measured.values())
    assert runs == [(c, f"alone {r}/3") for c in ("int8", "plain") for r in (1, 2, 3)]
    chosen = first.stdout.split("chosen: ", 1)[1].split(" (", 1)[0]
    assert chosen in {"plain", "int8"}
    assert all(m["report"]["failed"] == 0 for m in measured.values())

    # best.yaml is a config `brisk serve` reads; it names the chosen techniques' knobs
    values = read_config_file(str(out / "best.yaml"), SERVE_CONFIGS)
    assert values["model"] == tiny_folder and values["dtype"] == "float32"
    assert values["quantization"] == ("int8" if "int8" in chosen else "none")  # plain's float32, not auto
    assert values["enable_prefix_caching"] is False  # plain's, which the engine's default is not

    # A target nothing meets: every run is reused, none measured again, and every output says so
    again = _optimize(tiny_folder, out, text, store, "ttft_p50_ms=0.001")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no configuration measured meets the targets" in again.stdout
    reused = [line for line in again.stdout.splitlines() if line.startswith("  [alone")]
    assert len(reused) == 6 and all("(reused, measured " in line for line in reused), again.stdout
    report = (out / "report.md").read_text()
    assert "**No configuration measured meets the targets.**" in report and "6 of 6 runs come from the store" in report
    best = (out / "best.yaml").read_text()
    assert "does NOT meet" in best and "(reused: measured " in best


class Scripted(Optimizer):
    """The optimizer's search and report over scripted figures instead of real servers: each
    technique multiplies plain's speed and adds to its perplexity as SCRIPT says, and every
    run of round r is slowed or sped by NOISE[r] alike (a busy or quiet spell of the host)."""

    SCRIPT = {"int8": (1.3, 0.2), "chunk-512": (1.1, 0.0), "int4": (1.5, 5.0), "kv-int8": (1.04, 0.0)}

    def __init__(self, *args, noise=(1.0, 1.0, 1.0), max_loads: int = 10_000, **kwargs):
        super().__init__(*args, log=lambda line: None, **kwargs)
        self.noise, self.max_loads, self.loads = noise, max_loads, 0

    def _factor(self, candidate: Candidate) -> tuple[float, float]:
        speed, drop = 1.0, 0.0
        for name in candidate.techniques:
            speed *= self.SCRIPT[name][0]
            drop += self.SCRIPT[name][1]
        return speed, drop

    def measure(self, candidate: Candidate, round_label: str):
        self.round = int(round_label.rsplit(" ", 1)[1].split("/")[0])
        return super().measure(candidate, round_label)

    def _affordable(self) -> bool:  # the budget counted in runs, not seconds: no race with a loaded host
        return self.loads < self.max_loads

    def _perplexity(self, config: EngineConfig) -> float:
        techniques = tuple(t for t in ("int8", "int4") if config.quantization == t)
        return 10.0 * (1 + self._factor(Candidate(techniques))[1] / 100)

    def _load(self, candidate: Candidate) -> LoadReport:
        self.loads += 1
        speed = self._factor(candidate)[0] * self.noise[self.round - 1]
        records = [RequestRecord(sent=0.0, prompt_tokens=10, output_tokens=11, ttft=0.1 / speed,
                                 e2e=(0.1 + 1.0) / speed, itls=[0.1 / speed] * 10) for _ in range(4)]
        return LoadReport.of(records, 1.0 / speed, Goodput(), label=candidate.name, base_url="scripted", model="m",
                             endpoint="chat", request_rate=math.inf, max_concurrency=None)


def _scripted(tmp_path, *extra: str, model: str | None = None, **kwargs) -> Scripted:
    args = build_parser().parse_args([
        "optimize", "--target", "tpot_p50_ms=150", "--max-quality-drop", "1", "--out", str(tmp_path),
        "--no-progress", "--dataset", "jsonl", "--dataset-path", "unused", *extra])
    skip = tuple(t.name for t in TECHNIQUES if t.name not in Scripted.SCRIPT)
    return Scripted(EngineConfig(model=model), [LoadRequest("q", 11)] * 4, args, [Target.parse("tpot_p50_ms=150")],
                    tmp_path / "store.json", skip, **kwargs)


@pytest.fixture
def weights(tmp_path) -> str:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    return str(path)


def test_on_a_steady_host_the_search_stacks_what_helps_within_the_quality_budget(tmp_path, weights):
    opt = _scripted(tmp_path, model=weights)
    chosen = opt.run()
    # int8 (+30%), 512-token steps (+10%) and the int8 KV cache (+4%, over the 3% floor) stack;
    # int4 (+50%) costs 5% perplexity, over the 1% budget
    assert chosen == Candidate(("int8", "chunk-512", "kv-int8"))
    assert [(s.trial.name, s.kept) for s in opt.stack] == [("int8 + chunk-512", True),
                                                           ("int8 + chunk-512 + kv-int8", True)]
    assert opt.loads == 5 * 3 + 2 * 2 * 3  # five configurations alone, then two pairs, three rounds each
    assert opt.threshold("output_throughput") == NOISE_FLOOR  # plain ran alike in every round
    write_outputs(opt, chosen, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "**Chosen: int8 + chunk-512 + kv-int8**" in report
    assert "| int8 | int8 weights, float activations | 57.2 (57.2-57.2): **+30%** (better) |" in report
    assert "| int4 | int4 weights, groups of 32 |" in report and "(+5.00%) |" in report
    values = read_config_file(str(tmp_path / "best.yaml"), SERVE_CONFIGS)
    assert (values["quantization"], values["max_num_batched_tokens"], values["kv_cache_dtype"]) == ("int8", 512,
                                                                                                   "int8")


def test_a_gain_inside_plain_s_own_range_is_not_credited(tmp_path, weights):
    # plain's throughput spans 0.95-1.10 of its median over the rounds: a 15.8% range
    opt = _scripted(tmp_path, model=weights, noise=(1.0, 1.10, 0.95))
    chosen = opt.run()
    assert opt.threshold("output_throughput") == pytest.approx(15.0 / 0.95 * 0.95 / 1.0 * 1.0, rel=0.01)
    effects = {c.name: opt.effect(c, Candidate(()), "output_throughput", "alone") for c in opt.measured if c.techniques}
    assert effects["chunk-512"].change == pytest.approx(10.0) and effects["chunk-512"].verdict == "none"
    assert effects["kv-int8"].verdict == "none" and effects["int8"].verdict == "better"
    assert chosen == Candidate(("int8",)) and opt.stack == []  # nothing else credited: nothing to stack
    write_outputs(opt, chosen, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| chunk-512 | 512-token steps (longer prefill chunks) |" in report
    assert "+10%, no measurable effect (noise 15%)" in report


def test_knobs_that_cannot_act_on_the_workload_are_reported_not_tried(tmp_path, weights):
    base, seqs, ngram = EngineConfig(), technique("seqs-16"), technique("ngram")
    assert "at most 8 requests in flight, within the limit of 16" in not_applicable(seqs, base, weights, 8)
    assert not_applicable(seqs, base, weights, 32) is None
    assert not_applicable(seqs, base, weights, None) is None  # open Poisson arrivals: the load decides
    # the drafter's own rule, read from it: prompt lookup drafts at any load (its drafts' acceptance
    # decides per sequence), unless its config caps the running sequences
    assert drafting_limit(SpeculativeConfig.parse(NGRAM)) is None and not_applicable(ngram, base, weights, 64) is None
    capped = replace(ngram, engine={"speculative_config": {**NGRAM, "disable_by_batch_size": 2}})
    assert "drafts only while at most 2 sequences run" in not_applicable(capped, base, weights, 3)
    assert not_applicable(capped, base, weights, 2) is None
    for blocks in ("gguf", "gguf-a8"):  # a GGUF file's own blocks: a folder of weights has none
        assert not_applicable(technique(blocks), base, "/models/m/", None) == "the model is not a GGUF file"
        assert not_applicable(technique(blocks), base, "/models/m.Q4_1.gguf", None) is None
    opt = _scripted(tmp_path, "--max-concurrency", "8", "--skip", "int4", model=weights)
    opt.skipped.pop("seqs-16")  # offered, so the rule and not --skip leaves it out
    opt.run()
    assert {c.name for c in opt.measured} >= {"plain", "int8"} and "seqs-16" not in {c.name for c in opt.measured}
    write_outputs(opt, None, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| seqs-16 | at most 16 sequences per batch | not run: no effect possible: this workload has at most 4" \
           in report  # four requests, at most 8 in flight


def test_reused_figures_are_labelled_in_every_output_and_fresh_reuses_none(tmp_path, weights):
    first = _scripted(tmp_path, model=weights)
    first.run()
    again = _scripted(tmp_path, model=weights)
    chosen = again.run()
    assert again.loads == 0 and chosen == Candidate(("int8", "chunk-512", "kv-int8"))
    write_outputs(again, chosen, tmp_path)
    today = first.measured[Candidate(())]["alone 1/3"].measured_on
    label = f"(reused: measured {today} by the same code on this host)"
    report = (tmp_path / "report.md").read_text()
    chosen_line = next(line for line in report.splitlines() if line.startswith("**Chosen:"))
    assert label in chosen_line
    assert f"| int8 {label} | int8 weights" in report  # the impact table
    assert f"| int8 + chunk-512 + kv-int8 {label} | int8 + chunk-512 |" in report  # the stacking table
    assert "27 of 27 runs come from the store" in report
    assert label in (tmp_path / "best.yaml").read_text().splitlines()[1]  # the '# measured:' comment
    fresh = _scripted(tmp_path, "--fresh", model=weights)
    fresh.run()
    assert fresh.loads == 27 and not any(m.reused for r in fresh.measured.values() for m in r.values())


def test_a_changed_weight_file_of_the_same_size_and_mtime_is_not_reused(tmp_path, weights):
    _scripted(tmp_path, model=weights).run()
    stat = os.stat(weights)
    with open(weights, "r+b") as f:  # one byte changed: same size
        f.seek(100)
        f.write(b"\xff")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old modification time
    changed = _scripted(tmp_path, model=weights)
    changed.run()
    assert changed.loads == 27


def test_a_spent_budget_is_reported_not_hidden(tmp_path, weights):
    # room for the five configurations alone in three rounds, and one run of the stacking
    opt = _scripted(tmp_path, model=weights, max_loads=16)
    chosen = opt.run()
    assert chosen == Candidate(("int8",)) and opt.budget_spent
    assert [(s.trial.name, s.effects, s.kept) for s in opt.stack] == [("int8 + chunk-512", None, False),
                                                                      ("int8 + kv-int8", None, False)]
    write_outputs(opt, chosen, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "**The time budget ran out**" in report
    assert "| int8 + chunk-512 | int8 | unmeasured: the time budget ran out |" in report
    # too little for plain's three rounds: a clear error, not a choice made on one run
    with pytest.raises(ConfigError, match="did not cover 3 rounds of the plain configuration"):
        _scripted(tmp_path / "short", "--fresh", model=weights, max_loads=4).run()


def test_targets_candidates_and_rounds_parse_as_documented(tmp_path, weights):
    assert Target.parse("ttft_p95_ms=800").upper_bound and not Target.parse("output_throughput=90").upper_bound
    for bad in ("ttft=800", "ttft_p95_ms", "latency_p50_ms=3", "ttft_p95_ms=-1", "tpot_p42_ms=5"):
        with pytest.raises(ConfigError):
            Target.parse(bad)
    stacked = Candidate(("int8",)).with_("int4").with_("kv-int8")
    assert stacked.techniques == ("int4", "kv-int8")  # one weight format at a time
    config = stacked.engine(EngineConfig(max_num_seqs=7))
    assert (config.quantization, config.kv_cache_dtype, config.dtype, config.max_num_seqs) == ("int4", "int8",
                                                                                               "float32", 7)
    assert not config.enable_prefix_caching  # plain's, which no technique here turned on
    with pytest.raises(ConfigError, match="--rounds must be >= 3"):
        _scripted(tmp_path, "--rounds", "2", model=weights)


def test_serve_reads_a_config_file_and_the_command_line_overrides_it(tiny_folder, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("# a hand-written config\nquantization: int8\nkv-cache-dtype: int8\nmax_num_seqs: 3\n"
                    "served_model_name: [tiny-config, alias]\nresponse_cache: false\nembedding_model: none\n")
    process, url = serve_tiny(tiny_folder, "--config", str(path), "--max-num-seqs", "2",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        info = httpx.get(f"{url}/v1/model/info").json()
        assert (info["runtime_quantization"], info["kv_cache_dtype"], info["max_num_seqs"]) == ("int8", "int8", 2)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny-config", "alias"]
        assert httpx.get(f"{url}/v1/cache/stats").json()["response_cache"] == {"enabled": False}
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize("text, message", [
    ("max_num_seqs: lots\n", "max_num_seqs must be int, got 'lots'"),
    ("max_num_sequences: 3\n", "unknown option 'max_num_sequences'"),
    ("- dtype\n", "expected a mapping"),
    ("dtype: [float32\n", "not valid YAML"),
    ("enable_prefix_caching: maybe\n", "enable_prefix_caching must be bool"),
    ("kv_cache_memory_gib: -1\n", "kv_cache_memory_gib must be > 0"),
])
def test_a_bad_config_file_is_a_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no config file at" in capsys.readouterr().err
