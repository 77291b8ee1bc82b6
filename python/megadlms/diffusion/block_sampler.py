"""Block-diffusion generation (BD3-LM): autoregressive over blocks of the model's block size,
each block denoised by the sampler's steps (or its confidence threshold); stop at the block
that holds EOS.

Blocks are aligned so that a boundary falls at the prompt's end (the prompt's own blocks end
there too). The model sees what its training pass showed x_t block b: the clean blocks
before b (block-causal among themselves) and block b as it is now. Two equal ways to run it:

* ``cache="prefix"`` (exact for a block-diffusion model: committed blocks never change): the
  keys/values of each clean block are written once, after it is committed (or, for the
  prompt, block by block), and each step runs the current block alone against them;
* no cache: each step runs the training pass ``[x_t ; x_0]`` over everything up to the
  current block (the reference; every key recomputed).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from megadlms.common.enums import RunningMode
from megadlms.ops.block_mask import BlockDiffusion
from megadlms.ops.kv_cache import KVCache

from .denoise import commit, get_num_transfer_tokens, step_logits
from .shift import predicts_next


def model_block_size(model: torch.nn.Module) -> Optional[int]:
    """The block size a model was trained with (``config.difflm_block_size``), else None."""
    return getattr(getattr(model, "config", None), "difflm_block_size", None)


class _BlockForwards:
    """The model calls of one block-diffusion generation (see the module docstring)."""

    def __init__(self, model, block_size: int, shift: int, cached: bool, shifted: bool) -> None:
        self.model, self.block_size, self.shift, self.shifted = model, block_size, shift, shifted
        self.kv: Optional[KVCache] = KVCache() if cached else None
        self.last: Optional[torch.Tensor] = None  # difflm-shift: the last commit's last logits
        self.nfe = 0

    def commit(self, x: torch.Tensor, start: int, end: int) -> None:
        """Write the keys/values of the clean block x[:, start:end] (cache only)."""
        if self.kv is not None:
            self.nfe += 1
            self.kv.truncate(start)
            logits = self.model(x[:, start:end], kv_cache=self.kv, cache_offset=start)
            self.last = logits[:, -1:]  # difflm-shift: the predictor of the next block's first token

    def __call__(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Logits that predict the current block x[:, start:end] given the clean blocks before it
        (difflm-shift: the first from the clean prefix's last position, the rest from the
        positions before them, as the training pass scores them)."""
        self.nfe += 1
        if self.kv is not None:
            self.kv.truncate(start)
            logits = self.model(x[:, start:end], kv_cache=self.kv, cache_offset=start)
            if not self.shifted:
                return logits
            assert self.last is not None  # set by the prefix's forward before the first block
            return torch.cat([self.last, logits[:, :-1]], dim=1)
        prefix = x[:, :end]
        both = torch.cat([prefix, prefix], dim=1)
        logits = self.model(both, block_diffusion=BlockDiffusion(self.block_size, self.shift))
        if self.shifted:  # x_0's position start - 1, then x_t's positions start .. end - 2
            return torch.cat([logits[:, end + start - 1 : end + start], logits[:, start : end - 1]], dim=1)
        return logits[:, start:end]


@torch.no_grad()
def generate_blocks(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_token_id: int,
    block_size: int,
    gen_length: int,
    steps: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    generator: Optional[torch.Generator] = None,
    vocab_size: Optional[int] = None,
    threshold: Optional[float] = None,
    cache: Optional[str] = "prefix",
    eos_token_id: Optional[int] = None,
    stats: Optional[Dict[str, Any]] = None,
    running_mode: RunningMode = RunningMode.DIFFLM_NOSHIFT,
) -> torch.Tensor:
    """Complete ``prompt`` [b, P] block by block -> [b, P + n * block_size] (n <= gen_length /
    block_size: generation stops after the block in which every row has produced
    ``eos_token_id``). ``steps``: denoising steps of all blocks (a multiple of their number);
    ``cache``: "prefix" (exact) or None (recompute everything); ``running_mode`` difflm-shift:
    each token from the logits before it (a prompt of at least one token). Called by
    :func:`~megadlms.diffusion.sampler.generate` for a model with a block size."""
    if gen_length % block_size or steps % (gen_length // block_size):
        raise ValueError(
            f"block diffusion: gen_length ({gen_length}) must be a multiple of the block size "
            f"({block_size}) and steps ({steps}) of the number of blocks"
        )
    if cache not in (None, "prefix"):
        raise ValueError(f"block diffusion runs cache 'prefix' (exact) or None, got {cache!r}")
    b, P = prompt.shape
    shifted = predicts_next(RunningMode(running_mode))
    if shifted and P == 0:
        raise ValueError(
            "a difflm-shift model needs a prompt of at least one token (position 0 has no predictor)"
        )
    num_blocks = gen_length // block_size
    x = torch.cat(
        [prompt, torch.full((b, gen_length), mask_token_id, dtype=prompt.dtype, device=prompt.device)], 1
    )
    forwards = _BlockForwards(model, block_size, (-P) % block_size, cache == "prefix", shifted)
    # the prompt's blocks end at P: boundaries at P - k * block_size
    bounds = sorted({0, *range(P % block_size, P + 1, block_size)})
    for lo, hi in zip(bounds, bounds[1:]):
        forwards.commit(x, lo, hi)
    block_nfe: List[int] = []
    done = torch.zeros(b, dtype=torch.bool, device=x.device)
    end = P
    for block in range(num_blocks):
        start, end = P + block * block_size, P + (block + 1) * block_size
        num_transfer = get_num_transfer_tokens(x[:, start:end] == mask_token_id, steps // num_blocks)
        step = 0
        while (
            step < steps // num_blocks
            if threshold is None
            else bool((x[:, start:end] == mask_token_id).any())
        ):
            part = x[:, start:end]
            logits = step_logits(
                model, part, None, mask_token_id, 0.0, vocab_size,
                lambda _: forwards(x, start, end), RunningMode.DIFFLM_NOSHIFT,  # noqa: B023 (called at once)
            )  # fmt: skip
            k = num_transfer[:, step] if threshold is None else None
            x[:, start:end] = commit(
                logits, part, part == mask_token_id, block_size, k, mask_token_id, temperature, remasking,
                generator, threshold,
            )  # fmt: skip
            step += 1
        block_nfe.append(step)
        if block < num_blocks - 1:
            forwards.commit(x, start, end)
        if eos_token_id is not None:
            done |= (x[:, start:end] == eos_token_id).any(dim=1)
            if bool(done.all()):
                break
    if stats is not None:
        stats["nfe"], stats["block_nfe"] = forwards.nfe, block_nfe
    return x[:, :end]
