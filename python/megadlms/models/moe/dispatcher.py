"""Token dispatchers: move each routed (token, expert) row to the expert-parallel rank that
holds the expert, and the expert outputs back (Megatron-core's token_dispatcher.py).

EP rank e holds the experts [e*El, (e+1)*El) (El = E / ep). Both dispatchers hand the experts
their rows grouped by LOCAL expert (``tokens_per_expert`` [El], the rows of expert 0 first),
and ``combine`` returns [T, H]: ``sum over the token's routed experts of prob * expert(x)``,
summed in fp32.

- :class:`AllGatherDispatcher` (Megatron's default "allgather"): all-gather every rank's tokens,
  routing map and probabilities over EP, keep the rows of the local experts, and
  reduce-scatter the weighted outputs back. Rows are padded to the longest rank (T may differ).
- :class:`AllToAllDispatcher` ("alltoall"): sort the local rows by global expert, exchange the
  counts, then ``all_to_all_single`` the rows to their expert's rank and back. The
  probabilities never leave the rank (they weight the rows after the return trip).

Every rank joins every collective, also when it sends or receives no row (an expert without
tokens computes nothing and gets a zero gradient; nobody waits).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from megadlms.common.enums import MoETokenDispatcher
from megadlms.parallel import mappings
from megadlms.parallel.mappings import Group, all_gather_single, group_rank, group_size

DISPATCHER_TYPES = tuple(m.value for m in MoETokenDispatcher)


def permute(
    x_TH: torch.Tensor, routing_map_TE: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed rows expert-major (expert 0's tokens first, each expert's in token order):
    (rows [R, H], token index of each row [R], rows per expert [E])."""
    # nonzero of the transposed map walks expert by expert, tokens ascending: expert-major order.
    _, token_idx = routing_map_TE.t().nonzero(as_tuple=True)
    return x_TH[token_idx], token_idx, routing_map_TE.sum(dim=0, dtype=torch.int64)


def unpermute(rows_RH: torch.Tensor, token_idx: torch.Tensor, weight_R: torch.Tensor, num_tokens: int):
    """``out[t] = sum of weight_r * rows_r over the rows r of token t`` in fp32, then the rows'
    dtype: the inverse of :func:`permute` (with weights 1 and top-1 routing, exactly)."""
    out = torch.zeros(num_tokens, rows_RH.shape[-1], dtype=torch.float32, device=rows_RH.device)
    # index_add sums a token's top-k rows in fp32, cast once at the end: k adds no bf16 roundings.
    out = out.index_add(0, token_idx, rows_RH.float() * weight_R.unsqueeze(-1))
    return out.to(rows_RH.dtype)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with explicit splits; the backward sends the gradient back
    (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits: List[int], input_splits: List[int], group):
        # Stored swapped: the backward's output splits are the forward's input splits, and vice versa.
        ctx.splits, ctx.group = (input_splits, output_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        back_out, back_in = ctx.splits
        # An all-to-all is its own conjugate with the splits swapped: each row's grad returns to its sender.
        return _all_to_all(grad.contiguous(), back_out, back_in, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _expert_range(num_experts: int, group: Group) -> Tuple[int, int]:
    ep = group_size(group)
    if num_experts % ep:
        raise ValueError(f"num_moe_experts {num_experts} is not divisible by expert_model_parallel_size {ep}")
    per_rank = num_experts // ep
    lo = group_rank(group) * per_rank
    return lo, lo + per_rank


class AllGatherDispatcher:
    """All-gather dispatch over the EP group (None: one rank, a local permutation)."""

    def __init__(self, num_experts: int, group: Group = None) -> None:
        self.group, self.ep = group, group_size(group)
        self.lo, self.hi = _expert_range(num_experts, group)

    def dispatch(self, x_TH, probs_TE, routing_map_TE):
        """-> (rows of the local experts [R, H], rows per local expert [El] int64, the handle
        that :meth:`combine` takes)."""
        T = x_TH.shape[0]
        if self.ep > 1:
            sizes = _gather_rows(torch.tensor([T], dtype=torch.int64, device=x_TH.device), self.group)
            t_max = int(sizes.max())  # T may differ per rank: pad every rank to the longest
            # The single-tensor all-gather needs equal sizes; padded rows have an all-False routing map, so no
            # expert ever computes them.
            x_TH, probs_TE, routing_map_TE = (_pad_rows(t, t_max) for t in (x_TH, probs_TE, routing_map_TE))
            # Every rank's experts send grads to every rank's tokens: the backward reduce-scatter sums them
            # and hands each rank its own rows (the SP gather's conjugate, reused over EP).
            x_TH = mappings.gather_from_sequence_parallel(x_TH, self.group, seq_dim=0, grad_is_partial=True)
            probs_TE = mappings.gather_from_sequence_parallel(
                probs_TE, self.group, seq_dim=0, grad_is_partial=True
            )
            # No grad needed for the map; bool is not a collective dtype on every backend, uint8 is.
            routing_map_TE = _gather_rows(routing_map_TE.to(torch.uint8), self.group).bool()
        else:
            t_max = T
        local_map = routing_map_TE[:, self.lo : self.hi]
        rows, token_idx, counts = permute(x_TH, local_map)
        weight = probs_TE[:, self.lo : self.hi].t()[local_map.t()]  # expert-major, as the rows
        return rows, counts, (token_idx, weight, x_TH.shape[0], T)

    def combine(self, rows_RH: torch.Tensor, handle) -> torch.Tensor:
        """Expert outputs (the dispatched order) -> [T, H], weighted by the routing probs."""
        token_idx, weight, num_rows, T = handle
        out = unpermute(rows_RH, token_idx, weight, num_rows)
        if self.ep > 1:
            # Each rank holds partial outputs (its experts) for all ranks' tokens: sum them and keep own rows;
            # [:T] drops this rank's padding.
            out = mappings.reduce_scatter_to_sequence_parallel(out, self.group, seq_dim=0)[:T]
        return out


class AllToAllDispatcher:
    """All-to-all dispatch over the EP group (None: one rank, a local permutation)."""

    def __init__(self, num_experts: int, group: Group = None) -> None:
        self.group, self.ep = group, group_size(group)
        self.num_experts = num_experts
        self.lo, self.hi = _expert_range(num_experts, group)

    def dispatch(self, x_TH, probs_TE, routing_map_TE):
        """-> (rows of the local experts [R, H], rows per local expert [El] int64, the handle
        that :meth:`combine` takes)."""
        # Expert-major over GLOBAL experts is also destination-rank-major, as each rank's experts are
        # contiguous: the rows are already laid out in all_to_all's send order.
        rows, token_idx, counts_E = permute(x_TH, routing_map_TE)
        weight = probs_TE.t()[routing_map_TE.t()]
        handle = (token_idx, weight, x_TH.shape[0])
        if self.ep == 1:
            return rows, counts_E, handle
        El = self.hi - self.lo
        # recv[src, l]: rows rank src sends to my local expert l
        recv = torch.empty_like(counts_E)
        # Counts first: the receiver must size its buffer and split the payload before the rows arrive.
        dist.all_to_all_single(recv, counts_E, group=self.group)
        recv = recv.view(self.ep, El)
        input_splits = counts_E.view(self.ep, El).sum(dim=1).tolist()
        output_splits = recv.sum(dim=1).tolist()
        rows = _AllToAll.apply(rows, output_splits, input_splits, self.group)
        # received: source-major (src 0: expert 0.., src 1: ...) -> expert-major for the GEMM
        order = _chunk_order(recv)
        return rows[order], recv.sum(dim=0), handle + (input_splits, output_splits, order)

    def combine(self, rows_RH: torch.Tensor, handle) -> torch.Tensor:
        """Expert outputs (the dispatched order) -> [T, H], weighted by the routing probs."""
        token_idx, weight, T = handle[:3]
        if self.ep > 1:
            input_splits, output_splits, order = handle[3:]
            # Invert the expert-major reorder, so the rows go back in the source-major order they arrived in.
            back = torch.empty_like(order)
            back[order] = torch.arange(order.numel(), device=order.device)
            rows_RH = _AllToAll.apply(rows_RH[back], input_splits, output_splits, self.group)
        return unpermute(rows_RH, token_idx, weight, T)


def _chunk_order(counts_SL: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder chunks laid out source-major ([s][l] for counts [S, L]) into
    local-expert-major ([l][s]). One host copy of the (small) count matrix."""
    # The split sizes must be on the host anyway (all_to_all_single takes lists): one small sync.
    counts = counts_SL.tolist()
    S, L = len(counts), len(counts[0])
    starts, offset = [[0] * L for _ in range(S)], 0
    for s in range(S):
        for l_idx in range(L):
            starts[s][l_idx], offset = offset, offset + counts[s][l_idx]
    pieces = [
        torch.arange(starts[s][l_idx], starts[s][l_idx] + counts[s][l_idx], device=counts_SL.device)
        for l_idx in range(L)
        for s in range(S)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=counts_SL.device)


def _gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along dim 0 without autograd (counts, routing maps)."""
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def build_dispatcher(kind: MoETokenDispatcher, num_experts: int, group: Group = None):
    """The dispatcher named by ``moe_token_dispatcher_type``."""
    cls = {MoETokenDispatcher.ALLGATHER: AllGatherDispatcher, MoETokenDispatcher.ALLTOALL: AllToAllDispatcher}
    if kind not in cls:
        raise ValueError(f"moe_token_dispatcher_type must be one of {DISPATCHER_TYPES}, got {kind!r}")
    return cls[MoETokenDispatcher(kind)](num_experts, group)
