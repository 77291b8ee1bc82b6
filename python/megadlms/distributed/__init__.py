"""Data-parallel wrappers (Megatron-style DDP, PyTorch FSDP2) and their plumbing.

Knows nothing about diffusion; works on any ``nn.Module``.
"""

from .config import DistributedDataParallelConfig
from .ddp import DistributedDataParallel
from .fsdp2 import TorchFullyShardedDataParallel, mixed_precision_policy
from .wrappers import ALL_MODULE_WRAPPER_CLASSNAMES, Float16Module, unwrap_model

__all__ = [
    "ALL_MODULE_WRAPPER_CLASSNAMES",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "Float16Module",
    "TorchFullyShardedDataParallel",
    "mixed_precision_policy",
    "unwrap_model",
]
