"""Counter-based noise: every random number of the objective is a pure function of
(seed, stream tag, global sample index, draw, position).

The generator is SplitMix64 (Steele, Lea & Flood 2014) applied as a hash chain, written
with torch int64 ops so it is vectorised and bit-identical on CPU and GPU:

    h = mix(seed); h = mix(h ^ tag); for key in keys: h = mix(h ^ key)
    u = (h >>> 11) * 2**-53                      # uniform in [0, 1), float64

where mix(x) is SplitMix64's finaliser of x + 0x9E3779B97F4A7C15 and >>> is a logical
shift. Int64 products wrap modulo 2**64 exactly as the uint64 reference does.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from megadlms.common.enums import Objective, PMaskMode

from .config import DiffusionConfig


def _signed(c: int) -> int:
    """uint64 constant -> the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)

# Stream tags keep the independent draws of one sample apart.
TAG_TIME = 1  # t of a sample
TAG_MASK = 2  # per-position mask uniforms
TAG_VARILEN = 3  # per-iteration crop decision and length
TAG_VALID_TIME = 4  # stratified t of validation draws


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    # torch lacks full uint64 arithmetic, but int64 + and * wrap modulo 2**64 with the same bits, so this is
    # SplitMix64 exactly; only the shifts need _srl.
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def counter_uniform(
    seed: int, tag: int, *keys: Union[torch.Tensor, int], device: Optional[torch.device] = None
) -> torch.Tensor:
    """Uniforms in [0, 1) (float64), one per element of the broadcast of ``keys``.

    keys: int64 tensors (or Python ints) that broadcast together; the result depends on
    (seed, tag, keys) only, never on the device, the batch it sits in, or call order.
    """
    if device is None:
        device = next((k.device for k in keys if isinstance(k, torch.Tensor)), torch.device("cpu"))
    # Fold any Python int (negative, or over 64 bits) into 64 bits before reinterpreting it as int64.
    h = _mix(torch.tensor(_signed(seed % (1 << 64)), dtype=torch.int64, device=device))
    h = _mix(h ^ tag)
    for key in keys:
        if not isinstance(key, torch.Tensor):
            key = torch.tensor(key, dtype=torch.int64, device=device)
        h = _mix(h ^ key.to(device=device, dtype=torch.int64))
    # The top 53 bits fit a float64 mantissa exactly: an even grid on [0, 1) that never reaches 1.
    return _srl(h, 11).to(torch.float64) * (2.0**-53)


def varilen_length(seed: int, iteration: int, seq_length: int, prob: float) -> Optional[int]:
    """Crop length for the whole batch of ``iteration`` or None (no crop).

    With probability ``prob`` returns a length uniform in [2, seq_length]; a function of
    (seed, iteration) only, so every rank and micro-batch of a step agrees without talking.
    """
    if prob <= 0.0 or seq_length < 2:
        return None
    # Keys 0 and 1 of the same counter: the crop decision and the length are independent draws. No rank or
    # micro-batch in the key, which is what lets all ranks agree without a collective.
    u = counter_uniform(seed, TAG_VARILEN, torch.tensor([iteration]), torch.tensor([0, 1]))
    if u[0].item() >= prob:
        return None
    # min(): u * (S - 1) can round up to S - 1 in float64 when u is within 2**-53 of 1.
    return 2 + min(int(u[1].item() * (seq_length - 1)), seq_length - 2)


def micro_batch_crop(
    config: DiffusionConfig,
    iteration: int,
    micro_batch: int,
    num_micro_batches: int,
    seq_length: int,
    *,
    bidirectional: bool = True,
) -> Optional[int]:
    """Crop length (in ``tokens`` positions, before any shift) of one training micro-batch, or None.

    'megadlms' objective: MegaDLMs' ``use_varilen_data``: numpy seeded with
    ``iteration * num_micro_batches + micro_batch`` draws u ~ U(0, 1) and L uniform in
    [2, seq_length]; crop iff u < varilen_prob, and only with bidirectional attention. The
    same on every rank, different per micro-batch (a local RandomState: numpy's global
    state is untouched, as MegaDLMs restores it). 'llada': :func:`varilen_length`, one per step.
    """
    if not config.diffusion or config.sft:  # fine-tuning never crops: the answer must stay whole
        return None
    if config.objective is Objective.LLADA:
        return block_crop(varilen_length(config.seed, iteration, seq_length, config.varilen_prob), config)
    if not bidirectional or config.varilen_prob <= 0.0:
        return None
    # MegaDLMs' seeding, not config.seed: reproducing its crops bit for bit needs its exact numpy stream.
    rng = np.random.RandomState(iteration * num_micro_batches + micro_batch)
    # Draw order u then L, and L drawn even when unused: MegaDLMs' sequence of draws.
    u = rng.uniform(0, 1)
    length = int(rng.randint(low=2, high=seq_length + 1))
    return block_crop(length, config) if u < config.varilen_prob else None


def block_crop(crop: Optional[int], config: DiffusionConfig) -> Optional[int]:
    """Block diffusion (``config.block_size``): a crop rounded down to a multiple of the block
    size; a crop shorter than one block stays as it is (one partial block), so block_size =
    seq_length keeps every crop of the full-sequence objective."""
    B = config.block_size
    if crop is None or B is None or crop < B:
        return crop
    return crop // B * B


def forward_process(
    tokens: torch.Tensor,
    sample_idx: torch.Tensor,
    config: DiffusionConfig,
    loss_mask: Optional[torch.Tensor] = None,
    *,
    t: Optional[torch.Tensor] = None,
    draw: int = 0,
    p_mask_mode: Optional[PMaskMode] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask ``tokens`` [b, S] (int64) with the masked-diffusion forward process.

    Row i draws t_i ~ U(0, 1) from (seed, sample_idx[i]) (or takes ``t[i]``), sets
    p_i = (1 - eps) t_i + eps and masks position j iff u(seed, sample_idx[i], draw, j) < p_i.
    ``p_mask_mode`` overrides ``config.p_mask``:

    * "sampled": p_mask = p_i (LLaDA, MDLM).
    * "realised" (MegaDLMs): a row with no masked loss token gets its loss position with
      the smallest uniform masked (the first one to flip as t grows: uniform over the loss
      positions), and p_mask = (# masked loss positions) / (# loss positions) of the row.

    Returns (noisy int64 [b,S], masked bool [b,S], p_mask float32 [b,S]).
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    b, S = tokens.shape
    device = tokens.device
    sample_idx = torch.as_tensor(sample_idx, dtype=torch.int64, device=device).reshape(-1)
    if sample_idx.numel() != b:
        raise ValueError(f"sample_idx has {sample_idx.numel()} entries for a batch of {b} rows")
    mode = p_mask_mode or config.p_mask
    if t is None:
        # Keyed by the global sample index, not the row: the same t for any dp size, micro-batch size,
        # pipeline stage or resume point.
        t = counter_uniform(config.seed, TAG_TIME, sample_idx, draw)
    t = torch.as_tensor(t, dtype=torch.float64, device=device).reshape(b)
    # eps > 0 keeps p >= eps, so the 1/p loss weight stays bounded as t -> 0 (LLaDA's 1e-3); MegaDLMs uses 0
    # and bounds it by forcing a mask instead ('realised' below).
    p_b = (1.0 - config.mask_eps) * t + config.mask_eps
    positions = torch.arange(S, dtype=torch.int64, device=device)
    # One uniform per (sample, draw, absolute position): a cropped row sees the masks of the uncropped prefix,
    # and thresholding one uniform per position means a larger t masks a superset of positions.
    u_bS = counter_uniform(config.seed, TAG_MASK, sample_idx[:, None], draw, positions[None, :])
    masked = u_bS < p_b[:, None]
    if mode == PMaskMode.SAMPLED:
        p_mask = p_b.to(torch.float32)[:, None].expand(b, S)
    elif mode == PMaskMode.REALISED:
        is_loss = torch.ones_like(masked) if loss_mask is None else loss_mask > 0
        masked, p_mask = realise_masks(masked, u_bS, is_loss)
    else:
        raise ValueError(f"p_mask mode must be 'sampled' or 'realised', got {mode!r}")
    noisy = torch.where(masked, torch.full_like(tokens, config.mask_token_id), tokens)
    return noisy, masked, p_mask.contiguous()


def realise_masks(masked: torch.Tensor, u_bS: torch.Tensor, is_loss: torch.Tensor):
    """MegaDLMs' 'realised' p of each row of ``masked`` [b, S]: (masked with >= 1 forced, p_mask)."""
    b, S = masked.shape
    # A row with loss tokens but none masked would add nothing and make the realised p 0; force one mask,
    # as MegaDLMs. Rows without any loss token are left alone.
    none_masked = ((masked & is_loss).sum(dim=1) == 0) & is_loss.any(dim=1)
    # 2.0 is above every uniform: a non-loss position never wins the argmin.
    first = torch.where(is_loss, u_bS, torch.full_like(u_bS, 2.0)).argmin(dim=1)
    force = torch.zeros_like(masked)
    force[torch.arange(b, device=masked.device), first] = none_masked
    masked = masked | force
    # clamp and the frac > 0 fallback only matter for rows without loss tokens, whose weights are 0
    # anyway: they just avoid 0/0 and 1/0.
    num_loss = is_loss.sum(dim=1).clamp(min=1).to(torch.float32)
    frac = (masked & is_loss).sum(dim=1).to(torch.float32) / num_loss
    p_mask = torch.where(frac > 0, frac, torch.ones_like(frac))[:, None].expand(b, S)
    return masked, p_mask


def sft_forward_process(
    tokens: torch.Tensor,
    answer_mask: torch.Tensor,
    sample_idx: torch.Tensor,
    config: DiffusionConfig,
    *,
    t: Optional[torch.Tensor] = None,
    draw: int = 0,
    p_mask_mode: Optional[PMaskMode] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_process` for supervised fine-tuning: the prompt is never noised.

    The same draws as pretraining (t and the per-position uniforms of (seed, sample index,
    draw)), kept only where ``answer_mask`` [b, S] (bool) is True: a False position is never
    masked, whatever t. With ``p_mask`` 'realised' the forced mask and the fraction count the
    answer positions only. Returns (noisy, masked, p_mask) as :func:`forward_process`."""
    if answer_mask.shape != tokens.shape:
        raise ValueError(
            f"answer_mask has shape {tuple(answer_mask.shape)}, tokens {tuple(tokens.shape)}: they must match"
        )
    answer = answer_mask.to(torch.bool)
    _, masked, p_mask = forward_process(
        tokens, sample_idx, config, answer.to(torch.float32), t=t, draw=draw, p_mask_mode=p_mask_mode
    )
    masked = masked & answer
    noisy = torch.where(masked, torch.full_like(tokens, config.mask_token_id), tokens)
    return noisy, masked, p_mask


def validation_times(
    seed: int,
    sample_idx: torch.Tensor,
    draw: int,
    num_mc_samples: int,
) -> torch.Tensor:
    """Stratified t of Monte Carlo draw k: (k + u(seed, sample, k)) / K, float64 [b].

    Each of the K strata of [0, 1) gets exactly one t per sample, which removes most of the
    variance of the t-integral (MDLM's low-discrepancy sampler, per sequence).
    """
    u = counter_uniform(seed, TAG_VALID_TIME, sample_idx, draw)
    return (draw + u) / num_mc_samples
