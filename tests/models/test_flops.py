"""Megatron FLOPs formula vs a GEMM-by-GEMM hand count and torch's FlopCounterMode."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megadlms.models import GPTModel, TransformerConfig, num_floating_point_operations


def _hand_count(c, B, S, causal=False):
    H, N, G, D, Fh, V = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_query_groups,
        c.kv_channels,
        c.ffn_hidden_size,
        c.vocab_size,
    )
    gemm = lambda m, n, k: 2 * m * n * k  # noqa: E731
    per_layer = (
        gemm(B * S, H, N * D + 2 * G * D)  # linear_qkv
        + gemm(B * N * S, D, S) * (0.5 if causal else 1)  # Q K^T
        + gemm(B * N * S, S, D) * (0.5 if causal else 1)  # P V
        + gemm(B * S, N * D, H)  # linear_proj
        + gemm(B * S, H, Fh * (2 if c.swiglu else 1))  # linear_fc1
        + gemm(B * S, Fh, H)
    )  # linear_fc2
    forward = c.num_layers * per_layer + gemm(B * S, H, V)  # + logits
    return 3 * forward


@pytest.mark.parametrize("kw", [dict(), dict(swiglu=True, num_query_groups=2, ffn_hidden_size=80)])
def test_flops_formula_vs_hand_count(kw):
    c = TransformerConfig(
        num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=101, seq_length=32, **kw
    )
    for causal in (False, True):
        got = num_floating_point_operations(c, 5, 32, causal=causal)
        assert got == pytest.approx(_hand_count(c, 5, 32, causal), rel=1e-12)


def test_flops_formula_vs_torch_flop_counter():
    c = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        seq_length=16,
        swiglu=True,
        position_embedding_type="rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(c, attention="bidirectional")
    ids = torch.randint(0, 64, (3, 16))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    # torch counts every linear/logit GEMM of the forward; on CPU its SDPA kernel is not
    # counted, so add the two S x S attention GEMMs (4*B*N*S*S*D per layer). Training = 3x.
    B, S, N, D = 3, 16, 4, 8
    attention = 4 * B * N * S * S * D * c.num_layers
    assert counter.get_flop_counts()["Global"]  # the counter saw the GEMMs
    total = 3 * (counter.get_total_flops() + attention)
    assert total == pytest.approx(num_floating_point_operations(c, B, S), rel=1e-9)
