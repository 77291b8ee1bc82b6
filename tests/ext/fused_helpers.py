"""The unfused torch expressions the fused ops replace (written here, as the model writes them,
not taken from megadlms or megadlm_ext), their float64 truth, and the tolerances of a fused
result: fp32 within 1e-6 of the unfused ops (relative to the tensor's largest magnitude); for
bf16/fp16 no more than twice the unfused ops' own error against the float64 truth plus one
epsilon of the dtype (one rounding instead of several: the fused result is usually closer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP32_TOL = 1e-6


def unfused_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


def unfused_swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def unfused_add_rmsnorm(x, h, w, eps):
    total = x + h
    return total, F.rms_norm(total, (total.shape[-1],), w, eps)


def rope_angles(B, S, D, *, general=False, batch1=False, seed=0):
    """fp32 cos/sin [B or 1, S, 1, D]: RotaryEmbedding's layout (halves repeated) or, with
    ``general``, independent halves (the kernels' contract covers any angles)."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.randn(1 if batch1 else B, S, 1, D // 2, generator=g) * 3
    ang = torch.cat((ang, torch.randn(ang.shape, generator=g) * 3 if general else ang), dim=-1)
    return ang.cos(), ang.sin()


def grads_of(fn, inputs, grad_outs):
    """(outputs, grads of every input) of ``fn(*inputs)`` for the given output gradients."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_outs)
    return [o.detach() for o in outs], [t.grad for t in leaves]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max(1, max |b|) (in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def check_fused(
    fused: torch.Tensor, unfused: torch.Tensor, truth: torch.Tensor, what: str, fp32_tol: float = FP32_TOL
) -> None:
    """Assert the tolerance above for ``fused`` (same dtype and shape as ``unfused``)."""
    assert fused.dtype == unfused.dtype and fused.shape == unfused.shape, what
    if fused.dtype == torch.float32:
        err = rel_err(fused, unfused)
        assert err <= fp32_tol, f"{what}: fused vs unfused fp32 {err:.3g} > {fp32_tol}"
        return
    eps = torch.finfo(fused.dtype).eps
    mine, theirs = rel_err(fused, truth), rel_err(unfused, truth)
    assert mine <= 2 * theirs + eps, f"{what}: fused error {mine:.3g} vs unfused {theirs:.3g} (eps {eps:.3g})"
