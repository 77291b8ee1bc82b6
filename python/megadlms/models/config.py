"""TransformerConfig: the model shape and numerics, with Megatron-core's field names.

Built once from the command line (``--num-layers`` -> ``num_layers`` ...) and handed to
``GPTModel``; nothing in the model reads global arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITION_EMBEDDINGS = ("rope", "learned_absolute")


def megatron_swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default FFN width with ``--swiglu``: 2/3 of 4h, rounded down to 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


@dataclass(kw_only=True)
class TransformerConfig:
    """Shape and numerics of the GPT-style transformer (names follow megatron.core)."""

    num_layers: int
    """Number of transformer layers (--num-layers)."""
    hidden_size: int
    """Model width h (--hidden-size)."""
    num_attention_heads: int
    """Query heads (--num-attention-heads)."""
    vocab_size: int
    """Rows of the embedding / output layer (already padded by the caller if wanted)."""
    seq_length: int
    """Training sequence length (--seq-length)."""
    max_position_embeddings: Optional[int] = None
    """Longest sequence the model accepts (--max-position-embeddings); defaults to seq_length."""
    ffn_hidden_size: Optional[int] = None
    """MLP width (--ffn-hidden-size). Default: 4h, or Megatron's swiglu rule int(8h/3/64)*64."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention (--num-query-groups); default: all heads."""
    kv_channels: Optional[int] = None
    """Per-head width (--kv-channels); default hidden_size // num_attention_heads."""
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm' (--normalization)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm (--norm-epsilon)."""
    swiglu: bool = False
    """Gated SiLU MLP (--swiglu); otherwise GeLU."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linears (--disable-bias-linear turns them off)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head before attention (--qk-layernorm)."""
    position_embedding_type: str = "learned_absolute"
    """'rope' or 'learned_absolute' (--position-embedding-type), Megatron's default."""
    rotary_base: int = 10000
    """RoPE base (--rotary-base)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output-layer weight (--untie-embeddings-and-output-weights)."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 * num_layers)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (--attention-dropout), Megatron's default."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and residual branches (--hidden-dropout), Megatron's default."""
    params_dtype: torch.dtype = torch.float32
    """Dtype the parameters are created in (torch.bfloat16 with --bf16)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} must be a positive integer ({flag}), got {value!r}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings}): raise --max-position-embeddings or "
                "shorten --seq-length"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be a multiple of "
                f"--num-query-groups ({self.num_query_groups})"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"--hidden-size ({self.hidden_size}) is not divisible by "
                    f"--num-attention-heads ({self.num_attention_heads}); set --kv-channels"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                megatron_swiglu_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size
            )
        if self.ffn_hidden_size <= 0:
            raise ValueError(f"--ffn-hidden-size must be positive, got {self.ffn_hidden_size}")
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"--normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}")
        if self.position_embedding_type not in _POSITION_EMBEDDINGS:
            raise ValueError(
                f"--position-embedding-type must be one of {_POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding_type!r}"
            )
        if self.position_embedding_type == "rope" and self.kv_channels % 2:
            raise ValueError(f"rope needs an even head width (--kv-channels), got {self.kv_channels}")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.init_method_std <= 0:
            raise ValueError(f"--init-method-std must be positive, got {self.init_method_std}")
        if self.norm_epsilon <= 0:
            raise ValueError(f"--norm-epsilon must be positive, got {self.norm_epsilon}")
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise ValueError(f"params_dtype must be a floating torch.dtype, got {self.params_dtype!r}")
