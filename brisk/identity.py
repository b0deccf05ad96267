"""What a figure or a cached answer was made with: the model's bytes and brisk's own code.

Two things key on these: the response cache (an answer is reused only by the same model, the
same settings and the same code) and `brisk optimize` (a measurement is reused only on the
same model, code and host). Both hash contents, never names, sizes or modification times: a
fine-tune saved over the same file name, a same-sized weight file copied in with its old
mtime, or an edit to a kernel under the static version string 0.1.0 must each count as a
different model or a different brisk. brisk's version joins its sources: an install whose
sources are not all there to hash (bytecode only, a build's compiled parts) still counts as
another brisk after an upgrade, which may change the numbers and so the answers.

A leaf: it imports nothing of brisk, so every room may use it.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

_PACKAGE = Path(__file__).parent
# The files whose bytes decide brisk's behaviour: code, kernels, the dashboard, bundled data.
_SOURCE_SUFFIXES = (".py", ".c", ".h", ".html", ".jsonl")


def content_digest(path: str) -> str:
    """SHA-256 over a model's files: a file's bytes, or for a folder each file's path inside
    it and bytes, in sorted order (about 1 GB/s on our CPUs: 0.1 s for the default model)."""
    root = os.path.realpath(path)
    digest = hashlib.sha256()
    if os.path.isdir(root):
        files = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names)
    else:
        files = [root]
    for file in files:
        digest.update(os.path.relpath(file, root).encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def brisk_version() -> str:
    """brisk's version from its package metadata; "unknown" for a tree that was never installed."""
    try:
        return version("brisk")
    except PackageNotFoundError:
        return "unknown"


@cache
def source_digest() -> str:
    """The identity of the code that produced a figure: brisk's version and its sources as
    installed (an editable checkout's working tree, so uncommitted changes count)."""
    return code_digest(brisk_version(), _PACKAGE)


def code_digest(version: str, package: Path) -> str:
    """SHA-256 over `version` and the source files under `package`, by path and bytes."""
    digest = hashlib.sha256(f"brisk {version}\0".encode())
    for file in sorted(p for p in package.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        digest.update(file.relative_to(package).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()
