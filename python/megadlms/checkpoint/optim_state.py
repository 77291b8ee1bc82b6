"""The optimizer state of format 4: each rank's LOCAL state, written and read as views.

An optimizer with ``sharded_state_dict()`` / ``load_sharded_state_dict()``
(:class:`~megadlms.optimizer.MixedPrecisionOptimizer`) hands out its state with every leaf
local and no collective: the parameter's TP-local tensor (replicated / DDP), the DTensor
(FSDP2), or a :class:`~megadlms.optimizer.FlatPiece` (the distributed optimizer: elements
[start, stop) of the TP-local tensor flattened). A FlatPiece becomes a ShardView of at most
2 * ndim - 1 boxes per TP block (views.py's :func:`flat_view`), so the distributed optimizer
neither gathers at save nor reads whole tensors at load. Without that API (a torch.optim
optimizer) ``state_dict()``'s tensors are used as before (a full tensor: one replicated box).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megadlms.common.dtensor import is_dtensor
from megadlms.optimizer import FlatPiece
from megadlms.parallel.mappings import Group, group_rank, group_size
from megadlms.parallel.sharding import sharding_of

from .format import join_state, tensor_paths
from .tensor_parallel import entry_view, full_shape_of
from .views import ShardView, flat_view, sharding_cut


def has_sharded_state(optimizer) -> bool:
    """Whether ``optimizer`` hands out (and takes back) local state without collectives."""
    return hasattr(optimizer, "sharded_state_dict") and hasattr(optimizer, "load_sharded_state_dict")


def piece_view(piece: FlatPiece, like: torch.Tensor, tp_group: Group, ep_group: Group) -> ShardView:
    """A distributed-optimizer piece of parameter ``like``'s state as its boxes of the full tensor."""
    cut = sharding_cut(
        sharding_of(like), piece.shape, (group_rank(tp_group), group_size(tp_group)),
        (group_rank(ep_group), group_size(ep_group)),
    )  # fmt: skip
    return flat_view(piece.tensor.detach(), piece.start, piece.stop, piece.shape, cut)


def views_of_pieces(state: dict, params: Dict[str, torch.nn.Parameter], tp_group, ep_group) -> dict:
    """``sharded_state_dict()`` with every FlatPiece leaf replaced by its ShardView (a copy of the
    nesting; the other leaves unchanged: save.py views them by parameter like model tensors)."""
    out = dict(state)
    out["state"] = {
        fqn: {
            k: piece_view(v, params[fqn], tp_group, ep_group) if isinstance(v, FlatPiece) else v
            for k, v in entry.items()
        }
        for fqn, entry in state.get("state", {}).items()
    }
    return out


def _destination(key: str, leaf, dtype: torch.dtype, like, tp_group, ep_group):
    """(what the optimizer gets back, what DCP reads into) for one local leaf, of ``dtype``."""
    if isinstance(leaf, FlatPiece):
        piece = FlatPiece(torch.empty(leaf.stop - leaf.start, dtype=dtype), leaf.start, leaf.stop, leaf.shape)
        return piece, piece_view(piece, like, tp_group, ep_group)
    dst = torch.empty_like(leaf, dtype=dtype) if is_dtensor(leaf) else torch.empty(leaf.shape, dtype=dtype)
    return dst, entry_view(key, dst, like if dst.dim() > 0 else None, tp_group, ep_group)


def sharded_reads(skel, shapes, optimizer, params, tp_group, ep_group) -> Optional[Dict[str, tuple]]:
    """``key -> (leaf for load_sharded_state_dict, view DCP reads into)`` for every tensor of
    ``skel`` (this rank's part of the stored skeleton), laid out like the optimizer's own
    ``sharded_state_dict()``; None when the stored entries are not the optimizer's own (e.g. a
    bf16 checkpoint's ``fp32_param`` into an fp32 run): the caller then reads full tensors."""
    own = optimizer.sharded_state_dict(values=False)["state"]  # the layout only: nothing zero-filled
    paths = {key: path for path, key in tensor_paths(skel)}
    state_paths = {key: p for key, p in paths.items() if len(p) == 3 and p[0] == "state"}
    mine = {(fqn, k) for fqn, entry in own.items() for k in entry if torch.is_tensor(entry[k]) or
            isinstance(entry[k], FlatPiece)}  # fmt: skip
    if {(p[1], p[2]) for p in state_paths.values()} != mine or len(state_paths) != len(paths):
        return None
    reads: Dict[str, tuple] = {}
    for key, (_, fqn, name) in state_paths.items():
        shape, dtype = shapes[key]
        leaf = own[fqn][name]
        reads[key] = _destination(key, leaf, dtype, params.get(fqn), tp_group, ep_group)
        if full_shape_of(reads[key][1]) != shape:
            raise RuntimeError(
                f"optimizer state {key} has shape {shape} but this run's is {full_shape_of(reads[key][1])}; "
                "the model flags differ from the checkpoint's"
            )
    return reads


def load_sharded(optimizer, skel, reads: Dict[str, tuple]) -> None:
    """Hand the filled leaves back to the optimizer in its own nesting."""
    # take: the leaves were allocated for this load only (sharded_reads), so they become the state.
    leaves = join_state(skel, {k: leaf for k, (leaf, _) in reads.items()})
    optimizer.load_sharded_state_dict(leaves, take=True)
