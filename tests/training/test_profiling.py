"""Megatron's profiling flags on CPU: --profile --use-pytorch-profiler writes one torch profiler
trace per profiled rank (and none elsewhere), each a JSON that holds our named ranges (forward,
backward, each bucket's collective, the optimizer, the pipeline's sends/receives) for the
requested iterations only; --record-memory-history and nsys --profile leave a note on CPU;
invalid combinations are one-line errors naming the flag. One 4-rank world (pp 2 x dp 2, the
distributed optimizer) serves the run-level assertions."""

from __future__ import annotations

import functools
import glob
import json
import logging
import os

import pytest

from megadlms.config import parse_config
from tests.dist_utils import run_distributed

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--global-batch-size 4 --train-iters 4 --lr 1e-3 --seed 3 --mock-data --num-workers 0 "
    "--tokenizer-type ByteTokenizer --log-interval 1 --eval-interval 100 --eval-iters 0 "
    "--pipeline-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 4000"
).split()
PROFILE = "--profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4 --profile-ranks 0 3"
NOTES = "--profile --profile-ranks 1 --record-memory-history --memory-snapshot-path {tmp}/snap.pickle"


def _world(rank, world, tmp):
    from megadlms.training.logging_utils import setup_logging
    from megadlms.training.train import Trainer

    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    setup_logging(rank)
    logging.getLogger("megadlms").addHandler(handler)
    try:
        argv = TINY + PROFILE.split() + ["--tensorboard-dir", f"{tmp}/tb"]
        profiled = Trainer(parse_config(argv, world_size=world)).train()
        notes_from = len(lines)
        argv = TINY + ["--train-iters", "1"] + NOTES.format(tmp=tmp).split()
        Trainer(parse_config(argv, world_size=world)).train()
    finally:
        logging.getLogger("megadlms").removeHandler(handler)
    return profiled.losses, [x for x in lines[notes_from:] if x.startswith("note: --")]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("profiling"))
    return tmp, run_distributed(_world, 4, (tmp,), timeout=240)


@functools.cache  # ~5 MB each: parsed once
def _events(path):
    with open(path) as f:
        trace = json.load(f)  # the Chrome trace format TensorBoard's profiler plugin reads
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_one_trace_per_profiled_rank(profiled):
    tmp, _ = profiled
    files = sorted(os.path.basename(p) for p in glob.glob(f"{tmp}/tb/*.pt.trace.json"))
    assert [f.split(".")[0] for f in files] == ["rank0", "rank3"], files


def test_traces_hold_our_ranges_for_the_requested_steps_only(profiled):
    tmp, _ = profiled
    for rank in (0, 3):
        (path,) = glob.glob(f"{tmp}/tb/rank{rank}.*.pt.trace.json")
        events = _events(path)
        names = [e["name"] for e in events]
        assert sorted(n for n in set(names) if n.startswith("iteration ")) == ["iteration 2", "iteration 3"]
        for want in ("forward-compute", "backward-compute", "optimizer", "pipeline-send-recv"):
            assert want in names, (rank, want)
        # pp 2 x dp 2, 4 micro-batches per step: 2 per rank and step, in 2 steps
        assert names.count("forward-compute") == names.count("backward-compute") == 4, rank
        assert names.count("optimizer") == 2, rank
        # the distributed optimizer: each bucket's reduce-scatter and the parameter all-gather
        grad_sync = {n for n in names if n.startswith("grad-sync bucket ")}
        assert grad_sync and all(n.endswith(" reduce-scatter") for n in grad_sync), grad_sync
        assert any(n.startswith("param-gather bucket ") for n in names)
        # every named range of a step lies inside that step's "iteration N" range
        steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("iteration ")]
        for e in events:
            if e["name"] in ("forward-compute", "backward-compute", "optimizer"):
                assert any(a <= e["ts"] <= b for a, b in steps), (rank, e["name"], e["ts"])


def test_profiling_changes_no_number(profiled):
    _, per_rank = profiled
    last = per_rank[-1][0]  # the last stage holds the losses
    plain = run_distributed(_plain_losses, 4, (), timeout=240)[-1]
    assert last == plain


def _plain_losses(rank, world):
    from megadlms.training.train import Trainer

    return Trainer(parse_config(TINY, world_size=world)).train().losses


def test_cpu_notes_instead_of_crashes(profiled):
    tmp, per_rank = profiled
    assert not os.path.exists(f"{tmp}/snap.pickle")
    for rank, (_, notes) in enumerate(per_rank):
        history = [n for n in notes if n.startswith("note: --record-memory-history")]
        nsys = [n for n in notes if n.startswith("note: --profile without --use-pytorch-profiler")]
        # a note of rank 0 (the one that prints info lines)
        assert len(history) == (rank == 0) and all("cpu" in n for n in history), (rank, notes)
        assert len(nsys) == (rank == 1), (rank, notes)  # only the profiled rank says it


@pytest.mark.parametrize(
    "extra, flag",
    [
        (
            "--profile --profile-step-start 5 --profile-step-end 5",
            "--profile-step-end must be > --profile-step-start",
        ),
        ("--profile --profile-step-start -1", "--profile-step-start must be >= 0"),
        ("--profile --profile-ranks 0 4", "--profile-ranks 4 out of range for a world of 4"),
        ("--memory-snapshot-path s.pickle", "--memory-snapshot-path s.pickle needs --record-memory-history"),
        ("--use-pytorch-profiler", "--use-pytorch-profiler needs --profile"),
        (
            "--profile --use-pytorch-profiler",
            "--use-pytorch-profiler writes its traces into --tensorboard-dir",
        ),
    ],
)
def test_invalid_profiling_flags_are_one_line_errors(extra, flag):
    with pytest.raises(ValueError) as exc:
        parse_config(TINY + extra.split(), world_size=4)
    problems = str(exc.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].startswith(f"  - {flag}"), problems


def test_profiling_flags_default_off():
    config = parse_config(TINY, world_size=4)
    assert not config.profiling.profile and not config.profiling.record_memory_history
    assert "profiling" not in config.to_dict()  # checkpoints' run record unchanged


def test_a_run_that_stops_inside_the_window_still_writes_its_trace(tmp_path):
    import torch

    from megadlms.config import ProfilingConfig
    from megadlms.training.profiling import StepProfiler

    config = ProfilingConfig(
        profile=True,
        use_pytorch_profiler=True,
        trace_dir=str(tmp_path),
        profile_step_start=2,
        profile_step_end=6,
    )
    hook = StepProfiler(config, rank=0, world=1, device=torch.device("cpu"), log_interval=1)
    for it in range(3):  # iterations 1..3, then the run stops (an exit request, an error)
        hook.before_step(it)
        torch.ones(4).sum()
        hook.after_step(it + 1)
    hook.close()
    (path,) = glob.glob(f"{tmp_path}/rank0.*.pt.trace.json")
    steps = {e["name"] for e in _events(path) if e["name"].startswith("iteration ")}
    assert steps == {"iteration 2", "iteration 3"}
    # off by default: the same calls write nothing
    off = StepProfiler(ProfilingConfig(), rank=0, world=1, device=torch.device("cpu"), log_interval=1)
    off.before_step(0)
    off.after_step(1)
    off.close()
    assert len(glob.glob(f"{tmp_path}/*.json")) == 1
