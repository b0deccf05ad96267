"""How the C kernels' build fails: without a compiler the engine runs torch (said once in the
log); with one, a build that fails raises KernelBuildError with the compiler's own message,
never a quiet fall back to torch. The sources are copied to a temporary folder and the kernel
cache pointed there, so neither the package nor the user's cache is touched."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend, choose_backend
from tests.helpers import require_c_compiler


@pytest.fixture
def fresh_caches(monkeypatch, tmp_path):
    """An empty kernel cache under tmp_path, and no library or compiler remembered from before
    (nor, afterwards, from the test)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu_kernels._compiler.cache_clear()
    cpu_kernels._library.cache_clear()
    yield tmp_path / "cache"
    cpu_kernels._compiler.cache_clear()
    cpu_kernels._library.cache_clear()


def test_a_source_that_does_not_compile_raises_with_the_compilers_message(fresh_caches, monkeypatch, tmp_path):
    require_c_compiler()
    sources = tmp_path / "kernels"
    sources.mkdir()
    for source in [*cpu_kernels._HERE.glob("*.c"), *cpu_kernels._HERE.glob("*.h")]:
        shutil.copy(source, sources)
    with open(sources / "quant.h", "a") as header:
        header.write("\nstatic int broken_on_purpose(void) { return }\n")
    monkeypatch.setattr(cpu_kernels, "_HERE", sources)
    with pytest.raises(cpu_kernels.KernelBuildError) as raised:
        cpu_kernels._library.__wrapped__("quant_linear.c")
    message = str(raised.value)
    assert message.startswith("building quant_linear.c failed (exit code ")
    assert f"-c {sources / 'quant_linear.c'} -o " in message  # the command
    assert "quant.h" in message and "broken_on_purpose" in message and "error" in message  # the compiler's stderr
    assert not list(fresh_caches.rglob("*.so"))


def test_a_kernel_cache_that_cannot_be_written_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    require_c_compiler()
    blocker = tmp_path / "a-file-not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder cannot be created
    with pytest.raises(OSError):
        cpu_kernels._library.__wrapped__("linear.c")


def test_without_a_compiler_the_kernels_are_unavailable_and_it_is_said_once(fresh_caches, monkeypatch, tmp_path,
                                                                           caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels._library("linear.c") is None
        assert cpu_kernels._library("sampling.c") is None
        assert type(choose_backend(torch.device("cpu"))) is KernelBackend  # the torch formulation
    assert [r.getMessage() for r in caplog.records] == [
        "no C compiler found (neither $CC, cc nor gcc on PATH): using the slower torch paths"]
    assert not fresh_caches.exists()
