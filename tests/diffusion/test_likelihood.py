"""LLaDA's prompt-conditioned likelihood estimator against its exact expectation."""

import itertools
import math

import torch
import torch.nn.functional as F

from megadlms.diffusion import answer_nll_draws, conditional_log_likelihood
from megadlms.diffusion.likelihood import answer_masks
from megadlms.models import GPTModel, TransformerConfig

MASK = 257


def _model():
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=259,
        seq_length=16,
        position_embedding_type="rope",
        swiglu=True,
        normalization="RMSNorm",
    )
    m = GPTModel(cfg)
    with torch.no_grad():
        m.embedding.word_embeddings.weight.mul_(30)
    return m.eval()


@torch.no_grad()
def _exact(model, prompt, answer):
    """-E[...] by enumerating every non-empty subset of answer positions."""
    L, P = len(answer), len(prompt)
    seq = torch.tensor(prompt + answer)
    total = 0.0
    for n in range(1, L + 1):
        subsets = list(itertools.combinations(range(L), n))
        acc = 0.0
        for S in subsets:
            x = seq.clone()
            idx = torch.tensor(S) + P
            x[idx] = MASK
            logp = F.log_softmax(model(x[None])[0].double(), -1)
            acc += -(logp[idx, seq[idx]]).sum().item() * L / n
        total += acc / len(subsets) / L
    return -total


def test_masks_are_stratified_and_uniform():
    m = answer_masks(5, 5, batch=0, seed=1)
    assert sorted(m.sum(1).tolist()) == [1, 2, 3, 4, 5]  # a batch of L rows covers 1..L
    counts = torch.zeros(6)
    for b in range(400):
        counts += torch.bincount(answer_masks(5, 3, batch=b, seed=1).sum(1), minlength=6)
    assert counts[0] == 0
    assert (counts[1:] / counts[1:].sum() - 0.2).abs().max() < 0.03  # l ~ U{1..L}


def test_single_token_answer_is_exact():
    model = _model()
    prompt, answer = list(b"abc"), [100]
    got = conditional_log_likelihood(model, prompt, answer, mask_token_id=MASK, mc_samples=3, batch_size=2)
    assert math.isclose(got, _exact(model, prompt, answer), rel_tol=1e-6)


def test_matches_exact_expectation_by_enumeration():
    model = _model()
    prompt, answer = list(b"xy"), list(b"qrst")
    exact = _exact(model, prompt, answer)
    draws = answer_nll_draws(
        model, prompt, answer, mask_token_id=MASK, mc_samples=2048, batch_size=64, seed=5
    )
    est, se = -draws.mean().item(), draws.std().item() / math.sqrt(draws.numel())
    assert abs(est - exact) < 4 * se, (est, exact, se)
    assert se < 0.05 * abs(exact)
    # reproducible, and the prompt is never masked: a different prompt changes the value
    again = conditional_log_likelihood(
        model, prompt, answer, mask_token_id=MASK, mc_samples=2048, batch_size=64, seed=5
    )
    assert again == est
    other = conditional_log_likelihood(model, list(b"zz"), answer, mask_token_id=MASK, mc_samples=64)
    assert other != conditional_log_likelihood(model, prompt, answer, mask_token_id=MASK, mc_samples=64)
