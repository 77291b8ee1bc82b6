"""The one object a training run talks to about checkpoints.

    ckpt = Checkpointer(config.checkpoint, ParallelLayout.of_run(groups, tp, vp))
    path = ckpt.find()                                  # --load, or resume from --save
    path, state = ckpt.load(path, model, optimizer, scheduler, model_config=...)
    kind = ckpt.due(iteration)                          # "persistent", "non_persistent" or None
    ckpt.save(iteration, model, optimizer, scheduler, consumed_samples=..., extra=..., records=...,
              non_persistent=kind == "non_persistent")
    ckpt.wait()                                         # the background save, if one is in flight

It is built once, from the :class:`CheckpointConfig` and the run's :class:`ParallelLayout`
(process groups, RNG tracker), so those are its state and not arguments of every call; what
changes per call is the iteration and the training counters. The model, optimizer and
scheduler are passed to load and save because they are built after the checkpoint to resume
from is known (its vocabulary sizes the model). The functions it calls (save.py, load.py,
read.py) stay public for tools that save or read without a training run.
"""

from __future__ import annotations

from typing import Optional, Tuple

from megadlms.config import CheckpointConfig

from .async_save import PendingSave, background_group
from .layout import SINGLE, ParallelLayout
from .load import TrainState, load_checkpoint
from .nonpersistent import check_local_storage, drop_older, non_persistent_root, save_kind
from .records import RunRecords
from .resume import from_pretrained, recorded_vocab, resume_path, with_fallback
from .save import save_checkpoint


class Checkpointer:
    """Find, load, save and wait for checkpoints of one run (collective calls: every rank
    calls each method, in the same order).

    ``config``: the run's :class:`CheckpointConfig` (where to save and load, the format,
    what to skip, --async-save, --ckpt-fallback). ``layout``: its model-parallel groups and
    RNG tracker. ``override_scheduler``: on load keep the LR schedule of the flags
    (--override-opt-param-scheduler). With --async-save a gloo group of all ranks is made
    here (a collective), for the background writes.
    """

    def __init__(
        self, config: CheckpointConfig, layout: ParallelLayout = SINGLE, *, override_scheduler: bool = False
    ) -> None:
        self.config, self.layout = config, layout
        self.override_scheduler = override_scheduler
        # Built here, once: creating a group is a collective and must not happen inside a save.
        check_local_storage(config)  # before the collective below: a refusal leaves no rank waiting
        self._group = background_group(config.async_save)
        self._pending: Optional[PendingSave] = None
        self._pending_np = False  # the save in flight is non-persistent: prune its root once committed

    def find(self) -> Optional[str]:
        """The checkpoint directory to resume from (--load, or --save when it holds one and
        --auto-resume), decided on rank 0 for every rank; None: start fresh."""
        return resume_path(self.config)

    def weights_only(self, path: Optional[str]) -> bool:
        """Whether loading ``path`` (what :meth:`find` chose) takes the weights only: --finetune,
        or the start of a run from --pretrained-checkpoint."""
        return self.config.finetune or from_pretrained(self.config, path)

    def due(self, iteration: int) -> Optional[str]:
        """The save iteration ``iteration`` is due for: PERSISTENT, NON_PERSISTENT or None."""
        return save_kind(self.config, iteration)

    @staticmethod
    def recorded_vocab(path: Optional[str]) -> Optional[int]:
        """The padded vocabulary size checkpoint ``path`` was trained with (None: no record)."""
        return recorded_vocab(path)

    def load(
        self, path: str, model, optimizer=None, scheduler=None, *, model_config: Optional[dict] = None
    ) -> Tuple[str, TrainState]:
        """Verify and restore ``path`` into the model, optimizer, scheduler and this rank's RNG
        (weights only with --finetune, a --pretrained-checkpoint start or --no-load-optim; RNG only
        at the same layout). With
        --ckpt-fallback a checkpoint that fails verification gives way to the newest older
        one that passes. Returns the directory actually loaded and where the run continues."""
        ck = self.config

        def load(p: str) -> TrainState:
            return load_checkpoint(
                p,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                restore_optimizer=not (self.weights_only(p) or ck.no_load_optim),
                load_rng=not (self.weights_only(p) or ck.no_load_rng),
                override_scheduler=self.override_scheduler,
                model_config=model_config,
                layout=self.layout,
            )

        return with_fallback(path, load, ck.ckpt_fallback)

    def save(
        self,
        iteration: int,
        model,
        optimizer=None,
        scheduler=None,
        *,
        consumed_samples: int = 0,
        extra: Optional[dict] = None,
        records: Optional[RunRecords] = None,
        non_persistent: bool = False,
    ) -> Optional[str]:
        """Write iteration ``iteration`` under --save, atomically (the optimizer unless
        --no-save-optim, RNG unless --no-save-rng). Waits for a background save still in
        flight first. Returns the checkpoint directory, or None with --async-save (the write
        goes on in the background: :meth:`wait` returns the directory). ``non_persistent``:
        under the non-persistent root instead, whose older checkpoints are deleted once
        this one is committed (nonpersistent.py)."""
        ck = self.config
        # Two saves never overlap: DCP's background thread and a new save would share the
        # gloo group, and the new latest must not be written before the older one.
        self.wait()
        root = non_persistent_root(ck, ck.save) if non_persistent else ck.save
        if root is None:
            raise ValueError("Checkpointer.save: no directory to save to: set --save (CheckpointConfig.save)")
        written = save_checkpoint(
            root,
            iteration,
            model=model,
            optimizer=None if ck.no_save_optim else optimizer,
            scheduler=scheduler,
            ckpt_format=ck.ckpt_format,
            consumed_samples=consumed_samples,
            extra=extra,
            records=records,
            save_rng=not ck.no_save_rng,
            async_group=self._group,
            layout=self.layout,
        )
        if isinstance(written, PendingSave):
            self._pending, self._pending_np = written, non_persistent
            return None
        if non_persistent:
            drop_older(root, iteration)
        return written

    def wait(self) -> Optional[str]:
        """Block until the background save in flight (if any) is complete and in place; its
        directory (None when nothing was in flight). Re-raises a failed write."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        written = pending.wait()
        if self._pending_np:
            drop_older(pending.root, pending.iteration)
        return written
