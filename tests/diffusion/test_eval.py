"""validation_nelbo: deterministic, batch-split invariant, equal to a hand computation."""

import math

import pytest
import torch
from torch import nn

from megadlms.diffusion import DiffusionConfig, ar_loss, validation_nelbo
from megadlms.diffusion.noise import TAG_MASK, TAG_VALID_TIME

from ._reference import uniform as ref_uniform
from .test_loss import MASK, V, _batch, _tiny


class ContextFree(nn.Module):
    """Logits depend on the position only: the exact NELBO is the clean-token mean CE."""

    def __init__(self, S):
        super().__init__()
        self.table = nn.Parameter(torch.randn(S, V, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids, position_ids=None):
        return self.table[: ids.shape[1]].expand(ids.shape[0], -1, -1)


def test_nelbo_deterministic_split_invariant_and_equals_hand_computation():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=31, mask_eps=0.02)
    model = _tiny()
    model.train()
    batch = _batch(4, first_idx=50)
    K = 3
    r1 = validation_nelbo(model, [batch], cfg, num_mc_samples=K)
    r2 = validation_nelbo(model, [batch], cfg, num_mc_samples=K)
    assert r1 == r2 and model.training  # deterministic; training flag restored
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    r3 = validation_nelbo(model, halves, cfg, num_mc_samples=K)
    assert r3["nelbo"] == pytest.approx(r1["nelbo"], rel=1e-6)
    # hand computation from the reference hash
    model.eval()
    clean, lm = batch["labels"], batch["loss_mask"]
    total = 0.0
    with torch.no_grad():
        for k in range(K):
            noisy = clean.clone()
            w = torch.zeros(4, 16, dtype=torch.float64)
            for b in range(4):
                s = 50 + b
                t = (k + ref_uniform(31, TAG_VALID_TIME, s, k)) / K
                p = (1 - 0.02) * t + 0.02
                for j in range(16):
                    if ref_uniform(31, TAG_MASK, s, k + 1, j) < p:
                        noisy[b, j] = MASK
                        w[b, j] = lm[b, j].item() / torch.tensor(p, dtype=torch.float32).item()
            logp = torch.log_softmax(model(noisy).double(), -1)
            total += -(w * logp.gather(-1, clean[..., None]).squeeze(-1)).sum().item() / K
    want = total / lm.sum().item()
    assert r1["nelbo"] == pytest.approx(want, rel=1e-5)
    assert r1["ppl_bound"] == pytest.approx(math.exp(want), rel=1e-5)
    assert r1["num_tokens"] == 63


def test_nelbo_is_unbiased_for_a_context_free_model():
    S, n = 32, 200
    model = ContextFree(S)
    cfg = DiffusionConfig(mask_token_id=MASK, seed=5)
    batch = _batch(n, S=S)
    got = validation_nelbo(model, [batch], cfg, num_mc_samples=16)["nelbo"]
    with torch.no_grad():
        exact = ar_loss(model(batch["labels"]), batch["labels"], batch["loss_mask"])
    exact = (exact[0] / exact[1]).item()
    assert got == pytest.approx(exact, rel=0.03)


def test_nelbo_vanilla_is_per_token_nll():
    model = _tiny("causal")
    cfg = DiffusionConfig(model_running_mode="vanilla")
    batch = _batch(3)
    got = validation_nelbo(model, [batch], cfg)
    with torch.no_grad():
        s, n = ar_loss(model(batch["tokens"]), batch["labels"], batch["loss_mask"])
    assert got["nelbo"] == pytest.approx((s / n).item(), rel=1e-6)


def test_explicit_seed_drives_all_validation_noise():
    model = ContextFree(16)
    batch = _batch(8)
    a = validation_nelbo(model, [batch], DiffusionConfig(mask_token_id=MASK, seed=1), 2, seed=7)
    b = validation_nelbo(model, [batch], DiffusionConfig(mask_token_id=MASK, seed=7), 2)
    c = validation_nelbo(model, [batch], DiffusionConfig(mask_token_id=MASK, seed=1), 2)
    assert a == b and a != c
