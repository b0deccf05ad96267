"""`brisk bench lora` runs the base model alone and every count of adapters at every rank, in
rounds with the base model run between every two settings (a tiny model: what is checked is the
command and its table, not the numbers)."""

from __future__ import annotations

import pytest

from brisk.cli import main
from tests.conftest import build_tiny_checkpoint


def test_bench_lora_measures_every_setting_beside_the_base_model(tmp_path, capsys):
    model = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    code = main(["bench", "lora", "--model", model, "--num-prompts", "6", "--output-len", "4", "--rounds", "2",
                 "--adapters", "1", "3", "--ranks", "2", "4", "--dtype", "float32", "--num-kv-blocks", "64"])
    assert code == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    assert [row[0].removeprefix("| ") for row in rows] == [
        "base model alone", "1 adapter, rank 2", "3 adapters, rank 2", "1 adapter, rank 4", "3 adapters, rank 4"]
    assert rows[0][3] == "1.00" and len(rows[0][4].split(", ")) == 2 * 5  # the base: before each setting and after
    assert all(len(row[4].split(", ")) == 2 for row in rows[1:])  # both rounds shown
    sizes = [float(row[1].removesuffix(" MB")) for row in rows]
    assert sizes[0] == 0 and sizes[1] > 0  # bytes follow count and rank
    assert sizes[2] == pytest.approx(3 * sizes[1], rel=1e-2) and sizes[3] == pytest.approx(2 * sizes[1], rel=1e-2)
