"""Faults under the real launcher: ``torchrun`` (its default settings, ``--standalone``) on
2 CPU ranks, a tiny model, faults injected by ``fault_launcher.py``. Where an assertion is
about the trainer and not the launcher (the SIGTERM to one rank, the auto-resume), the run
uses 2 pooled ranks instead of a launch.

The reference of every interrupted run is an uninterrupted run of the same flags on 2 gloo
ranks: its metrics JSONL. The interrupted run's JSONL keeps appending across restarts; every
record, before and after the restart, must equal the reference's record of that iteration
bitwise (json round-trips floats exactly), and the restart must resume from the last
complete checkpoint (nothing before it is lost).

Megatron's default dropout (0.1) is on: the restarted run's dropout masks must come from
the restored RNG states for the curve to be bitwise equal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(ROOT, "tests", "training", "fault_launcher.py")
FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 12 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --seed 7 --mock-data "
    "--num-workers 0 --log-interval 1 --eval-interval 1000 --eval-iters 0 --save-interval 4"
).split()


def _env(tmp, fault=None, **extra):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT, os.environ.get("PYTHONPATH", "")]),
        MEGADLMS_TEST_PID_DIR=str(tmp),
    )
    env.pop("MEGADLMS_TEST_FAULT", None)
    if fault:
        env["MEGADLMS_TEST_FAULT"] = json.dumps(fault)
    env.update(extra)
    return env


def _cmd(argv, restarts=0):
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"--max-restarts={restarts}", LAUNCHER, *FLAGS, *argv,
    ]  # fmt: skip


def _torchrun(tmp, name, argv, fault=None, restarts=0, timeout=110, **env):
    log = tmp / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            _cmd(argv, restarts), env=_env(tmp, fault, **env), stdout=out, stderr=subprocess.STDOUT,
            timeout=timeout, cwd=str(tmp),
        )  # fmt: skip
    return proc.returncode, log.read_text()


def _curve(path):
    return [json.loads(x) for x in open(path).read().splitlines() if '"event": "train"' in x]


def _dir_args(tmp, name):
    return ["--save", str(tmp / name), "--metrics-jsonl", str(tmp / f"{name}.jsonl")]


def _reference_world(rank, world, argv):
    from megadlms.pretrain import main

    return main(FLAGS + argv)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of the same flags on 2 gloo ranks in the test's worker pool (the
    numbers do not depend on the launcher; a torchrun start would add a launch)."""
    tmp = tmp_path_factory.mktemp("reference")
    assert run_distributed(_reference_world, 2, (_dir_args(tmp, "ref"),), timeout=300) == [0, 0]
    curve = {r["iteration"]: r["lm_loss"] for r in _curve(tmp / "ref.jsonl")}
    assert sorted(curve) == list(range(1, 13))
    return curve


# One launch per run of flags; each fault hits its own restart attempt (fault_launcher.py).
SIGKILL_LAUNCHES = {
    "step_save": (
        [
            # attempt 0, rank 1 at the start of step 7: its peer is inside the step's first collective
            {"kind": "kill", "rank": 1, "iteration": 7, "attempt": 0},
            # attempt 1 (resumed from 4), rank 1 inside the save of iteration 8, after writing
            # its tensor files
            {"kind": "kill_in_save", "rank": 1, "iteration": 8, "attempt": 1},
        ],
        [],
    ),
    # --async-save: rank 0 while it finishes the background save of iteration 8 (common.json)
    "async": ([{"kind": "kill_in_save", "rank": 0, "iteration": 8, "attempt": 0}], ["--async-save"]),
}
# case: (launch, the attempt its fault kills, the last iteration logged before it; None: 8..12)
SIGKILLS = {"step": ("step_save", 0, 6), "save": ("step_save", 1, 8), "async": ("async", 0, None)}


@pytest.fixture(scope="module")
def sigkill_launch(tmp_path_factory):
    """launch name -> (tmp, return code, log) of its torchrun run, started once per module."""
    done = {}

    def launch(name):
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            faults, extra = SIGKILL_LAUNCHES[name]
            # bounded per attempt: each restart re-imports both ranks (slow on a loaded machine)
            argv, timeout = _dir_args(tmp, name) + extra, 110 + 100 * len(faults)
            done[name] = (tmp, *_torchrun(tmp, name, argv, faults, len(faults), timeout))
        return done[name]

    return launch


def _segments(records):
    """The JSONL's iterations split at each restart (where the iteration goes back)."""
    segs = [[]]
    for r in records:
        if segs[-1] and r["iteration"] <= segs[-1][-1]:
            segs.append([])
        segs[-1].append(r["iteration"])
    return segs


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", sorted(SIGKILLS))
def test_sigkill_restart_resumes_bitwise(reference, sigkill_launch, case):
    """torchrun --max-restarts restarts the group after a SIGKILL; it resumes from iteration
    4 (the last complete checkpoint: 8 never completed) and reproduces the reference bitwise.
    The step and save kills share one launch (--max-restarts 2, one kill per attempt)."""
    name, attempt, died_after = SIGKILLS[case]
    faults, _ = SIGKILL_LAUNCHES[name]
    tmp, rc, log = sigkill_launch(name)
    assert rc == 0, log[-4000:]
    assert f"local_rank: {faults[attempt]['rank']}" in log and "resuming from --save" in log
    records = _curve(tmp / f"{name}.jsonl")
    segs = _segments(records)
    assert len(segs) == len(faults) + 1, segs  # one restart per fault, then the run to the end
    got = segs[attempt][-1]
    if died_after is None:  # async: the kill lands while training continues past iteration 8
        assert 8 <= got <= 12, segs
    else:
        assert got == died_after, segs
    start = 1 if attempt == 0 else 5
    assert segs[attempt] == list(range(start, got + 1)), segs
    after = segs[attempt + 1]
    assert after == list(range(5, after[-1] + 1)), segs  # resumed from 4: nothing before it lost
    assert segs[-1][-1] == 12, segs
    for r in records:
        assert r["lm_loss"] == reference[r["iteration"]], r  # bitwise
    assert log.count(f"loaded {tmp / name}/iter_{4:07d}") >= len(faults), log[-4000:]  # every restart
    assert (tmp / name / "latest_checkpointed_iteration.txt").read_text() == "12"


def _wait_for(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _pids(tmp, attempt=0):
    return [int((tmp / f"rank_{r}.attempt_{attempt}.pid").read_text()) for r in range(2)]


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _sigterm_world(rank, world, argv):
    """The trainer with fault_launcher's SIGTERM to rank 1 at step 5 on a pooled rank; rank
    0's log. The fault's monkeypatches are undone after the job (the slot serves others)."""
    import contextlib
    import io

    from megadlms.checkpoint import checkpointer
    from megadlms.pretrain import main
    from megadlms.training import train
    from tests.training import fault_launcher

    real = train.train_step, checkpointer.save_checkpoint
    fault_launcher._install({"kind": "sigterm", "rank": 1, "iteration": 5})
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # setup_logging binds its handler to sys.stdout
            rc = main(FLAGS + argv)
    finally:
        train.train_step, checkpointer.save_checkpoint = real
    return rc, out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_to_one_rank_and_to_all_saves_and_exits_zero(tmp_path, reference):
    """--exit-signal-handler: a real SIGTERM to rank 1 only (during step 5; 2 pooled ranks),
    then under torchrun SIGTERM from outside to every rank (as SLURM does); each run saves at
    the next step boundary and exits 0; a later run without --load (2 pooled ranks) resumes
    (auto-resume) to the end."""
    argv = _dir_args(tmp_path, "one") + ["--exit-signal-handler"]
    results = run_distributed(_sigterm_world, 2, (argv,), timeout=300)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-4000:]
    log = results[0][1]
    assert "exiting at iteration 5 (signal)" in log
    assert (tmp_path / "one" / "latest_checkpointed_iteration.txt").read_text() == "5"

    argv = _dir_args(tmp_path, "all") + ["--exit-signal-handler", "--train-iters", "12"]
    log_path = tmp_path / "all.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(_cmd(argv), env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT)
        try:
            # the progress line of iteration 3, in Megatron's format ("iteration        3/      12 |")
            _wait_for(lambda: re.search(r"iteration +3/ +12 \|", log_path.read_text()), 90, "iteration 3")
            for pid in _pids(tmp_path):
                os.kill(pid, signal.SIGTERM)
            rc = proc.wait(timeout=90)
        finally:
            proc.kill()
    log = log_path.read_text()
    assert rc == 0, log[-4000:]
    stopped = int((tmp_path / "all" / "latest_checkpointed_iteration.txt").read_text())
    assert f"exiting at iteration {stopped} (signal)" in log and 3 <= stopped < 12

    # the resume is about the trainer, not the launcher: 2 pooled ranks, no third torchrun launch
    argv = ["--save", str(tmp_path / "all"), "--metrics-jsonl", str(tmp_path / "all.jsonl")]
    assert run_distributed(_reference_world, 2, (argv,), timeout=300) == [0, 0]
    records = _curve(tmp_path / "all.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, 13))
    assert all(r["lm_loss"] == reference[r["iteration"]] for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stopped_rank_fails_peers_within_timeout_and_exception_stops_all(tmp_path):
    """SIGSTOP on rank 1 at step 3: rank 0 fails within the collective timeout (5 s via
    $MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS) naming the collective. An exception inside one
    rank's forward makes every rank exit at once (no timeout involved)."""
    log_path = tmp_path / "stop.log"
    fault = {"kind": "stop", "rank": 1, "iteration": 3}
    env = _env(tmp_path, fault, MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS="5")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(_cmd(["--train-iters", "6"]), env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(
                lambda: all((tmp_path / f"rank_{r}.attempt_0.pid").exists() for r in (0, 1)),
                90,
                "the pid files",
            )
            stopped_pid = _pids(tmp_path)[1]
            t_stop = _wait_for(lambda: _state(stopped_pid) == "T", 90, "rank 1 to stop")
            t_fail = _wait_for(lambda: "CollectiveError" in log_path.read_text(), 60, "rank 0's error")
            os.kill(stopped_pid, signal.SIGKILL)  # torchrun would SIGTERM it, which a stopped process ignores
            rc = proc.wait(timeout=60)
        finally:
            proc.kill()
    log = log_path.read_text()
    assert rc != 0
    assert "rank 0: collective 'all-reduce of the step's loss-token count' failed" in log
    assert "Timed out" in log and "iteration 3" in log
    assert t_fail - t_stop < 5 + 10, t_fail - t_stop  # the timeout, plus polling and log flushing

    t0 = time.monotonic()
    fault = {"kind": "raise", "rank": 1, "iteration": 3}
    rc, log = _torchrun(
        tmp_path, "raise", ["--train-iters", "6"], fault, MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS="600"
    )
    assert rc != 0 and time.monotonic() - t0 < 90
    assert "injected failure inside the forward" in log
    assert "iteration 3: 1 other rank(s) failed inside the step" in log
