"""Megatron's weight initialisation of a transformer block, layout independent: every draw is
of the FULL logical tensor in one fixed order, so a model initialised at any (tp, pp, ep) holds
the same weights as on one process (the layers of other pipeline chunks are drawn and dropped)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megadlms.parallel import TensorParallelContext
from megadlms.parallel.sharding import full_shape, local_from_full, shard_spec

from .config import TransformerConfig
from .moe import MoELayer
from .transformer import NO_TENSOR_PARALLEL, TransformerBlock, TransformerLayer


def init_normal_(param: torch.Tensor, std: float, tp: TensorParallelContext) -> None:
    """normal(0, std) init of ``param`` from the default generator, layout independent: a
    tensor-parallel shard draws its FULL logical tensor (the same draws at every tp and on one
    process) and keeps its own part (``sharding.local_from_full``). A replicated parameter,
    or any parameter at tp = 1, is drawn in place, exactly as ``nn.init.normal_``."""
    spec = shard_spec(param)
    if spec is None or tp.size == 1:
        nn.init.normal_(param, mean=0.0, std=std)
        return
    # The full tensor, not the shard: the draws must not depend on tp.
    full = torch.empty(full_shape(param, tp.size), dtype=param.dtype, device=param.device)
    nn.init.normal_(full, mean=0.0, std=std)
    param.copy_(local_from_full(full, param, tp.group))


def skip_normal_(param: torch.Tensor, std: float, tp: TensorParallelContext, device) -> None:
    """Make the draws :func:`init_normal_` would make for ``param`` (a meta stand-in of a
    weight another pipeline chunk holds) on ``device`` and drop them: the default generator
    then stands where it would after initialising the whole model up to there."""
    shape = tuple(param.shape) if shard_spec(param) is None or tp.size == 1 else full_shape(param, tp.size)
    torch.empty(shape, dtype=param.dtype, device=device).normal_(mean=0.0, std=std)


def _init_layer_weights(
    layer: TransformerLayer, std: float, scaled_std: float, init, init_expert=None
) -> None:
    """One layer's draws in the fixed order: attention, then the MLP (dense, or the MoE
    router, experts and shared experts). ``init_expert(param, std, ep)``: the experts' full
    [E, ...] draw (default: :func:`moe.experts.init_expert_normal_`)."""
    attn, mlp = layer.self_attention, layer.mlp
    linears: list = [(attn.linear_qkv, std), (attn.linear_proj, scaled_std)]
    if not isinstance(mlp, MoELayer):
        linears += [(mlp.linear_fc1, std), (mlp.linear_fc2, scaled_std)]
    for linear, s in linears:
        init(linear.weight, s)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)
    if isinstance(mlp, MoELayer):  # router, experts (full [E, ...] tensors), shared experts
        mlp.init_weights(std, scaled_std, init, init_expert)


def init_transformer_weights(
    block: TransformerBlock, config: TransformerConfig, tp: TensorParallelContext = NO_TENSOR_PARALLEL
) -> None:
    """Megatron init: normal(0, std) for input projections, std/sqrt(2L) for the output
    projections (linear_proj, linear_fc2), zero biases, norms at (1, 0). The draws are made in
    one fixed order of FULL tensors (:func:`init_normal_`), the same at every tp; the layers of
    other pipeline chunks are drawn and dropped (:func:`skip_normal_`), so a chunk's weights are
    the whole model's."""
    std = config.init_method_std
    # Output projections feed the residual stream, 2 per layer: scaling keeps its variance from growing
    # with depth (GPT-2 / Megatron).
    scaled_std = std / math.sqrt(2.0 * config.num_layers)
    device = next(block.parameters()).device
    with torch.no_grad():
        for i in range(config.num_layers):
            layer = block.layers.by_global(i)
            if isinstance(layer, TransformerLayer):
                _init_layer_weights(layer, std, scaled_std, lambda p, s: init_normal_(p, s, tp))
                continue
            with torch.device("meta"):  # per layer: moe_layer_freq makes layers differ
                ghost = TransformerLayer(config, block.attention, layer_number=i + 1, tp=tp)
            _init_layer_weights(
                ghost,
                std,
                scaled_std,
                lambda p, s: skip_normal_(p, s, tp, device),
                # Experts hold E/ep locally: skip the full [E, ...] draw that init_expert_normal_ would make.
                lambda p, s, ep: skip_normal_(p.new_empty((p.shape[0] * ep,) + p.shape[1:]), s, tp, device),
            )
        # Norms reset to (1, 0) without random draws, so doing them last leaves the draw order intact.
        for module in block.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
