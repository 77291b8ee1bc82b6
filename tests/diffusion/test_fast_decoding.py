"""Confidence-threshold parallel decoding (``generate(threshold=...)``) against NVlabs/Fast-dLLM's
own sampler, token for token and in forward passes, on the same model and prompts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megadlms.diffusion import generate
from megadlms.models import GPTModel, TransformerConfig
from tests.diffusion import _fast_dllm_reference as fast_dllm

V, MASK = 48, 47


class _NoMaskLogit(torch.nn.Module):
    """The tiny model with the [MASK] logit pushed out of reach (our sampler never draws [MASK],
    Fast-dLLM's can: the comparison holds them to the same draws) and its logits sharpened x30,
    so that confidences spread over (0, 1) as a trained model's do."""

    def __init__(self, model, hf=False):
        super().__init__()
        self.model, self.hf, self.device = model, hf, torch.device("cpu")

    def forward(self, x):
        logits = 30.0 * self.model(x)
        logits = torch.cat([logits[..., :MASK], torch.full_like(logits[..., MASK:], -1e4)], dim=-1)
        return SimpleNamespace(logits=logits) if self.hf else logits


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, seq_length=48,
        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(3)
    return GPTModel(cfg, attention="bidirectional").eval()


@pytest.mark.parametrize("threshold", [None, 0.9, 0.5, 0.2])
@pytest.mark.parametrize("block_length", [16, 8])
def test_threshold_decoding_equals_fast_dllm(model, threshold, block_length):
    ours, theirs = _NoMaskLogit(model), _NoMaskLogit(model, hf=True)
    total_nfe = 0
    for seed in range(3):
        prompt = torch.randint(0, MASK, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        stats = {}
        got = generate(
            ours, prompt, mask_token_id=MASK, gen_length=16, steps=16, block_length=block_length, threshold=threshold,
            stats=stats,
        )  # fmt: skip
        want, nfe = fast_dllm.generate(
            theirs,
            prompt,
            steps=16,
            gen_length=16,
            block_length=block_length,
            mask_id=MASK,
            threshold=threshold,
        )
        assert torch.equal(got, want), (threshold, block_length, seed)
        assert stats["nfe"] == nfe
        total_nfe += nfe
    if threshold is None:
        assert total_nfe == 3 * 16  # one forward per step
    elif threshold == 0.2:  # (an untrained model is rarely above 0.5)
        assert total_nfe < 3 * 16  # parallel decoding commits several tokens per forward


def test_threshold_rules(model):
    prompt = torch.randint(0, MASK, (2, 6), generator=torch.Generator().manual_seed(0))
    stats = {}
    x = generate(_NoMaskLogit(model), prompt, mask_token_id=MASK, gen_length=8, steps=8, block_length=8,
                 threshold=1.0, stats=stats)  # fmt: skip
    assert not (x == MASK).any() and stats["nfe"] == 8  # nothing reaches 1.0: one token a forward
    with pytest.raises(ValueError, match="threshold"):
        generate(model, prompt, mask_token_id=MASK, gen_length=8, steps=8, block_length=8, threshold=0.0)
