"""brisk.sample is a leaf: it can be read, tested and replaced without the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import brisk.sample

# kernels: the C sampling kernel, itself a leaf (it imports nothing of brisk).
ALLOWED_BRISK_IMPORTS = {"brisk.sample", "brisk.sampling_params", "brisk.kernels"}


def test_sample_modules_import_no_other_brisk_package():
    folder = Path(brisk.sample.__file__).parent
    imported = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    brisk_imports = {m for m in imported if m == "brisk" or m.startswith("brisk.")}
    assert brisk_imports, "the check must see the package's own imports"
    assert {m for m in brisk_imports if not any(m == a or m.startswith(a + ".") for a in ALLOWED_BRISK_IMPORTS)} == set()
