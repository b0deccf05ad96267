"""`brisk bench vocab` measures every setting on every model it is given, in columns side by side
(two tiny models of different vocabularies: what is checked is the command, not the numbers)."""

from __future__ import annotations

from brisk.cli import main
from tests.conftest import build_tiny_checkpoint


def test_bench_vocab_prints_every_setting_for_every_model(tmp_path, capsys):
    first = build_tiny_checkpoint(str(tmp_path / "llama"), "llama")
    second = build_tiny_checkpoint(str(tmp_path / "gemma3"), "gemma3")
    code = main(["bench", "vocab", "--model", first, "--beside", second, "--batch-sizes", "1", "3", "--rounds", "1",
                 "--steps", "2", "--prompt-len", "8", "--prompt-logprobs-len", "16"])
    assert code == 0
    out = capsys.readouterr().out
    tables = [[line.split(" | ") for line in block.splitlines() if line.startswith("| ") and "---" not in line]
              for block in out.split("\n### ")[1:]]
    assert len(tables) == 3  # batch 1, batch 3, per request
    for table in tables:
        assert [len(row) for row in table] == [3] * len(table)  # the part, then a column per model
        assert "llama" in table[0][1] and "gemma3" in table[0][2]
    parts = [row[0].removeprefix("| ") for row in tables[0][1:]]
    assert parts[:4] == ["decode step, greedy", "LM head (alone)", "JSON-schema masks: fill (alone)",
                         "JSON-schema masks: apply (alone)"]
    assert {"temperature 0.7, top-p 0.95", "penalties (repetition 1.1, frequency 0.5, presence 0.5)",
            "logprobs (top 5)"} <= set(parts)
    # the tiny models' WordPiece tokenizers take no grammar: their mask rows say so
    assert "JSON-schema masks: structured outputs are not available" in out
    assert all(cell.removesuffix(" |") == "–" for row in tables[0][3:5] for cell in row[1:])
    assert all(cell.removesuffix(" |").endswith("%)") for row in tables[0][5:] for cell in row[1:])
    assert "logit_bias (16 tokens)" in parts
    assert [row[0].removeprefix("| ") for row in tables[2][1:]][:2] == [
        "a prompt of 16 tokens, 1 output token", "the same with prompt_logprobs=1"]
