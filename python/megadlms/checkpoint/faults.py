"""How a failed save is shared: every rank learns that some rank failed before anyone waits
on the next collective, and a full disk is recognised inside DCP's wrapped failures."""

from __future__ import annotations

import errno
from typing import List, Optional, Set

import torch.distributed as dist


def agree(error: Optional[BaseException], what: str) -> None:
    """Every rank learns whether any rank failed ``what``; all raise (no rank left blocked)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    gathered: list = [None] * dist.get_world_size()
    # Every rank joins even without an error: the failing rank's peers must not block elsewhere.
    dist.all_gather_object(gathered, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if failed:
        raise RuntimeError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")


def find_enospc(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC OSError inside ``exc`` (its cause chain or DCP's per-rank failures), if any."""
    seen: Set[int] = set()
    todo: List[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # dcp CheckpointException: rank -> (exc, traceback)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None
