"""Per-rank bytes of weights, gradients and optimizer state, from the layouts the wrappers use.

Nothing here re-states a layout rule: the DDP grad / param buffers are laid out by
:func:`megadlms.distributed.param_and_grad_buffer.build_bucket_layout` (the function the
buffers call), over the parameters :mod:`.manifest` lists, grouped as ``DistributedDataParallel``
groups them (dense before expert, one buffer per (param dtype, grad dtype), one wrapper per
pipeline chunk). What is counted, per rank (the test measures the same quantities):

* weights: the parameter storage (with the distributed optimizer the padded param buffer the
  parameters view; FSDP2: each fp32 dim-0 shard as ``fully_shard`` allocates it, padded to
  ``ceil(dim0 / shards)`` rows).
* gradients: the DDP grad buffers (padding included) in the grad dtype; FSDP2: the fp32
  reduce-scatter output each sharded gradient views (padded the same way).
* optimizer state: per optimized element the moments in their stored dtype (Adam: exp_avg +
  exp_avg_sq; SGD with momentum: one fp32 buffer), plus the main parameter when the optimizer
  keeps its own copy (fp32 for bf16/fp16 weights; ``--main-params-dtype fp16``: the fp16
  master in the state instead). Per-tensor scalars (the step count, fp16/fp8 scales) are
  left out: a few bytes per tensor.

Transient buffers (FSDP2's unsharded parameters during a unit's forward / backward, fp32
copies of 16-bit gradients during the step) are not resident state and are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megadlms.config import RunConfig
from megadlms.distributed.param_and_grad_buffer import build_bucket_layout
from megadlms.optimizer.precision import StateCodec

from .manifest import PlannedParam, rank_parameters

__all__ = ["StateBytes", "ShardGroups", "shard_groups", "state_bytes"]


@dataclass(frozen=True)
class StateBytes:
    """Resident bytes of one rank's model state (see the module docstring for what counts)."""

    weights: int
    grads: int
    optimizer: int
    params: int  # parameters this rank holds (local elements, before any data-parallel sharding)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True)
class ShardGroups:
    """The sizes of the groups gradients are reduced and sharded over (ParallelGroups' axes)."""

    reduce: int  # dense gradients: dp x cp (dp_cp)
    shard: int  # dense distributed-optimizer shards / FSDP2 shards: dp_intra (dp / instances)
    expert: int  # expert gradients and shards: expert_dp = world / (tp x ep x pp) (ep 1: shard)


def shard_groups(config: RunConfig) -> ShardGroups:
    par = config.parallel
    dp = par.data_parallel_size
    assert dp is not None  # derived by ParallelConfig
    reduce = dp * par.context_parallel_size
    shard = reduce // config.ddp.num_distributed_optimizer_instances
    ep = par.expert_model_parallel_size
    # ep 1: the expert buffers use the dense communicators (ddp_groups.reduce_groups)
    return ShardGroups(reduce=reduce, shard=shard, expert=reduce // ep if ep > 1 else shard)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def param_dtype(config: RunConfig) -> torch.dtype:
    """The dtype the wrapped model's parameters have (Float16Module casts; FSDP2 keeps fp32)."""
    opt = config.optimizer
    if config.parallel.use_torch_fsdp2 or not (opt.bf16 or opt.fp16):
        return torch.float32
    return torch.bfloat16 if opt.bf16 else torch.float16


def _stored(dtype) -> int:
    """Bytes per element of an optimizer state kept in ``dtype`` (OptimizerConfig made it a
    torch dtype; fp8 is stored as E4M3)."""
    assert isinstance(dtype, torch.dtype)
    return _itemsize(StateCodec(dtype).storage)


def _per_element_optimizer_bytes(config: RunConfig, owns_main: bool) -> int:
    """Resident optimizer bytes per optimized element (moments, plus a main copy if owned)."""
    opt = config.optimizer
    moments: int
    if opt.optimizer == "sgd":
        moments = 4 if opt.sgd_momentum else 0
    elif opt.lowers_state or opt.fused_adam == "megadlm":  # the precision-aware AdamW's codecs
        moments = _stored(opt.exp_avg_dtype) + _stored(opt.exp_avg_sq_dtype)
    else:
        moments = 8  # torch AdamW: fp32 exp_avg + exp_avg_sq
    master = 0
    if opt.main_params_dtype != torch.float32:  # the master lives in the optimizer state
        master = _stored(opt.main_params_dtype)
    elif owns_main:
        master = 4
    return moments + master


def _ddp_chunk(config: RunConfig, params: Sequence[PlannedParam], groups: ShardGroups, ranks) -> Tuple:
    """(weights, grads, optimizer) bytes of one DDP-wrapped chunk."""
    ddp, opt = config.ddp, config.optimizer
    pdt = param_dtype(config)
    gdt = torch.float32 if ddp.grad_reduce_in_fp32 else pdt
    bucket_size = ddp.bucket_size
    if bucket_size is None and ddp.overlap_grad_reduce:
        bucket_size = max(40_000_000, 1_000_000 * groups.reduce)  # DistributedDataParallel's default
    owns_main = pdt != torch.float32 and opt.main_params_dtype == torch.float32
    per_element = _per_element_optimizer_bytes(config, owns_main)
    weights = grads = optimizer = 0
    for expert in (False, True):  # dense buffers first, as the wrapper builds them
        members = [p for p in params if p.expert == expert]
        if not members:
            continue
        shards = groups.expert if expert else groups.shard
        numels = [p.numel for p in reversed(members)]  # the buffer's reverse registration order
        ranges, buckets, total = build_bucket_layout(
            numels, bucket_size, shards, ddp.use_distributed_optimizer
        )
        grads += total * _itemsize(gdt)
        if not ddp.use_distributed_optimizer:
            weights += sum(numels) * _itemsize(pdt)
            optimizer += sum(numels) * per_element
            continue
        weights += total * _itemsize(pdt)  # the parameters view the padded param buffer
        rank = ranks["expert_shard" if expert else "shard"]
        owned = 0
        for start, end, b in ranges:
            lo, hi = buckets[b]
            size = (hi - lo) // shards
            a, z = lo + rank * size, lo + (rank + 1) * size
            owned += max(0, min(end, z) - max(start, a))
        optimizer += owned * per_element
    return weights, grads, optimizer


def _fsdp2_chunk(config: RunConfig, params: Sequence[PlannedParam], groups: ShardGroups, ranks) -> Tuple:
    """(weights, grads, optimizer) bytes under FSDP2: fp32 dim-0 shards over ``groups.shard``."""
    shards, rank = groups.shard, ranks["shard"]
    per_element = _per_element_optimizer_bytes(config, owns_main=False)
    padded = mine = 0
    for p in params:
        rows, rest = p.shape[0], math.prod(p.shape[1:])
        per_rank = -(-rows // shards)  # torch.chunk's rows per shard
        padded += per_rank * rest  # fully_shard allocates every rank's shard at this size
        mine += max(0, min(per_rank, rows - rank * per_rank)) * rest  # the moments: the real rows
    return padded * 4, padded * 4, mine * per_element


def state_bytes(config: RunConfig, *, pp_rank: int = 0, shard_rank: int = 0, expert_shard_rank: int = 0):
    """:class:`StateBytes` of one rank: pipeline rank ``pp_rank``, position ``shard_rank`` in the
    dense shard group (dp_intra) and ``expert_shard_rank`` in the expert-dp group (rank 0 holds
    the largest shards)."""
    groups = shard_groups(config)
    ranks: Dict[str, int] = {"shard": shard_rank, "expert_shard": expert_shard_rank}
    chunk = _fsdp2_chunk if config.parallel.use_torch_fsdp2 else _ddp_chunk
    totals = [0, 0, 0]
    n = 0
    for params in rank_parameters(config, pp_rank=pp_rank):
        n += sum(p.numel for p in params)
        for i, v in enumerate(chunk(config, params, groups, ranks)):
            totals[i] += v
    return StateBytes(weights=totals[0], grads=totals[1], optimizer=totals[2], params=n)


def stage_params(config: RunConfig) -> List[int]:
    """Parameters held by one (tp, ep) rank of each pipeline stage."""
    pp = config.parallel.pipeline_model_parallel_size
    return [sum(p.numel for c in rank_parameters(config, pp_rank=r) for p in c) for r in range(pp)]
