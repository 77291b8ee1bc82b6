"""Residual add followed by an RMSNorm: the unfused torch ops, and the fused kernel
(``megadlm_ext.add_rmsnorm``) with autograd, chosen by :func:`residual_add_norm`.

``(x, h) -> (x + h, norm(x + h))``: the new residual stream and its normalised copy. Unfused:
an add, then ``nn.RMSNorm`` (several kernels). Fused: one forward kernel (fp32 statistics)
and one backward kernel taking the gradients of both outputs and giving those of x, h (the
same tensor: sum = x + h) and the weight, reduced over the rows by per-block partials and a
second small kernel. It saves what the unfused norm saved (its input, the new residual
stream, and the fp32 per-row rstd). The norm module keeps its parameter: no new parameters,
no renamed modules, checkpoints load unchanged; its weight's gradient is what the unfused
norm gives (partial over TP under sequence parallelism, declared on the parameter as before).
LayerNorm models take the unfused path.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

import megadlm_ext
from megadlms.common.dtensor import local_tensor

from .fusion import decline_once, fusion_applies


class _FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, weight, eps):
        total, y, rstd = megadlm_ext.add_rmsnorm(x.contiguous(), h.contiguous(), weight.contiguous(), eps)
        ctx.save_for_backward(total, weight, rstd)
        return total, y

    @staticmethod
    def backward(ctx, grad_total, grad_y):
        total, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = megadlm_ext.add_rmsnorm_backward(
            grad_total.contiguous(), grad_y.contiguous(), total, weight.contiguous(), rstd
        )
        # The same tensor for x and h (d(x + h)/dx = d(x + h)/dh), as torch's add does: autograd
        # accumulates into it in place only where nothing else holds it.
        return grad_x, grad_x, grad_w, None


def fused_add_rmsnorm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """The fused kernel with autograd: ``(x + h, rmsnorm(x + h) * weight)``; x, h ``[..., H]``
    and weight ``[H]`` of one dtype."""
    return _FusedAddRMSNorm.apply(x, h, local_tensor(weight), float(eps))


def residual_add_norm(
    x: torch.Tensor, h: torch.Tensor, norm: nn.Module, fused: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x + h, norm(x + h))``.

    ``fused``: the fused kernel where the device rule allows (ops/fusion.py: CUDA tensors) and
    ``norm`` is an ``nn.RMSNorm`` over the last dim with a weight of the activations' dtype;
    otherwise, and always on CPU, the unfused add and the norm module, bitwise as before."""
    if fused and isinstance(norm, nn.RMSNorm) and norm.weight is not None and len(norm.normalized_shape) == 1:
        # FSDP2 hands forward an unsharded DTensor weight: its local tensor (differentiable) is the
        # full [H] weight.
        weight = local_tensor(norm.weight)
        if fusion_applies(True, x, h, weight):
            if x.dtype == h.dtype == weight.dtype:
                eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps  # nn.RMSNorm's default
                return fused_add_rmsnorm(x, h, weight, eps)
            decline_once(
                "fused residual add + RMSNorm",
                f"activations {x.dtype} / {h.dtype}, norm weight {weight.dtype} (the kernel takes one dtype)",
            )
    total = x + h
    return total, norm(total)
