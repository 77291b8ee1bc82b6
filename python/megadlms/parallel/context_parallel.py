"""Context parallelism (Megatron's ``--context-parallel-size C``): the sequence of every
micro-batch is split over the C ranks of the context-parallel group, and attention runs across
the split by all-gathering K and V (Megatron / Transformer Engine's ``cp_comm_type
"all_gather"``).

* :func:`sequence_index`: which global token positions a cp rank holds. Bidirectional
  attention costs the same for every query, so the split is contiguous (rank r holds
  ``[r*S/C, (r+1)*S/C)``). Causal attention costs more for late queries, so the sequence is cut
  into 2C chunks and rank r holds chunks r and 2C-1-r (Megatron's ``get_batch_on_this_cp_rank``
  load balancing).
* :func:`shard_sequence`: pad a micro-batch's [B, S] tensors to a length the split (and the
  sequence-parallel split after it) divides, then keep this rank's positions. Padded positions
  carry position id -1, which :class:`ContextParallelPlan` turns into "never a key".
* :class:`ContextParallelPlan`: what attention needs in one forward: the global index of each
  local query, the global index and validity of every gathered key, and so the mask.
* :func:`gather_kv`: the all-gather of K/V along the sequence, whose backward reduce-scatters
  dK/dV (every rank's queries contributed to every rank's keys).

Parameters are replicated over cp: their gradients are reduced over dp x cp
(``ParallelGroups.for_gradients``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from .mappings import Group, _all_gather, gather_from_sequence_parallel, group_rank, group_size

PAD_POSITION = -1
"""Position id of a padded token: not a key for any query, its output is never scored."""


def sequence_index(length: int, cp: int, rank: int, load_balance: bool, device=None) -> torch.Tensor:
    """The global positions (int64 [length / cp]) rank ``rank`` of ``cp`` holds of a padded
    sequence of ``length`` (a multiple of cp, or of 2cp with ``load_balance``)."""
    if not load_balance:
        part = length // cp
        return torch.arange(rank * part, (rank + 1) * part, device=device)
    chunk = length // (2 * cp)
    # chunks r and 2C-1-r: an early and a late chunk, so every rank does the same causal work
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def padded_length(length: int, cp: int, load_balance: bool, multiple: int = 1) -> int:
    """The smallest length >= ``length`` that the cp split divides (2cp chunks with
    ``load_balance``) with each rank's part a multiple of ``multiple`` (the tp size under
    sequence parallelism)."""
    step = cp * (2 if load_balance else 1) * multiple
    return -(-length // step) * step


def shard_sequence(
    tensors: Dict[str, Optional[torch.Tensor]],
    pad_values: Dict[str, float],
    *,
    cp: int,
    rank: int,
    load_balance: bool,
    multiple: int = 1,
) -> Dict[str, Optional[torch.Tensor]]:
    """This cp rank's part of every [B, S] tensor of ``tensors`` (None stays None): padded at
    the end with ``pad_values[name]`` to :func:`padded_length`, then indexed with
    :func:`sequence_index`. ``tensors["position_ids"]`` must be given (global positions);
    its padding is :data:`PAD_POSITION`."""
    ref = tensors["position_ids"]
    if ref is None:
        raise ValueError("shard_sequence: tensors['position_ids'] (the global positions) must be given")
    S = ref.shape[1]
    total = padded_length(S, cp, load_balance, multiple)
    index = sequence_index(total, cp, rank, load_balance, device=ref.device)
    out: Dict[str, Optional[torch.Tensor]] = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = None
            continue
        value = PAD_POSITION if name == "position_ids" else pad_values.get(name, 0)
        if total > S:
            filler = torch.full((t.shape[0], total - S), value, dtype=t.dtype, device=t.device)
            t = torch.cat([t, filler], dim=1)
        out[name] = t.index_select(1, index)
    return out


def gather_kv(x: torch.Tensor, group: Group, dim: int = 2) -> torch.Tensor:
    """The full-sequence K or V ([B, G, S, D] with ``dim`` 2) from every cp rank's part, in
    cp-rank order (differentiable: dK/dV are reduce-scattered back)."""
    # The sequence-parallel gather with a partial gradient: every rank's queries attended to this
    # rank's keys, so the key's gradient is the sum over ranks, reduce-scattered.
    return gather_from_sequence_parallel(x, group, seq_dim=dim, grad_is_partial=True)


@dataclass
class ContextParallelPlan:
    """One forward's context-parallel attention: built by :meth:`build` from the local
    position ids, passed to every layer's attention in place of a document mask.

    Bidirectional: the local queries attend to every gathered key but the padding (``valid``;
    None when there is none: no mask at all). Causal: the gathered keys are put in global order
    (``order``) and each of this rank's two chunks attends only to the keys up to its end (its
    earlier chunks unmasked, its own chunk lower-triangular), so the work skips what causality
    hides, as the 2C-chunk balance intends; padding sits at the end and is never a real key."""

    group: Group
    causal: bool
    valid: Optional[torch.Tensor] = None  # bool [B, 1, 1, S]: bidirectional, keys that are not padding
    order: Optional[torch.Tensor] = None  # causal: gathered (rank-order) key -> global order
    ends: tuple = ()  # causal: for each local chunk, (its global chunk index, keys it sees)
    chunk: int = 0
    _masks: Optional[dict] = None  # additive masks by dtype, made once per forward (see _additive)

    @classmethod
    def build(cls, position_ids: Optional[torch.Tensor], group: Group, causal: bool):
        """(plan, position ids for the embeddings with padding at 0). ``position_ids`` int64
        [B, Sl]: the global positions of this rank's tokens (:func:`shard_sequence`)."""
        if position_ids is None:
            raise ValueError(
                "context parallelism needs position_ids (the global positions of this rank's tokens): "
                "shard the batch with megadlms.parallel.context_parallel.shard_sequence"
            )
        cp, rank = group_size(group), group_rank(group)
        Sl = position_ids.shape[1]
        positions = position_ids.clamp(min=0)
        if causal:
            chunk, device = Sl // 2, position_ids.device
            k_index = torch.cat([sequence_index(Sl * cp, cp, r, True, device) for r in range(cp)])
            ends = ((rank, (rank + 1) * chunk), (2 * cp - 1 - rank, (2 * cp - rank) * chunk))
            return cls(
                group, True, order=torch.argsort(k_index), ends=ends, chunk=chunk, _masks={}
            ), positions
        # One small all-gather per forward: which gathered keys are padding (known only to their owner).
        valid = _all_gather(position_ids.contiguous(), 1, group) != PAD_POSITION  # [B, S]
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        return cls(group, False, valid=mask, _masks={}), positions

    def attention(self, q, k, v, dropout_p: float, enable_gqa: bool) -> torch.Tensor:
        """SDPA of the local queries q [B, N, Sl, D] against the gathered keys and values."""
        k, v = gather_kv(k, self.group), gather_kv(v, self.group)
        kw: Dict[str, Any] = {"dropout_p": dropout_p, "enable_gqa": enable_gqa}
        if not self.causal:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._additive(q.dtype), **kw)
        k, v = k.index_select(2, self.order), v.index_select(2, self.order)
        c = self.chunk
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, i * c : (i + 1) * c], k[:, :, :end], v[:, :, :end], attn_mask=mask, **kw
            )
            for i, ((_, end), mask) in enumerate(zip(self.ends, self._additive(q.dtype)))
        ]
        return torch.cat(outs, dim=2)

    def _additive(self, dtype):
        # SDPA turns a boolean mask into an additive one in every call, and saves it for backward:
        # made once per forward here, every layer shares the same tensors.
        if dtype not in self._masks:
            self._masks[dtype] = self._make_masks(dtype)
        return self._masks[dtype]

    def _make_masks(self, dtype):
        if not self.causal:
            if self.valid is None:
                return None
            return torch.where(self.valid, 0.0, torch.finfo(dtype).min).to(dtype)
        out, c = [], self.chunk
        for index, end in self.ends:
            # query i of global chunk `index` sees keys j <= index * c + i (the lower-right triangle)
            rows = torch.arange(c, device=self.order.device)[:, None] + index * c
            seen = torch.arange(end, device=self.order.device)[None, :] <= rows
            out.append(torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype))
        return out


def context_parallel_problems(
    context_parallel_size: int,
    *,
    use_torch_fsdp2: bool = False,
    reset_attention_mask: bool = False,
    num_moe_experts: Optional[int] = None,
    num_distributed_optimizer_instances: int = 1,
) -> list:
    """What context parallelism cannot be combined with here, worded with field names (the
    CLI rewords them with flags). Sizes (world, ep, optimizer instances) are
    :func:`~megadlms.parallel.groups.check_sizes`' rule."""
    cp = context_parallel_size
    if cp == 1:
        return []
    out = []
    if use_torch_fsdp2:
        out.append(
            f"use_torch_fsdp2 with context_parallel_size {cp} is not supported: use the default DDP "
            "(with use_distributed_optimizer to shard the optimizer over dp x cp)"
        )
    if reset_attention_mask:
        out.append(
            f"reset_attention_mask (document packing) with context_parallel_size {cp} is not supported: "
            "drop one of them (reset_position_ids alone works)"
        )
    if num_moe_experts:
        out.append(
            f"num_moe_experts with context_parallel_size {cp} is not supported: MoE layers need "
            "context_parallel_size 1"
        )
    if num_distributed_optimizer_instances != 1:
        out.append(
            f"num_distributed_optimizer_instances {num_distributed_optimizer_instances} with "
            f"context_parallel_size {cp} is not supported: the optimizer is sharded over dp x cp "
            "as one instance"
        )
    return out
