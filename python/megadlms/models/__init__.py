"""megadlms.models: the GPT-style transformer (bidirectional for DLMs, causal for AR).

    from megadlms.models import TransformerConfig, GPTModel
    model = GPTModel(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                       vocab_size=259, seq_length=128), attention="bidirectional")
    logits = model(input_ids)            # [B, S, V] in params_dtype

Knows nothing about distribution: data-parallel wrappers are applied from outside.
"""

from .chunk import PipelineChunk
from .config import TransformerConfig, megatron_swiglu_ffn_size
from .flops import num_floating_point_operations
from .gpt import GPTModel, LanguageModelEmbedding, OutputLayer
from .transformer import (
    MLP,
    RotaryEmbedding,
    SelfAttention,
    TransformerBlock,
    TransformerLayer,
    TransformerLayers,
)

__all__ = [
    "TransformerConfig",
    "GPTModel",
    "PipelineChunk",
    "LanguageModelEmbedding",
    "OutputLayer",
    "RotaryEmbedding",
    "TransformerLayer",
    "TransformerBlock",
    "TransformerLayers",
    "SelfAttention",
    "MLP",
    "num_floating_point_operations",
    "megatron_swiglu_ffn_size",
]
