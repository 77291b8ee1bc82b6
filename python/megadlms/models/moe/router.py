"""The MoE router: fp32 logits, top-k routing with optional capacity, and the aux losses.

Megatron-core's rules (megatron/core/transformer/moe/router.py, moe_utils.py), written for
tokens-first tensors: ``x_TH`` [tokens, hidden], ``logits_TE`` / ``probs_TE`` [tokens, experts].

- softmax: top-k of the logits then a softmax over the k chosen (``pre_softmax``: softmax over
  all experts first, the chosen probabilities are not renormalised); sigmoid: top-k of
  sigmoid(logits), renormalised to sum 1 when k > 1.
- capacity (``capacity_factor``): every expert keeps at most ceil(T * k / E * factor) of this
  micro-batch's tokens, by routing probability (``drop_policy="probs"``) or by position
  ("position"); ties go to the earlier token (a stable sort), so routing is deterministic.
  ``pad_to_capacity``: every expert gets exactly that many rows, the extra ones with weight 0.
- load balancing (Switch): ``E * coeff / (k * T^2) * sum_e (sum_t scores_te) * f_e`` with
  ``scores`` the full softmax (or normalised sigmoid) and ``f_e`` the tokens routed to expert e
  before any dropping; z-loss: ``coeff * mean_t logsumexp(logits_t)^2``.

The losses never appear in the forward value: :class:`AuxLossAutoScaler` attaches them to an
activation so that backward adds ``scale * d(loss)`` (Megatron's MoEAuxLossAutoScaler; the
scale is the layer's, set by the caller once per step, not a global).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


class Routing(NamedTuple):
    """The result of routing T tokens over E experts."""

    probs_TE: torch.Tensor
    """fp32 weight of each (token, expert) pair; zero where the pair is not routed."""
    routing_map_TE: torch.Tensor
    """bool: the (token, expert) pairs that are computed (after dropping / padding)."""
    tokens_per_expert_E: torch.Tensor
    """int64: tokens the top-k chose for each expert, before capacity dropping."""


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron's ``get_capacity(num_tokens * topk, num_experts, capacity_factor)``, at most T."""
    return min(num_tokens, math.ceil(num_tokens * topk / num_experts * capacity_factor))


def topk_routing(
    logits_TE: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    capacity_factor: Optional[float] = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Routing:
    """Route each token to ``topk`` experts (see the module docstring); ``logits_TE`` fp32."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"moe_router_score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}"
        )
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"moe_token_drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    T, E = logits_TE.shape
    if score_function == "softmax":
        if pre_softmax:
            top_probs, top_idx = torch.topk(torch.softmax(logits_TE, dim=-1), k=topk, dim=-1)
        else:
            top_logits, top_idx = torch.topk(logits_TE, k=topk, dim=-1)
            # Softmax over the k chosen only, so each token's kept weights sum to 1.
            top_probs = torch.softmax(top_logits, dim=-1)
    else:
        top_probs, top_idx = torch.topk(torch.sigmoid(logits_TE), k=topk, dim=-1)
        if topk > 1:
            # Top-1 keeps the raw sigmoid (Megatron); 1e-20 guards a row whose sigmoids all underflow.
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    # Dense [T, E]: capacity and dispatch work per expert column from here on.
    gates_TE = torch.zeros_like(logits_TE).scatter(1, top_idx, top_probs)
    topk_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, top_idx, True)
    # Counted before dropping: the balancing loss penalises what the router asked for, not what survived.
    tokens_per_expert = topk_map_TE.sum(dim=0, dtype=torch.int64)
    if capacity_factor is None:
        return Routing(gates_TE, topk_map_TE, tokens_per_expert)
    capacity = expert_capacity(T, E, topk, capacity_factor)
    # "position": every chosen pair has key 1 (unchosen 0), so the stable sort keeps the earliest tokens.
    key = gates_TE.detach() if drop_policy == "probs" else topk_map_TE.to(torch.float32)
    # stable: among equal keys the earlier token wins (position order, deterministic)
    # Sorted down the token dim, per expert column: the first ``capacity`` rows are each expert's keepers.
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
    capacity_map_TE = torch.zeros_like(topk_map_TE).scatter(0, order, True)
    # Padding keeps all capacity slots, also tokens that did not pick the expert: their gate is 0, so
    # they cost compute but add nothing to the output.
    final_map = capacity_map_TE if pad_to_capacity else topk_map_TE & capacity_map_TE
    return Routing(gates_TE * final_map, final_map, tokens_per_expert)


def aux_loss_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """The per-expert scores the load-balancing loss uses: the full softmax, or the sigmoid
    normalised over the experts (Megatron's compute_routing_scores_for_aux_loss)."""
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    scores = torch.sigmoid(logits_TE)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_load_balancing_loss(
    scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, topk: int, coeff: float
) -> torch.Tensor:
    """``E * coeff / (k * T^2) * sum_e (sum_t scores_te) * tokens_per_expert_e`` (fp32, 0-d)."""
    T, E = scores_TE.shape
    weighted = (scores_TE.sum(dim=0) * tokens_per_expert_E.to(scores_TE.dtype)).sum()
    return weighted * (E * coeff / (topk * T * T))


def z_loss(logits_TE: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss ``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE; fp32, 0-d)."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean() * coeff


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``activation``; its backward also sends ``scale`` as the gradient of
    ``aux_loss``, so the loss joins the backward without being added to the output."""

    @staticmethod
    def forward(ctx, activation, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        # Unchanged: the aux loss must not show up in the forward value (or in the logged loss).
        return activation

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        # Backward is where the loss joins: its graph is seeded with d(total)/d(aux) = scale, and the
        # activation's own grad passes through untouched.
        return grad, torch.ones_like(aux_loss) * ctx.scale, None  # scale: a float or a 0-d tensor


class RouterOutput(NamedTuple):
    """What :meth:`TopKRouter.forward` returns (losses detached, for the statistics)."""

    routing: Routing
    aux_loss: Optional[torch.Tensor]
    z_loss: Optional[torch.Tensor]


class TopKRouter(nn.Module):
    """``weight`` [E, H] (replicated); logits in fp32 whatever the parameter dtype."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        E, H = config.num_moe_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, H, dtype=config.params_dtype))

    def forward(self, x_TH: torch.Tensor, aux_loss_scale: float = 1.0) -> RouterOutput:
        c = self.config
        # fp32 logits: the softmax and top-k near-ties are sensitive to bf16 rounding.
        logits_TE = x_TH.float() @ self.weight.float().t()
        # No backward will run in eval / no_grad, so there is nothing to attach the losses to.
        attach = self.training and torch.is_grad_enabled()
        z = None
        if c.moe_z_loss_coeff is not None:
            z = z_loss(logits_TE, c.moe_z_loss_coeff)
            if attach:
                # On the logits, which the routing uses, so the z-loss graph is reached in every backward.
                logits_TE = AuxLossAutoScaler.apply(logits_TE, z, aux_loss_scale)
        routing = topk_routing(
            logits_TE,
            c.moe_router_topk,
            score_function=c.moe_router_score_function,
            pre_softmax=c.moe_router_pre_softmax,
            capacity_factor=c.moe_expert_capacity_factor,
            drop_policy=c.moe_token_drop_policy,
            pad_to_capacity=c.moe_pad_expert_input_to_capacity,
        )
        aux = None
        if c.moe_router_load_balancing_type == "aux_loss":
            scores = aux_loss_scores(logits_TE, c.moe_router_score_function)
            aux = switch_load_balancing_loss(
                scores, routing.tokens_per_expert_E, c.moe_router_topk, c.moe_aux_loss_coeff
            )
            if attach:
                # On the probs, which every routed output depends on, so backward always reaches the aux loss.
                probs = AuxLossAutoScaler.apply(routing.probs_TE, aux, aux_loss_scale)
                routing = routing._replace(probs_TE=probs)
        return RouterOutput(
            routing,
            None if aux is None else aux.detach(),
            None if z is None else z.detach(),
        )
