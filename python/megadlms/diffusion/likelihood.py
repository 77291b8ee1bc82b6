"""Prompt-conditioned log-likelihood of a masked-diffusion LM (LLaDA's estimator).

For a prompt p and an answer a of L tokens, the ELBO of log p(a | p) (LLaDA, Nie et al.
2025, eq. 6 / their ``get_log_likelihood``) keeps the prompt clean and masks answer tokens:

    log p(a | p) >= - E_{l ~ U{1..L}} E_{S ~ uniform l-subset of the answer}
                        [ (L / l) * sum_{j in S} -log p_theta(a_j | p, a with S masked) ]

Monte Carlo with ``mc_samples`` draws, in batches of ``batch_size`` forward rows. Within a
batch the numbers of masked tokens are stratified (LLaDA's batch stratification): one
offset k ~ U{1..L} per batch and l_r = ((k - 1 + floor(r L / b)) mod L) + 1 for row r of
b, so each row's l is still uniform on 1..L (unbiased) while a batch covers 1..L evenly.
The draws are counter-based (seed, batch, row, position), so the estimate is reproducible
and every (prompt, answer) of the same answer length sees the same masks (common random
numbers: the choices of a multiple-choice question are compared under the same noise).

This complements ``validation_nelbo`` (unconditional, every token maskable, t ~ U(0, 1)),
which keeps training's softmax over the padded vocabulary; this estimator scores answers,
so its softmax is over the real tokens only (``vocab.token_logits``): the same number
whether or not the vocabulary was padded.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from megadlms.common.enums import RunningMode

from .noise import counter_uniform
from .shift import position_logits, predicts_next
from .vocab import token_logits

# noise.py's tags are 1..4; these streams must not alias them.
TAG_LL_LENGTH = 5
TAG_LL_MASK = 6

Ids = Union[Sequence[int], torch.Tensor]


def answer_masks(length: int, rows: int, batch: int, seed: int, device=None) -> torch.Tensor:
    """bool [rows, length]: the masked answer positions of batch ``batch`` (rows stratified)."""
    u = counter_uniform(seed, TAG_LL_LENGTH, torch.tensor([batch]), device=device)
    # min(): u * length can round up to length in float64 when u is within 2**-53 of 1.
    k = 1 + min(int(u.item() * length), length - 1)
    r = torch.arange(rows, device=device)
    # A regular grid of counts rotated by k: each row alone is still uniform on 1..L (unbiased), while the
    # rows of a batch cover 1..L evenly (lower variance).
    num = (k - 1 + (r * length) // rows) % length + 1
    # Keyed without the prompt or the answer's ids: answers of equal length get the same masks (common random
    # numbers for comparing the choices of one question).
    pos_u = counter_uniform(
        seed, TAG_LL_MASK, batch, r[:, None], torch.arange(length, device=device)[None, :]
    )
    # Masking the num smallest uniforms of a row picks a uniformly random num-subset of the answer.
    rank = pos_u.argsort(dim=1).argsort(dim=1)  # 0 = smallest uniform
    return rank < num[:, None]


def _logits(model, x: torch.Tensor, prompt_len: int, mask_token_id: int, cfg_scale: float, vocab_size, mode):
    """The real tokens' logits [b, S, U] (``token_logits``) that predict each position (``mode``'s
    rule: ``shift.position_logits``), guided when ``cfg_scale`` > 0."""
    if cfg_scale <= 0:
        return token_logits(model, position_logits(model(x), mode), vocab_size)
    uncond = x.clone()
    # Classifier-free guidance: the unconditional copy has its prompt masked; both run in one forward.
    uncond[:, :prompt_len] = mask_token_id
    cond, unc = model(torch.cat([x, uncond])).chunk(2)
    return token_logits(model, position_logits(unc + (cfg_scale + 1) * (cond - unc), mode), vocab_size)


@torch.no_grad()
def answer_nll_draws(
    model: torch.nn.Module,
    prompt: Ids,
    answer: Ids,
    *,
    mask_token_id: int,
    mc_samples: int = 128,
    batch_size: int = 16,
    cfg_scale: float = 0.0,
    seed: int = 0,
    vocab_size: Optional[int] = None,
    running_mode: RunningMode = RunningMode.DIFFLM_NOSHIFT,
) -> torch.Tensor:
    """float64 [mc_samples]: each draw's (L / l) * sum of masked answer CE; their mean
    estimates -ELBO of log p(answer | prompt). ``model(ids [b, S]) -> logits [b, S, V]``.

    The softmax is over the real tokens only: the first ``vocab_size`` rows (default: the
    model's ``config.unpadded_vocab_size``), so Megatron's padding rows take no probability
    and the score is the one of the same model without them (``megadlms.diffusion.vocab``).
    ``running_mode`` difflm-shift: the answer is scored with the logits before each position
    (``megadlms.diffusion.shift``); the prompt must then hold at least one token."""
    if mc_samples < 1 or batch_size < 1:
        raise ValueError(f"mc_samples ({mc_samples}) and batch_size ({batch_size}) must be >= 1")
    device = next(model.parameters()).device
    prompt_t = torch.as_tensor(prompt, dtype=torch.int64, device=device).reshape(-1)
    answer_t = torch.as_tensor(answer, dtype=torch.int64, device=device).reshape(-1)
    L, P = answer_t.numel(), prompt_t.numel()
    if L == 0:
        raise ValueError("the answer is empty: nothing to score")
    running_mode = RunningMode(running_mode)
    if P == 0 and predicts_next(running_mode):
        raise ValueError(
            f"a {running_mode} model needs a prompt of at least one token (position 0 has no predictor)"
        )
    block = getattr(getattr(model, "config", None), "difflm_block_size", None)
    if block is not None and P + L > block:
        # Its estimate would need the [x_t ; x_0] block pass; full attention is not what it learned.
        raise ValueError(
            f"answer likelihood of a block-diffusion model (difflm_block_size {block}) over {P + L} "
            "tokens is not implemented: it would score with full-sequence attention, which the model "
            "was not trained with; use generation-based tasks (megadlms-generate, lm-eval generate_until)"
        )
    seq = torch.cat([prompt_t, answer_t])
    was_training = model.training
    model.eval()
    out = []
    try:
        for batch, start in enumerate(range(0, mc_samples, batch_size)):
            rows = min(batch_size, mc_samples - start)
            masked = answer_masks(L, rows, batch, seed, device)
            x = seq.expand(rows, -1).clone()
            # x[:, P:] is a view, so the boolean assignment writes into x itself.
            x[:, P:][masked] = mask_token_id
            logits = _logits(model, x, P, mask_token_id, cfg_scale, vocab_size, running_mode)[:, P:]
            if batch == 0:
                _check_answer(answer_t, logits.shape[-1])
            ce = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), answer_t.repeat(rows), reduction="none"
            ).reshape(rows, L)
            # L / l: the ELBO weight for l masked tokens out of L, the discrete counterpart of training's 1/t.
            weight = L / masked.sum(dim=1).to(torch.float64)
            out.append((ce.double() * masked).sum(dim=1) * weight)
    finally:
        model.train(was_training)
    return torch.cat(out)


def _check_answer(answer: torch.Tensor, real: int) -> None:
    """A ValueError (not an index error deep in the CE) for an answer id that is no token."""
    outside = (answer < 0) | (answer >= real)
    if bool(outside.any()):
        raise ValueError(
            f"answer holds id {answer[outside][0].item()}, outside the model's {real} tokens "
            f"(ids 0..{real - 1}; rows past them are Megatron's vocabulary padding)"
        )


def conditional_log_likelihood(model, prompt: Ids, answer: Ids, **kwargs) -> float:
    """LLaDA's estimate of log p(answer | prompt) (the ELBO; see the module docstring).
    Keyword arguments as :func:`answer_nll_draws` (mask_token_id, mc_samples, batch_size,
    cfg_scale, seed, vocab_size, running_mode)."""
    return -answer_nll_draws(model, prompt, answer, **kwargs).mean().item()
