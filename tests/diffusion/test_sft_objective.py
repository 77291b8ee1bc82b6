"""The fine-tuning objective against LLaDA's GUIDELINES.md "SFT" code, on the same batch, mask
and model; the prompt is never noised; compute_loss (the trainer's path) gives the same number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadlms.diffusion import (
    DiffusionConfig,
    compute_loss,
    loss_token_count,
    sft_forward_process,
    sft_loss,
    training_inputs,
    validation_inputs,
)
from megadlms.models import GPTModel, TransformerConfig

V, MASK, S = 64, 63, 24


def _model():
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=S,
        position_embedding_type="rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return GPTModel(cfg, attention="bidirectional").eval()


def _sft_batch(b=4, first_idx=0):
    """LLaDA's layout: prompt then answer then EOS padding (answer); prompt_lengths per row."""
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(0, MASK, (b, S), generator=g)  # never the mask id
    prompt_lengths = torch.tensor([3, 7, 12, 5][:b])
    answer = torch.arange(S)[None, :] >= prompt_lengths[:, None]
    batch = {
        "tokens": ids.clone(),  # unused by the 'llada' objective: the target and input is labels
        "labels": ids,
        "loss_mask": answer.to(torch.float32),
        "answer_mask": answer,
        "position_ids": torch.arange(S).expand(b, S).clone(),
        "sample_idx": torch.arange(first_idx, first_idx + b),
    }
    return batch, prompt_lengths


def _config(**kw):
    return DiffusionConfig(mask_token_id=MASK, objective="llada", sft=True, seed=7, **kw)


def _llada_guidelines_sft(model, input_ids, prompt_lengths, noisy_batch, p_mask):
    """GUIDELINES.md "SFT", as written there after LLaDA's own forward_process (its three name
    slips fixed: temp_tensor -> token_positions, prompt_length -> prompt_lengths,
    answer_length -> answer_lengths); ``model(x)`` returns the logits (``.logits`` in HF)."""
    noisy_batch = noisy_batch.clone()
    # Do not add noise to the prompt
    token_positions = torch.arange(noisy_batch.shape[1], device=noisy_batch.device).expand(
        noisy_batch.size(0), noisy_batch.size(1)
    )
    prompt_mask = token_positions < prompt_lengths.unsqueeze(1)
    noisy_batch[prompt_mask] = input_ids[prompt_mask]
    # Calculate the answer length (including the padded <EOS> tokens)
    prompt_mask = prompt_mask.to(torch.int64)
    answer_lengths = torch.sum((1 - prompt_mask), dim=-1, keepdim=True)
    answer_lengths = answer_lengths.repeat(1, noisy_batch.shape[1])
    masked_indices = noisy_batch == MASK
    logits = model(noisy_batch)
    token_loss = (
        F.cross_entropy(logits[masked_indices], input_ids[masked_indices], reduction="none")
        / p_mask[masked_indices]
    )
    return torch.sum(token_loss / answer_lengths[masked_indices]) / input_ids.shape[0]


@torch.no_grad()
def test_sft_loss_equals_llada_guidelines_and_the_trainers_path():
    model, cfg = _model(), _config()
    batch, prompt_lengths = _sft_batch()
    ids, answer = batch["labels"], batch["answer_mask"]
    # LLaDA's forward_process masks the whole sequence; ours draws the same per-position
    # uniforms and keeps the answer's: feed LLaDA's code the whole-sequence draw.
    from megadlms.diffusion import forward_process

    full_noisy, _, p_mask = forward_process(ids, batch["sample_idx"], cfg, answer.to(torch.float32))
    reference = _llada_guidelines_sft(model, ids, prompt_lengths, full_noisy, p_mask)

    noisy, masked, p = sft_forward_process(ids, answer, batch["sample_idx"], cfg)
    ours = sft_loss(model(noisy), ids, masked, p, answer)
    assert reference.item() > 0
    assert abs(ours.item() - reference.item()) <= 1e-6 * reference.item()

    # The trainer's path (training_inputs -> forward -> score, over the step's row count).
    loss_sum, count, _ = compute_loss(model, batch, cfg, iteration=0)
    assert count.item() == 4.0
    assert abs(loss_sum.item() / count.item() - reference.item()) <= 1e-6 * reference.item()


def test_prompt_never_masked_over_many_draws():
    batch, _ = _sft_batch()
    ids, answer = batch["labels"], batch["answer_mask"]
    masked_answer = 0
    for p_mask in ("sampled", "realised"):
        for seed in range(50):
            cfg = DiffusionConfig(mask_token_id=MASK, objective="llada", sft=True, seed=seed, p_mask=p_mask)
            for draw in range(4):
                noisy, masked, _ = sft_forward_process(ids, answer, batch["sample_idx"], cfg, draw=draw)
                assert not (masked & ~answer).any()
                assert torch.equal(noisy[~answer], ids[~answer])
                assert torch.equal(noisy[masked], torch.full_like(noisy[masked], MASK))
                masked_answer += int(masked.sum())
        inputs = training_inputs(batch, cfg)
        assert not (inputs.tokens == MASK)[~answer].any()
    assert masked_answer > 0


def test_normalisations_counts_and_validation():
    batch, _ = _sft_batch()
    answer = batch["answer_mask"]
    assert loss_token_count(batch, None, _config()).item() == 4.0  # 'sample': the rows
    tok = _config(sft_loss_normalization="token")
    assert loss_token_count(batch, None, tok).item() == float(answer.sum())
    # validation counts answer tokens (the NELBO per answer token) whatever the normalisation
    assert loss_token_count(batch, None, _config(), validation=True).item() == float(answer.sum())
    weights = training_inputs(batch, _config()).targets["loss_mask"]
    assert torch.allclose(weights.sum(dim=1), torch.ones(4))
    # validation: the answer NELBO per answer token, the prompt clean
    v = validation_inputs(batch, _config(), draw=0, num_draws=4)
    assert not (v.tokens == MASK)[~answer].any()
    assert torch.equal(v.targets["loss_mask"], answer.to(torch.float32))
    # pretraining data under --sft: one clear error
    plain = {k: t for k, t in batch.items() if k != "answer_mask"}
    with pytest.raises(ValueError, match="answer_mask"):
        training_inputs(plain, _config())


@torch.no_grad()
def test_vanilla_sft_is_answer_only_cross_entropy():
    """AR fine-tuning (Megatron's SFT): next-token CE on answer tokens only, token mean."""
    batch, _ = _sft_batch()
    cfg = DiffusionConfig(model_running_mode="vanilla", mask_token_id=MASK, sft=True)
    torch.manual_seed(0)
    model = GPTModel(
        TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=V,
            seq_length=S,
            hidden_dropout=0.0,
        ),
        attention="causal",
    ).eval()
    loss_sum, count, _ = compute_loss(model, batch, cfg, iteration=0)
    logits = model(batch["tokens"], batch["position_ids"])
    ce = F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), reduction="none").view(4, S)
    answer = batch["answer_mask"]
    assert count.item() == float(answer.sum())
    assert torch.allclose(loss_sum, (ce * answer).sum(), rtol=1e-6)
