"""Contiguous grad (and param) buffers split into buckets, with Megatron-core's layout.

One :class:`ParamAndGradBuffer` holds every trainable parameter of one
(param dtype, grad dtype) pair. Layout rules (``megatron/core/distributed/
param_and_grad_buffer.py``):

* parameters are placed in REVERSE registration order (roughly the order backward
  produces their gradients), so the first bucket is ready first;
* a bucket is closed as soon as it holds ``bucket_size`` or more elements
  (``bucket_size=None``: one bucket);
* with the distributed optimizer every parameter starts at a multiple of 64 elements
  and every bucket end is padded to a multiple of lcm(dp, 128), so each bucket splits
  into dp equal contiguous shards. Padding elements stay zero.

``param.main_grad`` is a view into the grad buffer; with the distributed optimizer
``param.data`` also becomes a view into a param buffer of the same layout (the
all-gather writes straight into the parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from megadlms.common.collectives import Handle

if TYPE_CHECKING:  # ddp_groups imports this module's users; the type is only annotated here
    from .ddp_groups import ReduceGroup

# Megatron's alignments: 64-element param starts keep every main_grad view aligned for
# vectorised kernels; bucket ends on lcm(dp, 128) give dp equal shards and keep the
# next bucket's start (hence each NCCL buffer) 128-element aligned.
PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128


def _pad(n: int, divisor: int) -> int:
    return int(math.ceil(n / divisor) * divisor)


def build_bucket_layout(
    numels: Sequence[int], bucket_size: Optional[int], dp_size: int, use_distributed_optimizer: bool
):
    """Place parameters (already in buffer order) into buckets.

    Returns ``(param_ranges, bucket_ranges, total)``: ``param_ranges[i] = (start, end, bucket)``
    in buffer elements, ``bucket_ranges[b] = (start, end)`` (end includes padding), and the
    buffer length.
    """
    param_ranges: List[Tuple[int, int, int]] = []
    bucket_ranges: List[Tuple[int, int]] = []
    divisor = math.lcm(dp_size, BUCKET_ALIGNMENT)
    bucket_start = 0
    pos = 0
    n_in_bucket = 0

    def close(end: int) -> int:
        # A plain all-reduce needs no equal shards, so without the distributed optimizer
        # nothing is padded (no wasted elements).
        padded = _pad(end, divisor) if use_distributed_optimizer else end
        bucket_ranges.append((bucket_start, padded))
        return padded

    for numel in numels:
        start = _pad(pos, PARAM_ALIGNMENT) if use_distributed_optimizer else pos
        end = start + numel
        param_ranges.append((start, end, len(bucket_ranges)))
        n_in_bucket += 1
        # Closed after the param that crosses the size, not before it: a param never spans two
        # buckets, and one larger than bucket_size gets a bucket of its own.
        if bucket_size is not None and end - bucket_start >= bucket_size:
            pos = bucket_start = close(end)
            n_in_bucket = 0
        else:
            pos = end
    # The last, partly filled bucket; none if the final param closed one exactly.
    if n_in_bucket:
        pos = close(pos)
    return param_ranges, bucket_ranges, pos


@dataclass(eq=False)
class Bucket:
    """A contiguous slice of a buffer whose collective is launched as one unit."""

    index: int  # global bucket index across all buffers (launch order)
    params: List[torch.nn.Parameter]
    names: List[str]
    offsets: List[int]  # start of each param inside the bucket
    grad_data: torch.Tensor  # view of the grad buffer, padding included
    param_data: Optional[torch.Tensor]  # view of the param buffer (distributed optimizer)
    numel_unpadded: int
    grad_view: bool = False  # grad dtype == param dtype: param.grad views the buffer
    ready: set = field(default_factory=set)
    folded: bool = False  # this step's gradients are in grad_data
    launched: bool = False
    handle: Optional[Handle] = None  # async collective in flight (grad reduce)
    gather_handle: Optional[Handle] = None  # async param all-gather in flight
    # Set by the wrapper right after the buffers are built (never None in use): dense (dp) or
    # expert (expert_dp) reduction, its communicators and its fold scale
    reduce_group: ReduceGroup = None  # type: ignore[assignment]
    # megadlm_ext.TensorTable of [grad_data], set by the wrapper: the whole-bucket ops (scale,
    # NaN check) without parsing a list each step
    grad_table: Any = None
    # Deferred zeroing (view buckets; Bucket.defer_zero): the buffer still holds the last step's
    # values, and each parameter's first gradient of the step is written over them, not added.
    stale: bool = False
    written: set = field(default_factory=set)  # params already written this step (stale bucket)
    # Learnt from a complete backward: every gradient came through autograd (none was added into
    # main_grad by gradient-accumulation fusion), so the zeroing may be deferred. A fused write
    # adds to main_grad before any hook can intervene, hence needs the zeroed buffer forever.
    defer_ok: bool = False
    fused_seen: bool = False
    # The fold scale went into this step's first writes (a stale bucket written first in the
    # synced backward, so no later micro-batch adds to it): no scaling pass before the collective.
    prescaled: bool = False

    def zero_or_defer(self) -> None:
        """Start a step: zero ``grad_data`` now, or (``defer_ok``) leave it and let the first
        gradient of each parameter overwrite its range (``write_first``); ``param.grad`` is then
        None so that autograd hands over its fresh gradient instead of adding it in place."""
        self.written.clear()
        self.prescaled = False
        self.stale = self.defer_ok and self.grad_view
        if not self.stale:
            self.grad_data.zero_()
        for p in self.params:
            p.grad = None if self.stale or not self.grad_view else p.main_grad  # type: ignore[attr-defined]

    def write_first(self, p: torch.nn.Parameter, *, last_micro_batch: bool) -> None:
        """Stale bucket: ``main_grad = 0 + grad`` (one pass that reads the gradient once; the
        zero-fill plus in-place add it replaces read it and the buffer). Adding 0.0 keeps the
        old result bitwise, signed zeros included (-0.0 + 0.0 = +0.0).

        ``last_micro_batch`` (the synced backward) on the bucket's first write of the step:
        the bucket's fold scale goes into this pass (``main_grad = grad * scale``, the same
        rounding as scaling ``0 + grad`` afterwards; only a -0.0 gradient stays -0.0 instead
        of +0.0), so the collective needs no scaling pass over the bucket (``prescaled``)."""
        if not self.written:
            self.prescaled = last_micro_batch and self.reduce_group.fold_scale != 1.0
        if self.prescaled:
            torch.mul(p.grad, self.reduce_group.fold_scale, out=p.main_grad)  # type: ignore[attr-defined, arg-type]
        else:
            torch.add(p.grad, 0.0, out=p.main_grad)  # type: ignore[attr-defined, arg-type]
        p.grad = p.main_grad  # type: ignore[attr-defined]
        self.written.add(p)

    def settle(self) -> None:
        """Before the bucket's contents are read (fold, collective): the ranges of parameters
        that got no gradient this step hold zeros, as after an eager zeroing."""
        if self.stale:
            for p in self.params:
                if p not in self.written:
                    p.main_grad.zero_()  # type: ignore[attr-defined]
                    p.grad = p.main_grad  # type: ignore[attr-defined]
            self.stale = False
            self.written.clear()

    def shard_range(self, dp_rank: int, dp_size: int) -> Tuple[int, int]:
        """[start, end) of this rank's shard, in bucket elements."""
        # Exact with the distributed optimizer (the bucket is padded to a multiple of dp).
        size = self.grad_data.numel() // dp_size
        return dp_rank * size, (dp_rank + 1) * size


class ParamAndGradBuffer:
    """Grad buffer (and, with the distributed optimizer, param buffer) for one dtype pair."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        *,
        grad_dtype: torch.dtype,
        bucket_size: Optional[int],
        dp_size: int,
        use_distributed_optimizer: bool,
        first_bucket_index: int,
    ) -> None:
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        device = params[0].device
        for p, n in zip(params, names):
            if p.dtype != self.param_dtype or p.device != device:
                raise ValueError(
                    f"parameter {n} is {p.dtype} on {p.device}; this buffer holds "
                    f"{self.param_dtype} on {device}"
                )
        order = list(range(len(params)))[::-1]  # reverse registration order
        ranges, bucket_ranges, total = build_bucket_layout(
            [params[i].numel() for i in order], bucket_size, dp_size, use_distributed_optimizer
        )
        self.numel = total
        # zeros, not empty: padding elements are reduced, gathered and scanned for NaN/Inf,
        # so they must start (and stay) finite.
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_data = (
            torch.zeros(total, dtype=self.param_dtype, device=device) if use_distributed_optimizer else None
        )
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}
        per_bucket: List[List[int]] = [[] for _ in bucket_ranges]
        for i, (start, end, b) in zip(order, ranges):
            p = params[i]
            self.param_index_map[p] = (start, end, b)
            per_bucket[b].append(i)
            p.main_grad = self.grad_data[start:end].view(p.shape)  # type: ignore[attr-defined]
            if self.param_data is not None:
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                # Swap .data, not the Parameter: the object the optimizer, hooks and names refer to
                # stays the same; the copy above carried its initial value over.
                p.data = view  # the all-gather now writes straight into the parameter
        self.buckets: List[Bucket] = []
        for b, (bstart, bend) in enumerate(bucket_ranges):
            members = per_bucket[b]
            self.buckets.append(
                Bucket(
                    index=first_bucket_index + b,
                    params=[params[i] for i in members],
                    names=[names[i] for i in members],
                    offsets=[self.param_index_map[params[i]][0] - bstart for i in members],
                    grad_data=self.grad_data[bstart:bend],
                    param_data=None if self.param_data is None else self.param_data[bstart:bend],
                    numel_unpadded=sum(params[i].numel() for i in members),
                    grad_view=grad_dtype == self.param_dtype,
                )
            )
