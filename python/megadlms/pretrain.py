"""Entry point of ``torchrun ... pretrain_difflm.py --flags`` (also ``python -m
megadlms.pretrain`` and the ``megadlms-pretrain`` console script).

Parse and validate the flags (before any process group exists, so a bad flag fails
fast on every rank), initialise torch.distributed (NCCL with CUDA, gloo otherwise,
``--distributed-backend`` overrides), train, and tear down — on error too.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def _single_process_env() -> None:
    """Let ``python pretrain_difflm.py ...`` (no torchrun) run as a world of one."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def init_distributed(parallel) -> None:
    """Initialise the default process group from torchrun's environment
    (``parallel``: the run's ParallelConfig)."""
    _single_process_env()
    backend = parallel.distributed_backend
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs CUDA devices; use gloo on CPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    minutes = parallel.distributed_timeout_minutes
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=minutes))


def run(argv: Optional[Sequence[str]] = None):
    """Parse ``argv``, train, return the :class:`~megadlms.training.train.RunResult`.

    Uses the default process group when one exists (tests call this from spawned
    ranks); otherwise creates it from the environment and destroys it afterwards.
    """
    from megadlms.training.arguments import parse_config
    from megadlms.training.logging_utils import setup_logging
    from megadlms.training.train import pretrain

    owned = not dist.is_initialized()
    world = dist.get_world_size() if not owned else int(os.environ.get("WORLD_SIZE", "1"))
    config = parse_config(list(argv) if argv is not None else None, world_size=world)
    if owned:
        init_distributed(config.parallel)
    setup_logging(dist.get_rank())
    try:
        if config.checkpoint.ckpt_convert_format:  # Megatron: convert, then exit
            from megadlms.training.ckpt_convert import convert_checkpoint

            return convert_checkpoint(config)
        return pretrain(config)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry: exit status 0 on success, 2 with a one-line message on a bad flag."""
    try:
        run(argv if argv is not None else sys.argv[1:])
    except ValueError as exc:  # bad flags / data / checkpoint: the message names the fix
        from megadlms.training.arguments import flag_message

        if os.environ.get("RANK", "0") == "0":
            tb = exc.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            where = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
            # library errors name config fields; say them as the flags that set them
            print(f"pretrain_difflm.py: error: {flag_message(str(exc))} [raised at {where}]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
