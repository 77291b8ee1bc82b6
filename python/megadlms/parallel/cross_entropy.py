"""Cross-entropy over vocab-split logits that never gathers the full vocab.

Each TP rank holds the logits of a contiguous vocab range ``[r * V/tp, (r + 1) * V/tp)`` (the
output of a column-parallel output layer, or of :class:`VocabParallelEmbedding`'s transposed
weight). Per token: the max over the vocab is all-reduced (MAX), the target's logit comes from
the one rank that owns it (all-reduce SUM of a one-hot contribution), and the sum of
``exp(logit - max)`` is all-reduced (SUM); loss = ``log(sum_exp) - (target_logit - max)``.

Backward: ``d loss / d logits = softmax - onehot(target)``, both computable locally from the
saved softmax shard, so backward needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadlms.parallel.mappings import Group, group_rank, group_size


def _all_reduce_(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        vocab_local = logits.shape[-1]
        start = group_rank(group) * vocab_local
        # Computed in fp32 whatever the logits' dtype (as Megatron's fp32 cross-entropy).
        x = logits.float()
        # The GLOBAL max, so every rank shifts by the same constant and the partial exp sums can be added.
        logits_max = _all_reduce_(x.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = x - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + vocab_local)
        # Index 0 only keeps gather in bounds for targets owned elsewhere; their value is masked to 0, so the
        # SUM all-reduce below yields exactly the owner's logit.
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = _all_reduce_(predicted, group)

        exp = shifted.exp()
        sum_exp = _all_reduce_(exp.sum(dim=-1), group)
        loss = sum_exp.log() - predicted

        # In place: exp becomes the softmax shard, the one activation backward needs, with no extra copy.
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        # Subtract the one-hot only on the rank that owns the target id.
        # Non-owners add 0 at the dummy index 0, so no branch is needed.
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Group) -> torch.Tensor:
    """Per-token cross-entropy losses (fp32, shape of ``target``) from this rank's vocab slice
    ``logits[..., V/tp]`` and full-vocab ``target`` ids; equals
    ``F.cross_entropy(full_logits, target, reduction="none")``. ``tp_group=None``: one process."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits of shape {tuple(logits.shape)} need target of shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
