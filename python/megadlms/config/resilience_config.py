"""Result validation and straggler reporting (Megatron's rerun state machine and straggler
detector flags) as one typed config; the trainer's ``training/rerun.py`` and
``training/straggler.py`` act on it (docs/reliability.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadlms.common.errors import Problems

RERUN_MODES = ("disabled", "validate_results", "report_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


@dataclass(kw_only=True)
class ResilienceConfig:
    """What the trainer checks about each step's results and timing (all off by default)."""

    rerun_mode: str = "disabled"
    """``validate_results``: re-run a step whose loss is NaN/Inf (fatal), spiky or whose
    gradients are unexpectedly large (not fatal) on the same micro-batches and RNG, to tell a
    transient fault from a reproducible result (Megatron's rerun state machine);
    ``report_stats``: re-run every step once and report the largest relative difference;
    ``disabled``: NaN/Inf steps are skipped (--nan-skip-limit)."""
    check_for_spiky_loss: bool = False
    """Validate each rank's per-token loss against ``spiky_loss_factor`` x the largest of its
    first 100 values."""
    spiky_loss_factor: float = 10.0
    """Megatron's SPIKY_LOSS_FACTOR (a constant there)."""
    check_for_large_grads: bool = False
    """Validate each rank's gradient norm (after reduction) against 10 x the largest of its
    first 100 values (Megatron's threshold)."""
    error_injection_rate: int = 0
    """Inject a rejected result once every N validations (0: never); for testing."""
    error_injection_type: str = "transient_error"
    """What the injected fault behaves as on the re-runs (Megatron's RerunDiagnostic)."""
    result_rejected_tracker_filename: Optional[str] = None
    """Append one line per rejected-result event to this file (every rank)."""
    log_straggler: bool = False
    """Gather every rank's step and forward/backward times every log interval and name the
    slowest and fastest ranks."""
    straggler_minmax_count: int = 1
    """How many slowest / fastest ranks the straggler report names."""

    def __post_init__(self) -> None:
        bad = Problems("ResilienceConfig")
        bad.check(
            self.rerun_mode in RERUN_MODES,
            f"rerun_mode must be one of {', '.join(RERUN_MODES)}, got {self.rerun_mode!r}",
        )
        bad.check(
            self.error_injection_type in INJECTION_TYPES,
            f"error_injection_type must be one of {', '.join(INJECTION_TYPES)}, "
            f"got {self.error_injection_type!r}",
        )
        bad.check(
            self.error_injection_rate >= 0,
            f"error_injection_rate must be >= 0, got {self.error_injection_rate}",
        )
        bad.check(self.spiky_loss_factor > 1, f"spiky_loss_factor must be > 1, got {self.spiky_loss_factor}")
        bad.check(
            self.straggler_minmax_count >= 1,
            f"straggler_minmax_count must be >= 1, got {self.straggler_minmax_count}",
        )
        bad.check(
            self.error_injection_rate == 0 or self.rerun_mode == "validate_results",
            "error_injection_rate needs rerun_mode validate_results (injected results are only "
            "validated there)",
        )
        bad.raise_if_any()

    @property
    def validating(self) -> bool:
        """Whether steps are validated (and possibly re-run) at all."""
        return self.rerun_mode != "disabled"
