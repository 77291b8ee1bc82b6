"""Megatron-style tensor-parallel layers holding LOCAL shards.

* :class:`ColumnParallelLinear` — weight ``[out, in]`` split on ``out`` (dim 0); each rank
  computes its slice of the output features.
* :class:`RowParallelLinear` — weight split on ``in`` (dim 1); partial products summed over
  the TP group; the bias is replicated and added once, after the sum.
* :class:`VocabParallelEmbedding` — rows split in contiguous vocab ranges; ids outside this
  rank's range give zero rows, and the all-reduce fills them in.

Initialisation is layout independent: each layer initialises the FULL logical weight from
the given ``torch.Generator`` (every rank draws the same numbers) and keeps its shard, so the
concatenated shards equal the unsharded layer's init at any tp. The full tensor exists for
a moment on every rank during ``__init__``.

Every parameter built here declares its sharding (``sharding.set_sharding``): ``tp_dim`` for
the shards; ``tp_partial_grad`` for a replicated parameter whose gradient is only partial
under sequence parallelism (the row-parallel bias) — :func:`allreduce_sequence_parallel_grads`
sums those over the TP group after backward. Activations are ``[B, S, H]``; ``seq_dim`` (default 1) is the
dim that sequence parallelism splits.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megadlms.parallel import linear_impl, mappings
from megadlms.parallel.mappings import Group, group_rank, group_size
from megadlms.parallel.sharding import set_sharding, shard_full, sharding_of

InitMethod = Callable[[torch.Tensor, Optional[torch.Generator]], None]


def normal_init(std: float = 0.02) -> InitMethod:
    """Megatron's ``init_method_normal``: normal(0, std), drawn from ``generator``."""

    def init(weight: torch.Tensor, generator: Optional[torch.Generator]) -> None:
        with torch.no_grad():
            weight.normal_(0.0, std, generator=generator)

    return init


# Megatron's default init_method_std.
DEFAULT_INIT = normal_init(0.02)


def _divide(total: int, size: int, what: str) -> int:
    if total % size != 0:
        raise ValueError(
            f"{what} = {total} is not divisible by the tensor-parallel size {size}; "
            f"choose {what} a multiple of {size} (or pad it)"
        )
    return total // size


def _sharded_parameter(
    full_shape,
    partition_dim: int,
    group: Group,
    init_method: InitMethod,
    generator,
    dtype,
    device,
    partition_blocks: int = 1,
) -> nn.Parameter:
    """Initialise the full tensor (same draws on every rank), keep this rank's shard
    (``sharding.shard_full``: chunk ``rank`` of each of ``partition_blocks`` blocks)."""
    full = torch.empty(full_shape, dtype=dtype, device=device)
    # Every rank draws the full tensor from the same generator state, so init does not depend on tp;
    # the generator therefore advances identically on all ranks too.
    init_method(full, generator)
    shard = shard_full(full, group_rank(group), group_size(group), partition_dim, partition_blocks)
    return set_sharding(nn.Parameter(shard), tp_dim=partition_dim, tp_blocks=partition_blocks)


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group: Group) -> None:
    """Sum over the TP group the grads of replicated parameters declared ``tp_partial_grad``
    (each rank saw only its sequence chunk). Call after backward, before the optimizer."""
    if group_size(tp_group) == 1:
        return
    for param in module.parameters():
        if sharding_of(param).tp_partial_grad and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=tp_group)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split on the output features across the TP group.

    Input: full ``[..., in]`` (or, with ``sequence_parallel``, this rank's sequence chunk,
    all-gathered here). Output: this rank's ``[..., out/tp]`` slice, or the full ``[..., out]``
    with ``gather_output`` (not allowed with ``sequence_parallel``, as in Megatron).
    ``gradient_accumulation_fusion``: the weight gradient is added straight into the fp32
    ``weight.main_grad`` of :class:`~megadlms.distributed.DistributedDataParallel` (no
    ``weight.grad``; see ``linear_impl.py``); without that wrapper forward raises.
    ``partition_blocks`` > 1: the output features are that many equal blocks, each split
    across the group (SwiGLU's ``[gate | up]``; see ``sharding.py``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        init_method: InitMethod = DEFAULT_INIT,
        generator: Optional[torch.Generator] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
        partition_blocks: int = 1,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__()
        if gather_output and partition_blocks != 1:
            raise ValueError("ColumnParallelLinear: gather_output=True needs partition_blocks=1")
        if gather_output and sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True; "
                "keep the output split and follow it with a RowParallelLinear"
            )
        self.tp_group, self.gather_output = tp_group, gather_output
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.input_size, self.output_size = input_size, output_size
        _divide(output_size, partition_blocks * group_size(tp_group), "output_size / partition_blocks")
        self.output_size_per_partition = output_size // group_size(tp_group)
        self.weight = _sharded_parameter(
            (output_size, input_size), 0, tp_group, init_method, generator, dtype, device, partition_blocks
        )
        self.bias = None
        if bias:
            # Zeros need no full-tensor draw, but the bias still declares tp_blocks so a [gate | up] bias is
            # gathered and resharded in the same order as its weight.
            bias_ = torch.zeros(self.output_size_per_partition, dtype=dtype, device=device)
            self.bias = set_sharding(nn.Parameter(bias_), tp_dim=0, tp_blocks=partition_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # SP: the gather replaces copy_to_tp, and its backward reduce-scatter replaces the all-reduce.
            x = mappings.gather_from_sequence_parallel(x, self.tp_group, self.seq_dim, grad_is_partial=True)
        else:
            x = mappings.copy_to_tp(x, self.tp_group)
        y = linear_impl.linear(
            x,
            self.weight,
            self.bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            layer_name="ColumnParallelLinear",
        )
        return mappings.gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split on the input features across the TP group.

    Input: this rank's ``[..., in/tp]`` slice when ``input_is_parallel`` (the output of a
    ColumnParallelLinear), else the full input, split here. Output: full ``[..., out]``
    (all-reduced), or with ``sequence_parallel`` this rank's sequence chunk (reduce-scattered).
    ``gradient_accumulation_fusion``: as in :class:`ColumnParallelLinear`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Group,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        init_method: InitMethod = DEFAULT_INIT,
        generator: Optional[torch.Generator] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(its input is the split output of a ColumnParallelLinear)"
            )
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, group_size(tp_group), "input_size")
        self.weight = _sharded_parameter(
            (output_size, input_size), 1, tp_group, init_method, generator, dtype, device
        )
        self.bias = None
        if bias:
            # Replicated; under sequence parallelism each rank's grad covers only its chunk.
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device))
            set_sharding(self.bias, tp_partial_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tp(x, self.tp_group)
        # No bias inside the linear: added before the reduction below it would be summed tp times.
        y = linear_impl.linear(
            x,
            self.weight,
            None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            layer_name="RowParallelLinear",
        )
        if self.sequence_parallel:
            # SP: a reduce-scatter costs half an all-reduce and leaves the output split on the sequence.
            y = mappings.reduce_scatter_to_sequence_parallel(y, self.tp_group, self.seq_dim)
        else:
            y = mappings.reduce_from_tp(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocab rows are split in contiguous ranges across the TP group.

    Rank ``r`` owns ids ``[r * V/tp, (r + 1) * V/tp)``; other ids look up row 0 and are
    zeroed, and the sum over the group (all-reduce, or reduce-scatter on ``seq_dim`` with
    ``sequence_parallel``) assembles the full embedding. ``num_embeddings`` must already be
    padded to a multiple of tp.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: Group,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        init_method: InitMethod = DEFAULT_INIT,
        generator: Optional[torch.Generator] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel, self.seq_dim = tp_group, sequence_parallel, seq_dim
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = _divide(num_embeddings, group_size(tp_group), "num_embeddings")
        self.vocab_start_index = group_rank(tp_group) * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = _sharded_parameter(
            (num_embeddings, embedding_dim), 0, tp_group, init_method, generator, dtype, device
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            # Row 0 is just an in-range dummy lookup; the masked_fill zeroes it, and since that zero does not
            # depend on the weight, foreign ids send no gradient into row 0.
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel(out, self.tp_group, self.seq_dim)
        return mappings.reduce_from_tp(out, self.tp_group)
