"""Deterministic validation NELBO (per token) and its perplexity bound."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, Optional

import torch

from .config import DiffusionConfig
from .loss import check_model_for_mode, token_cross_entropy_of
from .noise import validation_times
from .objective import loss_token_count, validation_draws, validation_inputs

__all__ = ["validation_nelbo", "validation_times"]


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
    and batch sizes. vanilla: the plain per-token NLL. Each draw is
    ``objective.validation_inputs``: the trainer's forward-only pipeline scores the same.

    Returns {"nelbo", "ppl_bound" = exp(nelbo), "loss_sum", "num_tokens"}; data-parallel
    callers all-reduce loss_sum and num_tokens and divide.
    """
    k = validation_draws(config, num_mc_samples)
    check_model_for_mode(model, config)
    if seed is not None and seed != config.seed:
        config = dataclasses.replace(config, seed=seed)  # the mask draws use config.seed too
    scorer = token_cross_entropy_of(model)
    was_training = model.training
    model.eval()
    total = 0.0
    count = 0.0
    try:
        for batch in batches:
            for draw in range(k):
                inputs = validation_inputs(batch, config, draw, k)
                loss_sum, _ = inputs.score(inputs.forward(model), scorer)
                # The K draws are averaged into the sum while the tokens are counted once: K copies estimate
                # one sequence's NELBO, they are not K more sequences.
                total += loss_sum.double().item() / k
            count += loss_token_count(batch, None, config, validation=True).double().item()
    finally:
        model.train(was_training)
    if count <= 0:
        raise ValueError(
            "validation_nelbo got no loss tokens: empty validation data or an all-zero loss_mask"
        )
    nelbo = total / count
    # exp overflows float64 past ~709: a diverged early evaluation still reports a (huge) number.
    return {"nelbo": nelbo, "ppl_bound": math.exp(min(nelbo, 700.0)), "loss_sum": total, "num_tokens": count}
