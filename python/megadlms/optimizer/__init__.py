"""Optimizers: mixed-precision (fp32 main params, loss scaling, clipping), the
distributed optimizer, and learning-rate schedules.

    from megadlms.optimizer import OptimizerConfig, get_optimizer
    opt = get_optimizer(OptimizerConfig(lr=3e-4, bf16=True), model)   # model: our DDP/FSDP2 wrapper
    success, grad_norm = opt.step()
"""

from __future__ import annotations

import torch

from .clip_grads import clip_grads_with_norm_, get_grad_norm_fp32
from .config import OptimizerConfig
from .distrib_optimizer import ShardedBufferLayout
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .lr_scheduler import OptimizerParamScheduler
from .optimizer import DTensorLayout, MixedPrecisionOptimizer, ReplicaLayout, no_weight_decay


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


# The optimizer layer sits below megadlms.distributed (DESIGN.md), so wrappers are recognised
# by their interface, not imported: every wrapper keeps the wrapped module in `.module`, and
# only our DDP owns grad-buffer `buckets`.
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _is_megadlms_ddp(model) -> bool:
    return hasattr(model, "buckets") and hasattr(model, "ddp_config") and hasattr(model, "finish_grad_sync")


def get_optimizer(config: OptimizerConfig, model: torch.nn.Module) -> MixedPrecisionOptimizer:
    """Build the optimizer for ``model``: our DDP wrapper, our FSDP2 wrapper, or a plain module.

    DDP: fp32 main params when ``config.bf16``/``fp16`` (grads from ``param.main_grad``);
    with ``config.use_distributed_optimizer`` (the DDP must be built with
    ``use_distributed_optimizer=True`` too) the main params and state are sharded.
    FSDP2 (DTensor params): AdamW over the sharded fp32 params; fp16 is rejected.
    """
    inner = _unwrap(model)
    names = {p: n for n, p in inner.named_parameters() if p.requires_grad}
    if not names:
        raise ValueError("get_optimizer: the model has no trainable parameters (requires_grad=True)")
    fp32_copies = config.bf16 or config.fp16
    if any(_is_dtensor(p) for p in names):
        if config.fp16:
            raise ValueError(
                "--fp16 is not supported with --use-torch-fsdp2 (no loss scaling over "
                "DTensor shards): use --bf16"
            )
        if config.use_distributed_optimizer:
            raise ValueError(
                "--use-distributed-optimizer does not apply to --use-torch-fsdp2 "
                "(FSDP2 already shards optimizer state): drop one of the two flags"
            )
        layout = DTensorLayout(names, getattr(model, "process_group", None))
        return MixedPrecisionOptimizer(config, layout)
    ddp = model if _is_megadlms_ddp(model) else None
    if ddp is not None and ddp.ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
        raise ValueError(
            "use_distributed_optimizer differs between DistributedDataParallelConfig "
            f"({ddp.ddp_config.use_distributed_optimizer}) and OptimizerConfig "
            f"({config.use_distributed_optimizer}): set --use-distributed-optimizer for both"
        )
    if config.use_distributed_optimizer:
        if ddp is None:
            raise ValueError(
                "--use-distributed-optimizer needs the model wrapped in megadlms "
                "DistributedDataParallel(use_distributed_optimizer=True)"
            )
        layout = ShardedBufferLayout(ddp, names)
    else:
        layout = ReplicaLayout(names, ddp, fp32_copies=fp32_copies)
    return MixedPrecisionOptimizer(config, layout, ddp=ddp)


__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "clip_grads_with_norm_",
    "get_grad_norm_fp32",
    "get_optimizer",
    "no_weight_decay",
]
