"""The shifted-prediction rule of ``--model-running-mode difflm-shift`` (Dream, Fast-dLLM v2),
decided here once for the objective, the likelihood and the sampler.

A shifted masked-diffusion model keeps the autoregressive alignment of its logits: the logits
at position i predict the token at position i + 1 (Dream continues from Qwen2.5 and keeps
that head). Position 0 has no predictor, so it is never masked (Dream's trainers put a BOS
there that is never scored), and the last position's logits predict nothing in the sequence.

* The objective (training and validation NELBO) masks positions 1..L-1 and moves each
  target one position left (:func:`to_logit_positions`), so the scorer compares ``logits[:, i]``
  with the token ``x[i + 1]`` position by position (a context-parallel slice of the targets
  stays aligned with the same slice of the logits).
* The sampler and the likelihood need, for every position, the logits that predict it:
  :func:`position_logits` moves the logits one position right, as Dream's
  ``diffusion_generate`` does (``cat([logits[:, :1], logits[:, :-1]])``; position 0 gets its
  own logits, which no caller reads: the prompt's first token is never masked).
"""

from __future__ import annotations

import torch

from megadlms.common.enums import RunningMode


def predicts_next(mode: RunningMode) -> bool:
    """True when the masked-diffusion model of ``mode`` predicts position i + 1 at position i."""
    return mode is RunningMode.DIFFLM_SHIFT


def to_logit_positions(per_token: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
    """[b, L-1] values of tokens 1..L-1 -> [b, L] at the logit positions that predict them
    (position i holds token i + 1's), the last position (predicting nothing) set to ``fill``."""
    pad = torch.full_like(per_token[:, :1], fill)
    return torch.cat([per_token, pad], dim=1)


def position_logits(logits: torch.Tensor, mode: RunningMode) -> torch.Tensor:
    """[b, S, V] logits -> the logits that predict each position's token: unchanged for an
    unshifted model; for difflm-shift moved one position right (Dream's ``diffusion_generate``),
    position 0 keeping its own (it is never masked)."""
    if not predicts_next(mode):
        return logits
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
