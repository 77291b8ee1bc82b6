"""Megatron's profiling flags as one typed config; the trainer's ``training/profiling.py``
acts on it (docs/profiling.md). Everything is off by default: no number of a run changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megadlms.common.errors import Problems

DEFAULT_SNAPSHOT = "snapshot.pickle"  # Megatron's --memory-snapshot-path default


@dataclass(kw_only=True)
class ProfilingConfig:
    """Which steps and ranks to profile, with which tool, and the CUDA memory history."""

    profile: bool = False
    """Profile the steps ``profile_step_start .. profile_step_end - 1`` (the progress line's
    iteration numbers) on ``profile_ranks``."""
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: Tuple[int, ...] = (0,)
    """Global ranks that profile; the others run unchanged."""
    use_pytorch_profiler: bool = False
    """torch.profiler with a TensorBoard trace per rank in ``trace_dir`` (else: an nsys capture
    range, CUDA only)."""
    trace_dir: Optional[str] = None
    """Where the torch profiler traces go: the run's --tensorboard-dir (as Megatron)."""
    record_memory_history: bool = False
    """Record the CUDA allocator's history; the last rank dumps a snapshot every log interval."""
    memory_snapshot_path: Optional[str] = None
    """The snapshot's path (None: ``snapshot.pickle``)."""

    def __post_init__(self) -> None:
        self.profile_ranks = tuple(self.profile_ranks)
        bad = Problems("ProfilingConfig")
        if self.profile:
            bad.check(
                self.profile_step_start >= 0,
                f"profile_step_start must be >= 0, got {self.profile_step_start}",
            )
            bad.check(
                self.profile_step_end > self.profile_step_start,
                f"profile_step_end must be > profile_step_start {self.profile_step_start}, "
                f"got {self.profile_step_end}: the window profile_step_start .. profile_step_end - 1 "
                "would be empty",
            )
            bad.check(len(self.profile_ranks) > 0, "profile_ranks needs at least one rank")
        bad.check(
            not self.use_pytorch_profiler or self.profile,
            "use_pytorch_profiler needs profile (it picks the tool --profile runs): add --profile",
        )
        bad.check(
            not (self.profile and self.use_pytorch_profiler) or bool(self.trace_dir),
            "use_pytorch_profiler writes its traces into tensorboard_dir (as Megatron): add "
            "--tensorboard-dir DIR",
        )
        bad.check(
            self.memory_snapshot_path is None or self.record_memory_history,
            f"memory_snapshot_path {self.memory_snapshot_path} needs record_memory_history (nothing "
            "writes the snapshot without it): add --record-memory-history or drop --memory-snapshot-path",
        )
        bad.raise_if_any()

    @property
    def snapshot_path(self) -> str:
        """Where the last rank writes the memory snapshot."""
        return self.memory_snapshot_path or DEFAULT_SNAPSHOT

    def profiles(self, rank: int) -> bool:
        """Whether global ``rank`` profiles."""
        return self.profile and rank in self.profile_ranks
