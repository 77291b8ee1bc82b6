"""Where a run starts from: --load (or --ckpt-step's iteration of it), automatic resume from
--save (docs/reliability.md), a newer non-persistent checkpoint (nonpersistent.py), and the
newest older checkpoint that verifies when --ckpt-fallback is given. Used by the
Checkpointer's ``find`` and ``load``."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch.distributed as dist

from .integrity import CheckpointCorruptError
from .nonpersistent import non_persistent_root
from .paths import (
    COMMON_FILE,
    LATEST_FILE,
    checkpoint_dir,
    older_checkpoints,
    read_common,
    resolve_checkpoint,
)

_log = logging.getLogger("megadlms.checkpoint")
T = TypeVar("T")


def _persistent(
    load: Optional[str], save: Optional[str], auto_resume: bool
) -> Tuple[Optional[str], Optional[str]]:
    """(root resumed from, its latest checkpoint): --load, or --save when resuming automatically."""
    if load:
        return load, resolve_checkpoint(load)
    if save and auto_resume:
        path = resolve_checkpoint(save)
        if path is not None:
            _log.info(f"resuming from --save {save} (no --load given; --no-auto-resume starts fresh)")
        return save, path
    return None, None


def _iteration(path: Optional[str]) -> int:
    return -1 if path is None else int(read_common(path)["iteration"])


def _step(ck, np_root: Optional[str]) -> str:
    """--ckpt-step N: iteration N of --load (or of the non-persistent root when only it has N)."""
    n = ck.ckpt_step
    for root in (ck.load, np_root):
        if root and os.path.isfile(os.path.join(checkpoint_dir(root, n), COMMON_FILE)):
            return checkpoint_dir(root, n)
    have = sorted(int(os.path.basename(p)[5:]) for p in older_checkpoints(ck.load, 1 << 62))
    raise ValueError(
        f"--ckpt-step {n}: no complete checkpoint {os.path.basename(checkpoint_dir(ck.load, n))} in "
        f"--load {ck.load} (complete iterations there: {have or 'none'}); pass one of those"
    )


def _find(ck) -> Optional[str]:
    """Megatron's choice: --ckpt-step's iteration when given, else the newer of the persistent
    latest and the non-persistent latest (the non-persistent one wins a tie)."""
    if ck.ckpt_step is not None:  # before reading latest: a damaged latest must not hide iteration N
        return _step(ck, non_persistent_root(ck, ck.load))
    root, path = _persistent(ck.load, ck.save, ck.auto_resume)
    np_root = non_persistent_root(ck, root)
    np_path = resolve_checkpoint(np_root) if np_root and os.path.isdir(np_root) else None
    if np_path is not None and _iteration(np_path) >= _iteration(path):
        # Megatron's rule: the non-persistent checkpoint wins a tie with the persistent one.
        _log.info(f"resuming from the non-persistent checkpoint {np_path} (persistent: {path or 'none'})")
        return np_path
    if np_path is not None:
        _log.warning(f"the non-persistent checkpoint {np_path} is older than the persistent {path}")
    if path is None and ck.pretrained_checkpoint:
        # Megatron's --pretrained-checkpoint: the start of a fine-tuning run (weights only, see
        # from_pretrained); once the run has saved, its own checkpoints win above.
        pretrained = resolve_checkpoint(ck.pretrained_checkpoint)
        if pretrained is None:
            raise ValueError(
                f"--pretrained-checkpoint {ck.pretrained_checkpoint}: no checkpoint there (no "
                f"{LATEST_FILE} nor an iter_* directory); pass a --save directory of a finished run"
            )
        return pretrained
    if path is None and ck.load:
        _log.warning(f"no checkpoint in --load {ck.load} (no {LATEST_FILE}); training from scratch")
    return path


def from_pretrained(ck, path: Optional[str]) -> bool:
    """Whether ``path`` (what :func:`resume_path` chose) is --pretrained-checkpoint's, which loads
    as --finetune does: weights only."""
    if path is None or not ck.pretrained_checkpoint:
        return False
    root = os.path.abspath(ck.pretrained_checkpoint)
    return os.path.commonpath([root, os.path.abspath(path)]) == root


def resume_path(ck) -> Optional[str]:
    """The checkpoint a run with CheckpointConfig ``ck`` starts from (None: from scratch):
    --ckpt-step's iteration of --load, else the newest of --load's (or, resuming
    automatically, --save's) latest and the non-persistent latest.

    Decided on rank 0 and broadcast (a collective when a process group exists): every rank
    takes the same decision even when the others would see the file system differently (a
    ``latest`` file rank 0 just replaced, a shared file system's lag). An error (e.g. a
    ``latest`` file naming a missing iteration) is raised on every rank."""
    found, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            found = _find(ck)
        except (OSError, RuntimeError, ValueError) as exc:
            # A string, not the exception: it must pickle for broadcast_object_list.
            error = (isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared: List[Any] = [found, error]
        # The error travels too: every rank raises, none waits in the next collective.
        dist.broadcast_object_list(shared, src=0)
        found, error = shared
    if error is not None:
        user_error, text = error
        if user_error:  # a bad flag value: one line naming it, on every rank
            raise ValueError(text.split(": ", 1)[1])
        raise RuntimeError(f"finding the checkpoint to resume from (decided on rank 0): {text}")
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


def checkpoint_record(ck) -> Optional[Tuple[str, dict]]:
    """(directory, common.json) of the checkpoint a run with CheckpointConfig ``ck`` would
    load, or None: what --use-checkpoint-args reads (config/checkpoint_args.py). Called
    before any process group exists, on every rank (each reads the same small file)."""
    path = resume_path(ck)
    return None if path is None else (path, read_common(path))
