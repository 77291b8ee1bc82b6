"""Which pieces of the full logical tensors this rank holds: one checkpoint entry at a time.

Under tensor parallelism the model's state dict and the optimizer state hold this rank's
LOCAL shard of every sharded parameter (its ``ParamSharding``'s ``tp_dim`` / ``tp_blocks``:
``megadlms.parallel.sharding``, the one description); under expert parallelism this EP
rank's experts (``expert_dim``). A checkpoint stores the full logical tensor, so it loads
at any tp / ep (and on one process). Format 4 (views.py) never builds that full tensor:
:func:`entry_view` describes the local tensor -- the weight itself or an optimizer state
tensor of its local shape (``exp_avg``, ``exp_avg_sq``, ``fp32_param``, ``momentum_buffer``,
matched to the parameter by name) -- as its pieces of the full one, and DCP writes and reads
just those bytes. (A parameter is sharded over TP or over EP, never both: MoE with tp > 1 is
refused.)

Only the legacy ``--ckpt-format torch`` (Megatron's one file of FULL tensors written by rank
0) still gathers: :func:`gather_for_save`.

Keys: ``model/<fqn>`` and ``optimizer/state/<fqn>/<name>`` (``/`` never occurs in a name).
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch

from megadlms.common.dtensor import is_dtensor
from megadlms.parallel.mappings import Group, group_rank, group_size
from megadlms.parallel.sharding import gather_full, sharding_of

from .views import NO_CUT, Cut, ShardView, local_view, sharding_cut

_OPT_PREFIX = "optimizer/state/"


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


def param_cut(
    like: Optional[torch.Tensor], t: torch.Tensor, tp_group: Group, ep_group: Group, key: str
) -> Cut:
    """The :class:`~megadlms.checkpoint.views.Cut` of ``t``, a tensor sharded like parameter
    ``like`` (None: replicated); 0-d tensors (Adam's step) are never sharded."""
    if like is None or t.dim() == 0:
        return NO_CUT
    cut = sharding_cut(
        sharding_of(like), tuple(like.shape), (group_rank(tp_group), group_size(tp_group)),
        (group_rank(ep_group), group_size(ep_group)),
    )  # fmt: skip
    if cut.dim is not None and tuple(t.shape) != tuple(like.shape):
        raise ValueError(
            f"sharded checkpoint: {key} has shape {tuple(t.shape)}, not the local shape "
            f"{tuple(like.shape)} of its sharded parameter; cannot place it in the full tensor"
        )
    return cut


def entry_view(
    key: str, t: torch.Tensor, like: Optional[torch.Tensor], tp_group: Group, ep_group: Group = None
) -> Union[torch.Tensor, ShardView]:
    """What DCP gets for checkpoint entry ``key``: a :class:`ShardView` of ``t`` (this rank's
    tensor, sharded like parameter ``like``) in the full logical tensor, or ``t`` itself when
    it already is the full tensor (or a DTensor of it: DCP knows those)."""
    cut = param_cut(like, t, tp_group, ep_group, key)
    if cut.dim is None:
        return t.detach() if isinstance(t, torch.nn.Parameter) else t
    return local_view(t, cut)


def full_shape_of(entry: Union[torch.Tensor, ShardView]) -> tuple:
    """The full logical shape an entry describes."""
    return tuple(entry.size())


def gather_for_save(
    tensors: Dict[str, torch.Tensor], params, tp_group: Group, keep: bool, *, ep_group: Group = None
) -> None:
    """The legacy torch format only: replace every local shard in ``tensors`` by its full
    tensor (in place; a collective over ``tp_group`` / ``ep_group`` in sorted key order), kept
    only where ``keep`` (the rank that writes the file)."""
    for key in sorted(tensors):
        like = param_of(key, params)
        cut = param_cut(like, tensors[key], tp_group, ep_group, key)
        if cut.dim is None or like is None:
            continue
        local = tensors[key].detach()
        if is_dtensor(local):
            local = local.full_tensor()  # FSDP2 over TP: whole this TP rank's shard (over dp) first
        sharding = sharding_of(like)
        tp_split = sharding.tp_dim is not None and group_size(tp_group) > 1
        group, blocks = (tp_group, sharding.tp_blocks) if tp_split else (ep_group, 1)
        # Every rank gathers every key, keeper or not: a skipped gather would deadlock.
        full = gather_full(local, group, cut.dim, blocks)
        if keep:
            tensors[key] = full.cpu()
        else:
            del tensors[key]
