"""megadlms.training: the pretraining loop (trainer, one step, pipeline runner, validation,
logging). The flags and the typed RunConfig they become are megadlms.config.

    from megadlms.pretrain import run                 # parse flags + init + train
    from megadlms.training import pretrain, RunResult  # train from a RunConfig

Checkpoints are megadlms.checkpoint (``Checkpointer``, ``save_checkpoint``, ``load_model_state``).
The only layer that joins models, diffusion, data and the data-parallel wrappers.
"""

from .step import train_step
from .train import RunResult, evaluate, pretrain

__all__ = ["RunResult", "evaluate", "pretrain", "train_step"]
