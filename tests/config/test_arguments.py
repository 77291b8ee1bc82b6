"""The Megatron-compatible parser and validate_args: seed commands, then one table row per rule.

The two reference commands are MegaDLMs' examples/dlm_training/dlm_pretrain_1.7b.sh flag
arrays (GPT_MODEL_ARGS, PLMT_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS,
EVAL_AND_LOGGING_ARGS), scaled to tiny sizes: (1) DDP with tensor parallel 2 -> the clear
not-supported-yet error; (2) FSDP2 (--use-torch-fsdp2 --ckpt-format=torch_dist
--untie-embeddings-and-output-weights, no distributed optimizer) -> passes as written.
"""

from __future__ import annotations

import shlex

import pytest

from megadlms.config import (
    build_parser,
    fsdp_mixed_precision,
    parse_args,
    parse_config,
)
from megadlms.distributed import DistributedDataParallelConfig
from megadlms.optimizer import OptimizerConfig

GPT_MODEL_ARGS = """
    --seq-length 64 --attention-backend flash --attention-softmax-in-fp32
    --attention-dropout 0.0 --hidden-dropout 0.0
    --no-bias-gelu-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 192 --swiglu
    --vocab-size 50289 --normalization RMSNorm --max-position-embeddings 64 --norm-epsilon 1e-6
    --rotary-base 10000 --disable-bias-linear --position-embedding-type rope --qk-layernorm
    --untie-embeddings-and-output-weights
"""
PLMT_ARGS = "--model-running-mode difflm-noshift --base-model vanilla --mask-token 50277 --attention-mask-type no_mask"
TRAINING_ARGS_COMMON = """
    --micro-batch-size 2 --global-batch-size 16 --train-iters 100 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --clip-grad 1.0 --bf16
    --lr 0.0002 --min-lr 0.00002 --lr-decay-style WSD --lr-warmup-iters 10 --lr-decay-iters 100
    --lr-wsd-decay-style exponential --lr-wsd-decay-iters 20
    --rerun-mode validate_results --overlap-grad-reduce --distributed-timeout-minutes 60
"""
DISTOPT_ARGS = "--use-distributed-optimizer --num-distributed-optimizer-instances 1 --overlap-param-gather"
DATA_ARGS = """
    --train-data-path /data/train_text_document --valid-data-path /data/valid_text_document
    --data-cache-path /cache/data --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model /repo/megatron/training/tokenizer/gptneox_tokenizer
"""
EVAL_AND_LOGGING_ARGS = """
    --log-interval 5 --log-params-norm --log-num-zeros-in-grad --log-throughput --log-progress
    --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard
    --save-interval 50 --non-persistent-save-interval 200 --non-persistent-ckpt-type global
    --non-persistent-global-ckpt-dir /ckpt/non_persistent --ckpt-format torch_dist
    --auto-detect-ckpt-format --ckpt-fully-parallel-load --eval-interval 50 --save /ckpt --load /ckpt
    --eval-iters 2 --tensorboard-dir /logs/tb --wandb-project dlm --wandb-exp-name dlm_training
    --wandb-run-id dlm_training --wandb-save-dir /logs/wandb --wandb-mode offline --wandb-tags dlm
    --wandb-notes training --wandb-resume allow
"""


def seed_ddp_tp2() -> list:
    """Reference command 1: the 1.7b script with MODEL_PARALLEL_SIZE=2 (4 ranks -> dp 2)."""
    parallel = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"
    return shlex.split(
        " ".join(
            [
                GPT_MODEL_ARGS,
                TRAINING_ARGS_COMMON,
                DISTOPT_ARGS,
                parallel,
                DATA_ARGS,
                EVAL_AND_LOGGING_ARGS,
                PLMT_ARGS,
            ]
        )
    )


def seed_fsdp2() -> list:
    """Reference command 2: FSDP2 instead of the distributed optimizer, TP=PP=1."""
    parallel = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1"
    fsdp = "--use-torch-fsdp2 --ckpt-format=torch_dist --untie-embeddings-and-output-weights"
    return shlex.split(
        " ".join(
            [
                GPT_MODEL_ARGS,
                TRAINING_ARGS_COMMON,
                parallel,
                DATA_ARGS,
                EVAL_AND_LOGGING_ARGS,
                PLMT_ARGS,
                fsdp,
            ]
        )
    )


def test_seed_fsdp2_command_passes_as_written():
    for world in (2, 4, 8):
        cfg = parse_config(seed_fsdp2(), world_size=world)
        assert cfg.parallel.use_torch_fsdp2 and cfg.checkpoint.ckpt_format == "torch_dist"
        assert cfg.parallel.data_parallel_size == world and cfg.training.num_micro_batches == 16 // (
            2 * world
        )
        assert cfg.optimizer.bf16 and cfg.ddp.grad_reduce_in_fp32  # Megatron: bf16 reduces in fp32
        m = cfg.model
        assert m.num_query_groups == 4 and m.ffn_hidden_size == 192 and m.kv_channels == 16
        # speed/logging-only flags are accepted and reported, never silently dropped
        reported = " ".join(cfg.logging.notes)
        assert "--attention-backend" in reported
        # Megatron's result validation acts (training/rerun.py): a typed field, not a note
        assert cfg.resilience.rerun_mode == "validate_results" and "--rerun-mode" not in reported
        # non-persistent checkpoints act (config/flags/checkpoint.py): typed fields, not a "no effect" note
        assert (cfg.checkpoint.non_persistent_save_interval, cfg.checkpoint.non_persistent_ckpt_type) == (
            200, "global",
        ) and "--non-persistent" not in reported  # fmt: skip
    # Megatron's own FSDP2 recipe adds --no-gradient-accumulation-fusion: also fine
    assert parse_args(seed_fsdp2() + ["--no-gradient-accumulation-fusion"], world_size=2).use_torch_fsdp2


def test_seed_ddp_tp2_command_parses():
    """The MegaDLMs 1.7b script at MODEL_PARALLEL_SIZE=2 (tp 2 on 4 ranks: dp 2) is accepted as written."""
    cfg = parse_config(seed_ddp_tp2(), world_size=4)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.data_parallel_size == 2
    assert cfg.optimizer.use_distributed_optimizer and cfg.parallel.gradient_accumulation_fusion
    with pytest.raises(ValueError, match="world size 3 is not divisible by --tensor-model-parallel-size 2"):
        parse_config(seed_ddp_tp2(), world_size=3)


# A valid small command; each row below breaks exactly one rule and names its fix.
BASE = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data"
)
FSDP = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]

# (id, extra flags that break a rule, world size, substrings the message must contain,
#  valid neighbour flags: same intent, fixed)
RULES = [
    (  # FSDP2 composes with TP (+SP) and, through the instances, hybrid sharding
        "instances_without_sharding",
        ["--num-distributed-optimizer-instances", "2"],
        4,
        ["needs --use-distributed-optimizer", "or --use-torch-fsdp2 (hybrid sharding)"],
        FSDP
        + [
            "--num-distributed-optimizer-instances",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
    (
        "fsdp2_pp",
        FSDP + ["--pipeline-model-parallel-size", "2"],
        4,
        ["--use-torch-fsdp2 requires --pipeline-model-parallel-size 1"],
        FSDP,
    ),
    (
        "fsdp2_ep",
        FSDP + ["--expert-model-parallel-size", "2"],
        2,
        ["--use-torch-fsdp2 requires --expert-model-parallel-size 1"],
        FSDP,
    ),
    (
        "fsdp2_distopt",
        FSDP + ["--use-distributed-optimizer"],
        2,
        [
            "--use-torch-fsdp2 is incompatible with --use-distributed-optimizer",
            "drop --use-distributed-optimizer",
        ],
        ["--use-distributed-optimizer"],
    ),
    (
        "fsdp2_ckpt",
        FSDP + ["--ckpt-format", "torch"],
        2,
        ["--use-torch-fsdp2 requires --ckpt-format torch_dist"],
        FSDP + ["--ckpt-format", "torch_dist"],
    ),
    (
        "fsdp2_tied",
        ["--use-torch-fsdp2"],
        2,
        ["--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"],
        FSDP,
    ),
    (
        "fsdp2_fp16",
        FSDP + ["--fp16"],
        2,
        ["--use-torch-fsdp2 is incompatible with --fp16, which needs loss scaling: use --bf16"],
        FSDP + ["--bf16"],
    ),
    ("fp16_bf16", ["--fp16", "--bf16"], 2, ["--fp16 and --bf16 are exclusive"], ["--bf16"]),
    (
        "overlap_pg_no_distopt",
        ["--overlap-param-gather", "--overlap-grad-reduce"],
        2,
        ["--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"],
        ["--overlap-param-gather", "--overlap-grad-reduce", "--use-distributed-optimizer"],
    ),
    (
        "overlap_pg_no_overlap_grad",
        ["--overlap-param-gather", "--use-distributed-optimizer"],
        2,
        ["--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"],
        ["--overlap-param-gather", "--overlap-grad-reduce", "--use-distributed-optimizer"],
    ),
    (
        "global_batch",
        ["--global-batch-size", "10"],
        2,
        ["--global-batch-size 10 is not a multiple of --micro-batch-size 2 x data-parallel size 2"],
        ["--global-batch-size", "12"],
    ),
    (
        "global_batch_3ranks",
        [],
        3,
        ["--global-batch-size 8 is not a multiple of --micro-batch-size 2 x data-parallel size 3"],
        ["--global-batch-size", "12"],
    ),
    (
        "dp_size",
        ["--data-parallel-size", "4"],
        2,
        ["--data-parallel-size 4 != world size 2", "pass --data-parallel-size 2 or leave it unset"],
        ["--data-parallel-size", "2"],
    ),
    (
        "world_not_divisible",
        ["--pipeline-model-parallel-size", "2"],
        3,
        [
            "world size 3 is not divisible by --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2"
        ],
        [],
    ),
    (
        "tp_heads",
        ["--tensor-model-parallel-size", "8"],
        8,
        ["--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"],
        ["--tensor-model-parallel-size", "2"],
    ),
    (
        "recompute",
        ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
        2,
        ["--recompute-granularity full needs --recompute-method uniform or block"],
        ["--recompute-granularity", "full", "--recompute-num-layers", "1", "--recompute-method", "block"],
    ),
    ("fp8", ["--fp8-format", "hybrid"], 2, ["--fp8-format hybrid is not supported yet"], []),
    (
        "ckpt_format",
        ["--ckpt-format", "torch_dcp"],
        2,
        ["--ckpt-format torch_dcp is not supported yet"],
        ["--ckpt-format", "torch"],
    ),
    (
        "block_causal",
        ["--attention-mask-type", "block_causal"],
        2,
        ["--attention-mask-type block_causal"],
        ["--attention-mask-type", "causal_bottom_right"],
    ),
    (
        "heads",
        ["--num-attention-heads", "5"],
        2,
        ["--hidden-size 32 is not divisible by --num-attention-heads 5"],
        ["--num-attention-heads", "8"],
    ),
    (
        "gqa",
        ["--group-query-attention", "--num-query-groups", "3"],
        2,
        ["--num-attention-heads 4 must be a multiple of --num-query-groups 3"],
        ["--group-query-attention", "--num-query-groups", "2"],
    ),
    (
        "seq_vs_pos",
        ["--max-position-embeddings", "8"],
        2,
        ["--seq-length 16 exceeds --max-position-embeddings 8"],
        ["--max-position-embeddings", "16"],
    ),
    ("min_lr", ["--min-lr", "1e-2"], 2, ["--min-lr 0.01 exceeds --lr 0.001"], ["--min-lr", "1e-4"]),
    (
        "wsd_iters",
        ["--lr-decay-style", "WSD"],
        2,
        ["--lr-decay-style WSD needs --lr-wsd-decay-iters"],
        ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3"],
    ),
    (
        "warmup",
        ["--lr-warmup-iters", "10"],
        2,
        ["--lr-warmup-iters 10 must be smaller than --lr-decay-iters 10"],
        ["--lr-warmup-iters", "2"],
    ),
    ("two_sources", ["--data-path", "/x"], 2, ["use one data source"], []),
    (
        "hf_tokenizer",
        ["--tokenizer-type", "HuggingFaceTokenizer"],
        2,
        ["needs --tokenizer-model PATH"],
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/t.json"],
    ),
    (
        "save_interval",
        ["--save", "/ckpt"],
        2,
        ["--save needs --save-interval N"],
        ["--save", "/ckpt", "--save-interval", "5"],
    ),
    ("finetune", ["--finetune"], 2, ["--finetune needs --load DIR"], ["--finetune", "--load", "/ckpt"]),
    (
        "mask_eps",
        ["--difflm-mask-eps", "1.0"],
        2,
        ["--difflm-mask-eps must be in [0, 1)"],
        ["--difflm-mask-eps", "0"],
    ),
    (
        "nan_limit",
        ["--nan-skip-limit", "-1"],
        2,
        ["--nan-skip-limit must be >= 0"],
        ["--nan-skip-limit", "0"],
    ),
    (
        "eval_k",
        ["--difflm-eval-mc-samples", "0"],
        2,
        ["--difflm-eval-mc-samples must be >= 1"],
        ["--difflm-eval-mc-samples", "1"],
    ),
]


@pytest.mark.parametrize("name,bad,world,needles,good", RULES, ids=[r[0] for r in RULES])
def test_rule_rejects_case_and_accepts_neighbour(name, bad, world, needles, good):
    with pytest.raises(ValueError) as exc:
        parse_args(BASE + bad, world_size=world)
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    if name == "global_batch_3ranks":  # the neighbour of a batch rule keeps the world size
        parse_args(BASE + good, world_size=world)
    elif name == "world_not_divisible":  # divisible: pp 2 x dp 2 is a valid layout
        assert parse_config(BASE + bad, world_size=4).parallel.data_parallel_size == 2
    elif name == "two_sources":
        parse_args([a for a in BASE if a != "--mock-data"] + bad, world_size=world)
    else:
        parse_args(BASE + good, world_size=world)


def test_gradient_accumulation_fusion_flags():
    """On by default under DDP (Megatron); off with a note under FSDP2, where passing it
    explicitly is the error naming both flags."""
    assert parse_config(BASE, world_size=2).parallel.gradient_accumulation_fusion
    assert not parse_config(
        BASE + ["--no-gradient-accumulation-fusion"], world_size=2
    ).parallel.gradient_accumulation_fusion
    cfg = parse_config(BASE + FSDP, world_size=2)
    assert not cfg.parallel.gradient_accumulation_fusion
    assert any("gradient accumulation fusion is off under --use-torch-fsdp2" in n for n in cfg.logging.notes)
    with pytest.raises(ValueError, match="add --no-gradient-accumulation-fusion"):
        parse_config(BASE + FSDP + ["--gradient-accumulation-fusion"], world_size=2)


def test_sequence_parallel_needs_tp_and_divisible_seq_length():
    cfg = parse_config(BASE + ["--sequence-parallel"], world_size=2)
    assert not cfg.parallel.sequence_parallel
    assert any("--sequence-parallel: off with --tensor-model-parallel-size 1" in n for n in cfg.logging.notes)
    seq = BASE[BASE.index("--seq-length") + 1]
    tp = 3 if int(seq) % 3 else 5
    with pytest.raises(
        ValueError, match=f"--seq-length {seq} is not divisible by --tensor-model-parallel-size {tp}"
    ):
        parse_config(
            BASE
            + [
                "--tensor-model-parallel-size",
                str(tp),
                "--sequence-parallel",
                "--num-attention-heads",
                str(tp),
                "--hidden-size",
                str(16 * tp),
            ],
            world_size=tp,
        )


def test_missing_required_flags_are_all_listed():
    with pytest.raises(ValueError) as exc:
        parse_args(["--mock-data"], world_size=1)
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--seq-length",
        "--micro-batch-size",
        "--train-iters",
        "--lr",
    ):
        assert f"{flag} is required" in str(exc.value)


def test_unknown_and_bad_choice_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--no-such-flag"], world_size=2)
    assert "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--tokenizer-type", "GPT2BPETokenizer"], world_size=2)
    assert "--tokenizer-type" in capsys.readouterr().err


def test_derived_values_follow_megatron():
    a = parse_config(BASE, world_size=2)
    assert (a.parallel.data_parallel_size, a.training.num_micro_batches, a.model.max_position_embeddings) == (
        2,
        2,
        16,
    )
    m = a.model
    assert (m.ffn_hidden_size, m.num_query_groups, m.kv_channels, a.schedule.lr_decay_iters) == (
        128,
        4,
        8,
        10,
    )
    assert m.attention == "bidirectional" and a.parallel.distributed_backend in ("gloo", "nccl")
    a = parse_config(
        BASE
        + [
            "--swiglu",
            "--hidden-size",
            "96",
            "--model-running-mode",
            "vanilla",
            "--lr-warmup-fraction",
            "0.2",
        ],
        world_size=1,
    )
    assert a.model.ffn_hidden_size == int(4 * 96 * 2 / 3 / 64) * 64 == 256  # Megatron's swiglu rule
    assert (
        a.model.attention == "causal"
        and a.schedule.lr_warmup_iters == 2
        and a.training.global_batch_size == 8
    )
    a = parse_config(BASE + ["--attention-mask-type", "causal_bottom_right"], world_size=2)
    assert a.model.attention == "causal"
    b = [x for x in BASE if x not in ("--global-batch-size", "8")]
    assert parse_config(b, world_size=3).training.global_batch_size == 6  # micro x dp


def test_every_flag_has_help():
    text = build_parser().format_help()  # argparse would raise on a stray '%' in a help string
    assert "--use-torch-fsdp2" in text and "--difflm-eval-mc-samples" in text
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and action.help.strip(), action.option_strings


def test_configs_from_args():
    a = parse_config(
        BASE
        + [
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "1000",
            "--bf16",
            "--clip-grad",
            "0.5",
            "--adam-beta2",
            "0.95",
            "--optimizer",
            "sgd",
        ],
        world_size=2,
    )
    ddp = a.ddp
    assert isinstance(ddp, DistributedDataParallelConfig)
    assert (
        ddp.use_distributed_optimizer,
        ddp.overlap_grad_reduce,
        ddp.overlap_param_gather,
        ddp.bucket_size,
        ddp.grad_reduce_in_fp32,
        ddp.comm_backend,
    ) == (True, True, True, 1000, True, "torch")
    opt = a.optimizer
    assert isinstance(opt, OptimizerConfig)
    assert (
        opt.lr,
        opt.clip_grad,
        opt.adam_beta2,
        opt.bf16,
        opt.optimizer,
        opt.use_distributed_optimizer,
    ) == (1e-3, 0.5, 0.95, True, "sgd", True)
    policy = fsdp_mixed_precision(a)
    import torch

    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert fsdp_mixed_precision(parse_config(BASE, world_size=2)) is None
    # the trainer normalises by the global loss-token count: the wrappers reduce in sum mode
    assert ddp.calculate_per_token_loss


def test_library_errors_name_fields_and_the_cli_names_flags():
    """One rule, one place: the dataclass words it with its field, the CLI with the flag."""
    from megadlms.models import TransformerConfig

    with pytest.raises(ValueError, match="attention_dropout must be in"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=4, seq_length=4,
                          attention_dropout=1.0)  # fmt: skip
    with pytest.raises(ValueError) as exc:
        parse_args(BASE + ["--attention-dropout", "1.0", "--hidden-dropout", "2"], world_size=2)
    msg = str(exc.value)
    assert "--attention-dropout must be in [0, 1)" in msg and "--hidden-dropout must be in [0, 1)" in msg
    assert "2 problems" in msg


def test_flag_message_rewords_fields_once():
    from megadlms.config import flag_message

    once = flag_message("use_torch_fsdp2 is incompatible with fp16: use bf16 (lr_decay_iters, split)")
    assert once == "--use-torch-fsdp2 is incompatible with --fp16: use --bf16 (--lr-decay-iters, --split)"
    assert flag_message(once) == once  # the CLI rewords the whole error again: no "----fp16"
