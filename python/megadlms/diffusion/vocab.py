"""The logits of the real tokens: Megatron's padding rows cut before any token is chosen or scored.

Megatron pads the embedding and output layer to a multiple of --make-vocab-size-divisible-by
x tp (259 byte-tokenizer ids -> 384 rows at tp 1, 512 at tp 2). Training keeps Megatron's
softmax over every row (the padding rows learn to stay low); but a padding row is no token
(no tokenizer decodes it), so everything that turns logits into tokens or probabilities --
the sampler, the answer likelihood, lm-eval, ``megadlms-generate`` -- goes through
:func:`token_logits`, which cuts them. Cutting (rather than setting them to -inf) gives the
logits the Hugging Face export computes, whose output layer holds the real rows only: the
same softmax, the same Gumbel draws, so both samplers agree token for token.

The real size is the model's ``config.unpadded_vocab_size`` (recorded in checkpoints) unless
the caller passes one. Under tensor parallelism the model's logits are its vocab slice: the
model's ``gather_vocab_logits`` (GPTModel) all-gathers them first, so every TP rank picks
the same tokens.
"""

from __future__ import annotations

from typing import Optional

import torch


def _first(model: torch.nn.Module, read):
    """The first non-None ``read(m)`` over ``model.modules()`` (pre-order: a wrapper's inner
    model comes right after it, as for ``token_cross_entropy_of``)."""
    for m in model.modules():
        value = read(m)
        if value is not None:
            return value
    return None


def real_vocab_size(model: torch.nn.Module, vocab_size: Optional[int] = None) -> Optional[int]:
    """``vocab_size`` when given, else the model's ``config.unpadded_vocab_size`` (None: no
    record, every row is a token)."""
    if vocab_size is not None:
        return int(vocab_size)
    return _first(model, lambda m: getattr(getattr(m, "config", None), "unpadded_vocab_size", None))


def token_logits(
    model: torch.nn.Module, logits: torch.Tensor, vocab_size: Optional[int] = None
) -> torch.Tensor:
    """``model``'s ``logits`` [..., V/tp] -> [..., U]: the full vocabulary (vocab-parallel
    slices all-gathered by the model's ``gather_vocab_logits``), then the first U =
    :func:`real_vocab_size` rows, the tokens. Any module holding the model (a wrapper, a
    recorder) finds it, as ``token_cross_entropy_of`` does."""
    gather = _first(model, lambda m: getattr(m, "gather_vocab_logits", None))
    full = gather(logits) if gather is not None else logits
    real = real_vocab_size(model, vocab_size)
    if real is None:
        return full
    if not 0 < real <= full.shape[-1]:
        raise ValueError(
            f"vocab_size {real} must be in 1..{full.shape[-1]} (the model's output rows): pass the "
            "tokenizer's vocabulary size, before Megatron's padding"
        )
    # A view: the padding rows are the last ones, so token ids keep their meaning.
    return full[..., :real]
