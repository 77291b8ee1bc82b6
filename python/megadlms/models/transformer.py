"""Transformer building blocks with Megatron-core's module and parameter names.

Tensors are batch-first inside this package: ``x_BSH`` is [batch, seq, hidden]
(Megatron uses [seq, batch, hidden]; only the activation layout differs, the weights
and their names are the same as Megatron's local spec, so state-dict keys read
``decoder.layers.0.self_attention.linear_qkv.weight`` etc.).

Legend: B batch, S sequence, H hidden, N query heads, G query groups (kv heads),
D head width (kv_channels), F ffn width.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ATTENTION_KINDS, TransformerConfig

CORE_ATTN_IMPLEMENTATIONS = ("TEDotProductAttention", "FlexAttention")
"""MegaDLMs' --core-attn-implementation names: torch SDPA, or torch flex_attention."""


def document_attention_mask(document_ids: torch.Tensor, causal: bool, implementation: str):
    """Intra-document attention for packed samples: query i sees key j iff both belong to the
    same document (and j <= i when ``causal``). document_ids int64 [B, S].

    TEDotProductAttention: a boolean [B, 1, S, S] mask for SDPA; FlexAttention: a flex
    BlockMask (blocks of key/query pairs in different documents are skipped)."""
    B, S = document_ids.shape
    if implementation == "FlexAttention":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q, kv):
            same = document_ids[b, q] == document_ids[b, kv]
            return same & (q >= kv) if causal else same

        return create_block_mask(mask_mod, B, None, S, S, device=document_ids.device)
    mask = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        mask = mask & torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    return mask


def build_norm(config: TransformerConfig, size: int) -> nn.Module:
    """LayerNorm or RMSNorm over the last dim, created in ``config.params_dtype``."""
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.norm_epsilon, dtype=config.params_dtype)
    return nn.LayerNorm(size, eps=config.norm_epsilon, dtype=config.params_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, non-interleaved "rotate half" form as Megatron).

    Holds no parameters and no persistent buffers: the inverse frequencies are
    recomputed in fp32 on each call (a few hundred flops), so state dicts contain only
    real weights and the module needs nothing on meta-device or FSDP2 materialisation.
    """

    def __init__(self, kv_channels: int, rotary_base: int = 10000) -> None:
        super().__init__()
        if kv_channels % 2:
            raise ValueError(f"RotaryEmbedding needs an even head width, got kv_channels={kv_channels}")
        self.kv_channels = kv_channels
        self.rotary_base = rotary_base

    def forward(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """position_ids int64 [B, S] -> (cos, sin), each fp32 [B, S, 1, D]."""
        dim = self.kv_channels
        exponent = torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim
        inv_freq_D2 = 1.0 / (float(self.rotary_base) ** exponent)
        freqs_BSD2 = position_ids.to(torch.float32)[..., None] * inv_freq_D2
        emb_BSD = torch.cat((freqs_BSD2, freqs_BSD2), dim=-1)
        return emb_BSD.cos()[:, :, None, :], emb_BSD.sin()[:, :, None, :]


def apply_rotary(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of every head by the position angle (Megatron bshd form)."""
    x1, x2 = x_BSND.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_BSND * cos.to(x_BSND.dtype) + rotated * sin.to(x_BSND.dtype)


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention through F.scaled_dot_product_attention.

    ``linear_qkv`` uses Megatron's grouped layout: its output is G blocks, each holding the
    N/G query heads of the group followed by that group's key head and value head, so a
    Megatron checkpoint's weight drops in unchanged.
    """

    def __init__(self, config: TransformerConfig, attention: str) -> None:
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        self.attention = attention
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        self.attention_dropout = config.attention_dropout
        dt = config.params_dtype
        qkv_out = self.num_groups * (self.num_heads // self.num_groups + 2) * self.head_dim
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=qkv_bias, dtype=dt)
        self.linear_proj = nn.Linear(
            self.num_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear, dtype=dt
        )
        if config.qk_layernorm:
            self.q_layernorm = build_norm(config, self.head_dim)
            self.k_layernorm = build_norm(config, self.head_dim)
        else:
            self.q_layernorm = None
            self.k_layernorm = None

    def forward(
        self,
        x_BSH: torch.Tensor,
        rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        doc_mask=None,
    ) -> torch.Tensor:
        """``doc_mask``: None, or :func:`document_attention_mask`'s mask (document packing)."""
        B, S, _ = x_BSH.shape
        G, D = self.num_groups, self.head_dim
        per_group = self.num_heads // G
        qkv_BSGX = self.linear_qkv(x_BSH).view(B, S, G, (per_group + 2) * D)
        q, k, v = torch.split(qkv_BSGX, [per_group * D, D, D], dim=-1)
        q_BSND = q.reshape(B, S, self.num_heads, D)
        k_BSGD, v_BSGD = k, v
        if self.q_layernorm is not None:
            q_BSND = self.q_layernorm(q_BSND)
            k_BSGD = self.k_layernorm(k_BSGD)
        if rotary is not None:
            q_BSND = apply_rotary(q_BSND, *rotary)
            k_BSGD = apply_rotary(k_BSGD, *rotary)
        dropout_p = self.attention_dropout if self.training else 0.0
        q, k, v = q_BSND.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2)
        if doc_mask is not None and not isinstance(doc_mask, torch.Tensor):  # flex BlockMask
            from torch.nn.attention.flex_attention import flex_attention

            if dropout_p > 0:
                raise ValueError(
                    "FlexAttention has no attention dropout: set attention_dropout 0 "
                    "or use core_attn_implementation TEDotProductAttention"
                )
            out_BNSD = flex_attention(q, k, v, block_mask=doc_mask, enable_gqa=G != self.num_heads)
        else:
            # bidirectional: no mask at all (every position attends to every position); packed:
            # the document mask (which already holds the causal part).
            out_BNSD = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=doc_mask,
                dropout_p=dropout_p,
                is_causal=self.attention == "causal" and doc_mask is None,
                enable_gqa=G != self.num_heads,
            )
        out_BSX = out_BNSD.transpose(1, 2).reshape(B, S, self.num_heads * D)
        return self.linear_proj(out_BSX)


class MLP(nn.Module):
    """h -> F -> h feed-forward; with swiglu linear_fc1 emits [gate | up] (Megatron order)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
        dt = config.params_dtype
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear, dtype=dt)
        self.linear_fc2 = nn.Linear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear, dtype=dt
        )

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        h_BSF = self.linear_fc1(x_BSH)
        if self.swiglu:
            gate, up = h_BSF.chunk(2, dim=-1)
            h_BSF = F.silu(gate) * up
        else:
            h_BSF = F.gelu(h_BSF)
        return self.linear_fc2(h_BSF)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

    One FSDP2 sharding unit; parameter names match Megatron's local layer spec.
    """

    def __init__(
        self, config: TransformerConfig, attention: str = "bidirectional", layer_number: int = 1
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = SelfAttention(config, attention)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, x_BSH: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, doc_mask=None
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x_BSH), rotary, doc_mask)
        x_BSH = x_BSH + self.hidden_dropout(attn)
        return x_BSH + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x_BSH)))


class TransformerBlock(nn.Module):
    """``layers`` (ModuleList of TransformerLayer) followed by ``final_layernorm``."""

    def __init__(self, config: TransformerConfig, attention: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(config, attention, layer_number=i + 1) for i in range(config.num_layers)
        )
        self.final_layernorm = build_norm(config, config.hidden_size)

    def forward(
        self, x_BSH: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, doc_mask=None
    ) -> torch.Tensor:
        for layer in self.layers:
            x_BSH = layer(x_BSH, rotary, doc_mask)
        return self.final_layernorm(x_BSH)


def init_transformer_weights(block: TransformerBlock, config: TransformerConfig) -> None:
    """Megatron init: normal(0, std) for input projections, std/sqrt(2L) for the output
    projections (linear_proj, linear_fc2), zero biases, norms at (1, 0)."""
    std = config.init_method_std
    scaled_std = std / math.sqrt(2.0 * config.num_layers)
    with torch.no_grad():
        for layer in block.layers:
            attn, mlp = layer.self_attention, layer.mlp
            for linear, s in (
                (attn.linear_qkv, std),
                (attn.linear_proj, scaled_std),
                (mlp.linear_fc1, std),
                (mlp.linear_fc2, scaled_std),
            ):
                nn.init.normal_(linear.weight, mean=0.0, std=s)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
        for module in block.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
