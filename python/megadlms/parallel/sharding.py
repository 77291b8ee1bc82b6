"""How a parameter's LOCAL tensor relates to the model's FULL logical tensor: one declared
description (:class:`ParamSharding`) per parameter, set with :func:`set_sharding` where the
parameter is built and read with :func:`sharding_of` by everyone else (checkpoints, the
optimizer's grad norm, the params norm, DDP's sequence-parallel grads, parameter counting).

Tensor parallelism: the full tensor is cut along ``tp_dim`` into ``tp_blocks`` equal blocks
and every block into ``tp`` equal chunks; rank ``r`` holds chunk ``r`` of every block,
concatenated in block order. One block is Megatron's plain split (linear_qkv in the grouped
layout, linear_proj, the embedding); two blocks is SwiGLU's fused ``linear_fc1 = [gate | up]``,
whose shard must pair rank r's gate rows with rank r's up rows (Megatron's
``partition_stride``). :func:`shard_full` and :func:`gather_full` are the one definition of
that rule: the models use :func:`shard_full` for layout-independent initialisation,
checkpoints use :func:`gather_full` to store full logical shapes and :func:`shard_full` to
load them at any tp.

Expert parallelism: EP rank e holds experts [e*E/ep, (e+1)*E/ep) along ``expert_dim``; the full
tensor is the concatenation over the EP group in rank order.

The description replaces Megatron's loose attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``, ``allreduce``, ``sequence_parallel``,
``shared_embedding``): nothing in torch reads them, so none is kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from megadlms.common.dtensor import is_dtensor

from .mappings import Group, group_rank, group_size

_ATTR = "megadlms_sharding"
_T = TypeVar("_T", bound=torch.Tensor)  # set_sharding returns what it was given (a Parameter stays one)
"""The one attribute a parameter carries; read and written only here (fsdp2.py copies every
attribute of a parameter it replaces, models/gpt.py's ``_apply`` carries it explicitly)."""


@dataclass(frozen=True)
class ParamSharding:
    """How one parameter is split over the parallel grid (frozen: change it with
    :func:`set_sharding`, which replaces it).

    Attributes:
        tp_dim: the dim split over the tensor-parallel group; None when replicated over TP.
        tp_blocks: equal blocks along ``tp_dim``, each split over TP (2: SwiGLU's [gate | up]).
        expert_dim: the dim split over the expert-parallel group (this rank's experts). Such a
            parameter's gradient is reduced over the expert-data-parallel group, not over dp
            (DDP's expert buffers; Megatron marks it ``allreduce = False``).
        tp_partial_grad: replicated over TP, but each TP rank's gradient covers only its part
            of the input (its sequence chunk under sequence parallelism, its heads for a
            per-head norm): summed over TP after backward (Megatron's ``sequence_parallel``).
        tied_copy: the last pipeline stage's copy of the tied word embedding. It equals the
            first stage's embedding, which is the one tensor stored in checkpoints and counted
            in norms; its gradient is summed with it over the embedding group.
    """

    tp_dim: Optional[int] = None
    tp_blocks: int = 1
    expert_dim: Optional[int] = None
    tp_partial_grad: bool = False
    tied_copy: bool = False

    def __post_init__(self) -> None:
        if self.tp_blocks < 1 or (self.tp_blocks > 1 and self.tp_dim is None):
            raise ValueError(f"ParamSharding: tp_blocks {self.tp_blocks} needs tp_dim set and tp_blocks >= 1")
        if self.tp_dim is not None and self.expert_dim is not None:
            raise ValueError("ParamSharding: split over TP (tp_dim) or over EP (expert_dim), not both")
        if self.tp_dim is not None and self.tp_partial_grad:
            raise ValueError("ParamSharding: tp_partial_grad is for TP-replicated parameters: drop tp_dim")


REPLICATED = ParamSharding()
"""The description of a parameter nobody declared: the same full tensor on every rank."""


def sharding_of(tensor: torch.Tensor) -> ParamSharding:
    """The declared :class:`ParamSharding` of ``tensor`` (:data:`REPLICATED` when none was set)."""
    return getattr(tensor, _ATTR, REPLICATED)


def set_sharding(param: _T, **changes) -> _T:
    """Declare (part of) how ``param`` is sharded: the fields in ``changes`` replace those of
    its current description, the others stay. Returns ``param``."""
    setattr(param, _ATTR, dataclasses.replace(sharding_of(param), **changes))
    return param


def counts_once(
    param: torch.Tensor, *, tp_rank: int, dp_rank: Optional[int] = None, expert_dp_rank: Optional[int] = None
) -> bool:
    """Whether this rank's local ``param`` (or its gradient) counts in a sum over ranks that must
    count every element of the full model once (grad norm, params norm, parameter count).

    A tied copy never counts (the first stage's embedding counts). A TP-replicated tensor
    counts on TP rank 0 only. ``dp_rank`` / ``expert_dp_rank`` given: the sum also runs over
    data-parallel replicas, so the tensor counts only on the first rank of the group it is
    replicated over (expert_dp for expert parameters, dp for the others). Omit them when the
    sum does not run over replicas or every dp rank holds a different shard (the distributed
    optimizer). An FSDP2 DTensor's local piece is a different part on every rank of its
    Shard mesh dims; over replicas it counts only at coordinate 0 of its Replicate dims (HSDP)."""
    sharding = sharding_of(param)
    if sharding.tied_copy or (sharding.tp_dim is None and tp_rank != 0):
        return False
    if is_dtensor(param):
        if dp_rank is None:
            return True
        coord = param.device_mesh.get_coordinate()
        assert coord is not None  # this rank is in its parameter's mesh
        return all(c == 0 for c, pl in zip(coord, param.placements) if pl.is_replicate())
    if dp_rank is None:
        return True
    return (expert_dp_rank if sharding.expert_dim is not None else dp_rank) == 0


def shard_spec(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(tp_dim, tp_blocks)`` of a tensor-parallel parameter, None if replicated over TP."""
    sharding = sharding_of(tensor)
    return None if sharding.tp_dim is None else (sharding.tp_dim, sharding.tp_blocks)


def full_shape(tensor: torch.Tensor, tp: int, ep: int = 1) -> Tuple[int, ...]:
    """The full logical shape of a parameter (or a tensor carrying its attributes) whose local
    shard is ``tensor``: its own shape when replicated or at tp = 1 (an expert parameter: ep = 1)."""
    shape = list(tensor.shape)  # a DTensor's shape is already the full one
    spec = shard_spec(tensor)
    if spec is not None and tp > 1:
        shape[spec[0]] *= tp
    dim = sharding_of(tensor).expert_dim
    if dim is not None and ep > 1:
        shape[dim] *= ep
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
    # Chunk each block, not the whole tensor: a plain chunk of [gate | up] would give rank 0 only gates.
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
    # Each rank's shard is [its gate chunk | its up chunk]; rebuild block by block, rank order within.
    blocks_of_rank = [g.chunk(blocks, dim=partition_dim) for g in gathered]
    full_blocks = [
        torch.cat([blocks_of_rank[r][b] for r in range(tp)], dim=partition_dim) for b in range(blocks)
    ]
    return torch.cat(full_blocks, dim=partition_dim)


def local_from_full(
    full: torch.Tensor, like: torch.Tensor, group: Group, ep_group: Group = None
) -> torch.Tensor:
    """``full`` cut to the shard that ``like`` (a parameter, or a tensor carrying its
    attributes) holds on this rank: its TP shard over ``group``, or (an expert parameter) this
    rank's experts over ``ep_group``; ``full`` itself when ``like`` is replicated."""
    spec = shard_spec(like)
    if spec is None:
        dim = sharding_of(like).expert_dim
        if dim is None or group_size(ep_group) == 1:
            return full
        return shard_full(full, group_rank(ep_group), group_size(ep_group), dim)
    return shard_full(full, group_rank(group), group_size(group), *spec)


def is_expert_param(tensor: torch.Tensor) -> bool:
    """An expert parameter: its gradient is reduced over the expert-data-parallel group, not the
    data-parallel group (DDP's expert buffers)."""
    return sharding_of(tensor).expert_dim is not None


def expert_shard_dim(tensor: torch.Tensor) -> Optional[int]:
    """The dim along which an expert-parallel parameter holds this EP rank's experts (0 for the
    experts' [E_local, ...] weights); None for any other parameter."""
    return sharding_of(tensor).expert_dim
