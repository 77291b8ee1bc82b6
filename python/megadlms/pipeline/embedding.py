"""Tied embeddings across pipeline stages: the embedding group and its gradient sum.

With tied input/output embeddings and pp > 1 the first stage holds
``embedding.word_embeddings.weight`` and the last stage a copy, ``output_layer.weight``
(its sharding declares ``tied_copy``, initialised equal: models/gpt.py). Both get a gradient; after
every chunk's ``finish_grad_sync()`` the two are summed over the embedding group (first and
last rank of each pipeline group, Megatron's ``embedding group``), so both copies take the
same optimizer step and stay equal. The sum itself is ``distributed.finalize``'s (it
knows the wrappers' gradient layouts); this file says which parameters and which ranks.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megadlms.distributed import DataParallel, unwrap_model
from megadlms.distributed.finalize import TiedParam, allreduce_tied_grad
from megadlms.parallel.groups import ParallelGroups, rank_grid


def embedding_group_ranks(groups: ParallelGroups) -> List[List[int]]:
    """The global ranks of every embedding group: [first, last] stage of each pipeline group,
    in Megatron's enumeration order (empty when pp == 1: nothing to tie across stages)."""
    if groups.pp.size == 1:
        return []
    grid = rank_grid(groups.world_size, tp=groups.tp.size, pp=groups.pp.size, ep=groups.ep.size)
    # rank_grid's order is the same on every rank, so the new_group calls below match up.
    return [[ranks[0], ranks[-1]] for ranks in grid["pp"]]


def build_embedding_group(groups: ParallelGroups) -> Optional[dist.ProcessGroup]:
    """Create every embedding group (collective: every rank calls it, once) and return this
    rank's, or None when this rank is on neither the first nor the last stage (or pp == 1)."""
    mine = None
    for ranks in embedding_group_ranks(groups):
        # new_group is collective over the world: every rank creates every group and keeps its own.
        group = dist.new_group(ranks)
        if groups.rank in ranks:
            mine = group
    return mine


def embedding_grad_params(chunks: Iterable[Union[torch.nn.Module, DataParallel]]) -> List[torch.nn.Parameter]:
    """The parameters of this rank's chunks whose grads the embedding group sums: the word
    embedding of a first-stage chunk without the output layer, and the last stage's copy."""
    out = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        if not getattr(model, "share_embeddings_and_output_weights", False):
            continue
        pipe = model.pipeline
        # Only split ends need the sum: a chunk holding both uses one tensor for both.
        if pipe.pre_process and not pipe.post_process:
            out.append(model.embedding.word_embeddings.weight)
        elif model.has_shared_embedding_copy:
            out.append(model.output_layer.weight)
    return out


def tied_embedding_params(chunks: Sequence[DataParallel]) -> List[TiedParam]:
    """(chunk, parameter) of every tied-embedding gradient of this rank's wrapped chunks, in
    chunk order: what ``distributed.finalize_model_grads`` sums over the embedding group."""
    return [(chunk, p) for chunk in chunks for p in embedding_grad_params([chunk])]


def allreduce_embedding_grads(
    chunks: Sequence[DataParallel], embedding_group: Optional[dist.ProcessGroup]
) -> None:
    """Sum the tied embedding's reduced gradient of the wrapped ``chunks`` over
    ``embedding_group`` (call AFTER every chunk's ``finish_grad_sync()``, before the optimizer
    step; the trainer's step does it in ``finalize_model_grads``). A no-op without a group
    (pp == 1 or a middle stage) or with untied embeddings (``allreduce_tied_grad``: the
    distributed optimizer's shards, a rank without a gradient)."""
    if embedding_group is None:
        return
    for chunk, param in tied_embedding_params(chunks):
        allreduce_tied_grad(chunk, param, embedding_group)
