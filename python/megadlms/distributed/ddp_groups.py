"""Which ranks a DDP bucket is reduced and sharded over, and the factor its gradients get.

Two kinds of bucket (Megatron-core's DDP keeps them in separate buffers):

* dense parameters: reduced over the data-parallel group ``parallel.dp`` (with the
  distributed optimizer sharded over ``dp_intra``, and with instances all-reduced across
  ``dp_inter``);
* expert parameters (``ParamSharding.expert_dim`` set; Megatron marks them ``allreduce =
  False``): every EP rank holds different experts, so their gradients are reduced over the
  expert-data-parallel group
  ``parallel.expert_dp`` (the ranks holding the same experts: dp / ep of them), and the
  distributed optimizer shards them over that group.

Scaling: each kind's fold scale (1 in sum mode, 1/dp or expert_dp/dp when averaging) is
``finalize.bucket_fold_scales``, with every other factor of the step.

At ep = 1 the expert buckets use the dense communicators (same ranks): only the buffers
are separate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist

from megadlms.common.collectives import Communicator

from .comm import build_communicator, resolve_group
from .config import DistributedDataParallelConfig
from .finalize import bucket_fold_scales


@dataclass(frozen=True)
class ReduceGroup:
    """The communicators and fold scale of one kind of bucket (dense or expert)."""

    expert: bool
    comm: Communicator  # all-reduce (plain DDP) over the reduction group
    shard_comm: Communicator  # reduce-scatter / all-gather of the distributed optimizer
    inter_comm: Optional[Communicator]  # across distributed-optimizer instances (dense only)
    fold_scale: float  # factor applied to a gradient before a SUM collective
    op: str  # "sum" or "avg"


def expert_instances_problems(ep: int, num_instances: int) -> List[str]:
    """Expert parallelism with distributed-optimizer instances (not supported), worded with
    field names; :func:`reduce_groups` raises it, the CLI reports it before launch."""
    if ep > 1 and num_instances > 1:
        return [
            f"num_distributed_optimizer_instances {num_instances} with expert_model_parallel_size {ep}: "
            "distributed-optimizer instances are not supported with expert parallelism; use "
            "num_distributed_optimizer_instances 1"
        ]
    return []


def reduce_groups(cfg: DistributedDataParallelConfig, parallel, comm, shard_comm, inter_comm):
    """``(dense, expert)`` :class:`ReduceGroup` for a wrapper over ``comm`` (the dp group)."""
    ep = parallel.ep.size if parallel is not None else 1
    if ep > 1:
        problems = expert_instances_problems(ep, cfg.num_distributed_optimizer_instances)
        if problems:
            raise ValueError(problems[0])
        ecomm = build_communicator(cfg.comm_backend, parallel.expert_dp.group)
        # Expert buckets shard over the whole expert_dp group (instances are rejected above).
        eshard, einter = ecomm, None
    else:
        # ep = 1: expert_dp is dp, so reuse the dense communicators (no extra NCCL comms).
        ecomm, eshard, einter = comm, shard_comm, inter_comm
    comms = [comm, shard_comm, ecomm] + ([inter_comm] if inter_comm is not None else [])
    # AVG only if every hop a bucket may take supports it: mixing AVG on one hop with
    # pre-division on another would divide twice (or not at all).
    avg = cfg.average_in_collective and all(c.supports_avg for c in comms)
    op = "avg" if avg else "sum"
    # the factors are decided with the step's others (finalize.py), applied by the fold
    dense_scale, expert_scale = bucket_fold_scales(cfg, comm.world_size, ecomm.world_size, avg)
    dense = ReduceGroup(False, comm, shard_comm, inter_comm, dense_scale, op)
    expert = ReduceGroup(True, ecomm, eshard, einter, expert_scale, op)
    return dense, expert


def data_parallel_group(process_group, parallel):
    """The data-parallel group: ``parallel.dp.group`` over a grid (``process_group``, if also
    given, must have the same ranks), else ``process_group`` / WORLD."""
    if parallel is None:
        return resolve_group(process_group)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if parallel.world_size != world:
        raise ValueError(
            f"parallel was built for world size {parallel.world_size}, but this process group has "
            f"{world} ranks: build it with ParallelGroups.build(...) after init_process_group "
            "(ParallelGroups.single() is for one process)"
        )
    if process_group is not None:
        ranks = dist.get_process_group_ranks(process_group)
        if ranks != list(parallel.dp.ranks):
            raise ValueError(
                f"process_group (ranks {ranks}) differs from parallel.dp (ranks {list(parallel.dp.ranks)}): "
                "pass only parallel (its dp group is the data-parallel group)"
            )
    return parallel.dp.group


def instance_communicators(cfg: DistributedDataParallelConfig, parallel, comm):
    """(shard communicator, inter-instance communicator or None) for
    ``cfg.num_distributed_optimizer_instances``; the instance groups come from ``parallel``."""
    n = cfg.num_distributed_optimizer_instances
    built = parallel.num_distributed_optimizer_instances if parallel is not None else 1
    if n > 1 and parallel is None:
        raise ValueError(
            f"num_distributed_optimizer_instances {n} needs parallel=ParallelGroups.build(..., "
            f"num_distributed_optimizer_instances={n}): the instance groups are built there, once"
        )
    if parallel is not None and n != built:
        raise ValueError(
            f"num_distributed_optimizer_instances {n} in DistributedDataParallelConfig, but parallel "
            f"was built with {built} instance(s): pass the same value to ParallelGroups.build"
        )
    if n == 1:
        return comm, None
    return (
        build_communicator(cfg.comm_backend, parallel.dp_intra.group),
        build_communicator(cfg.comm_backend, parallel.dp_inter.group),
    )
