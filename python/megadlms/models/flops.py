"""Model FLOPs per training step, Megatron-LM's formula (training.py
``num_floating_point_operations``; Narayanan et al. 2021, appendix "floating-point operations").

Only matrix multiplies count (2*m*n*k each); a training step costs 3x the forward (forward,
weight-gradient and data-gradient GEMMs). Per layer and token the forward does
  QKV + output projections  2*h*(N*D)*(1 + G/N) * 2     (q, k, v, proj)
  attention scores + values 2 * 2*S*(N*D)               (Q K^T and P V, the full S x S)
  MLP                       2 * 2*h*F * (3/2 if swiglu)
and once per token the logits 2*h*V. An MoE layer's MLP counts its k routed experts plus the
shared expert (F = moe_ffn_hidden_size * k + shared width; the router is not counted, as
Megatron). Bidirectional attention (DLM) computes every score,
so the full S x S is counted; ``causal=True`` halves that term as newer Megatron does.
"""

from __future__ import annotations

from .config import TransformerConfig


def num_floating_point_operations(
    config: TransformerConfig, batch_size: int, seq_length: int, *, causal: bool = False
) -> float:
    """FLOPs of one training step (forward + backward) over batch_size sequences of seq_length."""
    if batch_size <= 0 or seq_length <= 0:
        raise ValueError(f"batch_size ({batch_size}) and seq_length ({seq_length}) must be positive")
    h = config.hidden_size
    query_projection_ratio = config.kv_channels * config.num_attention_heads / h
    gated = 1.5 if config.swiglu else 1.0
    # The two S x S GEMMs per token (4*S*N*D), in units of the 4*h*N*D that the q and proj terms cost.
    attention_scores = (seq_length / h) * (0.5 if causal else 1.0)
    # 12 = 3 (fwd, wgrad, dgrad) * 2 (GEMMs come in pairs) * 2 (multiply-add)
    expansion_factor = 3 * 2 * 2
    return float(
        expansion_factor
        * batch_size
        * seq_length
        * config.num_layers
        * h
        * h
        * (
            (1 + config.num_query_groups / config.num_attention_heads + attention_scores)
            * query_projection_ratio
            + (_mean_mlp_width(config) / h) * gated
            # The logits GEMM is once per token, not per layer and not a pair: / num_layers and / 2 undo the
            # factors that the common prefix multiplies in.
            + config.vocab_size / (2 * config.num_layers * h)
        )
    )


def _mean_mlp_width(config: TransformerConfig) -> float:
    """The MLP width per token averaged over the layers (dense F, or an MoE layer's k experts
    plus its shared expert)."""
    moe_width = 0
    if config.num_moe_experts is not None:
        assert config.moe_ffn_hidden_size is not None  # derived with the expert count (config.py)
        moe_width = config.moe_ffn_hidden_size * config.moe_router_topk
        moe_width += config.moe_shared_expert_intermediate_size or 0
    widths = [
        moe_width if config.is_moe_layer(i) else config.ffn_hidden_size for i in range(config.num_layers)
    ]
    return sum(widths) / config.num_layers
