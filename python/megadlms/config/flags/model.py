"""The model group: the transformer's shape, layers, initialisation and Megatron's inert model
flags (TransformerConfig's fields; the MoE, fusion and recompute flags have their own modules)."""

from __future__ import annotations

import argparse

from ._flag import add_flag


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def rope_scaling_arg(value: str) -> dict:
    """--rope-scaling 'rope_type=yarn,factor=4,...' -> {"rope_type": "yarn", "factor": 4, ...}
    (numbers and true/false parsed; no quotes needed in a shell)."""
    pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
    if not pairs or any(len(p) != 2 or not p[0].strip() for p in pairs):
        raise argparse.ArgumentTypeError(
            f"--rope-scaling {value!r}: expected key=value pairs, e.g. rope_type=linear,factor=2"
        )
    return {k.strip(): _value(v.strip()) for k, v in pairs}


def rope_scaling_flag(scaling: dict) -> str:
    """The --rope-scaling value that parses back to ``scaling``."""
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in scaling.items())


def model_args(p):
    """The transformer's shape and layers."""
    g = p.add_argument_group("model")
    for add in (_model_shape_flags, _model_layer_flags, _model_init_flags, _model_inert_flags):
        add(g)


def _model_shape_flags(g):
    """Layers, widths, heads and sequence length."""
    add_flag(g, "--num-layers", type=int, default=None, help="Number of transformer layers (required).")
    add_flag(g, "--hidden-size", type=int, default=None, help="Transformer hidden size (required).")
    add_flag(
        g,
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size. Default 4*hidden-size, or int(8*hidden/3/64)*64 with --swiglu "
        "(Megatron's rule).",
    )
    add_flag(
        g,
        "--num-attention-heads",
        type=int,
        default=None,
        help="Number of attention (query) heads (required).",
    )
    add_flag(
        g,
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (with --num-query-groups).",
    )
    add_flag(
        g,
        "--num-query-groups",
        type=int,
        default=1,
        help="Key/value head groups with --group-query-attention; without it, equals --num-attention-heads.",
    )
    add_flag(
        g,
        "--kv-channels",
        type=int,
        default=None,
        help="Per-head dimension. Default hidden-size / num-attention-heads.",
    )
    add_flag(g, "--seq-length", type=int, default=None, help="Training sequence length in tokens (required).")
    add_flag(
        g,
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Longest sequence the model accepts (learned position table size). Default --seq-length.",
    )


def _model_layer_flags(g):
    """Position encoding, normalisation, MLP and bias choices."""
    add_flag(
        g,
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
        help="Position encoding: learned absolute table or rotary (RoPE).",
    )
    add_flag(g, "--rotary-base", type=int, default=10000, help="RoPE base frequency.")
    add_flag(
        g,
        "--rope-scaling",
        type=rope_scaling_arg,
        default=None,
        help="RoPE scaling as comma-separated key=value pairs, e.g. rope_type=llama3,factor=8,"
        "low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192 (rope_type linear, "
        "llama3 or yarn; transformers' parameter names). Default: plain RoPE.",
    )
    add_flag(
        g,
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of head dim rotated (only 1.0 supported).",
    )
    add_flag(
        g,
        "--normalization",
        default="LayerNorm",
        choices=["LayerNorm", "RMSNorm"],
        help="Normalisation layer type.",
    )
    add_flag(g, "--norm-epsilon", type=float, default=1e-5, help="Epsilon of LayerNorm/RMSNorm.")
    add_flag(g, "--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU) instead of GeLU.")
    add_flag(
        g,
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="No bias in the linear layers.",
    )
    add_flag(
        g,
        "--add-qkv-bias",
        action="store_true",
        help="Bias on the QKV projection even with --disable-bias-linear (Qwen2).",
    )
    add_flag(
        g, "--qk-layernorm", action="store_true", help="Normalise queries and keys per head before attention."
    )


def _model_init_flags(g):
    """Embeddings, dropout, initialisation and vocabulary."""
    add_flag(
        g,
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output-layer weight instead of reusing the input embedding "
        "(required by --use-torch-fsdp2).",
    )
    add_flag(g, "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    add_flag(
        g, "--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states (residual branches)."
    )
    add_flag(
        g, "--init-method-std", type=float, default=0.02, help="Std of the normal weight initialisation."
    )
    add_flag(g, "--vocab-size", type=int, default=None, help="Vocabulary size. Default: the tokenizer's.")
    add_flag(
        g,
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding rows to a multiple of this.",
    )
    add_flag(
        g,
        "--model-type",
        default="gpt",
        choices=["gpt"],
        help="Model family: decoder-style stack; attention direction comes from --attention-mask-type.",
    )


def _model_inert_flags(g):
    """Megatron kernel choices accepted without effect (megatron_compat.py)."""
    add_flag(
        g,
        "--attention-backend",
        default="auto",
        choices=["auto", "flash", "fused", "unfused", "local"],
        help="Megatron attention kernel choice (no effect: torch SDPA picks the kernel).",
    )
    add_flag(
        g,
        "--attention-softmax-in-fp32",
        action="store_true",
        help="Accepted for Megatron scripts (no effect).",
    )
    # Negative flags with positive dests (store_false): the inert value in megatron_compat is True.
    for name in ("gelu", "dropout"):
        add_flag(
            g,
            f"--no-bias-{name}-fusion",
            action="store_false",
            dest=f"bias_{name}_fusion",
            help="Accepted for Megatron scripts (no fused kernels; no effect).",
        )
