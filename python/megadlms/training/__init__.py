"""megadlms.training: the pretraining loop, checkpoints, logging and the flag parser.

    from megadlms.pretrain import run                 # parse flags + init + train
    from megadlms.training import pretrain, RunResult  # train from parsed args
    from megadlms.training import save_checkpoint, load_model_state, load_optimizer_state

The only layer that joins models, diffusion, data and the data-parallel wrappers.
"""

from .checkpointing import (
    load_model_state,
    load_optimizer_state,
    load_rng_state,
    read_latest_iteration,
    resolve_checkpoint,
    save_checkpoint,
)
from .train import RunResult, evaluate, pretrain, train_step

__all__ = [
    "RunResult",
    "evaluate",
    "pretrain",
    "train_step",
    "save_checkpoint",
    "load_model_state",
    "load_optimizer_state",
    "load_rng_state",
    "read_latest_iteration",
    "resolve_checkpoint",
]
