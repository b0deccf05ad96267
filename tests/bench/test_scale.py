"""`brisk bench scale` on a small file written by the shape writer, beside fake llama.cpp programs
(tests/bench/conftest.py): each row's two sides, the same statistic on both (the median of the
runs, their range after it), the ratio, and each side against the build's measured limits. The
real section (large files, real llama.cpp) is `brisk bench scale` itself; no timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from brisk.bench.shapes import Shape, write_f16
from brisk.model.loader import default_model_path

SMALL = Shape("small", hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, rope_theta=10_000.0, tied=True)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("scale") / "small.gguf"
    write_f16(SMALL, path, default_model_path())
    return str(path)


def test_every_row_has_both_sides_the_same_statistic_and_the_limits(small_file, fake_llama_cpp):
    run = subprocess.run([sys.executable, "-m", "brisk.cli", "bench", "scale", "--models", small_file,
                          "--builds", "native", "--rows", "single", "pp512", "offline", "long", "--repeats", "2",
                          "--sequences", "3", "--long-tokens", "100", "--llama-cpp-dirs", f"native={fake_llama_cpp}"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "### small.gguf, native build" in out
    assert re.search(r"Limits measured by this build \(the higher of two measurements, before and after brisk.s "
                     r"rows\): read [\d.]+ GB/s with \d+ threads, int8 [\d.]+ GMAC/s \(", out)
    rows = {line.split(" [")[0].lstrip("| "): line.removesuffix(" |").split(" | ") for line in out.splitlines()
            if line.startswith("| ") and "row [unit] |" not in line}
    assert list(rows) == ["single stream, 128 new tokens", "prefill of a 512-token prompt",
                          "3 distinct sequences x (128 + 128), offline, all tokens", "prefill of a 100-token prompt",
                          "decode of 64 tokens at depth 100"]
    for name, cells in rows.items():
        assert cells[0].endswith("[tok/s, higher is better]")
        llama, brisk, ratio = cells[2], cells[3], cells[4]
        offline = name.startswith("3 distinct")
        # the fake llama-bench's runs: 126.8, 120.0 and 123.4 tok/s, shown as the median, then the range;
        # the fake batched bench's S: 48.0
        assert llama == ("48.0" if offline else "123.4 (120.0-126.8)"), (name, llama)
        repeated = name.startswith(("single", "prefill of a 512"))  # --repeats 2; the others run once
        assert re.fullmatch(r"[\d.]+ \([\d.]+-[\d.]+\)" if repeated else r"[\d.]+", brisk), (name, brisk)
        assert abs(float(ratio.removesuffix("x")) - float(brisk.split()[0]) / float(llama.split()[0])) < 0.01
    single, prefill = rows["single stream, 128 new tokens"], rows["prefill of a 512-token prompt"]
    assert single[1] == "llama-bench tg128" and prefill[1] == "llama-bench pp512"
    assert re.fullmatch(r"[\d.]+ GB/s = \d+%", single[5]) and re.fullmatch(r"[\d.]+ GB/s = \d+%", single[6])
    assert re.fullmatch(r"\d+ GMAC/s = \d+%", prefill[5]) and re.fullmatch(r"\d+ GMAC/s = \d+%", prefill[6])
    # the batched row's peer: llama-batched-bench on the same sequences
    batched = (fake_llama_cpp / "batched-args.json").read_text()
    assert '"-npp", "128", "-ntg", "128", "-npl", "3"' in batched


def test_an_unknown_shape_or_build_is_refused(small_file):
    for flags, message in ((["--models", "3b"], "unknown shape '3b'"),
                           (["--models", small_file, "--builds", "arm"], "unknown build 'arm'")):
        run = subprocess.run([sys.executable, "-m", "brisk.cli", "bench", "scale", *flags], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 2 and message in run.stderr, run.stderr
