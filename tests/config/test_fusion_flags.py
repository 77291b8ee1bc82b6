"""The fused-kernel flags: Megatron's --no-rope-fusion and --no-bias-swiglu-fusion (which now
acts) and megadlms's --no-residual-rmsnorm-fusion become TransformerConfig fields, on by
default; --help documents each with the device rule."""

from __future__ import annotations

from megadlms.config import build_parser, parse_config

BASE = (
    "--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
    "--train-iters 2 --lr 1e-3 --mock-data"
).split()
FIELDS = ("apply_rope_fusion", "bias_swiglu_fusion", "residual_rmsnorm_fusion")
FLAGS = ("--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-residual-rmsnorm-fusion")


def test_fusions_are_on_by_default_and_each_flag_turns_one_off():
    on = parse_config(BASE, world_size=1).model
    assert all(getattr(on, f) for f in FIELDS)
    for flag, field in zip(FLAGS, FIELDS):
        cfg = parse_config(BASE + [flag], world_size=1)
        assert [getattr(cfg.model, f) for f in FIELDS] == [f != field for f in FIELDS], flag
        # acts now: not reported as a Megatron flag without effect
        assert not any(flag in note for note in cfg.logging.notes)


def test_help_states_the_device_rule():
    text = " ".join(build_parser().format_help().split())
    for flag in FLAGS:
        after = text[text.index(flag) :]
        assert "On CPU the unfused torch ops always run" in after[:700], flag


def test_the_fields_round_trip_through_the_checkpoint_record():
    from megadlms.models import TransformerConfig

    cfg = parse_config(BASE + ["--no-rope-fusion"], world_size=1).model
    again = TransformerConfig.from_dict(cfg.to_dict())
    assert (again.apply_rope_fusion, again.bias_swiglu_fusion) == (False, True)
    old = {k: v for k, v in cfg.to_dict().items() if k not in FIELDS}  # a record from before the flags
    assert all(getattr(TransformerConfig.from_dict(old), f) for f in FIELDS)
