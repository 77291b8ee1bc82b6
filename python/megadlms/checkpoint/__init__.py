"""megadlms.checkpoint: checkpoints that reshard across wrappers and tp / pp / ep / dp layouts.

    from megadlms.checkpoint import Checkpointer, ParallelLayout   # a training run
    from megadlms.checkpoint import open_checkpoint, load_model_state, tensor_shapes, read_tensors
    from megadlms.checkpoint import save_checkpoint                # tools that write one

Files and format: docs/checkpoints.md; faults handled: docs/reliability.md.
"""

from .async_save import PendingSave
from .checkpointer import Checkpointer
from .integrity import CheckpointCorruptError, verify_checkpoint
from .layout import SINGLE, ParallelLayout
from .load import TrainState, load_checkpoint, load_optimizer_state, load_rng_state
from .paths import (
    COMMON_FILE,
    LATEST_FILE,
    TORCH_FILE,
    checkpoint_dir,
    older_checkpoints,
    read_common,
    read_latest_iteration,
    resolve_checkpoint,
)
from .read import load_model_state, open_checkpoint, read_tensors, tensor_shapes
from .records import MODEL_CONFIG_FLAGS, RunRecords, check_model_config, tokenizer_record
from .resume import checkpoint_record
from .save import CKPT_FORMATS, FORMAT_VERSION, save_checkpoint  # CKPT_FORMATS: config's, re-exported

__all__ = [
    "CKPT_FORMATS",
    "COMMON_FILE",
    "FORMAT_VERSION",
    "LATEST_FILE",
    "MODEL_CONFIG_FLAGS",
    "SINGLE",
    "TORCH_FILE",
    "CheckpointCorruptError",
    "Checkpointer",
    "ParallelLayout",
    "PendingSave",
    "RunRecords",
    "TrainState",
    "check_model_config",
    "checkpoint_record",
    "checkpoint_dir",
    "load_checkpoint",
    "load_model_state",
    "load_optimizer_state",
    "load_rng_state",
    "older_checkpoints",
    "open_checkpoint",
    "read_common",
    "read_latest_iteration",
    "read_tensors",
    "resolve_checkpoint",
    "save_checkpoint",
    "tensor_shapes",
    "tokenizer_record",
    "verify_checkpoint",
]
