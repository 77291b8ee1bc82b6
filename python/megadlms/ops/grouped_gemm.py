"""Grouped matmul of the MoE experts: one call for all local experts with variable token
counts (Megatron's ``grouped_gemm.ops.gmm`` with ``trans_b=True``), with autograd.

Forward: the rows of ``x`` are grouped by expert in order, ``tokens_per_expert[e]`` rows
for expert e, and the rows of expert e become ``x_e @ w[e].T``. Backward is two more
grouped GEMMs: ``dx_e = dy_e @ w[e]`` and ``dw[e] = dy_e^T @ x_e`` (zeros for an expert
without tokens). All three run in ``megadlm_ext.grouped_gemm`` (fp32 accumulation for
bf16/fp16, one rounding).

With ``gradient_accumulation_fusion`` the weight gradient is added straight into the fp32
``w.main_grad`` that :class:`megadlms.distributed.DistributedDataParallel` attaches, with
the handshake of :mod:`megadlms.parallel.linear_impl` (``grad_added_to_main_grad`` and a
placeholder gradient that keeps the bucket's readiness hook firing).
"""

from __future__ import annotations

import torch

import megadlm_ext
from megadlms.parallel.linear_impl import MISSING_MAIN_GRAD, placeholder_grad


def _host_sizes(tokens_per_expert: torch.Tensor, experts: int) -> torch.Tensor:
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.dtype != torch.int64:
        raise ValueError(
            f"grouped_matmul: tokens_per_expert must be an int64 tensor [{experts}], got "
            f"{getattr(tokens_per_expert, 'dtype', type(tokens_per_expert).__name__)}"
        )
    if tuple(tokens_per_expert.shape) != (experts,):
        raise ValueError(
            f"grouped_matmul: tokens_per_expert has shape {list(tokens_per_expert.shape)} but w has "
            f"{experts} experts (w.shape[0])"
        )
    # The GEMM loop runs on the host: a cuda tensor costs one device->host copy here.
    return tokens_per_expert.detach().to("cpu").contiguous()


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, sizes, fuse, layer_name):
        # The extension takes contiguous operands; the saved copies are reused by both backward GEMMs.
        x, w = x.contiguous(), w.contiguous()
        ctx.save_for_backward(x, w)
        ctx.sizes, ctx.fuse, ctx.layer_name = sizes, fuse, layer_name
        return megadlm_ext.grouped_gemm(x, w, sizes, trans_b=True)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = megadlm_ext.grouped_gemm(g, w, ctx.sizes)
        if ctx.needs_input_grad[1]:
            if not ctx.fuse:
                grad_w = megadlm_ext.grouped_gemm(g, x, ctx.sizes, trans_a=True)
            else:
                main_grad = getattr(w, "main_grad", None)
                if main_grad is None:
                    raise RuntimeError(MISSING_MAIN_GRAD.format(layer=ctx.layer_name, shape=tuple(w.shape)))
                # DDP's fold scale (distributed/finalize.py bucket_fold_scales), applied
                # inside the GEMM that accumulates into the buffer (see parallel/linear_impl.py)
                scale = getattr(w, "main_grad_scale", 1.0)
                megadlm_ext.grouped_gemm(
                    g, x, ctx.sizes, trans_a=True, out=main_grad, accumulate=True, alpha=scale
                )
                # As in parallel/linear_impl.py: DDP's hook must not fold the placeholder a second time.
                w.grad_added_to_main_grad = True
                grad_w = placeholder_grad(w)
        return grad_x, grad_w, None, None, None


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    gradient_accumulation_fusion: bool = False,
    layer_name: str = "grouped_matmul",
) -> torch.Tensor:
    """``x [T, K]`` (rows grouped by expert in order), ``w [E, N, K]``, ``tokens_per_expert
    [E]`` int64 (sum = T, zeros allowed) -> ``[T, N]`` whose rows of expert e are
    ``x_e @ w[e].T``; differentiable in ``x`` and ``w`` (same dtype: fp32, bf16 or fp16).

    ``gradient_accumulation_fusion=True`` adds the weight gradient into ``w.main_grad`` (DDP's
    fp32 buffer; RuntimeError naming ``layer_name`` and the flag when there is none) instead
    of producing ``w.grad``.
    """
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"grouped_matmul: x must be [T, K] and w [E, N, K], got x {list(x.shape)} and w {list(w.shape)}"
        )
    sizes = _host_sizes(tokens_per_expert, w.shape[0])
    # No weight grad in eval / no_grad, so nothing to fuse (and no main_grad needed).
    fuse = bool(gradient_accumulation_fusion and w.requires_grad and torch.is_grad_enabled())
    if fuse and getattr(w, "main_grad", None) is None:
        raise RuntimeError(MISSING_MAIN_GRAD.format(layer=layer_name, shape=tuple(w.shape)))
    return _GroupedMatmul.apply(x, w, sizes, fuse, layer_name)
