"""Losses of the two running modes and ``compute_loss``, the one call the trainer makes."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .config import DiffusionConfig
from .noise import forward_process, micro_batch_crop

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
    cross_entropy: TokenCrossEntropy = plain_token_cross_entropy,
) -> Tuple[torch.Tensor, torch.Tensor]:
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
    return (ce * weight[sel]).sum(), _num_tokens(tokens, loss_mask)


def ar_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    cross_entropy: TokenCrossEntropy = plain_token_cross_entropy,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive loss on already-shifted labels: (sum of CE * loss_mask, loss tokens).
    ``cross_entropy``: as for :func:`diffusion_loss`."""
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}")
    ce = cross_entropy(logits.flatten(0, 1), labels.flatten())
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


def objective_inputs(
    batch: Dict[str, torch.Tensor], config: DiffusionConfig, crop: Optional[int] = None
) -> Dict[str, Optional[torch.Tensor]]:
    """The clean sequence the difflm-noshift objective denoises, with its loss mask, position
    ids and (document packing) document ids, after an optional crop to ``crop`` positions.

    'megadlms': MegaDLMs crops tokens/labels/positions to L = crop (or S), then drops one
    position: input and target are text[1:L] = ``labels[:, :L-1]``, positions
    ``position_ids[:, 1:L]``, loss mask ``loss_mask[:, :L-1]`` (L-1 tokens).
    'llada': the target is ``labels[:, :L]`` with ``position_ids[:, :L]`` (L tokens).
    ``document_ids`` (present when packing) are aligned with ``labels``; cropped like them.
    """
    labels = batch["labels"]
    S = labels.shape[1]
    L = S if crop is None else crop
    loss_mask, position_ids = batch.get("loss_mask"), batch.get("position_ids")
    document_ids = batch.get("document_ids")
    if config.objective == "megadlms":
        # labels[j] is text[j + 1] and position_ids[j + 1] is its position: the two slices are one token apart
        # but describe the same tokens text[1:L].
        lab, pos = slice(0, L - 1), slice(1, L)
    else:
        lab, pos = slice(0, L), slice(0, L)
    docs = None if document_ids is None else document_ids[:, lab]
    if docs is not None and config.objective == "llada":
        # the target is labels (text[1:]): positions restart at each of ITS documents
        idx = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
        new_doc = torch.ones_like(docs, dtype=torch.bool)
        new_doc[:, 1:] = docs[:, 1:] != docs[:, :-1]
        # cummax carries the start of the latest document forward; subtracting it restarts positions at 0.
        position_ids = idx - torch.where(new_doc, idx, torch.zeros_like(idx)).cummax(dim=1).values
        pos = slice(None)
    return {
        "clean": labels[:, lab],
        "loss_mask": None if loss_mask is None else loss_mask[:, lab],
        "position_ids": None if position_ids is None else position_ids[:, pos],
        "document_ids": docs,
    }


def loss_token_count(
    batch: Dict[str, torch.Tensor], crop: Optional[int] = None, config: Optional[DiffusionConfig] = None
) -> torch.Tensor:
    """Loss tokens of ``batch`` after an optional crop to ``crop`` positions (0-d fp32), the
    count ``compute_loss`` returns; the trainer sums it over the step before the forward.
    With a difflm-noshift ``config`` its objective's inputs are counted (MegaDLMs': L-1)."""
    if config is not None and config.model_running_mode != "vanilla":
        # The same objective_inputs as compute_loss, so the counted N is exactly the tokens the losses sum
        # over.
        inputs = objective_inputs(batch, config, crop)
        return _num_tokens(inputs["clean"], inputs["loss_mask"])
    labels, loss_mask = batch["labels"], batch.get("loss_mask")
    if crop is not None:
        labels = labels[:, :crop]
        loss_mask = None if loss_mask is None else loss_mask[:, :crop]
    return _num_tokens(labels, loss_mask)


def _model_forward(model, tokens, position_ids, document_ids):
    if document_ids is None:
        return model(tokens, position_ids)
    return model(tokens, position_ids, document_ids=document_ids)


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

    batch: "tokens", "labels" (= text[1:]), "loss_mask", "position_ids", "sample_idx" and,
    when packing documents, "document_ids". difflm-noshift: the clean sequence is
    :func:`objective_inputs` (per ``config.objective``) after a crop to ``crop`` positions
    (default: drawn here with :func:`micro_batch_crop` for micro-batch 0 of 1; the trainer
    draws it per micro-batch and passes it), masked by ``forward_process`` and scored with
    ``diffusion_loss``. vanilla: model(tokens) scored against labels. Both score with
    :func:`token_cross_entropy_of` the model (vocab-parallel under tensor parallelism: the
    loss is then the same on every TP rank).
    The caller divides by the global number of loss tokens of the step.
    ``check``: run :func:`check_model_for_mode` on ``model`` first (the trainer has already).
    stats: "seq_length" (int, the model's input length) and, in difflm mode, "num_masked"
    (0-d tensor; reading it with .item() is a device sync).
    """
    if check:
        check_model_for_mode(model, config)
    if config.model_running_mode == "vanilla":
        tokens, labels = batch["tokens"], batch["labels"]
        logits = _model_forward(model, tokens, batch.get("position_ids"), batch.get("document_ids"))
        loss_sum, num_tokens = ar_loss(logits, labels, batch.get("loss_mask"), token_cross_entropy_of(model))
        return loss_sum, num_tokens, {"seq_length": tokens.shape[1]}
    if "sample_idx" not in batch:
        raise ValueError(
            "difflm-noshift needs batch['sample_idx'] (the global sample indices "
            "that seed the noise); use the data package's collate"
        )
    if crop is _AUTO:
        # A model that does not say is assumed bidirectional: the difflm default.
        bidirectional = getattr(model, "attention", "bidirectional") != "causal"
        crop = micro_batch_crop(
            config, iteration, 0, 1, batch["labels"].shape[1], bidirectional=bidirectional
        )
    inputs = objective_inputs(batch, config, crop)
    clean, loss_mask = inputs["clean"], inputs["loss_mask"]
    noisy, masked, p_mask = forward_process(clean, batch["sample_idx"], config, loss_mask)
    logits = _model_forward(model, noisy, inputs["position_ids"], inputs["document_ids"])
    loss_sum, num_tokens = diffusion_loss(
        logits, clean, masked, p_mask, loss_mask, token_cross_entropy_of(model)
    )
    stats = {"seq_length": clean.shape[1], "num_masked": masked.sum()}
    return loss_sum, num_tokens, stats
