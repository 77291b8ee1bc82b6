"""Transformer building blocks with Megatron-core's module and parameter names.

Tensors are batch-first inside this package: ``x_BSH`` is [batch, seq, hidden]
(Megatron uses [seq, batch, hidden]; only the activation layout differs, the weights
and their names are the same as Megatron's local spec, so state-dict keys read
``decoder.layers.0.self_attention.linear_qkv.weight`` etc.).

Legend: B batch, S sequence, H hidden, N query heads, G query groups (kv heads),
D head width (kv_channels), F ffn width; a trailing ``l`` (``Nl``, ``Gl``, ``Fl``) is this
tensor-parallel rank's share (N/tp ...), ``Sl`` this rank's sequence chunk (S/tp) under
sequence parallelism.

Tensor parallelism (``TensorParallelContext``, docs/parallel.md): the linears are always
megadlms.parallel's Column/RowParallelLinear, which are plain linears when the TP group is
None, so a tp=1 model has exactly the parameters, names and shapes of the plain model.
Attention is split by heads (linear_qkv column-parallel, linear_proj row-parallel), the MLP by
its width (linear_fc1 column-parallel, SwiGLU's [gate | up] as two blocks, linear_fc2
row-parallel). Replicated parameters whose gradient is only partial on each TP rank carry
``ParamSharding.tp_partial_grad`` (the data-parallel wrapper all-reduces them over the TP group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megadlms.common.enums import AttnMaskType, RecomputeGranularity
from megadlms.ops import apply_rotary, residual_add_norm, swiglu
from megadlms.ops.kv_cache import CachedAttention
from megadlms.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelContext
from megadlms.parallel.context_parallel import ContextParallelPlan
from megadlms.parallel.sharding import set_sharding

from .config import ATTENTION_KINDS, TransformerConfig
from .moe import MoELayer
from .recompute import checkpoint, checkpointed_layers_forward, recompute_problems
from .rope_scaling import scaled_inv_freq

CORE_ATTN_IMPLEMENTATIONS = ("TEDotProductAttention", "FlexAttention")

NO_TENSOR_PARALLEL = TensorParallelContext()
"""The default ``tp`` of every module here: one process, no TP group (the plain model)."""
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
    # [B, 1, S, S]: the singleton dim broadcasts the mask over the heads.
    mask = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        mask = mask & torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    return mask


def build_norm(config: TransformerConfig, size: int, grad_is_partial: bool = False) -> nn.Module:
    """LayerNorm or RMSNorm over the last dim, created in ``config.params_dtype``.

    ``grad_is_partial``: each TP rank sees only part of the norm's input (its sequence chunk,
    or its heads), so its parameters are declared ``tp_partial_grad`` (all-reduce over TP)."""
    norm: nn.Module
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(size, eps=config.norm_epsilon, dtype=config.params_dtype)
    else:
        norm = nn.LayerNorm(size, eps=config.norm_epsilon, dtype=config.params_dtype)
    if grad_is_partial:
        for param in norm.parameters():
            set_sharding(param, tp_partial_grad=True)
    return norm


def _linear_kwargs(tp: TensorParallelContext) -> dict:
    """The keyword arguments every TP linear of the model shares (the one place they are built)."""
    return {
        "tp_group": tp.group,
        "sequence_parallel": tp.sequence_parallel,
        "gradient_accumulation_fusion": tp.gradient_accumulation_fusion,
    }


def _torch_default_linear_init(bias: bool):
    """Construction-time init of a full [out, in] weight with exactly the draws nn.Linear makes
    (kaiming-uniform weight, then a uniform bias), so the default RNG stream reaches
    ``reset_parameters`` in the state it did when the model was built of nn.Linear: the tp=1
    initialisation is unchanged by the switch to the parallel layers. The bias draw is made
    and dropped (the parallel layers start their biases at zero; reset_parameters zeroes them)."""

    def init(weight: torch.Tensor, generator: Optional[torch.Generator]) -> None:
        with torch.no_grad():
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
            if bias:
                bound = 1.0 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
                drop = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
                drop.uniform_(-bound, bound, generator=generator)

    return init


def dropout_rng(tp: TensorParallelContext, split: bool):
    """The RNG context of a dropout: the model-parallel stream when the activation is ``split``
    across TP ranks (different per rank) and a tracker is given, else the default generator."""
    if split and tp.rng_tracker is not None:
        return tp.rng_tracker.fork()
    return contextlib.nullcontext()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, non-interleaved "rotate half" form as Megatron).

    Holds no parameters and no persistent buffers: the inverse frequencies are
    recomputed in fp32 on each call (a few hundred flops), so state dicts contain only
    real weights and the module needs nothing on meta-device or FSDP2 materialisation.
    """

    def __init__(
        self, kv_channels: int, rotary_base: int = 10000, rope_scaling: Optional[dict] = None
    ) -> None:
        super().__init__()
        if kv_channels % 2:
            raise ValueError(f"RotaryEmbedding needs an even head width, got kv_channels={kv_channels}")
        self.kv_channels = kv_channels
        self.rotary_base = rotary_base
        self.rope_scaling = rope_scaling  # None: plain RoPE (models/rope_scaling.py)

    def forward(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """position_ids int64 [B, S] -> (cos, sin), each fp32 [B, S, 1, D]."""
        dim = self.kv_channels
        exponent = torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim
        # Kept in fp32: in bf16 the angles of far positions lose the bits that tell neighbours apart.
        inv_freq_D2 = 1.0 / (float(self.rotary_base) ** exponent)
        scale = 1.0
        if self.rope_scaling is not None:
            inv_freq_D2, scale = scaled_inv_freq(
                float(self.rotary_base) ** exponent, dim, float(self.rotary_base), self.rope_scaling
            )
        freqs_BSD2 = position_ids.to(torch.float32)[..., None] * inv_freq_D2
        # Repeated, not interleaved: frequency j drives both dim j and dim j + D/2 (the rotate-half layout,
        # which is what Megatron checkpoints' q/k weights were trained with).
        emb_BSD = torch.cat((freqs_BSD2, freqs_BSD2), dim=-1)
        cos, sin = emb_BSD.cos(), emb_BSD.sin()
        if scale != 1.0:  # yarn's attention factor, on cos and sin as transformers applies it
            cos, sin = cos * scale, sin * scale
        # Singleton head dim: the same angles broadcast over q's N heads and k's G heads.
        return cos[:, :, None, :], sin[:, :, None, :]


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention through F.scaled_dot_product_attention.

    ``linear_qkv`` uses Megatron's grouped layout: its output is G blocks, each holding the
    N/G query heads of the group followed by that group's key head and value head, so a
    Megatron checkpoint's weight drops in unchanged. Under tensor parallelism a contiguous
    split of that output gives each rank G/tp whole groups (N/tp query heads): linear_qkv is
    column-parallel, linear_proj row-parallel, and attention runs on this rank's heads.
    """

    def __init__(
        self,
        config: TransformerConfig,
        attention: str,
        *,
        tp: TensorParallelContext = NO_TENSOR_PARALLEL,
        layer_number: int = 1,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number  # the slot of its keys/values in a KVCache
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        self.attention = AttnMaskType(attention)
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_groups = config.num_query_groups // tp.size
        # A bool fixed at construction: under torch.compile an int attribute can turn dynamic
        # after a recompile, and SDPA then rejects the SymBool `num_groups != num_heads`.
        self.enable_gqa = bool(self.num_groups != self.num_heads)
        self.head_dim = config.kv_channels
        self.attention_dropout = config.attention_dropout
        self.recompute_core_attention = config.recompute_granularity == RecomputeGranularity.SELECTIVE
        self.apply_rope_fusion = config.apply_rope_fusion  # CUDA tensors only (ops/fusion.py)
        dt = config.params_dtype
        N, G, D = config.num_attention_heads, config.num_query_groups, self.head_dim
        # G groups of [N/G query heads | k | v]: whole groups per rank under a contiguous TP split, which is
        # why num_query_groups (not just the heads) must divide by tp.
        qkv_out = G * (N // G + 2) * D
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_out,
            bias=qkv_bias,
            init_method=_torch_default_linear_init(qkv_bias),
            dtype=dt,
            **_linear_kwargs(tp),
        )
        self.linear_proj = RowParallelLinear(
            N * D,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=_torch_default_linear_init(config.add_bias_linear),
            dtype=dt,
            **_linear_kwargs(tp),
        )
        self.q_layernorm: Optional[nn.Module] = None
        self.k_layernorm: Optional[nn.Module] = None
        if config.qk_layernorm:
            # Replicated weights applied to this rank's heads only: partial grads under TP.
            self.q_layernorm = build_norm(config, self.head_dim, grad_is_partial=tp.size > 1)
            self.k_layernorm = build_norm(config, self.head_dim, grad_is_partial=tp.size > 1)

    def forward(
        self,
        x_BSH: torch.Tensor,
        rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        doc_mask=None,
    ) -> torch.Tensor:
        """``x_BSH``: [B, S, H], or [B, Sl, H] under sequence parallelism (linear_qkv gathers
        the sequence, so attention always sees all S positions). ``doc_mask``: None,
        :func:`document_attention_mask`'s mask (document packing), a ContextParallelPlan or a
        CachedAttention (generation with a KV cache)."""
        G, D = self.num_groups, self.head_dim
        per_group = self.num_heads // G
        qkv_BSX = self.linear_qkv(x_BSH)
        B, S, _ = qkv_BSX.shape
        qkv_BSGX = qkv_BSX.view(B, S, G, (per_group + 2) * D)
        # Split inside each group: k and v are one head per group, shared by its per_group query heads.
        q, k, v = torch.split(qkv_BSGX, [per_group * D, D, D], dim=-1)
        q_BSND = q.reshape(B, S, self.num_heads, D)
        k_BSGD, v_BSGD = k, v
        if self.q_layernorm is not None and self.k_layernorm is not None:
            # Per-head norm before rotary, as Megatron.
            q_BSND = self.q_layernorm(q_BSND)
            k_BSGD = self.k_layernorm(k_BSGD)
        if rotary is not None:
            q_BSND = apply_rotary(q_BSND, *rotary, fused=self.apply_rope_fusion)
            k_BSGD = apply_rotary(k_BSGD, *rotary, fused=self.apply_rope_fusion)
        dropout_p = self.attention_dropout if self.training else 0.0
        q, k, v = q_BSND.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2)
        if isinstance(doc_mask, CachedAttention):  # generation: keys/values of the cache (eval only)
            out_BNSD = doc_mask.attention(self.layer_number, q, k, v, enable_gqa=self.enable_gqa)
        elif isinstance(doc_mask, ContextParallelPlan):  # context parallelism: K/V gathered over cp
            with dropout_rng(self.tp, split=dropout_p > 0):
                out_BNSD = doc_mask.attention(q, k, v, dropout_p, enable_gqa=self.enable_gqa)
        elif doc_mask is not None and not isinstance(doc_mask, torch.Tensor):  # flex BlockMask
            from torch.nn.attention.flex_attention import flex_attention

            if dropout_p > 0:
                raise ValueError(
                    "FlexAttention has no attention dropout: set attention_dropout 0 "
                    "or use core_attn_implementation TEDotProductAttention"
                )
            # enable_gqa lets each k/v head serve its N/G query heads without materialising repeated copies.
            out_BNSD = flex_attention(q, k, v, block_mask=doc_mask, enable_gqa=self.enable_gqa)
        else:
            # bidirectional: no mask at all (every position attends to every position); packed:
            # the document mask (which already holds the causal part). The dropout acts on
            # this rank's heads: it draws from the model-parallel stream (differs per rank).
            def core_attention(q, k, v):
                with dropout_rng(self.tp, split=dropout_p > 0):
                    return F.scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        attn_mask=doc_mask,
                        dropout_p=dropout_p,
                        # SDPA rejects a mask with is_causal; the document mask already holds the causal part.
                        is_causal=self.attention == AttnMaskType.CAUSAL and doc_mask is None,
                        enable_gqa=self.enable_gqa,
                    )

            if self.recompute_core_attention and self.training:  # --recompute-granularity selective
                out_BNSD = checkpoint(core_attention, self.tp.rng_tracker, None, q, k, v)
            else:
                out_BNSD = core_attention(q, k, v)
        out_BSX = out_BNSD.transpose(1, 2).reshape(B, S, self.num_heads * D)
        return self.linear_proj(out_BSX)


class MLP(nn.Module):
    """h -> F -> h feed-forward; with swiglu linear_fc1 emits [gate | up] (Megatron order).

    Under TP linear_fc1 is column-parallel (with swiglu as two blocks, so each rank holds the
    matching F/tp gate and up rows) and linear_fc2 row-parallel."""

    def __init__(self, config: TransformerConfig, *, tp: TensorParallelContext = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        self.bias_swiglu_fusion = config.bias_swiglu_fusion  # CUDA tensors only (ops/fusion.py)
        fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
        dt = config.params_dtype
        bias = config.add_bias_linear
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_out,
            bias=bias,
            init_method=_torch_default_linear_init(bias),
            dtype=dt,
            # Two blocks: a plain split would give low ranks only gate rows and high ranks only up rows.
            partition_blocks=2 if config.swiglu else 1,
            **_linear_kwargs(tp),
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            bias=bias,
            input_is_parallel=True,
            init_method=_torch_default_linear_init(bias),
            dtype=dt,
            **_linear_kwargs(tp),
        )

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        h_BSF = self.linear_fc1(x_BSH)  # [B, S, Fl] (x2 with swiglu)
        if self.swiglu:
            # Locally [gate | up] of the SAME F/tp features, which the two-block sharding guarantees.
            h_BSF = swiglu(h_BSF, fused=self.bias_swiglu_fusion)
        else:
            h_BSF = F.gelu(h_BSF)
        return self.linear_fc2(h_BSF)


def build_mlp(config: TransformerConfig, layer_number: int, tp: TensorParallelContext) -> nn.Module:
    """The MLP of layer ``layer_number`` (1-based): an MoELayer where ``moe_layer_freq`` says
    so (experts over ``tp.expert_group``; the shared expert a dense MLP), else the dense MLP."""
    if not config.is_moe_layer(layer_number - 1):
        return MLP(config, tp=tp)
    shared = None
    if config.moe_shared_expert_intermediate_size is not None:
        width = config.moe_shared_expert_intermediate_size
        shared = MLP(dataclasses.replace(config, ffn_hidden_size=width, num_moe_experts=None), tp=tp)
    return MoELayer(
        config,
        expert_group=tp.expert_group,
        gradient_accumulation_fusion=tp.gradient_accumulation_fusion,
        shared_experts=shared,
        layer_number=layer_number,
    )


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

    One FSDP2 sharding unit; parameter names match Megatron's local layer spec. Under sequence
    parallelism ``x`` is this rank's sequence chunk: the norms see only it (partial grads) and
    the hidden dropout draws from the model-parallel stream (Megatron does the same).
    """

    def __init__(
        self,
        config: TransformerConfig,
        attention: str = AttnMaskType.BIDIRECTIONAL,
        layer_number: int = 1,
        *,
        tp: TensorParallelContext = NO_TENSOR_PARALLEL,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.tp = tp
        # SP: the norms see only this rank's tokens, so their weight grads are partial over TP.
        self.input_layernorm = build_norm(config, config.hidden_size, grad_is_partial=tp.sequence_parallel)
        self.self_attention = SelfAttention(config, attention, tp=tp, layer_number=layer_number)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size, grad_is_partial=tp.sequence_parallel)
        self.mlp = build_mlp(config, layer_number, tp)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        # RMSNorm models on CUDA tensors only (ops/fusion.py); the dropout stays torch's, before it.
        self.residual_rmsnorm_fusion = config.residual_rmsnorm_fusion

    def forward(
        self, x_BSH: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, doc_mask=None
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x_BSH), rotary, doc_mask)
        # x + drop(attn) and pre_mlp_layernorm of it, in one kernel where fused
        x_BSH, normed_BSH = residual_add_norm(
            x_BSH, self._dropout(attn), self.pre_mlp_layernorm, fused=self.residual_rmsnorm_fusion
        )
        return x_BSH + self._dropout(self.mlp(normed_BSH))

    def _dropout(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout.p == 0:
            return x_BSH
        # SP: each rank holds different tokens, so the masks must differ; without SP the activation is
        # replicated over TP and the default stream keeps the masks identical, as they must be.
        with dropout_rng(self.tp, split=self.tp.sequence_parallel):
            return self.hidden_dropout(x_BSH)


class TransformerLayers(nn.Module):
    """A chunk's transformer layers, registered under their GLOBAL indices (so parameter names
    read ``decoder.layers.{global_i}.…`` in every pipeline chunk, exactly the whole model's).

    Behaves like the ``nn.ModuleList`` it replaces: ``len``, iteration in layer order and
    ``layers[i]`` / slices by POSITION in this chunk (for the whole model position == global
    index). ``global_indices`` lists the global index of each position; :meth:`by_global`
    looks a layer up by global index (None if this chunk does not hold it)."""

    def __init__(self, layers: Dict[int, nn.Module]) -> None:
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    @property
    def global_indices(self) -> List[int]:
        return [int(k) for k in self._modules]

    def by_global(self, index: int) -> Optional[nn.Module]:
        return self._modules.get(str(index))

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return (m for m in self._modules.values() if m is not None)

    def __getitem__(self, idx):
        return list(self._modules.values())[idx]


class TransformerBlock(nn.Module):
    """``layers`` (:class:`TransformerLayers`) followed by ``final_layernorm``.

    ``layers``: the GLOBAL layer indices this block holds (a pipeline chunk; default all).
    The layers outside it are still constructed, one at a time, and dropped, so the default
    generator advances exactly as for the whole model (bitwise the same initial weights).
    ``post_process`` False: no final_layernorm (``final_layernorm`` is None; not the last chunk).
    """

    def __init__(
        self,
        config: TransformerConfig,
        attention: str,
        *,
        tp: TensorParallelContext = NO_TENSOR_PARALLEL,
        layers: Optional[range] = None,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        problems = recompute_problems(config, tp.size, tp.sequence_parallel)
        if problems:
            raise ValueError("TransformerBlock: " + "; ".join(problems))
        self.attention = attention
        self.tp = tp
        self.recompute_full = config.recompute_granularity == RecomputeGranularity.FULL
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        self.distribute_saved_activations = config.distribute_saved_activations
        keep = range(config.num_layers) if layers is None else layers
        built: Dict[int, nn.Module] = {}
        for i in range(config.num_layers):
            # Built even when dropped: construction draws advance the generator as in the whole model.
            layer = TransformerLayer(config, attention, layer_number=i + 1, tp=tp)
            if i in keep:
                built[i] = layer
        self.layers = TransformerLayers(built)
        self.final_layernorm: Optional[nn.Module] = None
        if post_process:
            self.final_layernorm = build_norm(
                config, config.hidden_size, grad_is_partial=tp.sequence_parallel
            )

    def forward(
        self, x_BSH: torch.Tensor, rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, doc_mask=None
    ) -> torch.Tensor:
        if self.recompute_full and self.training and torch.is_grad_enabled():
            x_BSH = checkpointed_layers_forward(self, x_BSH, rotary, doc_mask)
        else:
            for layer in self.layers:
                x_BSH = layer(x_BSH, rotary, doc_mask)
        return x_BSH if self.final_layernorm is None else self.final_layernorm(x_BSH)
