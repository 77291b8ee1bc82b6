"""--model-running-mode difflm-shift (Dream): the objective, the validation draws, the sampler
and the answer likelihood all read the logits at position i as the prediction of token i + 1."""

import pytest
import torch
from torch import nn

from megadlms.common.enums import RunningMode
from megadlms.config import parse_config
from megadlms.diffusion import (
    DiffusionConfig,
    answer_nll_draws,
    check_model_for_mode,
    compute_loss,
    generate,
    loss_token_count,
    training_inputs,
    validation_inputs,
)
from megadlms.diffusion.noise import TAG_MASK, TAG_TIME
from megadlms.models import GPTModel, TransformerConfig

from ._reference import uniform as ref_uniform

V, MASK, S = 23, 22, 12
SHIFT = RunningMode.DIFFLM_SHIFT


def _tiny(attention="bidirectional"):
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
    return GPTModel(cfg, attention=attention)


def _batch(n, first_idx=0):
    g = torch.Generator().manual_seed(n)
    text = torch.randint(0, MASK, (n, S + 1), generator=g)
    loss_mask = torch.ones(n, S)
    loss_mask[0, 3] = 0.0  # labels[0, 3] = tokens[0, 4]: masked or not, never scored
    return {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": loss_mask,
        "position_ids": torch.arange(S).expand(n, S),
        "sample_idx": torch.arange(first_idx, first_idx + n),
    }


def _config(**kw):
    return DiffusionConfig(
        model_running_mode=SHIFT, mask_token_id=MASK, seed=5, mask_eps=0.01, varilen_prob=0.0, **kw
    )


def test_shift_loss_matches_dreams_right_shifted_logits():
    """Dream's trainer: logits moved one position right, CE of masked tokens / p; position 0 is
    never masked. The noise of text position j (1..S-1) is keyed by j - 1."""
    cfg, model, batch = _config(), _tiny(), _batch(4, first_idx=40)
    loss_sum, num, stats = compute_loss(model, batch, cfg, iteration=0)
    tokens = batch["tokens"]
    noisy, weights = tokens.clone(), {}
    for b in range(4):
        s_idx = 40 + b
        p = (1 - cfg.mask_eps) * ref_uniform(cfg.seed, TAG_TIME, s_idx, 0) + cfg.mask_eps
        for j in range(1, S):
            if ref_uniform(cfg.seed, TAG_MASK, s_idx, 0, j - 1) < p:
                noisy[b, j] = MASK
                w = batch["loss_mask"][b, j - 1].item()
                weights[(b, j)] = w / torch.tensor(p, dtype=torch.float32).item()
    logits = model(noisy).double()
    shifted = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # Dream's generation_utils
    logp = torch.log_softmax(shifted, -1)
    want = sum(-w * logp[b, j, tokens[b, j]].item() for (b, j), w in weights.items())
    assert weights and stats["num_masked"].item() == len(weights)
    assert stats["seq_length"] == S
    assert loss_sum.item() == pytest.approx(want, rel=1e-5)
    assert num.item() == 4 * (S - 1) - 1 == loss_token_count(batch, None, cfg).item()


def test_shift_inputs_keep_the_first_token_and_align_targets_with_logits():
    cfg, batch = _config(), _batch(3)
    for inputs in (training_inputs(batch, cfg, crop=7), validation_inputs(batch, cfg, 1, 2)):
        L = inputs.tokens.shape[1]
        assert torch.equal(inputs.tokens[:, 0], batch["tokens"][:, 0])
        t = inputs.targets
        # logit position i scores token i + 1; the last one scores nothing
        assert torch.equal(t["masked"][:, : L - 1], inputs.tokens[:, 1:] == MASK)
        assert torch.equal(t["clean"][:, : L - 1], batch["tokens"][:, 1:L])
        assert not t["masked"][:, -1].any() and not t["loss_mask"][:, -1].any()
        assert torch.equal(inputs.position_ids, batch["position_ids"][:, :L])
    assert training_inputs(batch, cfg, crop=7).tokens.shape[1] == 7
    assert loss_token_count(batch, 7, cfg).item() == 3 * 6 - 1


def test_shift_mode_refuses_a_causal_model():
    with pytest.raises(ValueError, match="difflm-shift needs a bidirectional model"):
        check_model_for_mode(_tiny("causal"), _config())


class ShiftedOracle(nn.Module):
    """Logits at position i put all their weight on ``answer[i + 1]`` (a shifted model that
    knows the sequence); a sampler that does not shift reads every token one place early."""

    def __init__(self, sequence):
        super().__init__()
        self.sequence = sequence
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, x, position_ids=None):
        b, L = x.shape
        nxt = torch.cat([self.sequence[1:L], self.sequence[:1]])
        logits = torch.full((b, L, V), -20.0) + self.dummy
        logits[:, torch.arange(L), nxt] = 20.0
        return logits


def test_shift_sampler_generates_the_shifted_models_sequence():
    seq = torch.randint(0, MASK, (14,), generator=torch.Generator().manual_seed(3))
    oracle, prompt = ShiftedOracle(seq), seq[None, :4].clone()
    kw = dict(mask_token_id=MASK, gen_length=10, steps=10, block_length=5)
    out = generate(oracle, prompt, running_mode=SHIFT, **kw)
    assert torch.equal(out[0], seq)
    # Read unshifted, position i would take the token of i + 1: not the sequence.
    assert not torch.equal(generate(oracle, prompt, **kw)[0], seq)
    with pytest.raises(ValueError, match="not supported for a difflm-shift model"):
        generate(_tiny(), prompt, running_mode=SHIFT, cache="prefix", **kw)


def test_shift_likelihood_scores_each_answer_token_from_the_logits_before_it():
    seq = torch.randint(0, MASK, (10,), generator=torch.Generator().manual_seed(4))
    oracle = ShiftedOracle(seq)
    kw = dict(mask_token_id=MASK, mc_samples=4, batch_size=4)
    right = answer_nll_draws(oracle, seq[:6], seq[6:], running_mode=SHIFT, **kw)
    assert right.max().item() < 1e-6  # every answer token predicted with probability ~1
    assert answer_nll_draws(oracle, seq[:6], seq[6:], **kw).min().item() > 1.0
    with pytest.raises(ValueError, match="at least one token"):
        answer_nll_draws(oracle, [], seq[6:], running_mode=SHIFT, **kw)


def test_shift_flag_parses_and_refuses_causal_attention():
    base = (
        "--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
        "--train-iters 2 --lr 1e-3 --mock-data --model-running-mode difflm-shift"
    ).split()
    config = parse_config(base, world_size=1)
    assert config.diffusion.model_running_mode is SHIFT and config.diffusion.diffusion
    assert config.model.attention == "bidirectional"
    with pytest.raises(ValueError, match="difflm-shift trains a bidirectional mask predictor"):
        parse_config(base + ["--attention-mask-type", "causal"], world_size=1)


def test_shift_mode_is_read_from_the_checkpoint_record():
    from megadlms.generate import running_mode

    assert running_mode({"args": {"diffusion": {"model_running_mode": "difflm-shift"}}}) is SHIFT
    assert running_mode({"model_config": {}}) is RunningMode.DIFFLM_NOSHIFT
