"""Tensor-, data-, pipeline- and expert-parallel process groups, built once from the sizes.

Rank order is Megatron-core's default (``order="tp-cp-ep-dp-pp"`` with cp=1): tensor-parallel
ranks are adjacent (fastest), then data-parallel, then pipeline (slowest), so global rank
``r = tp_rank + tp * (dp_rank + dp * pp_rank)``. The dense layers see the world as the grid
``[pp, dp, tp]`` (row-major, tp last). Expert layers see the same world as
``[pp, expert_dp, ep, tp]``: the data-parallel axis is split into ``ep`` (fast) x ``expert_dp``
(slow), exactly as Megatron's second ``RankGenerator`` (expert tp = tp, cp = 1,
``expert_dp = world / (tp * ep * pp)``).

Both grids are torch ``DeviceMesh`` objects (one process group per mesh dimension); the
:class:`ParallelGroups` object is passed explicitly to whoever needs a group — nothing here
is global. :func:`rank_grid` computes the same tables without any process, for checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

# (axis name, dimension names of the mesh it lives in): dense axes first, then expert axes.
_DENSE_DIMS = ("pp", "dp", "tp")
_EXPERT_DIMS = ("pp", "expert_dp", "ep", "tp")


def check_sizes(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, dp: Optional[int] = None) -> int:
    """Validate the parallel sizes against ``world_size``; return the data-parallel size.

    Raises ``ValueError`` naming every size involved and what to change.
    """
    for name, value in (
        ("world size", world_size),
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp} = {tp * pp}; launch a multiple of {tp * pp} "
            f"processes or choose sizes whose product divides {world_size}"
        )
    expected_dp = world_size // (tp * pp)
    if dp is not None and dp != expected_dp:
        raise ValueError(
            f"data_parallel_size {dp} != world size {world_size} / (tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp}) = {expected_dp}; pass data_parallel_size {expected_dp} "
            f"or leave it unset"
        )
    if expected_dp % ep != 0:
        raise ValueError(
            f"expert_model_parallel_size {ep} does not divide the data-parallel size {expected_dp} "
            f"(world size {world_size} / (tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp})); expert groups are carved out of the data-parallel "
            f"ranks, so choose expert_model_parallel_size dividing {expected_dp}"
        )
    return expected_dp


def _groups_along(grid: torch.Tensor, dim: int) -> List[List[int]]:
    """Every 1-D slice of ``grid`` along ``dim``, in row-major order of the other dims."""
    moved = grid.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


def rank_grid(
    world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, dp: Optional[int] = None
) -> Dict[str, List[List[int]]]:
    """All groups of every axis (``tp``, ``dp``, ``pp``, ``ep``, ``expert_dp``) as rank lists.

    Pure: no process group is created. Group lists come in Megatron's enumeration order.
    """
    dp = check_sizes(world_size, tp, pp, ep, dp)
    dense = torch.arange(world_size).reshape(pp, dp, tp)
    expert = torch.arange(world_size).reshape(pp, dp // ep, ep, tp)
    out = {name: _groups_along(dense, i) for i, name in enumerate(_DENSE_DIMS)}
    for i, name in enumerate(_EXPERT_DIMS):
        if name in ("ep", "expert_dp"):
            out[name] = _groups_along(expert, i)
    return out


@dataclass(frozen=True)
class Axis:
    """One parallel axis as this rank sees it.

    ``group`` is None only in :meth:`ParallelGroups.single` (one process, nothing to talk to);
    ``ranks`` are the global ranks of this rank's group, in axis order.
    """

    size: int
    rank: int
    ranks: Tuple[int, ...]
    group: Optional[dist.ProcessGroup]


_SINGLE_AXIS = Axis(size=1, rank=0, ranks=(0,), group=None)


@dataclass(frozen=True)
class ParallelGroups:
    """The parallel layout of one run: sizes, this rank's coordinates and its process groups.

    Build it once with :meth:`build` (after ``init_process_group``) or :meth:`single` for one
    process, and pass it to the layers and wrappers that need a group.
    """

    world_size: int
    rank: int
    tp: Axis
    dp: Axis
    pp: Axis
    ep: Axis
    expert_dp: Axis
    mesh: Optional[object] = None  # DeviceMesh [pp, dp, tp]
    expert_mesh: Optional[object] = None  # DeviceMesh [pp, expert_dp, ep, tp]

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process: every size 1, no groups (the plain model)."""
        a = _SINGLE_AXIS
        return cls(world_size=1, rank=0, tp=a, dp=a, pp=a, ep=a, expert_dp=a)

    @classmethod
    def build(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        dp: Optional[int] = None,
        device_type: str = "cpu",
    ) -> ParallelGroups:
        """Create the meshes over the initialised default process group (a collective call:
        every rank must call it with the same sizes)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelGroups.build needs torch.distributed initialised (init_process_group); "
                "use ParallelGroups.single() for one process"
            )
        from torch.distributed.device_mesh import DeviceMesh

        world, rank = dist.get_world_size(), dist.get_rank()
        dp = check_sizes(world, tp, pp, ep, dp)
        dense = torch.arange(world).reshape(pp, dp, tp)
        expert = torch.arange(world).reshape(pp, dp // ep, ep, tp)
        mesh = DeviceMesh(device_type, dense, mesh_dim_names=_DENSE_DIMS)
        expert_mesh = DeviceMesh(device_type, expert, mesh_dim_names=_EXPERT_DIMS)
        axes = {n: _axis(mesh, dense, n, i, rank) for i, n in enumerate(_DENSE_DIMS)}
        for i, n in enumerate(_EXPERT_DIMS):
            if n in ("ep", "expert_dp"):
                axes[n] = _axis(expert_mesh, expert, n, i, rank)
        return cls(world_size=world, rank=rank, mesh=mesh, expert_mesh=expert_mesh, **axes)

    def describe(self) -> str:
        """The layout as the progress line shows it, e.g. ``tp2 x dp2 x pp2``."""
        parts = [f"tp{self.tp.size}", f"dp{self.dp.size}"]
        if self.pp.size > 1:
            parts.append(f"pp{self.pp.size}")
        if self.ep.size > 1:
            parts.append(f"ep{self.ep.size}")
        return " x ".join(parts)


def _axis(mesh, grid: torch.Tensor, name: str, dim: int, rank: int) -> Axis:
    coord = [int(c) for c in (grid == rank).nonzero()[0]]
    index = [slice(None) if d == dim else c for d, c in enumerate(coord)]
    ranks = tuple(int(r) for r in grid[tuple(index)].tolist())
    return Axis(size=grid.shape[dim], rank=coord[dim], ranks=ranks, group=mesh.get_group(name))
