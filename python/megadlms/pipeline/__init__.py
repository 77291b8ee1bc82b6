"""megadlms.pipeline: pipeline parallelism — the stage split, tied embeddings across stages,
point-to-point activation exchange and the schedules: 1F1B, interleaved 1F1B and the
one-stage schedule of a run without pipeline (``get_forward_backward_func``).

    from megadlms.models import GPTModel, PipelineChunk
    from megadlms.pipeline import stage_layers, model_chunks, forward_backward_pipelining
    ranges = stage_layers(num_layers, pp, vp=vp)[pp_rank]     # this rank's chunks' layers
    chunks = [GPTModel(cfg, tp=tp, pipeline=c) for c in model_chunks(ranges, pp_rank, pp, num_layers)]
    losses = forward_backward_pipelining(chunks, micro_batches, forward_step, pp_group=groups.pp)
"""

from megadlms.models.chunk import PipelineChunk

from .embedding import (
    allreduce_embedding_grads,
    build_embedding_group,
    embedding_grad_params,
    embedding_group_ranks,
    tied_embedding_params,
)
from .p2p import PipelineP2P
from .schedules import (
    check_micro_batches,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    get_forward_backward_func,
    micro_batch_problems,
    stages_in_lockstep,
)
from .split import model_chunks, stage_layers, virtual_pipeline_size

__all__ = [
    "PipelineChunk",
    "stage_layers",
    "model_chunks",
    "virtual_pipeline_size",
    "embedding_group_ranks",
    "build_embedding_group",
    "embedding_grad_params",
    "allreduce_embedding_grads",
    "PipelineP2P",
    "check_micro_batches",
    "micro_batch_problems",
    "forward_backward_pipelining",
    "forward_backward_no_pipelining",
    "get_forward_backward_func",
    "stages_in_lockstep",
    "tied_embedding_params",
]
