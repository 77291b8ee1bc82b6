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
* ``sigterm``: send SIGTERM to this rank at the start of that step.

Every rank writes its pid to ``$MEGADLMS_TEST_PID_DIR/rank_<r>.attempt_<a>.pid`` when set.
Nothing here is part of megadlms: the faults are monkeypatches of a test process.
"""

from __future__ import annotations

import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]


def _install(fault: dict) -> None:
    from megadlms.checkpoint import checkpointer, commit
    from megadlms.training import pipeline_run, train

    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank != fault["rank"] or attempt != fault.get("attempt", 0):
        return
    kind, target = fault["kind"], fault["iteration"] - 1  # train_step sees the 0-based iteration
    real_step, real_save = train.train_step, checkpointer.save_checkpoint

    def step(model, optimizer, micro, cfg, iteration, **kw):
        if iteration == target:
            if kind in ("kill", "stop", "sigterm"):
                os.kill(
                    os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}.get(kind, signal.SIGTERM)
                )
            if kind == "raise":  # the schedule's forward step runs each chunk through _run_chunk
                real_run = pipeline_run._run_chunk

                def failing(*a, **k):
                    pipeline_run._run_chunk = real_run
                    raise RuntimeError("injected failure inside the forward")

                pipeline_run._run_chunk = failing
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
    pid_dir = os.environ.get("MEGADLMS_TEST_PID_DIR")
    if pid_dir:
        name = (
            f"rank_{os.environ.get('RANK', '0')}.attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        path = os.path.join(pid_dir, name + ".pid")
        with open(path + ".tmp", "w") as f:  # renamed into place: a reader never sees it empty
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    if os.environ.get("MEGADLMS_TEST_FAULT"):
        faults = json.loads(os.environ["MEGADLMS_TEST_FAULT"])
        for fault in faults if isinstance(faults, list) else [faults]:
            _install(fault)  # a no-op unless it names this rank and restart attempt
    from megadlms.pretrain import main as pretrain_main

    return pretrain_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
