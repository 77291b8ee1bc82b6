"""Data-parallel wrappers (Megatron-style DDP, PyTorch FSDP2) and their plumbing.

Both wrappers implement the :class:`DataParallel` protocol (``protocol.py``); the trainer
and the optimizer use nothing else. Knows nothing about diffusion; works on any
``nn.Module``. See docs/architecture.md.
"""

from .config import DistributedDataParallelConfig
from .ddp import DistributedDataParallel
from .fsdp2 import TorchFullyShardedDataParallel, fsdp2_config_problems, mixed_precision_policy
from .protocol import OPTIMIZER_LAYOUTS, DataParallel
from .wrappers import ALL_MODULE_WRAPPER_CLASSNAMES, Float16Module, unwrap_model

__all__ = [
    "ALL_MODULE_WRAPPER_CLASSNAMES",
    "DataParallel",
    "OPTIMIZER_LAYOUTS",
    "fsdp2_config_problems",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "TorchFullyShardedDataParallel",
    "mixed_precision_policy",
    "unwrap_model",
]
