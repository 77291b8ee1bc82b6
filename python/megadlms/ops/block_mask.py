"""The block-diffusion attention mask (BD3-LM, Arriola et al., ICLR 2025): one builder for the
training pass over ``[x_t ; x_0]`` (2n tokens, x_t first).

Query q sees key k iff (with x_0 indices shifted down by n and blocks of ``block_size``)

* both in x_t, same block (block diagonal: a noised block denoises itself);
* q in x_t, k in x_0, block(q) > block(k) (offset block causal: the clean blocks before it);
* both in x_0, block(q) >= block(k) (block causal: the clean stream, as the KV cache sees it).

:func:`block_diffusion_predicate` is that predicate on index tensors, the one definition; the
SDPA path evaluates it on a grid (a boolean mask), the FlexAttention path hands it to
``create_block_mask`` as its ``mask_mod`` (CUDA only: compiled there). Positions at or beyond
``2n`` (sequence-parallel padding) see only themselves and are seen by nobody real.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class BlockDiffusion(NamedTuple):
    """What a model's ``[x_t ; x_0]`` pass needs to build its mask."""

    block_size: int
    shift: int = 0
    """Index i lies in block (i + shift) // block_size (generation after a prompt whose length
    is not a multiple of the block size puts a block boundary at the prompt's end)."""
    causal_clean: bool = False
    """x_0 token-causal instead of block-causal (--difflm-ar-loss-weight: the AR loss on x_0
    must not see the token it predicts); x_t's view of x_0 (the blocks before) is unchanged."""


def block_diffusion_predicate(
    q: torch.Tensor, kv: torch.Tensor, n: int, block_size: int, shift: int = 0, causal_clean: bool = False
) -> torch.Tensor:
    """True where query index ``q`` may attend to key index ``kv`` (broadcasting int64 tensors)
    in the ``[x_t ; x_0]`` sequence of 2 * ``n`` tokens; padding beyond 2n sees itself only.
    ``shift`` / ``causal_clean``: as :class:`BlockDiffusion`'s."""
    q_clean, kv_clean = q >= n, kv >= n
    q_block = (torch.where(q_clean, q - n, q) + shift) // block_size
    kv_block = (torch.where(kv_clean, kv - n, kv) + shift) // block_size
    diagonal = (q_block == kv_block) & ~q_clean & ~kv_clean  # x_t's blocks; x_0 with x_0 is below
    offset_causal = (q_block > kv_block) & kv_clean & ~q_clean
    clean_causal = ((kv <= q) if causal_clean else (q_block >= kv_block)) & kv_clean & q_clean
    real = (q < 2 * n) & (kv < 2 * n)
    return (real & (diagonal | offset_causal | clean_causal)) | ((q >= 2 * n) & (q == kv))


def block_diffusion_mask(
    n: int,
    spec: BlockDiffusion,
    device: torch.device,
    implementation: str = "TEDotProductAttention",
    total: Optional[int] = None,
):
    """The mask of a ``[x_t ; x_0]`` pass of 2 * ``n`` tokens (``total`` >= 2n with padding):
    TEDotProductAttention a boolean [total, total] mask for SDPA (True = attend);
    FlexAttention a flex BlockMask of the same predicate (whose masked-out tiles are skipped)."""
    block_size, shift, causal = spec
    if block_size <= 0 or n <= 0:
        raise ValueError(f"block diffusion needs n ({n}) and block_size ({block_size}) positive")
    total = 2 * n if total is None else total
    if implementation == "FlexAttention":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q, kv):
            return block_diffusion_predicate(q, kv, n, block_size, shift, causal)

        return create_block_mask(mask_mod, None, None, total, total, device=device)
    idx = torch.arange(total, device=device)
    return block_diffusion_predicate(idx[:, None], idx[None, :], n, block_size, shift, causal)
