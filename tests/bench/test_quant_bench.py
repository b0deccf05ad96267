"""`brisk bench quant` runs each configuration it is given and prints one row each, the first the
baseline of the ratios (a tiny model and a tiny workload: what is checked is the command, not
the numbers)."""

from __future__ import annotations

import json

import pytest

from brisk.cli import main
from tests.conftest import build_tiny_checkpoint


def test_bench_quant_prints_a_row_per_configuration(tmp_path, capsys):
    model = build_tiny_checkpoint(str(tmp_path / "llama"), "llama")
    code = main(["bench", "quant", "--model", model, "--configs", "float32", "gguf", "int8", "kv-int8",
                 "--num-prompts", "3", "--min-prompt-len", "5", "--max-prompt-len", "30", "--output-len", "4",
                 "--decode-len", "4", "--repeats", "1", "--perplexity-tokens", "0", "--no-llama-cpp"])
    assert code == 0
    out = capsys.readouterr().out
    assert "skipped ['gguf']: they run a GGUF file's own blocks" in out  # a Hugging Face folder has none
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| configuration", "| float32", "| int8", "| kv-int8"]
    assert "(1.00x)" in rows[1] and all(" – |" not in row.split(" | ")[2] for row in rows[1:])


def test_bench_quant_refuses_unknown_configurations(capsys):
    assert main(["bench", "quant", "--configs", "float32", "int3"]) == 2
    assert "unknown --configs ['int3']" in capsys.readouterr().err


def test_rows_rounding_activations_also_report_perplexity_through_the_decode_path(tmp_path, capsys):
    """w8a8 rounds activations one way in prompt-sized products and another in decode's: its row
    gives both perplexities; float32 has one."""
    model = build_tiny_checkpoint(str(tmp_path / "llama"), "llama")
    code = main(["bench", "quant", "--model", model, "--configs", "float32", "w8a8", "--num-prompts", "0",
                 "--decode-len", "4", "--repeats", "1", "--perplexity-tokens", "300", "--no-llama-cpp"])
    assert code == 0
    rows = {row.split(" | ")[0].removeprefix("| "): row.split(" | ")[-1].removesuffix(" |")
            for row in capsys.readouterr().out.splitlines() if row.startswith("| ") and "---" not in row}
    assert rows["float32"].endswith("(+0.00%)") and " / " not in rows["float32"]
    whole, decoding = rows["w8a8"].split(" / ")
    assert whole != decoding and all(part.endswith("%)") for part in (whole, decoding))


@pytest.mark.real_model
def test_the_llama_cpp_row_is_llama_bench_once_a_round(fake_llama_cpp, capsys):
    """llama.cpp's single-stream row comes from its own llama-bench (a fake here that prints
    123.4 tok/s), one repetition per round as each brisk row decodes once per round."""
    code = main(["bench", "quant", "--configs", "gguf", "--num-prompts", "0", "--decode-len", "4", "--repeats", "2",
                 "--perplexity-tokens", "0", "--llama-cpp-bin", str(fake_llama_cpp)])
    assert code == 0
    out = capsys.readouterr().out
    assert "llama.cpp: llama-bench (version: 42 (fake)" in out
    row = next(line for line in out.splitlines() if line.startswith("| llama.cpp (same GGUF)"))
    assert "| 123.4 (" in row
    bench = json.loads((fake_llama_cpp / "bench-args.json").read_text())
    assert bench[bench.index("--n-gen") + 1] == "4" and bench[bench.index("--repetitions") + 1] == "1"


@pytest.mark.real_model
def test_the_llama_cpp_offline_row_is_llama_batched_bench_on_the_same_shape(fake_llama_cpp, capsys):
    """Prompts of one length: llama-batched-bench runs as many sequences of as many prompt and
    output tokens (a fake here: 4 x (16 + 8) in 2 s), counted as the brisk rows are: output
    tokens over the whole run, 4 x 8 / 2 = 16 tok/s."""
    code = main(["bench", "quant", "--configs", "gguf", "--num-prompts", "4", "--min-prompt-len", "16",
                 "--max-prompt-len", "16", "--output-len", "8", "--decode-len", "4", "--repeats", "1",
                 "--perplexity-tokens", "0", "--llama-cpp-bin", str(fake_llama_cpp)])
    assert code == 0
    out = capsys.readouterr().out
    assert "llama-batched-bench, 4 x (16 + 8) tokens: 48.0 tok/s in all" in out
    row = next(line for line in out.splitlines() if line.startswith("| llama.cpp (same GGUF)"))
    assert row.split("|")[5].strip().startswith("16.0")
    run = json.loads((fake_llama_cpp / "batched-args.json").read_text())
    assert [run[run.index(flag) + 1] for flag in ("-npp", "-ntg", "-npl")] == ["16", "8", "4"]
