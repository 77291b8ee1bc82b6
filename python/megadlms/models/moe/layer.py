"""MoELayer: the mixture-of-experts MLP of a transformer layer (Megatron-core's MoELayer).

``router`` (TopKRouter, fp32) -> dispatcher (allgather | alltoall over the expert-parallel
group) -> ``experts`` (GroupedMLP, this rank's El = E / ep experts) -> combine, plus the
optional ``shared_experts`` (a dense MLP every token goes through, added ungated: Megatron's
``moe_shared_expert_gate`` is off by default). Parameter names:
``mlp.router.weight`` [E, H], ``mlp.experts.linear_fc1.weight`` [El, F1, H],
``mlp.experts.linear_fc2.weight`` [El, H, F], ``mlp.shared_experts.linear_fc1.weight`` ...

The load-balancing and z losses enter the backward with ``aux_loss_scale`` (set once per step
by the caller, :func:`megadlms.models.moe.set_moe_aux_loss_scale`), and the layer keeps
running sums of them and of the tokens per expert for logging (:func:`moe_layer_stats`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megadlms.parallel.mappings import Group, group_rank, group_size

from ..recompute import recomputing
from .dispatcher import build_dispatcher
from .experts import GroupedMLP
from .router import TopKRouter


class MoELayer(nn.Module):
    """Routed experts (+ shared experts) on [B, S, H] -> [B, S, H].

    ``expert_group``: the EP process group (None: every expert on this rank).
    ``gradient_accumulation_fusion``: the experts' weight grads go into DDP's ``main_grad``.
    ``shared_experts``: the dense MLP module of the shared expert, or None.
    ``layer_number``: 1-based, as TransformerLayer's (names the statistics)."""

    def __init__(
        self,
        config,
        *,
        expert_group: Group = None,
        gradient_accumulation_fusion: bool = False,
        shared_experts: Optional[nn.Module] = None,
        layer_number: int = 1,
    ) -> None:
        super().__init__()
        E, ep = config.num_moe_experts, group_size(expert_group)
        if E % ep:
            raise ValueError(
                f"num_moe_experts {E} is not divisible by expert_model_parallel_size {ep}: "
                "each expert-parallel rank holds num_moe_experts / ep experts"
            )
        self.config, self.layer_number = config, layer_number
        self.ep, self.ep_rank = ep, group_rank(expert_group)
        self.num_local_experts = E // ep
        self.router = TopKRouter(config)
        self.experts = GroupedMLP(config, self.num_local_experts, gradient_accumulation_fusion)
        self.shared_experts = shared_experts
        self.dispatcher = build_dispatcher(config.moe_token_dispatcher_type, E, expert_group)
        self.aux_loss_scale = 1.0  # Megatron's default main_loss_backward_scale
        self.reset_stats()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        # Routing is per token: batch and sequence flatten into one token dim.
        x_TH = x_BSH.reshape(B * S, H)
        routed = self.router(x_TH, self.aux_loss_scale)
        r = routed.routing
        if self.training and not recomputing():  # a recomputation's replay is not a second forward
            self._record(routed)
        rows, tokens_per_expert, handle = self.dispatcher.dispatch(x_TH, r.probs_TE, r.routing_map_TE)
        out_TH = self.dispatcher.combine(self.experts(rows, tokens_per_expert), handle)
        if self.shared_experts is not None:
            # Ungated, as Megatron's default (moe_shared_expert_gate off).
            out_TH = out_TH + self.shared_experts(x_TH)
        return out_TH.view(B, S, H)

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zero the running sums (aux loss, z loss, forwards, tokens per expert)."""
        E = self.config.num_moe_experts
        self._sums = torch.zeros(3, dtype=torch.float64)  # aux, z, forwards
        self._tokens = torch.zeros(E, dtype=torch.float64)

    def _record(self, routed) -> None:
        # device tensors, no host sync; moved to the sums' device lazily
        dev = routed.routing.tokens_per_expert_E.device
        if self._sums.device != dev:
            self._sums, self._tokens = self._sums.to(dev), self._tokens.to(dev)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        aux = zero if routed.aux_loss is None else routed.aux_loss.to(torch.float64)
        z = zero if routed.z_loss is None else routed.z_loss.to(torch.float64)
        self._sums += torch.stack([aux, z, zero + 1])
        self._tokens += routed.routing.tokens_per_expert_E.to(torch.float64)

    def stats_tensors(self):
        """(sums [aux, z, forwards] float64, tokens per expert [E] float64) since the last reset."""
        return self._sums, self._tokens

    @torch.no_grad()
    def init_weights(self, std: float, output_std: float, init_normal, init_expert=None) -> None:
        """Megatron's init in one fixed order of FULL tensors: the router normal(std), the
        experts (fc1 std, fc2 output_std; each EP rank keeps its own), the shared experts
        with ``init_normal(param, std)`` like the dense MLP."""
        init_normal(self.router.weight, std)
        self.experts.init_weights(std, output_std, self.ep_rank, self.ep, init_expert)
        if self.shared_experts is not None:
            shared: list = [
                (self.shared_experts.linear_fc1, std),
                (self.shared_experts.linear_fc2, output_std),
            ]
            for linear, s in shared:
                init_normal(linear.weight, s)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
