"""The autograd collectives of Megatron-style tensor and sequence parallelism.

Each function takes the tensor-parallel ``group`` explicitly; ``group=None`` (what
``ParallelGroups.single().tp.group`` holds) or a group of size 1 makes every one of them the
identity, so a layer built for one process runs the plain computation.

Tensor-parallel region (hidden dim, the LAST dim, is split):

=====================  ======================  ======================
function               forward                 backward
=====================  ======================  ======================
copy_to_tp             identity                all-reduce
reduce_from_tp         all-reduce              identity
scatter_to_tp          keep own last-dim chunk all-gather last dim
gather_from_tp         all-gather last dim     keep own chunk
=====================  ======================  ======================

Sequence parallelism (activations outside the TP region split on ``seq_dim``; 1 for this
project's ``[B, S, H]`` activations, 0 for Megatron's ``[S, B, H]``):

==============================  ==================  ===============================
function                        forward             backward
==============================  ==================  ===============================
scatter_to_sequence_parallel    keep own chunk      all-gather
gather_from_sequence_parallel   all-gather          reduce-scatter (or keep chunk)
reduce_scatter_to_sequence_...  reduce-scatter      all-gather
==============================  ==================  ===============================
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
# Resolved once here for every caller (the wrappers' communicators, FSDP2's probe, the MoE dispatcher).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    """Size of ``group``; 1 for None (one process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"{what}: tensor of shape {tuple(x.shape)} has dim {dim} = {x.shape[dim]}, not divisible "
            f"by the tensor-parallel size {size}; pad it to a multiple of {size}"
        )


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # all_reduce works in place: clone so the caller's tensor (possibly saved for backward) is untouched.
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size, "split across the tensor-parallel group")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    # Gather along dim 0 of a contiguous buffer, then move the rank axis to ``dim``.
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * x0.shape[0],) + tuple(x0.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size, "reduce-scatter across the tensor-parallel group")
    # Same trick as _all_gather: the single-tensor collective splits dim 0, so bring ``dim`` to the front.
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((x0.shape[0] // size,) + tuple(x0.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # The input was replicated but each rank's weight shard saw only part of the output, so each grad is a
        # partial sum: the conjugate of the forward identity is an all-reduce.
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        # The summed output is replicated, so every rank already holds the full grad of its own partial.
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        # Downstream of the gather every rank computes the same thing, so its grad is replicated and keeping
        # this rank's slice is exact (no reduce needed).
        return _split(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, grad_is_partial):
        ctx.group, ctx.dim, ctx.grad_is_partial = group, dim, grad_is_partial
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # Entering a column-parallel layer every rank back-propagates through its own output shard, so the
        # grad of the gathered sequence is partial: sum it over TP, then keep this rank's chunk.
        if ctx.grad_is_partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's partial fed every token chunk, so each rank needs the grad of the whole sequence.
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the TP region with a replicated input: identity forward, all-reduce of the grad."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the TP region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's contiguous chunk of the last dim; the grad is all-gathered back."""
    return _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dim (rank order); the grad keeps this rank's chunk."""
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group: Group, seq_dim: int = 1) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dim; the grad is all-gathered."""
    return _ScatterToSP.apply(x, group, seq_dim)


def gather_from_sequence_parallel(
    x: torch.Tensor, group: Group, seq_dim: int = 1, grad_is_partial: bool = True
) -> torch.Tensor:
    """All-gather the sequence dim. Backward reduce-scatters the grad when each rank holds a
    partial sum of it (entering a column-parallel layer, ``grad_is_partial=True``), otherwise
    keeps this rank's chunk."""
    return _GatherFromSP.apply(x, group, seq_dim, grad_is_partial)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group, seq_dim: int = 1) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk; the grad is all-gathered."""
    return _ReduceScatterToSP.apply(x, group, seq_dim)
