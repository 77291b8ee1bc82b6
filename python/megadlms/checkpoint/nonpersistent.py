"""Megatron's non-persistent checkpoints: frequent saves of which only the newest is kept.

A non-persistent checkpoint is an ordinary checkpoint (same files, same atomic commit,
its own ``latest_checkpointed_iteration.txt``) written under a separate root:

    --non-persistent-ckpt-type global   --non-persistent-global-ckpt-dir, default <save>/non_persistent
                                        (on load: <load>/non_persistent, as Megatron)
    --non-persistent-ckpt-type local    --non-persistent-local-ckpt-dir (node-local storage; every rank
                                        must see it, so single-node runs only)

Megatron deletes the older non-persistent checkpoints *before* writing the new one; here
they are deleted only once the new one is committed, so a crash during a save always
leaves the previous non-persistent checkpoint loadable. The persistent ``--save`` root and
its ``latest`` file are never touched by a non-persistent save.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

import torch.distributed as dist

from megadlms.common.enums import NonPersistentCkptType

from .paths import LATEST_FILE, read_latest_iteration

_log = logging.getLogger("megadlms.checkpoint")

SUBDIR = "non_persistent"
PERSISTENT, NON_PERSISTENT = "persistent", "non_persistent"


def non_persistent_root(ck, base: Optional[str]) -> Optional[str]:
    """Root of ``ck``'s non-persistent checkpoints (``base``: --save when saving, the root being
    resumed from when loading); None when --non-persistent-ckpt-type is not given."""
    kind = ck.non_persistent_ckpt_type
    if kind == NonPersistentCkptType.LOCAL:
        return ck.non_persistent_local_ckpt_dir
    if kind == NonPersistentCkptType.GLOBAL:
        if ck.non_persistent_global_ckpt_dir:
            return ck.non_persistent_global_ckpt_dir
        return os.path.join(base, SUBDIR) if base else None
    return None


def save_kind(ck, iteration: int) -> Optional[str]:
    """Which save iteration ``iteration`` is due for: PERSISTENT (--save-interval or
    --checkpoint-steps; it wins over a non-persistent one at the same iteration, as in
    Megatron), NON_PERSISTENT (--non-persistent-save-interval) or None."""
    if not ck.save:
        return None
    if iteration % ck.save_interval == 0 or iteration in ck.checkpoint_steps:
        return PERSISTENT
    interval = ck.non_persistent_save_interval
    if interval and ck.non_persistent_ckpt_type and iteration % interval == 0:
        return NON_PERSISTENT
    return None


def check_local_storage(ck) -> None:
    """``local`` checkpoints live on one node's storage: refuse a world spanning nodes (the
    ranks of other nodes could neither write the shared commit nor read it back)."""
    if ck.non_persistent_ckpt_type != NonPersistentCkptType.LOCAL:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local != world:
        # Same verdict on every rank (the environment is), so no rank waits for another.
        raise ValueError(
            f"--non-persistent-ckpt-type local: this run spans nodes ({world} ranks, {local} per node) and "
            "local checkpoints here need every rank on one node: use --non-persistent-ckpt-type global"
        )


def drop_older(root: str, keep: int) -> None:
    """Rank 0: delete every ``iter_*`` entry of ``root`` but iteration ``keep`` (which its
    ``latest`` names: called only after that checkpoint is committed). Best effort: a failed
    delete is a warning, the next non-persistent save tries again."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if read_latest_iteration(root) != keep:  # never delete around a latest file that moved elsewhere
        _log.warning(
            f"non-persistent cleanup skipped: {os.path.join(root, LATEST_FILE)} does not name {keep}"
        )
        return
    kept = f"iter_{keep:07d}"
    for name in sorted(os.listdir(root)):
        # Older complete ones, and torn iter_*.tmp / .old.* directories of crashed saves.
        if name.startswith("iter_") and name != kept:
            try:
                shutil.rmtree(os.path.join(root, name))
            except OSError as exc:
                _log.warning(f"could not delete old non-persistent checkpoint {name} in {root}: {exc}")
