"""Tensor-, data-, pipeline- and expert-parallel process groups, built once from the sizes.

Rank order is Megatron-core's default (``order="tp-cp-ep-dp-pp"`` with cp=1): tensor-parallel
ranks are adjacent (fastest), then data-parallel, then pipeline (slowest), so global rank
``r = tp_rank + tp * (dp_rank + dp * pp_rank)``. The dense layers see the world as the grid
``[pp, dp, tp]`` (row-major, tp last). Expert layers see the same world as
``[pp, expert_dp, ep, tp]``: the data-parallel axis is split into ``ep`` (fast) x ``expert_dp``
(slow), exactly as Megatron's second ``RankGenerator`` (expert tp = tp, cp = 1,
``expert_dp = world / (tp * ep * pp)``).

Context parallelism (``cp`` > 1, :func:`context_parallel_grid`): the cp axis sits between tp
and dp (``r = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``), the dense grid is
``[pp, dp, cp, tp]``, and two more axes exist: ``cp`` and ``dp_cp`` (dp x cp, over which the
replicated parameters' gradients are reduced: :meth:`ParallelGroups.for_gradients`). Expert
parallelism is 1 there. With cp = 1 every table and mesh is exactly the one described above.

Both grids are torch ``DeviceMesh`` objects (one process group per mesh dimension). Three
more axes are cut out of the dense grid with plain ``new_group`` calls, once, in
:meth:`ParallelGroups.build`:

* ``mp`` (model parallel): the ranks sharing this rank's dp coordinate, i.e. the tp x pp
  block, tp fastest (Megatron's ``get_model_parallel_group``). The optimizer sums the squared
  grad norm over it.
* ``dp_intra`` / ``dp_inter`` (distributed-optimizer instances, Megatron's
  ``num_distributed_optimizer_instances`` N): the dp group split into N instances of dp/N
  CONSECUTIVE dp ranks (e.g. one node each); ``dp_inter`` joins the ranks with the same
  position inside their instance. With N = 1, ``dp_intra`` is ``dp`` and ``dp_inter`` has
  size 1 and no group.

The :class:`ParallelGroups` object is passed explicitly to whoever needs a group — nothing
here is global. :func:`rank_grid` and :func:`derived_rank_grid` compute the same tables
without any process, for checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

# (axis name, dimension names of the mesh it lives in): dense axes first, then expert axes.
_DENSE_DIMS = ("pp", "dp", "tp")
_EXPERT_DIMS = ("pp", "expert_dp", "ep", "tp")
_DENSE_CP_DIMS = ("pp", "dp", "cp", "tp")  # with context parallelism (cp > 1)


def check_sizes(
    world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, dp: Optional[int] = None, cp: int = 1
) -> int:
    """Validate the parallel sizes against ``world_size``; return the data-parallel size
    (world / (tp x cp x pp)).

    Raises ``ValueError`` naming every size involved and what to change.
    """
    if cp != 1:
        return _check_sizes_cp(world_size, tp, pp, ep, dp, cp)
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


def _check_sizes_cp(world_size: int, tp: int, pp: int, ep: int, dp: Optional[int], cp: int) -> int:
    """check_sizes with context parallelism: the dp axis is world / (tp x cp x pp)."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context_parallel_size must be a positive integer, got {cp!r}")
    if ep != 1:
        raise ValueError(
            f"expert_model_parallel_size {ep} with context_parallel_size {cp}: expert parallelism is not "
            "supported with context parallelism; set one of them to 1"
        )
    model = tp * cp * pp
    if world_size % model != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"context_parallel_size {cp} x pipeline_model_parallel_size {pp} = {model}; launch a "
            f"multiple of {model} processes"
        )
    expected_dp = check_sizes(world_size // cp, tp, pp, 1, dp)
    return expected_dp


def check_instances(dp: int, num_distributed_optimizer_instances: int) -> int:
    """Validate the number of distributed-optimizer instances against the data-parallel size;
    return the size of one instance (dp / N). Raises ``ValueError`` naming both."""
    n = num_distributed_optimizer_instances
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_distributed_optimizer_instances must be a positive integer, got {n!r}")
    if dp % n != 0:
        raise ValueError(
            f"num_distributed_optimizer_instances {n} does not divide the data-parallel size {dp}: "
            f"each instance holds dp / N consecutive data-parallel ranks; choose a divisor of {dp}"
        )
    return dp // n


def _groups_along(grid: torch.Tensor, dim: int) -> List[List[int]]:
    """Every 1-D slice of ``grid`` along ``dim``, in row-major order of the other dims."""
    moved = grid.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


def rank_grid(
    world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, dp: Optional[int] = None, cp: int = 1
) -> Dict[str, List[List[int]]]:
    """All groups of every axis (``tp``, ``dp``, ``pp``, ``ep``, ``expert_dp``) as rank lists;
    with ``cp`` > 1 also ``cp`` and ``dp_cp`` (:func:`context_parallel_grid`).

    Pure: no process group is created. Group lists come in Megatron's enumeration order.
    """
    if cp != 1:
        return context_parallel_grid(world_size, tp, pp, dp, cp)
    dp = check_sizes(world_size, tp, pp, ep, dp)
    dense = torch.arange(world_size).reshape(pp, dp, tp)
    # ep varies faster than expert_dp inside the dp axis, so EP peers are neighbouring dp ranks (the
    # all-to-all stays as local as the dense dp layout allows), as Megatron's expert RankGenerator.
    expert = torch.arange(world_size).reshape(pp, dp // ep, ep, tp)
    out = {name: _groups_along(dense, i) for i, name in enumerate(_DENSE_DIMS)}
    for i, name in enumerate(_EXPERT_DIMS):
        if name in ("ep", "expert_dp"):
            out[name] = _groups_along(expert, i)
    return out


def context_parallel_grid(
    world_size: int, tp: int = 1, pp: int = 1, dp: Optional[int] = None, cp: int = 2
) -> Dict[str, List[List[int]]]:
    """The groups of a context-parallel layout: Megatron's order tp-cp-dp-pp, so global rank
    ``r = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`` and the dense grid is
    ``[pp, dp, cp, tp]``. ``dp_cp``: the ranks sharing (pp, tp) coordinates, over which
    gradients are reduced and the distributed optimizer shards (parameters are replicated over
    cp). ``mp``: the tp x pp block of one (dp, cp) coordinate. Expert axes: ep 1, expert_dp = dp_cp."""
    dp = check_sizes(world_size, tp, pp, 1, dp, cp)
    dense = torch.arange(world_size).reshape(pp, dp, cp, tp)
    out = {name: _groups_along(dense, i) for i, name in enumerate(_DENSE_CP_DIMS)}
    out["ep"] = [[r] for r in range(world_size)]
    # dp and cp merged: [pp, dp*cp, tp], cp fastest inside the merged axis (ascending ranks)
    out["dp_cp"] = _groups_along(dense.reshape(pp, dp * cp, tp), 1)
    out["expert_dp"] = out["dp_cp"]
    out["mp"] = dense.permute(1, 2, 0, 3).reshape(dp * cp, pp * tp).tolist()
    return {k: out[k] for k in ("tp", "cp", "dp", "pp", "ep", "expert_dp", "dp_cp", "mp")}


def derived_rank_grid(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: Optional[int] = None,
    *,
    num_distributed_optimizer_instances: int = 1,
) -> Dict[str, List[List[int]]]:
    """The groups of the axes cut out of the dense grid: ``mp`` (tp x pp ranks sharing a dp
    coordinate, tp fastest), ``dp_intra`` and ``dp_inter`` (distributed-optimizer instances).

    Pure, like :func:`rank_grid`. With one instance ``dp_intra`` equals ``dp`` and every
    ``dp_inter`` group is a single rank.
    """
    dp = check_sizes(world_size, tp, pp, ep, dp)
    intra = check_instances(dp, num_distributed_optimizer_instances)
    dense = torch.arange(world_size).reshape(pp, dp, tp)
    # [dp, pp * tp]: row d lists the model-parallel block of dp coordinate d (tp fastest).
    mp = dense.permute(1, 0, 2).reshape(dp, pp * tp).tolist()
    dp_groups = _groups_along(dense, 1)
    return {
        "mp": mp,
        # Consecutive dp ranks per instance, so each instance's reduce-scatter can stay inside a node.
        "dp_intra": [g[i : i + intra] for g in dp_groups for i in range(0, dp, intra)],
        "dp_inter": [g[j::intra] for g in dp_groups for j in range(intra)],
    }


@dataclass(frozen=True)
class Axis:
    """One parallel axis as this rank sees it.

    ``group`` is None in :meth:`ParallelGroups.single` (one process, nothing to talk to) and
    for ``dp_inter`` with one distributed-optimizer instance (size 1, no group built);
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
    mp: Optional[Axis] = None  # tp x pp ranks sharing the dp coordinate (None: tp, if pp == 1)
    # The four below are never None after __post_init__ (None given: derived there).
    dp_intra: Axis = None  # type: ignore[assignment]  # this rank's distributed-optimizer instance (None: dp)
    dp_inter: Axis = None  # type: ignore[assignment]  # same intra rank across instances (None: size 1)
    cp: Axis = None  # type: ignore[assignment]  # context-parallel ranks of its (pp, dp, tp) (None: size 1)
    dp_cp: Axis = None  # type: ignore[assignment]  # dp x cp: where gradients are reduced (None: dp)

    def __post_init__(self) -> None:
        # Fill the derived axes of a hand-built object (build() and single() pass them).
        if self.cp is None:
            object.__setattr__(self, "cp", Axis(size=1, rank=0, ranks=(self.rank,), group=None))
        if self.dp_cp is None:
            object.__setattr__(self, "dp_cp", self.dp)
        if self.mp is None and self.pp.size == 1:
            object.__setattr__(self, "mp", self.tp)
        if self.dp_intra is None:
            object.__setattr__(self, "dp_intra", self.dp)
        if self.dp_inter is None:
            object.__setattr__(self, "dp_inter", Axis(size=1, rank=0, ranks=(self.rank,), group=None))

    @property
    def num_distributed_optimizer_instances(self) -> int:
        """N: the dp group is split into N instances of ``dp_intra.size`` ranks."""
        return self.dp.size // self.dp_intra.size

    def for_gradients(self) -> ParallelGroups:
        """The layout as the data-parallel wrappers, the optimizer, the norms and the
        checkpoint see it: with context parallelism the parameters are replicated over dp x cp,
        so ``dp`` (and the one distributed-optimizer instance) is ``dp_cp``, as Megatron's
        ``get_data_parallel_group(with_context_parallel=True)``. Itself without cp."""
        if self.cp.size == 1:
            return self
        one = Axis(size=1, rank=0, ranks=(self.rank,), group=None)
        dp_cp = self.dp_cp
        return dataclasses.replace(self, dp=dp_cp, dp_intra=dp_cp, dp_inter=one, expert_dp=dp_cp)

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process: every size 1, no groups (the plain model)."""
        a = _SINGLE_AXIS
        return cls(world_size=1, rank=0, tp=a, dp=a, pp=a, ep=a, expert_dp=a, mp=a, dp_intra=a, dp_inter=a)

    @classmethod
    def build(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        dp: Optional[int] = None,
        device_type: str = "cpu",
        num_distributed_optimizer_instances: int = 1,
        cp: int = 1,
    ) -> ParallelGroups:
        """Create the meshes over the initialised default process group (a collective call:
        every rank must call it with the same sizes), then the ``mp`` groups and, with
        ``num_distributed_optimizer_instances`` > 1, the ``dp_intra`` / ``dp_inter`` groups."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelGroups.build needs torch.distributed initialised (init_process_group); "
                "use ParallelGroups.single() for one process"
            )
        from torch.distributed.device_mesh import DeviceMesh

        world, rank = dist.get_world_size(), dist.get_rank()
        if cp != 1:
            instances = num_distributed_optimizer_instances
            return cls._build_cp(world, rank, tp, pp, dp, cp, device_type, instances)
        dp = check_sizes(world, tp, pp, ep, dp)
        check_instances(dp, num_distributed_optimizer_instances)  # before any collective
        dense = torch.arange(world).reshape(pp, dp, tp)
        expert = torch.arange(world).reshape(pp, dp // ep, ep, tp)
        # Creating a mesh is collective; every rank builds both meshes, in this order, before any new_group.
        mesh = DeviceMesh(device_type, dense, mesh_dim_names=_DENSE_DIMS)
        expert_mesh = DeviceMesh(device_type, expert, mesh_dim_names=_EXPERT_DIMS)
        axes = {n: _axis(mesh, dense, n, i, rank) for i, n in enumerate(_DENSE_DIMS)}
        for i, n in enumerate(_EXPERT_DIMS):
            if n in ("ep", "expert_dp"):
                axes[n] = _axis(expert_mesh, expert, n, i, rank)
        derived = derived_rank_grid(
            world, tp, pp, ep, dp, num_distributed_optimizer_instances=num_distributed_optimizer_instances
        )
        axes["mp"] = _new_groups_axis(derived["mp"], rank)
        if num_distributed_optimizer_instances > 1:
            axes["dp_intra"] = _new_groups_axis(derived["dp_intra"], rank)
            axes["dp_inter"] = _new_groups_axis(derived["dp_inter"], rank)
        return cls(world_size=world, rank=rank, mesh=mesh, expert_mesh=expert_mesh, **axes)

    @classmethod
    def _build_cp(cls, world, rank, tp, pp, dp, cp, device_type, instances) -> ParallelGroups:
        """build() with context parallelism: the dense mesh is [pp, dp, cp, tp]; dp_cp and mp
        are cut out with new_group (the same calls, in the same order, on every rank)."""
        from torch.distributed.device_mesh import DeviceMesh

        from .context_parallel import context_parallel_problems

        for problem in context_parallel_problems(cp, num_distributed_optimizer_instances=instances):
            raise ValueError(problem)
        dp = check_sizes(world, tp, pp, 1, dp, cp)
        dense = torch.arange(world).reshape(pp, dp, cp, tp)
        mesh = DeviceMesh(device_type, dense, mesh_dim_names=_DENSE_CP_DIMS)
        axes = {n: _axis(mesh, dense, n, i, rank) for i, n in enumerate(_DENSE_CP_DIMS)}
        table = context_parallel_grid(world, tp, pp, dp, cp)
        axes["dp_cp"] = _new_groups_axis(table["dp_cp"], rank)
        axes["mp"] = _new_groups_axis(table["mp"], rank)
        axes["ep"] = Axis(size=1, rank=0, ranks=(rank,), group=None)
        axes["expert_dp"] = axes["dp_cp"]
        return cls(world_size=world, rank=rank, mesh=mesh, **axes)

    def describe(self) -> str:
        """The layout as the progress line shows it, e.g. ``tp2 x dp2``, ``pp2 x tp2 x dp2``,
        ``tp1 x cp2 x dp2``."""
        parts = [f"tp{self.tp.size}", f"dp{self.dp.size}"]
        if self.cp.size > 1:
            parts.insert(1, f"cp{self.cp.size}")
        if self.pp.size > 1:
            parts.insert(0, f"pp{self.pp.size}")
        if self.ep.size > 1:
            parts.append(f"ep{self.ep.size}")
        return " x ".join(parts)


def _new_groups_axis(groups: List[List[int]], rank: int) -> Axis:
    """Create every group of ``groups`` (each rank must create all of them, in the same
    order: ``new_group`` is collective over the world) and return this rank's as an Axis."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            # Keep looping after finding ours: skipping a later new_group would hang the ranks that need it.
            mine = Axis(size=len(ranks), rank=ranks.index(rank), ranks=tuple(ranks), group=group)
    assert mine is not None, f"rank {rank} is in none of the groups {groups}"
    return mine


def _axis(mesh, grid: torch.Tensor, name: str, dim: int, rank: int) -> Axis:
    coord = [int(c) for c in (grid == rank).nonzero()[0]]
    index = [slice(None) if d == dim else c for d, c in enumerate(coord)]
    ranks = tuple(int(r) for r in grid[tuple(index)].tolist())
    return Axis(size=grid.shape[dim], rank=coord[dim], ranks=ranks, group=mesh.get_group(name))
