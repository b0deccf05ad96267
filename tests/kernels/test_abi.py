"""The ctypes side of the C kernels (kernels/cpu.py) against the C declarations, which it mirrors
by hand: every exported function's argument and return kinds against `_SIGNATURES` and
`_STATUS_KERNELS`, every struct's size and fields' offsets, sizes and kinds against the ctypes
Structures, and the constants Python copies (`_FORMAT_IDS`, `QUANT_MATVEC_MAX_ROWS`, lora.py's
`COLUMNS` and `PROJECTIONS`). The C side is read as the compiler sees it: sources preprocessed
with cpu.py's own flags and shape defines (functions), and a probe program built from them that
prints sizeof/offsetof (structs and constants). Last, the kernels that allocate are run out of
memory: they must say so, not crash."""

from __future__ import annotations

import ctypes
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import torch

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels import lora as kernel_lora
from brisk.kernels.kv_cache import KVCacheLayer
from tests.helpers import require_c_compiler

require_c_compiler()

SHAPE = (("BLOCK_SIZE", 16), ("HEAD_DIM", 64))  # what _shaped_library defines, for a cache of 16 x 64
SOURCES = {"paged_attention.c": SHAPE, "decode_layers.c": SHAPE, "linear.c": (), "layer_ops.c": (),
           "sampling.c": (), "quant_linear.c": (), "lora.c": (), "limits.c": (), "tiles.c": ()}
STRUCTS = {cpu_kernels._Weight: "weight", cpu_kernels._Layer: "decode_layer", cpu_kernels._Model: "decode_model",
           cpu_kernels._Batch: "decode_batch", kernel_lora._Piece: "lora_piece", kernel_lora._Projection: "lora_projection",
           kernel_lora._Batch: "lora_batch"}
C_SCALARS = {"int64_t": "int64", "int32_t": "int32", "int": "int32", "float": "float", "double": "double"}
# GCC's __builtin_classify_type (typeclass.h), which the probe prints for each field
TYPE_CLASSES = {1: "integer", 5: "pointer", 8: "real", 12: "record"}
DEFINITION = re.compile(r"\b([A-Za-z_]\w*)\s*\(([^()]*)\)\s*\{")
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof"}


def _flags(defines: tuple[tuple[str, int], ...]) -> list[str]:
    """The flags _library compiles a source with."""
    return [*cpu_kernels._FLAGS, "-march=native", *(f"-D{name}={value}" for name, value in defines)]


@cache
def _preprocessed(source: str) -> str:
    """The source after the preprocessor, cut to the lines that come from brisk's kernel files
    (the system headers' declarations dropped), macros expanded: what the compiler sees."""
    result = subprocess.run([cpu_kernels._compiler(), *_flags(SOURCES[source]), "-E", str(cpu_kernels._HERE / source)],
                            capture_output=True, text=True, check=True)
    kept, ours = [], True
    for line in result.stdout.splitlines():
        marker = re.match(r'# \d+ "([^"]+)"', line)
        if marker:
            ours = Path(marker.group(1)).parent.resolve() == cpu_kernels._HERE.resolve()
        elif ours and not line.startswith("#"):
            kept.append(line)
    return "\n".join(kept)


def _kind(declaration: str) -> str:
    """'pointer', or the scalar kind of a C parameter declaration ('const int64_t *restrict x': pointer)."""
    if "*" in declaration:
        return "pointer"
    words = [w for w in declaration.split() if w not in ("const", "restrict", "volatile")]
    return C_SCALARS[" ".join(words[:-1])]


def _exported(source: str) -> dict[str, tuple[str, list[str]]]:
    """Each function the library exports (defined, not static): name -> (return kind, argument kinds)."""
    text = _preprocessed(source)
    functions = {}
    for match in DEFINITION.finditer(text):
        name, params = match.groups()
        head = re.split(r"[;{}]", text[:match.start()])[-1].split()
        if name in KEYWORDS or not head or "static" in head:
            continue
        returns = " ".join(w for w in head if w not in ("inline", "extern"))
        params = [] if params.strip() in ("", "void") else [p.strip() for p in params.split(",")]
        functions[name] = ("void" if returns == "void" else C_SCALARS[returns], [_kind(p) for p in params])
    return functions


def _ctypes_kind(t) -> str:
    if t is None:
        return "void"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "pointer"
    if t in (ctypes.c_float, ctypes.c_double):
        return {ctypes.c_float: "float", ctypes.c_double: "double"}[t]
    return f"int{8 * ctypes.sizeof(t)}"


def _base(name: str) -> str | None:
    """The _SIGNATURES entry a C function's name is a variant of (name_<dtype>[_<cache kind>])."""
    suffixes = "|".join(cpu_kernels._SUFFIXES.values())
    kinds = "|".join(cpu_kernels._CACHE_SUFFIXES.values())
    return next((base for base in cpu_kernels._SIGNATURES
                 if re.fullmatch(rf"{base}(_({suffixes})(_({kinds}))?)?", name)), None)


def test_every_kernel_source_is_checked():
    assert {p.name for p in cpu_kernels._HERE.glob("*.c")} == set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_ctypes_signatures_match_the_c_definitions(source):
    """Every function the library exports has its ctypes signature, set by _library, with the C
    definition's argument kinds (pointer, int64, int32, float, double) and return kind."""
    exported = _exported(source)
    assert exported, f"no exported function found in {source}"
    library = cpu_kernels._library(source, SOURCES[source])
    wrong = []
    for name, (returns, params) in exported.items():
        if _base(name) is None:
            wrong.append(f"{name}: exported by {source}, but no _SIGNATURES entry")
            continue
        function = getattr(library, name)
        got = [_ctypes_kind(t) for t in function.argtypes or ()]
        if got != params:
            wrong.append(f"{name}: C takes {params}, ctypes passes {got}")
        if _ctypes_kind(function.restype) != returns:
            wrong.append(f"{name}: C returns {returns}, ctypes reads {_ctypes_kind(function.restype)}")
    assert not wrong, "\n".join(wrong)


def test_every_signature_names_a_c_function_and_every_cache_kind_has_its_variants():
    """No stale _SIGNATURES entry, and a kernel built per cache kind exists for every pair of
    model dtype and cache kind that cpu.py may ask for."""
    bases = {name: _base(name) for source in SOURCES for name in _exported(source)}
    assert set(bases.values()) - {None} == set(cpu_kernels._SIGNATURES)
    for base in {base for name, base in bases.items() if base and name.count("_") == base.count("_") + 2}:
        grid = {f"{base}_{x}_{c}" for x in cpu_kernels._SUFFIXES.values() for c in cpu_kernels._CACHE_SUFFIXES.values()}
        assert grid <= bases.keys(), f"{base}: no C variant for {sorted(grid - bases.keys())}"


def test_status_kernels_are_the_ones_returning_a_status():
    returns = {_base(name): kind for source in SOURCES for name, (kind, _) in _exported(source).items()}
    assert {base for base, kind in returns.items() if kind == "int32"} == cpu_kernels._STATUS_KERNELS


def _c_fields(struct: str) -> list[tuple[str, str]]:
    """(name, declaration) of each field of `struct <struct>`, in order, as the preprocessor left it."""
    text = "\n".join(_preprocessed(source) for source in SOURCES)
    body = re.search(rf"struct\s+{struct}\s*\{{([^}}]*)\}}\s*;", text)
    assert body, f"struct {struct} not found in the kernel sources"
    fields = []
    for declaration in filter(str.strip, body.group(1).split(";")):
        first, *others = declaration.split(",")
        base_type = re.sub(r"\*?\s*\w+\s*$", "", first.strip()).replace("*", "").strip()
        for declarator in [first.strip()[len(base_type):], *others]:
            fields.append((declarator.replace("*", "").strip(), f"{base_type} {declarator.strip()}"))
    return fields


def _enumerators(enum: str) -> list[str]:
    body = re.search(rf"enum\s+{enum}\s*\{{([^}}]*)\}}", "\n".join(_preprocessed(s) for s in SOURCES))
    assert body, f"enum {enum} not found in the kernel sources"
    return [e.split("=")[0].strip() for e in body.group(1).split(",") if e.strip()]


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict[tuple[str, ...], int]:
    """Builds and runs a program that includes the kernel sources (with cpu.py's flags) and prints
    sizeof and offsetof of every struct field, and the constants Python copies."""
    lines = []
    for struct in STRUCTS.values():
        lines.append(f'printf("size {struct} %zu\\n", sizeof(struct {struct}));')
        for name, _ in _c_fields(struct):
            lines.append(f'printf("field {struct} {name} %zu %zu %d\\n", offsetof(struct {struct}, {name}), '
                         f'sizeof(((struct {struct} *)0)->{name}), '
                         f'__builtin_classify_type((struct {struct}){{0}}.{name}));')
    for constant in ["MATVEC_MAX_ROWS", "KERNEL_OK", "LORA_COLUMNS", *_enumerators("weight_format")]:
        lines.append(f'printf("const {constant} %lld\\n", (long long){constant});')
    folder = tmp_path_factory.mktemp("abi")
    program = folder / "probe.c"
    program.write_text('#include "decode_layers.c"\n#include "quant_linear.c"\n#include <stddef.h>\n#include <stdio.h>\n'
                       "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    binary = folder / "probe"
    built = subprocess.run([cpu_kernels._compiler(), *_flags(SHAPE), f"-I{cpu_kernels._HERE}", str(program), "-o",
                            str(binary), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    values = {}
    for line in output.splitlines():
        words = line.split()
        if words[0] == "field":  # field <struct> <name> <offset> <size> <type class>
            values.update({(*words[:3], what): int(v) for what, v in zip(("offset", "size", "class"), words[3:])})
        else:  # size <struct> <bytes>, const <name> <value>
            values[tuple(words[:2])] = int(words[2])
    return values


def test_the_ctypes_structures_have_the_c_layouts(probe):
    wrong = []
    for cls, struct in STRUCTS.items():
        c_fields = _c_fields(struct)
        names = [name for name, *_ in cls._fields_]
        if names != [name for name, _ in c_fields]:
            wrong.append(f"struct {struct} has fields {[n for n, _ in c_fields]}, {cls.__name__} {names}")
            continue
        if ctypes.sizeof(cls) != probe["size", struct]:
            wrong.append(f"struct {struct}: {probe['size', struct]} bytes, {cls.__name__} {ctypes.sizeof(cls)}")
        for (name, field_type), (_, declaration) in zip(cls._fields_, c_fields):
            field = getattr(cls, name)
            c_offset, c_size, c_class = (probe["field", struct, name, x] for x in ("offset", "size", "class"))
            kind = ("record" if issubclass(field_type, ctypes.Structure) else
                    "real" if field_type in (ctypes.c_float, ctypes.c_double) else
                    "pointer" if _ctypes_kind(field_type) == "pointer" else "integer")
            if (field.offset, field.size, kind) != (c_offset, c_size, TYPE_CLASSES.get(c_class)):
                wrong.append(f"{struct}.{name} ({declaration}): C offset {c_offset}, size {c_size}, "
                             f"{TYPE_CLASSES.get(c_class, c_class)}; {cls.__name__}: {field.offset}, {field.size}, {kind}")
            pointee = getattr(field_type, "_type_", None)
            if pointee in STRUCTS and f"struct {STRUCTS[pointee]}" not in declaration:
                wrong.append(f"{struct}.{name} ({declaration}) points to a {pointee.__name__} in ctypes")
    assert not wrong, "\n".join(wrong)


def test_the_constants_python_copies_match_c(probe):
    assert cpu_kernels.QUANT_MATVEC_MAX_ROWS == probe["const", "MATVEC_MAX_ROWS"]
    assert probe["const", "KERNEL_OK"] == 0  # what _check takes for success
    assert {f"WEIGHT_{name.upper()}" for name in cpu_kernels._FORMAT_IDS} == set(_enumerators("weight_format"))
    for name, value in cpu_kernels._FORMAT_IDS.items():
        assert probe["const", f"WEIGHT_{name.upper()}"] == value, name
    assert kernel_lora.COLUMNS == probe["const", "LORA_COLUMNS"]  # the tiles lora.py packs B^T in
    assert _enumerators("lora_target") == [f"LORA_{p.upper()}" for p in kernel_lora.PROJECTIONS] + ["LORA_PROJECTIONS"]


@pytest.fixture
def two_threads():
    """The kernels size their per-thread scratch by omp_get_max_threads(), torch's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# Sizes whose scratch is 2^58 bytes or more: past any address space, so malloc fails whatever the
# overcommit policy, yet far from overflowing an int64. No tensor that large exists: the inputs
# are NULL or expanded views, which a kernel that stops at its failed allocation never reads.
HUGE = 1 << 54


def test_decode_attention_out_of_memory_raises_and_writes_nothing(two_threads):
    heads = 1 << 50  # partials: 66 floats per head
    q = torch.zeros(1, 1, 64).expand(1, heads, 64)
    cache = KVCacheLayer("float32", torch.zeros(1, 1, 64, 16).expand(1, heads, 64, 16),
                         torch.zeros(1, 1, 16, 64).expand(1, heads, 16, 64))
    out = torch.full((1, 1, 64), 7.0).expand(1, heads, 64)
    with pytest.raises(MemoryError, match="paged_decode_attention"):
        cpu_kernels.decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 0.125, out)
    assert (out[:, :1] == 7.0).all()


def test_quant_linear_panels_out_of_memory(two_threads):
    weight = cpu_kernels._Weight(None, None, None, None, 1, HUGE, cpu_kernels._FORMAT_IDS["int8"], 0,
                                 HUGE // 32, HUGE // 32, 0)
    rows = cpu_kernels.QUANT_MATVEC_MAX_ROWS + 1  # the panel path
    y = torch.full((rows, 1), 7.0)
    assert cpu_kernels._library("quant_linear.c").quant_linear(ctypes.byref(weight), None, y.data_ptr(), rows, None,
                                                               0) != 0
    assert (y == 7.0).all()


def test_sample_rows_out_of_memory(two_threads):
    out = torch.full((1,), 7)
    status = cpu_kernels._library("sampling.c").sample_rows_f32(None, 1, HUGE, None, None, None, None, None,
                                                                out.data_ptr())
    assert status != 0 and out.item() == 7
    with pytest.raises(MemoryError, match="sample_rows"):
        cpu_kernels._check(status, "sample_rows")


def test_decode_layers_out_of_memory(two_threads):
    model = cpu_kernels._Model(1, 16 * HUGE, 1, 1, 1, 1e-6, 0.125)  # hidden: the residual's calloc fails
    batch = cpu_kernels._Batch(1, 1)
    x = torch.full((1, 1), 7.0)
    kernel = cpu_kernels._library("decode_layers.c", SHAPE).decode_layers_f32_f32
    assert kernel(ctypes.byref(model), ctypes.byref(batch), x.data_ptr(), None) != 0
    assert (x == 7.0).all()


def test_lora_add_out_of_memory(two_threads):
    batch = kernel_lora._Batch(1, HUGE)  # the shrink's scratch: rows x max_rank floats
    y = torch.full((1, 1), 7.0)
    with pytest.raises(MemoryError, match="lora_add"):
        cpu_kernels._check(cpu_kernels._library("lora.c").lora_add(ctypes.byref(batch), 0, None, y.data_ptr(), 1, 1, 1),
                           "lora_add")
    with pytest.raises(MemoryError, match="quant_linear"):  # the same scratch, for the adapters in the product's call
        cpu_kernels._check(cpu_kernels._library("quant_linear.c").quant_linear(None, None, y.data_ptr(), 1,
                                                                               ctypes.byref(batch), 0), "quant_linear")
    assert (y == 7.0).all()
