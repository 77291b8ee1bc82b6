"""Entry point of ``torchrun ... pretrain_difflm.py --flags`` (also ``python -m
megadlms.pretrain`` and the ``megadlms-pretrain`` console script).

Parse and validate the flags (before any process group exists, so a bad flag fails
fast on every rank), initialise torch.distributed (NCCL with CUDA, gloo otherwise,
``--distributed-backend`` overrides), train, and tear down — on error too.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import sys
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megadlms.checkpoint import checkpoint_record
from megadlms.checkpoint.convert import convert_checkpoint
from megadlms.config import flag_message, parse_config
from megadlms.config.messages import FlagError
from megadlms.hf.importer import init_from_hf
from megadlms.startup import check_startup
from megadlms.training.failures import FailureChannel
from megadlms.training.logging_utils import setup_logging
from megadlms.training.train import RunResult, pretrain


def _single_process_env() -> bool:
    """Let ``python pretrain_difflm.py ...`` (no torchrun) run as a world of one.

    Returns True when this process is such a world (no torchrun variables were set)."""
    if "RANK" in os.environ:
        return False
    # A free port, so several single-process runs on one host do not collide on a fixed one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    return True


TIMEOUT_ENV = "MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS"
"""Overrides --distributed-timeout-minutes with seconds (tests of stuck ranks; docs/reliability.md)."""


def collective_timeout(parallel) -> datetime.timedelta:
    """Timeout of every collective: --distributed-timeout-minutes or $MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS."""
    seconds = os.environ.get(TIMEOUT_ENV)
    if seconds:
        try:
            value = float(seconds)
        except ValueError:
            # Fall through to the one error message below rather than a bare float() traceback.
            value = -1.0
        if value <= 0:
            raise FlagError([f"${TIMEOUT_ENV} must be a positive number of seconds, got {seconds!r}"])
        return datetime.timedelta(seconds=value)
    return datetime.timedelta(minutes=parallel.distributed_timeout_minutes)


def _bootstrap_store(timeout: datetime.timedelta):
    """The store to bootstrap the process group with, namespaced per torchrun restart attempt.

    With torchrun's defaults the workers share the agent's TCPStore, and it outlives a restart:
    a restarted group would read the previous attempt's keys (pytorch#135712). Prefixing every
    key with the restart count makes each attempt start from an empty namespace. None outside
    torchrun (plain env:// rendezvous)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"megadlms/attempt_{attempt}/", store)


def init_distributed(parallel) -> None:
    """Initialise the default process group from torchrun's environment
    (``parallel``: the run's ParallelConfig)."""
    alone = _single_process_env()
    backend = parallel.distributed_backend
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs CUDA devices; use gloo on CPU")
        # Before init_process_group: NCCL binds each rank's communicator to the current device.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = collective_timeout(parallel)
    # A world of one rendezvous in-process: binding the port picked above could race with
    # another process taking it in between (EADDRINUSE when several runs start at once).
    if alone:
        dist.init_process_group(backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
        return
    store = _bootstrap_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=world)


def hf_initializer(hf_dir: str, running_mode=None):
    """--hf-init: a function copying the Hugging Face model in ``hf_dir`` into the plain model
    the trainer built (or, at pp > 1, into this rank's pipeline chunks: each takes its own
    layers); an architecture mismatch is an error naming the flags.

    Made here, at the top: ``hf/`` sits above ``training/``, which only calls it."""

    def init(model) -> None:
        init_from_hf(
            model, hf_dir, running_mode=running_mode
        )  # its ValueErrors name config fields: main() says them as flags

    return init


def _rank() -> int:
    """This process's rank: the process group's when one exists, else torchrun's $RANK."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def _quiet_unless_rank0():
    """Silence stdout/stderr on every rank but 0: argparse prints its usage and error (or
    --help) itself before exiting, and every rank parses the same argv."""
    if _rank() == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
        yield


def _config(argv: Optional[Sequence[str]], world: int):
    """The validated RunConfig, after the inputs on disk were checked (before any process
    group or model exists, so every error comes seconds after the launch)."""
    with _quiet_unless_rank0():
        # checkpoint_record: --use-checkpoint-args reads the model flags of the checkpoint to load.
        config = parse_config(
            list(argv) if argv is not None else None, world_size=world, checkpoint_args=checkpoint_record
        )
    check_startup(config)
    collective_timeout(config.parallel)  # a malformed $MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS: now
    return config


def run(argv: Optional[Sequence[str]] = None):
    """Parse ``argv``, train, return the :class:`~megadlms.training.train.RunResult`.

    Uses the default process group when one exists (tests call this from spawned
    ranks); otherwise creates it from the environment and destroys it afterwards.
    """

    owned = not dist.is_initialized()
    # The flags are validated before any process group exists: the world size comes from torchrun's env.
    world = dist.get_world_size() if not owned else int(os.environ.get("WORLD_SIZE", "1"))
    config = _config(argv, world)
    if owned:
        init_distributed(config.parallel)
    setup_logging(dist.get_rank())
    ok = False
    result: Union[str, RunResult]
    # This process owns its group: a peer's failure outside the step may end it (training/failures.py)
    failures = FailureChannel.for_default_group().start() if owned else None
    try:
        if config.checkpoint.ckpt_convert_format:  # Megatron: convert, then exit
            result = convert_checkpoint(config)
        else:
            hf_dir = config.checkpoint.hf_init
            init = hf_initializer(hf_dir, config.diffusion.model_running_mode) if hf_dir else None
            result = pretrain(config, init_model=init, failures=failures)
        ok = True
        return result
    finally:
        if owned and dist.is_initialized():
            _teardown(ok)  # the watcher still runs: a peer failing now must not leave the barrier waiting
        if failures is not None:
            failures.close()


def _teardown(ok: bool) -> None:
    """Destroy the process group so nothing of it is left to interpreter finalization.

    Objects of the run that sit in reference cycles keep their gloo groups and work objects
    alive until a gc pass; if that pass is the interpreter's final
    one, gloo's worker threads are torn down with Python half gone and the process can abort
    ("terminate called without an active exception", SIGABRT, after correct results). So:
    collect those cycles first, then (on success, when every rank is here) a barrier so no
    rank destroys its group while a peer still talks to it, then destroy. After a failure the
    barrier is skipped: a peer may be gone and it would wait for the timeout."""
    gc.collect()
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def _report(exc: ValueError) -> str:
    """The line(s) ``main`` prints for ``exc``: a FlagError's problems as they are (worded with
    flags once, where they were found); a run-time error of a lower layer reworded with flags
    (once, here) and the place that raised it, the useful pointer for a bug report."""
    if isinstance(exc, FlagError):
        if len(exc.problems) == 1:
            return exc.problems[0]
        return f"{len(exc.problems)} problems:\n" + "\n".join(f"  - {p}" for p in exc.problems)
    tb, where = exc.__traceback__, "?"
    while tb is not None:  # the innermost frame: where the failed check lives
        where = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{flag_message(str(exc))} [raised at {where}]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry: exit status 0 on success, 2 with a one-line message on a bad flag or
    input (printed by rank 0 only; argparse's own errors too), 16 / 17 from result validation
    (--rerun-mode validate_results, docs/reliability.md)."""
    try:
        result = run(argv if argv is not None else sys.argv[1:])
    except ValueError as exc:  # bad flags / data / checkpoint: the message names the fix
        # Every rank raises the same error (the checks run on every rank before any collective,
        # so none is left waiting); printing it once keeps the log readable.
        if _rank() == 0:
            print(f"pretrain_difflm.py: error: {_report(exc)}", file=sys.stderr)
        return 2
    # Megatron's 16 (resume elsewhere to disambiguate) / 17 (failed on result validation)
    return result.exit_code if isinstance(result, RunResult) else 0


if __name__ == "__main__":
    sys.exit(main())
