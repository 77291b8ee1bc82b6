"""megadlms.training: the pretraining loop (trainer, one step, pipeline runner, validation,
logging) and, for now, the flag parser and typed configs.

    from megadlms.pretrain import run                 # parse flags + init + train
    from megadlms.training import pretrain, RunResult  # train from parsed args

Checkpoints are megadlms.checkpoint (``Checkpointer``, ``save_checkpoint``, ``load_model_state``).
The only layer that joins models, diffusion, data and the data-parallel wrappers.
"""

from .train import RunResult, evaluate, pretrain, train_step

__all__ = ["RunResult", "evaluate", "pretrain", "train_step"]
