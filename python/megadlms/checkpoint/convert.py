"""Megatron's ``--ckpt-convert-format torch|torch_dist --ckpt-convert-save DIR``: rewrite
the ``--load`` checkpoint in the other format and exit (the iteration a run would load:
``--ckpt-step N``'s, else the latest; MegaDLMs' convert_ckpt mode passes ``--ckpt-step``).

As in Megatron the result goes to ``DIR/<format>/`` (a --save root with its own
``latest_checkpointed_iteration.txt``). Every tensor is carried over (model, and the
optimizer state unless --no-load-optim or --no-save-optim), with common.json's records
(iteration, consumed samples, model config, tokenizer, scheduler, args); RNG states are
not (as MegaDLMs' conversion passes --no-save-rng), so a resume from the converted
checkpoint restores everything but dropout's RNG. The same format is allowed: converting an
older torch_dist checkpoint (format 3, one full chunk per key) to torch_dist writes the current
format (4: save.py's ``FORMAT_VERSION``), so this is also the v3 -> v4 converter (v3 stays
loadable as it is: DCP maps any stored chunking onto the views of a load). This is the first
step of MegaDLMs' ckpt_conversion.sh; its second step (megatron_to_hf) is ``megadlms-export-hf``, which
reads either format directly.
"""

from __future__ import annotations

import logging
import os

import torch

from .format import join_state
from .read import MODEL_PREFIX, open_checkpoint, read_tensors, tensor_shapes
from .records import RunRecords
from .resume import resume_path
from .save import save_checkpoint

_log = logging.getLogger("megadlms.checkpoint")


class ConvertedCheckpoint:
    """A state_dict() holder standing in for the model / optimizer / scheduler at save."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


def convert_checkpoint(config) -> str:
    """Convert ``config.checkpoint.load``; returns the written iteration directory."""
    ck = config.checkpoint
    # What a run would load (Megatron): --ckpt-step's iteration, else the newest checkpoint.
    found = resume_path(ck)
    src, common = open_checkpoint(found or ck.load, "--ckpt-convert-format: --load")
    shapes = tensor_shapes(src, common)
    with_optim = common.get("optimizer") is not None and not (ck.no_load_optim or ck.no_save_optim)
    keep = {
        k: v
        for k, v in shapes.items()
        if k.startswith(MODEL_PREFIX) or (with_optim and k.startswith("optimizer/"))
    }
    # Full tensors as stored: the converted checkpoint is written from one layout (no groups).
    template = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in keep.items()}
    read_tensors(src, common, template)
    model = ConvertedCheckpoint(
        {k[len(MODEL_PREFIX) :]: v for k, v in template.items() if k.startswith(MODEL_PREFIX)}
    )
    optimizer = ConvertedCheckpoint(join_state(common["optimizer"], template)) if with_optim else None
    scheduler = ConvertedCheckpoint(common["scheduler"]) if common.get("scheduler") is not None else None
    root = os.path.join(ck.ckpt_convert_save, ck.ckpt_convert_format)
    out = save_checkpoint(
        root,
        int(common["iteration"]),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        ckpt_format=ck.ckpt_convert_format,
        consumed_samples=int(common.get("consumed_samples", 0)),
        records=RunRecords(common.get("args"), common.get("model_config"), common.get("tokenizer")),
        extra={
            **common.get("extra", {}),
            "converted_from": os.path.abspath(src),
            "converted_from_wrapper": common.get("wrapper"),
        },
        # RNG states belong to the saving layout; a conversion has none to carry over.
        save_rng=False,
    )
    assert isinstance(out, str)  # a save without async_group is written when it returns
    _log.info(f"converted {src} ({common['ckpt_format']}) -> {out} ({ck.ckpt_convert_format}); exiting")
    return out
