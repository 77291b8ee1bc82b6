"""Activation recomputation flags (Megatron-LM's names and defaults; TransformerConfig's
``recompute_*`` and ``distribute_saved_activations`` fields, models/recompute.py)."""

from __future__ import annotations

from ._flag import add_flag


def recompute_args(p):
    """--recompute-granularity / --recompute-method / --recompute-num-layers /
    --recompute-activations / --distribute-saved-activations."""
    g = p.add_argument_group("activation recomputation")
    add_flag(
        g,
        "--recompute-granularity",
        default=None,
        choices=["full", "selective"],
        help="Recompute activations in the backward: 'full' whole layers (with --recompute-method "
        "and --recompute-num-layers), 'selective' core attention only. Default: keep them.",
    )
    add_flag(
        g,
        "--recompute-method",
        default=None,
        choices=["uniform", "block"],
        help="With full granularity: 'uniform' recomputes spans of --recompute-num-layers layers, "
        "'block' the first --recompute-num-layers layers of each pipeline stage (or virtual chunk).",
    )
    add_flag(
        g,
        "--recompute-num-layers",
        type=int,
        default=None,
        help="Layers per recomputed span (uniform) or recomputed layers per stage (block).",
    )
    add_flag(
        g,
        "--recompute-activations",
        action="store_true",
        help="Megatron's alias of --recompute-granularity selective.",
    )
    add_flag(
        g,
        "--distribute-saved-activations",
        action="store_true",
        help="Full recompute with TP (no sequence parallelism): each TP rank saves 1/tp of a "
        "recomputed span's input and all-gathers it in the backward.",
    )
