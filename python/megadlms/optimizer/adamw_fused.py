"""PrecisionAwareAdamW's fused step: ``megadlm_ext.adamw_step`` over a param group's tensors
(one CUDA launch, or the C++ CPU kernel) instead of torch's single-tensor AdamW per parameter
with a decode / encode of the stored moments around it (on a GPU: ~15 launches and two fp32
temporaries per parameter).

Which step runs where (``PrecisionAwareAdamW(kernel=...)``, from ``OptimizerConfig.fused_adam``):

* ``"auto"`` (the default): the fused step for CUDA params, the per-parameter Python step
  for CPU params, so every CPU number stays bitwise what it was.
* ``"megadlm"``: the fused step on every device (its C++ kernel on CPU).
* ``"python"``: the per-parameter step everywhere (debugging, comparisons).

The fused kernel stores the moments unscaled: it applies when both moment codecs are fp32
or bf16 and the main params are fp32 (``main_params_dtype`` fp32). The scaled codecs (fp16 /
fp8 moments: a per-tensor scale from the absmax after the update, a second pass by
construction) and fp16 main params (``master_param``, scaled too) keep the Python step.

Same state (keys, dtypes, ``step`` counters), same checkpoints, same rounding order as the
Python step (the param from the unrounded new moments, the moments stored rounded after);
the fp32 operations are those of torch's fused AdamW rather than torch's single-tensor
step, so the two steps agree to fp32 rounding (a few ulp), not bitwise.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

import megadlm_ext as ext

KERNELS = ("auto", "megadlm", "python")


def kernel_from_config(config) -> str:
    """PrecisionAwareAdamW's ``kernel`` for ``OptimizerConfig.fused_adam``: None -> "auto",
    "megadlm" -> "megadlm", False -> "python". True (torch's fused AdamW, fp32 state only) has
    no precision-aware meaning; OptimizerConfig refuses it with a lowered dtype."""
    choice = {None: "auto", "megadlm": "megadlm", False: "python"}
    if config.fused_adam is True or config.fused_adam not in choice:
        raise ValueError(
            f"fused_adam={config.fused_adam!r} does not apply to the precision-aware optimizer: "
            "use None (our fused step on CUDA), 'megadlm' (everywhere) or False (the Python step)"
        )
    return choice[config.fused_adam]


def kernel_applies(codecs) -> bool:
    """Whether the fused kernel can store this optimizer's state: unscaled moments, fp32
    main params."""
    return "master_param" not in codecs and not (codecs["exp_avg"].scaled or codecs["exp_avg_sq"].scaled)


def uses_kernel(kernel: str, p: torch.Tensor) -> bool:
    """Whether param ``p`` takes the fused step under ``kernel`` (given kernel_applies)."""
    return kernel == "megadlm" or (kernel == "auto" and p.device.type == "cuda")


def fused_group_step(opt, pairs: List[Tuple[torch.Tensor, torch.Tensor]], group: dict) -> None:
    """The step of ``pairs`` ((param, grad) of one param group) with ``megadlm_ext.adamw_step``:
    one call per (device, grad dtype, step count) -- normally one per group. Increments
    each param's ``step`` counter as torch's AdamW does."""
    states = [opt._init_state(p) for p, _ in pairs]
    counters = [st["step"] for st in states]
    torch._foreach_add_(counters, 1)  # host tensors, one call for the group: no device sync
    buckets: Dict[tuple, Tuple[list, list, list, list]] = {}
    for (p, g), st, step in zip(pairs, states, counters):
        key = (p.device, g.dtype, int(step.item()))
        lists = buckets.setdefault(key, ([], [], [], []))
        for out, t in zip(lists, (p, g, st["exp_avg"], st["exp_avg_sq"])):
            out.append(t)
    beta1, beta2 = group["betas"]
    for (_device, _dtype, step), (ps, gs, ms, vs) in buckets.items():
        ext.adamw_step(
            ps,
            gs,
            ms,
            vs,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            step=step,
        )
