"""The parameters one rank holds, without building them: names, local shapes, dtypes.

The model is built once per pipeline chunk on the ``meta`` device at tensor-parallel size 1
(no memory, no process group), exactly as the trainer builds it (``GPTModel`` with the
chunk's :class:`~megadlms.models.PipelineChunk`), and each parameter's declared
:class:`~megadlms.parallel.sharding.ParamSharding` then gives its local shape at any layout:
``shape[tp_dim] / tp`` for tensor-parallel parameters, ``shape[expert_dim] / ep`` for experts.
So the planner reads the same description the checkpoints and norms read, never a second
list of the model's tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from megadlms.config import RunConfig
from megadlms.models import GPTModel, TransformerConfig
from megadlms.models.chunk import PipelineChunk
from megadlms.parallel.sharding import sharding_of
from megadlms.training.pipeline_run import chunk_layout  # the trainer's own layout

__all__ = ["PlannedParam", "chunk_layout", "rank_parameters"]


@dataclass(frozen=True)
class PlannedParam:
    """One parameter as this rank holds it (registration order within its chunk)."""

    name: str
    shape: Tuple[int, ...]  # the local shape on this rank (TP / EP split applied)
    expert: bool  # reduced over the expert-data-parallel group (its own DDP buffers)
    chunk: int  # the virtual pipeline chunk it belongs to

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# A sweep asks for the same chunk many times; keyed by the config's repr (TransformerConfig is
# a mutable dataclass, so not hashable) and the chunk.
_CACHE: Dict[Tuple[str, PipelineChunk], tuple] = {}


def _full_parameters(model: TransformerConfig, chunk: PipelineChunk) -> tuple:
    """(name, full shape, ParamSharding) of one chunk's parameters, from a meta-device build."""
    key = (repr(model), chunk)
    if key not in _CACHE:
        with torch.device("meta"):
            gpt = GPTModel(model, pipeline=chunk)
        _CACHE[key] = tuple(
            (n, tuple(p.shape), sharding_of(p)) for n, p in gpt.named_parameters() if p.requires_grad
        )
    return _CACHE[key]


def rank_parameters(config: RunConfig, *, pp_rank: int = 0) -> List[List[PlannedParam]]:
    """Per chunk of pipeline rank ``pp_rank``: the parameters one (tp, ep) rank holds. Every TP
    and EP rank holds the same shapes (the sizes divide: the config rules checked it)."""
    tp = config.parallel.tensor_model_parallel_size
    ep = config.parallel.expert_model_parallel_size
    out = []
    for c, chunk in enumerate(chunk_layout(config, pp_rank)):
        params = []
        for name, shape, sharding in _full_parameters(config.model, chunk):
            local = list(shape)
            if sharding.tp_dim is not None:
                local[sharding.tp_dim] //= tp
            if sharding.expert_dim is not None:
                local[sharding.expert_dim] //= ep
            params.append(PlannedParam(name, tuple(local), sharding.expert_dim is not None, c))
        out.append(params)
    return out
