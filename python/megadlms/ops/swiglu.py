"""SwiGLU of the MLP's fc1 output ``[gate | up]``: the unfused torch ops, and the fused
kernel (``megadlm_ext.swiglu``) with autograd, chosen by :func:`swiglu`.

Unfused: ``F.silu(gate) * up`` -- two kernels forward, saving gate, silu(gate) and up. Fused
(Megatron's bias_swiglu without a bias: the linear adds its own): one kernel forward, one
backward that writes the gradient of ``[gate | up]`` in one pass, recomputing silu from the
saved fc1 output, which is all it saves (as Megatron's bias_swiglu does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import megadlm_ext

from .fusion import fusion_applies


class _FusedSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h = h.contiguous()  # a linear's output already is
        ctx.save_for_backward(h)
        return megadlm_ext.swiglu(h)

    @staticmethod
    def backward(ctx, grad_out):
        (h,) = ctx.saved_tensors
        return megadlm_ext.swiglu_backward(h, grad_out.contiguous())


def fused_swiglu(h: torch.Tensor) -> torch.Tensor:
    """The fused kernel with autograd: ``h [..., 2F]`` -> ``[..., F]``."""
    return _FusedSwiglu.apply(h)


def swiglu(h: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` (the two halves of the last dim).

    ``fused``: the fused kernel where the device rule allows (ops/fusion.py: CUDA tensors);
    otherwise, and always on CPU, the unfused torch ops, bitwise as they always were."""
    if fusion_applies(fused, h):
        return fused_swiglu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
