"""`brisk bench report`'s file handling: a section's output as markdown, and rerunning some
sections without losing the others."""

from __future__ import annotations

from brisk.bench.report import SECTIONS, duration, render, write


def test_output_becomes_tables_and_verbatim_text():
    output = "CPU: x\nworkload: y\n\n| a | b |\n|---|---|\n| 1 | 2 |\nafter the table\n"
    assert render(output) == ["```text", "CPU: x", "workload: y", "```", "",
                              "| a | b |", "|---|---|", "| 1 | 2 |", "",
                              "```text", "after the table", "```", ""]


def test_rerunning_some_sections_keeps_the_others_in_order(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    first, second, third = SECTIONS[0].name, SECTIONS[1].name, SECTIONS[2].name
    write(path, {third: "third, old\n", first: "first, old\n"})
    write(path, {second: "second, new\n", third: "third, new\n"})
    text = path.read_text()
    assert text.startswith("# Benchmarks")
    assert "first, old" in text and "third, old" not in text
    assert text.index("first, old") < text.index("second, new") < text.index("third, new")


def test_the_header_states_the_full_runs_time_from_the_sections():
    run = "CPU: x. Run 2026-11-23, {} size, {} min.\n"
    first, second, third, fourth = (s.name for s in SECTIONS[:4])
    body = {first: run.format("full", "62.4"), second: run.format("full", "30.0"), third: run.format("quick", "1.2"),
            fourth: "Run by hand on another machine.\n"}
    text = duration(body)
    assert f"2 sections take 92 min (1 h 32 min) in all, the slowest {first} 62, {second} 30" in text
    assert f"At quick size, not in that sum: {third}." in text
    assert f"not in that sum: {fourth}." in text
    assert duration({third: body[third]}).startswith("No section here was run at full size.")
