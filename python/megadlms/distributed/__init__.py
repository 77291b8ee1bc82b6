"""Data-parallel wrappers (Megatron-style DDP, PyTorch FSDP2) and their plumbing.

Both wrappers implement the :class:`DataParallel` protocol (``protocol.py``); the trainer
and the optimizer use nothing else. Knows nothing about diffusion; works on any
``nn.Module``. See docs/architecture.md.
"""

from .chunked import ModelChunks, StageModules
from .config import DistributedDataParallelConfig
from .ddp import DistributedDataParallel
from .finalize import StepScales, finalize_model_grads, step_scales
from .fsdp2 import (
    TorchFullyShardedDataParallel,
    fsdp2_config_problems,
    mixed_precision_policy,
)
from .protocol import OPTIMIZER_LAYOUTS, DataParallel
from .wrappers import Float16Module, unwrap_model, wrapper_classes

ALL_MODULE_WRAPPER_CLASSNAMES = wrapper_classes()
"""The wrapper classes that hold the real model in ``.module`` (each registers itself with
``wrappers.model_wrapper``): DistributedDataParallel, TorchFullyShardedDataParallel,
Float16Module, ModelChunks. As Megatron's ``megatron.training.utils.ALL_MODULE_WRAPPER_CLASSNAMES``
they are classes despite the name, so ``isinstance(model, ALL_MODULE_WRAPPER_CLASSNAMES)`` works."""

__all__ = [
    "ALL_MODULE_WRAPPER_CLASSNAMES",
    "DataParallel",
    "OPTIMIZER_LAYOUTS",
    "fsdp2_config_problems",
    "finalize_model_grads",
    "step_scales",
    "StepScales",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "ModelChunks",
    "StageModules",
    "TorchFullyShardedDataParallel",
    "mixed_precision_policy",
    "unwrap_model",
]
