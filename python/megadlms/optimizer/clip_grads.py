"""Global gradient norm and clipping on fp32 main grads, through megadlm_ext."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

import megadlm_ext as ext


def get_grad_norm_fp32(
    grads,
    all_reduce_sum: Optional[Callable[[torch.Tensor], None]] = None,
    *,
    device=None,
) -> float:
    """L2 norm of ``grads`` (a list of tensors or a ``megadlm_ext.TensorTable``);
    ``all_reduce_sum`` sums the squared norm across ranks when the gradients are sharded
    (distributed optimizer, FSDP2, tensor-parallel shards). ``device``:
    where the zero of a rank with no gradients lives (the collective's device). One host
    sync (.item())."""
    local = ext.l2_norm(grads) if grads else torch.zeros((), dtype=torch.float32, device=device)
    if all_reduce_sum is None:
        return float(local)
    # Squared norms add across disjoint shards (norms do not): reduce the square, root last.
    sq = (local * local).reshape(1)
    all_reduce_sum(sq)
    return math.sqrt(float(sq))


def clip_grads_with_norm_(grads, max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` (a list or a TensorTable) in place by max_norm / (total_norm + 1e-6) when
    that is below 1 (torch.nn.utils.clip_grad_norm_'s rule)."""
    if max_norm <= 0 or not grads:
        return
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        ext.scale_(grads, coeff)
