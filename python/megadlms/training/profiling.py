"""The trainer's profiling hook (Megatron's --profile / --use-pytorch-profiler /
--record-memory-history, docs/profiling.md): one object the loop calls around each step.

    hook = StepProfiler(config.profiling, rank=..., device=..., log_interval=...)
    hook.before_step(iteration)   # the iteration counter before the step
    hook.after_step(iteration)    # ... and after it
    hook.close()                  # in the loop's finally: a failed run still ends its trace

Profiled steps are those whose progress-line iteration is in ``profile_step_start ..
profile_step_end - 1`` (Megatron's torch-profiler window; the step before it warms the
profiler up). Each profiled step is a range named ``iteration N`` in the trace, around the
ranges of ``common/ranges.py`` (forward, backward, each bucket's collective, the optimizer,
the pipeline's sends/receives).
"""

from __future__ import annotations

import logging
import pickle
from typing import Optional

import torch
from torch.profiler import (
    ProfilerAction,
    ProfilerActivity,
    profile,
    record_function,
    tensorboard_trace_handler,
)

from megadlms.config import ProfilingConfig

_log = logging.getLogger("megadlms.training")

__all__ = ["StepProfiler"]


class StepProfiler:
    """Starts and stops the chosen profiler at the configured steps on this rank; writes the
    CUDA memory snapshot (last rank). Does nothing at all with the default config."""

    def __init__(
        self, config: ProfilingConfig, *, rank: int, world: int, device: torch.device, log_interval: int
    ) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.active = config.profiles(rank)
        self.snapshot = config.record_memory_history and rank == world - 1  # Megatron: the last rank
        self.log_interval = log_interval
        self._prof: Optional[profile] = None
        self._nvtx: Optional[torch.autograd.profiler.emit_nvtx] = None  # an nsys capture range is open
        self._range: Optional[record_function] = None
        self._first = 0  # the iteration the torch profiler's step 0 is
        cuda = device.type == "cuda"
        if config.record_memory_history:
            if cuda:  # Megatron's: the last 100,000 events, with stacks
                torch.cuda.memory._record_memory_history("all", max_entries=100000)
            else:
                _log.info(
                    "note: --record-memory-history records CUDA allocations; this run is on "
                    f"{device.type}: no memory snapshot is written"
                )
                self.snapshot = False
        if self.active and not config.use_pytorch_profiler and not cuda:
            # a warning: the profiled rank may not be rank 0, whose info lines alone are printed
            _log.warning(
                "note: --profile without --use-pytorch-profiler opens an nsys capture range "
                f"(cudaProfilerStart/Stop), which needs CUDA; this run is on {device.type}: nothing is "
                "profiled (add --use-pytorch-profiler --tensorboard-dir DIR for a torch profiler trace)"
            )
            self.active = False

    def _in_window(self, it: int) -> bool:
        return self.start <= it < self.end

    def _action(self, step: int) -> ProfilerAction:
        """torch.profiler's schedule, in progress-line iterations."""
        it = self._first + step
        if self._in_window(it):
            return ProfilerAction.RECORD_AND_SAVE if it == self.end - 1 else ProfilerAction.RECORD
        return ProfilerAction.WARMUP if it == self.start - 1 else ProfilerAction.NONE

    def _open(self, it: int) -> None:
        if self.config.use_pytorch_profiler:
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            )
            self._first = it
            # one file per rank: <dir>/rank<r>.<time>.pt.trace.json (what TensorBoard reads)
            assert self.config.trace_dir is not None  # ProfilingConfig's rule
            handler = tensorboard_trace_handler(self.config.trace_dir, worker_name=f"rank{self.rank}")
            self._prof = profile(
                activities=activities, schedule=self._action, record_shapes=True, with_stack=True,
                on_trace_ready=handler,
            )  # fmt: skip
            self._prof.start()
        elif self._in_window(it):  # nsys: Megatron's capture range with NVTX ranges
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def before_step(self, iteration: int) -> None:
        """Called with the iteration counter before the step (the step is ``iteration + 1``)."""
        if not self.active:
            return
        it = iteration + 1
        if self._prof is None and self._nvtx is None and self.start - 1 <= it < self.end:
            self._open(it)
        if self._in_window(it) and (self._prof is not None or self._nvtx is not None):
            self._range = record_function(f"iteration {it}")
            self._range.__enter__()

    def after_step(self, iteration: int) -> None:
        """Called with the iteration counter after the step (the step just done)."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            if iteration >= self.end - 1:
                self._stop()
            else:
                self._prof.step()
        elif self._nvtx is not None and iteration >= self.end - 1:
            self._stop()
        if self.snapshot and iteration % self.log_interval == 0:
            with open(self.config.snapshot_path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def _stop(self) -> None:
        if self._prof is not None:
            # a run that stopped in the warm-up step has recorded nothing: no trace is written
            recording = self._prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
            self._prof.stop()  # writes the trace (on_trace_ready) when recording
            self._prof = None
            if recording:
                _log.info(f"profiler trace of rank {self.rank} written to {self.config.trace_dir}")
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            self._nvtx = None
        self.active = False  # one window per run

    def close(self) -> None:
        """End an open range and profiler (the run stopped inside the window, or failed)."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._stop()
