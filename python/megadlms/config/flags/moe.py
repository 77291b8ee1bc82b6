"""Mixture-of-experts model flags (Megatron-LM's names and defaults; TransformerConfig's
``num_moe_experts`` and ``moe_*`` fields). The expert-parallel layout flag
(--expert-model-parallel-size) lives with the other parallel sizes."""

from __future__ import annotations

import argparse
import ast

from ._flag import add_flag


def moe_layer_freq(value: str):
    """--moe-layer-freq: an int N (every N-th layer, starting at the first) or Megatron's list
    pattern such as ``[1,0,1,0]`` or ``([0]+[1]*3)*2`` (list literals, + and * only; Megatron
    evals the string, we parse it)."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        # Parsed, not eval'd: a flag value must not run code, yet Megatron's list expressions must work.
        pattern = _pattern(ast.parse(value, mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"--moe-layer-freq {value!r}: expected an integer or a 0/1 list pattern like "
            f"'([1]*3+[0])*2' ({exc})"
        ) from None
    if not isinstance(pattern, list):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {value!r}: the pattern must be a list")
    return pattern


def _pattern(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_pattern(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        # Python's own list semantics ([0]*3, [1]+[0]); a result that is not a list is refused by the caller.
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported element {ast.dump(node)[:40]}")


def moe_args(p):
    """Mixture-of-experts layers (Megatron's --num-experts / --moe-* flags)."""
    g = p.add_argument_group("mixture of experts")
    for add in (_moe_router_flags, _moe_dispatch_flags):
        add(g)


def _moe_router_flags(g):
    """Experts, routing and the router's losses."""
    add_flag(g, "--num-experts", type=int, default=None, help="Experts per MoE layer (default: dense MLPs).")
    add_flag(g, "--moe-router-topk", type=int, default=2, help="Experts each token is routed to.")
    add_flag(
        g,
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="Width of one expert's MLP (default --ffn-hidden-size).",
    )
    add_flag(
        g,
        "--moe-layer-freq",
        type=moe_layer_freq,
        default=1,
        help="Which layers are MoE: N (every N-th, from the first) or a 0/1 pattern, e.g. '([0]+[1]*3)*2'.",
    )
    add_flag(
        g,
        "--moe-router-score-function",
        default="softmax",
        choices=["softmax", "sigmoid"],
        help="Router score: softmax (top-k then softmax) or sigmoid (renormalised over the k).",
    )
    add_flag(
        g,
        "--moe-router-pre-softmax",
        action="store_true",
        help="Softmax over all experts before the top-k (the k probabilities are not renormalised).",
    )
    add_flag(
        g,
        "--moe-router-load-balancing-type",
        default="aux_loss",
        choices=["aux_loss", "none"],
        help="aux_loss: the Switch load-balancing loss, weighted by --moe-aux-loss-coeff; none.",
    )
    add_flag(g, "--moe-aux-loss-coeff", type=float, default=0.0, help="Weight of the load-balancing loss.")
    add_flag(
        g,
        "--moe-z-loss-coeff",
        type=float,
        default=None,
        help="Weight of the router z-loss (off when unset).",
    )


def _moe_dispatch_flags(g):
    """Capacity, token dropping, shared experts and dispatch."""
    add_flag(
        g,
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="Expert capacity as a multiple of the balanced share; tokens over it are dropped "
        "(default: dropless).",
    )
    add_flag(
        g,
        "--moe-token-drop-policy",
        default="probs",
        choices=["probs", "position"],
        help="Which tokens an over-full expert keeps: highest routing probability, or earliest.",
    )
    add_flag(
        g,
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).",
    )
    add_flag(
        g,
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="Width of a shared expert MLP every token also goes through (default: none).",
    )
    add_flag(
        g,
        "--moe-token-dispatcher-type",
        default="allgather",
        choices=["allgather", "alltoall"],
        help="How tokens reach the experts on other expert-parallel ranks.",
    )
    add_flag(
        g,
        "--moe-grouped-gemm",
        action="store_true",
        help="Accepted for Megatron scripts (no effect: the experts always run as one grouped GEMM).",
    )
