"""The linear of the TP layers with gradient-accumulation fusion (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``, without the async communication: the
TP collectives stay in :mod:`megadlms.parallel.mappings` around it).

Forward is ``F.linear``. Backward computes the input and bias gradients as autograd would,
and adds the weight gradient straight into the fp32 ``weight.main_grad`` buffer that
:class:`megadlms.distributed.DistributedDataParallel` attaches (one
``megadlm_ext.wgrad_accumulate`` GEMM: fp32 accumulation, no ``param.grad`` of the weight
and no fp32 copy of the activations).

The handshake with DDP (Megatron's): backward sets ``weight.grad_added_to_main_grad = True``
and returns a placeholder gradient whose only job is to make autograd run the weight's
post-accumulate-grad hook, so the bucket still becomes ready (``overlap_grad_reduce`` keeps
overlapping). The hook sees the flag, does not fold that parameter, resets the flag and
restores ``param.grad``. The placeholder costs no memory: when ``weight.grad`` is None
(fp32 grads of bf16 params, or ``zero_grad(set_to_none=True)``) it is an alias of the
weight's own storage, which autograd adopts as ``param.grad`` without copying; when
``weight.grad`` is the ``main_grad`` view (same dtypes) it is a broadcast zero, added in
place (x + 0 = x, exactly).

A weight that also gets an ordinary gradient in the same backward (an embedding tied to a
fused output layer) must carry ``weight.zero_out_wgrad = True`` (Megatron's attribute): the
placeholder is then a zero, autograd sums it with the ordinary gradient, and DDP folds
``param.grad`` as usual (an alias placeholder would corrupt that sum, and dropping it would
lose the ordinary gradient).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import megadlm_ext

MISSING_MAIN_GRAD = (
    "{layer}: gradient_accumulation_fusion=True (--gradient-accumulation-fusion) needs the "
    "DistributedDataParallel wrapper (param.main_grad), but weight {shape} has no main_grad; "
    "wrap the model in megadlms.distributed.DistributedDataParallel or pass "
    "--no-gradient-accumulation-fusion (gradient_accumulation_fusion=False)"
)


def placeholder_grad(weight: torch.Tensor) -> torch.Tensor:
    """A weight 'gradient' that costs nothing; its values are never used (module docstring)."""
    if weight.grad is None and not getattr(weight, "zero_out_wgrad", False):
        return weight.detach()  # a new alias: autograd steals it as param.grad, no copy
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer_name):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.layer_name = bias is not None, layer_name
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is None:
                raise RuntimeError(MISSING_MAIN_GRAD.format(layer=ctx.layer_name, shape=tuple(weight.shape)))
            # DDP's fold scale, decided in distributed/finalize.py (bucket_fold_scales) and
            # set on the weight by DDP: applied inside the fused GEMM, which writes the buffer
            # during backward (scaling the buffer afterwards would round differently)
            scale = getattr(weight, "main_grad_scale", 1.0)
            megadlm_ext.wgrad_accumulate(main_grad, grad_output.contiguous(), x.contiguous(), alpha=scale)
            # Read by DDP's hook: the placeholder below must not be folded into main_grad a second time.
            weight.grad_added_to_main_grad = True
            grad_weight = placeholder_grad(weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # The bias grad takes the ordinary param.grad route; DDP folds it like any unfused parameter.
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    gradient_accumulation_fusion: bool,
    layer_name: str,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``gradient_accumulation_fusion`` the weight gradient
    goes straight into ``weight.main_grad`` (RuntimeError naming ``layer_name`` and the flag
    when the weight has none: no DDP wrapper, or FSDP2)."""
    # Eval, no_grad or a frozen weight: no weight grad will exist, so there is nothing to fuse and
    # main_grad need not exist either.
    if not gradient_accumulation_fusion or not (weight.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    # Fail in forward, where the stack trace points at the model, rather than midway through backward.
    if getattr(weight, "main_grad", None) is None:
        raise RuntimeError(MISSING_MAIN_GRAD.format(layer=layer_name, shape=tuple(weight.shape)))
    if torch.compiler.is_compiling():
        return _fused_linear(x, weight, bias, layer_name)
    return _FusedLinear.apply(x, weight, bias, layer_name)


# Under --use-torch-compile the fused linear runs eagerly between the compiled pieces of a layer
# (a deliberate graph split, not a fallback: same kernels, same numbers). Its backward writes
# main_grad, a buffer that is no input of the graph, and sets DDP's handshake attribute on the
# weight; a compiled backward can express neither. What the split costs: no fusion across the
# linear's boundary (the GEMM itself is an extern call under inductor anyway) and one guard check
# per piece (docs/training.md). Eager runs call _FusedLinear directly.
@torch.compiler.disable(reason="gradient-accumulation fusion writes main_grad in backward")
def _fused_linear(x, weight, bias, layer_name):
    return _FusedLinear.apply(x, weight, bias, layer_name)
