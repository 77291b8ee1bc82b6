"""DistributedDataParallelConfig: Megatron-core's DDP knobs, plus our comm backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadlms.common.enums import CommBackend, as_member
from megadlms.common.errors import Problems


@dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """How gradients are buffered, reduced and (optionally) sharded.

    Field names and defaults follow ``megatron.core.distributed.DistributedDataParallelConfig``.
    """

    grad_reduce_in_fp32: bool = False
    """Keep the grad buffer (and reduce) in fp32 even when parameters are bf16/fp16."""
    overlap_grad_reduce: bool = False
    """Launch each bucket's collective as soon as its gradients are ready (during backward)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated params asynchronously, waited for in forward."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter grads; each rank keeps fp32 main params and Adam state for its shard only."""
    check_for_nan_in_grad: bool = False
    """Raise (naming rank, bucket and parameter) if a reduced gradient holds NaN/Inf."""
    bucket_size: Optional[int] = None
    """Elements per bucket. None: max(40M, 1M x dp) when overlapping, one bucket otherwise."""
    average_in_collective: bool = False
    """Average with ReduceOp.AVG inside the collective instead of pre-scaling by 1/dp."""
    comm_backend: CommBackend = CommBackend.TORCH
    """"torch" (torch.distributed) or "nccl_ext" (the extension's own NCCL communicator, GPU only)."""
    calculate_per_token_loss: bool = False
    """Sum mode: reduce gradients as SUMS over the data-parallel ranks, with no 1/dp
    scaling anywhere (Megatron's ``calculate_per_token_loss``, torchtitan's disabled FSDP
    gradient division). The caller normalises once, e.g. by dividing the loss by the
    step's global number of loss tokens before backward, as the megadlms trainer does.
    False (the default, for library users): gradients are averaged over the ranks."""
    num_distributed_optimizer_instances: int = 1
    """Distributed optimizer: split the data-parallel group into this many instances of
    dp / N consecutive ranks (Megatron's name; e.g. one per node). Gradients are
    reduce-scattered within an instance and the shard all-reduced across instances; the
    optimizer state is sharded within an instance (dp / N shards instead of dp), the
    parameters are all-gathered within it. Must divide the data-parallel size (checked by
    the wrapper / ParallelGroups.build) and needs use_distributed_optimizer when > 1, or
    use_torch_fsdp2: FSDP2 then shards within an instance and replicates across them (HSDP,
    Megatron-FSDP's DP-outer size)."""
    use_torch_fsdp2: bool = False
    """The model is wrapped by TorchFullyShardedDataParallel (set by the trainer from
    --use-torch-fsdp2); only read by the instances rule above."""

    def __post_init__(self) -> None:
        bad = Problems("DistributedDataParallelConfig")
        self.comm_backend = as_member(CommBackend, self.comm_backend)
        bad.check(
            isinstance(self.comm_backend, CommBackend),
            f"comm_backend must be 'torch' or 'nccl_ext', got {self.comm_backend!r}",
        )
        bad.check(
            self.bucket_size is None or self.bucket_size > 0,
            f"bucket_size must be positive, got {self.bucket_size}",
        )
        bad.check(
            not self.overlap_param_gather or (self.use_distributed_optimizer and self.overlap_grad_reduce),
            "overlap_param_gather needs use_distributed_optimizer and overlap_grad_reduce: "
            "enable them or drop overlap_param_gather",
        )
        bad.check(
            not (self.average_in_collective and self.calculate_per_token_loss),
            "average_in_collective and calculate_per_token_loss are exclusive (one averages, "
            "the other sums): pick one",
        )
        n = self.num_distributed_optimizer_instances
        if bad.check(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1,
            f"num_distributed_optimizer_instances must be a positive integer, got {n!r}",
        ):
            bad.check(
                n == 1 or self.use_distributed_optimizer or self.use_torch_fsdp2,
                f"num_distributed_optimizer_instances {n} > 1 needs use_distributed_optimizer "
                "(instances shard the distributed optimizer's state) or use_torch_fsdp2 (hybrid "
                "sharding): enable one or use 1",
            )
        bad.raise_if_any()
