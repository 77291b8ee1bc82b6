"""Activation recomputation: Megatron's ``--recompute-granularity`` / ``--recompute-method`` /
``--recompute-num-layers`` / ``--distribute-saved-activations``.

* ``full``: a span of transformer layers runs its forward without keeping activations; only
  the span's input is saved, and the backward runs the span's forward again (with grad) before
  going through it. ``uniform`` cuts the chunk's layers into spans of ``recompute_num_layers``;
  ``block`` recomputes the first ``recompute_num_layers`` layers of the chunk one by one and
  keeps the others' activations. Counted per model chunk (a pipeline stage, or a virtual chunk
  under interleaving), as Megatron's ``TransformerBlock._checkpointed_forward``.
* ``selective``: only core attention (the softmax, its dropout and the weighted sum, whose
  [B, N, S, S] probabilities dominate activation memory at long sequences) is recomputed.

The recomputation must reproduce the forward exactly, dropout masks included: before the
forward :class:`CheckpointFunction` saves every RNG state a dropout can draw from (the CPU and
CUDA default generators and the model-parallel tracker's streams), the backward sets them
back for the recomputation and afterwards restores the states it found, so the streams go on
as in a run without recomputation (bitwise the same losses and gradients).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megadlms.common.enums import RecomputeGranularity, RecomputeMethod
from megadlms.parallel.mappings import Group, group_rank, group_size
from megadlms.parallel.random import RNGStatesTracker, fork_all_rng, get_all_rng_states, set_all_rng_states

RECOMPUTE_GRANULARITIES = tuple(m.value for m in RecomputeGranularity)
RECOMPUTE_METHODS = tuple(m.value for m in RecomputeMethod)

_recompute_depth = 0  # > 0 while a backward re-runs a forward (see recomputing())


def recomputing() -> bool:
    """True while a backward re-runs a forward: side effects of a forward that must happen
    once per micro-batch (the MoE layers' logging sums) skip the second run."""
    return _recompute_depth > 0


@contextlib.contextmanager
def _recompute_pass():
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def recompute_problems(
    config,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    layers_per_rank: Optional[int] = None,
) -> List[str]:
    """Megatron's rules for the recompute fields of ``config`` (a TransformerConfig), worded
    with field names. ``layers_per_rank``: num_layers / pipeline size (None: not checked)."""
    g, method, n = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    out = []
    if g is not None and g not in RECOMPUTE_GRANULARITIES:
        out.append(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {g!r}")
    if g == RecomputeGranularity.FULL:
        if method not in RECOMPUTE_METHODS:
            out.append(f"recompute_granularity full needs recompute_method uniform or block (got {method})")
        bound = layers_per_rank if layers_per_rank is not None else config.num_layers
        if n is None or not 1 <= n <= bound:
            out.append(
                f"recompute_granularity full needs recompute_num_layers between 1 and the layers per "
                f"pipeline stage, {bound} (got {n})"
            )
    if g == RecomputeGranularity.SELECTIVE and method is not None:
        out.append(
            f"recompute_method {method} is not supported with recompute_granularity selective "
            "(it recomputes the core-attention of every layer): drop recompute_method"
        )
    if g == RecomputeGranularity.SELECTIVE and n is not None:
        out.append(f"recompute_granularity selective takes no recompute_num_layers (got {n}): drop it")
    if config.distribute_saved_activations:
        out += _distribute_problems(config, tensor_model_parallel_size, sequence_parallel)
    return out


def _distribute_problems(config, tp: int, sequence_parallel: bool) -> List[str]:
    out = []
    if tp <= 1:
        out.append(
            "distribute_saved_activations splits the saved layer inputs across tensor-parallel ranks: "
            f"it needs tensor_model_parallel_size > 1 (got {tp})"
        )
    if config.recompute_granularity != RecomputeGranularity.FULL or config.recompute_method is None:
        out.append(
            "distribute_saved_activations needs recompute_granularity full with a recompute_method "
            f"(got recompute_granularity {config.recompute_granularity}, recompute_method "
            f"{config.recompute_method})"
        )
    if sequence_parallel:
        # With SP the saved input is already this rank's sequence chunk: nothing is left to split.
        out.append("distribute_saved_activations cannot be used with sequence_parallel: drop one of them")
    return out


def _split_1d(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's 1/tp of ``x`` flattened (zero-padded to a multiple of tp), as a copy: a
    view would keep the whole tensor alive and save nothing."""
    size = group_size(group)
    flat = x.reshape(-1)
    chunk = -(-flat.numel() // size)
    flat = torch.nn.functional.pad(flat, (0, chunk * size - flat.numel()))
    rank = group_rank(group)
    return flat[rank * chunk : (rank + 1) * chunk].clone()


def _gather_1d(part: torch.Tensor, group: Group, shape: torch.Size) -> torch.Tensor:
    parts = [torch.empty_like(part) for _ in range(group_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts)[: shape.numel()].view(shape)


class CheckpointFunction(torch.autograd.Function):
    """``run(*args)`` without saved activations; the backward replays it under the RNG states
    of the forward (Megatron's tensor_parallel.CheckpointFunction, with our tracker passed in
    rather than global). ``distribute_group``: store only this rank's 1/tp of ``args[0]`` and
    all-gather it in the backward (``--distribute-saved-activations``)."""

    @staticmethod
    def forward(ctx, run, tracker, distribute_group, *args):
        ctx.run, ctx.tracker, ctx.group = run, tracker, distribute_group
        ctx.rng_states = get_all_rng_states(tracker)
        with torch.no_grad():
            out = run(*args)
        ctx.inputs_need_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        saved = list(args)
        if distribute_group is not None:
            ctx.shape0 = args[0].shape
            saved[0] = _split_1d(args[0], distribute_group)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs = list(ctx.saved_tensors)
        if ctx.group is not None:
            inputs[0] = _gather_1d(inputs[0], ctx.group, ctx.shape0)
        detached = [t.detach().requires_grad_(r) for t, r in zip(inputs, ctx.inputs_need_grad)]
        # fork: after the replay every stream is back where this backward found it.
        with fork_all_rng(ctx.tracker), _recompute_pass():
            set_all_rng_states(ctx.rng_states, ctx.tracker)
            with torch.enable_grad():
                out = ctx.run(*detached)
        torch.autograd.backward(out, grad)
        return (None, None, None) + tuple(
            d.grad if r else None for d, r in zip(detached, ctx.inputs_need_grad)
        )


def checkpoint(
    run: Callable[..., torch.Tensor],
    tracker: Optional[RNGStatesTracker],
    distribute_group: Group,
    *args: torch.Tensor,
) -> torch.Tensor:
    """``run(*args)`` (tensors in, one tensor out) recomputed in the backward. Runs it plainly
    when nothing needs a gradient: the re-entrant backward would never be reached, and the
    weights' gradients inside ``run`` would be lost."""
    if not torch.is_grad_enabled() or not any(a.requires_grad for a in args):
        return run(*args)
    return CheckpointFunction.apply(run, tracker, distribute_group, *args)


def checkpointed_layers_forward(block, x_BSH: torch.Tensor, rotary, doc_mask) -> torch.Tensor:
    """``block.layers`` over ``x_BSH`` with full recomputation by ``block.recompute_method``
    (rotary and doc_mask are the same for every layer and need no gradient: closed over)."""
    layers, n = list(block.layers), block.recompute_num_layers
    tracker = block.tp.rng_tracker
    group = block.tp.group if block.distribute_saved_activations else None

    def span(start: int, end: int):
        def run(x):
            for layer in layers[start:end]:
                x = layer(x, rotary, doc_mask)
            return x

        return run

    if block.recompute_method == RecomputeMethod.UNIFORM:
        for start in range(0, len(layers), n):
            x_BSH = checkpoint(span(start, min(start + n, len(layers))), tracker, group, x_BSH)
        return x_BSH
    for i, layer in enumerate(layers):  # block: the first n layers of this chunk
        x_BSH = checkpoint(span(i, i + 1), tracker, group, x_BSH) if i < n else layer(x_BSH, rotary, doc_mask)
    return x_BSH
