"""``megadlms-plan``: the trainer's flags in, per-rank memory and predicted throughput out.

megadlms-plan --world-size 64 --device H200 [--sweep] [--json] <the training flags>
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

from megadlms.config.plan_args import parse_plan_config, plan_help

from .devices import device_from
from .plan import Plan, plan, with_vocabulary
from .sweep import sweep

__all__ = ["main", "table"]

GB = 1e9


def _fits(p: Plan) -> str:
    return "fits" if p.fits else "DOES NOT FIT"


def table(p: Plan) -> str:
    """The plan as an aligned text table."""
    lay = p.layout()
    rows = [
        ("layout", ", ".join(f"{k} {v}" for k, v in lay.items())),
        ("device", f"{p.device.name}: {p.device.peak_tflops:g} TFLOP/s bf16, {p.device.hbm_gb:g} GB"),
        ("params / rank", f"{p.state.params / 1e9:.3f} B"),
        ("weights", f"{p.state.weights / GB:.2f} GB"),
        ("gradients", f"{p.state.grads / GB:.2f} GB"),
        ("optimizer state", f"{p.state.optimizer / GB:.2f} GB"),
        *((f"activations: {k}", f"{v / GB:.2f} GB") for k, v in p.activations.items()),
        ("total / rank", f"{p.total / GB:.2f} GB of {p.device.hbm_gb:g} -> {_fits(p)}"),
        ("step FLOPs", f"{p.step.flops:.4g}"),
        ("compute", f"{p.step.compute_s:.3f} s"),
        ("pipeline bubble", f"{p.step.bubble_s:.3f} s"),
        *((f"comm {k}", f"{p.step.comm_bytes[k] / GB:.3f} GB, {p.step.comm_s[k]:.3f} s "
           f"({p.step.exposed_s[k]:.3f} s exposed)") for k in p.step.comm_bytes if p.step.comm_bytes[k]),
        ("step time", f"{p.step.step_s:.3f} s, {p.step.tokens_per_s:,.0f} tokens/s"),
        ("MFU", f"{100 * p.step.mfu:.1f}%"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _sweep_table(plans: List[Plan], top: int) -> str:
    head = f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>4} {'recompute':>10} {'mbs':>4} "
    head += f"{'GB/rank':>8} {'step s':>8} {'MFU':>6}"
    lines = [head]
    for p in plans[:top]:
        a = p.layout()
        lines.append(
            f"{a['tp']:>3} {a['pp']:>3} {a['cp']:>3} {a['dp']:>4} {a['recompute']:>10} {a['micro_batch']:>4} "
            f"{p.total / GB:>8.1f} {p.step.step_s:>8.3f} {100 * p.step.mfu:>5.1f}%"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(plan_help() + "\nEvery other flag is a training flag (megadlms-pretrain --help).")
        return 0
    try:
        options, config, training_argv = parse_plan_config(argv)
        device = device_from(options.device, options.device_fields)
    except ValueError as e:
        print(f"megadlms-plan: {e}", file=sys.stderr)
        return 2
    if options.sweep:
        plans = sweep(training_argv, options.world_size, device, config.model.num_layers)
        if options.json:
            print(json.dumps([p.to_dict() for p in plans[: options.top]], indent=1))
        else:
            print(f"{len(plans)} layouts fit on {options.world_size} x {device.name}; fastest first:")
            print(_sweep_table(plans, options.top))
        return 0
    p = plan(with_vocabulary(config), device)
    print(json.dumps(p.to_dict(), indent=1) if options.json else table(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
