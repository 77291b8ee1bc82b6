"""Document packing: a packed sample attends only within each document and positions
restart per document, equal to running each document separately; the batch fields follow
Megatron's _get_ltor_masks_and_position_ids."""

from __future__ import annotations

import pytest
import torch

from megadlms.data.packing import add_packing_fields
from megadlms.models import GPTModel, TransformerConfig

EOD = 9


def _model(attention, kernel, pos):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=16, seq_length=12,
        position_embedding_type=pos, attention=attention, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    return GPTModel(cfg, core_attn_implementation=kernel).eval()


@pytest.mark.parametrize("kernel", ["TEDotProductAttention", "FlexAttention"])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
@pytest.mark.parametrize("pos", ["rope", "learned_absolute"])
def test_packed_equals_documents_run_separately(kernel, attention, pos):
    model = _model(attention, kernel, pos)
    docs = [[1, 2, 3, EOD], [4, 5, EOD], [6, 7, 8, 1, 2]]
    tokens = torch.tensor([sum(docs, [])])
    doc_ids = torch.tensor([[i for i, d in enumerate(docs) for _ in d]])
    positions = torch.tensor([[j for d in docs for j in range(len(d))]])
    with torch.no_grad():  # torch's flex_attention has no CPU backward
        packed = model(tokens, positions, document_ids=doc_ids)
        alone = torch.cat([model(torch.tensor([d])) for d in docs], dim=1)
        unpacked = model(tokens, positions)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unpacked, alone, atol=1e-3)  # the mask matters


def _megatron_positions(tokens, eod):
    """Megatron's loop: position_ids[(i + 1):] -= (i + 1 - prev_index) for each eod i."""
    pos = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    for b in range(tokens.shape[0]):
        prev = 0
        for i in (tokens[b] == eod).nonzero().flatten().tolist():
            pos[b, i + 1 :] -= i + 1 - prev
            prev = i + 1
    return pos


def test_packing_fields_follow_megatron():
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 12, (3, 33), generator=g)
    batch = {"tokens": text[:, :-1], "labels": text[:, 1:]}
    out = add_packing_fields(batch, EOD, reset_positions=True, reset_attention=True)
    assert torch.equal(out["position_ids"], _megatron_positions(batch["tokens"], EOD))
    for b in range(3):  # labels[j] = text[j+1] belongs to the document after every eod in text[0..j]
        for j in range(32):
            assert out["document_ids"][b, j] == int((text[b, : j + 1] == EOD).sum())
