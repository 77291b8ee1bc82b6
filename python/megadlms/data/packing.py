"""Document packing fields of a batch, from its ``tokens`` and the end-of-document id
(Megatron's --reset-position-ids / --reset-attention-mask, MegaDLMs' packed path).

A sample of ``seq_length + 1`` tokens spans several documents, each ending with eod.
Megatron's ``_get_ltor_masks_and_position_ids`` restarts the position ids after every
eod of ``tokens``; the document of ``labels[j]`` (= text[j + 1]) is the number of eods in
``tokens[0..j]``. Samples are never joined (MegaDLMs' --cut-off-varlen-to-seqlen): a
document cut by the sample boundary continues as a new document in the next sample.
"""

from __future__ import annotations

from typing import Dict

import torch


def reset_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Positions [B, S] that restart at 0 after every eod of ``tokens`` (Megatron)."""
    B, S = tokens.shape
    idx = torch.arange(S, device=tokens.device).expand(B, S)
    after_eod = torch.where(tokens == eod, idx + 1, torch.zeros_like(idx))
    # start of the current document = one past the last eod strictly before i
    start = torch.cat([torch.zeros_like(idx[:, :1]), after_eod[:, :-1]], dim=1).cummax(dim=1).values
    return idx - start


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Document index [B, S] of each ``labels`` position: eods in tokens[0..j] (inclusive)."""
    # Inclusive: after an eod at j, labels[j] is already the next document's first token.
    return (tokens == eod).to(torch.int64).cumsum(dim=1)


def add_packing_fields(
    batch: Dict[str, torch.Tensor], eod: int, *, reset_positions: bool, reset_attention: bool
) -> Dict[str, torch.Tensor]:
    """``batch`` with Megatron's per-document ``position_ids`` and/or ``document_ids``."""
    out = dict(batch)
    if reset_positions:
        out["position_ids"] = reset_position_ids(batch["tokens"], eod)
    if reset_attention:
        out["document_ids"] = document_ids(batch["tokens"], eod)
    return out
