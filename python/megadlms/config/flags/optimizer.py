"""Optimizer flags: the optimizer kind and learning-rate schedule, its hyper-parameters (both
in the "training / optimisation" group, see training.py), mixed precision and loss scaling, and
the precision-aware optimizer (Megatron-LM's names, defaults and choices; the OptimizerConfig
fields of the same names, megadlms/optimizer/precision.py).

For the precision-aware optimizer MegaDLMs' parser offers fp32/fp16/fp8 for the moments,
current Megatron-LM adds bf16: the union is accepted. The rules between them and the other
flags are ``optimizer.precision_aware_problems``."""

from __future__ import annotations

from megadlms.optimizer.precision import ALLOWED

from ._flag import add_flag


def lr_flags(g):
    """The optimizer kind and Megatron's learning-rate schedule."""
    add_flag(
        g,
        "--optimizer",
        default="adam",
        choices=["adam", "sgd"],
        help="AdamW (decoupled weight decay) or SGD.",
    )
    add_flag(g, "--lr", type=float, default=None, help="Peak learning rate (required).")
    add_flag(g, "--min-lr", type=float, default=0.0, help="Learning-rate floor after decay.")
    add_flag(
        g,
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "WSD"],
        help="Learning-rate decay after warmup.",
    )
    add_flag(g, "--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    add_flag(
        g, "--lr-warmup-fraction", type=float, default=None, help="Warmup as a fraction of --lr-decay-iters."
    )
    add_flag(g, "--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    add_flag(
        g,
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Steps over which the LR decays (incl. warmup). Default --train-iters.",
    )
    add_flag(
        g,
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="WSD: shape of the final decay phase.",
    )
    add_flag(
        g,
        # Megatron's own spelling mixes '_' and '-'; scripts use both, so both are accepted.
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="On resume, take the LR schedule from these flags instead of the checkpoint.",
    )
    add_flag(
        g,
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: length of the final decay phase (required for WSD).",
    )


def optimizer_flags(g):
    """Optimizer hyper-parameters, clipping and the seed."""
    add_flag(
        g, "--weight-decay", type=float, default=0.01, help="Decoupled weight decay (not on biases/norms)."
    )
    add_flag(g, "--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    add_flag(g, "--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    add_flag(g, "--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    add_flag(g, "--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    add_flag(
        g, "--clip-grad", type=float, default=1.0, help="Clip the global grad L2 norm to this (0 disables)."
    )
    add_flag(g, "--seed", type=int, default=1234, help="Seed of init, masking noise and data order.")


def precision_args(p):
    """bf16 / fp16 and fp16 loss scaling."""
    g = p.add_argument_group("mixed precision")
    add_flag(
        g, "--bf16", action="store_true", help="bf16 params/compute, fp32 main params and grad reduction."
    )
    add_flag(g, "--fp16", action="store_true", help="fp16 params/compute with loss scaling (DDP only).")
    add_flag(
        g, "--loss-scale", type=float, default=None, help="Static fp16 loss scale; default dynamic scaling."
    )
    # Megatron's defaults: start high and let the first overflows back the scale off quickly.
    add_flag(g, "--initial-loss-scale", type=float, default=2.0**32, help="Initial dynamic loss scale.")
    add_flag(g, "--min-loss-scale", type=float, default=1.0, help="Lower bound of the dynamic loss scale.")
    add_flag(
        g, "--loss-scale-window", type=float, default=1000, help="Clean steps before the loss scale grows."
    )
    add_flag(
        g, "--hysteresis", type=int, default=2, help="Overflows tolerated before the loss scale backs off."
    )
    add_flag(
        g,
        "--fp8-format",
        dest="fp8",
        default=None,
        choices=["e4m3", "hybrid"],
        help="FP8 training (not supported yet).",
    )


def precision_aware_args(p) -> None:
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
