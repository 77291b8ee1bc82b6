"""Block diffusion (BD3-LM, Arriola et al., ICLR 2025; kuleshov-group/bd3lms): the noise of a
sequence cut into blocks of ``block_size`` tokens, and the ``[x_t ; x_0]`` pass it trains with.

Each block k of a row draws its own t_k (counter-based, keyed by (seed, sample index, draw,
k); clipped to U(low, high) as BD3-LM's sampling_eps_min/max), p_k = (1 - eps) t_k + eps, and
position j is masked iff its uniform u(seed, sample, draw, j) (the full-sequence objective's)
is below p of its block. 'realised' p (MegaDLMs) is taken per block: a block with loss tokens
but none masked gets one forced mask, and p is its realised masked fraction. The last block
may be shorter (the 'megadlms' objective's L - 1 tokens).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megadlms.common.enums import PMaskMode

from .config import DiffusionConfig
from .loss import LossSums, diffusion_loss
from .noise import TAG_MASK, counter_uniform, realise_masks

TAG_BLOCK_TIME = 5  # t of each block of a sample
TAG_VALID_BLOCK_TIME = 6  # stratified t of each block of a validation draw


def clip_times(u: torch.Tensor, config: DiffusionConfig) -> torch.Tensor:
    """t = low + (high - low) u (BD3-LM's clipped noise range; identity for (0, 1))."""
    return u * (config.noise_clip_high - config.noise_clip_low) + config.noise_clip_low


def num_blocks(length: int, block_size: int) -> int:
    """Blocks of ``length`` tokens (the last one may be short)."""
    return -(-length // block_size)


def block_times(
    config: DiffusionConfig, sample_idx: torch.Tensor, draw: int, num_blocks: int, num_draws: int = 0
) -> torch.Tensor:
    """t [b, num_blocks] (float64): training (``num_draws`` 0) uniform, clipped; validation draw
    ``draw`` of ``num_draws``: stratified per block, (draw + u) / K, as the full-sequence NELBO."""
    blocks = torch.arange(num_blocks, dtype=torch.int64, device=sample_idx.device)
    if num_draws:
        u = counter_uniform(config.seed, TAG_VALID_BLOCK_TIME, sample_idx[:, None], draw, blocks[None, :])
        return (draw + u) / num_draws
    u = counter_uniform(config.seed, TAG_BLOCK_TIME, sample_idx[:, None], draw, blocks[None, :])
    return clip_times(u, config)


def block_forward_process(
    tokens: torch.Tensor,
    sample_idx: torch.Tensor,
    config: DiffusionConfig,
    loss_mask: Optional[torch.Tensor] = None,
    *,
    t: Optional[torch.Tensor] = None,
    draw: int = 0,
    p_mask_mode: Optional[PMaskMode] = None,
    offset: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask ``tokens`` [b, S] block by block (t per block, ``t`` [b, num_blocks] or drawn);
    token i lies in block (i + ``offset``) // block_size (difflm-shift: 1, the model's first
    token comes before ``tokens``). Returns (noisy int64, masked bool, p_mask float32), each
    [b, S], as ``forward_process``."""
    B = config.block_size
    if B is None:
        raise ValueError("block_forward_process needs config.block_size (--difflm-block-size)")
    b, S = tokens.shape
    device = tokens.device
    nb = num_blocks(S + offset, B)
    sample_idx = torch.as_tensor(sample_idx, dtype=torch.int64, device=device).reshape(-1)
    if t is None:
        t = block_times(config, sample_idx, draw, nb)
    p_bk = (1.0 - config.mask_eps) * t.to(device=device, dtype=torch.float64) + config.mask_eps
    positions = torch.arange(S, dtype=torch.int64, device=device)
    u_bS = counter_uniform(config.seed, TAG_MASK, sample_idx[:, None], draw, positions[None, :])
    p_bS = p_bk.repeat_interleave(B, dim=1)[:, offset : offset + S]
    masked = u_bS < p_bS
    if (p_mask_mode or config.p_mask) == PMaskMode.SAMPLED:
        p_mask = p_bS.to(torch.float32)
    else:  # 'realised' per block: the rows of [b * nb, B], short blocks padded (no loss there)
        pad = (offset, nb * B - S - offset)
        is_loss = torch.ones_like(masked) if loss_mask is None else loss_mask > 0
        rows = [F.pad(x, pad, value=False).reshape(b * nb, B) for x in (masked, is_loss)]
        u_rows = F.pad(u_bS, pad, value=3.0).reshape(b * nb, B)
        m_rows, p_rows = realise_masks(rows[0], u_rows, rows[1])
        masked = m_rows.reshape(b, nb * B)[:, offset : offset + S]
        p_mask = p_rows.reshape(b, nb * B)[:, offset : offset + S]
    noisy = torch.where(masked, torch.full_like(tokens, config.mask_token_id), tokens)
    return noisy, masked, p_mask.contiguous()


def two_stream(
    noisy: torch.Tensor, clean: torch.Tensor, position_ids: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The pass's input ``[x_t ; x_0]`` [b, 2S] and its positions (x_0 repeats x_t's)."""
    b, S = noisy.shape
    if position_ids is None:
        position_ids = torch.arange(S, device=noisy.device)
    position_ids = position_ids.expand(b, S)
    return torch.cat([noisy, clean], dim=1), torch.cat([position_ids, position_ids], dim=1)


def logit_index(n: int, block_size: int, device: torch.device) -> torch.Tensor:
    """difflm-shift: where in the [x_t ; x_0] logits [b, 2n, V] each logit position i (which
    predicts token i + 1) is read: in x_t, except for a token that starts a block, predicted
    from x_0's last position of the block before (the clean prefix, as generation has it)."""
    i = torch.arange(n, device=device)
    return torch.where((i + 1) % block_size == 0, i + n, i)


def block_score(
    logits, cross_entropy, clean, masked, p_mask, loss_mask, *, index=None, ar_weight: float = 0.0
) -> LossSums:
    """The block-diffusion loss: x_t's diffusion loss (``index``: :func:`logit_index`, difflm-
    shift) plus ``ar_weight`` times the autoregressive loss of x_0 (difflm-shift: x_0's logits
    at i predict ``clean[i]``, token i + 1), both over the same loss tokens."""
    n = clean.shape[1]
    x_t = logits[:, :n] if index is None else logits.index_select(1, index)
    sums = diffusion_loss(x_t, clean, masked, p_mask, loss_mask, cross_entropy)
    if not ar_weight:
        return sums
    ce = cross_entropy(logits[:, n : 2 * n].reshape(-1, logits.shape[-1]), clean.reshape(-1))
    weight = torch.ones_like(ce) if loss_mask is None else loss_mask.reshape(-1).to(torch.float32)
    return LossSums(sums.loss_sum + ar_weight * (ce * weight).sum(), sums.num_tokens)
