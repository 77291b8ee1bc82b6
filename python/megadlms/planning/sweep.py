"""``--sweep``: the layouts of one command that fit, fastest first.

Each candidate is the user's own training flags with the layout flags replaced, parsed by
``config.parse_config`` like any command (a layout the rules refuse is skipped, not guessed).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence

from megadlms.common.enums import RecomputeGranularity
from megadlms.config import parse_config

from .devices import Device
from .plan import Plan, plan, with_vocabulary

__all__ = ["sweep", "with_flags"]

# flags the sweep sets (value None: a switch), and every spelling it removes first
_LAYOUT_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activations",
    "--micro-batch-size", "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage",
    "--virtual-pipeline-model-parallel-size",
)  # fmt: skip
_SWITCHES = {"--recompute-activations", "--sequence-parallel"}


def with_flags(argv: Sequence[str], flags: Dict[str, Optional[str]]) -> List[str]:
    """``argv`` without any of the sweep's layout flags, then ``flags`` appended."""
    out: List[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in _LAYOUT_FLAGS:
            skip = "=" not in tok and name not in _SWITCHES
            continue
        out.append(tok)
    for flag, value in flags.items():
        out += [flag] if value is None else [flag, value]
    return out


def _candidates(world: int, num_layers: int, per_node: int):
    tps = [t for t in (1, 2, 4, 8) if t <= per_node and world % t == 0]
    pps = [p for p in (1, 2, 4, 8) if num_layers % p == 0 and world % p == 0]
    for tp, pp, cp, rc, mbs in itertools.product(tps, pps, (1, 2), ("none", "selective", "full"), (1, 2, 4)):
        flags: Dict[str, Optional[str]] = {
            "--tensor-model-parallel-size": str(tp), "--pipeline-model-parallel-size": str(pp),
            "--context-parallel-size": str(cp), "--micro-batch-size": str(mbs),
        }  # fmt: skip
        if rc != "none":  # no flag: no recomputation
            flags["--recompute-granularity"] = rc
        if rc == RecomputeGranularity.FULL:
            flags.update({"--recompute-method": "uniform", "--recompute-num-layers": "1"})
        if tp > 1:
            flags["--sequence-parallel"] = None
        yield flags


def sweep(argv: Sequence[str], world: int, device: Device, num_layers: int) -> List[Plan]:
    """Every candidate layout that the config rules accept and that fits, fastest first."""
    plans = []
    for flags in _candidates(world, num_layers, device.gpus_per_node):
        try:
            config = with_vocabulary(parse_config(with_flags(argv, flags), world_size=world))
        except ValueError:
            continue  # the rules refuse this layout (sizes, batch, cp with MoE, ...)
        p = plan(config, device)
        if p.fits:
            plans.append(p)
    return sorted(plans, key=lambda p: p.step.step_s)
