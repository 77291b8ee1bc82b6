"""Optimizers: mixed-precision (fp32 main params, loss scaling, clipping), the
distributed optimizer, and learning-rate schedules.

    from megadlms.optimizer import OptimizerConfig, get_optimizer
    opt = get_optimizer(OptimizerConfig(lr=3e-4, bf16=True), model)   # model: our DDP/FSDP2 wrapper
    success, grad_norm = opt.step()
"""

from __future__ import annotations

from typing import List

import torch

from megadlms.common.enums import OptimizerLayout

from .clip_grads import clip_grads_with_norm_, get_grad_norm_fp32
from .config import OptimizerConfig
from .distrib_optimizer import FlatPiece, ShardedBufferLayout
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .grid import GridReductions
from .layouts import DTensorLayout, ReplicaLayout, no_weight_decay
from .lr_scheduler import OptimizerParamScheduler
from .optimizer import MixedPrecisionOptimizer
from .precision import first_problem, precision_aware_problems
from .precision_adam import PrecisionAwareAdamW
from .source import GradientSource, LocalGradients, as_gradient_source


def dtensor_problems(config: OptimizerConfig, who: str = "DTensor-sharded (FSDP2) parameters") -> List[str]:
    """What this optimizer cannot do over DTensor-sharded parameters, worded with field names
    (``who`` names the switch that shards them; the CLI checks this before launch)."""
    if config.fp16:  # the fp16 grad scaler unscales local tensors, not DTensor shards
        return [f"{who} is incompatible with fp16, which needs loss scaling: use bf16"]
    if config.fused_adam == "megadlm":  # adamw_fused.py takes plain tensors
        return [
            f"{who} is incompatible with fused_adam='megadlm' (our kernel steps plain tensors): "
            "keep the default, torch's fused AdamW on CUDA"
        ]
    return []


def get_optimizer(config: OptimizerConfig, model) -> MixedPrecisionOptimizer:
    """Build the optimizer for ``model``: a data-parallel wrapper, or a plain module.

    A wrapper (a :class:`GradientSource`: megadlms.distributed's ``DataParallel`` protocol
    extends it; this layer sits below ``distributed`` and does not import it) declares in
    ``optimizer_layout`` where the reduced gradients are: "replicated" (our DDP: full fp32
    main params per rank when ``config.bf16``/``fp16``, grads from ``wrapper.main_grad``),
    "bucket_shards" (the distributed optimizer: main params and state only for this rank's
    bucket shards) or "dtensor" (FSDP2: the sharded fp32 DTensor params are the main params).
    A plain module is optimized as "replicated" with its own ``param.grad``
    (:class:`LocalGradients`).

    Over a tensor-parallel grid (the wrapper's ``parallel``, protocol.py) the grad norm counts
    every TP shard once and replicated parameters once, and skip decisions span every rank
    (``grid.py``).
    """
    wrapper = as_gradient_source(model)
    layout_kind = wrapper.optimizer_layout
    names = wrapper.named_trainable_parameters()
    if not names:
        raise ValueError("get_optimizer: the model has no trainable parameters (requires_grad=True)")
    grid = GridReductions(wrapper.parallel)  # None: plain data parallelism
    first_problem(precision_aware_problems(config, fsdp2=layout_kind == OptimizerLayout.DTENSOR))
    # main_params_dtype fp16: the main params live (scaled fp16) in the optimizer state, and the
    # layouts hand the optimizer the model params themselves
    master_in_state = config.main_params_dtype != torch.float32
    sharded = layout_kind == OptimizerLayout.BUCKET_SHARDS
    if config.use_distributed_optimizer != sharded:
        raise ValueError(
            f"use_distributed_optimizer={config.use_distributed_optimizer} in OptimizerConfig, but the "
            f"model's gradients are laid out {str(layout_kind)!r}: the wrapper must be "
            "DistributedDataParallel with DistributedDataParallelConfig(use_distributed_optimizer=True) "
            "exactly when the optimizer is distributed"
        )
    if layout_kind == OptimizerLayout.DTENSOR:
        problems = dtensor_problems(config)
        if problems:
            raise ValueError(problems[0])
        return MixedPrecisionOptimizer(config, DTensorLayout(names, wrapper.shard_comm, grid))
    if sharded:
        sharded_layout = ShardedBufferLayout(wrapper, names, grid, main_in_model=master_in_state)
        return MixedPrecisionOptimizer(config, sharded_layout, wrapper=wrapper)
    fp32_copies = (config.bf16 or config.fp16) and not master_in_state
    layout = ReplicaLayout(names, wrapper, fp32_copies=fp32_copies, grid=grid)
    return MixedPrecisionOptimizer(config, layout, wrapper=wrapper)


__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "FlatPiece",
    "GradientSource",
    "GridReductions",
    "LocalGradients",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "PrecisionAwareAdamW",
    "clip_grads_with_norm_",
    "dtensor_problems",
    "get_grad_norm_fp32",
    "get_optimizer",
    "no_weight_decay",
    "precision_aware_problems",
]
