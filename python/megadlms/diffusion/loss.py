"""The scorers of the running modes: a model's logits against an objective's targets
(objective.py builds the targets; every caller scores through these)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from megadlms.common.enums import AttnMaskType, RunningMode, SFTLossNormalization

from .config import DiffusionConfig


class LossSums(NamedTuple):
    """A scorer's result: two 0-d fp32 tensors."""

    loss_sum: torch.Tensor
    """Sum of the (weighted) token losses."""
    num_tokens: torch.Tensor
    """Loss tokens counted (the normaliser's share of this batch)."""


TokenCrossEntropy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logits [..., V'], targets [...]) -> per-token fp32 losses [...]``."""


def plain_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy over the full vocab, in fp32 (the default scorer)."""
    # fp32 whatever the logits' dtype: a bf16 log-softmax over a large vocabulary loses the loss's precision.
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, targets.reshape(-1), reduction="none").view(targets.shape)


def token_cross_entropy_of(model: torch.nn.Module) -> TokenCrossEntropy:
    """The scorer of ``model``'s logits: the ``token_cross_entropy`` of the first module in
    ``model.modules()`` that has one (GPTModel: vocab-parallel under tensor parallelism, where
    the logits are a vocab slice), else :func:`plain_token_cross_entropy`.

    Searching the module tree (pre-order: a wrapper's ``.module`` comes right after it) finds
    the model inside any data-parallel wrapper without this layer knowing the wrappers
    (diffusion sits below distributed)."""
    for m in model.modules():
        scorer = getattr(m, "token_cross_entropy", None)
        if scorer is not None:
            return scorer
    return plain_token_cross_entropy


def num_tokens(reference: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Loss tokens (0-d fp32): ``loss_mask``'s sum, or every position of ``reference``."""
    if loss_mask is None:
        return torch.tensor(float(reference.numel()), device=reference.device)
    return loss_mask.to(torch.float32).sum()


def diffusion_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    masked: torch.Tensor,
    p_mask: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    cross_entropy: TokenCrossEntropy = plain_token_cross_entropy,
) -> LossSums:
    """Masked-diffusion loss: (sum over masked loss tokens of CE / p_mask, number of loss tokens).

    logits [b,S,V] (any float dtype; CE is taken in fp32), tokens int64 [b,S] (the clean
    sequence), masked bool [b,S], p_mask float [b,S], loss_mask float [b,S] or None.
    Only masked positions are gathered before the softmax (a host sync point: boolean
    indexing), so the fp32 copy is ~p of the logits. Returns two 0-d fp32 tensors.
    ``cross_entropy``: the per-token scorer (:func:`token_cross_entropy_of` the model; under
    tensor parallelism the logits are a vocab slice and only the model's scorer is right).
    """
    if logits.shape[:2] != tokens.shape or masked.shape != tokens.shape:
        raise ValueError(
            f"shape mismatch: logits {tuple(logits.shape)}, tokens "
            f"{tuple(tokens.shape)}, masked {tuple(masked.shape)}"
        )
    # The ELBO weight 1/p: a masked token's CE counts as if every token had been masked with probability p,
    # which makes the sum an unbiased NELBO estimate; unmasked positions get weight 0.
    weight = masked.to(torch.float32) / p_mask.to(torch.float32)
    if loss_mask is not None:
        weight = weight * loss_mask.to(torch.float32)
    # Select before the CE: only ~p of the positions reach the fp32 softmax. The boolean index syncs with the
    # host (the size of the selection is data-dependent).
    sel = weight != 0
    ce = cross_entropy(logits[sel], tokens[sel])
    # The count is of all loss tokens, masked or not: the NELBO is per token of the sequence, and the trainer
    # divides the step's summed losses once by the global count.
    return LossSums((ce * weight[sel]).sum(), num_tokens(tokens, loss_mask))


def sft_weights(answer_mask: torch.Tensor, normalization: SFTLossNormalization) -> torch.Tensor:
    """Per-position loss weights [b, S] (fp32) of the fine-tuning objective: 'sample' (LLaDA's)
    1 / (the row's answer length) on its answer positions, so a row's weights sum to 1 and the
    trainer's division by the summed weights is the mean over samples; 'token' 1 on every
    answer position (the global answer-token mean). Computed on whole rows, before any
    context-parallel slice, so each slice keeps its row's true answer length."""
    answer = answer_mask.to(torch.float32)
    if normalization is SFTLossNormalization.TOKEN:
        return answer
    lengths = answer.sum(dim=1, keepdim=True)
    return answer / lengths.clamp(min=1.0)


def sft_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    masked: torch.Tensor,
    p_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    cross_entropy: TokenCrossEntropy = plain_token_cross_entropy,
) -> torch.Tensor:
    """LLaDA's SFT loss of one batch (GUIDELINES.md, "SFT"): the sum over masked answer
    positions of CE / p, each divided by its row's answer length (EOS padding included),
    over the number of rows. 0-d fp32.

    logits [b,S,V], targets int64 [b,S] (the clean sequence), masked bool [b,S] (from
    :func:`~megadlms.diffusion.noise.sft_forward_process`: never True outside the answer),
    p_mask [b,S], answer_mask bool [b,S] (True at answer positions; LLaDA's layout:
    positions >= the prompt length). The trainer computes the same sum through
    :func:`sft_weights` and :func:`diffusion_loss` and divides by the global row count."""
    weights = sft_weights(answer_mask, SFTLossNormalization.SAMPLE)
    sums = diffusion_loss(
        logits, targets, masked & answer_mask.to(torch.bool), p_mask, weights, cross_entropy
    )
    return sums.loss_sum / targets.shape[0]


def ar_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    cross_entropy: TokenCrossEntropy = plain_token_cross_entropy,
) -> LossSums:
    """Autoregressive loss on already-shifted labels: (sum of CE * loss_mask, loss tokens).
    ``cross_entropy``: as for :func:`diffusion_loss`."""
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}")
    ce = cross_entropy(logits.flatten(0, 1), labels.flatten())
    if loss_mask is not None:
        ce = ce * loss_mask.flatten().to(torch.float32)
    return LossSums(ce.sum(), num_tokens(labels, loss_mask))


def check_model_for_mode(model: torch.nn.Module, config: DiffusionConfig) -> None:
    """Reject model/objective combinations that would train on wrong targets. ``model`` is
    the plain (unwrapped) model; the trainer calls this once, before the first step."""
    attention = getattr(model, "attention", None)
    if config.model_running_mode is RunningMode.VANILLA and attention == AttnMaskType.BIDIRECTIONAL:
        raise ValueError(
            "model_running_mode vanilla needs a causal model: a bidirectional "
            "model sees the next token it is asked to predict"
        )
    if config.model_running_mode is RunningMode.DIFFLM_SHIFT and attention == AttnMaskType.CAUSAL:
        raise ValueError(
            "model_running_mode difflm-shift needs a bidirectional model (Dream's mask predictor): "
            "a causal one never sees the unmasked tokens after a masked one"
        )
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "vocab_size"):
        config.check_vocab(model_config.vocab_size)
