"""Finishing a step's gradients, and every gradient scale factor of a step (Megatron-core's
``finalize_model_grads``; docs/architecture.md, "One step").

:func:`finalize_model_grads` runs once per step, after the schedule's last backward and
before the optimizer: it waits for every chunk's reductions (``finish_grad_sync``, which also
runs the wrapper's NaN/Inf agreement when ``check_for_nan_in_grad``) and then sums the tied
copies of a parameter that live on different pipeline stages (the tied embedding). The
agreement on a NaN/Inf *loss* rides on the step's single loss reduction after it
(``training/step.py``), which decides whether the optimizer runs at all.

Every factor a gradient is multiplied by during a step is decided here, once; where it
must be applied elsewhere for the numbers to stay what they are, it is passed down:

* 1/N (sum mode) or dp/N, N the global batch's loss tokens: :func:`step_scales` ``loss``;
  applied by the step to each micro-batch's summed loss before its backward (a scale of the
  reduced gradient after backward would round differently).
* the fp16 loss scale S: read once by :func:`step_scales` (``loss_scale``; the optimizer's
  dynamic scaler owns S); multiplied onto the loss by ``StepScales.backward_loss``, undone by
  the optimizer on its fp32 main grads (``step(grad_unscale=...)``: its overflow check needs
  the unscaled values).
* the MoE aux-loss gradient S * dp / (micro-batches of the global batch):
  :func:`step_scales` ``moe_aux``; applied in each MoE layer's backward (``aux_loss_scale``).
* 1/dp when averaging and the expert buckets' expert_dp/dp: :func:`bucket_fold_scales`;
  applied by DDP when it folds a bucket (or scales it before its SUM collective). The fused
  weight-gradient kernels (gradient-accumulation fusion) write into the buffer during
  backward, so they take the same factor as ``param.main_grad_scale``.
* FSDP2's divide factor: :func:`fsdp2_reduction`; applied by FSDP2's own reduce-scatter, or
  as a post-scale in its ``finish_grad_sync`` (old torch whose gloo sums under AVG).

In sum mode (``calculate_per_token_loss``, the trainer's default) every collective is a plain
SUM and the only division of the step is the single 1/N on the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megadlms.common.enums import OptimizerLayout

from .config import DistributedDataParallelConfig
from .protocol import DataParallel


@dataclass(frozen=True)
class StepScales:
    """The scale factors of one step, decided before its first forward."""

    loss: torch.Tensor
    """0-d fp32: multiplies each micro-batch's summed loss before its backward."""
    moe_aux: torch.Tensor
    """0-d fp32: backward scale of every MoE layer's aux losses."""
    loss_scale: float
    """The optimizer's fp16 loss scale (1.0 without fp16), multiplied onto the loss."""

    @property
    def grad_unscale(self) -> float:
        """What the optimizer multiplies its main grads by (undoes ``loss_scale``)."""
        return 1.0 / self.loss_scale

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor a micro-batch's backward starts from: ``loss`` times the loss scale."""
        return loss * self.loss_scale


def step_scales(
    model: DataParallel,
    global_tokens: torch.Tensor,
    global_micro_batches: torch.Tensor,
    loss_scale: float,
) -> StepScales:
    """The step's factors from its global counts (0-d float64 device tensors, summed over
    the loss owners: no host sync) and the optimizer's loss scale.

    Sum mode divides by N here, once; an averaging wrapper divides by dp itself, so its loss
    is multiplied by dp. A 0-token step gives inf, hence a NaN loss, hence a skipped step.
    MoE aux losses are averaged over the global batch's micro-batches (times the loss scale,
    as the token loss), so their total does not depend on dp / EP / accumulation."""
    # An averaging wrapper divides by dp in its collective; the factor dp here cancels it,
    # so both modes end at the same per-token mean.
    dp = 1 if model.ddp_config.calculate_per_token_loss else model.comm.world_size
    return StepScales(
        # Counts are summed in float64 (exact past 2**24 tokens); the scale is cast once here.
        loss=(dp / global_tokens).to(torch.float32),
        moe_aux=(loss_scale * dp / global_micro_batches).to(torch.float32),
        loss_scale=loss_scale,
    )


def bucket_fold_scales(cfg: DistributedDataParallelConfig, dp: int, expert_dp: int, avg: bool):
    """``(dense, expert)`` factor a DDP bucket's gradients get before its collective.

    Sum mode: 1 (the loss carries 1/N). Averaging with a SUM collective: 1/dp for both: an
    expert's gradient already holds the tokens of all ep ranks of its EP group (the
    dispatcher brought them), so the SUM over expert_dp then equals the dp-average, as for
    the dense ones. With an AVG collective (which divides by the group size itself) dense
    gradients get 1 and expert ones expert_dp/dp (Megatron-core's DDP scaling)."""
    if cfg.calculate_per_token_loss:
        return 1.0, 1.0
    if avg:
        return 1.0, expert_dp / dp
    return 1.0 / dp, 1.0 / dp


@dataclass(frozen=True)
class Fsdp2Reduction:
    """How FSDP2 must reduce: its divide factor (None: FSDP2's own 1/dp), whether to force a
    SUM collective, and a factor for the reduced shards after FSDP2 is done."""

    divide_factor: Optional[float]
    force_sum: bool
    post_scale: float


def fsdp2_reduction(
    cfg: DistributedDataParallelConfig, dp: int, *, backend_sums_avg: bool, can_force_sum: bool
) -> Fsdp2Reduction:
    """Sum mode: plain SUM, no division. Averaging: FSDP2's ReduceOp.AVG; where the backend
    sums under AVG (pytorch#162338) force SUM and let FSDP2 pre/post-divide, or, on an FSDP2
    without that switch, divide the summed shards by dp after the reduction."""
    if cfg.calculate_per_token_loss:
        # Divide factor 1 plus a forced SUM: FSDP2 neither pre- nor post-divides.
        return Fsdp2Reduction(1.0, True, 1.0)
    if not backend_sums_avg:
        return Fsdp2Reduction(None, False, 1.0)
    if can_force_sum:
        return Fsdp2Reduction(None, True, 1.0)
    return Fsdp2Reduction(None, False, 1.0 / dp)


TiedParam = Tuple[DataParallel, torch.nn.Parameter]


def finalize_model_grads(
    model: DataParallel, *, tied: Sequence[TiedParam] = (), tied_group: Optional[dist.ProcessGroup] = None
) -> None:
    """Make the step's reduced gradients final (module docstring).

    ``model``: the step's wrapper (``ModelChunks`` under pipeline parallelism: every chunk).
    ``tied``: (chunk wrapper, parameter) pairs whose gradients are summed over ``tied_group``
    (the embedding group of the first and last stage; None: nothing tied across ranks). Also
    after a failed forward/backward: completing this rank's collectives unblocks its peers."""
    model.finish_grad_sync()
    if tied_group is None:
        return
    for chunk, param in tied:
        allreduce_tied_grad(chunk, param, tied_group)


def allreduce_tied_grad(chunk: DataParallel, param: torch.nn.Parameter, group: dist.ProcessGroup) -> None:
    """Sum ``param``'s reduced gradient over ``group`` (call after ``finish_grad_sync``).

    With the distributed optimizer only this rank's bucket shard is reduced, and the tied
    copies sit at different offsets of different buckets on the two stages, so their valid
    shards do not line up: each is first completed over the chunk's shard group (each rank
    contributes its reduced shard, zeros elsewhere). A rank of the group without a gradient
    yet joins with zeros, so its peer never blocks."""
    if chunk.optimizer_layout == OptimizerLayout.BUCKET_SHARDS:
        _complete_sharded_grad(chunk, param)
    grad = chunk.main_grad(param)
    if grad is None:
        param.grad = grad = torch.zeros_like(param)
    dist.all_reduce(grad, group=group)


def _complete_sharded_grad(wrapper: DataParallel, param: torch.nn.Parameter) -> None:
    """Make ``param``'s main grad the full reduced gradient on every rank of the wrapper's
    shard group: keep the part inside this rank's reduced shard, zero the rest, sum."""
    comm = wrapper.shard_comm
    for bucket in wrapper.grad_buckets:
        if not any(p is param for p in bucket.params):
            continue
        off = bucket.offsets[next(i for i, p in enumerate(bucket.params) if p is param)]
        lo, hi = bucket.shard_range(comm.rank, comm.world_size)
        grad = wrapper.main_grad(param)
        assert grad is not None  # a bucket parameter's main grad is its view of the buffer
        flat = grad.view(-1)
        a, b = max(lo - off, 0), min(hi - off, flat.numel())
        # The param may lie wholly outside this rank's shard: it then contributes zeros only.
        # clone() because the zero_() below hits the same storage.
        mine = flat[a:b].clone() if a < b else None
        flat.zero_()
        if mine is not None:
            flat[a:b] = mine
        if comm.world_size > 1:
            comm.all_reduce(flat, "sum")
        return
