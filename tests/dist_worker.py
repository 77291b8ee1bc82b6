"""The rank side of tests/dist_utils.py's worker pool: one long-lived process per pool slot.

Each slot connects once to the pool's TCPStore (hosted by the pytest process) and then runs
job after job: every job gets a process group of its own (a fresh ``init_process_group`` on a
per-job prefix of that store, destroyed afterwards), the caller's environment and working
directory, and the process state a freshly spawned rank would have (RNG streams, default
dtype, thread count, deterministic and grad modes, logging handlers, warning filters). What
a job leaves behind -- env vars, subgroups, DataLoader worker processes -- is undone before
the next one starts.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import io
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (a /proc scan: Linux, no psutil needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name (field 2) may hold spaces: the ppid follows the last ')'
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process exited while we looked
        if ppid == pid:
            out.append(int(entry))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid``'s descendants, children before grandchildren."""
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in child_pids(p)]
        found += kids
        frontier = kids
    return found


def kill_pids(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _fresh_multiprocessing() -> None:
    """A job's DataLoader workers and Processes start as in a fresh interpreter: with the
    platform's default start method and no forkserver. A slot forked by the pool's forkserver
    inherits that server's context and handles (its own forkserver would then be "not a
    child": ChildProcessError)."""
    multiprocessing.set_start_method(None, force=True)
    fs = multiprocessing.forkserver._forkserver
    fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = fs._inherited_fds = None


class _Baseline:
    """The process state right after start-up, reinstated before every job."""

    def __init__(self):
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.det_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.warning_filters = list(warnings.filters)
        self.sys_path = list(sys.path)
        self.loggers = {
            name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
            for name, lg in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]
            if isinstance(lg, logging.Logger)
        }
        self.children = set(child_pids(os.getpid()))
        self.signals = {sig: signal.getsignal(sig) for sig in _SIGNALS}

    def reset(self) -> None:
        _fresh_multiprocessing()
        # a fresh process seeds torch, random and numpy non-deterministically: so do we
        torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(1)
        det = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        if det != (self.deterministic, self.det_warn_only):  # the setter imports torch._dynamo: ~5 s
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.det_warn_only)
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_default_device(None)
        for sig, handler in self.signals.items():  # e.g. a trainer's SIGTERM handler
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        warnings.filters[:] = self.warning_filters
        sys.path[:] = self.sys_path

    def restore_logging(self) -> None:
        for name, lg in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]:
            if not isinstance(lg, logging.Logger):
                continue
            handlers, level, propagate, disabled = self.loggers.get(name, ([], logging.NOTSET, True, False))
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled

    def reap_children(self) -> None:
        """End processes a job started and left running (DataLoader workers, Popen)."""
        for child in multiprocessing.active_children():  # also joins finished ones
            child.join(1)
            if child.is_alive():
                child.kill()
                child.join(5)
        stray = [p for p in child_pids(os.getpid()) if p not in self.children]
        kill_pids([q for p in stray for q in process_tree(p)] + stray)
        for p in stray:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass


def _watch_parent(parent: int) -> None:
    """Exit (with everything this slot started) once the pytest process is gone.

    The slot's own parent is the pytest process (spawned) or the forkserver that forked it
    (which exits with pytest): either way, being re-parented, or ``parent`` gone, means exit."""
    first = os.getppid()
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
            gone = os.getppid() != first
        except ProcessLookupError:
            gone = True
        if gone:
            kill_pids(process_tree(os.getpid()))
            os._exit(3)


def _destroy_groups() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()  # the default group and every subgroup of the job
        except Exception:  # a broken group must not take the slot down
            pass


def _finish(store, job: int, world: int) -> int:
    """Count this rank as done with the job; the last one opens the gate the others wait on."""
    n = store.add(f"job{job}/finished", 1)
    if n == world:
        store.set(f"job{job}/all", b"1")
    return n


def _wait_for_peers(store, job: int, world: int, timeout: float) -> None:
    """Keep this rank's group open until every rank is done with the job.

    ``init_process_group`` does not wait for the peers to finish connecting: a rank that
    returned at once and destroyed its group would break a peer's half-made connection.
    A failed rank does not wait (the ranks blocked on it then error out instead of hanging).
    A blocking wait, not polling: finished ranks would otherwise take turns with the store
    and the rank still working for the 2 cores."""
    if _finish(store, job, world) < world:
        store.wait([f"job{job}/all"], datetime.timedelta(seconds=timeout))


def _run_job(store, base: _Baseline, results, job, rank, world, timeout, env, cwd, payload) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(store.port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    os.chdir(cwd)
    base.reset()
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"job{job}/", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, so no shared-memory handle outlives the job
        msg = ("done", job, rank, True, buf.getvalue())
    except BaseException:  # report, never hang the caller
        msg = ("done", job, rank, False, traceback.format_exc())
    # Report before tearing down: a failed rank's own traceback then arrives ahead of the
    # "connection closed" errors its peers get when its group goes away.
    results.put(msg)
    try:
        if msg[3]:
            _wait_for_peers(store, job, world, timeout)
        else:
            _finish(store, job, world)
    except dist.DistError:  # a peer never finished (the caller's timeout reports it), or the
        # store went away with the pytest process (the watchdog then exits us)
        pass
    fn = args = out = None  # noqa: F841 (drop the job's objects before collecting)
    # Every time: the job's objects in reference cycles (a trainer, a DataLoader iterator
    # with its workers) hold its process groups, and a gloo group's threads run until the
    # group itself is freed. What survives the collection is held by modules and caches:
    # freezing it keeps the next collection to that job's own objects (a full collection
    # of torch's and megadlms' module objects costs 60-350 ms a job).
    gc.collect()
    gc.freeze()
    _destroy_groups()
    base.reap_children()
    base.restore_logging()


def worker_main(slot: int, store_port: int, tasks, results, parent: int, stacks_path: str) -> None:
    """Entry point of one pool slot: connect, report ready, run jobs until told to stop."""
    torch.set_num_threads(1)
    stacks = open(stacks_path, "w")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # a hang's stacks
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    store = dist.TCPStore(HOST, store_port, is_master=False, timeout=datetime.timedelta(seconds=300))
    base = _Baseline()
    gc.freeze()  # the start-up imports: never garbage, never traversed again
    results.put(("ready", slot, os.getpid()))
    while True:
        task = tasks.get()
        if task is None:
            break
        _run_job(store, base, results, *task)
    del store
    faulthandler.unregister(signal.SIGUSR1)
    stacks.close()
