"""The precision-aware optimizer's flags (Megatron-LM's names, defaults and choices; the
OptimizerConfig fields of the same names, megadlms/optimizer/precision.py).

MegaDLMs' parser offers fp32/fp16/fp8 for the moments, current Megatron-LM adds bf16: the
union is accepted. The rules between them and the other flags are
``optimizer.precision_aware_problems``."""

from __future__ import annotations

from megadlms.optimizer.precision import ALLOWED

from .flags_model import add_flag


def add_paopt_args(p) -> None:
    """--use-precision-aware-optimizer and the four dtypes it unlocks."""
    g = p.add_argument_group("precision-aware optimizer")
    add_flag(
        g,
        "--use-precision-aware-optimizer",
        action="store_true",
        help="Allow the main grads, main params and Adam moments below fp32 (the four flags below); "
        "the update still runs in fp32.",
    )
    what = {
        "main_grads_dtype": "main grads (bf16: with --bf16, the DDP grad buffer stays bf16)",
        "main_params_dtype": "main params (fp16: kept in the optimizer state with a per-tensor scale)",
        "exp_avg_dtype": "Adam's first moment in memory (fp16/fp8: per-tensor scale)",
        "exp_avg_sq_dtype": "Adam's second moment in memory (fp16/fp8: per-tensor scale)",
    }
    for dest, text in what.items():
        add_flag(
            g,
            "--" + dest.replace("_", "-"),
            default="fp32",
            choices=list(ALLOWED[dest]),
            help=f"Dtype of the {text}; needs --use-precision-aware-optimizer unless fp32.",
        )
