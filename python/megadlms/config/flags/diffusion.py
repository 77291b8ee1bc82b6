"""The difflm group: the diffusion-LM objective's flags (MegaDLMs' custom_args/difflm.py;
DiffusionConfig's fields)."""

from __future__ import annotations

from ._flag import add_flag


def _int_or_str(value: str):
    # A token string that looks like a number would be taken as an id: name such tokens by their id.
    return int(value) if value.lstrip("-").isdigit() else value


def difflm_args(p):
    """The diffusion-LM objective (MegaDLMs' custom_args/difflm.py)."""
    g = p.add_argument_group("difflm (diffusion language model)")
    for add in (_difflm_mode_flags, _difflm_objective_flags, _difflm_block_flags):
        add(g)


def _difflm_mode_flags(g):
    """Diffusion or autoregressive mode, mask token and attention."""
    add_flag(
        g,
        "--model-running-mode",
        default="difflm-noshift",
        choices=["difflm-noshift", "difflm-shift", "vanilla"],
        help="difflm-noshift: masked diffusion LM on unshifted tokens; difflm-shift: masked diffusion "
        "whose logits at position i predict token i+1 (Dream, Fast-dLLM v2; bidirectional); vanilla: "
        "autoregressive (causal, shifted labels).",
    )
    add_flag(
        g,
        "--base-model",
        default="vanilla",
        choices=["vanilla"],
        help="MegaDLMs model series (only vanilla).",
    )
    add_flag(
        g,
        "--mask-token",
        type=_int_or_str,
        default=None,
        help="Mask token id or string. Default: the tokenizer's mask token.",
    )
    add_flag(
        g,
        "--attention-mask-type",
        default=None,
        choices=["no_mask", "causal", "causal_bottom_right", "block_causal"],
        help="no_mask (bidirectional) or causal. Default: no_mask for difflm-noshift, causal for vanilla "
        "(MegaDLMs: causal_bottom_right). causal_bottom_right equals causal here (queries and keys have "
        "the same length); vanilla mode always runs causal (as MegaDLMs); block_causal needs MegaDLMs' "
        "conditional mode (not available).",
    )
    add_flag(
        g,
        "--core-attn-implementation",
        default="TEDotProductAttention",
        choices=["TEDotProductAttention", "FlexAttention"],
        help="Attention kernel: TEDotProductAttention runs torch SDPA (with a boolean block mask when "
        "packing documents), FlexAttention runs torch flex_attention with a document block mask.",
    )


def _difflm_objective_flags(g):
    """The masking objective and its evaluation."""
    add_flag(
        g,
        "--difflm-mask-eps",
        type=float,
        default=None,
        help="Mask probability p = (1-eps)*t + eps. "
        "Default: 0 (MegaDLMs), 1e-3 with --difflm-objective llada.",
    )
    add_flag(
        g,
        "--difflm-p-mask",
        default=None,
        choices=["sampled", "realised"],
        help="Weight the loss by the realised mask fraction with >= 1 masked token per row (default, "
        "MegaDLMs) or the sampled p (--difflm-objective llada's default).",
    )
    add_flag(
        g,
        "--difflm-varilen-prob",
        type=float,
        default=0.01,
        help="Probability that a step's batch is cropped to a random length (same on every rank).",
    )
    add_flag(
        g,
        "--difflm-eval-mc-samples",
        type=int,
        default=1,
        help="K: Monte Carlo samples (stratified t, fixed seed) of the validation NELBO (1: one forward "
        "per eval batch, as MegaDLMs).",
    )
    add_flag(
        g,
        "--difflm-objective",
        default="megadlms",
        choices=["megadlms", "llada"],
        help="megadlms (default): MegaDLMs' difflm-noshift objective (model input and target text[1:L], "
        "eps 0, realised mask fraction, >= 1 masked token per row, a per-micro-batch crop); llada: "
        "LLaDA's (target text[1:S+1], eps 1e-3, sampled p, one crop per step).",
    )


def _difflm_block_flags(g):
    """Block diffusion (BD3-LM): the [x_t ; x_0] pass under the block mask."""
    add_flag(
        g,
        "--difflm-block-size",
        type=int,
        default=None,
        help="Block diffusion (BD3-LM) with blocks of B tokens (B divides --seq-length): one pass over "
        "[x_t ; x_0] under the block mask, t per block, the loss on x_t. B = --seq-length runs today's "
        "full-sequence objective. Default: off.",
    )
    add_flag(
        g,
        "--difflm-noise-clip-low",
        type=float,
        default=None,
        help="Block diffusion: t ~ U(low, high) (BD3-LM's sampling_eps_min). Default 0.",
    )
    add_flag(
        g,
        "--difflm-noise-clip-high",
        type=float,
        default=None,
        help="Block diffusion: t ~ U(low, high) (BD3-LM's sampling_eps_max). Default 1.",
    )
    add_flag(
        g,
        "--difflm-ar-loss-weight",
        type=float,
        default=None,
        help="Block diffusion with --model-running-mode difflm-shift (AR-to-block adaptation): add this "
        "weight times the autoregressive loss of the clean x_0 stream (then token-causal) to x_t's "
        "diffusion loss, in the same pass. Default: 0.",
    )
