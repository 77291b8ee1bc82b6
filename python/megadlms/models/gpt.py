"""GPTModel: embedding -> transformer layers -> final norm -> output layer.

Attribute layout follows megatron.core.models.gpt.GPTModel so checkpoints and FSDP2
unit selection read the same: ``embedding.word_embeddings``, ``embedding.position_embeddings``
(learned_absolute only), ``rotary_pos_emb`` (rope only, no parameters),
``decoder.layers[i]``, ``decoder.final_layernorm``, ``output_layer`` (weight is None when tied
to ``embedding.word_embeddings.weight``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import TransformerConfig
from .transformer import (
    CORE_ATTN_IMPLEMENTATIONS,
    RotaryEmbedding,
    TransformerBlock,
    document_attention_mask,
    init_transformer_weights,
)


class LanguageModelEmbedding(nn.Module):
    """Token embedding (+ learned absolute positions) followed by embedding dropout."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        dt = config.params_dtype
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dt)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=dt
            )
        else:
            self.position_embeddings = None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids int64 [B, S] -> [B, S, H]."""
        x_BSH = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x_BSH = x_BSH + self.position_embeddings(position_ids)
        return self.embedding_dropout(x_BSH)


class OutputLayer(nn.Module):
    """Vocabulary projection without bias (Megatron's output_layer).

    Tied: ``weight`` is None and the caller passes the embedding matrix to forward.
    """

    def __init__(self, config: TransformerConfig, tied: bool) -> None:
        super().__init__()
        if tied:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, dtype=config.params_dtype)
            )

    def forward(self, x_BSH: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight if self.weight is not None else weight
        if w is None:
            raise RuntimeError("output_layer is tied to the word embeddings: pass their weight")
        return F.linear(x_BSH, w)


class GPTModel(nn.Module):
    """Decoder-only transformer language model, bidirectional (DLM) or causal (AR).

    Args:
        config: TransformerConfig.
        attention: overrides ``config.attention`` ("bidirectional": no attention mask, for
            diffusion LMs; "causal": autoregressive) when given.

        core_attn_implementation: "TEDotProductAttention" (torch SDPA) or "FlexAttention"
            (torch flex_attention); they differ only for packed samples (``document_ids``).

    ``forward(input_ids [B,S] int64, position_ids=None, document_ids=None) -> logits [B,S,V]``
    in the parameters' dtype (no upcast: the loss functions upcast what they use).
    ``document_ids`` int64 [B,S] (document packing): each position attends only to the
    positions of its own document.
    """

    def __init__(
        self,
        config: TransformerConfig,
        attention: Optional[str] = None,
        core_attn_implementation: str = "TEDotProductAttention",
    ) -> None:
        super().__init__()
        if core_attn_implementation not in CORE_ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"core_attn_implementation must be one of {CORE_ATTN_IMPLEMENTATIONS}, "
                f"got {core_attn_implementation!r}"
            )
        self.core_attn_implementation = core_attn_implementation
        if attention is not None and attention != config.attention:
            config = dataclasses.replace(config, attention=attention)  # validated again there
        self.config = config
        self.attention = attention = config.attention
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.embedding = LanguageModelEmbedding(config)
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_base)
        else:
            self.rotary_pos_emb = None
        self.decoder = TransformerBlock(config, attention)
        self.output_layer = OutputLayer(config, tied=self.share_embeddings_and_output_weights)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)initialise every weight the Megatron way (normal(0, init_method_std); output
        projections scaled by 1/sqrt(2*num_layers)). Usable after ``to_empty`` from meta."""
        std = self.config.init_method_std
        with torch.no_grad():
            nn.init.normal_(self.embedding.word_embeddings.weight, mean=0.0, std=std)
            if self.embedding.position_embeddings is not None:
                nn.init.normal_(self.embedding.position_embeddings.weight, mean=0.0, std=std)
            if self.output_layer.weight is not None:
                nn.init.normal_(self.output_layer.weight, mean=0.0, std=std)
        init_transformer_weights(self.decoder, self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(
                f"input_ids must be int64 [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        B, S = input_ids.shape
        if S > self.config.max_position_embeddings:
            raise ValueError(
                f"input length {S} exceeds max_position_embeddings ({self.config.max_position_embeddings})"
            )
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        elif position_ids.shape != input_ids.shape:
            position_ids = position_ids.expand(B, S)
        x_BSH = self.embedding(input_ids, position_ids)
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        doc_mask = None
        if document_ids is not None:
            if document_ids.shape != input_ids.shape:
                raise ValueError(
                    f"document_ids {tuple(document_ids.shape)} must match input_ids {tuple(input_ids.shape)}"
                )
            doc_mask = document_attention_mask(
                document_ids, self.attention == "causal", self.core_attn_implementation
            )
        x_BSH = self.decoder(x_BSH, rotary, doc_mask)
        weight = self.embedding.word_embeddings.weight if self.share_embeddings_and_output_weights else None
        return self.output_layer(x_BSH, weight)
