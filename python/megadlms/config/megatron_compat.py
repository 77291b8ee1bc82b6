"""Megatron flags we accept but do not act on: the tables behind ``validate_args``'s
"not supported yet" errors and the trainer's one-time "no effect" notice.

Kept apart from the parser so the list of deviations from Megatron is one short file
to read and to review.
"""

from typing import Tuple

# (dest, flag, value that means "off") -> rejected with "not supported yet" when changed.
# Refused rather than ignored: a run relying on one would train otherwise than it asked for.
UNSUPPORTED = (
    ("fp8", "--fp8-format", None),
    ("train_samples", "--train-samples", None),
    ("rampup_batch_size", "--rampup-batch-size", None),
    ("rotary_percent", "--rotary-percent", 1.0),
)

# (dest, flag, value with no effect anyway, why it has none here)
WITHOUT_EFFECT: Tuple[Tuple[str, str, object, str], ...] = (
    (
        "attention_backend",
        "--attention-backend",
        "auto",
        "attention runs through torch SDPA, which picks its kernel",
    ),
    (
        "attention_softmax_in_fp32",
        "--attention-softmax-in-fp32",
        False,
        "SDPA accumulates the softmax in fp32",
    ),
    ("bias_gelu_fusion", "--no-bias-gelu-fusion", True, "no fused bias-GeLU kernel (speed only)"),
    ("bias_dropout_fusion", "--no-bias-dropout-fusion", True, "no fused bias-dropout kernel (speed only)"),
    ("ckpt_fully_parallel_load", "--ckpt-fully-parallel-load", False, "torch_dist loads are always parallel"),
    (
        "auto_detect_ckpt_format",
        "--auto-detect-ckpt-format",
        False,
        "the format is always read from the checkpoint",
    ),
    (
        "tp_comm_overlap",
        "--tp-comm-overlap",
        False,
        "no Transformer Engine userbuffers: the sequence-parallel all-gathers / reduce-scatters run "
        "as separate collectives, not overlapped with the GEMMs (speed only)",
    ),
    ("moe_grouped_gemm", "--moe-grouped-gemm", False, "the experts always run as one grouped GEMM"),
    (
        "variable_seq_lengths",
        "--variable-seq-lengths",
        False,
        "every pipeline stage computes each micro-batch's activation shape from its crop: lengths vary "
        "per micro-batch without a shape exchange (the same numbers either way)",
    ),
    (
        "cp_comm_type",
        "--cp-comm-type",
        ["allgather"],
        "context parallelism always all-gathers K/V (the same numbers; speed and memory differ)",
    ),
)
MEGADLMS_WITHOUT_EFFECT = (
    ("debug", "--debug", False, "no MegaDLMs debug mode"),
    ("turn_on_debugpy", "--turn-on-debugpy", False, "no debugpy hook; attach a debugger yourself"),
    ("use_on_the_fly_eval", "--use-on-the-fly-eval", False, "no on-the-fly downstream eval"),
    (
        "gpt_block_return_loss_and_logits",
        "--gpt-block-return-loss-and-logits",
        False,
        "a MegaDLMs model-API switch; the loss is the same",
    ),
    (
        "non_special_vocab_size",
        "--non-special-vocab-size",
        None,
        "used only by MegaDLMs' uniform-noise modes, not by difflm-noshift",
    ),
)
WITHOUT_EFFECT = WITHOUT_EFFECT + MEGADLMS_WITHOUT_EFFECT
# The --wandb-* flags after --wandb-project: given without it, W&B stays off (as in Megatron).
WANDB_DESTS = (
    "wandb_exp_name",
    "wandb_run_id",
    "wandb_save_dir",
    "wandb_mode",
    "wandb_tags",
    "wandb_notes",
    "wandb_resume",
    "wandb_group",
    "wandb_resume_from",
)
