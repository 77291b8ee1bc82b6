"""Losses of the two running modes and ``compute_loss``, the one call the trainer makes."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .config import DiffusionConfig
from .noise import forward_process, varilen_length


def _num_tokens(reference: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    if loss_mask is None:
        return torch.tensor(float(reference.numel()), device=reference.device)
    return loss_mask.to(torch.float32).sum()


def diffusion_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    masked: torch.Tensor,
    p_mask: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masked-diffusion loss: (sum over masked loss tokens of CE / p_mask, number of loss tokens).

    logits [b,S,V] (any float dtype; CE is taken in fp32), tokens int64 [b,S] (the clean
    sequence), masked bool [b,S], p_mask float [b,S], loss_mask float [b,S] or None.
    Only masked positions are gathered before the softmax (a host sync point: boolean
    indexing), so the fp32 copy is ~p of the logits. Returns two 0-d fp32 tensors.
    """
    if logits.shape[:2] != tokens.shape or masked.shape != tokens.shape:
        raise ValueError(
            f"shape mismatch: logits {tuple(logits.shape)}, tokens "
            f"{tuple(tokens.shape)}, masked {tuple(masked.shape)}"
        )
    weight = masked.to(torch.float32) / p_mask.to(torch.float32)
    if loss_mask is not None:
        weight = weight * loss_mask.to(torch.float32)
    sel = weight != 0
    ce = F.cross_entropy(logits[sel].float(), tokens[sel], reduction="none")
    return (ce * weight[sel]).sum(), _num_tokens(tokens, loss_mask)


def ar_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive loss on already-shifted labels: (sum of CE * loss_mask, loss tokens)."""
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}")
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    if loss_mask is not None:
        ce = ce * loss_mask.flatten().to(torch.float32)
    return ce.sum(), _num_tokens(labels, loss_mask)


def check_model_for_mode(model: torch.nn.Module, config: DiffusionConfig) -> None:
    """Reject model/objective combinations that would train on wrong targets. ``model`` is
    the plain (unwrapped) model; the trainer calls this once, before the first step."""
    attention = getattr(model, "attention", None)
    if config.model_running_mode == "vanilla" and attention == "bidirectional":
        raise ValueError(
            "model_running_mode vanilla needs a causal model: a bidirectional "
            "model sees the next token it is asked to predict"
        )
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "vocab_size"):
        config.check_vocab(model_config.vocab_size)


def loss_token_count(batch: Dict[str, torch.Tensor], crop: Optional[int] = None) -> torch.Tensor:
    """Loss tokens of ``batch`` after an optional crop to ``crop`` positions (0-d fp32), the
    count ``compute_loss`` returns; the trainer sums it over the step before the forward."""
    labels, loss_mask = batch["labels"], batch.get("loss_mask")
    if crop is not None:
        labels = labels[:, :crop]
        loss_mask = None if loss_mask is None else loss_mask[:, :crop]
    return _num_tokens(labels, loss_mask)


_AUTO = object()


def compute_loss(
    model: torch.nn.Module,
    batch: Dict[str, torch.Tensor],
    config: DiffusionConfig,
    iteration: int,
    crop=_AUTO,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, object]]:
    """One micro-batch: (loss_sum 0-d fp32, num_loss_tokens 0-d, stats).

    batch: "tokens", "labels" (= text[1:]), "loss_mask", "position_ids", "sample_idx".
    difflm-noshift: the clean sequence is ``labels`` (aligned with loss_mask), cropped to
    ``crop`` positions (default: drawn here by ``varilen_length(seed, iteration, ...)``; the
    trainer draws it once per step and passes it), masked by ``forward_process`` and
    scored with ``diffusion_loss``. vanilla: model(tokens) scored against labels.
    The caller divides by the global number of loss tokens of the step.
    ``check``: run :func:`check_model_for_mode` on ``model`` first (the trainer has already).
    stats: "seq_length" (int, after any crop) and, in difflm mode, "num_masked" (0-d tensor;
    reading it with .item() is a device sync).
    """
    if check:
        check_model_for_mode(model, config)
    loss_mask = batch.get("loss_mask")
    position_ids = batch.get("position_ids")
    if config.model_running_mode == "vanilla":
        tokens, labels = batch["tokens"], batch["labels"]
        logits = model(tokens, position_ids)
        loss_sum, num_tokens = ar_loss(logits, labels, loss_mask)
        return loss_sum, num_tokens, {"seq_length": tokens.shape[1]}
    clean = batch["labels"]
    if "sample_idx" not in batch:
        raise ValueError(
            "difflm-noshift needs batch['sample_idx'] (the global sample indices "
            "that seed the noise); use the data package's collate"
        )
    if crop is _AUTO:
        crop = varilen_length(config.seed, iteration, clean.shape[1], config.varilen_prob)
    if crop is not None:
        clean = clean[:, :crop]
        loss_mask = loss_mask[:, :crop] if loss_mask is not None else None
        position_ids = position_ids[:, :crop] if position_ids is not None else None
    noisy, masked, p_mask = forward_process(clean, batch["sample_idx"], config, loss_mask)
    logits = model(noisy, position_ids)
    loss_sum, num_tokens = diffusion_loss(logits, clean, masked, p_mask, loss_mask)
    stats = {"seq_length": clean.shape[1], "num_masked": masked.sum()}
    return loss_sum, num_tokens, stats
