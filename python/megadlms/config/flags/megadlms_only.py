"""The MegaDLMs group: MegaDLMs-only flags (custom_args/difflm.py) beyond the objective's."""

from __future__ import annotations

from ._flag import add_flag


def megadlms_args(p):
    """MegaDLMs-only flags (custom_args/difflm.py) beyond the objective's."""
    g = p.add_argument_group("MegaDLMs")
    for flag, why in (
        ("--debug", "MegaDLMs debug mode (no effect)"),
        ("--turn-on-debugpy", "attach debugpy (no effect)"),
        ("--use-on-the-fly-eval", "MegaDLMs' on-the-fly downstream eval (not available; no effect)"),
        ("--gpt-block-return-loss-and-logits", "MegaDLMs model API detail (no effect on training)"),
    ):
        add_flag(g, flag, action="store_true", help=f"Accepted for MegaDLMs scripts: {why}.")
    add_flag(
        g,
        "--detect-anomaly",
        action="store_true",
        help="Run forward/backward under torch.autograd.detect_anomaly (slow; names the op making a NaN).",
    )
    add_flag(
        g,
        "--use-torch-compile",
        action="store_true",
        help="torch.compile each transformer layer (regional compilation, as torchtitan does: "
        "every block, not the whole model); composes with DDP, FSDP2, TP, recompute and the "
        "objective. Compile time is logged apart from the step time. Megatron-LM has no such flag.",
    )
    add_flag(
        g,
        "--non-special-vocab-size",
        type=int,
        default=None,
        help="MegaDLMs' size of the non-special vocabulary, used by its uniform-noise modes only "
        "(accepted; no effect in difflm-noshift).",
    )
    add_flag(
        g,
        "--cut-off-varlen-to-seqlen",
        action="store_true",
        help="Document packing: also cut documents at every --seq-length boundary (packing here never "
        "crosses samples, so this is always the behaviour; MegaDLMs requires the flag).",
    )
    add_flag(
        g,
        "--checkpoint-steps",
        default=None,
        help="Also save at these iterations, comma-separated (e.g. '100,2000').",
    )
