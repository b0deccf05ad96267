"""LoRA adapters as the kernels apply them: one segmented low-rank product per projection.

A step may mix rows of several adapters and of the base model. The base weights run once over
every row, as without adapters; then each adapter's update is added to its own rows only:

    y[i] += B (A x[i])          for each row i of the adapter's segment

in two halves, as Punica's SGMV does on GPUs: the shrink (t = A x, a few numbers per row, each
row of A read once for the whole segment) and the expand (y += B t, B kept transposed and each of
its columns read once per segment). The rows of the step are grouped by adapter once
(LoRABatch.of), so every projection of every layer reads each adapter's A and B once per step,
whatever its number of rows. On CPU the C kernels (lora.h) run it: inside the fused decode step,
in a quantized projection's own C call (a linear layer is handed its `LoRAUpdate`), on its own
after a dense one (bf16 activations through a float32 update); elsewhere, and under autograd
(training an adapter), `lora_add_torch`, their reference (a GPU runs it in torch today, outside
CUDA graphs).

An adapter's update of one of the model's fused projections (q/k/v, gate/up) is one A, its
modules' A matrices stacked ([R, in]: R the sum of their ranks), and one B per module (a
`LoRAPiece`: the rows of the projection it writes, and which of R it reads). Projections are
numbered as the C kernels number them (PROJECTIONS); an adapter that leaves one alone has rank 0
there. The scaling is folded into B by the caller (model/lora.py).

The ctypes structs below mirror lora.h's; the C backend (kernels/cpu.py) passes them. Nothing
here imports the rest of brisk.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import torch

from brisk.kernels.memory import huge_page_copies

# The projections of a layer an adapter may update, in lora.h's order (enum lora_target)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
COLUMNS = 128  # lora.h's LORA_COLUMNS: the outputs a tile of B^T holds
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def table_index(layer: int, projection: str) -> int:
    """A projection's place in an adapter's table of updates (lora.h: layer * LORA_PROJECTIONS +
    enum lora_target), which the C kernels are handed."""
    return layer * len(PROJECTIONS) + PROJECTIONS.index(projection)


@dataclass(frozen=True)
class LoRAPiece:
    """One adapted module's B inside a fused projection, kept transposed: the expand adds t[i, r]
    times row r of B^T, a contiguous run along the outputs. An adapter packed for the C kernels
    keeps it in their tiles (`tiled`, lora.h), `shape` then saying what it holds."""

    first_row: int  # the projection's output its first row of B adds to
    first_rank: int  # where its columns of t start (its A's rows in the stacked A)
    bt: torch.Tensor  # B^T, [rank, rows], the scaling folded in; or its tiles, flat
    shape: tuple[int, int] | None = None  # (rank, rows) where bt is tiles

    @property
    def rank(self) -> int:
        return (self.shape or self.bt.shape)[0]

    @property
    def rows(self) -> int:
        return (self.shape or self.bt.shape)[1]

    def matrix(self) -> torch.Tensor:
        """B^T, [rank, rows] (rebuilt from the tiles of a packed adapter)."""
        return self.bt if self.shape is None else untiled(self.bt, *self.shape)


@dataclass(frozen=True)
class LoRAProjection:
    """An adapter's update of one projection of one layer."""

    a: torch.Tensor  # [R, in]: the pieces' A matrices, stacked
    pieces: tuple[LoRAPiece, ...]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


class _Piece(ctypes.Structure):  # struct lora_piece, lora.h
    _fields_ = [("first_row", _I64), ("rows", _I64), ("first_rank", _I64), ("rank", _I64), ("bt", _PTR)]


class _Projection(ctypes.Structure):  # struct lora_projection
    _fields_ = [("a", _PTR), ("rank", _I64), ("num_pieces", _I64), ("pieces", ctypes.POINTER(_Piece))]


class _Batch(ctypes.Structure):  # struct lora_batch
    _fields_ = [("num_adapters", _I64), ("max_rank", _I64), ("bf16", _I64), ("rows", _PTR), ("starts", _PTR),
                ("scales", _PTR), ("adapters", ctypes.POINTER(ctypes.POINTER(_Projection)))]


class AdapterWeights:
    """One adapter's updates of a model's layers, in one dtype, on one device: what a step reads.

    On CPU, unless in training (`packed`), it is laid out for the C kernels (`_packed`) and holds
    their table of it (num_layers x PROJECTIONS `lora_projection` structs), built once here and
    pointing into the tensors this object keeps; a training adapter's tensors are autograd's
    leaves, read by `lora_add_torch`."""

    def __init__(self, num_layers: int, projections: dict[tuple[int, str], LoRAProjection]):
        self.num_layers = num_layers
        tensors = [t for p in projections.values() for t in (p.a, *(piece.bt for piece in p.pieces))]
        self.packed = bool(tensors) and tensors[0].device.type == "cpu" and not any(t.requires_grad for t in tensors)
        if self.packed:
            projections = _packed(projections)
            tensors = [t for p in projections.values() for t in (p.a, *(piece.bt for piece in p.pieces))]
        self.projections = projections
        self.dtype = tensors[0].dtype if tensors else torch.float32
        self.device = tensors[0].device if tensors else torch.device("cpu")
        if any(t.dtype != self.dtype or t.device != self.device or not t.is_contiguous() for t in tensors):
            raise ValueError("an adapter's tensors must share one dtype and device and be contiguous")
        self.max_rank = max((p.rank for p in projections.values()), default=0)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._table = self._pieces = None
        if self.packed:
            self._pieces = [(_Piece * len(p.pieces))(*(
                _Piece(piece.first_row, piece.rows, piece.first_rank, piece.rank, piece.bt.data_ptr())
                for piece in p.pieces)) for p in projections.values()]
            pieces = dict(zip(projections, self._pieces))
            self._table = (_Projection * (num_layers * len(PROJECTIONS)))()
            for (layer, name), p in projections.items():
                entry = self._table[table_index(layer, name)]
                entry.a, entry.rank, entry.num_pieces, entry.pieces = p.a.data_ptr(), p.rank, len(p.pieces), \
                    pieces[(layer, name)]

    def get(self, layer: int, projection: str) -> LoRAProjection | None:
        return self.projections.get((layer, projection))

    @property
    def table(self) -> ctypes.Array:
        """The C kernels' table (packed adapters only: on CPU, not in training)."""
        if self._table is None:
            raise ValueError("the C kernels read packed adapters: in CPU memory and not in training")
        return self._table


@dataclass
class LoRABatch:
    """The adapters of one step's rows: `adapters[a]`'s rows are rows[starts[a]:starts[a + 1]]
    (indices into the step's flat token batch), its update times scales[a]; rows of the base model
    are in no segment. An adapter two requests scale differently has a segment per scale."""

    adapters: list[AdapterWeights]
    scales: list[float]
    rows: torch.Tensor  # int64, grouped by adapter
    starts: list[int]  # [len(adapters) + 1]
    _struct: _Batch | None = None
    _keep: tuple = ()

    @classmethod
    def of(cls, row_adapters: list[tuple[AdapterWeights, float] | None], device: torch.device) -> LoRABatch | None:
        """The batch for one (adapter, scale) or None per row; None when no row has an adapter."""
        members: dict[tuple[int, float], tuple[AdapterWeights, list[int]]] = {}
        for row, use in enumerate(row_adapters):
            if use is not None:
                members.setdefault((id(use[0]), use[1]), (use[0], []))[1].append(row)
        if not members:
            return None
        starts = [0]
        for _, segment in members.values():
            starts.append(starts[-1] + len(segment))
        rows = torch.tensor([r for _, segment in members.values() for r in segment], dtype=torch.long, device=device)
        return cls([adapter for adapter, _ in members.values()], [scale for _, scale in members], rows, starts)

    @property
    def dtype(self) -> torch.dtype:
        return self.adapters[0].dtype

    @property
    def max_rank(self) -> int:
        return max(a.max_rank for a in self.adapters)

    @cached_property
    def packed(self) -> bool:
        """Every adapter laid out for the C kernels (AdapterWeights.packed); asked at every call."""
        return all(a.packed for a in self.adapters)

    def segments(self):
        """(adapter, scale, its rows) for each segment of the step."""
        for i, adapter in enumerate(self.adapters):
            yield adapter, self.scales[i], self.rows[self.starts[i]:self.starts[i + 1]]

    def struct(self) -> _Batch:
        """struct lora_batch for the C kernels, built once per step."""
        if self._struct is None:
            if self.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"the C kernels read float32 or bfloat16 adapters, not {self.dtype}")
            starts = torch.tensor(self.starts, dtype=torch.long)
            scales = torch.tensor(self.scales, dtype=torch.float32)
            tables = (ctypes.POINTER(_Projection) * len(self.adapters))(
                *(ctypes.cast(a.table, ctypes.POINTER(_Projection)) for a in self.adapters))
            self._keep = (starts, scales, tables)
            self._struct = _Batch(len(self.adapters), self.max_rank, self.dtype == torch.bfloat16, self.rows.data_ptr(),
                                  starts.data_ptr(), scales.data_ptr(), tables)
        return self._struct


class LoRAUpdate(NamedTuple):
    """What one projection of one layer adds for a step's adapters (a linear layer's `lora`):
    `kernels.lora_add(y, x, *update)` adds it."""

    batch: LoRABatch
    layer: int
    projection: str

    @property
    def index(self) -> int:
        return table_index(self.layer, self.projection)


def _packed(projections: dict[tuple[int, str], LoRAProjection]) -> dict[tuple[int, str], LoRAProjection]:
    """The same updates for the C kernels: every matrix copied into one huge-page mapping in the
    order a step reads them (layer by layer, projection by projection, A before its pieces' B^T),
    B^T in the kernels' tiles. 16 adapters' hundreds of small matrices were hundreds of separate
    4 KiB-page streams (kernels/memory.py)."""
    order = sorted(projections, key=lambda key: (key[0], PROJECTIONS.index(key[1])))
    flat = [t for key in order for t in (projections[key].a, *(tiled(piece.bt) for piece in projections[key].pieces))]
    copies = iter(huge_page_copies(flat))
    return {key: LoRAProjection(next(copies), tuple(replace(piece, bt=next(copies), shape=(piece.rank, piece.rows))
                                                    for piece in projections[key].pieces))
            for key in order}


def _group(dtype: torch.dtype) -> int:
    """Ranks a tile interleaves: bfloat16 pairs, one 32-bit word per output that the expand widens to
    two floats by a shift and a mask (lora.h)."""
    return 2 if dtype == torch.bfloat16 else 1


def tiled(bt: torch.Tensor) -> torch.Tensor:
    """B^T [rank, rows] in lora.h's tiles, flat: COLUMNS outputs a tile (the last fewer), its ranks
    in groups (an odd last rank paired with zeros), group after group, each output-major."""
    rank, rows = bt.shape
    group = _group(bt.dtype)
    grouped = torch.zeros(-(-rank // group) * group, rows, dtype=bt.dtype)
    grouped[:rank] = bt
    grouped = grouped.view(-1, group, rows)
    return torch.cat([grouped[:, :, lo:lo + COLUMNS].transpose(1, 2).reshape(-1) for lo in range(0, rows, COLUMNS)])


def untiled(tiles: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """`tiled`'s inverse: B^T, [rank, rows]."""
    group = _group(tiles.dtype)
    groups, parts, at = -(-rank // group), [], 0
    for lo in range(0, rows, COLUMNS):
        width = min(COLUMNS, rows - lo)
        parts.append(tiles[at:at + groups * width * group].view(groups, width, group).transpose(1, 2)
                     .reshape(groups * group, width))
        at += groups * width * group
    return torch.cat(parts, dim=1)[:rank]


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch, layer: int, projection: str) -> None:
    """y[rows] += B (A x[rows]) for each adapter's rows, in float32 (the reference of the kernels)."""
    for adapter, scale, rows in lora.segments():
        update = adapter.get(layer, projection)
        if update is None:
            continue
        t = (x[rows].float() @ update.a.float().t()) * scale
        for piece in update.pieces:
            cols = slice(piece.first_row, piece.first_row + piece.rows)
            delta = t[:, piece.first_rank:piece.first_rank + piece.rank] @ piece.matrix().float()
            y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)
