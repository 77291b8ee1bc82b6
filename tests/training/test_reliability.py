"""Faults under the real launcher: ``torchrun`` (its default settings, ``--standalone``) on
2 CPU ranks, a tiny model, faults injected by ``fault_launcher.py``. Where an assertion is
about the trainer and not the launcher (the SIGTERM to one rank, the auto-resume), the run
uses 2 pooled ranks instead of a launch. Two launches in all, each serving several cases
through torchrun's restart attempts: the restart launch (three SIGKILLs, then SIGTERM to
every rank) and the stop launch (a stopped rank, then an exception in one rank's forward).

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


def _popen(cmd, env, out, **kw):
    # a session of its own: a launch the test gives up on is stopped with its ranks (_stop)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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


# One launch serves every restart case: each fault hits its own restart attempt
# (fault_launcher.py), --max-restarts 3; $MEGADLMS_TEST_ATTEMPTS gives attempts their own flags.
KILLS = [
    # attempt 0 (--async-save): rank 0 while it finishes the background save of iteration 8
    # (common.json); its iteration 4 was saved in the background too, and every later attempt loads it
    {"kind": "kill_in_save", "rank": 0, "iteration": 8, "attempt": 0},
    # attempt 1, rank 1 at the start of step 7: its peer is inside the step's first collective
    {"kind": "kill", "rank": 1, "iteration": 7, "attempt": 1},
    # attempt 2, rank 1 inside the (synchronous) save of iteration 8, after writing its tensor files
    {"kind": "kill_in_save", "rank": 1, "iteration": 8, "attempt": 2},
]
# attempt 3 runs to the end unless stopped: the SIGTERM test's signal from outside lands at the
# start of its step 6, where both ranks wait for it (no race with the training's end)
HOLDS = [{"kind": "hold_for_sigterm", "rank": r, "iteration": 6, "attempt": 3} for r in (0, 1)]
ATTEMPTS = {"0": {"argv": ["--async-save"]}, "3": {"argv": ["--exit-signal-handler"]}}
# case: (the attempt its fault kills, the last iteration logged before it; None: 8..12)
SIGKILLS = {"async": (0, None), "step": (1, 6), "save": (2, 8)}


@pytest.fixture(scope="module")
def restart_launch(tmp_path_factory):
    """The one torchrun launch (--max-restarts 3) of every restart case: three SIGKILLs, then
    SIGTERM from outside to every rank of the last attempt, then (the resume is about the
    trainer, not the launcher) the run resumed to the end on 2 pooled ranks. Returns tmp,
    torchrun's return code and log, and the iteration the SIGTERM stopped at."""
    tmp = tmp_path_factory.mktemp("restarts")
    log_path, held = tmp / "restarts.log", [tmp / f"rank_{r}.attempt_3.held" for r in (0, 1)]
    env = _env(tmp, KILLS + HOLDS, MEGADLMS_TEST_ATTEMPTS=json.dumps(ATTEMPTS))
    with open(log_path, "w") as out:
        cmd = _cmd(_dir_args(tmp, "restarts"), restarts=len(KILLS))
        proc = _popen(cmd, env, out, cwd=str(tmp))
        try:
            # bounded per attempt: each restart re-imports both ranks (slow on a loaded machine)
            _wait_for(lambda: proc.poll() is not None or all(p.exists() for p in held), 420, "attempt 3")
            if proc.poll() is None:
                for pid in _pids(tmp, attempt=3):
                    os.kill(pid, signal.SIGTERM)
            rc = proc.wait(timeout=90)
        finally:
            _stop(proc)
    log = log_path.read_text()
    assert rc == 0, log[-4000:]
    stopped = int((tmp / "restarts" / "latest_checkpointed_iteration.txt").read_text())
    assert run_distributed(_reference_world, 2, (_dir_args(tmp, "restarts"),), timeout=300) == [0, 0]
    return tmp, rc, log, stopped


def _segments(records):
    """The JSONL's iterations split at each restart (where the iteration goes back)."""
    segs = [[]]
    for r in records:
        if segs[-1] and r["iteration"] <= segs[-1][-1]:
            segs.append([])
        segs[-1].append(r["iteration"])
    return segs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(SIGKILLS))
def test_sigkill_restart_resumes_bitwise(reference, restart_launch, case):
    """torchrun --max-restarts restarts the group after a SIGKILL; it resumes from iteration
    4 (the last complete checkpoint: 8 never completed) and reproduces the reference bitwise.
    The async, step and save kills share one launch (one kill per attempt)."""
    attempt, died_after = SIGKILLS[case]
    tmp, rc, log, _ = restart_launch
    assert rc == 0, log[-4000:]
    assert f"local_rank: {KILLS[attempt]['rank']}" in log and "resuming from --save" in log
    records = _curve(tmp / "restarts.jsonl")
    segs = _segments(records)
    assert len(segs) == len(KILLS) + 1, segs  # one restart per kill, then the run to the end
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
    assert log.count(f"loaded {tmp / 'restarts'}/iter_{4:07d}") >= len(KILLS), log[-4000:]  # every restart
    assert (tmp / "restarts" / "latest_checkpointed_iteration.txt").read_text() == "12"


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
@pytest.mark.timeout(600)
def test_sigterm_to_one_rank_and_to_all_saves_and_exits_zero(tmp_path, reference, restart_launch):
    """--exit-signal-handler: a real SIGTERM to rank 1 only (during step 5; 2 pooled ranks),
    then under torchrun SIGTERM from outside to every rank (as SLURM does; the last attempt of
    the restart launch, at its step 6); each run saves at the next step boundary and exits 0;
    a later run without --load (2 pooled ranks) resumes (auto-resume) to the end."""
    argv = _dir_args(tmp_path, "one") + ["--exit-signal-handler"]
    results = run_distributed(_sigterm_world, 2, (argv,), timeout=300)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-4000:]
    log = results[0][1]
    assert "exiting at iteration 5 (signal)" in log
    assert (tmp_path / "one" / "latest_checkpointed_iteration.txt").read_text() == "5"

    tmp, rc, log, stopped = restart_launch
    assert rc == 0, log[-4000:]
    assert f"exiting at iteration {stopped} (signal)" in log and 3 <= stopped < 12
    # the pooled resume continued from the signal's checkpoint: after the restart from 4, every
    # iteration to the end once, bitwise the reference's
    records = _curve(tmp / "restarts.jsonl")
    assert _segments(records)[-1] == list(range(5, 13))
    assert all(r["lm_loss"] == reference[r["iteration"]] for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stopped_rank_fails_peers_within_timeout_and_exception_stops_all(tmp_path):
    """SIGSTOP on rank 1 at step 3: rank 0 fails within the collective timeout (5 s via
    $MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS) naming the collective. An exception inside one
    rank's forward makes every rank exit at once (no timeout involved: 600 s in that attempt).
    One launch: the exception is the fault of its restart attempt (--max-restarts 1)."""
    log_path = tmp_path / "stop.log"
    faults = [
        {"kind": "stop", "rank": 1, "iteration": 3, "attempt": 0},
        {"kind": "raise", "rank": 1, "iteration": 3, "attempt": 1},
    ]
    attempts = {"1": {"env": {"MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS": "600"}}}
    env = _env(
        tmp_path,
        faults,
        MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS="5",
        MEGADLMS_TEST_ATTEMPTS=json.dumps(attempts),
    )
    with open(log_path, "w") as out:
        cmd = _cmd(["--train-iters", "6"], restarts=1)
        proc = _popen(cmd, env, out)
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
            _wait_for(
                lambda: all((tmp_path / f"rank_{r}.attempt_1.pid").exists() for r in (0, 1)),
                90,
                "the restart",
            )
            stop_log, t_restart = log_path.read_text(), time.monotonic()
            rc = proc.wait(timeout=90)
        finally:
            _stop(proc)
    assert "rank 0: collective 'all-reduce of the step's loss-token count' failed" in stop_log
    assert "Timed out" in stop_log and "iteration 3" in stop_log
    assert t_fail - t_stop < 5 + 10, t_fail - t_stop  # the timeout, plus polling and log flushing

    log = log_path.read_text()[len(stop_log) :]  # the restart attempt's output
    assert rc != 0 and time.monotonic() - t_restart < 90
    assert "injected failure inside the forward" in log
    assert "iteration 3: 1 other rank(s) failed inside the step" in log
