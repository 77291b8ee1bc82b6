"""One denoising step of the samplers: how many tokens a step commits
(:func:`get_num_transfer_tokens`), the Gumbel noise of sampling, the logits of a step (with
classifier-free guidance and the running mode's shift) and the commit rule (low confidence or
random remasking, or a confidence threshold). Shared by the full-sequence sampler
(:mod:`.sampler`) and the block-diffusion sampler (:mod:`.block_sampler`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .shift import position_logits
from .vocab import token_logits

REMASKING = ("low_confidence", "random")


def get_num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit per step: masks of each row spread evenly, remainder first.

    block_mask bool [b, L] -> int64 [b, steps], each row summing to its mask count.
    """
    num = block_mask.sum(dim=1, keepdim=True)
    base, rem = num // steps, num % steps
    step_ids = torch.arange(steps, device=block_mask.device)[None, :]
    return base + (step_ids < rem).to(torch.int64)


def add_gumbel_noise(
    logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Scores whose argmax samples softmax(logits / temperature): exp(l) / (-log u)^T in
    float64 (low-precision Gumbel-max hurts generation quality, arXiv:2409.02908)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    # Gumbel-max in product form: log of this is l - T log(-log u) = l + T g with g ~ Gumbel, so the argmax
    # samples softmax(l / T).
    return logits.exp() / (-torch.log(u)) ** temperature


def check_arguments(prompt, gen_length, steps, block_length, temperature, remasking, cfg_scale) -> None:
    """The argument rules of :func:`generate`, each a ValueError naming the argument."""
    if prompt.dim() != 2:
        raise ValueError(f"prompt must be int64 [batch, length], got shape {tuple(prompt.shape)}")
    if gen_length <= 0 or block_length <= 0 or steps <= 0:
        raise ValueError(
            f"gen_length ({gen_length}), block_length ({block_length}) and steps ({steps}) must be positive"
        )
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    if steps % (gen_length // block_length):
        raise ValueError(
            f"steps ({steps}) must be a multiple of the number of blocks "
            f"gen_length/block_length = {gen_length // block_length}"
        )
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
    if temperature < 0 or cfg_scale < 0:
        raise ValueError(f"temperature ({temperature}) and cfg_scale ({cfg_scale}) must be >= 0")


def check_threshold(threshold: Optional[float]) -> None:
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1] (a confidence), got {threshold}")


def step_logits(model, x, prompt_index, mask_token_id, cfg_scale, vocab_size, forward, mode) -> torch.Tensor:
    """Token logits of ``x`` (a slice of the sequence, with its part of ``prompt_index``) through
    ``forward(batch) -> logits``; with classifier-free guidance the pair [x; x with the prompt
    masked] in one batch. ``mode``: the running mode, whose rule (``shift.position_logits``)
    gives each position the logits that predict it."""
    if cfg_scale > 0:
        uncond = x.clone()
        uncond[prompt_index] = mask_token_id
        cond_logits, uncond_logits = forward(torch.cat([x, uncond])).chunk(2)
        logits = uncond_logits + (cfg_scale + 1) * (cond_logits - uncond_logits)
    else:
        logits = forward(x)
    logits = position_logits(logits, mode)
    # The real tokens only (vocab-parallel slices gathered, Megatron's padding rows cut): no padding id can be
    # drawn, and confidences are probabilities over the tokens, as the Hugging Face export computes them.
    logits = token_logits(model, logits, vocab_size)
    if not 0 <= mask_token_id < logits.shape[-1]:
        raise ValueError(
            f"mask_token_id {mask_token_id} is outside the model's vocabulary of {logits.shape[-1]}"
        )
    return logits


def commit(
    logits, x, mask_index, end, num_transfer, mask_token_id, temperature, remasking, generator, threshold
):
    """One denoising step's commits on ``x`` [b, L] (a slice of the sequence) from its ``logits``:
    the ``num_transfer`` [b] most confident masked positions before ``end`` (the current block's
    end, in the slice); with ``threshold`` (Fast-dLLM's parallel decoding) every one whose
    confidence reaches it, and always at least the most confident one."""
    # [MASK] is excluded from the draw only; confidence is LLaDA's p(x0) from the
    # unmodified logits (not renormalised over the non-[MASK] tokens).
    draw_logits = logits.clone()
    draw_logits[..., mask_token_id] = float("-inf")
    x0 = add_gumbel_noise(draw_logits, temperature, generator).argmax(dim=-1)
    if remasking == "low_confidence":
        probs = F.softmax(logits, dim=-1)
        conf = probs.gather(-1, x0[..., None]).squeeze(-1).to(torch.float64)
    else:
        conf = torch.rand(x0.shape, dtype=torch.float64, device=x.device, generator=generator)
    conf[:, end:] = float("-inf")  # later blocks wait their turn
    # Positions not masked (prompt, committed) keep their value in x0 and get -inf confidence, so
    # even a topk that reaches them changes nothing.
    x0 = torch.where(mask_index, x0, x)
    conf = torch.where(mask_index, conf, torch.full_like(conf, float("-inf")))
    transfer = torch.zeros_like(mask_index)
    if threshold is not None:
        # Fast-dLLM's rule: every masked position of the block at or above the threshold, and the
        # row's most confident one even when none reaches it (a row with no mask left commits nothing).
        has_mask = torch.isfinite(conf).any(dim=1)
        transfer = (conf >= threshold) & torch.isfinite(conf)
        transfer[has_mask, conf[has_mask].argmax(dim=1)] = True
        return torch.where(transfer, x0, x)
    k_per_row = num_transfer.tolist()
    # topk row by row: rows may commit different k (their blocks held different numbers of masks).
    for j, k in enumerate(k_per_row):
        if k > 0:
            transfer[j, torch.topk(conf[j], k).indices] = True
    return torch.where(transfer, x0, x)
