"""Logging flags: the progress line, evaluation and metrics files, then Megatron's logging flags
(TensorBoard, Weights & Biases, progress.txt, timers) and the tensor-parallel overlap switch,
with Megatron's names, defaults and meanings, and the parse-time rules about them
(:func:`logging_flag_problems`, worded with the flags: there is no lower layer that owns them).
"""

from __future__ import annotations

import importlib.util
from typing import List

from ._flag import add_flag


def logging_args(p):
    g = p.add_argument_group("logging / evaluation")
    add_flag(g, "--log-interval", type=int, default=100, help="Print a progress line every N steps.")
    add_flag(g, "--eval-interval", type=int, default=1000, help="Validation NELBO every N steps.")
    add_flag(g, "--eval-iters", type=int, default=100, help="Validation batches per evaluation (0 disables).")
    add_flag(
        g,
        "--tensorboard-dir",
        default=None,
        help="Write TensorBoard scalars here, with Megatron's tag names (needs tensorboard).",
    )
    add_flag(
        g, "--log-params-norm", action="store_true", help="Log the global parameter L2 norm (params norm)."
    )
    add_flag(
        g,
        "--metrics-jsonl",
        default=None,
        help="Append one JSON object per logged step (iteration, consumed_samples, lm_loss, lr, grad_norm, "
        "loss_scale, skipped, tokens_per_sec, event='train'; at eval a separate event='eval' "
        "record with valid_nelbo and valid_ppl_bound; the end-of-training evaluations as "
        "event='final_validation' / 'final_test').",
    )


# Megatron's --wandb-* flags (megatron/training/arguments.py, _add_logging_args) after --wandb-project.
# Default None where Megatron's is '' or a fixed string: "not given" stays visible to the rules and
# to wandb itself (--wandb-mode not given: wandb reads $WANDB_MODE, default online).
WANDB_FLAGS = (
    ("--wandb-exp-name", "The W&B run name (required with --wandb-project)."),
    ("--wandb-run-id", "The W&B run id (resume a run by its id)."),
    ("--wandb-save-dir", "Where W&B writes its files (default: <--save>/wandb)."),
    ("--wandb-mode", "online, offline or disabled (default: $WANDB_MODE, else online)."),
    ("--wandb-tags", "Comma-separated W&B tags."),
    ("--wandb-group", "The W&B group of the run."),
    ("--wandb-notes", "Notes of the W&B run."),
    ("--wandb-resume", "W&B resume policy: allow, must, never or auto (Megatron's default: auto)."),
    ("--wandb-resume-from", "Resume from a specific W&B run ({run_id}?_step={step})."),
)


def megatron_logging_args(p) -> None:
    """The logging group's Megatron switches, the W&B flags and --tp-comm-overlap."""
    g = p.add_argument_group("logging (Megatron)")
    for flag, why in (
        ("--log-num-zeros-in-grad", "Log the number of zero gradient elements (num zeros / num-zeros)."),
        ("--log-throughput", "Add Megatron's throughput per GPU (TFLOP/s/GPU) to the progress line."),
        (
            "--log-progress",
            "Append Megatron's progress.txt lines (job start, throughput and tokens at each "
            "checkpoint) to <--save>/progress.txt.",
        ),
        (
            "--log-timers-to-tensorboard",
            "Write iteration-time (and throughput, and with --timing-log-level 1 the "
            "forward-backward / optimizer phase times) to TensorBoard / W&B.",
        ),
        (
            "--log-validation-ppl-to-tensorboard",
            "Also write the validation perplexity (lm loss validation ppl).",
        ),
        ("--log-memory-to-tensorboard", "Write the memory counters (mem-*) to TensorBoard / W&B."),
        ("--log-world-size-to-tensorboard", "Write world-size to TensorBoard / W&B."),
    ):
        add_flag(g, flag, action="store_true", help=why)
    add_flag(
        g,
        "--no-log-loss-scale-to-tensorboard",
        action="store_false",
        dest="log_loss_scale_to_tensorboard",
        help="Do not write loss-scale to TensorBoard / W&B.",
    )
    add_flag(
        g, "--tensorboard-log-interval", type=int, default=1, help="Write TensorBoard scalars every N steps."
    )
    add_flag(
        g,
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="Pending TensorBoard events before a flush.",
    )
    add_flag(
        g,
        "--timing-log-level",
        type=int,
        default=0,
        choices=range(0, 3),
        help="0: iteration time only; 1 or 2: also the forward-backward and optimizer phase times.",
    )
    add_flag(g, "--wandb-project", default="", help="Log to this Weights & Biases project (needs wandb).")
    for flag, why in WANDB_FLAGS:
        add_flag(g, flag, default=None, help=why)
    add_flag(
        g,
        "--tp-comm-overlap",
        action="store_true",
        help="Accepted for Megatron scripts: TP communication is not overlapped with the GEMMs here "
        "(a note says so).",
    )


def logging_flag_problems(args) -> List[str]:
    """The W&B and --tp-comm-overlap rules, one line each (checked on every rank at parse time,
    before anything is built)."""
    out = []
    project = getattr(args, "wandb_project", "")
    if project:
        if importlib.util.find_spec("wandb") is None:
            out.append(
                f"--wandb-project {project} needs the wandb package: pip install 'megadlms[wandb]' "
                "(or drop --wandb-project)"
            )
        if not args.wandb_exp_name:  # Megatron: "Please specify the wandb experiment name!"
            out.append(f"--wandb-project {project} needs --wandb-exp-name NAME (the W&B run name)")
        if not args.wandb_save_dir and not args.save:
            out.append(
                f"--wandb-project {project} needs --wandb-save-dir DIR (or --save DIR: W&B then writes "
                "to DIR/wandb)"
            )
    if getattr(args, "tp_comm_overlap", False):
        # Megatron's rule (arguments.py): sequence parallelism is switched off at tp 1 before it.
        if args.tensor_model_parallel_size == 1 or not args.sequence_parallel:
            out.append(
                "--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1 "
                "(as Megatron): add them or drop --tp-comm-overlap"
            )
    return out
