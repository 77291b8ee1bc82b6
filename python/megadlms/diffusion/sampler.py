"""LLaDA-style sampling: fill [MASK] positions over ``steps`` denoising steps, block by block.

Algorithm (Nie et al. 2025, "Large Language Diffusion Models", Alg. 4/5; their generate.py):
the answer region (gen_length masks after the prompt) is split into blocks of
block_length, filled left to right (semi-autoregressive). A block gets steps/num_blocks
steps; at each step the model predicts every position, a token x0 is drawn per position
(argmax of logits, with Gumbel noise in float64 when temperature > 0), and the k
most-confident masked positions of the current block are committed, where k spreads the
block's masks evenly over its steps (the linear schedule). Confidence is the model's
probability of x0 ("low_confidence" remasking keeps the least confident masked) or a
uniform draw ("random"). Classifier-free guidance mixes logits with those of a copy
whose prompt is masked: l = l_u + (w + 1)(l_c - l_u).

Confidence is LLaDA's: p(x0) under the softmax of the model's unmodified logits (in their
dtype), so p(MASK) > 0 lowers a position's confidence exactly as in LLaDA's generate.py.
The one deliberate difference from LLaDA's reference: the [MASK] logit is set to -inf for
the draw of x0 (only there), so a committed position can never hold [MASK] again
(LLaDA's trained model never predicts it; a small model might, which would leave holes).

Vocabulary: everything above runs on the logits of the real tokens (``vocab.token_logits``):
Megatron's padding rows of the output layer are cut first, so they are never drawn and take
no probability from the confidences (LLaDA's released models have no padding rows).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from megadlms.common.enums import RunningMode
from megadlms.ops.kv_cache import KVCache

from .block_sampler import generate_blocks
from .denoise import (
    check_arguments,
    check_threshold,
    commit,
    get_num_transfer_tokens,
    step_logits,
)
from .shift import predicts_next
from .vocab import real_vocab_size

CACHE_MODES = ("none", "prefix", "dual")


def _cache_mode(cache: Optional[str]) -> Optional[str]:
    """None (recompute every position at every step), "prefix" or "dual"; "none" is None."""
    if cache is None or cache == "none":
        return None
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES} (or None), got {cache!r}")
    return cache


def _padding(attention_mask: Optional[torch.Tensor], b: int, P: int, gen_length: int, device):
    """(keep, position_ids) of a left-padded batch: keep bool [b, P + gen] (False = padding) and
    positions counted from each row's first token (MegaDLMs' ``cumsum - 1``, as the Hugging Face
    export); (None, None) when no row is padded, so an unpadded batch runs today's exact path."""
    if attention_mask is None or bool(attention_mask.all()):
        return None, None
    if attention_mask.shape != (b, P):
        raise ValueError(
            f"attention_mask must be [batch, prompt] = {(b, P)}, got {tuple(attention_mask.shape)}"
        )
    keep = torch.cat(
        [attention_mask.to(device).bool(), torch.ones(b, gen_length, dtype=torch.bool, device=device)], 1
    )
    position_ids = keep.to(torch.int64).cumsum(-1) - 1
    return keep, position_ids.masked_fill_(~keep, 1)  # padding: any position, it is never attended to


class _Forwards:
    """The model calls of one generation: every position at every step, or (``cache``) Fast-dLLM's
    block-wise approximate cache, refreshed by a full forward at each block's first step:
    "prefix" keeps the keys/values before the block and recomputes the block and everything after
    it; "dual" also keeps those after the block and recomputes the block only."""

    def __init__(self, model, cache, keep, position_ids, rows: int) -> None:
        self.model, self.mode, self.keep, self.position_ids, self.rows = (
            model,
            cache,
            keep,
            position_ids,
            rows,
        )
        self.kv: Optional[KVCache] = None
        self.nfe = 0

    def span(self, step: int, start: int, end: int, total: int) -> Tuple[int, int]:
        """The slice [lo, hi) of the sequence this step recomputes."""
        if self.mode is None or step == 0:
            return 0, total
        return start, (total if self.mode == "prefix" else end)

    def __call__(self, batch: torch.Tensor, lo: int, step: int, start: int) -> torch.Tensor:
        """The logits of ``batch`` (slots [lo, lo + L), the CFG pair stacked as rows)."""
        self.nfe += 1
        kwargs: Dict[str, object] = {}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids[:, lo : lo + batch.shape[1]].repeat(self.rows, 1)
        if self.mode is None:
            if self.keep is not None:  # padding is its own document: no real token attends to it
                kwargs["document_ids"] = torch.where(self.keep, 0, -1).repeat(self.rows, 1)
            return self.model(batch, **kwargs)
        if step == 0:  # a block starts: refresh the cache with every position
            self.kv = KVCache(None if self.keep is None else self.keep.repeat(self.rows, 1))
        logits = self.model(batch, kv_cache=self.kv, cache_offset=lo, **kwargs)
        if step == 0 and self.mode == "prefix" and self.kv is not None:
            self.kv.truncate(start)  # the block and what follows are recomputed at every step
        return logits


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_token_id: int,
    gen_length: int = 128,
    steps: int = 128,
    block_length: Optional[int] = None,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    generator: Optional[torch.Generator] = None,
    seed: Optional[int] = None,
    vocab_size: Optional[int] = None,
    threshold: Optional[float] = None,
    cache: Optional[str] = None,
    attention_mask: Optional[torch.Tensor] = None,
    stats: Optional[Dict[str, Any]] = None,
    running_mode: RunningMode = RunningMode.DIFFLM_NOSHIFT,
    eos_token_id: Optional[int] = None,
) -> torch.Tensor:
    """Complete ``prompt`` int64 [b, P] with ``gen_length`` tokens -> int64 [b, P + gen_length].

    ``model(x) -> logits [b, S, V]`` must be a bidirectional mask predictor. Randomness
    (temperature > 0 or random remasking) comes from ``generator`` or a generator seeded with
    ``seed`` (default 0), so a call is reproducible. The model is run in eval mode and its
    training flag restored afterwards.

    Only real tokens are drawn: the logits are cut to the first ``vocab_size`` rows (default:
    the model's recorded ``config.unpadded_vocab_size``) before any draw or softmax, as the
    Hugging Face export drops Megatron's padding rows (``megadlms.diffusion.vocab``). Under
    tensor parallelism every TP rank calls this with the same prompt and seed (the vocab
    slices are all-gathered: the ranks draw the same tokens).

    ``threshold`` (Fast-dLLM's confidence-threshold parallel decoding, arXiv 2505.22618): each
    step of a block commits every masked position of the block whose confidence is at least
    ``threshold``, and always the most confident one, until the block is filled (``steps`` then
    only has to divide into the blocks). ``cache`` (Fast-dLLM's approximate KV cache; a
    GPTModel): None, "prefix" or "dual" (see :class:`_Forwards`). ``attention_mask`` int/bool
    [b, P] (1 = token): a left-padded batch of prompts of different lengths. ``stats``: a dict
    that receives ``"nfe"``, the number of model forward passes (the CFG pair counts as one, as
    Fast-dLLM counts), and ``"block_nfe"``, those of each block.

    ``block_length`` defaults to 128. A block-diffusion model (``model.config.difflm_block_size``
    set) generates block by block with :func:`~.block_sampler.generate_blocks`: ``block_length``
    must be its block size (the default there), ``cache`` "prefix" is exact there, and
    generation stops after the block in which every row has produced ``eos_token_id`` (so the
    result may be shorter).

    ``running_mode`` difflm-shift (Dream): the model's logits at i predict token i + 1; each
    position is chosen from the logits before it (``megadlms.diffusion.shift``), as Dream's
    ``diffusion_generate``; no ``cache`` (a cached step recomputes from the block's first
    position, whose predictor is the cached one before it).
    """
    block_size = getattr(getattr(model, "config", None), "difflm_block_size", None)
    if block_size is not None:
        return _generate_blocks(model, prompt, block_size, locals())  # locals(): this call's arguments
    block_length = 128 if block_length is None else block_length
    check_arguments(prompt, gen_length, steps, block_length, temperature, remasking, cfg_scale)
    check_threshold(threshold)
    mode = _cache_mode(cache)
    running_mode = RunningMode(running_mode)
    if mode is not None and predicts_next(running_mode):
        raise ValueError(f"cache={cache!r} is not supported for a {running_mode} model: pass cache=None")
    if predicts_next(running_mode) and prompt.dim() == 2 and prompt.shape[1] == 0:
        raise ValueError(
            f"a {running_mode} model needs a prompt of at least one token (position 0 has no predictor)"
        )
    num_blocks = gen_length // block_length
    # The real vocabulary when the model (or the caller) knows it, else the output rows; a model that records
    # neither is checked at its first logits (step_logits).
    real = real_vocab_size(model, vocab_size) or getattr(getattr(model, "config", None), "vocab_size", None)
    if real is not None and not 0 <= mask_token_id < real:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the model's vocabulary of {real}")
    device = prompt.device
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(0 if seed is None else seed)
    if prompt.dtype != torch.int64:
        raise ValueError(f"prompt must hold int64 token ids, got {prompt.dtype}")
    b, P = prompt.shape
    total = P + gen_length
    keep, position_ids = _padding(attention_mask, b, P, gen_length, device)
    x = torch.full((b, total), mask_token_id, dtype=torch.int64, device=device)
    x[:, :P] = prompt
    # By value, as LLaDA: a [MASK] id inside the prompt counts as a position to fill, not as prompt
    # (padding never does, whatever its id).
    prompt_index = x != mask_token_id if keep is None else (x != mask_token_id) | ~keep
    forwards = _Forwards(model, mode, keep, position_ids, rows=2 if cfg_scale > 0 else 1)
    steps_per_block = steps // num_blocks
    block_nfe = []
    was_training = model.training
    model.eval()
    try:
        for block in range(num_blocks):
            start, end = P + block * block_length, P + (block + 1) * block_length
            num_transfer = get_num_transfer_tokens(x[:, start:end] == mask_token_id, steps_per_block)
            step = 0
            # The schedule's steps; with a threshold, as many as the block needs (each commits >= 1 per row).
            while (
                (step < steps_per_block)
                if threshold is None
                else bool((x[:, start:end] == mask_token_id).any())
            ):
                lo, hi = forwards.span(step, start, end, total)
                part = x[:, lo:hi]
                logits = step_logits(
                    model, part, prompt_index[:, lo:hi], mask_token_id, cfg_scale, vocab_size,
                    lambda batch: forwards(batch, lo, step, start),  # noqa: B023 (called at once)
                    running_mode,
                )  # fmt: skip
                mask_index = (
                    part == mask_token_id if keep is None else (part == mask_token_id) & keep[:, lo:hi]
                )
                k = num_transfer[:, step] if threshold is None else None
                committed = commit(
                    logits, part, mask_index, end - lo, k, mask_token_id, temperature, remasking, generator,
                    threshold,
                )  # fmt: skip
                x = (
                    torch.cat([x[:, :lo], committed, x[:, hi:]], dim=1)
                    if (lo, hi) != (0, total)
                    else committed
                )
                step += 1
            block_nfe.append(step)
    finally:
        model.train(was_training)
    if stats is not None:
        stats["nfe"], stats["block_nfe"] = forwards.nfe, block_nfe
    return x


def _generate_blocks(model, prompt: torch.Tensor, block_size: int, args: Dict[str, Any]) -> torch.Tensor:
    """:func:`generate`'s arguments for a block-diffusion model, checked and passed on."""

    if args["block_length"] not in (None, block_size):
        raise ValueError(
            f"block_length ({args['block_length']}) must be the model's block size ({block_size}) "
            "for a block-diffusion model (or left out)"
        )
    if args["cfg_scale"] or args["attention_mask"] is not None:
        raise ValueError("block diffusion generation runs without cfg_scale and attention_mask (padding)")
    check_arguments(
        prompt, args["gen_length"], args["steps"], block_size, args["temperature"], args["remasking"], 0.0
    )
    check_threshold(args["threshold"])
    generator = args["generator"]
    if generator is None:
        generator = torch.Generator(device=prompt.device).manual_seed(args["seed"] or 0)
    was_training = model.training
    model.eval()
    try:
        return generate_blocks(
            model, prompt, mask_token_id=args["mask_token_id"], block_size=block_size,
            gen_length=args["gen_length"], steps=args["steps"], temperature=args["temperature"],
            remasking=args["remasking"], generator=generator, vocab_size=args["vocab_size"],
            threshold=args["threshold"], cache=_cache_mode(args["cache"]),
            eos_token_id=args["eos_token_id"], stats=args["stats"], running_mode=args["running_mode"],
        )  # fmt: skip
    finally:
        model.train(was_training)
