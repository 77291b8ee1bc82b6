"""Rotary position embedding applied to q or k: the unfused torch ops, and the fused kernel
(``megadlm_ext.rope``) with autograd, chosen by :func:`apply_rotary`.

Unfused (Megatron's bshd form): ``x * cos + cat(-x2, x1) * sin`` in x's dtype -- a chunk, a
neg, a cat, two casts of cos/sin and three more elementwise kernels per call. Fused: one
kernel each way, reading x with its strides (q and k are views of the qkv projection: no
contiguous copy), cos/sin in fp32 (no per-call cast), fp32 math, the output in x's dtype. The
backward is the same kernel applying the transpose of the rotation (its inverse); it needs
only cos and sin, so nothing of x is saved.
"""

from __future__ import annotations

import torch

import megadlm_ext

from .fusion import fusion_applies


class _FusedRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return megadlm_ext.rope(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        return megadlm_ext.rope(grad_out, cos, sin, backward=True), None, None


def fused_rotary(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The fused kernel with autograd for ``x`` (cos/sin: fp32 ``[B or 1, S, 1, D]``, no
    gradient -- RotaryEmbedding's angles are not trained)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "fused rotary embedding: cos/sin require grad, but the kernel gives no gradient for "
            "the angles; detach them or turn the fusion off (apply_rope_fusion / --no-rope-fusion)"
        )
    return _FusedRotary.apply(x_BSND, cos, sin)


def apply_rotary(
    x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False
) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of every head by the position angle (Megatron bshd form).

    ``fused``: the fused kernel where the device rule allows (ops/fusion.py: CUDA tensors);
    otherwise, and always on CPU, the unfused torch ops below, bitwise as they always were."""
    if fusion_applies(fused, x_BSND, cos, sin):
        # Angles that arrive in 16 bits (FSDP2's bf16 policy casts a unit's inputs, RotaryEmbedding's
        # output among them) are widened exactly: the values the unfused ops would use. A no-op for fp32.
        return fused_rotary(x_BSND, cos.float(), sin.float())
    x1, x2 = x_BSND.chunk(2, dim=-1)
    # With the cos/sin below this is the 2-D rotation of each pair (x1_i, x2_i).
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_BSND * cos.to(x_BSND.dtype) + rotated * sin.to(x_BSND.dtype)
