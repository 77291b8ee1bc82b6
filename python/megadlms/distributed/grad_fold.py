"""Folding a bucket's separate gradients into its grad buffer (ddp.py's backward hooks).

What the per-parameter hook of :class:`~megadlms.distributed.ddp.DistributedDataParallel`
calls once a bucket is complete (or ``start_grad_sync`` for an incomplete one): every
``param.grad`` that is not already the ``main_grad`` view is added into the buffer in one
``megadlm_ext.accumulate_into`` call (cast and fold scale included), then dropped. Also the
hook's own plumbing: the placeholder check of gradient-accumulation fusion and the weak
reference through which a parameter's hook reaches its wrapper.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

import megadlm_ext as ext

from .param_and_grad_buffer import Bucket


def foreign_grad(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """``p.grad`` when it is a separate tensor (not the ``main_grad`` view), else None."""
    g = p.grad
    return None if g is None or g.data_ptr() == p.main_grad.data_ptr() else g  # type: ignore[attr-defined]


def check_placeholder(p: torch.nn.Parameter, name: str) -> None:
    """A fused weight's ``param.grad`` is its own alias or the ``main_grad`` view; anything else
    is the placeholder summed with an ordinary gradient, which dropping would lose."""
    g = p.grad
    # The fused layer hands autograd a placeholder aliasing existing storage (no allocation);
    # new storage means autograd summed a real gradient into it.
    if g is not None and g.data_ptr() not in (p.data_ptr(), p.main_grad.data_ptr()):  # type: ignore[attr-defined]
        raise RuntimeError(
            f"parameter {name} got an ordinary gradient besides its fused one (gradient-"
            f"accumulation fusion; a weight tied to another use?): set {name}.zero_out_wgrad "
            "= True on it, or pass --no-gradient-accumulation-fusion"
        )


def fold_bucket(bucket: Bucket, sync_enabled: bool) -> None:
    """One fused call: ``bucket.grad_data[offset_i:] += scale * param_i.grad`` for every grad
    that is not already the buffer view; then free them (or re-point them at the view).
    ``sync_enabled``: this is the synced backward (outside ``no_sync()``), so the bucket
    becomes launchable."""
    bucket.settle()  # a deferred zeroing: params without a gradient read as zeros
    grads, offsets = [], []
    for p, off in zip(bucket.params, bucket.offsets):
        g = foreign_grad(p)
        if g is not None:
            # accumulate_into reads each grad as one flat run of numel elements.
            grads.append(g if g.is_contiguous() else g.contiguous())
            offsets.append(off)
    if grads:
        # View buckets are scaled as a whole at launch, so fold those grads unscaled.
        scale = 1.0 if bucket.grad_view and not bucket.prescaled else bucket.reduce_group.fold_scale
        ext.accumulate_into(bucket.grad_data, grads, offsets=offsets, scale=scale)
    for p in bucket.params:
        # Dropping the separate grads now is the memory saving of folding; a view bucket
        # re-points .grad at the buffer so the next micro-batch accumulates in place again.
        p.grad = p.main_grad if bucket.grad_view else None  # type: ignore[attr-defined]
    bucket.ready.clear()
    # Only a fold of the synced backward makes the bucket launchable; a no_sync fold
    # must not, or the next backward would launch it before its new grads arrive.
    bucket.folded = sync_enabled


def weak_hook(method):
    """``method`` as a parameter hook that does not keep its object alive."""
    ref = weakref.WeakMethod(method)

    def hook(param):
        bound = ref()
        if bound is not None:
            bound(param)

    return hook
