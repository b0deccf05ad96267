"""`brisk optimize` on a tiny model with a tiny budget, and the config file it writes, read back
by `brisk serve --config`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import httpx
import pytest

from brisk.args import read_config_file
from brisk.bench.load import Goodput, LoadReport, LoadRequest, RequestRecord
from brisk.bench.optimize import TECHNIQUES, Candidate, Optimizer, Target, write_outputs
from brisk.cli import build_parser, main
from brisk.config import ConfigError, EmbeddingConfig, EngineConfig, ResponseCacheConfig, ServerConfig
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import serve_tiny

SERVE_CONFIGS = (ServerConfig, EmbeddingConfig, ResponseCacheConfig, EngineConfig)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-optimize")), "llama")


def _optimize(folder: str, out, text, *targets: str) -> subprocess.CompletedProcess:
    kept = {"int8"}  # one technique keeps the run short: plain, int8, and plain again
    return subprocess.run(
        [sys.executable, "-m", "brisk.cli", "optimize", "--model", folder, "--dtype", "float32",
         "--max-model-len", "256", "--num-kv-blocks", "64", *(f"--target={t}" for t in targets),
         "--max-quality-drop", "100", "--budget-minutes", "5", "--skip",
         *(t.name for t in TECHNIQUES if t.name not in kept), "--dataset", "random", "--random-input-len", "16",
         "--num-prompts", "6", "--output-len", "6", "--perplexity-tokens", "120", "--perplexity-context-len", "64",
         "--text", str(text), "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=600)


def test_optimize_picks_a_configuration_meeting_the_targets_then_reuses_its_measurements(tiny_folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{3 + (i * 7) % 60}" for i in range(400)))
    out = tmp_path / "opt"
    first = _optimize(tiny_folder, out, text, "ttft_p95_ms=60000", "output_throughput=0.5")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "chosen:" in first.stdout
    report = (out / "report.md").read_text()
    assert "**Chosen:" in report and "| int8 |" in report and "Run-to-run noise: plain, measured twice" in report
    assert "not run: left out (--skip)" in report  # what was not measured is said
    assert (out / "impact.png").read_bytes()[:4] == b"\x89PNG"
    measured = json.loads((out / "measurements.json").read_text())
    names = {m["candidate"] for m in measured.values()}
    assert names == {"plain", "int8", "plain (again, #2)"}
    chosen = first.stdout.split("chosen: ", 1)[1].split(" (", 1)[0]
    assert chosen in names
    assert all(m["report"]["failed"] == 0 for m in measured.values())

    # best.yaml is a config `brisk serve` reads; it names the chosen techniques' knobs
    values = read_config_file(str(out / "best.yaml"), SERVE_CONFIGS)
    assert values["model"] == tiny_folder and values["dtype"] == "float32"
    assert values.get("quantization") == ("int8" if "int8" in chosen else None)
    assert values["enable_prefix_caching"] is False  # plain's, which the engine's default is not

    # A target nothing meets: every configuration measured before is reused, not measured again
    # (the stacking may try others, as it starts from the closest), and the report says none meets it.
    again = _optimize(tiny_folder, out, text, "ttft_p50_ms=0.001")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no configuration measured meets the targets" in again.stdout
    reused = {line.strip().split(":")[0] for line in again.stdout.splitlines() if line.endswith("(reused)")}
    assert reused >= names, again.stdout
    assert "**No configuration measured meets the targets.**" in (out / "report.md").read_text()
    assert "does NOT meet" in (out / "best.yaml").read_text()


class Scripted(Optimizer):
    """The optimizer's search and report over scripted figures instead of real servers: each
    technique multiplies plain's throughput and adds to its perplexity as SCRIPT says."""

    SCRIPT = {"int8": (1.3, 0.2), "chunk-512": (1.1, 0.0), "int4": (1.5, 5.0), "ngram": (0.9, 0.0)}

    def __init__(self, *args, seconds_per_load: float = 0.0, **kwargs):
        super().__init__(*args, log=lambda line: None, **kwargs)
        self.seconds_per_load = seconds_per_load

    def _factor(self, candidate: Candidate) -> tuple[float, float]:
        speed, drop = 1.0, 0.0
        for name in candidate.techniques:
            speed *= self.SCRIPT[name][0]
            drop += self.SCRIPT[name][1]
        return speed, drop

    def _perplexity(self, config: EngineConfig) -> float:
        techniques = tuple(t for t in ("int8", "int4") if config.quantization == t)
        return 10.0 * (1 + self._factor(Candidate(techniques))[1] / 100)

    def _load(self, candidate: Candidate) -> LoadReport:
        time.sleep(self.seconds_per_load)
        speed = self._factor(candidate)[0]
        records = [RequestRecord(sent=0.0, prompt_tokens=10, output_tokens=11, ttft=0.1, e2e=0.1 + 1.0 / speed,
                                 itls=[0.1 / speed] * 10) for _ in range(4)]
        return LoadReport.of(records, 1.0 / speed, Goodput(), label=candidate.name, base_url="scripted", model="m",
                             endpoint="chat", request_rate=math.inf, max_concurrency=None)


def _scripted(tmp_path, budget_minutes: float, seconds_per_load: float = 0.0) -> Scripted:
    args = build_parser().parse_args([
        "optimize", "--target", "tpot_p50_ms=100", "--max-quality-drop", "1", "--budget-minutes", str(budget_minutes),
        "--out", str(tmp_path), "--no-progress", "--dataset", "jsonl", "--dataset-path", "unused"])
    skip = tuple(t.name for t in TECHNIQUES if t.name not in Scripted.SCRIPT)
    return Scripted(EngineConfig(), [LoadRequest("q", 11)] * 4, args, [Target.parse("tpot_p50_ms=100")], tmp_path,
                    skip, seconds_per_load=seconds_per_load)


def test_the_search_stacks_what_helps_within_the_quality_budget(tmp_path):
    opt = _scripted(tmp_path, budget_minutes=5)
    chosen = opt.run()
    # int8 (x1.3) and 512-token steps (x1.1) stack; int4 (x1.5) costs 5% perplexity, over the 1%
    # budget; ngram slows down
    assert chosen == Candidate(("int8", "chunk-512"))
    stacked = {c for c in opt.measured if len(c.techniques) > 1}
    assert stacked == {Candidate(("int8", "chunk-512")), Candidate(("int8", "chunk-512", "ngram"))}  # ngram: dropped
    assert opt.noise == 0.0  # plain measured twice, the same figures
    write_outputs(opt, chosen, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "**Chosen: int8 + chunk-512**" in report
    assert "| int4 | int4 weights, groups of 32 |" in report and "(+5.00%) |" in report
    # alone, int4 misses the quality budget and ngram (TPOT 111 ms) the target
    assert "| int4 | 100.0 / 100.0 | 66.7 / 66.7 |" in report and "| ngram | 100.0 / 100.0 | 111.1 / 111.1 |" in report
    assert report.count("| no |") == 2
    values = read_config_file(str(tmp_path / "best.yaml"), SERVE_CONFIGS)
    assert (values["quantization"], values["max_num_batched_tokens"]) == ("int8", 512)


def test_a_spent_budget_is_reported_not_hidden(tmp_path):
    opt = _scripted(tmp_path, budget_minutes=0.3 / 60, seconds_per_load=0.2)  # room for one measurement
    assert opt.run() == Candidate(())
    assert set(opt.measured) == {Candidate(())}
    assert {name: why for name, why in opt.skipped.items() if name in Scripted.SCRIPT} == {
        name: "the time budget ran out" for name in Scripted.SCRIPT}
    write_outputs(opt, Candidate(()), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| int8 | int8 weights, float activations | not run: the time budget ran out" in report
    assert "Run-to-run noise: not measured" in report


def test_targets_and_candidates_parse_as_documented():
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
