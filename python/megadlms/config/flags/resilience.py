"""Result validation and straggler flags (Megatron's "rerun engine" and "straggler" groups),
typed as ``config.resilience_config.ResilienceConfig``."""

from __future__ import annotations

from ..resilience_config import INJECTION_TYPES, RERUN_MODES
from ._flag import add_flag


def resilience_args(p):
    """--rerun-mode and its checks, fault injection, --log-straggler."""
    g = p.add_argument_group("result validation / stragglers")
    add_flag(
        g,
        "--rerun-mode",
        default="disabled",
        choices=list(RERUN_MODES),
        help="validate_results: re-run a step whose loss is NaN/Inf, spiky or whose gradients are "
        "unexpectedly large, on the same data and RNG, and tell a transient fault (exit 17) from a "
        "reproducible result (checkpoint, exit 16); report_stats: re-run every step and report the "
        "largest difference; disabled (default here; Megatron's is validate_results): NaN/Inf steps "
        "are skipped up to --nan-skip-limit.",
    )
    add_flag(
        g,
        "--check-for-spiky-loss",
        action="store_true",
        help="Validate each rank's per-token loss against --spiky-loss-factor x its largest early value.",
    )
    add_flag(
        g,
        "--spiky-loss-factor",
        type=float,
        default=10.0,
        help="(megadlms) A loss this many times the largest of the first 100 is spiky (Megatron: 10).",
    )
    add_flag(
        g,
        "--check-for-large-grads",
        action="store_true",
        help="Validate each rank's gradient norm against 10 x its largest early value.",
    )
    add_flag(
        g,
        "--error-injection-rate",
        type=int,
        default=0,
        help="Inject a rejected result once every N validations (testing; 0: never).",
    )
    add_flag(
        g,
        "--error-injection-type",
        default="transient_error",
        choices=list(INJECTION_TYPES),
        help="What an injected fault behaves as when the step is re-run.",
    )
    add_flag(
        g,
        "--result-rejected-tracker-filename",
        default=None,
        help="Append one line per rejected-result event to this file.",
    )
    add_flag(
        g,
        "--log-straggler",
        action="store_true",
        help="Every --log-interval steps, gather every rank's step and forward/backward times and "
        "name the slowest and fastest ranks.",
    )
    add_flag(
        g,
        "--straggler-minmax-count",
        type=int,
        default=1,
        help="How many slowest and fastest ranks the straggler report names.",
    )
