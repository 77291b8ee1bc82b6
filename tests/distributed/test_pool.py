"""tests/dist_utils.py's worker pool: a failing job fails alone and names its rank, a hanging
one is bounded and the pool rebuilt, every job starts from a freshly spawned rank's state,
leftover child processes are reaped, and ``fresh=True`` gets processes of its own."""

import logging
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests import dist_utils
from tests.dist_utils import run_distributed

_LEAKED = []  # a job's deliberately leaked child processes (this module's global, in the slot)


def _pid(rank, world):
    return os.getpid()


def _fail_on_one(rank, world):
    dist.barrier()
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _dirty(rank, world):
    """Leave behind everything a careless test body could."""
    os.environ["MEGADLMS_POOL_LEFTOVER"] = "1"
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    logging.getLogger("megadlms").addHandler(logging.NullHandler())
    dist.new_group([0])
    os.chdir("/")
    signal.signal(signal.SIGTERM, lambda *a: None)
    _LEAKED.append(subprocess.Popen(["sleep", "600"]))
    return {"probe": os.environ.get("MEGADLMS_POOL_PROBE"), "pid": os.getpid(), "child": _LEAKED[-1].pid}


def _state(rank, world, child):
    t = torch.empty(1)
    sub = dist.new_group(list(range(world)))  # a new job's groups work after the last one's
    x = torch.ones(1)
    dist.all_reduce(x, group=sub)
    alive = os.path.exists(f"/proc/{child}") and "Z" not in open(f"/proc/{child}/stat").read().split()[2]
    return {
        "leftover": os.environ.get("MEGADLMS_POOL_LEFTOVER"),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "dtype": t.dtype,
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
        "handlers": len(logging.getLogger("megadlms").handlers),
        "cwd": os.getcwd(),
        "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        "seed": torch.initial_seed(),
        "sum": x.item(),
        "child_alive": alive,
        "pid": os.getpid(),
    }


@pytest.fixture(scope="module")
def private_pool():
    """A pool of this module's own, so the session's stays warm; short grace and stack wait
    (the checks are about the mechanism, not the defaults). It serves the recycling test and
    then the hang test, whose pool.grow(2) then finds the two fresh slots already up."""
    pool = dist_utils._Pool(grace=2.0, stack_wait=1.0)
    yield pool
    assert pool.close() == []  # and it stops cleanly


def _hang_on_one(rank, world):
    if rank == 1:
        time.sleep(600)
    return rank


def test_failure_names_the_rank_and_leaves_the_pool_usable():
    pids = run_distributed(_pid, 2)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: boom on purpose"):
        run_distributed(_fail_on_one, 2)
    assert run_distributed(_pid, 2) == pids  # the same slots serve the next job


def test_every_job_starts_from_a_fresh_rank_state(monkeypatch):
    monkeypatch.setenv("MEGADLMS_POOL_PROBE", "from the caller")
    dirty = run_distributed(_dirty, 2)
    assert [d["probe"] for d in dirty] == ["from the caller"] * 2  # the caller's env reaches the ranks
    states = run_distributed(_state, 3, args=(dirty[0]["child"],))
    assert [s["pid"] for s in states[:2]] == [d["pid"] for d in dirty]  # pooled, not respawned
    for rank, s in enumerate(states):
        assert s["leftover"] is None
        assert s["rank_env"] == (str(rank), "3")
        assert (s["dtype"], s["threads"], s["deterministic"], s["grad"]) == (torch.float32, 1, False, True)
        assert s["handlers"] == 0
        assert s["cwd"] == os.getcwd()
        assert s["sigterm"] is True
        assert s["seed"] != 1234
        assert s["sum"] == 3.0
    assert states[0]["child_alive"] is False  # the Popen the last job leaked was reaped


def _exit_after_reporting(rank, world):
    threading.Timer(0.5, os._exit, args=(7,)).start()  # the slot dies between jobs
    return os.getpid()


def _leak_groups(rank, world):
    """Keep two gloo groups alive past the job (as objects in reference cycles or caches do)."""
    before = len(os.listdir("/proc/self/task"))
    _LEAKED.extend([dist.new_group(), dist.new_group()])
    during = len(os.listdir("/proc/self/task"))
    return during, (during - before) // 2  # threads now, threads per gloo group


def test_a_slot_leaking_threads_is_recycled_cleanly(private_pool, monkeypatch):
    pool = private_pool
    first = pool.run(dist_utils._job_payload(_leak_groups, ()), 2, timeout=60)
    pids = [p.pid for p in pool.procs]
    during, per_group = min(n for n, _ in first), max(g for _, g in first)
    assert per_group > 0
    # the leak is past it; the job's default group is not counted: its threads end with the
    # job (or shortly after), the leaked groups' do not
    monkeypatch.setattr(dist_utils, "MAX_SLOT_THREADS", during - per_group - 1)
    again = pool.run(dist_utils._job_payload(_leak_groups, ()), 2, timeout=60)
    assert not set(pids) & {p.pid for p in pool.procs}  # stopped and respawned before the job
    assert again == first  # fresh slots: the leaked threads went with the old ones
    assert not [c for c in dist_utils._CASUALTIES if c[2].startswith("recycled")]  # clean exits


def test_a_hang_is_bounded_names_the_rank_and_the_pool_is_rebuilt(private_pool):
    pool = private_pool
    payload = dist_utils._job_payload(_hang_on_one, ())
    pool.grow(2)  # start-up is not part of the job's time (a no-op after the recycling test)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"(?s)ranks \[1\] of 2 did not finish within 2 s.*rank 1 stacks.*_hang_on_one"
    ):
        pool.run(payload, 2, timeout=2)
    assert time.monotonic() - start < 2 + 10  # the timeout, the stack dump and the kill
    assert pool.procs == []  # torn down
    # rebuilt: the next job gets a new slot; it dies after its report, which is charged to
    # the job it ran, not to the next one
    dying = pool.run(dist_utils._job_payload(_exit_after_reporting, ()), 1, timeout=60, name="exiter")[0]
    assert dying != os.getpid()
    while os.path.exists(f"/proc/{dying}") and pool.procs[0].exitcode is None:
        time.sleep(0.05)
    assert pool.run(dist_utils._job_payload(_pid, ()), 1, timeout=60)[0] not in (dying, os.getpid())
    assert dist_utils._CASUALTIES[-1] == (0, 7, "died after job exiter")
    dist_utils._CASUALTIES.pop()  # seen here: not a failure of the session


def test_fresh_world_and_unpicklable_jobs():
    pooled = run_distributed(_pid, 2)
    fresh = run_distributed(_pid, 1, fresh=True)  # one rank shows it: its own process
    assert not set(fresh) & set(pooled)
    with pytest.raises(TypeError, match="must be picklable"):
        run_distributed(lambda rank, world: rank, 2)
