"""DistributedDataParallelConfig: Megatron-core's DDP knobs, plus our comm backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
    comm_backend: str = "torch"
    """"torch" (torch.distributed) or "nccl_ext" (the extension's own NCCL communicator, GPU only)."""

    def __post_init__(self) -> None:
        if self.comm_backend not in ("torch", "nccl_ext"):
            raise ValueError(f"comm_backend must be 'torch' or 'nccl_ext', got {self.comm_backend!r}")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"bucket_size must be positive (--ddp-bucket-size), got {self.bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather requires use_distributed_optimizer "
                "(--overlap-param-gather needs --use-distributed-optimizer)"
            )
