"""The folder tree is the architecture (docs/architecture.md): every room of brisk has a layer,
and a module imports only its own room and the rooms of lower layers. So no room imports one
above it or beside it, and no two rooms depend on each other: a cycle needs an import that is
not downwards. (Within a room, a base class may name its subclasses in a factory, as
kernels/backend.py's choose_backend does: the room is one unit.)

Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is
still a dependency, only a later one. The files are read, not imported: a broken room still
fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "brisk"

# Bottom to top. A room is a top-level module or package of brisk; "brisk" is the package's
# facade (brisk/__init__.py: `from brisk import LLM`), which re-exports the runtime's public names.
LAYERS: list[tuple[str, ...]] = [
    ("brisk.config", "brisk.kernels"),  # the one config home; the kernels, the ground floor
    ("brisk.sample", "brisk.quant", "brisk.identity", "brisk.cache", "brisk.embed"),  # sampler, weight formats, stores
    ("brisk.model",),  # layers and loaders
    ("brisk.engine",),  # the core: scheduler, KV blocks, runner, and the seams techniques plug into
    ("brisk.spec",),  # speculative decoding, a step hook
    ("brisk.assembly",),  # an engine built with the plug-ins its config asks for
    ("brisk.llm", "brisk.transport"),  # the offline API; what carries requests to an engine
    ("brisk",),  # the public facade
    ("brisk.server",),  # the OpenAI-compatible HTTP API
    ("brisk.cluster", "brisk.batch"),  # Ray Serve replicas; OpenAI batch files
    ("brisk.args", "brisk.training"),  # command-line flags from the configs; new weights
    ("brisk.bench",),  # measurements
    ("brisk.cli",),  # the command line, on top of everything
]
LAYER = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _brisk_imports(path: Path) -> set[str]:
    """The brisk modules `path` imports (`from brisk.x import y` counts as brisk.x and brisk.x.y;
    a bare `import brisk` as nothing: every brisk import loads the package first). A relative
    import is refused: brisk spells every import out."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import ({'.' * node.level}{node.module or ''})"
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {m for m in imported if m.startswith("brisk.")}


IMPORTS = {_module_name(p): _brisk_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
ROOMS = {f"brisk.{p.stem}" for p in PACKAGE.iterdir()
         if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and any(p.rglob("*.py")))} | {"brisk"}


def _room(module: str) -> str:
    """The room of a module, or of a name imported from one: brisk.engine.scheduler -> brisk.engine;
    brisk.LLM (a name of the facade) -> brisk."""
    if module == "brisk":
        return "brisk"
    top = ".".join(module.split(".")[:2])
    return top if top in ROOMS else "brisk"


def test_the_walk_sees_imports_inside_functions_and_type_checking_blocks():
    assert "brisk.engine.engine" in IMPORTS["brisk.assembly"]
    assert "brisk.training.distill.train" in IMPORTS["brisk.cli"]  # imported inside a function
    assert "brisk.engine.engine" in IMPORTS["brisk.spec.speculator"]  # under TYPE_CHECKING


def test_every_room_has_exactly_one_layer():
    rooms = ROOMS
    declared = [room for rooms_of_layer in LAYERS for room in rooms_of_layer]
    assert len(declared) == len(set(declared)), "a room is declared twice"
    assert rooms == set(declared), {"undeclared": sorted(rooms - set(declared)),
                                    "declared, not in brisk/": sorted(set(declared) - rooms)}


@pytest.mark.parametrize("room", [room for rooms in LAYERS for room in rooms])
def test_a_room_imports_only_itself_and_the_layers_below(room):
    upward = {m: sorted(i for i in imports if _room(i) != room and LAYER[_room(i)] >= LAYER[room])
              for m, imports in IMPORTS.items() if _room(m) == room}
    assert {m: i for m, i in upward.items() if i} == {}
