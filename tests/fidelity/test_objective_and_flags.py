"""MegaDLMs' objective and flag semantics (pretrain_difflm.py, megatron/core/models/difflm,
custom_args/difflm.py), each detail against an independent statement of MegaDLMs' rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megadlms.config import build_parser, parse_config
from megadlms.diffusion import (
    DiffusionConfig,
    forward_process,
    loss_token_count,
    micro_batch_crop,
    objective_inputs,
)

BASE = (
    "--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
    "--train-iters 2 --lr 1e-3 --mock-data"
).split()


def _cfg(*extra):
    return parse_config(BASE + list(extra), world_size=1)


def test_megadlms_objective_is_the_default_and_llada_is_one_switch():
    d = _cfg().diffusion
    assert (d.objective, d.mask_eps, d.p_mask, d.eval_mc_samples) == ("megadlms", 0.0, "realised", 1)
    d = _cfg("--difflm-objective", "llada").diffusion
    assert (d.objective, d.mask_eps, d.p_mask) == ("llada", 1e-3, "sampled")
    d = _cfg("--difflm-objective", "llada", "--difflm-mask-eps", "0.1").diffusion
    assert d.mask_eps == 0.1  # an explicit flag still wins


def _batch(S=8):
    text = torch.arange(100, 100 + S + 1)[None]
    return {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": torch.ones(1, S),
        "position_ids": torch.arange(S)[None],
    }


def test_noshift_inputs_and_labels_are_text_1_to_L():
    """MegaDLMs: crop tokens/labels to L, then input_ids[:, 1:] and labels[:, :-1]."""
    b, cfg = _batch(8), DiffusionConfig(mask_token_id=0, objective="megadlms")
    text = torch.arange(100, 109)
    for crop, L in ((None, 8), (5, 5)):
        got = objective_inputs(b, cfg, crop)
        tokens_L, labels_L = b["tokens"][:, :L], b["labels"][:, :L]
        assert torch.equal(got["clean"], tokens_L[:, 1:]) and torch.equal(got["clean"], labels_L[:, :-1])
        assert got["clean"].tolist() == [text[1:L].tolist()]
        assert got["position_ids"].tolist() == [list(range(1, L))]  # position_ids[:, 1:]
        assert float(loss_token_count(b, crop, cfg)) == L - 1  # loss_mask[:, :L-1].sum()
    llada = objective_inputs(b, DiffusionConfig(mask_token_id=0, objective="llada"), None)
    assert llada["clean"].tolist() == [text[1:].tolist()]


def _megadlms_use_varilen(iteration, accum_step, num_accum, S, prob):
    """MegaDLMs' GPTModel.use_varilen_data, with numpy's global RNG as it does."""
    state = np.random.get_state()
    np.random.seed(iteration * num_accum + accum_step)
    u = np.random.uniform(0, 1)
    length = np.random.randint(low=2, high=S + 1)
    np.random.set_state(state)
    return length if u < prob else None


def test_variable_length_crop_is_megadlms_per_micro_batch():
    cfg = DiffusionConfig(mask_token_id=0, objective="megadlms", varilen_prob=0.3)
    got = [[micro_batch_crop(cfg, it, m, 4, 64) for m in range(4)] for it in range(30)]
    want = [[_megadlms_use_varilen(it, m, 4, 64, 0.3) for m in range(4)] for it in range(30)]
    assert got == want and any(c is not None for row in got for c in row)
    assert any(len(set(row)) > 1 for row in got)  # differs between micro-batches of a step
    # MegaDLMs crops only with attention-mask-type no_mask
    assert all(micro_batch_crop(cfg, it, 0, 1, 64, bidirectional=False) is None for it in range(30))


def test_realised_mask_fraction_and_at_least_one_masked_token():
    cfg = DiffusionConfig(mask_token_id=0, objective="megadlms")
    clean = torch.arange(1, 9).repeat(400, 1)
    _, masked, p = forward_process(clean, torch.arange(400), cfg)
    assert bool((masked.sum(1) >= 1).all())
    assert torch.allclose(p[:, 0], masked.sum(1).float() / 8)
    t_min = masked.float().mean(1).min()
    assert t_min == 1 / 8  # eps 0: some rows have exactly the one forced mask


def test_tokenizer_model_without_type_is_huggingface_and_byte_with_model_fails():
    assert _cfg("--tokenizer-model", "/x/tokenizer.json").data.tokenizer.tokenizer_type == (
        "HuggingFaceTokenizer"
    )
    assert _cfg().data.tokenizer.tokenizer_type == "ByteTokenizer"
    with pytest.raises(ValueError, match="--tokenizer-model .* --tokenizer-type ByteTokenizer"):
        _cfg("--tokenizer-model", "/x/tokenizer.json", "--tokenizer-type", "ByteTokenizer")


def test_attention_mask_types_with_megadlms_meaning():
    assert _cfg("--attention-mask-type", "causal_bottom_right").model.attention == "causal"
    assert _cfg("--attention-mask-type", "no_mask").model.attention == "bidirectional"
    vanilla = _cfg("--model-running-mode", "vanilla", "--attention-mask-type", "no_mask")
    assert vanilla.model.attention == "causal"  # decided at parse time, with a note
    assert any("vanilla mode runs causal" in n for n in vanilla.logging.notes)
    with pytest.raises(ValueError, match="block_causal needs MegaDLMs' conditional"):
        _cfg("--attention-mask-type", "block_causal")


def test_notes_and_hints_are_right():
    assert not any("params-norm" in n for n in _cfg("--log-params-norm").logging.notes)
    assert _cfg("--log-params-norm").logging.log_params_norm
    for spelling in ("--override-opt_param-scheduler", "--override-opt-param-scheduler"):
        assert _cfg(spelling).schedule.override_opt_param_scheduler
    from megadlms.optimizer.lr_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10)
    state = dict(sched.state_dict(), max_lr=2.0)
    with pytest.raises(ValueError) as err:
        sched.load_state_dict(state)
    flag = next(w for w in str(err.value).split() if w.startswith("--override"))
    build_parser().parse_args(BASE + [flag])  # the suggested flag parses


def test_megadlms_only_flags_are_accepted_or_implemented():
    cfg = _cfg(
        "--debug", "--turn-on-debugpy", "--use-on-the-fly-eval", "--gpt-block-return-loss-and-logits",
        "--non-special-vocab-size", "100255", "--detect-anomaly", "--checkpoint-steps", "3,7",
        "--save", "/tmp/x", "--save-interval", "100", "--cut-off-varlen-to-seqlen", "--reset-position-ids",
        "--reset-attention-mask",
    )  # fmt: skip
    notes = " ".join(cfg.logging.notes)
    for flag in ("--debug", "--turn-on-debugpy", "--use-on-the-fly-eval", "--non-special-vocab-size"):
        assert flag in notes
    assert cfg.training.detect_anomaly and cfg.checkpoint.checkpoint_steps == (3, 7)
    if torch.cuda.is_available():
        flex = _cfg("--core-attn-implementation", "FlexAttention", "--attention-dropout", "0")
        assert flex.training.core_attn_implementation == "FlexAttention"
    else:
        with pytest.raises(ValueError, match="FlexAttention needs CUDA"):
            _cfg("--core-attn-implementation", "FlexAttention", "--attention-dropout", "0")
    assert cfg.data.reset_attention_mask and cfg.data.reset_position_ids
    with pytest.raises(ValueError, match="FlexAttention has no attention dropout"):
        _cfg("--core-attn-implementation", "FlexAttention")
    with pytest.raises(ValueError, match="--reset-attention-mask needs --reset-position-ids"):
        _cfg("--reset-attention-mask")
