"""OptimizerConfig: Megatron-core's optimizer knobs (names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadlms.config_errors import Problems


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
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state across data-parallel ranks (the wrapper
    must lay its gradients out for it: DistributedDataParallelConfig.use_distributed_optimizer)."""
    loss_scale: Optional[float] = None
    """Static loss scale for fp16; None means dynamic loss scaling."""
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        bad = Problems("OptimizerConfig")
        bad.check(not (self.bf16 and self.fp16), "fp16 and bf16 are exclusive: pick one")
        bad.check(
            self.optimizer in ("adam", "sgd"), f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}"
        )
        if self.lr is None:
            bad.add("lr is required")
        elif bad.check(self.lr >= 0, f"lr must be >= 0, got {self.lr}"):
            bad.check(self.min_lr <= self.lr, f"min_lr {self.min_lr} exceeds lr {self.lr}")
        bad.check(self.min_lr >= 0, f"min_lr must be >= 0, got {self.min_lr}")
        bad.check(self.clip_grad >= 0, f"clip_grad must be >= 0, got {self.clip_grad}")
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
            value = getattr(self, name)
            bad.check(value > 0, f"{name} must be positive, got {value}")
        bad.check(
            self.loss_scale is None or self.loss_scale > 0,
            f"loss_scale must be positive, got {self.loss_scale}",
        )
        bad.raise_if_any()
