"""Format 4's tensors: every rank hands DCP only the rectangles of a global tensor it holds.

A :class:`ShardView` is the GLOBAL shape and dtype of one checkpoint entry (``model/<fqn>``,
``optimizer/state/<fqn>/<name>``: the full logical tensor, exactly as format 3 stored it) and
a list of pieces: each a VIEW into this rank's storage with its offsets in the global tensor.
It implements the hooks torch.distributed.checkpoint calls on DTensors
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, ``size()``),
so DCP writes only the local bytes at save, reads only them at load, and maps any stored
chunking (format 3's one full chunk per key included) onto any requested one: resharding
across tp / ep / pp / dp / FSDP2 needs no gather and no cut by hand.

The builders turn the one description of how a parameter is cut
(:class:`~megadlms.parallel.sharding.ParamSharding`) into pieces:

* tensor parallelism: rank r's local [tp_blocks * n, ...] shard is ``tp_blocks`` boxes of the
  global tensor, rows [k*tp*n + r*n, +n) for block k -- SwiGLU's interleaved [gate; up]
  (2 blocks) needs no [2, F, H] reshape, the files keep format 3's keys and shapes;
* expert parallelism: EP rank e's experts are one box at row e * E_local of dim 0;
* FSDP2: a DTensor's local piece is a box of its global tensor (torch's
  ``compute_local_shape_and_global_offset``; uneven shards included), and under FSDP2 x TP
  that global tensor is the TP shard, composed with the TP boxes;
* the distributed optimizer: a flat range [start, stop) of the TP-local tensor flattened
  row-major is at most 2 * ndim - 1 row-aligned boxes, composed with the TP boxes;
* anything replicated: one full box (DCP deduplicates replicas and spreads the writes).

0-d tensors (Adam's step) stay plain tensors. :meth:`ShardView.fill_from_full` is the same
description used the other way round: the legacy ``--ckpt-format torch`` (full tensors) fills
views from its full tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megadlms.common.dtensor import is_dtensor
from megadlms.parallel.sharding import ParamSharding

Piece = Tuple[torch.Tensor, Tuple[int, ...]]
"""A view into local storage and its offsets in the global tensor."""


class ShardView:
    """The pieces of one global tensor this rank holds (see the module docstring).

    Args:
        shape: the global (full logical) shape.
        dtype: the dtype stored / read.
        pieces: ``(view, global offsets)``; zero-size pieces are dropped.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, pieces: Sequence[Piece]) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces: List[Piece] = [(t, tuple(off)) for t, off in pieces if t.numel() > 0]
        self._staged = False  # True: the pieces are this view's own CPU copies (staged())
        if self.shape.numel() == 0 and pieces:
            # An empty tensor still needs one (empty) chunk, or its key would vanish from the files.
            self.pieces = [(pieces[0][0], (0,) * len(self.shape))]
        for t, off in self.pieces:
            if len(off) != len(self.shape) or any(o + s > g for o, s, g in zip(off, t.shape, self.shape)):
                raise ValueError(f"ShardView: piece {tuple(t.shape)} at {off} outside {tuple(self.shape)}")

    def size(self) -> torch.Size:
        """The global shape (DCP's load planner compares it with the stored one)."""
        return self.shape

    def __repr__(self) -> str:
        boxes = [(off, tuple(t.shape)) for t, off in self.pieces]
        return f"ShardView({tuple(self.shape)}, {self.dtype}, {boxes})"

    # ------------------------------------------------------------------ DCP's hooks
    def __create_write_items__(self, fqn: str, obj: object) -> List[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()),
                    properties=props,
                    size=self.shape,
                ),
            )
            for t, off in self.pieces
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()) for t, off in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for t, off in self.pieces:
            if torch.Size(off) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no local piece at offset {index.offset} in {self!r}")

    # ------------------------------------------------------------------ other uses
    def fill_from_full(self, full: torch.Tensor) -> None:
        """Copy this rank's pieces out of the full tensor (the legacy torch format's load)."""
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"full tensor of shape {tuple(full.shape)}, expected {tuple(self.shape)}")
        with torch.no_grad():
            for t, off in self.pieces:
                t.copy_(full[tuple(slice(o, o + s) for o, s in zip(off, t.shape))])

    def staged(self) -> ShardView:
        """A copy on the CPU with its own (minimal) storage: what an async save writes while
        training goes on. Deep copies (DCP's stagers) of a staged view are the view itself."""
        pieces = [(t.detach().to("cpu", copy=True), o) for t, o in self.pieces]
        view = ShardView(self.shape, self.dtype, pieces)
        view._staged = True
        return view

    def __deepcopy__(self, memo) -> ShardView:
        # DCP's async stagers deep-copy leaves they do not know: copy the pieces, not their storages.
        return self if self._staged else self.staged()


# ---------------------------------------------------------------------------- planners
class ViewSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, looking pieces up in :class:`ShardView` values."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ShardView):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class ViewLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, looking pieces up in :class:`ShardView` values (of a flat
    state dict)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's meta-tensor initialisation maps objects it does not know to None (in place): put
        # the views back afterwards (flat keys: the flattened keys are the same).
        views = {k: v for k, v in state_dict.items() if isinstance(v, ShardView)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(views)
        self.state_dict.update(views)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, ShardView):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


# ---------------------------------------------------------------------------- the cut
@dataclasses.dataclass(frozen=True)
class Cut:
    """How a local tensor sits in its global one along ``dim``: segments of
    ``(local start, length, global start)``; ``dim`` None: the local tensor is the global one."""

    dim: Optional[int] = None
    segments: Tuple[Tuple[int, int, int], ...] = ()
    factor: int = 1  # global length / local length along dim

    def global_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.factor
        return tuple(shape)


NO_CUT = Cut()


def tp_cut(dim: int, local_len: int, blocks: int, rank: int, tp: int) -> Cut:
    """Rank ``rank`` of ``tp`` holds chunk ``rank`` of each of ``blocks`` blocks along ``dim``
    (``sharding.shard_full``'s rule), concatenated in block order."""
    if local_len % blocks:
        raise ValueError(f"dim {dim} of length {local_len} is not {blocks} equal blocks")
    n = local_len // blocks
    return Cut(dim, tuple((k * n, n, k * n * tp + rank * n) for k in range(blocks)), tp)


def ep_cut(dim: int, local_len: int, rank: int, ep: int) -> Cut:
    """EP rank ``rank`` of ``ep`` holds experts [rank * E_local, (rank + 1) * E_local) along ``dim``."""
    return Cut(dim, ((0, local_len, rank * local_len),), ep)


def sharding_cut(
    sharding: ParamSharding, local_shape: Sequence[int], tp: Tuple[int, int], ep: Tuple[int, int]
) -> Cut:
    """The :class:`Cut` of a parameter (or its optimizer state) of TP-local shape ``local_shape``
    under ``sharding`` at ``tp`` = (rank, size) and ``ep`` = (rank, size)."""
    if sharding.tp_dim is not None and tp[1] > 1 and len(local_shape) > 0:
        return tp_cut(sharding.tp_dim, local_shape[sharding.tp_dim], sharding.tp_blocks, *tp)
    if sharding.expert_dim is not None and ep[1] > 1 and len(local_shape) > 0:
        return ep_cut(sharding.expert_dim, local_shape[sharding.expert_dim], *ep)
    return NO_CUT


def place(box: torch.Tensor, offsets: Sequence[int], cut: Cut) -> List[Piece]:
    """The global pieces of ``box`` (a view at ``offsets`` of the local tensor): split where it
    crosses the cut's segments, each moved to its global offset."""
    if cut.dim is None:
        return [(box, tuple(offsets))]
    d, lo = cut.dim, offsets[cut.dim]
    hi = lo + box.shape[d]
    out: List[Piece] = []
    for start, length, gstart in cut.segments:
        a, b = max(lo, start), min(hi, start + length)
        if a < b:
            off = list(offsets)
            off[d] = gstart + (a - start)
            out.append((box.narrow(d, a - lo, b - a), tuple(off)))
    return out


# ---------------------------------------------------------------------------- builders
def dtensor_box(t: Any) -> Piece:
    """A DTensor's local tensor and its offsets in the DTensor's global tensor (FSDP2's cut,
    uneven and padded shards included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(sizes) != tuple(local.shape):  # padded local storage: the real rows only
        local = local[tuple(slice(0, s) for s in sizes)]
    return local, tuple(offsets)


def local_view(t: torch.Tensor, cut: Cut = NO_CUT, dtype: Optional[torch.dtype] = None) -> ShardView:
    """A tensor this rank holds (plain, or an FSDP2 DTensor whose global tensor is the
    TP-local one) as its pieces of the global tensor under ``cut``."""
    box, offsets = dtensor_box(t) if is_dtensor(t) else (t, (0,) * t.dim())
    return ShardView(cut.global_shape(t.shape), dtype or t.dtype, place(box.detach(), offsets, cut))


Box = Tuple[int, int, Tuple[int, ...], Tuple[int, ...]]
"""``(flat start, flat stop, offsets, sizes)`` of a row-aligned box."""


def flat_boxes(start: int, stop: int, shape: Sequence[int]) -> List[Box]:
    """``[start, stop)`` of a tensor of ``shape`` flattened row-major as row-aligned boxes:
    ``(flat start, flat stop, offsets, sizes)``, at most ``2 * len(shape) - 1`` of them."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(start, stop, (start,) if shape else (), (stop - start,) if shape else ())]
    row = 1
    for s in shape[1:]:
        row *= s
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(stop, row)

    def within(r: int, a: int, b: int):
        # boxes of row r's [a, b), with dim 0 fixed at r
        inner = flat_boxes(a, b, shape[1:])
        return [(r * row + fa, r * row + fb, (r,) + o, (1,) + s) for fa, fb, o, s in inner]

    if r0 == r1:
        return within(r0, c0, c1)
    out: List[Box] = []
    if c0:
        out += within(r0, c0, row)
        r0 += 1
    if r0 < r1:
        out.append((r0 * row, r1 * row, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += within(r1, 0, c1)
    return out


def flat_view(
    flat: torch.Tensor, start: int, stop: int, local_shape: Sequence[int], cut: Cut = NO_CUT
) -> ShardView:
    """Elements [start, stop) of a TP-local tensor of ``local_shape`` flattened row-major, held
    as the 1-D ``flat`` (the distributed optimizer's piece), as pieces of the global tensor."""
    if flat.numel() != stop - start:
        raise ValueError(f"flat piece of {flat.numel()} elements for range [{start}, {stop})")
    pieces: List[Piece] = []
    for a, b, off, sizes in flat_boxes(start, stop, local_shape):
        pieces += place(flat[a - start : b - start].view(sizes), off, cut)
    return ShardView(cut.global_shape(local_shape), flat.dtype, pieces)
