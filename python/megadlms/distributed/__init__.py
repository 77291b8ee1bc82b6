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
    torch_supports_fsdp2,
)
from .protocol import OPTIMIZER_LAYOUTS, DataParallel
from .wrappers import Float16Module, unwrap_model

ALL_MODULE_WRAPPER_CLASSNAMES = (
    (DistributedDataParallel,)
    + ((TorchFullyShardedDataParallel,) if torch_supports_fsdp2() else ())
    + (Float16Module, ModelChunks)
)
"""The wrapper classes that hold the real model in ``.module``, as Megatron's
``megatron.training.utils.ALL_MODULE_WRAPPER_CLASSNAMES`` (classes despite the name, so
``isinstance(model, ALL_MODULE_WRAPPER_CLASSNAMES)`` works; FSDP2 is left out where torch
lacks it)."""

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
