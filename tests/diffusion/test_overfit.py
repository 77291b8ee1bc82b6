"""A tiny bidirectional model memorises one batch under the masked-diffusion loss."""

import torch

from megadlms.diffusion import DiffusionConfig, compute_loss
from megadlms.models import GPTModel, TransformerConfig


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    V, S, mask = 33, 16, 32
    # learned positions: a row that is entirely [MASK] (t near 1) gives a RoPE-only model no
    # way to tell positions apart (identical tokens, relative rotations only), so it could not
    # memorise that row.
    model = GPTModel(
        TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            vocab_size=V,
            seq_length=S,
            position_embedding_type="learned_absolute",
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    )
    text = torch.randint(0, mask, (4, S + 1))
    batch = {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": torch.ones(4, S),
        "position_ids": torch.arange(S).expand(4, S),
        "sample_idx": torch.arange(4),
    }
    # fixed iteration + sample indices: the same noisy batch every step (pure memorisation)
    cfg = DiffusionConfig(mask_token_id=mask, seed=0, varilen_prob=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(120):
        loss_sum, num, _ = compute_loss(model, batch, cfg, iteration=0)
        loss = loss_sum / num
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
