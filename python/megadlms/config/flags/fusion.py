"""Fused-kernel flags (TransformerConfig's ``apply_rope_fusion``, ``bias_swiglu_fusion`` and
``residual_rmsnorm_fusion``; megadlms/ops, docs/model_and_objective.md "Fused kernels").

Each fused path is on by default, as Megatron's are, and runs on CUDA tensors only: fusion
exists to cut GPU kernel launches and memory traffic, and on CPU the model always runs the
unfused torch ops, so a CPU run is bitwise the same with or without these flags. They are
for debugging (the unfused ops are the reference the kernels are tested against).
"""

from __future__ import annotations

from ._flag import add_flag

_ON_CPU = " On CPU the unfused torch ops always run (a CPU run is bitwise the same either way)."


def fusion_args(p):
    """--no-rope-fusion / --no-bias-swiglu-fusion (Megatron's) / --no-residual-rmsnorm-fusion."""
    g = p.add_argument_group("fused kernels (GPU; on by default)")
    add_flag(
        g,
        "--no-rope-fusion",
        action="store_false",
        dest="apply_rope_fusion",
        help="Unfused rotary embedding on GPU (torch's chunk, neg, cat, casts, mul, add) instead of "
        "one fused kernel each way; for debugging." + _ON_CPU,
    )
    add_flag(
        g,
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="Unfused SwiGLU on GPU (F.silu(gate) * up) instead of one fused kernel each way that "
        "saves only the fc1 output; for debugging." + _ON_CPU,
    )
    # Megatron has no such flag (it fuses the residual into the norm only through Transformer
    # Engine's layers): the name follows its --no-*-fusion pattern and says what is fused.
    add_flag(
        g,
        "--no-residual-rmsnorm-fusion",
        action="store_false",
        dest="residual_rmsnorm_fusion",
        help="Unfused attention residual add + pre-MLP RMSNorm on GPU instead of one fused kernel "
        "each way; for debugging. megadlms's own flag (Megatron has none); LayerNorm models "
        "always run these unfused." + _ON_CPU,
    )
