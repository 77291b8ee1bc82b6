"""Pipeline-parallel flags at the boundary: the layout fields, the micro-batch rule of each
schedule and the layer split, every error worded with the flags and one valid neighbour."""

from __future__ import annotations

import shlex

import pytest

from megadlms.config import parse_config

from .test_arguments import seed_ddp_tp2

BASE = shlex.split(
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 1 --train-iters 10 --lr 1e-3 --mock-data"
)

# (id, flags, world size, substrings of the error, a valid neighbour: same intent, fixed)
RULES = [
    (
        "1f1b_too_few_micro_batches",
        ["--pipeline-model-parallel-size", "4", "--global-batch-size", "3"],
        4,
        [
            "--global-batch-size 3 / (--micro-batch-size 1 x --data-parallel-size 1) = 3 micro-batches",
            "the 1F1B pipeline schedule needs at least --pipeline-model-parallel-size 4",
            "raise --global-batch-size to 4",
        ],
        ["--pipeline-model-parallel-size", "4", "--global-batch-size", "4"],
    ),
    (
        "1f1b_with_dp",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"],
        4,
        ["(--micro-batch-size 1 x --data-parallel-size 2) = 1 micro-batches", "raise --global-batch-size to 4"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "6"],
    ),
    (
        "interleaved_not_multiple",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "3", "--num-layers-per-virtual-pipeline-stage", "1"],
        2,
        ["the interleaved pipeline schedule (2 virtual stages) needs a multiple of --pipeline-model-parallel-size 2"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    (
        "interleaved_vp_flag",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "5", "--virtual-pipeline-model-parallel-size", "2"],
        2,
        ["= 5 micro-batches per step: the interleaved pipeline schedule (2 virtual stages)"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "6", "--virtual-pipeline-model-parallel-size", "2"],
    ),
    (
        "virtual_layers_divide",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--num-layers-per-virtual-pipeline-stage", "3"],
        2,
        ["--num-layers 4 is not divisible by --pipeline-model-parallel-size 2 x --num-layers-per-virtual-pipeline-stage 3"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--num-layers-per-virtual-pipeline-stage", "2"],
    ),
    (
        "virtual_exclusive",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
         "--num-layers-per-virtual-pipeline-stage", "1", "--virtual-pipeline-model-parallel-size", "2"],
        2,
        ["--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size are exclusive"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--virtual-pipeline-model-parallel-size", "2"],
    ),
    (
        "virtual_needs_pp",
        ["--virtual-pipeline-model-parallel-size", "2"],
        1,
        ["--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1"],
        [],
    ),
    (
        "uneven_needs_pp",
        ["--decoder-first-pipeline-num-layers", "1"],
        1,
        ["--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1"],
        [],
    ),
    (
        "uneven_split",
        ["--pipeline-model-parallel-size", "3", "--global-batch-size", "3", "--decoder-first-pipeline-num-layers", "1"],
        3,
        ["the 3 layers left by --decoder-first-pipeline-num-layers 1", "evenly (at least one each) over the 2 middle stages"],
        ["--pipeline-model-parallel-size", "3", "--global-batch-size", "3", "--decoder-first-pipeline-num-layers", "2"],
    ),
    (
        "even_split",
        ["--pipeline-model-parallel-size", "3", "--global-batch-size", "3"],
        3,
        ["--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"],
        ["--pipeline-model-parallel-size", "3", "--global-batch-size", "3", "--decoder-last-pipeline-num-layers", "2"],
    ),
    (
        "torch_format",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--ckpt-format", "torch"],
        2,
        ["--ckpt-format torch (one file written by rank 0) needs --pipeline-model-parallel-size 1"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--ckpt-format", "torch_dist"],
    ),
    (
        "fsdp2_pp",
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--use-torch-fsdp2",
         "--untie-embeddings-and-output-weights"],
        2,
        ["--use-torch-fsdp2 requires --pipeline-model-parallel-size 1 (got 2)"],
        ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--untie-embeddings-and-output-weights"],
    ),
]  # fmt: skip


@pytest.mark.parametrize("rule_id,flags,world,expected,valid", RULES, ids=[r[0] for r in RULES])
def test_pipeline_rule_names_the_flags(rule_id, flags, world, expected, valid):
    with pytest.raises(ValueError) as err:
        parse_config(BASE + flags, world_size=world)
    for text in expected:
        assert text in str(err.value), f"{rule_id}: {text!r} not in {err.value}"
    parse_config(BASE + valid, world_size=world)  # the neighbour passes


def test_pipeline_layout_fields():
    cfg = parse_config(
        BASE
        + shlex.split(
            "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --global-batch-size 8 "
            "--num-layers-per-virtual-pipeline-stage 1"
        ),
        world_size=8,
    )
    par = cfg.parallel
    assert (par.pipeline_model_parallel_size, par.tensor_model_parallel_size, par.data_parallel_size) == (
        2,
        2,
        2,
    )
    assert par.virtual_stages(cfg.model.num_layers) == 2 and cfg.training.num_micro_batches == 4
    cfg = parse_config(
        BASE
        + shlex.split(
            "--pipeline-model-parallel-size 2 --global-batch-size 2 "
            "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3"
        ),
        world_size=2,
    )
    assert cfg.parallel.decoder_first_pipeline_num_layers == 1 and cfg.parallel.virtual_stages(4) == 1
    # Megatron's newer name of the virtual-stage count
    cfg = parse_config(
        BASE
        + shlex.split(
            "--pipeline-model-parallel-size 2 --global-batch-size 2 --num-virtual-stages-per-pipeline-rank 2"
        ),
        world_size=2,
    )
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2


def test_megadlms_script_at_pp2_parses():
    """The MegaDLMs 1.7b flag arrays with --pipeline-model-parallel-size 2 (8 ranks: tp 2 x pp 2 x dp 2)."""
    argv = seed_ddp_tp2()
    argv[argv.index("--pipeline-model-parallel-size") + 1] = "2"
    cfg = parse_config(argv, world_size=8)
    assert cfg.parallel.pipeline_model_parallel_size == 2 and cfg.parallel.data_parallel_size == 2
    assert cfg.training.num_micro_batches == 4  # 16 / (2 x 2) >= pp


def test_variable_seq_lengths_is_accepted_with_a_note():
    """Megatron's --variable-seq-lengths: lengths vary per micro-batch here without it (every
    stage computes each micro-batch's activation shape), so it parses and is noted once."""
    pp2 = BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"]
    assert not any("--variable-seq-lengths" in n for n in parse_config(pp2, world_size=2).logging.notes)
    notes = parse_config(pp2 + ["--variable-seq-lengths"], world_size=2).logging.notes
    assert [n for n in notes if n.startswith("--variable-seq-lengths: ")] == [
        "--variable-seq-lengths: every pipeline stage computes each micro-batch's activation shape from "
        "its crop: lengths vary per micro-batch without a shape exchange (the same numbers either way)"
    ]
