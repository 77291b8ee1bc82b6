"""Run a function on N gloo ranks (CPU) and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(...))   # results[rank]

``fn(rank, world_size, *args)`` runs after ``init_process_group("gloo")``; ``fn`` must be a
module-level function (it travels by name) and whatever it returns picklable (results travel
as ``torch.save`` bytes). An exception on any rank is re-raised here naming the rank, with
its traceback.

The ranks are slots of a pool of long-lived processes, forked from a forkserver that has
imported torch once (a spawned rank costs ~4 s of imports; a forked one ~0.1 s): slot r
serves rank r of every world of size > r, one job at a time, and the pool lives
for the whole pytest session (tests/conftest.py shuts it down and fails the session if a slot
then exits uncleanly). Each job runs in a process group of its own and in the state of a
freshly spawned rank (tests/dist_worker.py lists what is reset). A failing job fails its test
alone; a job that runs past ``timeout`` is reported with each stuck rank's stacks, and the
pool is torn down and respawned for the next caller. ``fresh=True`` spawns (a new
interpreter, no forkserver) a world for this call alone, for a job that needs what only a
new process gives (an env var read at import or library load, a clean ``sys.modules``).
"""

from __future__ import annotations

import atexit
import datetime
import io
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import dist_worker

SPAWN_TIMEOUT = 300.0  # start-up of new slots: not charged to a job's timeout
GRACE = 15.0  # after one rank fails, how long the others get to report before teardown
STACK_WAIT = 1.0  # at most, for a stuck slot's stack dump to appear (it takes milliseconds)
STOP_TIMEOUT = 120.0  # all slots together: exits are slow on a loaded 2-core machine
# A slot past this many threads is recycled between jobs. Gloo groups that a job's objects
# keep alive outlive destroy_process_group with their threads (3 per group; measured: +21
# threads per 2-rank trainer run), and those threads spin on their closed peers' sockets:
# unchecked, a whole suite reached 1,500 threads per slot and a load average of ~490.
MAX_SLOT_THREADS = 300


def _job_payload(fn, args) -> bytes:
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as e:
        raise TypeError(
            f"run_distributed: {getattr(fn, '__qualname__', fn)!r} and its args must be picklable "
            f"(a module-level function; tensors, numbers, strings): {e}"
        ) from e


class _Pool:
    """Slots 0..n-1 (grown on demand), a shared result queue and the store they rendezvous on.

    ``grace`` and ``stack_wait`` default to GRACE and STACK_WAIT (the pool's own tests shorten
    them); ``ctx`` is the multiprocessing context the slots start in."""

    def __init__(self, grace: float | None = None, stack_wait: float | None = None, ctx=None):
        self.grace = GRACE if grace is None else grace
        self.stack_wait = STACK_WAIT if stack_wait is None else stack_wait
        self.ctx = ctx or _forkserver()
        self._reset()

    def _reset(self) -> None:
        self.procs, self.tasks = [], []
        self.results = None
        self.store = None
        self.job = 0
        self.last = ""
        self.dir = None

    def _start(self) -> None:
        self.store = dist.TCPStore(
            dist_worker.HOST,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        self.results = self.ctx.Queue()
        self.dir = tempfile.mkdtemp(prefix="megadlms-pool-")

    def grow(self, n: int) -> None:
        if self.store is None:
            self._start()
        new = range(len(self.procs), n)
        for slot in new:
            tasks = self.ctx.Queue()
            stacks = os.path.join(self.dir, f"slot{slot}.stacks")
            # not daemonic, so a job may start DataLoader workers; the slot reaps them
            p = self.ctx.Process(
                target=dist_worker.worker_main,
                args=(slot, self.store.port, tasks, self.results, os.getpid(), stacks),
                daemon=False,
            )
            p.start()
            self.procs.append(p)
            self.tasks.append(tasks)
        waiting, deadline = set(new), time.monotonic() + SPAWN_TIMEOUT
        while waiting:
            msg = self._get(deadline, list(waiting))
            if msg is None:
                self.kill()
                raise RuntimeError(
                    f"run_distributed: pool slots {sorted(waiting)} did not start in {SPAWN_TIMEOUT} s"
                )
            if msg[0] == "died":
                self.kill()
                raise RuntimeError(
                    f"run_distributed: pool slot {msg[1]} died while starting (exit code {msg[2]})"
                )
            if msg[0] == "ready":
                waiting.discard(msg[1])

    def _get(self, deadline: float, watch: list[int]):
        """The next message before ``deadline``, or None; ("died", slot, code) for a dead slot."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                pass
            for s in watch:
                if self.procs[s].exitcode is not None:
                    return ("died", s, self.procs[s].exitcode)

    def _check_alive(self) -> None:
        """A slot that died between jobs (after reporting): note it against the job it last
        ran (the session fails at shutdown) and rebuild, so this job is not blamed."""
        dead = [(s, p.exitcode) for s, p in enumerate(self.procs) if p.exitcode is not None]
        if dead:
            _CASUALTIES.extend((s, code, f"died after job {self.last}") for s, code in dead)
            self.kill()

    def _recycle_if_leaking(self) -> None:
        """Stop every slot cleanly and start afresh when one holds more than MAX_SLOT_THREADS
        threads (exit codes are still checked: a bad exit fails the session at shutdown)."""
        if any(_thread_count(p.pid) > MAX_SLOT_THREADS for p in self.procs):
            last = self.last
            _CASUALTIES.extend((s, code, f"recycled after job {last}") for s, code in self.close())

    def run(self, payload: bytes, world_size: int, timeout: float, name: str = "") -> list:
        self._check_alive()
        self._recycle_if_leaking()
        self.grow(world_size)
        self.job += 1
        self.last = name or f"#{self.job}"
        env, cwd = dict(os.environ), os.getcwd()
        for r in range(world_size):
            self.tasks[r].put((self.job, r, world_size, timeout, env, cwd, payload))
        try:
            results, errors = self._collect(world_size, timeout)
        except BaseException:  # interrupted (Ctrl-C, pytest-timeout): the slots are mid-job
            self.kill()
            raise
        missing = [r for r in range(world_size) if r not in results and r not in errors]
        if missing or any(self.procs[r].exitcode is not None for r in errors):
            stuck = self._stacks(missing) if missing else ""
            self.kill()  # a slot still inside the job cannot take the next one
            if not errors:
                raise RuntimeError(
                    f"run_distributed: ranks {missing} of {world_size} did not finish within {timeout} s "
                    f"(pool torn down; the next call respawns it){stuck}"
                )
            errors.update(
                dict.fromkeys(
                    missing, f"no report {self.grace} s after another rank failed (pool torn down){stuck}"
                )
            )
        if errors:
            raise RuntimeError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors.items()))
        return [results[r] for r in range(world_size)]

    def _collect(self, world_size: int, timeout: float):
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            pending = [r for r in range(world_size) if r not in results and r not in errors]
            msg = self._get(deadline, pending)
            if msg is None:
                break
            if msg[0] == "died":
                errors[msg[1]] = f"its process died (exit code {msg[2]})"
            elif msg[0] == "done" and msg[1] == self.job:
                _, _, rank, ok, data = msg
                if ok:
                    results[rank] = torch.load(io.BytesIO(data), weights_only=False)
                else:
                    errors[rank] = data
            if errors:  # the rest either finish soon or wait on the failed rank: bound it
                deadline = min(deadline, time.monotonic() + self.grace)
        return results, errors

    def _stacks(self, slots: list[int]) -> str:
        """Ask stuck slots for their Python stacks (faulthandler on SIGUSR1) and read them."""
        for s in slots:
            try:
                os.kill(self.procs[s].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        paths = [os.path.join(self.dir, f"slot{s}.stacks") for s in slots]
        deadline = time.monotonic() + self.stack_wait
        while time.monotonic() < deadline and not all(_size(p) for p in paths):
            time.sleep(0.01)
        time.sleep(min(0.05, self.stack_wait))  # a dump that just began: let it finish
        out = []
        for s, path in zip(slots, paths):
            try:
                with open(path) as f:
                    out.append(f"\n--- rank {s} stacks ---\n{f.read()[:12000]}")
            except OSError:
                pass
        return "".join(out)

    def kill(self) -> None:
        """Tear everything down now (a hung or broken job): SIGKILL each slot and its children."""
        for p in self.procs:
            if p.pid is not None:
                dist_worker.kill_pids(dist_worker.process_tree(p.pid) + [p.pid])
        for p in self.procs:
            p.join(5)
        self._forget()

    def close(self) -> list[tuple[int, int]]:
        """Stop every slot; return (slot, exit code) of those that did not exit with 0."""
        for t in self.tasks:
            t.put(None)
        bad, deadline = [], time.monotonic() + STOP_TIMEOUT
        for s, p in enumerate(self.procs):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                bad.append((s, f"alive {STOP_TIMEOUT:.0f} s after stop{self._stacks([s])}"))
                dist_worker.kill_pids(dist_worker.process_tree(p.pid) + [p.pid])
                p.join(5)
            elif p.exitcode != 0:
                bad.append((s, p.exitcode))  # e.g. -6: SIGABRT at interpreter exit
        self._forget()
        return bad

    def _forget(self) -> None:
        for q in [*self.tasks, *([self.results] if self.results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self._reset()


def _forkserver():
    """The context pool slots start in: forked from a server that has imported torch once
    (a spawned slot re-imports it: ~2-8 s a slot, paid again at each respawn)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["pytest", "tests.dist_worker"])
    return ctx


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _thread_count(pid) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # gone, or not Linux: nothing to recycle
        return 0


_POOL = _Pool()
_CASUALTIES: list = []  # (slot, exit code, what it last ran) of slots that died between jobs


def run_distributed(fn, world_size: int, args=(), timeout: float = 300.0, fresh: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return [result of rank 0, 1, ...].

    ``timeout`` bounds the job (start-up of new pool slots excluded). ``fresh``: spawn new
    processes for this call instead of using the session's pool.
    """
    payload = _job_payload(fn, args)
    pool = _Pool(ctx=mp.get_context("spawn")) if fresh else _POOL  # fresh: a new interpreter
    try:
        out = pool.run(payload, world_size, timeout, name=getattr(fn, "__qualname__", repr(fn)))
    finally:
        if fresh and pool.store is not None:
            bad = pool.close()
            if bad:
                raise RuntimeError(
                    f"ranks exited uncleanly after returning their results (rank, exit code): {bad}"
                )
    return out


def shutdown_pool() -> list:
    """Stop the session's pool; (slot, exit code) of each slot that did not exit cleanly."""
    _POOL._check_alive()
    bad = [*_CASUALTIES, *(_POOL.close() if _POOL.procs else [])]
    _CASUALTIES.clear()
    return bad


atexit.register(shutdown_pool)  # outside pytest too (the conftest hook checks the codes)
