"""Tied embeddings across pipeline stages: the embedding group and its gradient sum.

With tied input/output embeddings and pp > 1 the first stage holds
``embedding.word_embeddings.weight`` and the last stage a copy, ``output_layer.weight``
(its sharding declares ``tied_copy``, initialised equal: models/gpt.py). Both get a gradient; after
every chunk's ``finish_grad_sync()`` the two are summed over the embedding group (first and
last rank of each pipeline group, Megatron's ``embedding group``), so both copies take the
same optimizer step and stay equal.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from megadlms.distributed.wrappers import unwrap_model
from megadlms.parallel.groups import ParallelGroups, rank_grid


def embedding_group_ranks(groups: ParallelGroups) -> List[List[int]]:
    """The global ranks of every embedding group: [first, last] stage of each pipeline group,
    in Megatron's enumeration order (empty when pp == 1: nothing to tie across stages)."""
    if groups.pp.size == 1:
        return []
    grid = rank_grid(groups.world_size, tp=groups.tp.size, pp=groups.pp.size, ep=groups.ep.size)
    return [[ranks[0], ranks[-1]] for ranks in grid["pp"]]


def build_embedding_group(groups: ParallelGroups) -> Optional[dist.ProcessGroup]:
    """Create every embedding group (collective: every rank calls it, once) and return this
    rank's, or None when this rank is on neither the first nor the last stage (or pp == 1)."""
    mine = None
    for ranks in embedding_group_ranks(groups):
        group = dist.new_group(ranks)
        if groups.rank in ranks:
            mine = group
    return mine


def embedding_grad_params(chunks: Iterable[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """The parameters of this rank's chunks whose grads the embedding group sums: the word
    embedding of a first-stage chunk without the output layer, and the last stage's copy."""
    out = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        if not getattr(model, "share_embeddings_and_output_weights", False):
            continue
        pipe = model.pipeline
        if pipe.pre_process and not pipe.post_process:
            out.append(model.embedding.word_embeddings.weight)
        elif model.has_shared_embedding_copy:
            out.append(model.output_layer.weight)
    return out


def _grad_of(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def allreduce_embedding_grads(
    chunks: Iterable[torch.nn.Module], embedding_group: Optional[dist.ProcessGroup]
) -> None:
    """Sum the tied embedding's gradient over ``embedding_group``: ``param.main_grad`` of
    DDP-wrapped chunks (call AFTER every chunk's ``finish_grad_sync()``, before the optimizer
    step), ``param.grad`` of plain modules. A no-op without a group (pp == 1 or a middle
    stage) or untied embeddings. A rank of the group without a gradient yet joins with zeros,
    so its peer never blocks. Under the distributed optimizer (``optimizer_layout``
    "bucket_shards") only this rank's bucket shard is reduced, at offsets that differ between
    the two stages, so each gradient is first completed over the chunk's shard group."""
    if embedding_group is None:
        return
    for chunk in chunks:
        for param in embedding_grad_params([chunk]):
            if getattr(chunk, "optimizer_layout", None) == "bucket_shards":
                _complete_sharded_grad(chunk, param)
            grad = _grad_of(param)
            if grad is None:
                param.grad = grad = torch.zeros_like(param)
            dist.all_reduce(grad, group=embedding_group)


def _complete_sharded_grad(wrapper, param: torch.nn.Parameter) -> None:
    """Make ``param.main_grad`` the full reduced gradient on every rank of the wrapper's shard
    group: keep the part inside this rank's reduced shard, zero the rest, sum over the group."""
    comm = wrapper.shard_comm
    for bucket in wrapper.grad_buckets:
        if not any(p is param for p in bucket.params):
            continue
        off = bucket.offsets[next(i for i, p in enumerate(bucket.params) if p is param)]
        lo, hi = bucket.shard_range(comm.rank, comm.world_size)
        flat = param.main_grad.view(-1)
        a, b = max(lo - off, 0), min(hi - off, flat.numel())
        mine = flat[a:b].clone() if a < b else None
        flat.zero_()
        if mine is not None:
            flat[a:b] = mine
        if comm.world_size > 1:
            comm.all_reduce(flat, "sum")
        return
