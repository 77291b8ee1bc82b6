"""One optimizer step of the masked-diffusion loop (``train_step``); docs/architecture.md,
"One step".

1. Draw the step's variable-length crop once, count this rank's loss tokens of its
   micro-batches; ONE all-reduce gives the step's global count N, the global micro-batch
   count and the ranks without data. ``distributed.step_scales`` turns them into the step's
   factors (1/N on each micro-batch's summed loss in sum mode -- the wrapper reduces plain
   sums, ``calculate_per_token_loss`` -- so the gradient is d(sum of all losses)/N: the same
   for any dp and gradient accumulation up to fp reduction order; the MoE aux scale; the
   fp16 loss scale).
2. The schedule of ``runner`` (``pipeline_run.PipelineRunner``: the one-stage schedule
   without pipeline parallelism, 1F1B / interleaved with it) runs every forward and backward;
   each chunk's gradients are synced on its own last micro-batch.
3. ``distributed.finalize_model_grads``: wait for every reduction (NaN/Inf agreement of the
   gradients there), sum the tied embedding over the first and last stage.
4. ONE all-reduce of [loss sum, non-finite flag, failure flag, exit flags]: if any rank saw a
   NaN/Inf loss every rank skips the optimizer step (MegaDLMs' nan skipping,
   --nan-skip-limit).
5. ``optimizer.step() -> (success, grad_norm)`` (unscaling, clipping, fp16 overflow skips
   inside); on success the LR schedule advances by one global batch of samples.

The reductions run over every rank (the flags must reach the whole grid), but only the
ranks that own a data-parallel replica's loss (``loss_owner``: tensor-parallel rank 0 of the
last stage) contribute their loss and token counts, so the TP ranks of one replica -- which
all hold the same loss -- count it once. The data-parallel wrapper is whatever
``builders.wrap_model`` chose; this file only uses the ``DataParallel`` protocol.

Failures: a data error on any rank is known to all before the schedule (it rides on the
token-count all-reduce). Where the schedule's stages wait on each other (``runner.lockstep``:
pipeline stages exchange activations) every rank then skips it. Where the forward/backward
itself holds collectives (``runner.unpaired``: pipeline point-to-point calls, tensor-, context-
or expert-parallel collectives, FSDP2's per-unit all-gathers and reduce-scatters) an exception
inside it, or a data error without lockstep, stops its rank at once with
:class:`UnpairedStepFailure` (its peers wait in calls it
will never make; the trainer's failure channel stops them, training/failures.py). Otherwise the
failing rank contributes nothing, still joins ``finalize_model_grads`` (its peers' collectives
complete) and the step's reductions carry the failure, so every rank stops.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megadlms.common.ranges import OPTIMIZER, traced
from megadlms.diffusion import loss_token_count, micro_batch_crop, model_length
from megadlms.distributed import DataParallel, finalize_model_grads, step_scales
from megadlms.models.moe import set_moe_aux_loss_scale

from .collectives import is_comm_error, named_collective


@dataclasses.dataclass
class StepOut:
    """What one step reports back to the loop (the reduced loss, the norm, the flags)."""

    loss: float
    grad_norm: Optional[float]
    success: bool
    nonfinite: bool
    exit_flags: List[float]
    seq_length: int
    times: dict = dataclasses.field(default_factory=dict)
    """Seconds of Megatron's timed phases ("forward-backward", "optimizer") on this rank."""
    crop_lengths: List[int] = dataclasses.field(default_factory=list)
    """Each micro-batch's length after the variable-length crop (before any shift)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class UnpairedStepFailure(RuntimeError):
    """An exception inside a forward/backward whose collectives the failing rank cannot pair
    (module docstring, "Failures"); the original error is its ``__cause__``."""


def _reduce_step(local_loss, error, exit_flags: List[float], iteration: int, device, loss_owner=True):
    """ONE all-reduce of [loss sum, NaN/Inf flag, failure flag, exit flags]; a failure on
    any rank raises on every rank (the failing one re-raises its own error)."""
    nonfinite = (~torch.isfinite(local_loss)).to(torch.float64)
    flags = torch.tensor(exit_flags, dtype=torch.float64, device=device)
    failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=device)
    # a TP peer's (equal) loss is counted by its owner; its NaN flag still counts
    loss = torch.where(nonfinite > 0, 0.0, local_loss) if loss_owner else torch.zeros_like(local_loss)
    loss = loss.reshape(1)
    # One packed all-reduce instead of four: every rank learns the loss and all the flags at once.
    packed = torch.cat([loss, nonfinite.reshape(1), failed, flags])
    with named_collective("all-reduce of [loss, NaN flag, failure flag, exit flags]", iteration):
        dist.all_reduce(packed)
    loss_total, nan_ranks, failed_ranks, *exit_reduced = packed.tolist()
    # Every rank raises, so none goes on to a collective that its failed peer will never join.
    if failed_ranks > 0:
        if error is not None:
            raise error
        raise RuntimeError(
            f"iteration {iteration + 1}: {int(failed_ranks)} other rank(s) failed inside the step "
            "(see their error); stopping this rank too"
        )
    return loss_total, nan_ranks, exit_reduced


def _count(micro_batches, diff_cfg, iteration, bidirectional, data_error):
    """(crops, [loss tokens, micro-batches, no-data flag]) of this rank (device tensors: no
    host sync until the step's reductions)."""
    crops, local_tokens = [None], torch.zeros((), dtype=torch.float64)
    if data_error is None:
        S, n = micro_batches[0]["labels"].shape[1], len(micro_batches)
        crops = [
            micro_batch_crop(diff_cfg, iteration, i, n, S, bidirectional=bidirectional) for i in range(n)
        ]
        local_tokens = torch.stack(
            [loss_token_count(b, c, diff_cfg).to(torch.float64) for b, c in zip(micro_batches, crops)]
        ).sum()
    # A rank without data contributes 0 micro-batches and sets the no-data flag for its lockstep peers.
    n_micro = float(len(micro_batches)) if data_error is None else 0.0
    rest = torch.tensor([n_micro, float(data_error is not None)], dtype=torch.float64)
    return crops, torch.cat([local_tokens.reshape(1), rest.to(local_tokens.device)])


def _run_schedule(runner, micro_batches, diff_cfg, crops, scales, iteration: int, device):
    """(error or None, this rank's loss sum) of the runner's forward/backward (module
    docstring, "Failures")."""
    try:
        return None, runner.forward_backward(micro_batches, diff_cfg, crops, scales, device)
    except Exception as exc:  # noqa: BLE001 - re-raised by _reduce_step, after every rank knows
        if is_comm_error(exc):  # a peer is gone: no collective can complete, stop now
            with named_collective(
                "forward/backward (FSDP2 all-gather / gradient bucket reduction)", iteration
            ):
                raise
        if runner.unpaired:
            # its peers wait in collectives this rank will never join: stop now, with this rank's own error
            raise UnpairedStepFailure(
                f"iteration {iteration + 1}: rank {_rank()} failed inside the step's "
                f"forward/backward, whose collectives its peers wait in: {type(exc).__name__}: {exc}"
            ) from exc
        return exc, torch.zeros((), dtype=torch.float64, device=device)


@dataclasses.dataclass
class StepGrads:
    """A step up to its optimizer update (``forward_backward``): gradients finished in the
    buffers, the reductions done. ``local_loss`` / ``local_tokens``: this rank's own loss sum
    and loss-token count (before any reduction: what result validation looks at)."""

    loss_total: float
    nan_ranks: float
    n_global: float
    grad_unscale: object
    local_loss: torch.Tensor
    local_tokens: float
    shape: dict


def train_step(
    model: DataParallel,
    optimizer,
    micro_batches: List[dict],
    diff_cfg,
    iteration: int,
    *,
    validate: Optional[Callable[[Callable[[], StepGrads], int], StepGrads]] = None,
    **kw,
) -> StepOut:
    """One optimizer step over this rank's micro-batches (see the module docstring):
    :func:`forward_backward` then :func:`optimizer_update`; ``kw``: those of
    :func:`forward_backward`. ``validate(fb, iteration)``: runs ``fb`` (the forward/backward)
    in its place and returns its gradients (result validation, ``rerun.RerunMachine.run``:
    it may run it twice, or stop the run)."""
    fb = functools.partial(forward_backward, model, optimizer, micro_batches, diff_cfg, iteration, **kw)
    grads = fb() if validate is None else validate(fb, iteration)
    return optimizer_update(optimizer, grads, iteration)


def forward_backward(
    model: DataParallel,
    optimizer,
    micro_batches: List[dict],
    diff_cfg,
    iteration: int,
    *,
    runner,
    device: torch.device,
    exit_flags: Callable[[], List[float]] = list,
    bidirectional: bool = True,
    data_error: Optional[BaseException] = None,
    loss_owner: bool = True,
    count_owner: Optional[bool] = None,
) -> StepGrads:
    """The step up to the optimizer update (steps 1-4 of the module docstring). Nothing in it
    changes the weights, the optimizer or the schedule: run again on the same micro-batches
    with the same RNG states, it gives the same gradients (a result-validation re-run).

    ``runner``: the ``pipeline_run.PipelineRunner`` of ``model`` (its schedule, one stage or
    several). ``exit_flags()`` is read just before the step's reduction, so a request (e.g.
    SIGTERM) that arrived during this step's forward/backward is seen by every rank after it.
    ``data_error``: this rank could not load its micro-batches; it still takes part in the
    step's collectives (contributing nothing) so that every rank stops with the error.
    ``loss_owner``: this rank contributes its replica's loss and token count to the
    reductions (False on the tensor-parallel peers of the owner, see the module docstring).
    ``count_owner``: this rank contributes the token count (default ``loss_owner``; under
    context parallelism only cp rank 0 of the owners: each cp rank holds the whole
    micro-batch's count but only its slice's loss)."""
    if data_error is not None and runner.unpaired and not runner.lockstep:
        # its peers would run a schedule whose collectives it cannot join (lockstep: every rank skips it)
        raise UnpairedStepFailure(
            f"iteration {iteration + 1}: rank {_rank()} could not load its micro-batches and its "
            f"peers' forward/backward needs it: {type(data_error).__name__}: {data_error}"
        ) from data_error
    crops, counts = _count(micro_batches, diff_cfg, iteration, bidirectional, data_error)
    local_tokens = float(counts[0])  # this rank's own count, before the reduction (a CPU tensor: no sync)
    # [tokens, micro-batches] of the loss owners: the global batch's N and micro-batch count;
    # [ranks without data] of every rank
    counts = counts.to(device=device)
    count_owner = loss_owner if count_owner is None else count_owner
    counts = counts if count_owner else torch.cat([torch.zeros_like(counts[:2]), counts[2:]])
    with named_collective("all-reduce of the step's loss-token count", iteration):
        dist.all_reduce(counts)
    # a lockstep schedule (pipeline stages) runs on every rank or on none; `and` keeps the
    # one-stage schedule free of the host sync
    run = data_error is None and not (runner.lockstep and counts[2].item() > 0)
    # From the global N: each micro-batch's summed loss is scaled by 1/N, so the step divides exactly once and
    # the gradient is independent of dp size and accumulation.
    scales = step_scales(model, counts[0], counts[1], optimizer.get_loss_scale())
    set_moe_aux_loss_scale(model.module, scales.moe_aux)  # the wrapped model(s): every MoE layer

    t0 = time.perf_counter()
    optimizer.zero_grad()  # zeroes the wrapper's grad buffers too: once per step
    error, local_loss = data_error, torch.zeros((), dtype=torch.float64, device=device)
    if run:
        error, local_loss = _run_schedule(runner, micro_batches, diff_cfg, crops, scales, iteration, device)
    # this rank's own schedule, before it waits for its peers' gradients (--log-straggler; no device sync:
    # on GPU it is the launch time unless the schedule synced)
    compute = time.perf_counter() - t0
    with named_collective("gradient reduction (finish_grad_sync)", iteration):
        # also after a failure: completes this rank's collectives for its peers
        finalize_model_grads(model, tied=runner.tied, tied_group=runner.embedding_group)

    # exit_flags() is read only now: a SIGTERM during forward/backward still stops after this step.
    loss_total, nan_ranks, exit_reduced = _reduce_step(
        local_loss, error, exit_flags(), iteration, device, loss_owner
    )
    # block diffusion runs [x_t ; x_0]: FLOPs and tokens/s count the 2S pass
    seq_length = model_length(diff_cfg, micro_batches[0]["labels"].shape[1] if crops[0] is None else crops[0])
    times = {"forward-backward": time.perf_counter() - t0, "schedule": compute}  # .item() above synced
    # (a data error raised in _reduce_step: the micro-batches exist here)
    lengths = [micro_batches[0]["labels"].shape[1] if c is None else c for c in crops]
    shape = {"exit_flags": exit_reduced, "seq_length": seq_length, "times": times, "crop_lengths": lengths}
    return StepGrads(
        loss_total=loss_total,
        nan_ranks=nan_ranks,
        n_global=float(counts[0].item()),
        grad_unscale=scales.grad_unscale,
        local_loss=local_loss,
        local_tokens=local_tokens,
        shape=shape,
    )


def optimizer_update(optimizer, grads: StepGrads, iteration: int) -> StepOut:
    """Step 5 of the module docstring: the optimizer update of :func:`forward_backward`'s
    gradients, or the NaN/Inf skip (both decided from all-reduced values: every rank alike)."""
    shape = grads.shape
    if grads.nan_ranks > 0 or grads.n_global <= 0:
        return StepOut(loss=float("nan"), grad_norm=None, success=False, nonfinite=True, **shape)
    # always=False: only communication errors are renamed; an optimizer bug keeps its own traceback.
    with (
        named_collective(
            "optimizer step (grad-norm all-reduce / parameter all-gather)", iteration, always=False
        ),
        traced(OPTIMIZER),
    ):
        t0 = time.perf_counter()
        success, grad_norm = optimizer.step(grad_unscale=grads.grad_unscale)
        shape["times"]["optimizer"] = time.perf_counter() - t0
    return StepOut(
        # The global per-token loss: the sum over all ranks' loss tokens divided once by their global count.
        loss=grads.loss_total / grads.n_global,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        success=bool(success),
        nonfinite=False,
        **shape,
    )
