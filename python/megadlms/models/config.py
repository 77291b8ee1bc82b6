"""TransformerConfig: the model shape and numerics, with Megatron-core's field names.

Built once from the command line (``--num-layers`` -> ``num_layers`` ...) and handed to
``GPTModel``; nothing in the model reads global arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megadlms.common.enums import (
    AttnMaskType,
    MoETokenDispatcher,
    PositionEmbeddingType,
    RecomputeGranularity,
    RecomputeMethod,
    as_member,
    plain,
)
from megadlms.common.errors import Problems

from .rope_scaling import rope_scaling_problems

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITION_EMBEDDINGS = tuple(m.value for m in PositionEmbeddingType)
ATTENTION_KINDS = tuple(m.value for m in AttnMaskType)
# The fields that name a mode: their values become enum members (an unknown value is reported
# by the field's own check).
_MODE_FIELDS = (
    ("position_embedding_type", PositionEmbeddingType),
    ("attention", AttnMaskType),
    ("moe_token_dispatcher_type", MoETokenDispatcher),
    ("recompute_granularity", RecomputeGranularity),
    ("recompute_method", RecomputeMethod),
)


def megatron_swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default FFN width with ``--swiglu``: 2/3 of 4h, rounded down to 64."""
    # 2/3 keeps the gated MLP's three matrices at the parameter count of the plain 4h MLP's two; the exact
    # expression (float, then truncation) is Megatron's, so shapes and checkpoints match.
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
    unpadded_vocab_size: Optional[int] = None
    """Real tokens: rows [unpadded_vocab_size, vocab_size) are Megatron's padding
    (--make-vocab-size-divisible-by), never tokens. Training's softmax still runs over every
    row (Megatron's); sampling and answer scoring leave the padding out. Recorded with the
    model in checkpoints; None: every row is a token."""
    seq_length: int
    """Training sequence length (--seq-length)."""
    max_position_embeddings: int = None  # type: ignore[assignment]  # None until __post_init__ derives it
    """Longest sequence the model accepts (--max-position-embeddings); defaults to seq_length."""
    ffn_hidden_size: int = None  # type: ignore[assignment]  # None until __post_init__ derives it
    """MLP width (--ffn-hidden-size). Default: 4h, or Megatron's swiglu rule int(8h/3/64)*64."""
    num_query_groups: int = None  # type: ignore[assignment]  # None until __post_init__ derives it
    """Key/value heads for grouped-query attention (--num-query-groups); default: all heads."""
    kv_channels: int = None  # type: ignore[assignment]  # None until __post_init__ derives it
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
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.LEARNED_ABSOLUTE
    """'rope' or 'learned_absolute' (--position-embedding-type), Megatron's default."""
    rotary_base: int = 10000
    """RoPE base (--rotary-base)."""
    rope_scaling: Optional[dict] = None
    """RoPE scaling (--rope-scaling): {"rope_type": linear | llama3 | yarn, its parameters}
    (models/rope_scaling.py); None: plain RoPE."""
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

    attention: AttnMaskType = AttnMaskType.BIDIRECTIONAL
    """'bidirectional' (no mask; diffusion LMs) or 'causal' (autoregressive)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even without add_bias_linear (--add-qkv-bias; Qwen2)."""

    # Mixture of experts (megatron.core's names and defaults; docs/moe.md).
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer (--num-experts); None: every MLP is dense."""
    moe_router_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one expert's MLP (--moe-ffn-hidden-size); default ffn_hidden_size."""
    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE (--moe-layer-freq): N = every N-th layer starting at the first,
    or a 0/1 list of length num_layers."""
    moe_router_score_function: str = "softmax"
    """'softmax' or 'sigmoid' (--moe-router-score-function)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """'aux_loss' (the Switch load-balancing loss) or 'none' (--moe-router-load-balancing-type)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (--moe-aux-loss-coeff)."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (--moe-z-loss-coeff); None: no z-loss."""
    moe_expert_capacity_factor: Optional[float] = None
    """Capacity per expert as a multiple of the balanced share (--moe-expert-capacity-factor);
    tokens over capacity are dropped. None: dropless."""
    moe_token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps (--moe-token-drop-policy): 'probs' (highest
    routing probability) or 'position' (earliest in the micro-batch)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Every expert gets exactly its capacity of tokens, padded with zero-weight ones
    (--moe-pad-expert-input-to-capacity; needs moe_expert_capacity_factor)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert MLP that every token also goes through
    (--moe-shared-expert-intermediate-size); None: no shared expert."""
    moe_token_dispatcher_type: MoETokenDispatcher = MoETokenDispatcher.ALLGATHER
    """How tokens reach experts on other expert-parallel ranks (--moe-token-dispatcher-type):
    'allgather' or 'alltoall'."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (--moe-router-pre-softmax); default: top-k of
    the logits, then softmax over the k chosen."""

    # Activation recomputation (megatron.core's names; models/recompute.py has the rules).
    recompute_granularity: Optional[RecomputeGranularity] = None
    """None, 'full' (whole layers) or 'selective' (core attention) (--recompute-granularity)."""
    recompute_method: Optional[RecomputeMethod] = None
    """With 'full': 'uniform' (spans of recompute_num_layers) or 'block' (the first
    recompute_num_layers layers of each model chunk) (--recompute-method)."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputed span (uniform) or recomputed layers per chunk (block)."""
    distribute_saved_activations: bool = False
    """Save only this TP rank's 1/tp of each recomputed span's input (--distribute-saved-activations)."""

    # Fused elementwise kernels (megadlms/ops; docs/model_and_objective.md, "Fused kernels"). Each
    # runs on CUDA tensors when on; on CPU the unfused torch ops always run (a CPU run is bitwise
    # the same with or without them). Speed and memory knobs: the numbers agree up to rounding.
    apply_rope_fusion: bool = True
    """Rotary embedding in one kernel each way (Megatron's name; --no-rope-fusion turns it off)."""
    bias_swiglu_fusion: bool = True
    """SwiGLU in one kernel each way, saving only the fc1 output (--no-bias-swiglu-fusion)."""
    residual_rmsnorm_fusion: bool = True
    """The attention residual add and pre_mlp_layernorm (RMSNorm) in one kernel each way
    (--no-residual-rmsnorm-fusion; no Megatron equivalent). LayerNorm models run unfused."""

    difflm_block_size: Optional[int] = None
    """Block diffusion (--difflm-block-size): the block size the model is trained with; the
    sampler generates block by block with it (None: a full-sequence model)."""

    def __post_init__(self) -> None:
        """Fill the derived defaults (Megatron's rules) and check every field."""
        bad = Problems("TransformerConfig")
        for name, enum_cls in _MODE_FIELDS:
            setattr(self, name, as_member(enum_cls, getattr(self, name)))
        bad.positive(self, "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if bad.items:  # the rules below need the sizes
            bad.raise_if_any()
        _check_unpadded_vocab(self, bad)
        bad.check(
            self.seq_length <= self.max_position_embeddings,
            f"seq_length {self.seq_length} exceeds max_position_embeddings "
            f"{self.max_position_embeddings}: raise max_position_embeddings or shorten seq_length",
        )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        bad.check(
            self.num_query_groups > 0 and self.num_attention_heads % self.num_query_groups == 0,
            f"num_attention_heads {self.num_attention_heads} must be a multiple of "
            f"num_query_groups {self.num_query_groups}",
        )
        if self.kv_channels is None and bad.check(
            self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
            f"{self.num_attention_heads}: change one of them or set kv_channels",
        ):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                megatron_swiglu_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size
            )
        bad.positive(self, "ffn_hidden_size", "kv_channels", required=False)
        bad.check(
            self.normalization in _NORMALIZATIONS,
            f"normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}",
        )
        bad.check(
            self.position_embedding_type in _POSITION_EMBEDDINGS,
            f"position_embedding_type must be one of {_POSITION_EMBEDDINGS}, "
            f"got {self.position_embedding_type!r}",
        )
        bad.check(
            self.attention in ATTENTION_KINDS,
            f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}",
        )
        if self.position_embedding_type is PositionEmbeddingType.ROPE and isinstance(self.kv_channels, int):
            bad.check(self.kv_channels % 2 == 0, f"rope needs an even kv_channels, got {self.kv_channels}")
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            bad.check(0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value}")
        bad.check(self.init_method_std > 0, f"init_method_std must be positive, got {self.init_method_std}")
        bad.check(self.norm_epsilon > 0, f"norm_epsilon must be positive, got {self.norm_epsilon}")
        bad.check(
            isinstance(self.params_dtype, torch.dtype) and self.params_dtype.is_floating_point,
            f"params_dtype must be a floating torch.dtype, got {self.params_dtype!r}",
        )
        if self.num_moe_experts is not None:
            _check_moe(self, bad)
        for problem in rope_scaling_problems(self.rope_scaling):
            bad.check(False, problem)
        bad.raise_if_any()

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` (0-based) has an MoE MLP (``moe_layer_freq``)."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            # An int N puts MoE on layers 0, N, 2N, ...: layer 0 is always MoE, as in Megatron.
            return layer_index % freq == 0
        return bool(freq[layer_index])

    def to_dict(self) -> dict:
        """The JSON-able record stored in checkpoints (params_dtype as its name)."""
        d = plain(dataclasses.asdict(self))
        d["params_dtype"] = str(self.params_dtype).replace("torch.", "")
        if d["rope_scaling"] is None:  # plain RoPE: today's record (checkpoints, exports) unchanged
            del d["rope_scaling"]
        if d.get("difflm_block_size") is None:  # absent when off: other runs' checkpoints keep their bytes
            d.pop("difflm_block_size", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TransformerConfig:
        """Inverse of :meth:`to_dict`; unknown keys (records of newer versions) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("params_dtype"), str):
            kw["params_dtype"] = getattr(torch, kw["params_dtype"])
        return cls(**kw)


def _check_unpadded_vocab(c: TransformerConfig, bad: Problems) -> None:
    """The real vocabulary fits the rows: ``unpadded_vocab_size`` in 1..``vocab_size``."""
    bad.positive(c, "unpadded_vocab_size", required=False)
    if isinstance(c.unpadded_vocab_size, int) and c.unpadded_vocab_size > c.vocab_size:
        bad.add(
            f"unpadded_vocab_size {c.unpadded_vocab_size} exceeds vocab_size {c.vocab_size}: "
            "the embedding needs a row per token (pad vocab_size up, never down)"
        )


def _check_moe(c: TransformerConfig, bad: Problems) -> None:
    """The mixture-of-experts fields (only when num_moe_experts is set)."""
    if c.moe_ffn_hidden_size is None:
        c.moe_ffn_hidden_size = c.ffn_hidden_size
    bad.positive(c, "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size")
    if isinstance(c.moe_router_topk, int) and isinstance(c.num_moe_experts, int):
        bad.check(
            c.moe_router_topk <= c.num_moe_experts,
            f"moe_router_topk {c.moe_router_topk} exceeds num_moe_experts {c.num_moe_experts}",
        )
    freq = c.moe_layer_freq
    if isinstance(freq, int):
        bad.check(freq > 0, f"moe_layer_freq must be a positive integer or a 0/1 list, got {freq}")
    else:
        freq = c.moe_layer_freq = [int(v) for v in freq]
        bad.check(
            len(freq) == c.num_layers and set(freq) <= {0, 1},
            f"moe_layer_freq as a list must hold num_layers ({c.num_layers}) entries of 0 or 1, got {freq}",
        )
    choices = (
        ("moe_router_score_function", ("softmax", "sigmoid")),
        ("moe_router_load_balancing_type", ("aux_loss", "none")),
        ("moe_token_drop_policy", ("probs", "position")),
        ("moe_token_dispatcher_type", tuple(m.value for m in MoETokenDispatcher)),
    )
    for name, allowed in choices:
        value = getattr(c, name)
        bad.check(value in allowed, f"{name} must be one of {allowed}, got {value!r}")
    bad.check(c.moe_aux_loss_coeff >= 0, f"moe_aux_loss_coeff must be >= 0, got {c.moe_aux_loss_coeff}")
    z = c.moe_z_loss_coeff
    bad.check(z is None or z >= 0, f"moe_z_loss_coeff must be >= 0 (or unset), got {z}")
    cf = c.moe_expert_capacity_factor
    bad.check(cf is None or cf > 0, f"moe_expert_capacity_factor must be positive (or unset), got {cf}")
    bad.check(
        not c.moe_pad_expert_input_to_capacity or cf is not None,
        "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (a capacity to pad to)",
    )
    bad.positive(c, "moe_shared_expert_intermediate_size", required=False)


def tensor_parallel_problems(
    config: TransformerConfig, tp: int, sequence_parallel: bool = False, *, check_vocab: bool = True
) -> List[str]:
    """The field-named reasons ``config`` cannot be split over ``tp`` ranks (the one list of
    these rules): attention by heads and query groups, the MLP by ``ffn_hidden_size``, the
    embedding and output layer by ``vocab_size`` (already padded by the caller; the CLI,
    which pads it later, passes ``check_vocab=False``), and with ``sequence_parallel`` the
    sequence by ``seq_length``. Pure arithmetic: a layout can be checked before building."""
    if tp == 1:
        return []
    # Experts are sharded over EP only; a TP split of them would need expert-TP collectives not built here.
    if config.num_moe_experts is not None:
        return [
            f"num_moe_experts {config.num_moe_experts} with tensor_model_parallel_size {tp}: expert "
            "tensor parallelism is not supported; use tensor_model_parallel_size 1 for MoE models "
            "(expert_model_parallel_size shards the experts)"
        ]
    names = ("num_attention_heads", "num_query_groups", "ffn_hidden_size") + ("vocab_size",) * check_vocab
    out = []
    for name in names:
        value = getattr(config, name)
        if value % tp:
            hint = " (pad the vocabulary)" if name == "vocab_size" else ""
            out.append(
                f"{name} {value} is not divisible by tensor_model_parallel_size {tp}: each tensor-parallel "
                f"rank holds {name} / tp of them; choose a multiple of {tp}{hint}"
            )
    if sequence_parallel and config.seq_length % tp:
        out.append(
            f"seq_length {config.seq_length} is not divisible by tensor_model_parallel_size {tp}, which "
            "sequence_parallel splits it by; choose seq_length a multiple of it or drop sequence_parallel"
        )
    return out


def expert_parallel_problems(config: TransformerConfig, ep: int) -> List[str]:
    """The field-named reasons ``config`` cannot be split over ``ep`` expert-parallel ranks."""
    if ep == 1:
        return []
    if config.num_moe_experts is None:
        return [
            f"expert_model_parallel_size {ep} needs a mixture-of-experts model: set num_moe_experts "
            "(or use expert_model_parallel_size 1)"
        ]
    if config.num_moe_experts % ep:
        return [
            f"num_moe_experts {config.num_moe_experts} is not divisible by expert_model_parallel_size "
            f"{ep}: each expert-parallel rank holds num_moe_experts / ep experts"
        ]
    return []


def check_tensor_parallel(
    config: TransformerConfig, tensor_model_parallel_size: int, sequence_parallel: bool = False
) -> None:
    """Raise ``ConfigError`` (a ValueError) with every :func:`tensor_parallel_problems`."""
    bad = Problems("TransformerConfig")
    for problem in tensor_parallel_problems(config, tensor_model_parallel_size, sequence_parallel):
        bad.add(problem)
    bad.raise_if_any()
