"""Checkpoints across tensor-parallel sizes: store FULL logical tensors, load any tp.

Under tensor parallelism the model's state dict and the optimizer state hold this rank's
LOCAL shard of every sharded parameter (its ``ParamSharding``'s ``tp_dim`` / ``tp_blocks``:
``megadlms.parallel.sharding``, the one description). A checkpoint
stores the full logical tensor instead, so it loads at any tp (and on one process):

* save: every shard of a sharded parameter -- the weight itself and every optimizer state
  tensor of its local shape (``exp_avg``, ``exp_avg_sq``, ``fp32_param``,
  ``momentum_buffer``, matched to the parameter by name) -- is gathered over the TP group
  with :func:`~megadlms.parallel.sharding.gather_full`, one tensor at a time in sorted key
  order (a collective: every TP rank gathers the same tensors in the same order). Only
  one rank keeps each gathered tensor (:func:`gather_for_save`'s ``owner``), so the
  transient cost per rank is one full tensor plus ~1/world of the gathered ones;
* load: full tensors are read in batches of at most :data:`LOAD_BATCH_BYTES` and cut to
  this rank's shard with :func:`~megadlms.parallel.sharding.shard_full` right away,
  so at most one batch of full tensors exists at a time.

Expert parallelism works the same way over the EP group: an expert parameter
(``ParamSharding.expert_dim`` 0: this EP rank's experts of the full [E, ...] tensor)
and its optimizer state are gathered over ``ep_group`` along that dim (the experts in global
order) and stored under the FULL shape, and cut to this rank's experts on load, so a
checkpoint loads at any ep. (A parameter is sharded over TP or over EP, never both: MoE
with tp > 1 is refused.)

Keys: ``model/<fqn>`` and ``optimizer/state/<fqn>/<name>`` (``/`` never occurs in a name).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megadlms.common.dtensor import is_dtensor
from megadlms.parallel.mappings import Group, group_rank, group_size
from megadlms.parallel.sharding import expert_shard_dim, gather_full, shard_full, shard_spec

LOAD_BATCH_BYTES = 1 << 30
"""Full tensors read at once while loading at tp > 1 (a batch is one DCP read)."""

_OPT_PREFIX = "optimizer/state/"


def tp_size(tp_group: Group) -> int:
    """The tensor-parallel size of ``tp_group`` (1 for None)."""
    return group_size(tp_group)


def _spec(p: torch.Tensor, tp_group: Group, ep_group: Group) -> Optional[Tuple[Group, int, int]]:
    """``(group, dim, blocks)`` of a parameter sharded in this run (over TP or over EP), or None."""
    spec = shard_spec(p)
    if spec is not None and tp_size(tp_group) > 1:
        return (tp_group,) + spec
    dim = expert_shard_dim(p)
    if dim is not None and group_size(ep_group) > 1:
        return ep_group, dim, 1
    return None


def sharded_full_shape(p: torch.Tensor, tp_group: Group, ep_group: Group = None) -> Tuple[int, ...]:
    """The full logical shape of ``p`` (its local shape when it is not sharded in this run; a
    DTensor's shape is already the full one)."""
    shape = list(p.shape)
    spec = _spec(p, tp_group, ep_group)
    if spec is not None:
        shape[spec[1]] *= group_size(spec[0])
    return tuple(shape)


def _local_from_full(
    full: torch.Tensor, like: torch.Tensor, tp_group: Group, ep_group: Group
) -> torch.Tensor:
    spec = _spec(like, tp_group, ep_group)
    if spec is None:
        return full
    group, dim, blocks = spec
    return shard_full(full, group_rank(group), group_size(group), dim, blocks)


def named_params(module: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Every parameter of ``module`` by state-dict name (tied weights under each name)."""
    # remove_duplicate=False: a tied weight must be found under the output layer's name too.
    return dict(module.named_parameters(remove_duplicate=False))


def param_of(key: str, params: Dict[str, torch.nn.Parameter]) -> Optional[torch.nn.Parameter]:
    """The parameter a flat checkpoint key belongs to (model weight or its optimizer state)."""
    if key.startswith("model/"):
        return params.get(key[len("model/") :])
    if key.startswith(_OPT_PREFIX):
        return params.get(key[len(_OPT_PREFIX) :].split("/", 1)[0])
    return None


def check_optimizer_keys(state: dict, params: Dict[str, torch.nn.Parameter]) -> None:
    """At tp > 1 optimizer state must be keyed by parameter name to be matched to its shard."""
    # torch.optim keys state by index, which names no parameter, so no shard spec can be found.
    foreign = [k for k in state if not isinstance(k, str) or k not in params]
    if foreign:
        raise ValueError(
            f"tensor-parallel checkpoint: optimizer state keys {foreign[:3]} are not parameter names "
            "of the model, so their shards cannot be gathered; use megadlms.optimizer.get_optimizer "
            "(state keyed by parameter name), not a torch.optim optimizer"
        )


def _to_gather(tensors: Dict[str, torch.Tensor], params, tp_group, ep_group) -> Iterable[Tuple[str, tuple]]:
    """(key, shard spec) of every LOCAL shard in ``tensors``, in rank-independent (sorted) order."""
    for key in sorted(tensors):
        p = param_of(key, params)
        spec = None if p is None else _spec(p, tp_group, ep_group)
        # Scalars such as Adam's step are identical on every rank and never gathered.
        if p is None or spec is None or tensors[key].dim() == 0:
            continue
        if tuple(tensors[key].shape) != tuple(p.shape):
            raise ValueError(
                f"tensor-parallel checkpoint: {key} has shape {tuple(tensors[key].shape)}, not the "
                f"local shape {tuple(p.shape)} of its sharded parameter; cannot gather it"
            )
        yield key, spec


def gather_for_save(
    tensors: Dict[str, torch.Tensor],
    params,
    tp_group: Group,
    owner: Callable[[int], bool],
    *,
    ep_group: Group = None,
) -> None:
    """Replace every local shard in ``tensors`` by its full tensor (in place; collective over
    ``tp_group``, and over ``ep_group`` for expert parameters). The i-th gathered tensor is
    kept only where ``owner(i)``, and dropped elsewhere right after its gather (the other
    ranks write it)."""
    if tp_size(tp_group) == 1 and group_size(ep_group) == 1:
        return
    for i, (key, (group, dim, blocks)) in enumerate(list(_to_gather(tensors, params, tp_group, ep_group))):
        local = tensors[key].detach()
        if is_dtensor(local):
            # FSDP2 over TP: the DTensor is this TP rank's shard, split over dp; whole it first
            # (a collective over dp, in the same sorted key order on every rank).
            local = local.full_tensor()
        # Every rank of the group gathers every key, owner or not: a skipped gather would deadlock.
        full = gather_full(local, group, dim, blocks)
        # Dropping the full tensor on non-owners right away bounds the memory to ~1/world of them.
        if owner(i):
            tensors[key] = full.cpu()
        else:
            del tensors[key]


def read_resharded(
    reads: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]],
    tp_group: Group,
    read: Callable[[Dict[str, torch.Tensor]], None],
    batch_bytes: int = LOAD_BATCH_BYTES,
    *,
    ep_group: Group = None,
) -> None:
    """Fill every destination of ``reads`` (``key -> (dst, like)``; ``like`` the parameter
    whose sharding ``dst`` has, or None) through ``read`` (fills a dict of tensors in place).

    Destinations that are not TP shards are read in place in one call. TP shards are read as
    full tensors in batches of at most ``batch_bytes`` (sorted keys: every rank makes the same
    calls) and cut to this rank's shard at once; expert shards likewise over ``ep_group``."""
    direct: Dict[str, torch.Tensor] = {}
    sharded: List[Tuple[str, torch.Tensor]] = []  # (key, the parameter whose sharding it has)
    for key in sorted(reads):
        dst, like = reads[key]
        if like is not None and dst.dim() > 0 and _spec(like, tp_group, ep_group) is not None:
            sharded.append((key, like))
        else:
            direct[key] = dst
    read(direct)  # (an empty dict reads nothing; the key sets are the same on every rank)
    batch: Dict[str, torch.Tensor] = {}
    size = 0
    likes = dict(sharded)
    for n, (key, like) in enumerate(sharded):
        dst = reads[key][0]
        batch[key] = torch.empty(sharded_full_shape(like, tp_group, ep_group), dtype=dst.dtype)
        size += batch[key].numel() * batch[key].element_size()
        # The last key always flushes, so every rank makes the same number of reads (DCP collectives).
        if size >= batch_bytes or n == len(sharded) - 1:
            read(batch)
            with torch.no_grad():
                for k, full in batch.items():
                    _copy_into(reads[k][0], _local_from_full(full, likes[k], tp_group, ep_group))
            batch, size = {}, 0


def _copy_into(dst: torch.Tensor, local: torch.Tensor) -> None:
    """``dst`` := ``local`` (this rank's TP shard); an FSDP2 DTensor ``dst`` takes its own
    piece of it, cut as FSDP2 cuts (every rank holds ``local``: no scatter)."""
    if is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(local.to(dst.dtype), dst.device_mesh, dst.placements, src_data_rank=None)
        dst, local = dst.to_local(), local.to_local()
    dst.copy_(local)
