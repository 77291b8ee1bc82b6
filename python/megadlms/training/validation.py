"""Validation and parameter norms of a run (collectives over the data-parallel ranks)."""

from __future__ import annotations

import math
from itertools import islice
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from megadlms.common.dtensor import local_tensor
from megadlms.diffusion import validation_nelbo
from megadlms.distributed import unwrap_model
from megadlms.parallel.sharding import counts_once


class Evaluation(NamedTuple):
    """One evaluation's result (:func:`evaluate`), combined over the ranks."""

    nelbo: float
    """Loss per token: the diffusion NELBO (the next-token loss in vanilla mode)."""
    ppl_bound: float
    """exp(nelbo): for a DLM an upper bound on the perplexity."""
    num_tokens: float
    """Loss tokens over every rank."""


def to_device(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def evaluate(
    model,
    loader,
    diff_cfg,
    *,
    num_micro_batches: int,
    num_mc_samples: int,
    seed: int,
    device: torch.device,
    packing: Optional[Callable[[dict], dict]] = None,
    loss_owner: bool = True,
    pipeline=None,
) -> Evaluation:
    """Validation NELBO over the first ``num_micro_batches`` of ``loader`` on every rank,
    combined over ranks (the same samples every time, so evaluations are comparable).
    ``packing``: adds the document-packing fields to each batch. ``loss_owner`` False: a
    tensor-parallel peer (or a rank off the last pipeline stage), whose sums its loss owner
    contributes. ``pipeline``: a ``pipeline_run.PipelineRunner`` (forward-only schedule)."""
    # A fresh iterator each call: every evaluation reads the same first batches.
    batches = (to_device(b, device) for b in islice(iter(loader), num_micro_batches))
    if packing is not None:
        batches = (packing(b) for b in batches)
    if pipeline is not None:
        sums = pipeline.validation_sums(list(batches), diff_cfg, num_mc_samples=num_mc_samples, seed=seed)
        loss_sum, n = sums.loss_sum, sums.num_tokens
    else:
        res = validation_nelbo(model, batches, diff_cfg, num_mc_samples=num_mc_samples, seed=seed)
        loss_sum, n = res["loss_sum"], res["num_tokens"]
    t = torch.tensor([float(loss_sum), float(n)], dtype=torch.float64, device=device)
    # Non-owners still join (the all-reduce is collective) but add zeros: the shared TP loss counts once.
    dist.all_reduce(t if loss_owner else t.zero_())
    loss_sum, n = t.tolist()
    nelbo = loss_sum / max(n, 1.0)
    return Evaluation(nelbo=nelbo, ppl_bound=math.exp(min(nelbo, 700.0)), num_tokens=n)


def params_norm(model, device: torch.device, groups=None) -> float:
    """Global L2 norm of the full parameters (collective over every rank): FSDP2's DTensor
    pieces count on every rank, tensor-parallel shards on data-parallel rank 0 of their TP
    group, expert parameters on expert-data-parallel rank 0 of their EP group, replicated
    parameters on data- and tensor-parallel rank 0 of their pipeline stage (global rank 0
    without pipeline parallelism), a tied embedding's copy on the last stage never -- so each
    element counts once."""
    dp_rank = groups.dp.rank if groups is not None else 0
    expert_dp_rank = groups.expert_dp.rank if groups is not None else 0
    tp_rank = groups.tp.rank if groups is not None else dist.get_rank()
    total = torch.zeros((), dtype=torch.float64, device=device)
    finish = getattr(model, "finish_param_sync", None)
    if finish is not None:  # an overlapped gather still writes the parameters (issue 21)
        finish()
    for p in unwrap_model(model).parameters():
        # the sum runs over the world, so data-parallel replicas count on their first rank only
        if counts_once(p, tp_rank=tp_rank, dp_rank=dp_rank, expert_dp_rank=expert_dp_rank):
            local = local_tensor(p)
            total += local.detach().double().square().sum().to(device)
    dist.all_reduce(total)
    return math.sqrt(total.item())
