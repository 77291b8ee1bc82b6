"""OptimizerConfig: Megatron-core's optimizer knobs (names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer, precision and clipping settings; field names follow megatron.core.optimizer."""

    lr: float
    """Peak learning rate (the scheduler sets the per-step value)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""
    optimizer: str = "adam"
    """'adam' (AdamW, decoupled weight decay) or 'sgd'."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Global grad-norm clipping threshold; 0 disables clipping."""
    bf16: bool = False
    """Model params are bf16; the optimizer keeps fp32 main params."""
    fp16: bool = False
    """Model params are fp16; fp32 main params and dynamic loss scaling."""
    params_dtype: Optional[str] = None
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state across data-parallel ranks."""
    overlap_param_gather: bool = False
    loss_scale: Optional[float] = None
    """Static loss scale for fp16; None means dynamic loss scaling."""
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 are exclusive (--bf16 / --fp16): pick one")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd' (--optimizer), got {self.optimizer!r}")
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError(f"--lr ({self.lr}) and --min-lr ({self.min_lr}) must be >= 0")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
