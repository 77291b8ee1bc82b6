"""OptimizerConfig: Megatron-core's optimizer knobs (names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megadlms.common.errors import Problems

from .precision import to_dtype

DtypeLike = Union[str, torch.dtype]


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
    use_precision_aware_optimizer: bool = False
    """Allow the dtypes below to be lower than fp32 (Megatron's flag; precision.py)."""
    main_grads_dtype: DtypeLike = torch.float32
    """'fp32' or 'bf16' (with bf16 params: the DDP grad buffer stays bf16)."""
    main_params_dtype: DtypeLike = torch.float32
    """'fp32' or 'fp16' (the main params are kept in the optimizer state, scaled)."""
    exp_avg_dtype: DtypeLike = torch.float32
    """Adam's first moment in memory: 'fp32', 'bf16', 'fp16' or 'fp8' (E4M3, scaled)."""
    exp_avg_sq_dtype: DtypeLike = torch.float32
    """Adam's second moment in memory: same choices."""
    fused_adam: Optional[Union[bool, str]] = None
    """Which AdamW step runs. fp32 state: None is torch's fused kernel
    (``torch.optim.AdamW(fused=True)``: one pass over every tensor, ~3x faster than foreach on
    a GPU) when the main params are CUDA tensors and torch's default elsewhere (the per-tensor
    loop on CPU: CPU numbers unchanged); True: torch's fused kernel on any device (CPU too);
    False: torch's default (foreach on CUDA), for debugging; "megadlm": our fused kernel
    (``megadlm_ext.adamw_step``, one launch; its C++ kernel on CPU), same state and checkpoints.
    Precision-aware optimizer (a dtype below fp32): None is our fused kernel on CUDA and the
    per-parameter Python step on CPU; "megadlm": our kernel everywhere; False: the Python step
    everywhere; True is refused (torch's kernel keeps fp32 state). The scaled fp16 / fp8 moments
    and fp16 main params always take the Python step (optimizer/adamw_fused.py)."""

    @property
    def lowers_state(self) -> bool:
        """True when some optimizer dtype is below fp32 (the precision-aware inner optimizer)."""
        names = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        return any(getattr(self, n) != torch.float32 for n in names)

    def __post_init__(self) -> None:
        bad = Problems("OptimizerConfig")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            try:  # Megatron's strings become torch dtypes once, here
                setattr(self, name, to_dtype(getattr(self, name), name))
            except ValueError as exc:
                bad.add(str(exc))
        bad.check(not (self.bf16 and self.fp16), "fp16 and bf16 are exclusive: pick one")
        if bad.check(
            self.fused_adam in (None, True, False, "megadlm"),
            f"fused_adam must be None, True, False or 'megadlm', got {self.fused_adam!r}",
        ):
            bad.check(
                not (self.fused_adam is True and self.lowers_state),
                "fused_adam=True is torch's fused AdamW, which keeps fp32 state: with an optimizer "
                "dtype below fp32 use fused_adam=None (our fused step on CUDA) or 'megadlm'",
            )
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
