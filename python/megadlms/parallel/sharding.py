"""How a tensor-parallel parameter's LOCAL shard relates to its FULL logical tensor.

A sharded parameter carries ``tensor_model_parallel = True``, ``partition_dim`` (the dim
that is split) and ``partition_blocks`` (default 1). The full tensor is cut along
``partition_dim`` into ``partition_blocks`` equal blocks and every block into ``tp`` equal
chunks; rank ``r`` holds chunk ``r`` of every block, concatenated in block order. One block
is Megatron's plain split (linear_qkv in the grouped layout, linear_proj, the embedding);
two blocks is SwiGLU's fused ``linear_fc1 = [gate | up]``, whose shard must pair rank r's
gate rows with rank r's up rows (Megatron's ``partition_stride``).

These two functions are the one definition of that rule: the models use :func:`shard_full`
for layout-independent initialisation, checkpoints use :func:`gather_full` to store full
logical shapes and :func:`shard_full` to load them at any tp.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .mappings import Group, group_rank, group_size


def shard_spec(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(partition_dim, partition_blocks)`` of a tensor-parallel parameter, None if replicated."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return None
    return int(tensor.partition_dim), int(getattr(tensor, "partition_blocks", 1))


def mark_sharded(param: torch.Tensor, partition_dim: int, partition_blocks: int = 1) -> torch.Tensor:
    """Attach the sharding attributes to ``param`` (returns it)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_blocks = partition_blocks
    return param


def full_shape(tensor: torch.Tensor, tp: int) -> Tuple[int, ...]:
    """The full logical shape of a parameter (or a tensor carrying its attributes) whose local
    shard is ``tensor``: its own shape when replicated or at tp = 1."""
    shape = list(tensor.shape)  # a DTensor's shape is already the full one
    spec = shard_spec(tensor)
    if spec is not None and tp > 1:
        shape[spec[0]] *= tp
    return tuple(shape)


def _check(full_len: int, dim: int, blocks: int, tp: int, shape) -> None:
    if full_len % (blocks * tp) != 0:
        raise ValueError(
            f"tensor of shape {tuple(shape)}: dim {dim} = {full_len} cannot be split into {blocks} "
            f"block(s) x {tp} tensor-parallel chunks; its size must be a multiple of {blocks * tp}"
        )


def shard_full(full: torch.Tensor, rank: int, tp: int, partition_dim: int, blocks: int = 1) -> torch.Tensor:
    """This rank's local shard (a new contiguous tensor) of the full logical ``full``."""
    if tp == 1:
        return full.contiguous()
    _check(full.shape[partition_dim], partition_dim, blocks, tp, full.shape)
    pieces = [block.chunk(tp, dim=partition_dim)[rank] for block in full.chunk(blocks, dim=partition_dim)]
    return torch.cat(pieces, dim=partition_dim).contiguous()


def gather_full(local: torch.Tensor, group: Group, partition_dim: int, blocks: int = 1) -> torch.Tensor:
    """The full logical tensor from every TP rank's ``local`` shard (a collective over
    ``group``: every rank of it must call, with its own shard); the inverse of
    :func:`shard_full`."""
    tp = group_size(group)
    if tp == 1:
        return local
    local = local.contiguous()
    gathered = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(gathered, local, group=group)
    blocks_of_rank = [g.chunk(blocks, dim=partition_dim) for g in gathered]
    full_blocks = [
        torch.cat([blocks_of_rank[r][b] for r in range(tp)], dim=partition_dim) for b in range(blocks)
    ]
    return torch.cat(full_blocks, dim=partition_dim)


def local_from_full(full: torch.Tensor, like: torch.Tensor, group: Group) -> torch.Tensor:
    """``full`` cut to the shard that ``like`` (a parameter, or a tensor carrying its
    attributes) holds on this rank; ``full`` itself when ``like`` is replicated."""
    spec = shard_spec(like)
    if spec is None:
        return full
    return shard_full(full, group_rank(group), group_size(group), *spec)


def is_expert_param(tensor: torch.Tensor) -> bool:
    """An expert parameter (Megatron's mark ``allreduce = False``): its gradient is reduced
    over the expert-data-parallel group, not the data-parallel group (DDP's expert buffers)."""
    return getattr(tensor, "allreduce", True) is False


def expert_shard_dim(tensor: torch.Tensor) -> Optional[int]:
    """The dim along which an expert-parallel parameter (``expert_parallel = True``) holds this
    EP rank's experts (``partition_dim``, 0 for the experts' [E_local, ...] weights); None
    for any other parameter. EP rank e holds experts [e*E/ep, (e+1)*E/ep): the full tensor is
    the concatenation over the EP group in rank order."""
    if not getattr(tensor, "expert_parallel", False):
        return None
    return int(getattr(tensor, "partition_dim", 0))
