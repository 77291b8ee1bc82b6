"""What a checkpoint records about the model and tokenizer, and how a run is checked
against it (the architecture fields and the flags that set them)."""

from __future__ import annotations

import dataclasses
from typing import Optional

# Architecture fields whose mismatch makes a checkpoint unloadable, with their flags.
MODEL_CONFIG_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "vocab_size": "--vocab-size / --tokenizer-type / --make-vocab-size-divisible-by",
    "padded_vocab_size": "--vocab-size / --tokenizer-type / --make-vocab-size-divisible-by",
    "max_position_embeddings": "--max-position-embeddings",
    "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization",
    "swiglu": "--swiglu",
    # Two field names per setting where Megatron's TransformerConfig and ours differ; either may be saved.
    "gated_linear_unit": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "qk_layernorm": "--qk-layernorm",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    # What an imported model (hf/) brings besides the shapes: same tensors, other numbers.
    "add_qkv_bias": "--add-qkv-bias",
    "rotary_base": "--rotary-base",
    "rope_scaling": "--rope-scaling",
    "num_moe_experts": "--num-experts",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_router_topk": "--moe-router-topk",
    "moe_router_pre_softmax": "--moe-router-pre-softmax",
    "moe_router_score_function": "--moe-router-score-function",
}
# Fields a record omits when they hold this value (TransformerConfig.to_dict): plain RoPE has no
# rope_scaling key, and records older than the field were plain RoPE too.
ABSENT_MEANS = {"rope_scaling": None}


@dataclasses.dataclass(frozen=True)
class RunRecords:
    """What a save records about the run besides tensors and counters (JSON-able dicts):
    ``args`` (the whole configuration), ``model_config`` (``TransformerConfig.to_dict()``,
    checked on load) and ``tokenizer`` (``TokenizerConfig`` fields, read by generate/export)."""

    args: Optional[dict] = None
    model_config: Optional[dict] = None
    tokenizer: Optional[dict] = None


def check_model_config(saved: dict, current: dict, ckpt: str) -> None:
    """Raise naming the first architecture field that differs between checkpoint and run."""
    if saved and current:  # an empty record (a checkpoint from elsewhere) has nothing to compare
        saved, current = ({**ABSENT_MEANS, **d} for d in (saved, current))
    for field, flag in MODEL_CONFIG_FLAGS.items():
        # Fields missing on either side are skipped: older checkpoints recorded fewer of them.
        if field in saved and field in current and saved[field] != current[field]:
            raise ValueError(
                f"checkpoint {ckpt} was trained with {field}={saved[field]!r} but this "
                f"run has {field}={current[field]!r} ({flag}); use the checkpoint's "
                "model flags or start without --load"
            )


def tokenizer_record(common: dict) -> dict:
    """The checkpoint's tokenizer record (``TokenizerConfig`` fields). Format-1 checkpoints
    stored only the run's flags: their record is read from those, here and only here."""
    if common.get("tokenizer"):
        return dict(common["tokenizer"])
    saved = common.get("args", {})
    return {
        "tokenizer_type": saved.get("tokenizer_type") or "ByteTokenizer",
        "tokenizer_model": saved.get("tokenizer_model"),
        "mask_token": saved.get("mask_token"),
        "vocab_size": saved.get("vocab_size"),
    }
