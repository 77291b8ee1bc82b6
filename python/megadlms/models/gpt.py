"""GPTModel: embedding -> transformer layers -> final norm -> output layer.

Attribute layout follows megatron.core.models.gpt.GPTModel so checkpoints and FSDP2
unit selection read the same: ``embedding.word_embeddings``, ``embedding.position_embeddings``
(learned_absolute only), ``rotary_pos_emb`` (rope only, no parameters),
``decoder.layers[i]``, ``decoder.final_layernorm``, ``output_layer`` (weight is None when tied
to ``embedding.word_embeddings.weight``).

Tensor parallelism (``tp``, docs/parallel.md): the word embedding and the output layer are split
over the vocab (rank r holds rows [r*V/tp, (r+1)*V/tp)), the logits are this rank's vocab slice
[B, S, V/tp] (never gathered: :meth:`GPTModel.token_cross_entropy` scores them), learned
position embeddings are replicated. With sequence parallelism the activations between the TP
regions are [B, S/tp, H].

Pipeline parallelism (``pipeline``, docs/parallel.md): a :class:`PipelineChunk` builds one
chunk — the embedding only with ``pre_process``, ``decoder.final_layernorm`` and
``output_layer`` only with ``post_process``, and the layers of its GLOBAL range, named by their
global index. With tied embeddings a ``post_process`` chunk without ``pre_process`` owns
``output_layer.weight``, a copy of the word embedding declared ``tied_copy`` (parallel/sharding.py)
(its gradient is summed with the embedding's over the embedding group:
``megadlms.pipeline.allreduce_embedding_grads``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megadlms.common.enums import AttnMaskType, PositionEmbeddingType, as_member
from megadlms.ops.block_mask import BlockDiffusion, block_diffusion_mask
from megadlms.ops.kv_cache import CachedAttention, KVCache
from megadlms.parallel import (
    TensorParallelContext,
    VocabParallelEmbedding,
    mappings,
    normal_init,
    vocab_parallel_cross_entropy,
)
from megadlms.parallel.context_parallel import ContextParallelPlan
from megadlms.parallel.linear_impl import linear as fused_linear
from megadlms.parallel.sharding import REPLICATED, set_sharding, sharding_of

from .chunk import WHOLE_MODEL, PipelineChunk
from .config import TransformerConfig, check_tensor_parallel, expert_parallel_problems
from .init import init_normal_, init_transformer_weights
from .transformer import (
    CORE_ATTN_IMPLEMENTATIONS,
    NO_TENSOR_PARALLEL,
    RotaryEmbedding,
    TransformerBlock,
    document_attention_mask,
    dropout_rng,
)


class LanguageModelEmbedding(nn.Module):
    """Token embedding (+ learned absolute positions) followed by embedding dropout.

    The word embedding is vocab-parallel; position embeddings are replicated. Under sequence
    parallelism the output is this rank's sequence chunk: reduce-scattered straight from the
    word embedding, or (learned positions, as Megatron) all-reduced, summed with the positions
    and then split, so the position embedding's grad stays full on every rank."""

    def __init__(self, config: TransformerConfig, tp: TensorParallelContext = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        dt = config.params_dtype
        self.tp = tp
        learned = config.position_embedding_type == PositionEmbeddingType.LEARNED_ABSOLUTE
        # N(0, 1) at construction, the draws nn.Embedding makes (reset_parameters redraws).
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            tp_group=tp.group,
            # With learned positions the split must wait until they are added (forward), so the word embedding
            # all-reduces instead of reduce-scattering.
            sequence_parallel=tp.sequence_parallel and not learned,
            init_method=normal_init(1.0),
            dtype=dt,
        )
        self.position_embeddings: Optional[nn.Embedding] = None
        if learned:
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=dt
            )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids int64 [B, S] -> [B, S, H] ([B, S/tp, H] sequence-parallel)."""
        x_BSH = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x_BSH = x_BSH + self.position_embeddings(position_ids)
            if self.tp.sequence_parallel:
                # The position table is replicated: adding it before the split keeps its grad
                # complete on every TP rank, so it needs no tp_partial_grad fix-up.
                x_BSH = mappings.scatter_to_sequence_parallel(x_BSH, self.tp.group)
        if not self.training or self.embedding_dropout.p == 0:
            return x_BSH
        # Sequence-parallel: each rank holds different positions, so it draws its own mask.
        with dropout_rng(self.tp, split=self.tp.sequence_parallel):
            return self.embedding_dropout(x_BSH)


class OutputLayer(nn.Module):
    """Vocabulary projection without bias (Megatron's output_layer), column-parallel over the
    vocab with no gather: the output is this rank's logits slice [B, S, V/tp].

    Tied: ``weight`` is None and the caller passes the embedding matrix (its local vocab
    shard, the same vocab range) to forward. The input is replicated (its grad all-reduced
    over TP) or, sequence-parallel, this rank's chunk, all-gathered here.
    """

    def __init__(
        self, config: TransformerConfig, tied: bool, tp: TensorParallelContext = NO_TENSOR_PARALLEL
    ) -> None:
        super().__init__()
        self.tp = tp
        if tied:
            # Tied on this chunk: forward is handed the embedding's own parameter, so no second one may exist.
            self.register_parameter("weight", None)
        else:
            # Values come from reset_parameters, which draws in the model's fixed order.
            local = torch.empty(config.vocab_size // tp.size, config.hidden_size, dtype=config.params_dtype)
            self.weight = set_sharding(nn.Parameter(local), tp_dim=0)

    def forward(self, x_BSH: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight if self.weight is not None else weight
        if w is None:
            raise RuntimeError("output_layer is tied to the word embeddings: pass their weight")
        if self.tp.sequence_parallel:
            # Each rank back-propagates only through its vocab slice, so the gathered input's grad is partial.
            x_BSH = mappings.gather_from_sequence_parallel(x_BSH, self.tp.group, grad_is_partial=True)
        else:
            x_BSH = mappings.copy_to_tp(x_BSH, self.tp.group)
        fusion = self.tp.gradient_accumulation_fusion
        return fused_linear(x_BSH, w, None, gradient_accumulation_fusion=fusion, layer_name="output_layer")


class GPTModel(nn.Module):
    """Decoder-only transformer language model, bidirectional (DLM) or causal (AR).

    Args:
        config: TransformerConfig.
        attention: overrides ``config.attention`` ("bidirectional": no attention mask, for
            diffusion LMs; "causal": autoregressive) when given.

        core_attn_implementation: "TEDotProductAttention" (torch SDPA) or "FlexAttention"
            (torch flex_attention); they differ only for packed samples (``document_ids``).
        tp: the tensor-parallel setting (default: one process, the plain model). The sizes
            must divide (:func:`check_tensor_parallel`); the weights are initialised layout
            independently (the full tensors are the tp = 1 model's for the same seed).
            Its ``expert_group`` shards the experts of MoE layers (``num_moe_experts``;
            megadlms.models.moe), EP rank e holding experts [e*E/ep, (e+1)*E/ep).

    ``forward(input_ids [B,S] int64, position_ids=None, document_ids=None) -> logits [B,S,V/tp]``
    in the parameters' dtype (no upcast: the loss functions upcast what they use); score
    them with :meth:`token_cross_entropy`.
    ``document_ids`` int64 [B,S] (document packing): each position attends only to the
    positions of its own document.
    ``kv_cache`` (:class:`~megadlms.ops.kv_cache.KVCache`, generation): the call's tokens are
    slots [cache_offset, cache_offset + S) (default positions: those slot numbers); their keys
    and values are written there and their queries attend to every slot of the cache.
    ``block_diffusion`` (a :class:`~megadlms.ops.block_mask.BlockDiffusion`, training): the input
    is ``[x_t ; x_0]`` (2n tokens, the positions of x_0 repeating those of x_t) under BD3-LM's
    mask (:mod:`megadlms.ops.block_mask`).

    ``pipeline``: the :class:`PipelineChunk` this model builds (default: the whole model).
    Its weights are bitwise the whole model's for the same seed (the parts other chunks hold
    are constructed and drawn, then dropped). A chunk without ``pre_process`` takes the previous
    chunk's output as ``hidden_states`` [B, S, H] ([B, S'/tp, H] sequence-parallel, S' padded
    to a multiple of tp) plus ``position_ids`` [B, S] (rotary, padding) and ``document_ids``;
    ``input_ids`` is then optional. A chunk without ``post_process`` returns hidden states
    (uncropped, the next chunk's input) instead of logits.
    """

    def __init__(
        self,
        config: TransformerConfig,
        attention: Optional[AttnMaskType | str] = None,
        core_attn_implementation: str = "TEDotProductAttention",
        tp: TensorParallelContext = NO_TENSOR_PARALLEL,
        pipeline: PipelineChunk = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        if core_attn_implementation not in CORE_ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"core_attn_implementation must be one of {CORE_ATTN_IMPLEMENTATIONS}, "
                f"got {core_attn_implementation!r}"
            )
        self.core_attn_implementation = core_attn_implementation
        if attention is not None and attention != config.attention:
            config = dataclasses.replace(
                config, attention=as_member(AttnMaskType, attention)
            )  # validated there
        check_tensor_parallel(config, tp.size, tp.sequence_parallel)
        for problem in expert_parallel_problems(config, tp.ep_size):
            raise ValueError(problem)
        self.config = config
        self.tp = tp
        self.attention = attention = config.attention
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        layers = pipeline.layer_range(config.num_layers)
        self.pipeline = PipelineChunk(pipeline.pre_process, pipeline.post_process, layers)
        pre, post = pipeline.pre_process, pipeline.post_process
        # built on every chunk (dropped unless pre_process): the construction draws of the whole model
        embedding = LanguageModelEmbedding(config, tp)
        self.embedding = embedding if pre else None
        self.rotary_pos_emb: Optional[RotaryEmbedding] = None
        if config.position_embedding_type == PositionEmbeddingType.ROPE:
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_base, config.rope_scaling)
        self.decoder = TransformerBlock(config, attention, tp=tp, layers=layers, post_process=post)
        # the last stage's copy of a tied embedding (another stage holds the embedding itself)
        self.has_shared_embedding_copy = self.share_embeddings_and_output_weights and post and not pre
        self.output_layer: Optional[OutputLayer] = None
        if post:
            tied_here = self.share_embeddings_and_output_weights and pre
            self.output_layer = OutputLayer(config, tied=tied_here, tp=tp)
            if self.has_shared_embedding_copy:
                set_sharding(self.output_layer.weight, tied_copy=True)
        if self.share_embeddings_and_output_weights and pre and post and tp.gradient_accumulation_fusion:
            # the tied matrix also gets the lookup's ordinary gradient: DDP must fold that too
            embedding.word_embeddings.weight.zero_out_wgrad = True  # type: ignore[attr-defined]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)initialise every weight the Megatron way (normal(0, init_method_std); output
        projections scaled by 1/sqrt(2*num_layers)). Usable after ``to_empty`` from meta.

        Every FULL tensor is drawn from the default generator in one fixed order (word
        embeddings, positions, output layer, then the layers) and each rank keeps its shard,
        so the logical weights are bitwise the same at every tp for the same seed.
        A pipeline chunk makes the same draws and keeps its own tensors (the tied embedding's
        copy on the last stage is drawn with the word embedding: equal to it)."""
        cfg, std = self.config, self.config.init_method_std
        emb = self.embedding
        out_w = None if self.output_layer is None else self.output_layer.weight
        word = (
            emb.word_embeddings.weight
            if emb is not None
            # The last stage's copy is drawn in the word embedding's slot, so both copies start bitwise equal.
            else (out_w if self.has_shared_embedding_copy else None)
        )
        device = next(self.parameters()).device
        with torch.no_grad():
            self._init_or_skip(word, (cfg.vocab_size, cfg.hidden_size), std, device)
            if cfg.position_embedding_type == PositionEmbeddingType.LEARNED_ABSOLUTE:
                pos = (
                    emb.position_embeddings.weight
                    if emb is not None and emb.position_embeddings is not None
                    else None
                )
                self._init_or_skip(pos, (cfg.max_position_embeddings, cfg.hidden_size), std, device)
            if not self.share_embeddings_and_output_weights:
                self._init_or_skip(out_w, (cfg.vocab_size, cfg.hidden_size), std, device)
        init_transformer_weights(self.decoder, self.config, self.tp)

    def _init_or_skip(self, param, full_shape, std: float, device) -> None:
        """init_normal_ ``param``; when another chunk holds it (None), draw its full tensor and drop it."""
        if param is not None:
            init_normal_(param, std, self.tp)
        else:
            # Draw and discard: the generator must advance as in the whole model, or later tensors differ.
            torch.empty(full_shape, dtype=self.config.params_dtype, device=device).normal_(mean=0.0, std=std)

    def _apply(self, fn, recurse=True):
        # ``to_empty`` (meta -> device) and some conversions replace the Parameter objects,
        # which would drop what the layers declared: the sharding description (read by
        # reset_parameters, checkpoints, norms, DDP) and Megatron's ``zero_out_wgrad`` mark
        # (read by the fused weight-gradient path): carry both over by name.
        marks = {n: (sharding_of(p), getattr(p, "zero_out_wgrad", None)) for n, p in self.named_parameters()}
        out = super()._apply(fn, recurse)
        for name, param in self.named_parameters():
            sharding, zero_out_wgrad = marks.get(name, (REPLICATED, None))
            if sharding is not REPLICATED:
                set_sharding(param, **dataclasses.asdict(sharding))
            if zero_out_wgrad is not None:
                param.zero_out_wgrad = zero_out_wgrad
        return out

    def token_cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (fp32, shape of ``targets``) of this model's ``logits``
        [..., V/tp] against full-vocab ``targets`` [...]: vocab-parallel over the TP group
        (the full logits are never gathered; the result is the same on every TP rank), or
        ``F.cross_entropy`` in fp32 at tp = 1."""
        if self.tp.size > 1:
            return vocab_parallel_cross_entropy(logits, targets, self.tp.group)
        # fp32 as in the vocab-parallel path, so the loss does not change with tp.
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, targets.reshape(-1), reduction="none").view(targets.shape)

    def gather_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This model's ``logits`` [..., V/tp] over the whole (padded) vocabulary [..., V]: the
        TP ranks' vocab slices all-gathered in rank order (= vocab order), the same on every
        rank; the logits themselves at tp = 1. For choosing tokens (the sampler), where every
        rank must see every row; training never gathers (``token_cross_entropy``)."""
        if self.tp.size == 1:
            return logits
        return mappings.gather_from_tp(logits, self.tp.group)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        cache_offset: int = 0,
        block_diffusion: Optional[BlockDiffusion | int] = None,
    ) -> torch.Tensor:
        B, S, device = self._check_inputs(input_ids, position_ids, hidden_states)
        if kv_cache is not None:
            self._check_cache(document_ids, S, cache_offset)
        if block_diffusion is not None:
            self._check_block_diffusion(document_ids, kv_cache, S)
        if input_ids is None:  # a later pipeline chunk: only the shape matters (padding)
            input_ids = torch.zeros(B, S, dtype=torch.int64, device=device)
        if (S // 2 if block_diffusion is not None else S) > self.config.max_position_embeddings:
            raise ValueError(
                f"input length {S} exceeds max_position_embeddings ({self.config.max_position_embeddings})"
            )
        if position_ids is None:
            if self.tp.cp_group is not None:  # a local arange would be the wrong (non-global) positions
                ContextParallelPlan.build(None, self.tp.cp_group, False)  # raises, naming the fix
            position_ids = torch.arange(cache_offset, cache_offset + S, device=device).expand(B, S)
            if block_diffusion is not None:  # x_0 repeats the positions of x_t
                position_ids = torch.arange(S // 2, device=device).repeat(2).expand(B, S)
        elif position_ids.shape != input_ids.shape:
            # A shared [S] / [1, S] row broadcast over the batch (a view, no copy).
            position_ids = position_ids.expand(B, S)
        if document_ids is not None and document_ids.shape != input_ids.shape:
            raise ValueError(
                f"document_ids {tuple(document_ids.shape)} must match input_ids {tuple(input_ids.shape)}"
            )
        pad = -S % self.tp.size if self.tp.sequence_parallel else 0
        if pad and self.tp.cp_group is not None:
            raise ValueError(f"context parallelism: this rank's {S} tokens must split over tp {self.tp.size}")
        if pad:  # the sequence is split over the TP ranks: pad it to a multiple, masked out exactly
            input_ids, position_ids, document_ids = _pad_sequence(input_ids, position_ids, document_ids, pad)
        cached = None
        if kv_cache is not None:  # the padding of the sequence split is never written to the cache
            cached = CachedAttention(kv_cache, cache_offset, S, self.attention == AttnMaskType.CAUSAL)
            document_ids = None
        if block_diffusion is not None:  # the [x_t ; x_0] pass: BD3-LM's mask (padding sees itself only)
            cached = block_diffusion_mask(
                S // 2, _block_spec(block_diffusion), device, self.core_attn_implementation, total=S + pad
            )
        out = self._forward(input_ids, position_ids, document_ids, hidden_states, cached)
        # Only logits are cropped: a later pipeline chunk expects the padded length it splits over TP.
        return out[:, :S] if pad and self.pipeline.post_process else out

    def _check_inputs(self, input_ids, position_ids, hidden_states):
        """(B, S, device) of the call; the inputs a chunk needs must be there."""
        if input_ids is not None:
            if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
                raise ValueError(
                    f"input_ids must be int64 [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
                )
            B, S = input_ids.shape
        elif self.pipeline.pre_process:
            raise ValueError("input_ids is required (this model chunk holds the embedding)")
        if self.pipeline.pre_process:
            if hidden_states is not None:
                raise ValueError(
                    "hidden_states is only for a pipeline chunk without the embedding (pre_process)"
                )
            return B, S, input_ids.device
        if hidden_states is None or hidden_states.dim() != 3:
            raise ValueError(
                "a pipeline chunk without the embedding (pre_process False) takes the previous chunk's "
                "output as hidden_states [batch, seq, hidden]"
            )
        if input_ids is None:  # the batch dim is never split; the sequence is under SP (and padded)
            B = hidden_states.shape[0]
            if position_ids is not None:
                # Under SP hidden_states holds S'/tp positions; position_ids carry the real, unpadded length.
                S = position_ids.shape[-1]
            elif self.tp.sequence_parallel:
                raise ValueError(
                    "a sequence-parallel pipeline chunk needs input_ids or position_ids [batch, seq]"
                )
            else:
                S = hidden_states.shape[1]
        return B, S, hidden_states.device

    def _check_cache(self, document_ids, S: int, cache_offset: int) -> None:
        """The rules of a cached forward (generation), each a ValueError naming the fix."""
        if self.training:
            raise ValueError(
                "kv_cache is for generation: call model.eval() first (training recomputes every key)"
            )
        if self.tp.cp_group is not None:
            raise ValueError(
                "kv_cache: cached generation does not run under context parallelism; build cp = 1"
            )
        if document_ids is not None:
            raise ValueError("kv_cache: document_ids (packing) cannot be combined with a cache")
        if cache_offset < 0 or cache_offset + S > self.config.max_position_embeddings:
            raise ValueError(
                f"kv_cache: slots [{cache_offset}, {cache_offset + S}) are outside the model's "
                f"{self.config.max_position_embeddings} positions"
            )

    def _check_block_diffusion(self, document_ids, kv_cache, S: int) -> None:
        """The rules of a block-diffusion training pass, each a ValueError naming the fix."""
        if self.attention == AttnMaskType.CAUSAL:
            raise ValueError(
                "block_diffusion: a causal model cannot run the [x_t ; x_0] mask; build it bidirectional"
            )
        if self.tp.cp_group is not None:
            raise ValueError(
                "block_diffusion: the [x_t ; x_0] mask is not sliced over context parallelism; build cp = 1"
            )
        if document_ids is not None or kv_cache is not None:
            raise ValueError("block_diffusion cannot be combined with document_ids (packing) or a kv_cache")
        if S % 2:
            raise ValueError(f"block_diffusion: the input holds [x_t ; x_0], an even length, got {S}")

    def _forward(
        self, input_ids, position_ids, document_ids, hidden_states=None, cached=None
    ) -> torch.Tensor:
        doc_mask = cached
        if self.tp.cp_group is not None:  # this rank holds part of the sequence (context parallelism)
            if document_ids is not None:
                raise ValueError("document_ids (document packing) are not supported with context parallelism")
            doc_mask, position_ids = ContextParallelPlan.build(
                position_ids, self.tp.cp_group, self.attention == AttnMaskType.CAUSAL
            )
        x_BSH = self.embedding(input_ids, position_ids) if self.embedding is not None else hidden_states
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        if document_ids is not None:
            doc_mask = document_attention_mask(
                document_ids, self.attention == AttnMaskType.CAUSAL, self.core_attn_implementation
            )
        x_BSH = self.decoder(x_BSH, rotary, doc_mask)
        if self.output_layer is None:  # not the last pipeline chunk
            return x_BSH
        weight = None
        if self.share_embeddings_and_output_weights and self.embedding is not None:
            # Tied within one chunk: the output layer multiplies by the embedding's own local vocab shard.
            weight = self.embedding.word_embeddings.weight
        return self.output_layer(x_BSH, weight)


def _block_spec(block_diffusion) -> BlockDiffusion:
    """A bare block size stands for the training mask of that size."""
    return BlockDiffusion(block_diffusion) if isinstance(block_diffusion, int) else block_diffusion


def _pad_sequence(input_ids, position_ids, document_ids, pad: int):
    """Append ``pad`` positions that no real position can see: they form their own document
    (id -1), so the document mask keeps every real query's attention exactly as unpadded;
    their outputs are dropped by the caller. Used when sequence parallelism needs the length
    to be a multiple of tp (MegaDLMs' objective feeds L-1 tokens; variable-length crops)."""
    B, S = input_ids.shape
    device = input_ids.device
    if document_ids is None:
        document_ids = torch.zeros(B, S, dtype=torch.int64, device=device)
    filler = torch.zeros(B, pad, dtype=torch.int64, device=device)
    return (
        torch.cat([input_ids, filler], dim=1),
        torch.cat([position_ids, filler], dim=1),  # position 0: inside any position table
        torch.cat([document_ids, filler - 1], dim=1),
    )
