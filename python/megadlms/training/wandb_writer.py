"""The Weights & Biases sink (Megatron's ``global_vars._set_wandb_writer``): one run, opened on
the last rank from the --wandb-* flags, logged with the TensorBoard tag names at the iteration.

``WANDB_MODE=offline`` (or --wandb-mode offline) writes the run under the save dir without a
network; ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import os
from typing import Optional


class WandbWriter:
    """``wandb.init`` with Megatron's arguments; ``log`` / ``finish`` as Megatron's writer."""

    def __init__(self, cfg, *, save_dir: Optional[str], run_record: dict) -> None:
        try:
            import wandb
        except ImportError as exc:  # the parse-time rule says this first; kept for library callers
            raise ValueError(
                f"--wandb-project {cfg.wandb_project} needs the wandb package: pip install 'megadlms[wandb]'"
            ) from exc
        # Megatron: --wandb-save-dir, else <--save>/wandb
        directory = cfg.wandb_save_dir or os.path.join(save_dir or ".", "wandb")
        os.makedirs(directory, exist_ok=True)
        self._wandb = wandb
        self.run = wandb.init(
            dir=directory,
            name=cfg.wandb_exp_name,
            id=cfg.wandb_run_id,
            project=cfg.wandb_project,
            config=run_record,
            # Megatron's default policy is "auto"; None lets $WANDB_MODE decide the mode.
            resume=cfg.wandb_resume or "auto",
            resume_from=cfg.wandb_resume_from,
            tags=cfg.wandb_tags.split(",") if cfg.wandb_tags else None,
            group=cfg.wandb_group,
            notes=cfg.wandb_notes,
            mode=cfg.wandb_mode,
            settings=wandb.Settings(init_timeout=600),
        )

    def log(self, values: dict, step: int) -> None:
        if values:
            self.run.log(dict(values), step=step)

    def finish(self) -> None:
        self.run.finish()
        # stop the W&B service now: a long-lived process (a worker pool) would meet it at exit
        self._wandb.teardown()
