"""Forward process: hash vs an independent reference, mask statistics, noise invariance, varilen."""

import math

import pytest
import torch

from megadlms.diffusion import DiffusionConfig, counter_uniform, forward_process, varilen_length
from megadlms.diffusion.noise import TAG_MASK, TAG_TIME

from ._reference import uniform as ref_uniform

MASK = 99


def test_counter_uniform_matches_python_splitmix64():
    seeds = [0, 1234, 2**63 + 5, -7]
    idx = torch.tensor([0, 1, 17, 2**40 + 3, -1])
    for seed in seeds:
        got = counter_uniform(seed, 2, idx[:, None], 3, torch.arange(4)[None, :])
        for i, s in enumerate(idx.tolist()):
            for j in range(4):
                assert got[i, j].item() == ref_uniform(seed, 2, s, 3, j)
    assert 0.0 <= got.min() and got.max() < 1.0


def test_forward_process_follows_the_formula():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=11, mask_eps=0.1)
    tokens = torch.randint(0, 50, (3, 20))
    idx = torch.tensor([4, 8, 15])
    noisy, masked, p = forward_process(tokens, idx, cfg)
    for i, s in enumerate(idx.tolist()):
        p_i = 0.9 * ref_uniform(11, TAG_TIME, s, 0) + 0.1
        assert p[i].eq(torch.tensor(p_i, dtype=torch.float32)).all()
        for j in range(20):
            want = ref_uniform(11, TAG_MASK, s, 0, j) < p_i
            assert masked[i, j].item() == want
            assert noisy[i, j].item() == (MASK if want else tokens[i, j].item())


def test_mask_fraction_statistics():
    eps = 0.05
    cfg = DiffusionConfig(mask_token_id=MASK, seed=3, mask_eps=eps)
    n, S = 4000, 64
    tokens = torch.zeros(n, S, dtype=torch.int64)
    _, masked, p = forward_process(tokens, torch.arange(n), cfg)
    frac = masked.double().mean(dim=1)
    expected = (1 - eps) * 0.5 + eps
    se = frac.std().item() / math.sqrt(n)
    assert abs(frac.mean().item() - expected) < 4 * se
    # t ~ U(0,1): p uniform on [eps, 1]
    pr = p[:, 0].double()
    assert pr.min() >= eps and pr.max() <= 1
    assert abs(pr.var().item() - (1 - eps) ** 2 / 12) < 0.01
    # per row, masked fraction tracks p (binomial noise only)
    resid = frac - pr
    assert abs(resid.mean().item()) < 4 * math.sqrt((pr * (1 - pr)).mean().item() / S / n)


def test_realised_mode_forces_a_mask_and_uses_realised_fraction():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=5, mask_eps=0.0, p_mask="realised")
    n, S = 500, 8
    tokens = torch.zeros(n, S, dtype=torch.int64)
    loss_mask = torch.ones(n, S)
    loss_mask[:, :2] = 0  # first two positions carry no loss
    _, masked, p = forward_process(tokens, torch.arange(n), cfg, loss_mask)
    in_loss = masked & (loss_mask > 0)
    assert (in_loss.sum(1) >= 1).all()
    torch.testing.assert_close(p[:, 0], in_loss.sum(1).float() / 6)
    # without forcing, small t often masks nothing: the forced rows exist
    _, masked_s, _ = forward_process(tokens, torch.arange(n), cfg, loss_mask, p_mask_mode="sampled")
    forced = (masked_s & (loss_mask > 0)).sum(1) == 0
    assert forced.any()
    assert (in_loss[forced].sum(1) == 1).all()
    # the forced position is uniform over the loss positions
    hits = in_loss[forced].float().sum(0)
    assert hits[:2].sum() == 0


def test_noise_depends_only_on_sample_index():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=21)
    tokens = torch.randint(0, 50, (6, 32))
    idx = torch.tensor([10, 3, 77, 5, 1000, 42])
    _, full, p_full = forward_process(tokens, idx, cfg)
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    _, permuted, _ = forward_process(tokens[perm], idx[perm], cfg)
    assert torch.equal(permuted, full[perm])
    for lo, hi in ((0, 1), (1, 4), (4, 6)):  # micro-batches of other sizes
        _, part, p_part = forward_process(tokens[lo:hi], idx[lo:hi], cfg)
        assert torch.equal(part, full[lo:hi]) and torch.equal(p_part, p_full[lo:hi])
    # a cropped batch keeps the masks of the kept positions
    _, cropped, _ = forward_process(tokens[:, :9], idx, cfg)
    assert torch.equal(cropped, full[:, :9])
    # different seed -> different noise
    _, other, _ = forward_process(tokens, idx, DiffusionConfig(mask_token_id=MASK, seed=22))
    assert not torch.equal(other, full)


def test_varilen_is_a_function_of_seed_and_iteration():
    got = [varilen_length(7, it, 128, 0.2) for it in range(3000)]
    assert got == [varilen_length(7, it, 128, 0.2) for it in range(3000)]
    crops = [g for g in got if g is not None]
    assert abs(len(crops) / 3000 - 0.2) < 4 * math.sqrt(0.2 * 0.8 / 3000)
    assert min(crops) >= 2 and max(crops) <= 128
    assert len(set(crops)) > 100  # spread over the range
    assert all(varilen_length(7, it, 128, 0.0) is None for it in range(100))
    assert [varilen_length(8, it, 128, 0.2) for it in range(200)] != got[:200]


def test_config_errors():
    with pytest.raises(ValueError, match="model_running_mode"):
        DiffusionConfig(model_running_mode="difflm", mask_token_id=1)
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionConfig()
    with pytest.raises(ValueError, match="p_mask"):
        DiffusionConfig(mask_token_id=1, p_mask="exact")
    with pytest.raises(ValueError, match="mask_eps"):
        DiffusionConfig(mask_token_id=1, mask_eps=1.0)
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionConfig(mask_token_id=300).check_vocab(259)
    DiffusionConfig(model_running_mode="vanilla")  # AR needs no mask token


@pytest.mark.gpu
def test_noise_identical_on_cpu_and_gpu():
    cfg = DiffusionConfig(mask_token_id=MASK, seed=77, p_mask="realised")
    tokens = torch.randint(0, 50, (5, 300))
    idx = torch.tensor([0, 9, 2**35, 4, 123456789])
    cpu = forward_process(tokens, idx, cfg)
    gpu = forward_process(tokens.cuda(), idx.cuda(), cfg)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
    u = counter_uniform(3, 2, torch.arange(10_000))
    assert torch.equal(u, counter_uniform(3, 2, torch.arange(10_000, device="cuda")).cpu())
