"""A test whose part is missing (redis-server, Chromium, Ray, a C compiler...) skips, naming it,
but fails under CI=true: a CI run that skipped what it should have installed must not pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import import_or_require, require

ROOT = Path(__file__).resolve().parents[1]
REDIS_TESTS = ["tests/cache/test_stores.py::test_exact_and_nearest_lookups[redis]",
               "tests/cache/test_stores.py::test_redis_processes_share_one_index_state"]


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_a_missing_part_fails_under_ci(ci, monkeypatch):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"^a widget is missing \(CI=true: a missing part fails"):
        require(False, "a widget")


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_a_missing_part_skips_elsewhere(ci, monkeypatch):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="^a widget is missing$"):
        require(False, "a widget")
    require(True, "a widget")  # present: nothing happens


def test_import_or_require_returns_the_module_or_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert import_or_require("json", "json") is json
    with pytest.raises(pytest.fail.Exception, match=r"^a widget \(import no_such_module_anywhere: No module named"):
        import_or_require("no_such_module_anywhere", "a widget")


def _pytest_without_redis(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """The Redis store's tests in a pytest of their own whose PATH holds only the venv's folder
    and an empty one: no redis-server to find."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "CI"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(tmp_path)])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *REDIS_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_without_redis_server_ci_fails(tmp_path):
    run = _pytest_without_redis(tmp_path, "true")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "redis-server (make install puts in Debian's package) is missing (CI=true" in run.stdout
    assert "2 errors" in run.stdout and "skipped" not in run.stdout


def test_without_redis_server_a_local_run_skips(tmp_path):
    run = _pytest_without_redis(tmp_path, None)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "redis-server (make install puts in Debian's package) is missing" in run.stdout
    assert "2 skipped" in run.stdout and "error" not in run.stdout and "failed" not in run.stdout
