"""Failures of the training step's collectives, named (docs/reliability.md, "No hangs").

A peer that died fails a gloo/NCCL collective at once; a peer that stopped responding fails
it after the collective timeout (--distributed-timeout-minutes, or
$MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS). Either way the error says which collective of the
step it was, on which rank and iteration.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective of the training step failed or timed out (a peer died or stopped responding)."""


# Message signs as a fallback: older torch and gloo raise plain RuntimeErrors when a peer fails.
_COMM_SIGNS = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe", "NCCL")


def is_comm_error(exc: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", ())
    return isinstance(exc, dist_error) or any(sign in str(exc) for sign in _COMM_SIGNS)


@contextlib.contextmanager
def named_collective(name: str, iteration: int, always: bool = True):
    """Name the collective when it fails: a timeout here means a peer rank stopped responding
    (or died) and is reported on every live rank within the collective timeout."""
    try:
        yield
    except RuntimeError as exc:
        # Already named by an inner block, or (always=False) not a communication error: keep it as it is.
        if isinstance(exc, CollectiveError) or not (always or is_comm_error(exc)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"iteration {iteration + 1}: rank {rank}: collective '{name}' failed: {exc} -- a peer rank "
            "died or stopped responding for longer than the collective timeout "
            "(--distributed-timeout-minutes, or $MEGADLMS_DISTRIBUTED_TIMEOUT_SECONDS); stopping this rank"
        ) from exc
