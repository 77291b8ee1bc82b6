"""Losses: unbiasedness on a uniform predictor, AR vs hand CE, compute_loss vs hand-built."""

import math

import pytest
import torch
from torch import nn

from megadlms.diffusion import (
    DiffusionConfig,
    ar_loss,
    compute_loss,
    diffusion_loss,
    forward_process,
    varilen_length,
)
from megadlms.diffusion.noise import TAG_MASK, TAG_TIME
from megadlms.models import GPTModel, TransformerConfig

from ._reference import uniform as ref_uniform

V, MASK = 23, 22


class UniformModel(nn.Module):
    """Predicts the uniform distribution over V at every position."""

    def forward(self, ids, position_ids=None):
        return torch.zeros(*ids.shape, V)


def _tiny(attention="bidirectional", **kw):
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=16,
        position_embedding_type="rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **kw,
    )
    torch.manual_seed(0)
    return GPTModel(cfg, attention=attention)


def _batch(n, S=16, first_idx=0):
    g = torch.Generator().manual_seed(n + S)
    text = torch.randint(0, MASK, (n, S + 1), generator=g)
    loss_mask = torch.ones(n, S)
    loss_mask[0, 3] = 0.0
    return {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": loss_mask,
        "position_ids": torch.arange(S).expand(n, S),
        "sample_idx": torch.arange(first_idx, first_idx + n),
    }


def test_uniform_model_gets_log_v_sampled_mode():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=1, varilen_prob=0.0)
    n, S = 3000, 32
    tokens = torch.randint(0, MASK, (n, S))
    _, masked, p = forward_process(tokens, torch.arange(n), cfg)
    logits = torch.zeros(n, S, V)
    per_row = torch.stack(
        [
            diffusion_loss(logits[i : i + 1], tokens[i : i + 1], masked[i : i + 1], p[i : i + 1])[0] / S
            for i in range(0, n)
        ]
    )
    se = per_row.std().item() / math.sqrt(n)
    assert abs(per_row.mean().item() - math.log(V)) < 4 * se
    total, count = diffusion_loss(logits, tokens, masked, p)
    assert count.item() == n * S
    assert total.item() / count.item() == pytest.approx(per_row.mean().item(), rel=1e-5)


def test_uniform_model_realised_mode_is_exact():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=2, mask_eps=0.0, p_mask="realised", varilen_prob=0.0)
    batch = _batch(64)
    loss_sum, num, _ = compute_loss(UniformModel(), batch, cfg, iteration=0)
    # every row contributes exactly (#loss tokens) * log V
    assert loss_sum.item() == pytest.approx(num.item() * math.log(V), rel=1e-5)


def test_ar_mode_matches_hand_written_shifted_ce():
    model = _tiny("causal")
    cfg = DiffusionConfig(model_running_mode="vanilla")
    batch = _batch(3)
    loss_sum, num, _ = compute_loss(model, batch, cfg, iteration=5)
    logits = model(batch["tokens"]).double()
    want = 0.0
    for b in range(3):
        for s in range(16):
            row = logits[b, s].tolist()
            lse = math.log(sum(math.exp(v) for v in row))
            want += batch["loss_mask"][b, s].item() * (lse - row[batch["labels"][b, s].item()])
    assert loss_sum.item() == pytest.approx(want, rel=1e-5)
    assert num.item() == 3 * 16 - 1
    s2, n2 = ar_loss(logits, batch["labels"])
    assert n2.item() == 48


def test_vanilla_with_bidirectional_model_is_rejected():
    with pytest.raises(ValueError, match="causal"):
        compute_loss(_tiny(), _batch(2), DiffusionConfig(model_running_mode="vanilla"), 0)
    with pytest.raises(ValueError, match="mask_token_id"):
        compute_loss(_tiny(), _batch(2), DiffusionConfig(mask_token_id=V), 0)


def test_compute_loss_matches_hand_built_dlm_loss():
    seed, eps = 9, 0.01
    cfg = DiffusionConfig(mask_token_id=MASK, seed=seed, mask_eps=eps, varilen_prob=0.0)
    model = _tiny()
    batch = _batch(4, first_idx=100)
    loss_sum, num, stats = compute_loss(model, batch, cfg, iteration=0)
    clean = batch["labels"]
    want = 0.0
    noisy = clean.clone()
    weights = {}
    for b in range(4):
        s_idx = 100 + b
        p = (1 - eps) * ref_uniform(seed, TAG_TIME, s_idx, 0) + eps
        for j in range(16):
            if ref_uniform(seed, TAG_MASK, s_idx, 0, j) < p:
                noisy[b, j] = MASK
                weights[(b, j)] = (
                    batch["loss_mask"][b, j].item() / torch.tensor(p, dtype=torch.float32).item()
                )
    logp = torch.log_softmax(model(noisy).double(), -1)
    for (b, j), w in weights.items():
        want += -w * logp[b, j, clean[b, j]].item()
    assert stats["num_masked"].item() == len(weights)
    assert loss_sum.item() == pytest.approx(want, rel=1e-5)
    assert num.item() == 63


def test_varilen_crop_in_compute_loss():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=4, varilen_prob=1.0)
    batch = _batch(2)
    crop = varilen_length(4, 17, 16, 1.0)
    _, num, stats = compute_loss(UniformModel(), batch, cfg, iteration=17)
    assert stats["seq_length"] == crop
    assert num.item() == batch["loss_mask"][:, :crop].sum().item()


def test_micro_batching_gives_the_same_loss_and_gradient():
    """The per-sample noise makes one batch of 4 == two micro-batches of 2 (the dp/GA claim)."""
    cfg = DiffusionConfig(mask_token_id=MASK, seed=13, varilen_prob=0.0)
    model = _tiny()
    batch = _batch(4, first_idx=7)
    loss, num, _ = compute_loss(model, batch, cfg, iteration=3)
    (loss / num).backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    parts = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    outs = [compute_loss(model, part, cfg, iteration=3) for part in parts]
    total_tokens = sum(o[1] for o in outs)
    for o in outs:
        (o[0] / total_tokens).backward()
    assert sum(o[0] for o in outs).item() == pytest.approx(loss.item(), rel=1e-6)
    for g, p in zip(full_grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
