"""Plain-PyTorch reference route of ``megadlm_ext.adamw_step`` (the fused AdamW step).

Same contract and the same checks, worded the same way, as the compiled route
(csrc/adam_bindings.cpp). The math is the kernel's (megadlm/adam.h), written as torch ops
that each round once to fp32, so this route is bitwise the compiled one: ``mul``, ``add``,
``sub`` and the tensor-by-tensor ``div`` are correctly rounded on CPU and CUDA and none is
fused with another (the kernel divides by no scalar: torch's CUDA division by a scalar
multiplies by its reciprocal); ``sqrt`` goes through fp64 (torch's vectorized fp32 sqrt on
CPU is not always correctly rounded). The fp32 scalars come from the same doubles, computed
in the same order.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .reference import SUPPORTED_DTYPES, check_list

NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "model_params")
_DTYPES = {  # list -> (allowed dtypes, what the message says they must be)
    "params": ((torch.float32,), "float32 (the fp32 main params)"),
    "grads": ((torch.float32, torch.bfloat16), "float32 or bfloat16"),
    "exp_avgs": (SUPPORTED_DTYPES, "float32, bfloat16 or float16 (stored unscaled)"),
    "exp_avg_sqs": (SUPPORTED_DTYPES, "float32, bfloat16 or float16 (stored unscaled)"),
    "model_params": (
        (torch.bfloat16, torch.float16),
        "bfloat16 or float16 (the model params' copy; fp32 params are their own main params)",
    ),
}


def _fail(msg: str):
    raise ValueError(f"adamw_step: {msg}")


def _check_list(name: str, tensors, device: Optional[torch.device]) -> list:
    """A tensor-list argument, checked as the compiled route's parse_list does."""
    return check_list(name, tensors, device=device, device_owner="params[0]")


def _check_dtype(name: str, tensors: list) -> None:
    allowed, what = _DTYPES[name]
    if not tensors:
        return
    d = tensors[0].dtype
    if d not in allowed:
        _fail(f"{name}[0] has dtype {d}; {name} must be {what}")
    for i, t in enumerate(tensors):
        if t.dtype != d:
            _fail(
                f"{name}[{i}] is {t.dtype} but {name}[0] is {d}: one dtype per list "
                "(call adamw_step once per dtype combination)"
            )


def _check_scalars(lr, beta1, beta2, eps, weight_decay, step) -> None:
    def need(ok: bool, name: str, v: float, what: str) -> None:
        if not ok:
            _fail(f"{name} must be {what}, got {float(v)}")

    need(math.isfinite(lr) and lr >= 0, "lr", lr, "a finite number >= 0")
    need(0 <= beta1 < 1, "beta1", beta1, "in [0, 1)")
    need(0 <= beta2 < 1, "beta2", beta2, "in [0, 1)")
    need(math.isfinite(eps) and eps >= 0, "eps", eps, "a finite number >= 0")
    need(
        math.isfinite(weight_decay) and weight_decay >= 0,
        "weight_decay",
        weight_decay,
        "a finite number >= 0",
    )
    if step < 1:
        _fail(f"step must be >= 1 (the number of this update, counted as torch's AdamW does), got {step}")


def _check_no_overlap(lists: dict) -> None:
    spans = []
    for k, name in enumerate(NAMES):
        for i, t in enumerate(lists.get(name, ())):
            if t.numel():
                start = t.data_ptr()
                spans.append((start, start + t.numel() * t.element_size(), k, i))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            (ka, ia), (kb, ib) = sorted([(a[2], a[3]), (b[2], b[3])])
            _fail(
                f"{NAMES[ka]}[{ia}] and {NAMES[kb]}[{ib}] share memory: every tensor the step "
                "reads or writes must be distinct"
            )


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even), as the C++ route's float(double)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def adam_scalars(lr, beta1, beta2, eps, weight_decay, step) -> dict:
    """The fp32 scalars of one step (megadlm/adam.h ``adam_scalars``: doubles, then fp32)."""
    bc1 = 1.0 - math.pow(beta1, float(step))
    bc2 = 1.0 - math.pow(beta2, float(step))
    return {
        "decay": _f32(1.0 - lr * weight_decay),
        "beta1": _f32(beta1),
        "one_minus_beta1": _f32(1.0 - beta1),
        "beta2": _f32(beta2),
        "one_minus_beta2": _f32(1.0 - beta2),
        "step_size": _f32(lr / bc1),
        "inv_bias2_sqrt": _f32(1.0 / math.sqrt(bc2)),
        "eps": _f32(eps),
    }


def _step_one(p, g, m, v, mp, s: dict) -> None:
    """The kernel's element math (megadlm/adam.h ``adam_update``) on one tensor."""
    g32 = g.reshape(-1).float()
    p32 = p.reshape(-1).mul(s["decay"])
    m32 = m.reshape(-1).float().mul(s["beta1"]).add_(g32.mul(s["one_minus_beta1"]))
    v32 = v.reshape(-1).float().mul(s["beta2"]).add_(g32.mul(s["one_minus_beta2"]).mul_(g32))
    # torch's vectorized fp32 sqrt on CPU is not always correctly rounded (1 ulp off for some
    # inputs); an fp64 sqrt rounded to fp32 is (innocuous double rounding: 53 >= 2 * 24 + 2).
    denom = v32.double().sqrt_().float().mul_(s["inv_bias2_sqrt"]).add_(s["eps"])
    p32.sub_(m32.mul(s["step_size"]).div_(denom))
    p.view(-1).copy_(p32)
    m.view(-1).copy_(m32)  # rounded only now: the update used the unrounded moments
    v.view(-1).copy_(v32)
    if mp is not None:
        mp.view(-1).copy_(p32)


def adamw_step(
    params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step, model_params=None
) -> None:
    lists = {"params": _check_list("params", params, None)}
    device = lists["params"][0].device if lists["params"] else torch.device("cpu")
    n = len(lists["params"])
    given = [(name, obj) for name, obj in zip(NAMES[1:], (grads, exp_avgs, exp_avg_sqs, model_params))]
    for name, obj in given:
        if name == "model_params" and obj is None:
            continue
        lists[name] = _check_list(name, obj, device)
        if len(lists[name]) != n:
            _fail(f"{name} has {len(lists[name])} tensors but params has {n} (one entry per parameter)")
    for name in NAMES[1:]:
        for i, t in enumerate(lists.get(name, ())):
            if t.numel() != lists["params"][i].numel():
                _fail(
                    f"{name}[{i}] has {t.numel()} elements but params[{i}] has {lists['params'][i].numel()}"
                )
    for name in NAMES:
        if name in lists:
            _check_dtype(name, lists[name])
    _check_scalars(lr, beta1, beta2, eps, weight_decay, step)
    _check_no_overlap(lists)
    s = adam_scalars(lr, beta1, beta2, eps, weight_decay, step)
    mps = lists.get("model_params", [None] * n)
    with torch.no_grad():
        for p, g, m, v, mp in zip(*(lists[k] for k in NAMES[:4]), mps):
            if p.numel():
                _step_one(p, g, m, v, mp, s)
