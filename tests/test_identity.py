"""The code's identity, which the response cache's model identity holds: brisk's version and its
sources, so an upgrade is another brisk even where the sources hashed are the same."""

from __future__ import annotations

from pathlib import Path

import brisk
from brisk.identity import brisk_version, code_digest, source_digest


def test_an_upgrade_or_an_edit_is_another_brisk(tmp_path):
    (tmp_path / "kernel.c").write_text("int f(void) { return 1; }\n")
    installed = code_digest("0.1.0", tmp_path)
    assert code_digest("0.1.0", tmp_path) == installed
    assert code_digest("0.2.0", tmp_path) != installed  # compiled parts may change with no source here
    (tmp_path / "kernel.c").write_text("int f(void) { return 2; }\n")
    assert code_digest("0.1.0", tmp_path) != installed


def test_the_source_digest_is_the_installed_version_and_sources():
    assert brisk_version() not in ("", "unknown")  # the venv installs brisk (editable)
    assert source_digest() == code_digest(brisk_version(), Path(brisk.__file__).parent)
