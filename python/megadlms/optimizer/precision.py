"""The precision-aware optimizer's dtypes, how a state tensor is stored in them, and its rules.

Megatron-LM's ``--use-precision-aware-optimizer`` (``OptimizerConfig`` fields
``main_grads_dtype``, ``main_params_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``) hands
TransformerEngine's FusedAdam lower-precision storage for Adam's moments. What is kept
from it (transformer_engine/pytorch/optimizers/fused_adam.py):

* the update runs in fp32 on the upcast state; the new state is then stored rounded to its
  dtype (round to nearest, ties to even: a plain ``Tensor.to``);
* bf16 state is stored as it is (no scale);
* fp16 and fp8 (E4M3, Megatron's ``torch.uint8``) state is stored divided by a per-tensor
  fp32 scale computed from the tensor's absmax after each update, so the largest element
  maps to half of fp16's range (65504 / 2) or to fp8's 448; TE takes absmax / range as the
  scale, we round that scale UP to a power of two (see :class:`StateCodec`).

Dtype values accept Megatron's strings (``fp32``, ``fp16``, ``bf16``, ``fp8``) and torch
dtypes (``torch.uint8`` meaning fp8, as Megatron maps it).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

# Megatron's dtype_map (megatron/training/arguments.py): "fp8" is torch.uint8 there.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}
NAMES = {v: k for k, v in DTYPES.items()}
# Per field, the values Megatron-LM's parser offers (MegaDLMs' offers the same less bf16 moments).
ALLOWED = {
    "main_grads_dtype": ("fp32", "bf16"),
    "main_params_dtype": ("fp32", "fp16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}
# TE's dtype_to_range_map: where the absmax lands after scaling.
_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}
_FP8_STORAGE = torch.float8_e4m3fn  # TE's Float8Tensor of the moments is E4M3


def to_dtype(value, field: str) -> torch.dtype:
    """A dtype field's value (Megatron's string or a torch dtype) as a torch dtype."""
    if isinstance(value, torch.dtype):
        name = NAMES.get(value)
    else:
        name = value if value in DTYPES else None
    if name is None or name not in ALLOWED[field]:
        raise ValueError(f"{field} {value!r} is not one of {', '.join(ALLOWED[field])}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """Megatron's name of a state dtype (``fp8`` for torch.uint8)."""
    return NAMES[dtype]


class StateCodec:
    """Store an fp32 state tensor in ``dtype`` and read it back as fp32.

    fp32: the tensor itself. bf16: a cast (round to nearest even), no scale. fp16 / fp8:
    ``payload = (x / scale).to(dtype)`` with one fp32 ``scale`` per tensor, chosen after every
    update from the tensor's absmax as TE does (absmax lands at most at the dtype's range),
    except that the scale is rounded up to a power of two: multiplying by it is then exact,
    so reading a payload back and storing it again gives the same values, which keeps a
    checkpointed fp16/fp8 state (stored as its fp32 values) bitwise on resume.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.scaled = dtype in _RANGE
        self.storage = _FP8_STORAGE if dtype == torch.uint8 else dtype

    def zeros_like(self, t: torch.Tensor):
        """(payload, scale) of an all-zero state shaped like ``t``; scale None when unscaled."""
        payload = torch.zeros(t.shape, dtype=self.storage, device=t.device)
        scale = torch.ones((), dtype=torch.float32, device=t.device) if self.scaled else None
        return payload, scale

    def decode(self, payload: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        """The fp32 values (the payload itself when it is fp32: updated in place)."""
        if self.storage == torch.float32:
            return payload
        out = payload.float()
        if self.scaled:
            assert scale is not None  # a scaled dtype's state always carries its scale (zeros())
            out.mul_(scale)
        return out

    def encode_(self, payload: torch.Tensor, scale: Optional[torch.Tensor], values: torch.Tensor) -> None:
        """Store fp32 ``values`` into ``payload`` (and its ``scale``), in place; a scaled
        dtype consumes ``values`` (divided in place: it is the step's temporary)."""
        if payload.data_ptr() == values.data_ptr():
            return  # fp32: already updated in place
        if not self.scaled:
            payload.copy_(values)  # round to nearest even
            return
        assert scale is not None  # a scaled dtype's state always carries its scale (zeros())
        absmax = values.abs().max() if values.numel() else values.new_zeros(())
        scale.fill_(self.pow2_scale(float(absmax)))
        payload.copy_(values.div_(scale))

    def pow2_scale(self, absmax: float) -> float:
        """The smallest power of two s with absmax / s <= the dtype's range (1 for zeros)."""
        if not math.isfinite(absmax):
            return 1.0  # a NaN/Inf step is skipped before the update; keep the old behaviour harmless
        if absmax <= 0.0:
            return 1.0
        return 2.0 ** math.ceil(math.log2(absmax / _RANGE[self.dtype]))


def precision_aware_problems(
    config,
    *,
    accumulate_allreduce_grads_in_fp32: bool = False,
    gradient_accumulation_fusion: bool = False,
    fsdp2: bool = False,
) -> List[str]:
    """Megatron's rules of the precision-aware optimizer, worded with field names (each value
    follows its field, e.g. ``exp_avg_dtype bf16``, so the CLI's rewording keeps it).

    ``config``: an :class:`~megadlms.optimizer.OptimizerConfig` (dtypes already mapped);
    the keywords: the DDP / model settings the rules span."""
    out: List[str] = []
    fields = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    lowered = [f for f in fields if getattr(config, f) != torch.float32]
    if not config.use_precision_aware_optimizer:
        # megatron/core/optimizer/optimizer_config.py: "<field> can only be fp32 when not using ..."
        return [
            f"{f} {dtype_name(getattr(config, f))} needs use_precision_aware_optimizer "
            "(without it every optimizer dtype is fp32)"
            for f in lowered
        ]
    if config.optimizer != "adam":
        out.append(f"use_precision_aware_optimizer needs --optimizer adam, got {config.optimizer}")
    if fsdp2 and lowered:
        out.append(
            f"{lowered[0]} {dtype_name(getattr(config, lowered[0]))} is not supported with "
            "use_torch_fsdp2 (FSDP2's DTensor params are fp32 main params): use DDP or fp32"
        )
    if config.main_grads_dtype == torch.bfloat16:
        out += _main_grads_problems(config, accumulate_allreduce_grads_in_fp32, gradient_accumulation_fusion)
    if config.main_params_dtype == torch.float16 and not (config.bf16 or config.fp16):
        out.append(
            "main_params_dtype fp16 needs bf16 or fp16 model params: with fp32 params the params "
            "are the main params (pass --bf16, or main_params_dtype fp32)"
        )
    return out


def _main_grads_problems(config, accumulate_in_fp32: bool, fusion: bool) -> List[str]:
    out = []
    if not config.bf16:
        # Megatron acts on main_grads_dtype only under bf16 (the grad buffer is the param dtype).
        out.append("main_grads_dtype bf16 needs bf16 (the grad buffer has the params' dtype otherwise)")
    if accumulate_in_fp32:
        out.append(
            "main_grads_dtype bf16 contradicts accumulate_allreduce_grads_in_fp32 (Megatron: main grads "
            "can only be fp32 with it): drop one"
        )
    if fusion:
        out.append(
            "main_grads_dtype bf16: the fused weight-gradient GEMM accumulates into fp32 main_grad "
            "only; pass --no-gradient-accumulation-fusion"
        )
    return out


def first_problem(problems: List[str]) -> None:
    """Raise the first of ``problems`` (a run-time guard saying the parse-time rule)."""
    if problems:
        raise ValueError(problems[0])
