"""The "training / optimisation" group: batch sizes and run length, the learning-rate schedule
and optimizer hyper-parameters (optimizer.py), and NaN/Inf handling."""

from __future__ import annotations

from ._flag import add_flag
from .optimizer import lr_flags, optimizer_flags


def training_args(p):
    """Batch, schedule, optimizer and NaN handling."""
    g = p.add_argument_group("training / optimisation")
    for add in (_batch_flags, lr_flags, optimizer_flags, _robustness_flags):
        add(g)


def _batch_flags(g):
    """Batch sizes and the length of the run."""
    add_flag(
        g, "--micro-batch-size", type=int, default=None, help="Sequences per rank per micro-step (required)."
    )
    add_flag(
        g,
        "--global-batch-size",
        type=int,
        default=None,
        help="Sequences per optimizer step; a multiple of micro-batch x dp. Default micro-batch x dp.",
    )
    add_flag(
        g, "--rampup-batch-size", nargs="*", default=None, help="Batch-size ramp-up (not supported yet)."
    )
    add_flag(g, "--train-iters", type=int, default=None, help="Optimizer steps to train (required).")
    add_flag(
        g,
        "--train-samples",
        type=int,
        default=None,
        help="Sample-based training (not supported yet; use --train-iters).",
    )


def _robustness_flags(g):
    """NaN/Inf handling."""
    add_flag(
        g,
        "--nan-skip-limit",
        type=int,
        default=10,
        help="Steps with a NaN/Inf loss are skipped on every rank; after this many the run stops "
        "(0: stop at the first).",
    )
    add_flag(
        g,
        # Megatron names only the opt-out; the check is on by default.
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Do not check loss and reduced grads for NaN/Inf.",
    )
    add_flag(
        g,
        "--check-for-nan-in-loss-and-grad",
        action="store_true",
        dest="check_for_nan_in_loss_and_grad",
        default=True,
        help="The default: check loss and reduced grads for NaN/Inf (with --rerun-mode "
        "validate_results a NaN/Inf loss is re-run to diagnose it instead of skipped).",
    )
