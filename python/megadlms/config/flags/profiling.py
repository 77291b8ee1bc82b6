"""Profiling flags, with Megatron-LM's names and defaults (megatron/training/arguments.py):
an nsys capture range or a torch profiler trace over a window of steps on chosen ranks, and
CUDA memory history with a snapshot file. The typed config is ``ProfilingConfig``
(config/profiling_config.py); the trainer's hook is training/profiling.py (docs/profiling.md).
"""

from __future__ import annotations

from ._flag import add_flag


def profiling_args(p) -> None:
    """--profile / --profile-step-start / --profile-step-end / --profile-ranks /
    --use-pytorch-profiler / --record-memory-history / --memory-snapshot-path."""
    g = p.add_argument_group("profiling")
    add_flag(
        g,
        "--profile",
        action="store_true",
        help="Profile steps --profile-step-start..--profile-step-end - 1 on --profile-ranks: with "
        "--use-pytorch-profiler a torch profiler trace per rank in --tensorboard-dir, else an nsys "
        "capture range (cudaProfilerStart/Stop + NVTX ranges; run under `nsys profile "
        "--capture-range=cudaProfilerApi --capture-range-end=stop`; CUDA only).",
    )
    add_flag(g, "--profile-step-start", type=int, default=10, help="First profiled iteration.")
    add_flag(g, "--profile-step-end", type=int, default=12, help="Profiling stops before this iteration.")
    add_flag(
        g,
        "--profile-ranks",
        nargs="+",
        type=int,
        default=[0],
        help="Global ranks to profile (default: 0).",
    )
    add_flag(
        g,
        "--use-pytorch-profiler",
        action="store_true",
        help="With --profile: use torch.profiler and write a TensorBoard-readable trace per profiled "
        "rank into --tensorboard-dir (also a Chrome/Perfetto JSON trace).",
    )
    add_flag(
        g,
        "--record-memory-history",
        action="store_true",
        help="Record the CUDA caching allocator's history from the first step; the last rank writes a "
        "snapshot to --memory-snapshot-path every --log-interval steps (CUDA only; a note on CPU).",
    )
    add_flag(
        g,
        "--memory-snapshot-path",
        default=None,
        help="Where --record-memory-history writes its pickle (default: snapshot.pickle, Megatron's).",
    )
