"""Where FSDP2 shards when other parallel axes exist: the device mesh of ``fully_shard`` and
the tensor-parallel fix-up of its reduced gradients.

Tensor parallelism keeps our own TP layers (``megadlms.parallel.layers``): every TP rank
holds its local shard of each split parameter as a plain tensor (described by its
``ParamSharding``), and FSDP2 shards that local tensor again, over the data-parallel
dimension only -- the ``dp`` dimension of the run's ``[pp, dp, tp]`` mesh, as torchtitan's
``fully_shard(mesh=world_mesh["dp"])``. A parameter's FSDP2 DTensor therefore has the
TP-local shape as its "global" shape, and ``ParamSharding`` stays the one description of
the TP split (checkpoints, norms and the optimizer read it as under DDP).

Hybrid sharding (HSDP) reuses Megatron's ``num_distributed_optimizer_instances`` N (Megatron-
FSDP's DP-outer size): the dp group is split into N instances of dp/N consecutive ranks
(``ParallelGroups.dp_intra``), FSDP2 shards within an instance and replicates across them
(``dp_inter``) on a 2-D mesh ``(dp_replicate, dp_shard)``: placements ``(Replicate(), Shard(0))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megadlms.common.dtensor import local_tensor
from megadlms.common.enums import CommBackend
from megadlms.parallel.groups import ParallelGroups
from megadlms.parallel.sharding import sharding_of

from .comm import build_communicator, sum_in_place

if TYPE_CHECKING:  # imported where used: older torch builds lack it (torch_supports_fsdp2)
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Fsdp2Grid:
    """The groups one FSDP2 wrapper uses.

    ``mesh``: what ``fully_shard`` shards over (1-D dp, or 2-D (dp_replicate, dp_shard)).
    ``dp_group``: every data-parallel rank (the average runs over it).
    ``shard_group``: the ranks one parameter is sharded over (dp_group without HSDP).
    ``tp_group``: the tensor-parallel group (None at tp 1).
    ``parallel``: the run's ``ParallelGroups`` when a second axis exists (None: plain dp).
    """

    mesh: DeviceMesh
    dp_group: dist.ProcessGroup
    shard_group: dist.ProcessGroup
    tp_group: Optional[dist.ProcessGroup] = None
    parallel: Optional[ParallelGroups] = None


def _uses_grid(parallel) -> bool:
    return parallel is not None and (parallel.tp.size > 1 or parallel.num_distributed_optimizer_instances > 1)


def fsdp2_grid(parallel, process_group, device_type: str, instances: int = 1) -> Fsdp2Grid:
    """The mesh and groups for FSDP2 over ``parallel`` (a ``ParallelGroups``), or over
    ``process_group`` alone (plain data parallelism, as before tensor parallelism existed).
    ``instances``: the config's ``num_distributed_optimizer_instances``, which must be the
    groups' (HSDP's replica groups are their instances)."""
    from torch.distributed.device_mesh import DeviceMesh

    built = parallel.num_distributed_optimizer_instances if parallel is not None else 1
    if instances != built:
        raise ValueError(
            f"FSDP2: num_distributed_optimizer_instances is {instances} in the config but {built} in "
            "parallel: pass parallel=ParallelGroups.build(..., num_distributed_optimizer_instances=N) "
            "with the config's N"
        )

    if not _uses_grid(parallel):
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # FSDP2 needs torch.distributed initialised (checked by the caller)
        # From the given group rather than init_device_mesh: a dp subgroup of a larger world works.
        return Fsdp2Grid(DeviceMesh.from_group(group, device_type), group, group)
    if process_group is not None and process_group is not parallel.dp.group:
        raise ValueError("TorchFullyShardedDataParallel: pass either process_group or parallel, not both")
    tp_group = parallel.tp.group if parallel.tp.size > 1 else None
    n = parallel.num_distributed_optimizer_instances
    if n == 1:
        # The dp dimension of the run's [pp, dp, tp] mesh: FSDP2 never communicates across TP ranks.
        return Fsdp2Grid(parallel.mesh["dp"], parallel.dp.group, parallel.dp.group, tp_group, parallel)
    # Row i = instance i (consecutive dp ranks, ParallelGroups.dp_intra); column j = dp_inter.
    ranks = torch.tensor(parallel.dp.ranks).reshape(n, parallel.dp.size // n)
    mesh = DeviceMesh.from_group(
        [parallel.dp_inter.group, parallel.dp_intra.group],
        device_type,
        mesh=ranks,
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )
    return Fsdp2Grid(mesh, parallel.dp.group, parallel.dp_intra.group, tp_group, parallel)


class TensorParallelGradSum:
    """Sums over TP the reduced gradient shards of parameters declared ``tp_partial_grad``
    (sequence-parallel norms, per-head norms): each TP rank's gradient covers only its part.

    FSDP2 reduced them over dp first; TP peers shard the same (TP-replicated) shape the same
    way over dp, so summing their local shards over TP gives the shard of the full sum."""

    def __init__(self, module: torch.nn.Module, tp_group) -> None:
        self.params = [p for p in module.parameters() if sharding_of(p).tp_partial_grad]
        self.comm = (
            build_communicator(CommBackend.TORCH, tp_group) if tp_group is not None and self.params else None
        )

    def __call__(self) -> None:
        if self.comm is None:
            return
        # Every TP peer has the same list: the same parameters got gradients (the same model on
        # every TP rank).
        grads = [p.grad for p in self.params if p.grad is not None]
        sum_in_place(self.comm, [local_tensor(g) for g in grads])
