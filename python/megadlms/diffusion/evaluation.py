"""Deterministic validation NELBO (per token) and its perplexity bound."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, Optional

import torch

from .config import DiffusionConfig
from .loss import ar_loss, check_model_for_mode, diffusion_loss, objective_inputs, token_cross_entropy_of
from .noise import TAG_VALID_TIME, counter_uniform, forward_process


def validation_times(
    seed: int,
    sample_idx: torch.Tensor,
    draw: int,
    num_mc_samples: int,
) -> torch.Tensor:
    """Stratified t of Monte Carlo draw k: (k + u(seed, sample, k)) / K, float64 [b].

    Each of the K strata of [0, 1) gets exactly one t per sample, which removes most of the
    variance of the t-integral (MDLM's low-discrepancy sampler, per sequence).
    """
    u = counter_uniform(seed, TAG_VALID_TIME, sample_idx, draw)
    return (draw + u) / num_mc_samples


@torch.no_grad()
def validation_nelbo(
    model: torch.nn.Module,
    batches: Iterable[Dict[str, torch.Tensor]],
    config: DiffusionConfig,
    num_mc_samples: int = 1,
    seed: Optional[int] = None,
) -> Dict[str, float]:
    """Per-token negative ELBO over ``batches`` (dicts as for ``compute_loss``).

    difflm-noshift: for every sample K masked copies with stratified t (see
    ``validation_times``) and p = (1 - eps) t + eps; the estimate is
        NELBO = sum_batches (1/K) sum_k sum_{masked loss tokens} CE / p  /  #loss tokens,
    always with the sampled p (the unbiased estimator) and no variable-length crop. The noise
    depends on (seed, sample_idx, k) only, so the number is reproducible across runs, ranks
    and batch sizes. vanilla: the plain per-token NLL.

    Returns {"nelbo", "ppl_bound" = exp(nelbo), "loss_sum", "num_tokens"}; data-parallel
    callers all-reduce loss_sum and num_tokens and divide.
    """
    if num_mc_samples < 1:
        raise ValueError(f"num_mc_samples must be >= 1, got {num_mc_samples}")
    check_model_for_mode(model, config)
    if seed is not None and seed != config.seed:
        config = dataclasses.replace(config, seed=seed)  # the mask draws use config.seed too
    seed = config.seed
    was_training = model.training
    model.eval()
    total = 0.0
    count = 0.0
    try:
        for batch in batches:
            loss_mask = batch.get("loss_mask")
            position_ids = batch.get("position_ids")
            if config.model_running_mode == "vanilla":
                logits = model(batch["tokens"], position_ids)
                loss_sum, num_tokens = ar_loss(
                    logits, batch["labels"], loss_mask, token_cross_entropy_of(model)
                )
                total += loss_sum.double().item()
                count += num_tokens.double().item()
                continue
            inputs = objective_inputs(batch, config)  # the objective's sequence, no crop
            clean, loss_mask, position_ids = inputs["clean"], inputs["loss_mask"], inputs["position_ids"]
            extra = {} if inputs["document_ids"] is None else {"document_ids": inputs["document_ids"]}
            sample_idx = torch.as_tensor(batch["sample_idx"], dtype=torch.int64, device=clean.device)
            for k in range(num_mc_samples):
                t = validation_times(seed, sample_idx, k, num_mc_samples)
                # draw k+1: training uses draw 0, so validation masks never alias training ones.
                # 'sampled' even when training uses 'realised': only 1/p(t) makes the NELBO an unbiased bound.
                noisy, masked, p_mask = forward_process(
                    clean, sample_idx, config, loss_mask, t=t, draw=k + 1, p_mask_mode="sampled"
                )
                loss_sum, num_tokens = diffusion_loss(
                    model(noisy, position_ids, **extra),
                    clean,
                    masked,
                    p_mask,
                    loss_mask,
                    token_cross_entropy_of(model),
                )
                # The K draws are averaged into the sum while the tokens are counted once: K copies estimate
                # one sequence's NELBO, they are not K more sequences.
                total += loss_sum.double().item() / num_mc_samples
            count += num_tokens.double().item()
    finally:
        model.train(was_training)
    if count <= 0:
        raise ValueError(
            "validation_nelbo got no loss tokens: empty validation data or an all-zero loss_mask"
        )
    nelbo = total / count
    # exp overflows float64 past ~709: a diverged early evaluation still reports a (huge) number.
    return {"nelbo": nelbo, "ppl_bound": math.exp(min(nelbo, 700.0)), "loss_sum": total, "num_tokens": count}
