"""Where a run starts from: --load, automatic resume from --save (docs/reliability.md), and
the newest older checkpoint that verifies when --ckpt-fallback is given. Used by the
Checkpointer's ``find`` and ``load``."""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Tuple, TypeVar

import torch.distributed as dist

from .integrity import CheckpointCorruptError
from .paths import LATEST_FILE, older_checkpoints, read_common, resolve_checkpoint

_log = logging.getLogger("megadlms.checkpoint")
T = TypeVar("T")


def _find(load: Optional[str], save: Optional[str], auto_resume: bool) -> Optional[str]:
    if load:
        path = resolve_checkpoint(load)
        if path is None:
            _log.warning(f"no checkpoint in --load {load} (no {LATEST_FILE}); training from scratch")
        return path
    if save and auto_resume:
        path = resolve_checkpoint(save)
        if path is not None:
            _log.info(f"resuming from --save {save} (no --load given; --no-auto-resume starts fresh)")
        return path
    return None


def resume_path(load: Optional[str], save: Optional[str], auto_resume: bool) -> Optional[str]:
    """--load, or (automatic resume) --save when it holds a checkpoint and --load is absent.

    Decided on rank 0 and broadcast (a collective when a process group exists): every rank
    takes the same decision even when the others would see the file system differently (a
    ``latest`` file rank 0 just replaced, a shared file system's lag). An error (e.g. a
    ``latest`` file naming a missing iteration) is raised on every rank."""
    found, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            found = _find(load, save, auto_resume)
        except (OSError, RuntimeError) as exc:
            # A string, not the exception: it must pickle for broadcast_object_list.
            error = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [found, error]
        # The error travels too: every rank raises, none waits in the next collective.
        dist.broadcast_object_list(shared, src=0)
        found, error = shared
    if error is not None:
        raise RuntimeError(f"finding the checkpoint to resume from (decided on rank 0): {error}")
    return found


def recorded_vocab(path: Optional[str]) -> Optional[int]:
    """The padded vocabulary recorded by checkpoint ``path`` (None without one)."""
    if path is None:
        return None
    try:
        return read_common(path).get("model_config", {}).get("vocab_size")
    except (OSError, ValueError):  # unreadable: the verified load reports it
        return None


def with_fallback(path: str, load: Callable[[str], T], fallback: bool) -> Tuple[str, T]:
    """``(path, load(path))``; with ``fallback`` a checkpoint that fails verification gives way
    to the newest older one that passes (every rank takes the same decision: the verdict of
    ``verify_checkpoint`` is shared)."""
    try:
        return path, load(path)
    except CheckpointCorruptError as exc:
        if not fallback:
            raise
        # A corrupt checkpoint's common.json is still readable: it is written last and atomically.
        root, it = os.path.dirname(path), int(read_common(path)["iteration"])
        for older in older_checkpoints(root, it):
            _log.warning(f"{exc}\n--ckpt-fallback: trying {older}")
            try:
                return older, load(older)
            except CheckpointCorruptError as again:
                exc = again
        raise CheckpointCorruptError(
            f"{exc} (--ckpt-fallback: no older complete checkpoint in {root} verifies)"
        ) from exc
