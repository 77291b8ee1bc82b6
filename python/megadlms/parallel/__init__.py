"""Model-parallel building blocks: process groups, TP/SP collectives, TP layers, the
vocab-parallel cross-entropy and the model-parallel RNG tracker (docs/parallel.md).

Not yet used by the models, DDP, the optimizer or the CLI."""

from megadlms.parallel.cross_entropy import vocab_parallel_cross_entropy
from megadlms.parallel.groups import Axis, ParallelGroups, check_sizes, rank_grid
from megadlms.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    normal_init,
)
from megadlms.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_manual_seed

__all__ = [
    "MODEL_PARALLEL_RNG",
    "Axis",
    "ColumnParallelLinear",
    "ParallelGroups",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "check_sizes",
    "model_parallel_manual_seed",
    "normal_init",
    "rank_grid",
    "vocab_parallel_cross_entropy",
]
