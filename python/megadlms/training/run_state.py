"""The loop's state as data: its counters (:class:`TrainerCounters`), the throughput window
of the progress line (:class:`ThroughputWindow`), what a run reports (:class:`RunResult`) and
how it notices SIGTERM (:class:`SignalFlag`)."""

from __future__ import annotations

import dataclasses
import signal
from typing import Dict, List, Optional


@dataclasses.dataclass
class TrainerCounters:
    """The loop's counters: the trainer advances them, a checkpoint saves them, the reporter
    reads them."""

    iteration: int = 0
    """Optimizer steps done, skipped ones included."""
    consumed: int = 0
    """Samples read (a skipped step's too: a resume must not read them again)."""
    nan_total: int = 0
    """Steps skipped on every rank for a NaN/Inf loss."""
    skipped_total: int = 0
    """Steps the optimizer skipped (fp16 overflow)."""


@dataclasses.dataclass
class ThroughputWindow:
    """Sums over the steps since the last progress line, whose means and rates it reports."""

    time: float = 0.0
    """Seconds of the steps (data, step, accounting)."""
    iters: int = 0
    loss: float = 0.0
    """Sum of the finite steps' losses (a NaN step would poison the mean)."""
    n_loss: int = 0
    tokens: int = 0
    flops: float = 0.0

    def add(self, seconds: float, tokens: int, flops: float, loss: Optional[float]) -> None:
        """One step; ``loss`` None for a step whose loss was NaN/Inf."""
        self.time += seconds
        self.iters += 1
        self.tokens += tokens
        self.flops += flops
        if loss is not None:
            self.loss += loss
            self.n_loss += 1

    def reset(self) -> None:
        """Start the next window (the progress line reported this one)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)


@dataclasses.dataclass
class RunResult:
    """What a run did (returned by :func:`pretrain`; tests and scripts read it)."""

    iteration: int
    consumed_samples: int
    wrapper: str
    losses: Dict[int, float]
    """Iteration (1-based) -> global per-token loss of that step (nan when skipped for NaN)."""
    grad_norms: Dict[int, float]
    lrs: Dict[int, float]
    nan_iterations: List[int]
    skipped_iterations: int
    evals: Dict[int, float]
    """Iteration -> validation NELBO."""
    exit_reason: str
    """'done', 'exit_interval', 'exit_duration', 'signal' or 'result_validation'."""
    last_checkpoint: Optional[str]
    final_evals: Dict[str, float] = dataclasses.field(default_factory=dict)
    """'validation' / 'test' -> NELBO of the evaluation after the last step (Megatron's)."""
    save_stalls: List[float] = dataclasses.field(default_factory=list)
    """Seconds the loop spent inside each save call (with --async-save: staging only)."""
    exit_code: int = 0
    """The process exit status the run asks for: Megatron's 16 / 17 after result validation."""

    @classmethod
    def starting_at(cls, counters: TrainerCounters, wrapper: str) -> RunResult:
        """The empty record of a run that starts from ``counters`` (0, or a restored step)."""
        return cls(
            iteration=counters.iteration, consumed_samples=counters.consumed, wrapper=wrapper, losses={},
            grad_norms={}, lrs={}, nan_iterations=[], skipped_iterations=counters.skipped_total, evals={},
            exit_reason="done", last_checkpoint=None,
        )  # fmt: skip


class SignalFlag:
    """Records SIGTERM (--exit-signal-handler); the loop agrees across ranks and saves."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        self._previous = None
        if enabled:
            # Keep the previous handler so restore() gives a caller's own handler (or the default) back.
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        # Only a flag: the loop acts at the step boundary, where the all-reduce makes every rank agree.
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
