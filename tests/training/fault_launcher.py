"""torchrun target of the fault tests: ``megadlms.pretrain.main`` with one fault injected.

    MEGADLMS_TEST_FAULT='{"kind": "kill", "rank": 1, "iteration": 7, "attempt": 0}' \\
        torchrun --max-restarts 1 ... tests/training/fault_launcher.py <pretrain flags>

kinds (``iteration`` is the 1-based step the fault hits; only in restart ``attempt``, default 0;
a JSON list of such faults injects each in its own attempt, so one launch with
``--max-restarts N`` serves N faults):

* ``kill``: SIGKILL this rank at the start of that step (mid-step for its peers);
* ``kill_in_save``: SIGKILL this rank inside the save at the end of that step, after its
  tensor files are written (rank 0: while it writes common.json);
* ``stop``: SIGSTOP this rank at the start of that step (a rank that stops responding);
* ``raise``: raise inside the forward of that step on this rank;
* ``sigterm``: send SIGTERM to this rank at the start of that step;
* ``raise_outside``: raise ``OSError("injected failure in <phase>")`` on this rank outside the
  step, in ``phase``: ``evaluation`` (the first one), ``checkpoint save`` (the first save's
  metadata), ``data-loader construction`` (at start-up), ``logging`` (the report after step
  ``iteration``), ``the step`` (the loss of the first micro-batch of step ``iteration``, 1
  micro-batch per step: under FSDP2 between its units' all-gathers and reduce-scatters) or
  ``step data`` (loading the micro-batch of step ``iteration``, 1 micro-batch per step);
* ``hold_for_sigterm``: at the start of that step write ``rank_<r>.attempt_<a>.held`` (next to
  the pid file) and wait, at most 120 s, until a SIGTERM from outside has reached the trainer's
  handler (--exit-signal-handler): the test's signal then lands mid-run at a known step,
  without racing the training to its end.

``$MEGADLMS_TEST_ATTEMPTS`` (JSON, restart attempt -> ``{"argv": [...], "env": {...}}``) gives
one attempt extra pretrain flags or environment on every rank, so attempts of one launch can
differ (e.g. ``--async-save`` in one of them) where torchrun passes the same command to all.

Every rank writes its pid to ``$MEGADLMS_TEST_PID_DIR/rank_<r>.attempt_<a>.pid`` when set.
Nothing here is part of megadlms: the faults are monkeypatches of a test process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]


def _hold_for_sigterm(rank: int, attempt: int) -> None:
    handler, seen = signal.getsignal(signal.SIGTERM), []
    assert callable(handler), "hold_for_sigterm needs --exit-signal-handler"

    def noting(signum, frame):
        seen.append(signum)
        handler(signum, frame)

    signal.signal(signal.SIGTERM, noting)
    with open(os.path.join(os.environ["MEGADLMS_TEST_PID_DIR"], f"rank_{rank}.attempt_{attempt}.held"), "w"):
        pass
    deadline = time.monotonic() + 120
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)  # a signal interrupts the sleep: the handler runs at once
    signal.signal(signal.SIGTERM, handler)


def _raise_outside(phase: str, iteration: int) -> None:
    """Make this rank raise in one phase outside the step: its first evaluation, save or
    loader construction, or the report after step ``iteration``."""
    from megadlms.diffusion.objective import ObjectiveBatch
    from megadlms.training import builders, reporting, train

    owner, name = {
        "the step": (ObjectiveBatch, "forward"),
        "step data": (train, "_to_device"),
        "evaluation": (train, "evaluate"),
        "checkpoint save": (train, "RunRecords"),  # the save's metadata, gathered on every rank
        "data-loader construction": (builders, "build_loader"),
        "logging": (reporting.Reporter, "after_step"),
    }[phase]
    real, calls = getattr(owner, name), []

    def failing(*a, **k):
        calls.append(1)
        # Reporter.after_step(self, out, lr, flops, counters, window): the step just counted
        due = {
            "logging": lambda: a[4].iteration == iteration,
            "the step": lambda: len(calls) == iteration,
            "step data": lambda: len(calls) == iteration,
        }
        if due.get(phase, lambda: True)():
            with open(os.path.join(os.environ["MEGADLMS_TEST_PID_DIR"], "failed_at"), "w") as f:
                f.write(repr(time.time()))
            raise OSError(f"injected failure in {phase}")
        return real(*a, **k)

    setattr(owner, name, failing)
    _hold_teardown()


def _hold_teardown(limit: float = 30.0) -> None:
    """This rank keeps its process group until every peer process has exited (at most
    ``limit`` s): a failed rank that lingers (as under NCCL, where a peer's exit does not end
    a collective), so a peer that waits for the collective timeout shows."""
    from megadlms import pretrain

    real, pid_dir = pretrain._teardown, os.environ["MEGADLMS_TEST_PID_DIR"]

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:  # an exited child of the launcher (zombie) is gone
                return f.read().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    def holding(ok: bool) -> None:
        me, deadline = os.getpid(), time.monotonic() + limit
        pids = [int(open(os.path.join(pid_dir, n)).read()) for n in os.listdir(pid_dir) if n.endswith(".pid")]
        while any(alive(p) for p in pids if p != me) and time.monotonic() < deadline:
            time.sleep(0.05)
        real(ok)

    pretrain._teardown = holding


def _install(fault: dict) -> None:
    from megadlms.checkpoint import checkpointer, commit
    from megadlms.diffusion.objective import ObjectiveBatch
    from megadlms.training import train

    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank != fault["rank"] or attempt != fault.get("attempt", 0):
        return
    if fault["kind"] == "raise_outside":
        _raise_outside(fault["phase"], fault.get("iteration", 0))
        return
    kind, target = fault["kind"], fault["iteration"] - 1  # train_step sees the 0-based iteration
    real_step, real_save = train.train_step, checkpointer.save_checkpoint

    def step(model, optimizer, micro, cfg, iteration, **kw):
        if iteration == target:
            if kind in ("kill", "stop", "sigterm"):
                os.kill(
                    os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}.get(kind, signal.SIGTERM)
                )
            if kind == "raise":  # the schedule's forward step runs each chunk through ObjectiveBatch.forward
                real_run = ObjectiveBatch.forward

                def failing(*a, **k):
                    ObjectiveBatch.forward = real_run
                    raise RuntimeError("injected failure inside the forward")

                ObjectiveBatch.forward = failing
            if kind == "hold_for_sigterm":
                _hold_for_sigterm(rank, attempt)
        return real_step(model, optimizer, micro, cfg, iteration, **kw)

    def save(root, iteration, **kw):
        if kind == "kill_in_save" and iteration == fault["iteration"]:
            from torch.distributed.checkpoint import filesystem

            real_write, real_atomic = filesystem.FileSystemWriter.write_data, commit.write_atomic

            def dying_write(self, plan, planner):
                fut = real_write(self, plan, planner)
                fut.wait()
                if rank != 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fut

            def dying_atomic(path, data):
                with open(path + ".partial", "w") as f:
                    f.write(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)

            filesystem.FileSystemWriter.write_data = dying_write
            commit.write_atomic = dying_atomic if rank == 0 else real_atomic
        return real_save(root, iteration, **kw)

    train.train_step = step
    checkpointer.save_checkpoint = save  # what Checkpointer.save calls


def main() -> int:
    pid_dir, attempt = (
        os.environ.get("MEGADLMS_TEST_PID_DIR"),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    if pid_dir:
        name = f"rank_{os.environ.get('RANK', '0')}.attempt_{attempt}"
        path = os.path.join(pid_dir, name + ".pid")
        with open(path + ".tmp", "w") as f:  # renamed into place: a reader never sees it empty
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    this = json.loads(os.environ.get("MEGADLMS_TEST_ATTEMPTS") or "{}").get(attempt, {})
    os.environ.update(this.get("env", {}))  # before megadlms is imported
    if os.environ.get("MEGADLMS_TEST_FAULT"):
        faults = json.loads(os.environ["MEGADLMS_TEST_FAULT"])
        for fault in faults if isinstance(faults, list) else [faults]:
            _install(fault)  # a no-op unless it names this rank and restart attempt
    from megadlms.pretrain import main as pretrain_main

    return pretrain_main(sys.argv[1:] + this.get("argv", []))


if __name__ == "__main__":
    sys.exit(main())
