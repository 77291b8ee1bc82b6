"""LLaDA sampler: fills every mask, block order, confidence order, determinism, CFG."""

import pytest
import torch
from torch import nn

from megadlms.diffusion import add_gumbel_noise, generate, get_num_transfer_tokens
from megadlms.models import GPTModel, TransformerConfig

V, MASK = 19, 18


class Recorder(nn.Module):
    """Wraps a model and keeps every input it was called with."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, x):
        self.calls.append(x.clone())
        return self.inner(x)


def _model():
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=V,
        seq_length=32,
        position_embedding_type="rope",
    )
    return GPTModel(cfg)


def test_fills_every_mask_in_block_order():
    rec = Recorder(_model())
    prompt = torch.randint(0, MASK, (2, 5))
    out = generate(rec, prompt, mask_token_id=MASK, gen_length=12, steps=6, block_length=4)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    assert not (out == MASK).any()
    assert len(rec.calls) == 6
    for c, x in enumerate(rec.calls):
        block = c // 2
        start, end = 5 + 4 * block, 5 + 4 * (block + 1)
        assert not (x[:, :start] == MASK).any()  # earlier blocks are complete
        assert (x[:, end:] == MASK).all()  # later blocks untouched
        assert ((x[:, start:end] == MASK).sum(1) == (4 if c % 2 == 0 else 2)).all()
    assert rec.inner.training  # mode restored


def test_deterministic_at_temperature_zero_and_seeded_otherwise():
    model = _model()
    prompt = torch.randint(0, MASK, (4, 3))
    kw = dict(mask_token_id=MASK, gen_length=16, steps=8, block_length=8)
    assert torch.equal(generate(model, prompt, **kw), generate(model, prompt, **kw))
    a = generate(model, prompt, temperature=1.0, seed=1, **kw)
    assert torch.equal(a, generate(model, prompt, temperature=1.0, seed=1, **kw))
    assert not torch.equal(a, generate(model, prompt, temperature=1.0, seed=2, **kw))
    r = generate(model, prompt, remasking="random", seed=3, **kw)
    assert not (r == MASK).any()


class Peaked(nn.Module):
    """Position j predicts token j % 5 with confidence rising with j."""

    def forward(self, x):
        b, S = x.shape
        logits = torch.zeros(b, S, V)
        for j in range(S):
            logits[:, j, j % 5] = 0.5 * j
        return logits


def test_low_confidence_commits_most_confident_first():
    rec = Recorder(Peaked())
    out = generate(
        rec, torch.zeros(1, 2, dtype=torch.int64), mask_token_id=MASK, gen_length=4, steps=4, block_length=4
    )
    assert out[0, 2:].tolist() == [2, 3, 4, 0]
    # after step 1 the last position is filled, then the one before it, ...
    masks_per_call = [c[0, 2:].eq(MASK).tolist() for c in rec.calls]
    assert masks_per_call == [
        [True] * 4,
        [True, True, True, False],
        [True, True, False, False],
        [True, False, False, False],
    ]


def test_classifier_free_guidance_masks_the_prompt_in_the_unconditional_copy():
    rec = Recorder(_model())
    prompt = torch.randint(0, MASK, (2, 4))
    out = generate(rec, prompt, mask_token_id=MASK, gen_length=4, steps=2, block_length=4, cfg_scale=1.5)
    assert not (out == MASK).any()
    first = rec.calls[0]
    assert first.shape == (4, 8)
    assert torch.equal(first[:2, :4], prompt) and (first[2:, :4] == MASK).all()


def test_num_transfer_tokens_schedule():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :7] = True
    got = get_num_transfer_tokens(mask, 4)
    assert got.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1], [0, 0, 0, 0]]


def test_gumbel_noise_samples_the_softmax():
    probs = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    logits = probs.log().expand(20000, 3)
    g = torch.Generator().manual_seed(0)
    draws = add_gumbel_noise(logits, 1.0, g).argmax(-1)
    freq = torch.bincount(draws, minlength=3).double() / 20000
    se = (probs * (1 - probs) / 20000).sqrt()
    assert ((freq - probs).abs() < 4 * se).all()
    assert add_gumbel_noise(logits, 1.0, g).dtype == torch.float64
    # temperature 0.5 sharpens: softmax(logits / 0.5)
    sharp = torch.softmax(probs.log() / 0.5, -1)
    freq = torch.bincount(add_gumbel_noise(logits, 0.5, g).argmax(-1), minlength=3).double() / 20000
    assert ((freq - sharp).abs() < 4 * (sharp * (1 - sharp) / 20000).sqrt()).all()


def test_bad_arguments():
    model, prompt = _model(), torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_length"):
        generate(model, prompt, mask_token_id=MASK, gen_length=10, block_length=4, steps=4)
    with pytest.raises(ValueError, match="steps"):
        generate(model, prompt, mask_token_id=MASK, gen_length=8, block_length=4, steps=3)
    with pytest.raises(ValueError, match="remasking"):
        generate(model, prompt, mask_token_id=MASK, gen_length=4, block_length=4, steps=4, remasking="top_k")
    with pytest.raises(ValueError, match="mask_token"):
        generate(model, prompt, mask_token_id=V, gen_length=4, block_length=4, steps=4)


@pytest.mark.gpu
def test_generate_on_gpu_matches_cpu_at_temperature_zero():
    model = _model().double()
    prompt = torch.randint(0, MASK, (2, 4))
    kw = dict(mask_token_id=MASK, gen_length=8, steps=8, block_length=4)
    cpu = generate(model, prompt, **kw)
    gpu = generate(model.cuda(), prompt.cuda(), **kw)
    assert torch.equal(cpu, gpu.cpu())
