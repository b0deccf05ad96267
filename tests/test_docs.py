"""The documentation site builds without a warning (a broken link or anchor, a page left out of
the nav), and every knob of the config classes is documented on its page, so an option added to
brisk/config.py without a word in the docs fails here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from brisk.config import ClusterConfig, EmbeddingConfig, EngineConfig, ResponseCacheConfig, ServerConfig, knobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_site_builds_in_strict_mode(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "benchmarks" / "index.html").is_file()


@pytest.mark.parametrize(("config", "page"), [(EngineConfig, "configuration.md"), (ServerConfig, "serving.md"),
                                              (EmbeddingConfig, "serving.md"), (ResponseCacheConfig, "serving.md"),
                                              (ClusterConfig, "deployment.md")])
def test_every_option_is_documented_on_its_page(config, page):
    with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
        text = f.read()
    missing = [f.name for f in knobs(config)
               if f"`{f.name}`" not in text and f"`--{f.name.replace('_', '-')}" not in text]
    assert not missing, f"docs/{page} does not document {missing}"
