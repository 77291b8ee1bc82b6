"""Model-parallel building blocks: process groups, TP/SP collectives, TP layers, the
vocab-parallel cross-entropy, the model-parallel RNG tracker and the shard rule
(docs/parallel.md)."""

from megadlms.parallel.cross_entropy import vocab_parallel_cross_entropy
from megadlms.parallel.groups import (
    Axis,
    ParallelGroups,
    check_instances,
    check_sizes,
    derived_rank_grid,
    rank_grid,
)
from megadlms.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    normal_init,
)
from megadlms.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_manual_seed
from megadlms.parallel.sharding import (
    REPLICATED,
    ParamSharding,
    counts_once,
    gather_full,
    local_from_full,
    set_sharding,
    shard_full,
    shard_spec,
    sharding_of,
)
from megadlms.parallel.tp_context import TensorParallelContext

__all__ = [
    "MODEL_PARALLEL_RNG",
    "REPLICATED",
    "ParamSharding",
    "Axis",
    "ColumnParallelLinear",
    "ParallelGroups",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TensorParallelContext",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "check_instances",
    "check_sizes",
    "counts_once",
    "derived_rank_grid",
    "gather_full",
    "local_from_full",
    "model_parallel_manual_seed",
    "normal_init",
    "shard_full",
    "shard_spec",
    "rank_grid",
    "set_sharding",
    "sharding_of",
    "vocab_parallel_cross_entropy",
]
