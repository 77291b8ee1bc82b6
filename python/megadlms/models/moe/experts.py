"""This rank's experts as ONE grouped MLP: ``linear_fc1.weight`` [El, F1, H] and
``linear_fc2.weight`` [El, H, F] (F1 = 2F with SwiGLU: [gate | up] as the dense MLP), optional
biases [El, F1] / [El, H]. Both linears run as one ``grouped_matmul`` call over every local
expert (megadlms.ops.grouped_gemm), whatever the tokens per expert (0 included); with
``gradient_accumulation_fusion`` (the model context's, as the TP linears) the weight gradient
goes straight into DDP's ``main_grad``.

Expert parameters are declared ``expert_dim = 0`` (parallel/sharding.py): the full tensor is
[E, ...] in global expert order, EP rank e holds the experts [e*El, (e+1)*El), and the gradient
is reduced over the expert-data-parallel group, not the whole data-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megadlms.ops.grouped_gemm import grouped_matmul
from megadlms.ops.swiglu import swiglu
from megadlms.parallel.sharding import set_sharding


def mark_expert(param: torch.Tensor) -> torch.Tensor:
    """Declare ``param`` split over the expert-parallel group along dim 0 (returns it)."""
    return set_sharding(param, expert_dim=0)


def init_expert_normal_(param: torch.Tensor, std: float, ep_rank: int, ep: int) -> None:
    """normal(0, std) of the FULL [E, ...] tensor from the default generator (the same draws at
    every EP size), of which this rank keeps its experts: layout-independent initialisation."""
    local = param.shape[0]
    full = torch.empty((local * ep,) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
    nn.init.normal_(full, mean=0.0, std=std)
    # Contiguous slice: EP rank e owns experts [e*El, (e+1)*El), the layout the dispatchers assume.
    param.copy_(full[ep_rank * local : (ep_rank + 1) * local])


class GroupedLinear(nn.Module):
    """``weight`` [El, out, in] (+ ``bias`` [El, out]): rows grouped by expert -> x_e @ W_e^T + b_e."""

    def __init__(
        self, num_local: int, in_features: int, out_features: int, bias: bool, dtype, fusion: bool, name: str
    ) -> None:
        super().__init__()
        self.gradient_accumulation_fusion, self.name = fusion, name
        self.weight = mark_expert(
            nn.Parameter(torch.empty(num_local, out_features, in_features, dtype=dtype))
        )
        if bias:
            self.bias = mark_expert(nn.Parameter(torch.zeros(num_local, out_features, dtype=dtype)))
        else:
            self.register_parameter("bias", None)

    def forward(self, x_RK: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        y_RN = grouped_matmul(
            x_RK,
            self.weight,
            tokens_per_expert,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            layer_name=self.name,
        )
        if self.bias is not None:
            # Rows are grouped by expert in order, so repeating each expert id by its count labels every row.
            expert_of_row = torch.repeat_interleave(
                torch.arange(self.weight.shape[0], device=x_RK.device), tokens_per_expert
            )
            y_RN = y_RN + self.bias[expert_of_row]
        return y_RN


class GroupedMLP(nn.Module):
    """The El local experts: fc1 -> GeLU (or SwiGLU) -> fc2 on rows grouped by expert."""

    def __init__(self, config, num_local_experts: int, gradient_accumulation_fusion: bool = False) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        self.bias_swiglu_fusion = config.bias_swiglu_fusion  # CUDA tensors only (ops/fusion.py)
        F_, H = config.moe_ffn_hidden_size, config.hidden_size
        kw = dict(bias=config.add_bias_linear, dtype=config.params_dtype, fusion=gradient_accumulation_fusion)
        fc1_out = F_ * (2 if self.swiglu else 1)
        self.linear_fc1 = GroupedLinear(num_local_experts, H, fc1_out, name="experts.linear_fc1", **kw)
        self.linear_fc2 = GroupedLinear(num_local_experts, F_, H, name="experts.linear_fc2", **kw)

    def forward(self, rows_RH: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(rows_RH, tokens_per_expert)
        if self.swiglu:
            h = swiglu(h, fused=self.bias_swiglu_fusion)
        else:
            h = F.gelu(h)
        return self.linear_fc2(h, tokens_per_expert)

    @torch.no_grad()
    def init_weights(self, std: float, output_std: float, ep_rank: int, ep: int, init_expert=None) -> None:
        """Megatron's init: fc1 normal(std), fc2 normal(output_std), zero biases; full tensors.
        ``init_expert(param, std, ep)`` replaces the draw (a pipeline chunk skipping a layer)."""
        for linear, s in ((self.linear_fc1, std), (self.linear_fc2, output_std)):
            if init_expert is None:
                init_expert_normal_(linear.weight, s, ep_rank, ep)
            else:
                # A chunk skipping this layer still makes the full [E, ...] draws, keeping the RNG in step.
                init_expert(linear.weight, s, ep)
            if linear.bias is not None:
                linear.bias.zero_()
