"""How a written checkpoint becomes the current one, atomically, and how a failed save is
worded. Shared by the synchronous save (save.py) and the background one (async_save.py).

Everything is written into ``iter_XXXXXXX.tmp`` first; :func:`finalize_checkpoint` (rank 0,
once every rank's files are on disk) records each file's size and CRC-32, writes common.json
last, renames the directory into place and only then replaces ``latest``. A crash or a full
disk at any point leaves the previous checkpoint and ``latest`` intact.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

from .faults import find_enospc
from .integrity import file_manifest
from .paths import COMMON_FILE, LATEST_FILE, checkpoint_dir, read_latest_iteration


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems do not support directory fsync
        pass


def write_atomic(path: str, data: str) -> None:
    """Replace ``path`` by ``data``: readers see the old or the new file, never a torn one."""
    # Per-process temp name: two processes replacing the same file never write into one temp.
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(data)
        f.flush()
        # Data on disk before the rename: otherwise a crash can leave the new name pointing at empty blocks.
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename lives in the directory entry, which needs its own fsync to survive a power loss.
    fsync_dir(os.path.dirname(path) or ".")


def save_error(exc: BaseException, root: str, iteration: int) -> BaseException:
    """A save failure worded for the user: disk full names the directory and what is intact."""
    full = find_enospc(exc)
    if full is None:
        return exc
    # What latest names now is what a restart would load: that is what to report as intact.
    previous = read_latest_iteration(root) if os.path.isdir(root) else None
    intact = (
        f"the previous checkpoint {checkpoint_dir(root, previous)} and {LATEST_FILE} are untouched"
        if previous is not None
        else f"no earlier checkpoint exists; {LATEST_FILE} was not written"
    )
    err = OSError(
        errno.ENOSPC,
        f"saving checkpoint iteration {iteration} to {root} failed: no space left on device "
        f"({full.filename or full}); {intact}. Free space on that filesystem or point --save elsewhere",
    )
    err.__cause__ = exc
    return err


def finalize_checkpoint(root: str, iteration: int, common: dict) -> str:
    """Rank 0, once every file of ``iter_XXXXXXX.tmp`` is written: record each file's size and
    checksum, write common.json, rename the directory into place, then replace ``latest``."""
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    # The manifest must see every rank's finished files, which is why only rank 0 runs this, last.
    common = dict(common, files=file_manifest(tmp))
    # common.json is the completeness marker (resolve_checkpoint looks for it), so it goes in last.
    write_atomic(os.path.join(tmp, COMMON_FILE), json.dumps(common, indent=1, default=str))
    if os.path.exists(final):  # re-saving the same iteration: swap, then drop the old one
        old = f"{final}.old.{os.getpid()}"
        # A directory cannot be replaced over a non-empty one: move the old aside first, drop it after.
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)  # the rename is durable before latest names it
    write_atomic(os.path.join(root, LATEST_FILE), str(iteration))
    return final
