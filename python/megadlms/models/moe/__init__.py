"""Mixture-of-experts MLP (Megatron-core's MoE): router, token dispatchers, grouped experts,
the layer, and the training loop's API (aux-loss scale, statistics). docs/moe.md."""

from .dispatcher import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from .experts import GroupedMLP, mark_expert
from .layer import MoELayer
from .router import TopKRouter, switch_load_balancing_loss, topk_routing, z_loss
from .stats import moe_layer_stats, moe_layers, set_moe_aux_loss_scale

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "GroupedMLP",
    "MoELayer",
    "TopKRouter",
    "build_dispatcher",
    "mark_expert",
    "moe_layer_stats",
    "moe_layers",
    "set_moe_aux_loss_scale",
    "switch_load_balancing_loss",
    "topk_routing",
    "z_loss",
]
