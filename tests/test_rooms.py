"""The folder tree is the architecture: which room may import which (README, Architecture).

Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is
still a dependency, only a later one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "brisk"  # read, not imported: a broken room still fails here

# The offline tools on top: nothing in the runtime may import them.
OFFLINE = ("brisk.bench", "brisk.training", "brisk.cli")

# room -> the brisk modules it may import (None: any but the offline tools)
ALLOWED: dict[str, tuple[str, ...]] = {
    "brisk.kernels": ("brisk.kernels",),  # the ground floor
    "brisk.config": (),  # the one config home reads nothing of what it configures
    "brisk.sample": ("brisk.sample", "brisk.sampling_params", "brisk.kernels"),
}
# room -> the brisk modules it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # the core: techniques plug in through its seams (brisk.assembly), transports carry requests to it
    "brisk.engine": ("brisk.spec", "brisk.transport", "brisk.server", "brisk.cluster", "brisk.cache", "brisk.assembly",
                     "brisk.llm", "brisk.batch", "brisk.embed"),
    "brisk.spec": ("brisk.transport", "brisk.server", "brisk.cluster", "brisk.assembly", "brisk.llm"),
    "brisk.transport": ("brisk.server", "brisk.cluster"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _brisk_imports(path: Path) -> set[str]:
    """The brisk modules `path` imports; `from brisk import spec` counts as brisk.spec, and a
    relative import is refused (brisk spells every import out)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import ({'.' * node.level}{node.module or ''})"
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {m for m in imported if m == "brisk" or m.startswith("brisk.")}


def _within(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


IMPORTS = {_module_name(p): _brisk_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_walk_sees_imports_inside_functions_and_type_checking_blocks():
    assert "brisk.engine.engine" in IMPORTS["brisk.assembly"]
    assert "brisk.training.distill.train" in IMPORTS["brisk.cli"]  # imported inside a function
    assert "brisk.engine.engine" in IMPORTS["brisk.spec.speculator"]  # under TYPE_CHECKING


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_what_it_stands_on(room):
    modules = {m: i for m, i in IMPORTS.items() if _within(m, (room,))}
    assert modules, f"no modules found for {room}"
    assert {m: sorted(i for i in imports if not _within(i, ALLOWED[room]))
            for m, imports in modules.items() if any(not _within(i, ALLOWED[room]) for i in imports)} == {}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_does_not_import_the_rooms_above_it(room):
    modules = {m: i for m, i in IMPORTS.items() if _within(m, (room,))}
    assert modules, f"no modules found for {room}"
    assert {m: sorted(i for i in imports if _within(i, FORBIDDEN[room]))
            for m, imports in modules.items() if any(_within(i, FORBIDDEN[room]) for i in imports)} == {}


def test_the_runtime_never_imports_the_offline_tools():
    runtime = {m: i for m, i in IMPORTS.items() if not _within(m, OFFLINE)}
    assert {m: sorted(i for i in imports if _within(i, OFFLINE))
            for m, imports in runtime.items() if any(_within(i, OFFLINE) for i in imports)} == {}
