"""Where a run starts from: --load, automatic resume from --save, verified loading with the
optional fallback to an older checkpoint (docs/reliability.md). The loading itself is
``checkpointing.load_checkpoint``, one call for weights, optimizer, schedule and RNG."""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch.distributed as dist

from . import checkpointing
from .config import CheckpointConfig, RunConfig

_log = logging.getLogger("megadlms.training")


def resume_path(ck: CheckpointConfig) -> Optional[str]:
    """--load, or (automatic resume) --save when it holds a checkpoint and --load is absent.

    Decided on rank 0 and broadcast (a collective when a process group exists): every rank
    takes the same decision even when the others would see the file system differently (a
    ``latest`` file rank 0 just replaced, a shared file system's lag). An error (e.g. a
    ``latest`` file naming a missing iteration) is raised on every rank."""
    found, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            found = _find(ck)
        except (OSError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [found, error]
        dist.broadcast_object_list(shared, src=0)
        found, error = shared
    if error is not None:
        raise RuntimeError(f"finding the checkpoint to resume from (decided on rank 0): {error}")
    return found


def _find(ck: CheckpointConfig) -> Optional[str]:
    if ck.load:
        path = checkpointing.resolve_checkpoint(ck.load)
        if path is None:
            _log.warning(
                f"no checkpoint in --load {ck.load} (no {checkpointing.LATEST_FILE}); training from scratch"
            )
        return path
    if ck.save and ck.auto_resume:
        path = checkpointing.resolve_checkpoint(ck.save)
        if path is not None:
            _log.info(f"resuming from --save {ck.save} (no --load given; --no-auto-resume starts fresh)")
        return path
    return None


def checkpoint_vocab(path: Optional[str]) -> Optional[int]:
    """The padded vocabulary recorded by checkpoint ``path`` (None without one)."""
    if path is None:
        return None
    try:
        return checkpointing.read_common(path).get("model_config", {}).get("vocab_size")
    except (OSError, ValueError):  # unreadable: the verified load below reports it
        return None


def _load(
    path: str, config: RunConfig, model, optimizer, scheduler, tp, pp_group=None
) -> checkpointing.TrainState:
    ck = config.checkpoint
    return checkpointing.load_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        restore_optimizer=not (ck.finetune or ck.no_load_optim),
        load_rng=not (ck.finetune or ck.no_load_rng),
        override_scheduler=config.schedule.override_opt_param_scheduler,
        model_config=config.model.to_dict(),
        tp_group=None if tp is None else tp.group,
        rng_tracker=None if tp is None else tp.rng_tracker,
        ep_group=None if tp is None else tp.expert_group,
        pp_group=pp_group,
    )


def load_verified(
    path: str, config: RunConfig, model, optimizer, scheduler, *, tp=None, pp_group=None
) -> Tuple[str, checkpointing.TrainState]:
    """Load ``path``; with --ckpt-fallback a checkpoint that fails verification gives way to
    the newest older one that passes (every rank takes the same decision: the verdict is shared).
    ``tp``: the model's TensorParallelContext (its group and RNG tracker); ``pp_group``: the
    pipeline-parallel group (None without PP)."""
    try:
        return path, _load(path, config, model, optimizer, scheduler, tp, pp_group)
    except checkpointing.CheckpointCorruptError as exc:
        if not config.checkpoint.ckpt_fallback:
            raise
        root, it = os.path.dirname(path), int(checkpointing.read_common(path)["iteration"])
        for older in checkpointing.older_checkpoints(root, it):
            _log.warning(f"{exc}\n--ckpt-fallback: trying {older}")
            try:
                return older, _load(older, config, model, optimizer, scheduler, tp, pp_group)
            except checkpointing.CheckpointCorruptError as again:
                exc = again
        raise checkpointing.CheckpointCorruptError(
            f"{exc} (--ckpt-fallback: no older complete checkpoint in {root} verifies)"
        ) from exc
