"""One optimizer step of the masked-diffusion loop (``train_step``).

1. Draw the step's variable-length crop once, count this rank's loss tokens of its
   ``num_micro`` micro-batches; ONE all-reduce gives the step's global count N. Each
   micro-batch's summed loss is divided by N before backward and the wrapper reduces in
   sum mode (``calculate_per_token_loss``: no 1/dp anywhere), so the gradient is
   d(sum of all losses)/N: the same for 1, 2 or 3 ranks and any gradient accumulation (up
   to fp reduction order). This is the one place gradients are normalised.
2. All but the last micro-batch run under ``model.no_sync()``; ``finish_grad_sync()``.
3. ONE all-reduce of [loss sum, non-finite flag, exit flags]: if any rank saw a NaN/Inf
   loss every rank skips the optimizer step (MegaDLMs' nan skipping, --nan-skip-limit).
4. ``optimizer.step() -> (success, grad_norm)`` (clipping, fp16 loss-scale skips
   inside); on success the LR schedule advances by one global batch of samples.

The reductions run over every rank (the flags must reach the whole grid), but only the
ranks that own a data-parallel replica's loss (``loss_owner``: tensor-parallel rank 0)
contribute their loss and token counts, so the TP ranks of one replica -- which all hold
the same loss -- count it once.

The data-parallel wrapper is whatever ``builders.wrap_model`` chose; this file only uses
the ``DataParallel`` protocol (docs/architecture.md).

Pipeline parallelism (``pipeline``: a ``pipeline_run.PipelineRunner``): step 2 is the
pipeline schedule over the model chunks (each chunk synced on its own last micro-batch),
then ``finish_grad_sync()`` on every chunk and the tied-embedding gradient sum; the loss
lives on the last stage, whose tensor-parallel rank 0 is the loss owner. A data error on
any rank is known to all before the schedule (it rides on the token-count all-reduce), so
no stage waits for activations that never come; an exception inside the schedule stops its
rank at once with that error (its pipeline peers wait in point-to-point calls it will never
make; its exit ends their waits). A failure on one rank inside the
forward/backward is carried by the step's reductions, so every rank stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megadlms.diffusion import compute_loss, loss_token_count, micro_batch_crop
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


def _forward_backward(model, optimizer, micro_batches, diff_cfg, iteration, crops, scale, device):
    """Loss sum of this rank's micro-batches; backward of each, synced on the last."""
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_sum, _, _ = compute_loss(model, batch, diff_cfg, iteration, crops[i], check=False)
            optimizer.scale_loss(loss_sum * scale).backward()
        local_loss += loss_sum.detach().to(torch.float64)
    return local_loss


def _reduce_step(local_loss, error, exit_flags: List[float], iteration: int, device, loss_owner=True):
    """ONE all-reduce of [loss sum, NaN/Inf flag, failure flag, exit flags]; a failure on
    any rank raises on every rank (the failing one re-raises its own error)."""
    nonfinite = (~torch.isfinite(local_loss)).to(torch.float64)
    flags = torch.tensor(exit_flags, dtype=torch.float64, device=device)
    failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=device)
    # a TP peer's (equal) loss is counted by its owner; its NaN flag still counts
    loss = torch.where(nonfinite > 0, 0.0, local_loss) if loss_owner else torch.zeros_like(local_loss)
    loss = loss.reshape(1)
    packed = torch.cat([loss, nonfinite.reshape(1), failed, flags])
    with named_collective("all-reduce of [loss, NaN flag, failure flag, exit flags]", iteration):
        dist.all_reduce(packed)
    loss_total, nan_ranks, failed_ranks, *exit_reduced = packed.tolist()
    if failed_ranks > 0:
        if error is not None:
            raise error
        raise RuntimeError(
            f"iteration {iteration + 1}: {int(failed_ranks)} other rank(s) failed inside the step "
            "(see their error); stopping this rank too"
        )
    return loss_total, nan_ranks, exit_reduced


def train_step(
    model,
    optimizer,
    micro_batches: List[dict],
    diff_cfg,
    iteration: int,
    *,
    device: torch.device,
    exit_flags: Callable[[], List[float]] = list,
    bidirectional: bool = True,
    data_error: Optional[BaseException] = None,
    loss_owner: bool = True,
    pipeline=None,
) -> StepOut:
    """One optimizer step over this rank's micro-batches (see the module docstring).

    ``exit_flags()`` is read just before the step's reduction, so a request (e.g. SIGTERM)
    that arrived during this step's forward/backward is seen by every rank after it.
    ``data_error``: this rank could not load its micro-batches; it still takes part in the
    step's collectives (contributing nothing) so that every rank stops with the error.
    ``loss_owner``: this rank contributes its replica's loss and token count to the
    reductions (False on the tensor-parallel peers of the owner, see the module docstring)."""
    crops, local_tokens = [None], torch.zeros((), dtype=torch.float64)
    if data_error is None:
        S, n = micro_batches[0]["labels"].shape[1], len(micro_batches)
        crops = [
            micro_batch_crop(diff_cfg, iteration, i, n, S, bidirectional=bidirectional) for i in range(n)
        ]
        # Device tensors throughout: no host sync until the single reduction after backward.
        local_tokens = torch.stack(
            [loss_token_count(b, c, diff_cfg).to(torch.float64) for b, c in zip(micro_batches, crops)]
        ).sum()
    # [tokens, micro-batches] of the loss owners (the global batch's N and micro-batch count),
    # [ranks without data] under pipeline parallelism: every stage skips the schedule together
    n_micro = float(len(micro_batches)) if data_error is None else 0.0
    local_micro = torch.tensor(n_micro, dtype=torch.float64, device=local_tokens.device)
    counts = torch.stack([local_tokens, local_micro]).to(device=device)
    counts = counts if loss_owner else torch.zeros_like(counts)
    if pipeline is not None:
        failed = torch.tensor([float(data_error is not None)], dtype=counts.dtype, device=device)
        counts = torch.cat([counts, failed])
    with named_collective("all-reduce of the step's loss-token count", iteration):
        dist.all_reduce(counts)
    run_step = pipeline is None or counts[2:].sum().item() == 0
    global_tokens = counts[:1]
    # Sum mode divides by N here, once; an averaging wrapper divides by dp itself.
    dp = 1 if model.ddp_config.calculate_per_token_loss else model.comm.world_size
    scale = (dp / global_tokens).to(torch.float32)[0]  # a 0-token step gives inf -> NaN skip
    # MoE aux losses: mean over the global batch's micro-batches (times the loss scale, as the
    # token loss), so the total does not depend on dp / EP / accumulation (models.moe.stats)
    set_moe_aux_loss_scale(model, (optimizer.get_loss_scale() * dp / counts[1]).to(torch.float32))

    optimizer.zero_grad()  # zeroes the wrapper's grad buffers too: once per step
    error, local_loss = data_error, torch.zeros((), dtype=torch.float64, device=device)
    try:
        if error is None and pipeline is not None and run_step:
            local_loss = pipeline.forward_backward(optimizer, micro_batches, diff_cfg, crops, scale, device)
        elif error is None and pipeline is None:
            local_loss = _forward_backward(
                model, optimizer, micro_batches, diff_cfg, iteration, crops, scale, device
            )
    except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank knows
        if is_comm_error(exc):  # a peer is gone: no collective can complete, stop now
            with named_collective(
                "forward/backward (FSDP2 all-gather / gradient bucket reduction)", iteration
            ):
                raise
        if pipeline is not None:
            # the neighbouring stages wait in point-to-point calls this rank will never make:
            # stop now with this rank's own error (its exit ends their waits)
            raise
        error, local_loss = exc, torch.zeros((), dtype=torch.float64, device=device)
    with named_collective("gradient reduction (finish_grad_sync)", iteration):
        model.finish_grad_sync()  # also after a failure: completes this rank's collectives for its peers
        if pipeline is not None:
            pipeline.after_grad_sync()

    loss_total, nan_ranks, exit_reduced = _reduce_step(
        local_loss, error, exit_flags(), iteration, device, loss_owner
    )
    seq_length = S if crops[0] is None else crops[0]  # the throughput line's length
    n_global = float(global_tokens.item())
    if nan_ranks > 0 or n_global <= 0:
        return StepOut(float("nan"), None, False, True, exit_reduced, seq_length)
    with named_collective(
        "optimizer step (grad-norm all-reduce / parameter all-gather)", iteration, always=False
    ):
        success, grad_norm = optimizer.step()
    return StepOut(
        loss_total / n_global,
        float(grad_norm) if grad_norm is not None else None,
        bool(success),
        False,
        exit_reduced,
        seq_length,
    )
