"""Asynchronous checkpoint saves (--async-save): torch.distributed.checkpoint's ``async_save``.

The training loop pays only for staging (a CPU copy of the state made by DCP before it
returns); the files are written by a background thread that talks over its own gloo
process group (collectives on the training group from two threads would interleave).
When DCP's future resolves on rank 0 -- its coordinator, so every rank's data and the
``.metadata`` are on disk -- the same thread finishes the checkpoint exactly as a
synchronous save does (commit.py: manifest, common.json, rename into place, ``latest``).
A crash before that leaves the previous checkpoint and ``latest`` untouched.

The Checkpointer keeps at most one :class:`PendingSave`: the next save and the exit wait for it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Dict, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from .commit import finalize_checkpoint, save_error
from .paths import checkpoint_dir
from .views import ShardView, ViewSavePlanner


class PendingSave:
    """A checkpoint being written in the background; ``wait()`` returns its final path and
    re-raises a failure of the write (worded as the synchronous save would)."""

    def __init__(self, future: concurrent.futures.Future, root: str, iteration: int) -> None:
        self._future, self.root, self.iteration = future, root, iteration

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> str:
        try:
            self._future.result()
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reworded (disk full), re-raised
            raise save_error(exc, self.root, self.iteration) from exc
        return checkpoint_dir(self.root, self.iteration)


def start_async_save(
    tensors: Dict[str, Any], tmp: str, root: str, iteration: int, common: dict, group
) -> PendingSave:
    """Stage ``tensors`` (plain tensors, DTensors and format 4's :class:`ShardView` s) and write
    them to ``tmp`` in the background (collective over ``group``)."""
    # Views are staged here, piece by piece (only this rank's bytes); DCP stages (copies to CPU)
    # the rest before returning, so training may mutate the tensors right after.
    staged = {k: v.staged() if isinstance(v, ShardView) else v for k, v in tensors.items()}
    written: Any = dcp.async_save(
        staged,
        storage_writer=FileSystemWriter(tmp),
        planner=ViewSavePlanner(),
        process_group=group,
        no_dist=not dist.is_initialized(),
    )
    written = getattr(written, "upload_completion", written)  # AsyncSaveResponse with async stagers
    rank = dist.get_rank() if dist.is_initialized() else 0
    # A second future: DCP's resolves when the files are written, this one only after the commit
    # (manifest, rename, latest), which is what wait() must report.
    done: concurrent.futures.Future = concurrent.futures.Future()

    def finish() -> None:
        try:
            written.result()
            if rank == 0:  # DCP's coordinator: its future resolves after every rank's write
                finalize_checkpoint(root, iteration, common)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            done.set_exception(exc)
        else:
            done.set_result(None)

    # Daemon: a hung filesystem must not keep the process alive; the exit path calls wait() itself.
    threading.Thread(target=finish, name=f"megadlms-ckpt-{iteration}", daemon=True).start()
    return PendingSave(done, root, iteration)


def background_group(enabled: bool) -> Optional[object]:
    """The gloo group of all ranks for background saves (collective; None when not ``enabled``)."""
    if not enabled or not dist.is_initialized():
        return None
    # new_group is itself a collective: every rank must build it, in the same order as other groups.
    return dist.new_group(backend="gloo")
